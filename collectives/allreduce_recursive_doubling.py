"""Recursive-doubling allreduce, for small vectors.

Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1):49-66, 2005, §4.4.  ``log2(p')`` steps of a
full-vector exchange with partner ``r XOR 2^k``, where ``p'`` is the largest power
of two <= n.  With ``rem = n - p'`` extra ranks, ranks ``2i`` and ``2i + 1`` for
``i < rem`` first combine into rank ``2i + 1``, and rank ``2i`` receives the result
at the end.

Reduction order: a fixed binary tree over the (combined) ranks; at each node
the lower-rank partial is the left operand, so both partners compute the same
bits and every rank ends bit-identical.
"""
from __future__ import annotations

import numpy as np

from commlib.core.seconds import deadline_of

from ._common import next_tag, waitall
from .ops import get_op

__all__ = ["allreduce_recursive_doubling", "combine_pair"]


def combine_pair(op, out: np.ndarray, mine: np.ndarray, other: np.ndarray, other_is_lower: bool) -> None:
    """``out <- lower (op) higher``: the lower rank's partial is always the left
    operand, so both partners compute the same bits (NaN payloads and signed
    zeros included)."""
    if other_is_lower:
        op.ufunc(other, mine, out=out)
    else:
        op.ufunc(mine, other, out=out)


def allreduce_recursive_doubling(transport, buf: np.ndarray, op="sum", *, sendbuf: np.ndarray | None = None,
                                 timeout: float | None = None, tmp: np.ndarray | None = None) -> None:
    """Allreduce ``buf`` in place by recursive doubling.

    Args:
        transport: a :class:`commlib.transports.base.Transport` (n ranks).
        buf: 1-D contiguous host array, same count and dtype on every rank;
            on return holds the reduction over all ranks.
        op: operator name or :class:`~.ops.Op`.
        sendbuf: input when not ``buf`` (not modified; read in place by the first
            step, so ``buf`` is written only by the first combine: a caller that
            keeps ``sendbuf`` untouched until the result is committed needs no
            snapshot to restore it).  A ``sendbuf`` overlapping ``buf`` is copied
            into it first.
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.
        tmp: scratch for the received vectors, ``buf.dtype``, at least
            ``buf.size`` elements (a caller that keeps one saves allocating and
            page-faulting a buffer as large as ``buf`` on every call).  None:
            allocated.

    Raises:
        CommTimeout: the call did not complete within ``timeout``.
        ProcessFailed / CommError: from the transport (classified), when a peer fails.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    op = get_op(op)
    n, r = transport.size, transport.rank
    cur = buf  # this rank's partial: its input until the first combine writes buf
    if sendbuf is not None and sendbuf is not buf:
        if np.may_share_memory(sendbuf, buf):
            buf[...] = sendbuf
        else:
            cur = sendbuf
    if n == 1:
        if cur is not buf:
            buf[...] = cur
        op.finalize(buf, 1)
        return
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    tmp = tmp[:buf.size] if tmp is not None and tmp.size >= buf.size else np.empty_like(buf)
    tag = next_tag(transport, 3)  # fold-in, doubling steps, fold-out
    # fold the extra ranks in
    if r < 2 * rem:
        if r % 2 == 0:
            waitall(transport, [transport.isend(cur, r + 1, tag)], timeout)
            newrank = -1
        else:
            waitall(transport, [transport.irecv(tmp, r - 1, tag)], timeout)
            combine_pair(op, buf, cur, tmp, True)
            cur = buf
            newrank = r // 2
    else:
        newrank = r - rem
    if newrank >= 0:
        mask = 1
        while mask < p2:
            newpeer = newrank ^ mask
            peer = newpeer * 2 + 1 if newpeer < rem else newpeer + rem
            rq = transport.irecv(tmp, peer, tag + 1)
            sq = transport.isend(cur, peer, tag + 1)
            waitall(transport, [rq, sq], timeout)
            combine_pair(op, buf, cur, tmp, peer < r)
            cur = buf
            mask <<= 1
        op.finalize(buf, n)
    if r < 2 * rem:
        if r % 2:
            waitall(transport, [transport.isend(buf, r - 1, tag + 2)], timeout)
        else:
            waitall(transport, [transport.irecv(buf, r + 1, tag + 2)], timeout)
