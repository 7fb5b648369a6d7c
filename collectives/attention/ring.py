"""Ring attention: exact attention over a sequence sharded across the ranks.

Each rank keeps its queries; the K/V shards travel around the ring (rank
``r`` sends to ``r + 1`` and receives from ``r - 1``).  At step ``s`` rank ``r``
holds the K/V shard of rank ``(r - s) mod P`` and folds it into its
online-softmax state; after ``P`` steps it has seen every key.  Double
buffering: the next shard's ``isend``/``irecv`` are posted *before* the current
shard is computed, so communication hides behind the block math.

The backward keeps the queries, ``dout`` and the global ``lse`` in place and
sends K/V around the ring again; each block's ``dk``/``dv`` accumulator travels
with it (in the accumulation dtype) and, after ``P`` hops, arrives back at the
block's owner.  The K/V exchange of the next step is posted before the
current block's gradients are computed, and the incoming ``dk``/``dv`` is
received while the local contribution is computed.

Who holds which shard at each step, and the ring neighbours, come from
:class:`.schedule.RingSchedule` (the same schedule the torch ring uses).

Papers: Ring Attention (Liu, Zaharia, Abbeel 2023, arXiv:2310.01889); Striped
Attention (Brandon et al. 2023, arXiv:2311.09431); the zigzag layout of
ring-flash-attention (github.com/zhuzilin/ring-flash-attention).  Unlike the
latter, partial results are merged in float32 or float64, never in the input
half-precision dtype.
"""
from __future__ import annotations

import time

import numpy as np

from commlib.core.seconds import call_deadline

from .blocks import (ForwardAccumulator, backward_block, backward_operands, forward_block, from_heads_major, tile_plan,
                     to_heads_major)
from .common import as_array_api, comm_last, in_format, validate
from .layout import layout_of
from .ringcomm import RingComm
from .schedule import RingSchedule
from .transport import transport_of
from .window import window_attention, window_attention_backward

__all__ = ["ring_attention", "ring_attention_backward", "ring_plan_work"]

# Tags: each call takes a block of RingComm.WIDTH from its transport's allocator
# (the K/V and the travelling dk/dv of each stream; the halo exchange of a
# windowed call uses the same block).
_TAG_WIDTH, _TAG_KV, _TAG_DKV = RingComm.WIDTH, RingComm.KV, RingComm.DKV


def _heads_major_kv(k, v, spec):
    """K and V packed into one contiguous ``(2, B, Hkv, L, D)`` buffer in the
    input dtype: one message per ring step."""
    xp = spec.xp
    kv = xp.empty((2, spec.batch, spec.kv_heads, spec.seq_local, spec.head_dim), dtype=spec.array_dtype)
    kv[0] = k.transpose(0, 2, 1, 3)
    kv[1] = v.transpose(0, 2, 1, 3)
    return kv


def ring_plan_work(size: int, seq_len: int, seq_local: int, layout: str, causal: bool, tile: int = 128):
    """Score entries (per batch and head) each rank computes at each ring step,
    from the tile plans alone (no data, no communication).

    Returns:
        numpy.ndarray: int64 ``(size, size)``: ``[rank, step]``.  The critical
        path of a ring is ``work.max(axis=0).sum()`` (every step waits for its
        slowest rank); the balance is that over ``work.sum() / size``.
    """
    work = np.zeros((size, size), dtype=np.int64)
    pos = layout_of(layout, op="ring_plan_work").all_positions(size, seq_local)
    for r in range(size):
        for st in RingSchedule(size, r).steps():
            work[r, st.step] = tile_plan(pos[r], pos[st.owners[0]], seq_len, causal, tile).work
    return work


def _new_stats(stats, kind):
    if stats is None:
        return None
    stats.clear()
    stats.update(kind=kind, steps=[], total_s=0.0)
    return stats


def ring_attention(q, k, v, comm=None, causal: bool = False, layout: str = "contiguous", softmax_scale=None, *,
                   seq_len: int | None = None, tile: int = 128, timeout: float | None = None, stats: dict | None = None,
                   window=None, qkv_format: str = "bshd"):
    """Exact attention over a sequence sharded across ``comm``'s ranks.

    The communicator comes after the arrays, as in :mod:`commlib.nn`; the
    old order ``ring_attention(comm, q, k, v, ...)`` still works and warns
    (``DeprecationWarning``).

    Args:
        q: local queries ``(batch, seq_local, heads, head_dim)``; numpy or CuPy;
            float16, bfloat16 (ml_dtypes), float32 or float64.  (torch
            tensors: :func:`commlib.nn.ring_attention`.)
        k: local keys ``(batch, seq_local, kv_heads, head_dim)``, same dtype;
            ``heads % kv_heads == 0`` (grouped-query attention: K/V travel
            unreplicated).
        v: local values, shaped like ``k``.
        comm: :class:`commlib.Communicator`; the messages go over its
            collectives transport (see :func:`.transport.transport_of`), with
            tags of their own.
        causal: mask key positions after the query's position.
        layout: ``"contiguous"``, ``"striped"`` or ``"zigzag"``: how the global
            sequence is spread over the ranks (:mod:`.layout`).
        softmax_scale: default ``head_dim ** -0.5``.
        seq_len: true global length when the shards were padded by
            :func:`shard_sequence` (default ``size * seq_local``).  Padded keys
            are masked and padded query rows give 0.
        tile: query rows per tile; fully masked tiles are skipped.
        timeout: the deadline of the whole call, in seconds (finite, > 0;
            None: forever): the argument agreement and every ring step wait
            what is left of it.
        stats: optional dict, filled with per-step ``source``, ``work``
            (score entries computed), ``visible`` (unmasked pairs),
            ``compute_s`` and ``wait_s``, and ``total_s`` (with a window:
            ``work``, ``recv_bytes``, ``sent_bytes`` and ``total_s``).
        qkv_format: ``"bshd"`` (default, the shapes above) or ``"bhsd"``
            (SDPA's ``(batch, heads, seq_local, head_dim)``): the order of q,
            k, v and of ``out`` (and, in the backward, of ``out``, ``dout``,
            dq, dk, dv; lse is ``(batch, heads, seq_local)`` either way).
            The results are views in that order.
        window: optional sliding window ``(left, right)`` (FlashAttention-2's
            ``window_size``, ints >= -1, -1 unbounded; Longformer/Mistral):
            the query at global position ``i`` sees only keys ``j`` with
            ``i - left <= j <= i + right`` (and, with ``causal``, ``j <= i``).
            A window that hides anything replaces the ring by a halo
            exchange (:mod:`.window`): each rank receives only the K/V rows
            inside some local query's window (contiguous layout: about
            ``left`` rows from the previous rank and ``right`` from the next)
            and computes only the tiles the window reaches.

    Returns:
        tuple: ``out`` ``(batch, seq_local, heads, head_dim)`` in the input dtype,
        ``lse`` ``(batch, heads, seq_local)`` in float64 for float64 inputs, else
        float32.  Rows that see no key (padding) give out 0 and lse ``-inf``.

    Raises:
        InvalidArgument: no communicator after the arrays (nor, old order,
            before them); bad shapes, dtypes, layout, ``seq_len``, scale, tile,
            ``window`` (not None nor a pair of ints >= -1)
            or ``timeout`` (not None nor a finite number > 0), on any rank
            (raised on every rank before any K/V message is posted).
        CommTimeout: the call did not complete within ``timeout`` (naming the rank and the operation).
        ProcessFailed: a peer failed (any other transport failure: :class:`~commlib.CommError`).
    """
    op = "ring_attention"
    (q, k, v), comm = comm_last(op, (q, k, v), comm)
    (q, k, v), fmt_problem = in_format(qkv_format, q, k, v)
    timeout = call_deadline(timeout, op)  # the deadline of the whole call: every wait gets what is left
    tp = transport_of(comm, timeout, op)
    tag_kv = tp.tags.slot(_TAG_WIDTH)
    q, k, v = as_array_api(q, k, v)
    spec = validate(tp, q, k, v, causal=causal, layout=layout, softmax_scale=softmax_scale,
                    seq_len=seq_len, tile=tile, op=op, timeout=timeout, window=window, problem=fmt_problem,
                    qkv_format=qkv_format)
    if spec.window is not None:
        res = window_attention(tp, spec, q, k, v, causal=causal, layout=spec.layout, window=spec.window, tile=tile,
                               tag=tag_kv, timeout=timeout, op=op, stats=stats)
        return in_format(qkv_format, *res)[0]
    xp, P, r = spec.xp, tp.size, tp.rank
    st = _new_stats(stats, "forward")
    t_start = time.perf_counter()
    L = spec.seq_local
    nbh = spec.batch * spec.heads
    qpos = spec.layout.positions(r, P, L)
    qh = to_heads_major(q, spec.kv_heads, spec.cdtype, xp)
    qh *= spec.scale
    state = ForwardAccumulator(qh.shape, spec.cdtype, xp)
    cur = _heads_major_kv(k, v, spec)
    nxt = xp.empty_like(cur) if P > 1 else None
    sched = RingSchedule(P, r)
    ring = RingComm(tp, sched, tag_kv, timeout, op)
    for ring_step in sched.steps():
        step, owner = ring_step.step, ring_step.owners[0]
        # double buffering: post the next block before computing this one
        reqs = ring.post_kv([cur], [nxt]) if not ring_step.last else []
        t0 = time.perf_counter()
        kpos = spec.layout.positions(owner, P, L)
        plan = tile_plan(qpos, kpos, spec.seq_len, causal, tile)
        if plan.tiles:
            forward_block(qh, cur[0].astype(spec.cdtype, copy=False), cur[1].astype(spec.cdtype, copy=False),
                          plan, qpos, kpos, state)
        t1 = time.perf_counter()
        ring.wait(reqs)
        t2 = time.perf_counter()
        if st is not None:
            st["steps"].append(dict(step=step, source=owner, work=plan.work * nbh, visible=plan.visible * nbh,
                                    compute_s=t1 - t0, wait_s=t2 - t1))
        if not ring_step.last:
            cur, nxt = nxt, cur
    out, lse = state.finalize()
    out = from_heads_major(out, spec.array_dtype, xp)
    lse = lse.reshape(spec.batch, spec.heads, L)
    if st is not None:
        st["total_s"] = time.perf_counter() - t_start
    return in_format(qkv_format, out, lse)[0]


def ring_attention_backward(q, k, v, out, lse, dout, comm=None, causal: bool = False, layout: str = "contiguous",
                            softmax_scale=None, *, seq_len: int | None = None, tile: int = 128,
                            timeout: float | None = None, stats: dict | None = None, window=None,
                            qkv_format: str = "bshd"):
    """Gradients of :func:`ring_attention`.

    Args:
        q, k, v, comm, causal, layout, softmax_scale, seq_len, tile, timeout, stats, window:
            as in :func:`ring_attention` (the same values as the forward call;
            the old order, ``comm`` first, warns as there).
        out: the forward output ``(batch, seq_local, heads, head_dim)``, input dtype.
        lse: the forward lse ``(batch, heads, seq_local)``, float32 or float64.
        dout: gradient of the loss with respect to ``out``, shaped and typed like ``q``.

    Returns:
        tuple: ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``; ``dk``
        and ``dv`` are summed over each query group.  Accumulation is in float32
        (float64 for float64 inputs), including the ``dk``/``dv`` that travel.

    Raises:
        InvalidArgument: as in :func:`ring_attention`, or ``out``/``lse``/``dout``
            of the wrong shape or dtype.
        CommTimeout: the call did not complete within ``timeout`` (naming the rank and the operation).
        ProcessFailed: a peer failed (any other transport failure: :class:`~commlib.CommError`).
    """
    op = "ring_attention_backward"
    (q, k, v, out, lse, dout), comm = comm_last(op, (q, k, v, out, lse, dout), comm)
    (q, k, v, out, lse, dout), fmt_problem = in_format(qkv_format, q, k, v, out, lse, dout)
    q, k, v, out, lse, dout = as_array_api(q, k, v, out, lse, dout)
    timeout = call_deadline(timeout, op)  # the deadline of the whole call: every wait gets what is left
    tp = transport_of(comm, timeout, op)
    tag0 = tp.tags.slot(_TAG_WIDTH)
    qshape = tuple(q.shape) if hasattr(q, "shape") else None
    qd = np.dtype(q.dtype).name if hasattr(q, "dtype") else None
    extra = {}
    if qshape is not None and len(qshape) == 4:
        extra = {"out": (out, qshape, qd), "dout": (dout, qshape, qd),
                 "lse": (lse, (qshape[0], qshape[2], qshape[1]), None)}
    spec = validate(tp, q, k, v, causal=causal, layout=layout, softmax_scale=softmax_scale,
                    seq_len=seq_len, tile=tile, op=op, extra=extra, timeout=timeout, window=window,
                    problem=fmt_problem, qkv_format=qkv_format)
    if spec.window is not None:
        res = window_attention_backward(tp, spec, q, k, v, out, lse, dout, causal=causal, layout=spec.layout,
                                        window=spec.window, tile=tile, tag=tag0, timeout=timeout, op=op, stats=stats)
        return in_format(qkv_format, *res)[0]
    xp, P, r = spec.xp, tp.size, tp.rank
    st = _new_stats(stats, "backward")
    t_start = time.perf_counter()
    L, hk = spec.seq_local, spec.kv_heads
    nbh = spec.batch * spec.heads
    cdt = spec.cdtype
    qpos = spec.layout.positions(r, P, L)
    qh, doh, dh, lseh, dqh = backward_operands(q, out, lse, dout, hk, spec.scale, cdt, xp)
    dkv_shape = (2, spec.batch, hk, L, spec.head_dim)
    cur = _heads_major_kv(k, v, spec)
    nxt = xp.empty_like(cur) if P > 1 else None
    sched = RingSchedule(P, r)
    ring = RingComm(tp, sched, tag0, timeout, op)
    dkv = None
    for ring_step in sched.steps():
        step, owner = ring_step.step, ring_step.owners[0]
        # post the next K/V block before computing this one
        reqs = ring.post_kv([cur], [nxt]) if not ring_step.last else []
        if P > 1:  # the dk/dv that will arrive for the next step (or, at the last, our own)
            ring.expect_dkv(0, xp.empty(dkv_shape, dtype=cdt))
        t0 = time.perf_counter()
        kpos = spec.layout.positions(owner, P, L)
        plan = tile_plan(qpos, kpos, spec.seq_len, causal, tile)
        dkv = xp.zeros(dkv_shape, dtype=cdt)
        if plan.tiles:
            backward_block(qh, cur[0].astype(cdt, copy=False), cur[1].astype(cdt, copy=False), doh, lseh, dh,
                           plan, qpos, kpos, dqh, dkv[0], dkv[1])
        t1 = time.perf_counter()
        if P > 1:  # add what the previous holders accumulated for this block, pass it on
            ring.pass_dkv(0, dkv)
        ring.wait(reqs)
        t2 = time.perf_counter()
        if st is not None:
            st["steps"].append(dict(step=step, source=owner, work=plan.work * nbh, visible=plan.visible * nbh,
                                    compute_s=t1 - t0, wait_s=t2 - t1))
        if not ring_step.last:
            cur, nxt = nxt, cur
    if P > 1:  # our own block's dk/dv, back from its last holder
        dkv = ring.home_dkv(0)
    dqh *= spec.scale
    dq = from_heads_major(dqh, spec.array_dtype, xp)
    dk = xp.ascontiguousarray(dkv[0].transpose(0, 2, 1, 3).astype(spec.array_dtype, copy=False))
    dv = xp.ascontiguousarray(dkv[1].transpose(0, 2, 1, 3).astype(spec.array_dtype, copy=False))
    if st is not None:
        st["total_s"] = time.perf_counter() - t_start
    return in_format(qkv_format, dq, dk, dv)[0]
