"""Helpers shared by the collective algorithms (chunking, steps, bounded waits, tags)."""
from __future__ import annotations

import numpy as np

from commlib.core.errors import CommError, CommTimeout
from commlib.core.seconds import Deadline

__all__ = ["chunk_bounds", "chunk_bounds_list", "waitall", "exchange", "next_tag"]


def next_tag(transport, width: int = 1) -> int:
    """The first of ``width`` fresh tags for one algorithm call, from the
    transport's allocator (:mod:`commlib.core.tags`; gloo's ``nextSlot``), so
    consecutive operations on one communicator never match each other's
    messages.

    Raises:
        CommError: ``transport`` has no allocator (``tags``).  Every
            :class:`~commlib.transports.base.Transport` makes one; a stand-in
            must carry one too (e.g. the transport it wraps), since a fixed tag
            would let two operations' messages match each other.
    """
    tags = getattr(transport, "tags", None)
    if tags is None:
        raise CommError(f"{type(transport).__name__} has no tag allocator (.tags): a collective needs fresh tags "
                        "per call; pass a commlib Transport, or give the stand-in its inner transport's .tags",
                        rank=getattr(transport, "rank", None), op="next_tag")
    return tags.slot(width)


def chunk_bounds(count: int, parts: int) -> np.ndarray:
    """Offsets of ``parts`` nearly equal chunks of ``count`` elements.

    The first ``count % parts`` chunks hold one element more (as
    ``numpy.array_split``).  Chunk ``i`` is ``[b[i], b[i+1])``.

    Returns:
        np.ndarray: int64, shape ``(parts + 1,)``.
    """
    base, extra = divmod(count, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    b = np.zeros(parts + 1, dtype=np.int64)
    np.cumsum(sizes, out=b[1:])
    return b


def chunk_bounds_list(count: int, parts: int) -> list[int]:
    """:func:`chunk_bounds` as a list of Python ints (cheaper to slice with in
    an algorithm's per-step loop)."""
    base, extra = divmod(count, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def exchange(transport, sendbuf, dest: int, recvbuf, source: int, tag: int, timeout, overlap=None) -> None:
    """One algorithm step: send ``sendbuf`` to ``dest`` while receiving
    ``recvbuf`` from ``source`` (same ``tag``).

    Unbounded (``timeout=None``) and with nothing to overlap, this is the
    transport's ``sendrecv``: for the MPI transport one call, the least Python
    on the step's critical path (every microsecond there is paid once per rank
    around a ring).  Otherwise the receive and the send are posted,
    ``overlap()`` runs while they are in flight (e.g. a fault-tolerant
    snapshot), and the step waits at most what is left of ``timeout`` (a
    :class:`~commlib.core.seconds.Deadline`: the whole call's; a number: seconds for this step).

    Raises:
        CommTimeout: the step did not complete within ``timeout``.
        ProcessFailed / CommError: from the transport (classified), when a peer fails.
    """
    if timeout is None and overlap is None:
        transport.sendrecv(sendbuf, dest, recvbuf, source, tag, tag)
        return
    rq = transport.irecv(recvbuf, source, tag)
    sq = transport.isend(sendbuf, dest, tag)
    if overlap is not None:
        overlap()
    waitall(transport, [rq, sq], timeout)


def waitall(transport, requests, timeout) -> None:
    """Wait for one step's requests through the transport, bounded when
    ``timeout`` is not None (a :class:`~commlib.core.seconds.Deadline`: the time
    left of the whole call; a number: seconds for this wait)."""
    if type(timeout) is Deadline:
        try:
            _waitall(transport, requests, timeout.left())
        except CommTimeout as exc:
            raise CommTimeout(f"not complete within its timeout of {timeout.timeout:g} s (the deadline of the whole "
                              f"call; {exc.detail})", rank=exc.rank, op=timeout.op or exc.op) from exc
        return
    _waitall(transport, requests, timeout)


def _waitall(transport, requests, timeout) -> None:
    w = getattr(transport, "waitall", None)
    if w is not None:
        w(requests, timeout)
    else:  # pragma: no cover - every Transport has waitall
        for r in requests:
            r.wait(timeout)
