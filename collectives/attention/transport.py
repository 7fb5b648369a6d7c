"""The transport attention's messages run on.

Attention runs on the communicator's collectives transport
(``comm.collective_transport()``, the duplicate commlib reserves for its own
traffic), never on the one the user sends on.  Every call takes its tags from
that transport's allocator (:mod:`commlib.core.tags`) as it starts (Ulysses:
each of its all-to-alls), and every rank calls the attention functions in the
same order, so the ranks agree on the tags.
"""
from __future__ import annotations

from commlib.core.seconds import Deadline, time_left, wait_bound_ok
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
        self._p2p.waitall(requests, time_left(timeout))


def transport_of(comm, timeout=None, op: str = "attention") -> Transport:
    """The transport attention's messages run on.

    Args:
        comm: a :class:`commlib.Communicator` (its collectives transport, or
            its transport where it has none), a
            :class:`~commlib.transports.base.Transport` (itself), or any object
            with ``rank``, ``size``, ``isend``, ``irecv`` and ``waitall``.
        timeout: the call's ``timeout`` (seconds, or its
            :class:`~commlib.core.seconds.Deadline`): when it is a valid bound and
            the communicator's collectives transport is not made yet, making it
            (a duplicate: collective over the group) waits at most that long,
            so a first call made on one rank alone raises instead of waiting
            for ever.  Anything else: the call's own validation judges it later.
        op: the operation, for errors.

    Raises:
        CommTimeout: the duplicate was not made within ``timeout`` (the peers
            did not call); it stays posted and the next call completes it.
    """
    if isinstance(comm, Transport):
        return comm
    get = getattr(comm, "collective_transport", None)
    if get is not None:
        if type(timeout) is Deadline:
            timeout = max(timeout.left(), 1e-3)
        if timeout is not None and wait_bound_ok(timeout) and timeout > 0 and getattr(comm, "bounded_first_use",
                                                                                      False):
            return get(op, timeout=timeout)
        return get()
    t = getattr(comm, "transport", None)
    if t is not None:
        return t
    return _PointToPoint(comm)
