"""Pairwise-exchange alltoall.

Thakur, Rabenseifner & Gropp, IJHPCA 19(1), 2005, §4.6: in step ``k = 1 .. n-1``
rank r sends its block for ``(r + k) % n`` and receives from ``(r - k) % n``, so
each step is one ``sendrecv`` and no rank is flooded.
"""
from __future__ import annotations

import numpy as np

from commlib.core.seconds import deadline_of

from ._common import next_tag, waitall

__all__ = ["alltoall_pairwise", "alltoall_pairwise_parts"]


def alltoall_pairwise_parts(transport, sendparts, recvparts, *, timeout: float | None = None) -> None:
    """Pairwise-exchange all-to-all over separate per-rank arrays.

    Args:
        transport: anything with ``rank``, ``size``, ``isend``, ``irecv`` and
            ``waitall`` (a transport, or a :class:`commlib.Communicator`).
        sendparts: ``n`` contiguous arrays; ``sendparts[i]`` goes to rank ``i``.
        recvparts: ``n`` contiguous arrays (host or device, same kind as the
            sends); ``recvparts[i]`` receives rank ``i``'s part for this rank,
            ``recvparts[rank]`` gets a copy of ``sendparts[rank]``.
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = transport.size, transport.rank
    recvparts[r][...] = sendparts[r]
    tag = next_tag(transport)
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        rq = transport.irecv(recvparts[src], src, tag)
        sq = transport.isend(sendparts[dst], dst, tag)
        waitall(transport, [rq, sq], timeout)


def alltoall_pairwise(transport, sendbuf: np.ndarray, recvbuf: np.ndarray, *, timeout: float | None = None) -> None:
    """``MPI_Alltoall`` by pairwise exchange.

    Args:
        transport: the point-to-point transport (n ranks).
        sendbuf: 1-D contiguous host array of ``n * count`` elements; block ``i``
            goes to rank ``i``.
        recvbuf: 1-D contiguous host array of ``n * count`` elements, same dtype,
            not overlapping ``sendbuf``; block ``i`` receives rank ``i``'s block ``rank``.
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n = transport.size
    count = sendbuf.size // n
    alltoall_pairwise_parts(transport, [sendbuf[i * count:(i + 1) * count] for i in range(n)],
                            [recvbuf[i * count:(i + 1) * count] for i in range(n)], timeout=timeout)
