"""Pairwise-exchange alltoall.

Thakur, Rabenseifner & Gropp, IJHPCA 19(1), 2005, §4.6: in step ``k = 1 .. n-1``
rank r sends its block for ``(r + k) % n`` and receives from ``(r - k) % n``, so
each step is one ``sendrecv`` and no rank is flooded.
"""
from __future__ import annotations

import numpy as np

from ._common import TAGS, waitall

__all__ = ["alltoall_pairwise"]


def alltoall_pairwise(transport, sendbuf: np.ndarray, recvbuf: np.ndarray, *, timeout: float | None = None) -> None:
    """``MPI_Alltoall`` by pairwise exchange.

    Args:
        transport: the point-to-point transport (n ranks).
        sendbuf: 1-D contiguous host array of ``n * count`` elements; block ``i``
            goes to rank ``i``.
        recvbuf: 1-D contiguous host array of ``n * count`` elements, same dtype,
            not overlapping ``sendbuf``; block ``i`` receives rank ``i``'s block ``rank``.
        timeout: seconds per step (None: unbounded).
    """
    n, r = transport.size, transport.rank
    count = sendbuf.size // n
    recvbuf[r * count:(r + 1) * count] = sendbuf[r * count:(r + 1) * count]
    tag = TAGS["a2a"]
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        rq = transport.irecv(recvbuf[src * count:(src + 1) * count], src, tag)
        sq = transport.isend(sendbuf[dst * count:(dst + 1) * count], dst, tag)
        waitall(transport, [rq, sq], timeout)
