"""The transport attention's messages run on.

Attention runs on the communicator's collectives transport
(``comm.collective_transport()``, the duplicate commlib reserves for its own
traffic), never on the one the user sends on.  Every call takes its tags from
that transport's allocator (:mod:`commlib.core.tags`) as it starts (Ulysses:
each of its all-to-alls), and every rank calls the attention functions in the
same order, so the ranks agree on the tags.
"""
from __future__ import annotations

from commlib.transports.base import Transport

__all__ = ["transport_of"]


class _PointToPoint(Transport):
    """The transport contract over an object that has only ``rank``, ``size``,
    ``isend``, ``irecv`` and ``waitall(requests, timeout)`` (a wrapper that logs
    or injects faults around a communicator): no native collectives, and a tag
    allocator of its own."""

    name = "point-to-point"

    def __init__(self, p2p):
        self._p2p = p2p
        super().__init__()

    @property
    def rank(self) -> int:
        return self._p2p.rank

    @property
    def size(self) -> int:
        return self._p2p.size

    def isend(self, buf, dest: int, tag: int = 0):
        return self._p2p.isend(buf, dest, tag)

    def irecv(self, buf, source: int, tag: int = 0):
        return self._p2p.irecv(buf, source, tag)

    def waitall(self, requests, timeout: float | None = None, op: str = "waitall") -> None:
        self._p2p.waitall(requests, timeout)


def transport_of(comm) -> Transport:
    """The transport attention's messages run on.

    Args:
        comm: a :class:`commlib.Communicator` (its collectives transport, or
            its transport where it has none), a
            :class:`~commlib.transports.base.Transport` (itself), or any object
            with ``rank``, ``size``, ``isend``, ``irecv`` and ``waitall``.
    """
    if isinstance(comm, Transport):
        return comm
    get = getattr(comm, "collective_transport", None)
    if get is not None:
        return get()
    t = getattr(comm, "transport", None)
    if t is not None:
        return t
    return _PointToPoint(comm)
