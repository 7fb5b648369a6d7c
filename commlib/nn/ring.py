"""Ring attention for torch: exact, differentiable attention over a sequence sharded across ranks.

Each rank keeps its queries; the K/V shards travel round the ring
(:class:`commlib.collectives.attention.schedule.RingSchedule` says who holds
what at each step, the same schedule the numpy ring uses).  At every step the
next step's receive and send are posted *before* the current block is
computed (double buffering), and the block's output and lse are merged into
float32 accumulators (float64 for float64 inputs).

The backward sends the K/V round again; the ``dk``/``dv`` of each piece
accumulate in float32 as they travel with it and are back at the piece's
owner after ``P`` hops; ``dq`` accumulates in float32 locally.  The
bidirectional variant splits every shard in two halves that travel in
opposite directions (both directions of every link carry half the bytes),
forward and backward.

Blocks run on torch's fused attention kernels (:mod:`._blocks`); on one rank
the call is a single fused kernel call forward and one backward.  Document
boundaries (``cu_seqlens``) cut every block into full and causal pieces, or a
masked call when the documents are many and small.

Papers: Ring Attention (Liu, Zaharia, Abbeel 2023, arXiv:2310.01889);
Striped Attention (Brandon et al. 2023, arXiv:2311.09431); the zigzag layout
of ring-flash-attention (github.com/zhuzilin/ring-flash-attention);
TokenRing (Wang et al. 2024, arXiv:2412.20501) for the bidirectional ring;
FlashAttention-2 (Dao 2023, arXiv:2307.08691) for the lse-based block
backward.
"""
from __future__ import annotations

import functools
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from commlib.collectives.attention.ringcomm import RingComm
from commlib.collectives.attention.schedule import RingSchedule
from commlib.collectives.attention.spec import AttnSpec
from commlib.collectives.attention.transport import transport_of
from commlib.core.errors import InvalidArgument
from commlib.core.seconds import restarted

from ._check import autocast_inputs, autocast_off, bool_option, no_double_backward, validate
from ._blocks import PieceFold, PieceGrads, acc_dtype, block_backward, block_forward, heads_major, pack_kv, plan_block, plan_window_block
from ._failure import bound, guarded, link_comm
from ._front import front
from ._wire import irecv_tensor, isend_tensor
from .window import WindowAttention, halo_pays, halo_plan

__all__ = ["ring_attention", "ring_attention_bidirectional"]

# Tags: each call takes a block of RingComm.WIDTH from its transport's allocator
# (the K/V of stream s at s, the backward's travelling dk/dv of stream s at 2 + s).
_TAG_WIDTH = RingComm.WIDTH


# ------------------------------------------------------------------ the plan
@dataclass
class _Plan:
    """Host-side bookkeeping of one call, shared by forward and backward."""

    sched: RingSchedule
    halves: tuple | None          # per stream, the local token indices it carries (None: whole shard)
    steps: list                   # per step: [(stream index or None for the own whole shard, pieces)]
    single: bool                  # one rank, one piece covering the whole block: one fused call


def _plan(spec: AttnSpec) -> _Plan:
    """The call's plan, cached per (ranks, rank, seq_local, layout, causal,
    bidirectional, cu_seqlens, window): a training loop repeats one call
    shape, and building it costs host time that a GPU step waits for."""
    return _plan_cached(spec.size, spec.rank, spec.seq_local, spec.layout, spec.causal,
                        bool(spec.option("bidirectional")), spec.cu_seqlens, spec.window)


@functools.lru_cache(maxsize=64)
def _plan_cached(P, r, L, layout, causal, bidirectional, cu, window=None) -> _Plan:
    cu = None if cu is None else np.asarray(cu, dtype=np.int64)
    sched = RingSchedule(P, r, bidirectional and P > 1)
    halves = layout.halves(L) if sched.bidirectional else None
    qpos = layout.positions(r, P, L)

    def block_plan(qp, kp):  # a window's band in tiles (blocks outside it: no piece), else full/causal pieces
        if window is not None:
            return plan_window_block(qp, kp, causal, cu, window)
        return plan_block(qp, kp, causal, cu)

    steps = []
    for rs in sched.steps():
        if rs.step == 0:  # the own shard, whole, in both rings
            steps.append([(None, block_plan(qpos, qpos))])
            continue
        entry = []
        for stream, owner in zip(sched.streams, rs.owners):
            kpos = layout.piece_positions(owner, P, L, stream.half)
            entry.append((stream.index, block_plan(qpos, kpos)))
        steps.append(entry)
    pieces = steps[0][0][1]
    single = (P == 1 and len(pieces) == 1 and pieces[0].mask is None
              and (pieces[0].q0, pieces[0].q1, pieces[0].k0, pieces[0].k1) == (0, L, 0, L))
    return _Plan(sched, None if halves is None else tuple(torch.from_numpy(h) for h in halves), steps, single)


def _ring_comm(tp, spec: AttnSpec, plan: _Plan) -> RingComm:
    """The call's ring traffic (tensors on the wire through :mod:`._wire`)."""
    return RingComm(tp, plan.sched, tp.tags.slot(_TAG_WIDTH), spec.timeout, spec.op, isend=isend_tensor,
                    irecv=irecv_tensor)


# ------------------------------------------------------------------ forward
def _forward(tp, spec: AttnSpec, plan: _Plan, q, k, v):
    """The ring forward: ``(out (B, L, H, D) input dtype, lse (B, H, L) accumulation dtype)``."""
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if plan.single:
        piece = plan.steps[0][0][1][0]
        out, lse = block_forward(qh, kh, vh, spec.scale, piece.kind)
        return out.transpose(1, 2), lse
    fold = PieceFold(q, spec.scale)

    P = spec.size
    cur = nxt = ring = None
    if P > 1:
        ring = _ring_comm(tp, spec, plan)
        halves = plan.halves or (None,)
        cur = [pack_kv(k, v, idx) for idx in halves]
        nxt = [torch.empty_like(c) for c in cur]
    for rs, entry in zip(plan.sched.steps(), plan.steps):
        reqs = ring.post_kv(cur, nxt) if not rs.last else []  # before this step's compute
        for sidx, pieces in entry:
            if sidx is None:
                fold(pieces, kh, vh)
            else:
                fold(pieces, *heads_major(cur[sidx]))
        if reqs:
            ring.wait(reqs)
        if not rs.last:
            cur, nxt = nxt, cur
    return fold.out.to(q.dtype), fold.lse


# ------------------------------------------------------------------ backward
def _backward(tp, spec: AttnSpec, plan: _Plan, q, k, v, out, lse, dout):
    """The ring backward: ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``."""
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    oh, doh = out.transpose(1, 2), dout.transpose(1, 2)
    if plan.single:
        piece = plan.steps[0][0][1][0]
        dq, dk, dv = block_backward(doh, qh, kh, vh, oh, lse, spec.scale, piece.kind)
        return dq.transpose(1, 2), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)
    B, L, H, D = q.shape
    hk = k.shape[2]
    cd = acc_dtype(q.dtype)
    dq_acc = torch.zeros(B, L, H, D, dtype=cd, device=q.device)
    dqh = dq_acc.transpose(1, 2)

    grads = PieceGrads(doh, qh, oh, lse, spec.scale, dqh)  # dq into dq_acc, dk/dv into the buffer passed

    P = spec.size
    own = torch.zeros(2, B, L, hk, D, dtype=cd, device=q.device)  # dk/dv of the own shard, step 0
    if P == 1:
        for sidx, pieces in plan.steps[0]:
            grads(pieces, kh, vh, own)
        dkv = own
    else:
        ring = _ring_comm(tp, spec, plan)
        halves = plan.halves or (None,)
        streams = plan.sched.streams
        cur = [pack_kv(k, v, idx) for idx in halves]
        nxt = [torch.empty_like(c) for c in cur]
        for rs, entry in zip(plan.sched.steps(), plan.steps):
            reqs = ring.post_kv(cur, nxt) if not rs.last else []  # before this step's compute
            for st in streams:  # the dk/dv for the next step (at the last: our own, home)
                ring.expect_dkv(st.index, torch.empty_like(cur[st.index], dtype=cd))
            if rs.step == 0:
                grads(entry[0][1], kh, vh, own)
                local = [own if idx is None else own.index_select(2, idx.to(q.device)) for idx in halves]
            else:
                local = [torch.zeros_like(cur[sidx], dtype=cd) for sidx, _ in entry]
                for sidx, pieces in entry:
                    kb, vb = heads_major(cur[sidx])
                    grads(pieces, kb, vb, local[sidx])
            for st in streams:  # add what the previous holders accumulated for each piece, pass it on
                ring.pass_dkv(st.index, local[st.index])
            ring.wait(reqs)
            if not rs.last:
                cur, nxt = nxt, cur
        home = [ring.home_dkv(st.index) for st in streams]  # our own pieces' dk/dv, back from their last holders
        if plan.halves is None:
            dkv = home[0]
        else:
            dkv = torch.empty_like(own)
            for idx, part in zip(plan.halves, home):
                dkv.index_copy_(2, idx.to(q.device), part)
    return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tp, spec, plan):
        out, lse = _forward(tp, spec, plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tp, ctx.spec, ctx.plan = tp, spec, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        # the backward is a call of its own: the whole timeout again
        spec = dataclasses.replace(ctx.spec, timeout=restarted(ctx.spec.timeout))
        # create_graph=True runs the backward in grad mode: refuse it (on every
        # rank alike, before any byte moves) rather than drop the second-order
        # terms silently, as once_differentiable would when dout needs no grad
        no_double_backward(lambda msg: InvalidArgument(msg, rank=spec.rank, op=spec.op + " (backward)"))
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad(), autocast_off(q.device.type), guarded(ctx.tp):
            dout = dout.to(q.dtype).contiguous()
            dq, dk, dv = _backward(ctx.tp, spec, ctx.plan, q, k, v, out, lse, dout)
        return dq, dk, dv, None, None, None


# ------------------------------------------------------------------ public
def _checks(spec: AttnSpec, bad) -> None:
    if spec.option("bidirectional") < 0:
        raise bad("bidirectional must be a bool")


def _ring(q, k, v, comm, causal, layout, softmax_scale, cu_seqlens, bidirectional, timeout, op, sdpa, window=None,
          fmt="bshd"):
    timeout = bound(comm, timeout, op)  # the deadline of the whole call (by default a FT communicator's own)
    tp = transport_of(comm, timeout, op)
    link_comm(comm, tp)
    (q, k, v), ctx = autocast_inputs(q, k, v)  # autocast: SDPA's casts, before the dtype agreement
    with ctx, guarded(tp, comm):
        spec = validate(tp, q, k, v, op=op, causal=causal, softmax_scale=softmax_scale, layout=layout,
                        qkv_format=fmt, cu_seqlens=cu_seqlens, window=window, timeout=timeout, sdpa=sdpa, grads="any",
                        options=(("bidirectional", bool_option(bidirectional)),), checks=_checks)
        if spec.window is not None and halo_pays(spec.size, spec.seq_local, spec.layout, spec.causal,
                                                 spec.cu_seqlens, spec.window):
            # a halo exchange bounded by the window, not the ring
            plan = halo_plan(spec.size, spec.rank, spec.seq_local, spec.layout, spec.causal, spec.cu_seqlens,
                             spec.window)
            return WindowAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), tp, spec, plan)
        plan = _plan(spec)  # with a window the halo saves nothing: the ring, blocks cut to the window
        return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), tp, spec, plan)


def ring_attention(q, k, v, comm=None, causal=False, layout=None, softmax_scale=None, *, cu_seqlens=None,
                   window=None, bidirectional=False, qkv_format="bshd", timeout=None, attn_mask=None, dropout_p=0.0,
                   is_causal=None, scale=None, enable_gqa=None):
    """Exact attention over a sequence sharded across ``comm``'s ranks, differentiable in ``q``, ``k``, ``v``.

    The global sequence has ``size * seq_local`` tokens (no padding: pad the
    sequence before sharding and mask the padding as its own document with
    ``cu_seqlens`` if needed); rank ``r`` holds the tokens
    ``sequence_positions(layout, r, size, seq_local)``
    (:mod:`commlib.collectives.attention.layout`).

    Arguments come in one order, q, k, v, then the communicator (as
    :func:`commlib.ring_attention` takes them); the communicator first
    (``ring_attention(comm, q, k, v)``) works with a ``DeprecationWarning``.

    Args:
        q: this rank's queries, torch tensor ``(batch, seq_local, heads,
            head_dim)`` (``qkv_format="bhsd"``: ``(batch, heads, seq_local,
            head_dim)``); float16, bfloat16, float32 or float64; CPU or CUDA.
            Non-contiguous tensors are accepted (copied with ``.contiguous()``).
        k: keys ``(batch, seq_local, kv_heads, head_dim)``, same dtype and
            device; ``heads % kv_heads == 0`` (grouped-query attention: K/V
            travel with ``kv_heads`` heads and are expanded locally).
        v: values, shaped like ``k``.
        comm: :class:`commlib.Communicator` (messages go over its collectives
            transport with tags of their own), a transport, or any object with
            ``rank``, ``size``, ``isend``, ``irecv`` and ``waitall``; or a
            :class:`commlib.nn.Sharding`, which carries the layout (the
            recommended path: the layout said once for sharding, attention
            and unsharding).
        causal: a query sees only keys at positions up to its own.
        layout: ``"contiguous"``, ``"striped"`` or ``"zigzag"`` (even
            ``seq_local``): how the sequence is spread over the ranks; None
            (default): the Sharding's, else ``"contiguous"``.  A tensor
            :func:`commlib.nn.shard_sequence` cut in another layout is refused.
        softmax_scale: scores are ``softmax_scale * q k^T``; default
            ``head_dim ** -0.5``.
        cu_seqlens: optional document boundaries on the *global* sequence
            (FlashAttention's convention): integers ``[0, ..., size *
            seq_local]``, non-decreasing (empty documents are allowed), the
            same on every rank; a tensor, numpy array or sequence.  No query
            sees a key of another document; composes with ``causal`` and
            every layout.
        window: optional sliding window ``(left, right)`` (FlashAttention-2's
            ``window_size``; ints >= -1, -1 unbounded): the query at global
            position ``i`` sees only keys ``j`` with ``i - left <= j <= i +
            right``, and that with ``causal`` (then ``right`` is 0) and
            ``cu_seqlens``.  A window that hides anything turns the ring
            into a halo exchange (:mod:`commlib.nn.window`): every rank
            receives only the K/V rows inside some local query's window (in
            the contiguous layout, about ``left`` rows from the previous
            rank(s) and ``right`` from the next, whatever the sequence length
            and rank count) and returns only their dk/dv; blocks outside the
            window are neither computed nor sent.  Every layout (striped
            spreads a window over every rank: no bytes saved there);
            ``bidirectional`` changes nothing then.
        bidirectional: split every K/V shard in two halves that travel round
            the ring in opposite directions (:func:`ring_attention_bidirectional`).
        qkv_format: ``"bshd"`` (default, ``(batch, seq, heads, head_dim)``)
            or ``"bhsd"`` (SDPA's ``(batch, heads, seq, head_dim)``,
            Transformer Engine's name): the order of q, k, v, of the output
            and of the gradients (a transposed view in and out, no copy
            beyond the call's own ``.contiguous()``).  The same on every rank.
        timeout: the deadline of the whole call, in seconds: the argument
            agreement and every exchange wait what is left of it, and past it
            the call raises ``CommTimeout`` naming the rank and the operation
            (its backward, a call of its own, gets the whole timeout again).
            None (no limit; on a fault-tolerant communicator its own
            ``timeout``) or a finite number > 0.
        attn_mask, dropout_p, is_causal, scale, enable_gqa: the keywords of
            :func:`torch.nn.functional.scaled_dot_product_attention`, so a
            call written for it ports: ``is_causal`` and ``scale`` are
            ``causal`` and ``softmax_scale`` under SDPA's names;
            ``enable_gqa`` None or True (False needs ``heads == kv_heads``);
            ``attn_mask`` only None (use ``causal`` and ``cu_seqlens``) and
            ``dropout_p`` only 0 (no attention dropout).

    Autocast: inside ``torch.autocast`` for the inputs' device type, q, k and
    v are cast as SDPA's are (attention is on autocast's lower-precision
    list): float32 and float16 inputs go to the autocast dtype (float64
    stays), the output comes back in that dtype, and the gradients of q, k,
    v in their own dtypes.

    Returns:
        torch.Tensor: ``(batch, seq_local, heads, head_dim)`` (``"bhsd"``:
        ``(batch, heads, seq_local, head_dim)``) in the input dtype (under
        autocast: the autocast dtype, see above).  Block outputs and lse are
        merged in float32 (float64 for
        float64 inputs); the backward accumulates ``dq`` and the travelling
        ``dk``/``dv`` in the same dtype.

    Raises:
        InvalidArgument: no communicator in its slot (nor, old order,
            first): raised at once, naming the call.  On every rank alike,
            before any K/V moves, when any
            rank's arguments are bad (not 4-d torch tensors, an unknown
            ``qkv_format`` or shapes that fit only the other one (GQA head
            counts, ``cu_seqlens``), a ``layout`` that contradicts the
            Sharding's or the one a shard was cut in, mixed dtypes or
            devices, unsupported dtype, ``heads % kv_heads != 0``, unknown
            layout, odd ``seq_local`` with zigzag, bad scale or timeout,
            an ``attn_mask``, a ``dropout_p`` other than 0, ``enable_gqa=False``
            with ``heads != kv_heads``, ``causal``/``is_causal`` or
            ``softmax_scale``/``scale`` both given and in conflict,
            ``cu_seqlens`` not running from 0 to ``size * seq_local``, a
            ``window`` that is not None or a pair of ints >= -1) or when
            the ranks' shapes, dtype, device, options, ``cu_seqlens`` or
            whether a gradient flows back (grad mode and ``requires_grad``: the
            backward communicates) differ.  Also from the backward, on every
            rank alike, when it runs with ``create_graph=True`` (the backward
            is not differentiable: no double backward).
        CommTimeout: the argument agreement or a step's messages did not
            complete within ``timeout``.
        CommError: a peer failed (``ProcessFailed``) or another transport error.

    Failures (fault-tolerant ``comm``, forward or backward): a rank whose
    call fails revokes the communicator's transports before raising, so every
    survivor raises ``ProcessFailed`` or ``CommTimeout`` within ``timeout``
    of the failure; each survivor then calls ``comm.recover()`` unless the
    error has ``recovered = True`` (see :mod:`commlib.nn`), and the
    next call on the shrunk ``comm`` runs over the survivors.
    """
    op = "ring_attention_bidirectional" if bidirectional is True else "ring_attention"
    call = front(op, q, k, v, comm, layout, qkv_format, cu_seqlens=cu_seqlens,
                 causal=causal is True or is_causal is True)
    return call.out(_ring(call.q, call.k, call.v, call.comm, causal, call.layout, softmax_scale, cu_seqlens,
                          bidirectional, timeout, op,
                          call.keywords(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                        enable_gqa=enable_gqa), window, call.fmt))


def ring_attention_bidirectional(q, k, v, comm=None, causal=False, layout=None, softmax_scale=None, *,
                                 cu_seqlens=None, window=None, qkv_format="bshd", timeout=None, attn_mask=None,
                                 dropout_p=0.0, is_causal=None, scale=None, enable_gqa=None):
    """:func:`ring_attention` with ``bidirectional=True``.

    Every K/V shard is cut in two halves (layout-aware, see
    :func:`commlib.collectives.attention.schedule.split_halves`): half 0
    travels to ``rank + 1``, half 1 to ``rank - 1``, so both directions of
    every link carry half the bytes of the unidirectional ring, in the same
    number of steps and with the same block work per step (TokenRing's idea,
    Wang et al. 2024, arXiv:2412.20501).  Forward and backward, every layout,
    ``cu_seqlens``, ``window`` (a halo exchange, both ways already), GQA,
    autocast, SDPA's keywords, a :class:`commlib.nn.Sharding` as ``comm``
    and ``qkv_format`` as in :func:`ring_attention`.
    """
    op = "ring_attention_bidirectional"
    call = front(op, q, k, v, comm, layout, qkv_format, cu_seqlens=cu_seqlens,
                 causal=causal is True or is_causal is True)
    return call.out(_ring(call.q, call.k, call.v, call.comm, causal, call.layout, softmax_scale, cu_seqlens, True,
                          timeout, op,
                          call.keywords(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                        enable_gqa=enable_gqa), window, call.fmt))
