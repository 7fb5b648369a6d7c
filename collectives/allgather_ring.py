"""Ring allgather (the second half of the ring allreduce).

Patarasuk & Yuan, J. Parallel Distrib. Comput. 69(2), 2009; also Thakur,
Rabenseifner & Gropp, "Optimization of collective communication operations in
MPICH", IJHPCA 19(1), 2005, §4.1.  In ``n - 1`` steps each rank forwards to
``(r + 1) % n`` the block it received in the previous step.
"""
from __future__ import annotations

import numpy as np

from commlib.core.seconds import deadline_of

from ._common import next_tag, exchange

__all__ = ["allgather_ring", "allgather_ring_inplace"]


def allgather_ring_inplace(transport, work: np.ndarray, bounds, owner_shift: int = 0, *,
                           timeout: float | None = None) -> None:
    """Circulate the chunks of ``work`` so that every rank ends with all of them.

    Args:
        transport: the point-to-point transport.
        work: 1-D contiguous host array; on entry chunk ``(r + owner_shift) % n``
            is valid on rank r; on return every chunk is.
        bounds: chunk offsets, ``n + 1`` ints (a list or tuple of Python
            ints is used as is).
        owner_shift: which chunk rank r starts with (0: chunk r).
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = transport.size, transport.rank
    if type(bounds) is not list and type(bounds) is not tuple:
        bounds = [int(x) for x in bounds]
    right, left = (r + 1) % n, (r - 1) % n
    tag = next_tag(transport)
    if timeout is None:  # exchange()'s unbounded step, without its call per step
        sendrecv = transport.sendrecv
        for s in range(n - 1):
            sc = (r + owner_shift - s) % n
            rc = (sc - 1) % n
            sendrecv(work[bounds[sc]:bounds[sc + 1]], right, work[bounds[rc]:bounds[rc + 1]], left, tag, tag)
        return
    for s in range(n - 1):
        sc = (r + owner_shift - s) % n
        rc = (sc - 1) % n
        exchange(transport, work[bounds[sc]:bounds[sc + 1]], right, work[bounds[rc]:bounds[rc + 1]], left, tag,
                 timeout)


def allgather_ring(transport, sendbuf: np.ndarray, recvbuf: np.ndarray, *, timeout: float | None = None) -> None:
    """``MPI_Allgather`` by the ring algorithm.

    Args:
        transport: the point-to-point transport (n ranks).
        sendbuf: 1-D contiguous host array of ``count`` elements.
        recvbuf: 1-D contiguous host array of ``n * count`` elements, same dtype;
            block ``i`` receives rank ``i``'s ``sendbuf``.
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = transport.size, transport.rank
    count = sendbuf.size
    bounds = np.arange(n + 1, dtype=np.int64) * count
    recvbuf[bounds[r]:bounds[r + 1]] = sendbuf
    allgather_ring_inplace(transport, recvbuf, bounds, timeout=timeout)
