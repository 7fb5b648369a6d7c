"""Dissemination barrier.

Hensgen, Finkel & Manber, "Two algorithms for barrier synchronization", IJPP
17(1), 1988 (used by MPICH, Thakur et al. 2005 §4.7): in round ``k`` rank r
signals ``(r + 2^k) % n`` and waits for ``(r - 2^k) % n``; after ``ceil(log2 n)``
rounds every rank has (transitively) heard from every other.
"""
from __future__ import annotations

import numpy as np

from commlib.core.seconds import deadline_of

from ._common import next_tag, waitall

__all__ = ["barrier_dissemination"]


def barrier_dissemination(transport, *, timeout: float | None = None) -> None:
    """Block until every rank of ``transport`` has entered the barrier.

    Args:
        transport: the point-to-point transport (n ranks).
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            round waits what is left of it.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = transport.size, transport.rank
    out = np.zeros(1, np.uint8)
    inb = np.zeros(1, np.uint8)
    dist = 1
    tag = next_tag(transport)
    while dist < n:
        rq = transport.irecv(inb, (r - dist) % n, tag)
        sq = transport.isend(out, (r + dist) % n, tag)
        waitall(transport, [rq, sq], timeout)
        dist <<= 1
