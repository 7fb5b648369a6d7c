"""Ring allreduce: ring reduce-scatter followed by ring allgather.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2):117-124, 2009.  Each rank
sends ``2 (n - 1) / n`` times the vector, the lower bound for allreduce, which is
why nccl-tests report allreduce *bus bandwidth* as ``algbw * 2 (n - 1) / n``.
Latency is ``2 (n - 1)`` steps, so :mod:`.allreduce_recursive_doubling` wins for
small vectors.

Reduction order is fixed (see :func:`.reduce_scatter_ring.ring_order`) and the
allgather copies the same reduced bits to every rank, so the result is
bit-identical on all ranks.

Each step is one ``transport.sendrecv`` of a whole chunk; out of place the
partial is received straight into the chunk it is reduced into.  Pipelined
segments (NCCL's and Open MPI's segmented ring) do not overlap transfer and
reduction here: over Open MPI's shared-memory transport the receiver copies
each message itself (CMA single copy, inside its own MPI calls), on the same
core, and every segment adds a request and a wait from Python (at 2 and 4 ranks
on 2 cores, 1-16 MiB: 10-50% slower with 64-512 KiB segments).  Only in place,
for chunks above :data:`.reduce_scatter_ring.SEGMENT_BYTES` (4 MiB), does the
reduce-scatter exchange segments, each received into the same cache-sized slice
of the scratch: the partial then never goes out to memory (64-128 MiB at 2
ranks: 8-10% faster).
"""
from __future__ import annotations

import functools

import numpy as np

from commlib.core.buffer import grown
from commlib.core.seconds import deadline_of

from ._common import chunk_bounds_list, exchange, next_tag
from .allgather_ring import allgather_ring_inplace
from .one_round import apply_steps, ring_order_steps
from .ops import get_op
from .reduce_scatter_ring import reduce_scatter_ring_inplace

__all__ = ["allreduce_ring", "ring_scratch"]


def allreduce_ring(transport, buf: np.ndarray, op="sum", *, sendbuf: np.ndarray | None = None,
                   timeout: float | None = None, save=None, tmp: np.ndarray | None = None,
                   head=None) -> None:
    """Allreduce ``buf`` in place by the ring algorithm.

    Args:
        transport: a :class:`commlib.transports.base.Transport` (n ranks).
        buf: 1-D contiguous host array, ``count`` elements of any dtype ``op``
            supports (see :mod:`.ops`); same count and dtype on every rank.
            On return it holds the reduction over all ranks.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``, ``"band"``,
            ``"bor"``, ``"bxor"`` or an :class:`~.ops.Op`.
        sendbuf: this rank's input when it is not ``buf`` (out of place: same
            count and dtype, not modified; nothing is copied up front).
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); each of
            the ``2 (n - 1)`` steps waits what is left of it.
        save: a :class:`.snapshot.LazySnapshot` of ``buf`` (in place only): every
            chunk is saved before it is first overwritten, overlapped with the
            reduce-scatter's transfers, so a fault-tolerant retry can restore
            the input without a memcpy up front.
        tmp: scratch for the partials received in place, ``buf.dtype``, at least
            ``ceil(count / n) + 1`` elements; a caller that keeps one saves
            allocating (and page-faulting) half the buffer on every call at 2
            ranks.  Unused out of place.  None: allocated when needed.
        head: a :class:`.agreement.RingHead`: the first step carries the argument
            agreement (:func:`.reduce_scatter_ring.reduce_scatter_ring_inplace`).

    Raises:
        CommTimeout: the call did not complete within ``timeout``.
        ProcessFailed / CommError: from the transport (classified), when a peer fails.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    op = get_op(op)
    n = transport.size
    if n == 1:  # nothing is overwritten: no save needed
        if sendbuf is not None:
            buf[...] = sendbuf
        op.finalize(buf, 1)
        return
    if n == 2 and head is None and save is None and 0 < buf.nbytes <= PAIR_BYTES:
        _pair(transport, buf, op, timeout, sendbuf, tmp)
        return
    bounds = _bounds(buf.size, n)
    reduce_scatter_ring_inplace(transport, buf, op, bounds, timeout=timeout, src=sendbuf, tmp=tmp,
                                save=save if sendbuf is None else None, head=head)
    r = transport.rank
    if op.mean:
        op.finalize(buf[bounds[r]:bounds[r + 1]], n)
    allgather_ring_inplace(transport, buf, bounds, timeout=timeout)


#: at 2 ranks, vectors up to this many bytes take one exchange (:func:`_pair`)
#: instead of the ring's two steps: a 32 KiB allreduce at 2 ranks, 17.7 us as
#: two steps, is latency-bound (one 32 KiB MPI_Sendrecv: 5.6 us, a 16 KiB one:
#: 4.9 us); above, the ring reduces half the vector per rank where the pair
#: exchange reduces all of it (benchmarks/bench_small.py, bench_allreduce.py)
PAIR_BYTES = 256 * 1024


def _pair(transport, buf: np.ndarray, op, timeout, sendbuf: np.ndarray | None, tmp: np.ndarray | None) -> None:
    """The ring at 2 ranks in one step: each rank sends its whole vector and
    receives the other's (the same bytes each way as the ring's two steps:
    ``count`` elements), then combines both in the ring's order
    (:func:`~.one_round.ring_order_steps`: chunk 0 as ``x1 op x0``, chunk 1 as
    ``x0 op x1``), so every rank holds the ring's bits."""
    mine = buf if sendbuf is None else sendbuf
    theirs = tmp[:buf.size] if tmp is not None and tmp.size >= buf.size else np.empty_like(buf)
    other = 1 - transport.rank
    exchange(transport, mine, other, theirs, other, next_tag(transport), timeout)
    parts = [mine, theirs] if transport.rank == 0 else [theirs, mine]
    apply_steps(ring_order_steps(parts, buf.size, op), op.ufunc, buf)
    op.finalize(buf, 2)


def ring_scratch(keep: np.ndarray | None, work: np.ndarray, n: int):
    """``(keep, tmp)``: the ``tmp`` argument of :func:`allreduce_ring` in place
    over ``n`` ranks for ``work`` (``ceil(count / n) + 1`` elements of its
    dtype), a view of the caller's kept uint8 buffer ``keep``
    (:func:`commlib.core.buffer.grown`: replaced when too small)."""
    need = ((work.size if n == 2 and work.nbytes <= PAIR_BYTES else -(-work.size // n)) + 1) * work.dtype.itemsize
    keep = grown(keep, need)
    return keep, keep[:need].view(work.dtype)


@functools.lru_cache(maxsize=64)
def _bounds(count: int, n: int) -> tuple:
    """:func:`chunk_bounds_list` as a tuple, kept per (count, n): the ring
    calls of one size in a training loop share it."""
    return tuple(chunk_bounds_list(count, n))
