"""Sliding-window attention over sequence shards: attention as a halo exchange.

A query at global position ``i`` sees the keys ``j`` with
``i - left <= j <= i + right`` (FlashAttention-2's ``window_size=(left,
right)``, ``-1`` unbounded; Longformer's and Mistral's sliding window), and,
combined with ``causal`` and ``cu_seqlens``, only keys of its own document and
not after it.  Sharded over ranks, a window narrower than the sequence needs
only the K/V rows that fall inside some local query's window: this module
computes, from the layout's positions, which rows of every rank's shard each
rank needs (:func:`halo_plan`, over
:func:`commlib.collectives.attention.window.halo_rows`, the bookkeeping the
numpy/CuPy attention shares), and exchanges exactly those rows, point to
point, in one round:

* **forward**: every rank posts the receives of the rows it needs and sends
  every other rank the rows of its own shard that rank needs, computes its
  own shard's block while they travel, then the received blocks, merging the
  blocks' ``(out, lse)`` in float32 (float64 for float64 inputs).  In the
  contiguous layout a window ``(left, right)`` narrower than a shard is a halo
  of ``left`` rows from the previous rank and ``right`` from the next
  (``right`` is 0 with ``causal``): the bytes a rank receives are those rows,
  whatever the sequence length and the rank count.  Wider windows reach the
  ranks they cover, and only those (no K/V of a rank wholly outside the
  window moves); a window unbounded on one side reaches every rank on that
  side, in one round (memory: the rows received).  The zigzag layout needs
  the halo of each of a rank's two chunks (up to four neighbours); the
  striped layout spreads every window over every rank.  Where the halo
  would bring a rank more than two shards and more than half the rows the
  ring brings (striped over many ranks, or a window nearly as long as the
  sequence: :func:`halo_pays`), the ring runs instead, its blocks cut to the
  window: the bytes of the ring, the work of the window.
* **backward**: the received K/V rows are kept from the forward (no second
  exchange); the ``dk``/``dv`` partials of those rows, accumulated in float32
  (float64), go back to their owners, who add them to their own.

Blocks run on torch's fused kernels (:mod:`._blocks`):
:func:`._blocks.plan_window_block` cuts the band-shaped visibility into
query tiles of a full piece (no mask), a causal diagonal where the window is
causal, and masked edges, so the work is about ``rows * (window + tile)``
score entries, not ``rows * keys``.

:data:`LINK_BYTES` counts the bytes this process sends per directed link, by
phase, from the messages it posts.

Papers: FlashAttention-2 (Dao 2023, arXiv:2307.08691) for ``window_size``
and the lse-based block backward; Longformer (Beltagy, Peters, Cohan 2020,
arXiv:2004.05150) and Mistral 7B (Jiang et al. 2023, arXiv:2310.06825) for
sliding-window attention; Ring Attention (Liu et al. 2023, arXiv:2310.01889)
for the merge of block results.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from commlib.collectives.attention.layout import layout_of
from commlib.collectives.attention.window import effective_window, halo_rows, window_of
from commlib.core.errors import InvalidArgument
from commlib.core.seconds import restarted, time_left

from ._blocks import PieceFold, PieceGrads, acc_dtype, heads_major, pack_kv, plan_window_block
from ._check import autocast_off, no_double_backward
from ._failure import guarded
from ._wire import irecv_tensor, isend_tensor

__all__ = ["LINK_BYTES", "SCHEDULE", "window_of", "effective_window", "window_dense_mask", "halo_pays",
           "halo_plan", "HaloPlan",
           "window_forward", "window_backward", "WindowAttention"]

#: bytes this process sent in windowed attention calls since import (or the
#: last ``LINK_BYTES.clear()``), keyed ``(phase, src, dst)`` with ``phase``
#: ``"forward"`` (K/V rows) or ``"backward"`` (dk/dv partials)
LINK_BYTES: Counter = Counter()

# Tags, as offsets in the block each call takes from its transport's allocator
_TAG_KV = 0
_TAG_DKV = 1
_TAG_WIDTH = 2


def window_dense_mask(mask, n: int, causal: bool, window, device):
    """A dense boolean ``(n, n)`` mask (True: visible) of a whole sequence in
    natural order, cut to ``window`` (for attention that runs on the whole
    sequence locally, as Ulysses does after its all-to-all).

    Args:
        mask: None (then ``causal`` alone) or a bool ``(n, n)`` tensor that
            already holds the causal and document masks.
        n: tokens; causal: causal masking; window: an effective ``(left,
            right)`` or None (``mask`` returned as it is).
        device: where the mask goes.
    """
    if window is None:
        return mask
    pos = torch.arange(n, device=device)
    d = pos[None, :] - pos[:, None]  # key - query
    band = torch.ones(n, n, dtype=torch.bool, device=device)
    left, right = window
    if left >= 0:
        band &= d >= -left
    if right >= 0:
        band &= d <= right
    if mask is not None:
        return mask & band
    return band & (d <= 0) if causal else band


@dataclass(frozen=True)
class HaloPlan:
    """Who sends which rows to whom in one windowed call, from one rank's view.

    Attributes:
        own: the pieces (:class:`._blocks.Piece`) of the local queries against the local keys.
        recv: per source rank, ``(source, rows, pieces)``: the number of K/V
            rows it sends here (its local indices ascending) and the pieces of
            the local queries against them.
        send: per destination rank, ``(dest, idx)``: the int64 local indices
            (a CPU tensor) of the rows it needs from this rank.
    """

    own: list
    recv: list
    send: list


def halo_plan(size: int, rank: int, seq_local: int, layout: str, causal: bool, cu_seqlens, window) -> HaloPlan:
    """The halo exchange of a windowed call (cached: a training loop repeats one call shape).

    Args:
        size, rank: the group; seq_local: tokens per rank; layout: one of
            :data:`commlib.collectives.attention.layout.LAYOUTS`.
        causal: causal masking; cu_seqlens: None or int64 document boundaries.
        window: the :func:`effective_window`, not None.

    Returns:
        :class:`HaloPlan`; every rank computes every rank's plan alike from
        the positions, so the sends and receives match.
    """
    cu = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens)
    return _halo_plan(int(size), int(rank), int(seq_local), layout_of(layout, rank=rank, op="halo_plan"), bool(causal),
                      cu, tuple(window))


@functools.lru_cache(maxsize=64)
def _halo_plan(P, r, L, layout, causal, cu, window) -> HaloPlan:
    rows = halo_rows(P, r, L, layout, causal, cu, window)
    cu = None if cu is None else np.asarray(cu, dtype=np.int64)
    qpos = layout.positions(r, P, L)
    own = plan_window_block(qpos, qpos, causal, cu, window)
    recv = [(s, len(idx), plan_window_block(qpos, layout.positions(s, P, L)[idx], causal, cu, window))
            for s, idx in rows.recv]
    send = [(t, torch.from_numpy(idx)) for t, idx in rows.send]
    return HaloPlan(own, recv, send)


#: which schedule a windowed call takes: "auto" (:func:`halo_pays`), "halo" or "ring" (tests, benchmarks)
SCHEDULE = "auto"


def halo_pays(size: int, seq_local: int, layout: str, causal: bool, cu_seqlens, window) -> bool:
    """Whether a windowed call runs as the halo exchange (True) or as the ring
    with its blocks cut to the window (False); the same answer on every rank.

    The halo sends every needed row in one round (memory: the rows a rank
    receives); the ring sends every shard in ``size - 1`` double-buffered
    steps (memory: two shards in flight, and all the bytes).  The halo is
    taken while the busiest rank receives at most ``2 * seq_local`` rows (no
    more memory than the ring's buffers, never more bytes) or at most half
    the ``(size - 1) * seq_local`` rows the ring brings it; past both (the
    striped layout, whose every window reaches every rank, or a window about
    as long as the sequence over many ranks) the ring runs.
    :data:`SCHEDULE` overrides the choice.
    """
    if SCHEDULE != "auto":
        return SCHEDULE == "halo"
    if size == 1:
        return True
    cu = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens)
    return _halo_pays(int(size), int(seq_local), layout_of(layout, op="halo_pays"), bool(causal), cu, tuple(window))


@functools.lru_cache(maxsize=64)
def _halo_pays(P, L, layout, causal, cu, window) -> bool:
    most = max(sum(len(idx) for _, idx in halo_rows(P, r, L, layout, causal, cu, window).recv) for r in range(P))
    return most <= max(2 * L, (P - 1) * L // 2)


def _nbytes(t):
    return t.numel() * t.element_size()


def window_forward(tp, spec, plan: HaloPlan, q, k, v):
    """The windowed forward on one rank.

    Args:
        tp: the call's transport; spec: the validated call (``rank``,
            ``size``, ``scale``, ``op``, ``timeout``); plan: its :class:`HaloPlan`.
        q: ``(B, L, H, D)``; k, v: ``(B, L, Hkv, D)``, contiguous.

    Returns:
        tuple: ``out`` ``(B, L, H, D)`` in the input dtype, ``lse``
        ``(B, H, L)`` in the accumulation dtype, and the list of received
        ``(2, B, n, Hkv, D)`` K/V buffers (kept for the backward).

    Raises:
        CommTimeout, CommError: from the transport's waits.
    """
    B, L, H, D = q.shape
    hk = k.shape[2]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    fold = PieceFold(q, spec.scale)

    reqs, bufs, msgs = [], [], []
    if spec.size > 1:
        tag = tp.tags.slot(_TAG_WIDTH) + _TAG_KV
        for src, n, _ in plan.recv:  # every receive before any send
            buf = torch.empty(2, B, n, hk, D, dtype=k.dtype, device=k.device)
            reqs.append(irecv_tensor(tp, buf, src, tag))
            bufs.append(buf)
        for dst, idx in plan.send:
            msg = pack_kv(k, v, idx)
            reqs.append(isend_tensor(tp, msg, dst, tag))
            msgs.append(msg)
            LINK_BYTES[("forward", spec.rank, dst)] += _nbytes(msg)
    fold(plan.own, kh, vh)  # while the halo travels
    if reqs:
        tp.waitall(reqs, time_left(spec.timeout), op=spec.op)
    for (_, _, pieces), buf in zip(plan.recv, bufs):
        fold(pieces, *heads_major(buf))
    return fold.out.to(q.dtype), fold.lse, bufs


def window_backward(tp, spec, plan: HaloPlan, q, k, v, out, lse, dout, bufs):
    """The windowed backward on one rank: ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``.

    ``bufs`` are the K/V rows :func:`window_forward` received; their dk/dv
    partials (accumulation dtype) go back to their owners, and the partials
    of this rank's rows come back from the ranks it sent them to.
    """
    B, L, H, D = q.shape
    hk = k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    oh, doh = out.transpose(1, 2), dout.transpose(1, 2)
    cd = acc_dtype(q.dtype)
    dq_acc = torch.zeros(B, L, H, D, dtype=cd, device=q.device)
    dqh = dq_acc.transpose(1, 2)

    grads = PieceGrads(doh, qh, oh, lse, spec.scale, dqh)

    own = torch.zeros(2, B, L, hk, D, dtype=cd, device=q.device)
    reqs, incoming, partials = [], [], []
    if spec.size > 1:
        tag = tp.tags.slot(_TAG_WIDTH) + _TAG_DKV
        for dst, idx in plan.send:  # our rows' partials, back from the ranks that used them
            buf = torch.empty(2, B, len(idx), hk, D, dtype=cd, device=q.device)
            reqs.append(irecv_tensor(tp, buf, dst, tag))
            incoming.append((idx, buf))
    grads(plan.own, kh, vh, own)
    for (src, n, pieces), kv in zip(plan.recv, bufs):
        part = torch.zeros(2, B, n, hk, D, dtype=cd, device=q.device)
        grads(pieces, *heads_major(kv), part)
        reqs.append(isend_tensor(tp, part, src, tag))
        partials.append(part)
        LINK_BYTES[("backward", spec.rank, src)] += _nbytes(part)
    if reqs:
        tp.waitall(reqs, time_left(spec.timeout), op=spec.op)
    for idx, buf in incoming:
        own.index_add_(2, idx.to(q.device), buf)
    return dq_acc.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class WindowAttention(torch.autograd.Function):
    """``apply(q, k, v, tp, spec, plan)``: the windowed call as an autograd function
    (q ``(B, L, H, D)``, k/v ``(B, L, Hkv, D)``, contiguous; ``spec`` a validated
    call with ``rank``, ``size``, ``scale``, ``op``, ``timeout``)."""

    @staticmethod
    def forward(ctx, q, k, v, tp, spec, plan):
        out, lse, bufs = window_forward(tp, spec, plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, *bufs)
        ctx.tp, ctx.spec, ctx.plan = tp, spec, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        spec = dataclasses.replace(ctx.spec, timeout=restarted(ctx.spec.timeout))
        no_double_backward(lambda msg: InvalidArgument(msg, rank=spec.rank, op=spec.op + " (backward)"))
        q, k, v, out, lse, *bufs = ctx.saved_tensors
        with torch.no_grad(), autocast_off(q.device.type), guarded(ctx.tp):
            dout = dout.to(q.dtype).contiguous()
            dq, dk, dv = window_backward(ctx.tp, spec, ctx.plan, q, k, v, out, lse, dout, bufs)
        return dq, dk, dv, None, None, None
