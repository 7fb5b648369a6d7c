"""Bruck's allgather: ``ceil(log2 n)`` steps, for short blocks.

Bruck, Ho, Kipnis, Upfal & Weathersby, "Efficient algorithms for all-to-all
communications in multiport message-passing systems", IEEE TPDS 8(11), 1997;
Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), 2005, §4.1 (MPICH's allgather for short
messages on any number of ranks).

At step ``k = 1, 2, 4, ...`` rank ``r`` sends the first ``min(k, n - have)``
blocks it holds (its own and those of ranks ``r + 1, ..., r + have - 1``) to
``r - k`` and receives as many from ``r + k``; after ``ceil(log2 n)`` steps it
holds every rank's block, in the order ``r, r + 1, ...``, and rotates them into
place.  Each rank sends ``n - 1`` blocks in all, as in the ring, in
``ceil(log2 n)`` messages instead of ``n - 1``: the latency term falls from
``(n - 1) a`` to ``ceil(log2 n) a``, which is what a row of a few hundred
bytes costs (the argument agreement, :mod:`commlib.collectives.agreement`).
"""
from __future__ import annotations

import numpy as np

from commlib.core.seconds import deadline_of

from ._common import exchange, next_tag

__all__ = ["allgather_bruck", "bruck_steps"]


def bruck_steps(n: int):
    """The schedule of Bruck's all-gather on ``n`` ranks.

    Yields:
        ``(k, m, have)`` per step (``ceil(log2 n)`` of them): the distance ``k``
        (1, 2, 4, ...) to the step's partners, the ``m = min(k, n - have)``
        blocks that move each way, and the ``have`` blocks a rank held before it.
    """
    have, k = 1, 1
    while have < n:
        m = min(k, n - have)
        yield k, m, have
        have += m
        k *= 2


def allgather_bruck(transport, sendbuf: np.ndarray, recvbuf: np.ndarray, *, timeout: float | None = None) -> None:
    """``MPI_Allgather`` by Bruck's algorithm.

    Args:
        transport: the point-to-point transport (n ranks).
        sendbuf: 1-D contiguous host array of ``count`` elements.
        recvbuf: 1-D contiguous host array of ``n * count`` elements, same dtype;
            block ``i`` receives rank ``i``'s ``sendbuf``.
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.

    Raises:
        CommTimeout / ProcessFailed / CommError: from the transport.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = transport.size, transport.rank
    count = sendbuf.size
    work = np.empty(n * count, sendbuf.dtype)  # block i: rank (r + i) % n's
    work[:count] = sendbuf
    tag = next_tag(transport)
    for k, m, have in bruck_steps(n):
        exchange(transport, work[:m * count], (r - k) % n, work[have * count:(have + m) * count], (r + k) % n, tag,
                 timeout)
    # work block i holds rank (r + i) % n's: rotate into rank order
    head = (n - r) * count
    recvbuf[r * count:] = work[:head]
    recvbuf[:r * count] = work[head:n * count]
