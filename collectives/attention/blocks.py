"""Block kernels shared by every sequence-parallel attention algorithm.

One *block* is the attention of a rank's local queries against one K/V shard
(its own or one that arrived over the ring).  The kernels here never
communicate; :mod:`.ring` and :mod:`.ulysses` move the blocks.

Conventions (all kernels):

* Heads-major compute layout: a query tensor ``(batch, seq, heads, head_dim)``
  becomes ``(batch, kv_heads, group, seq, head_dim)`` with
  ``group = heads // kv_heads`` (grouped-query attention), so one matmul per
  ``kv_head`` serves the whole group and K/V are never replicated.
* Positions are *padded-global* token indices (int64 numpy, host), sorted
  ascending on every rank for every layout (see :mod:`.layout`); a token with
  position ``>= seq_len`` is padding: as a key it is invisible, as a query its
  row is never computed (output 0, lse ``-inf``).
* Causal visibility: key ``j`` is visible to query ``i`` iff
  ``kpos[j] <= qpos[i]``.  Because positions are sorted, for a tile of query
  rows the keys visible to *every* row form a prefix ``[0, a)`` and the keys
  visible to *some* row a prefix ``[0, b)``: the tile computes ``b`` columns
  and masks only ``[a, b)``.  Tiles with ``b == 0`` are skipped.  This is the
  tile skipping of FlashAttention applied to any layout; it is what gives the
  striped and zigzag layouts their load balance.
* Accumulation dtype (:func:`compute_dtype`): float64 for float64 inputs,
  float32 for float16 / bfloat16 / float32.
* Forward uses the online-softmax recurrence (running max ``m``, running sum
  ``l``, unnormalized output), which is the numerically stable log-sum-exp
  merge of block results; ``lse = m + log(l)``.  Rows that see no key keep
  ``l == 0`` and finish as out ``0``, lse ``-inf`` (never NaN).
* Backward is FlashAttention-2's: ``P = exp(S - lse)`` with the *global* lse,
  ``dS = P * (dP - D)`` with ``D = rowsum(dout * out)``.

The array module (numpy or CuPy) is taken from the inputs
(:func:`get_array_module`), so on CuPy arrays the block math runs on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "get_array_module",
    "compute_dtype",
    "SUPPORTED_DTYPES",
    "to_heads_major",
    "from_heads_major",
    "TilePlan",
    "tile_plan",
    "ForwardAccumulator",
    "forward_block",
    "backward_block",
    "attention_forward",
    "attention_backward",
]

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")


def get_array_module(x):
    """The array module of ``x``: ``cupy`` for CuPy arrays, else ``numpy``.

    Written so a host without CuPy never imports it.
    """
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":  # pragma: no cover - needs a GPU
        import cupy  # noqa: PLC0415

        return cupy
    return np


def compute_dtype(dtype) -> np.dtype:
    """Accumulation dtype for an input dtype: float64 stays float64, everything
    else (float16, bfloat16, float32) accumulates in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def to_heads_major(x, kv_heads: int, dtype, xp=np):
    """``(batch, seq, heads, head_dim)`` -> contiguous
    ``(batch, kv_heads, heads // kv_heads, seq, head_dim)`` in ``dtype``.

    Always a new array (one copy), never a view of ``x``, even where the
    transpose is a no-op (one head, or ``seq == 1``): the kernels scale and
    accumulate into it in place, and the caller's input must stay untouched."""
    b, s, h, d = x.shape
    y = x.reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
    out = xp.empty(y.shape, dtype=dtype)
    out[...] = y
    return out


def from_heads_major(x, dtype, xp=np):
    """Inverse of :func:`to_heads_major`: ``(batch, kv_heads, group, seq, head_dim)``
    -> contiguous ``(batch, seq, kv_heads * group, head_dim)`` in ``dtype``."""
    b, hk, g, s, d = x.shape
    y = x.transpose(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)
    return xp.ascontiguousarray(y.astype(dtype, copy=False))


# ------------------------------------------------------------------ tile plan
@dataclass
class TilePlan:
    """Which score entries one block computes.

    Attributes:
        tiles: ``(i0, i1, a, b)`` per computed query tile: rows ``[i0, i1)``
            against keys ``[0, b)``, with keys ``[a, b)`` masked causally.
        work: computed score entries per (batch, head): ``sum (i1 - i0) * b``.
        visible: visible (query, key) pairs per (batch, head) (the ideal work).
    """

    tiles: list = field(default_factory=list)
    work: int = 0
    visible: int = 0


def tile_plan(qpos: np.ndarray, kpos: np.ndarray, seq_len: int, causal: bool, tile: int) -> TilePlan:
    """Plan the query tiles of one block (host-side, no array math on device).

    Args:
        qpos: sorted padded-global positions of the query rows, int64 ``(Lq,)``.
        kpos: sorted padded-global positions of the keys, int64 ``(Lk,)``.
        seq_len: true global sequence length; positions ``>= seq_len`` are padding.
        causal: apply the causal mask ``kpos <= qpos``.
        tile: query rows per tile (>= 1).

    Returns:
        TilePlan
    """
    nq = int(np.searchsorted(qpos, seq_len, side="left"))
    nk = int(np.searchsorted(kpos, seq_len, side="left"))
    plan = TilePlan()
    if nk == 0:
        return plan
    for i0 in range(0, nq, tile):
        i1 = min(i0 + tile, nq)
        if causal:
            a = min(int(np.searchsorted(kpos, qpos[i0], side="right")), nk)
            b = min(int(np.searchsorted(kpos, qpos[i1 - 1], side="right")), nk)
            if b == 0:
                continue
            vis = (i1 - i0) * a
            if b > a:
                vis += int(np.searchsorted(kpos[a:b], qpos[i0:i1], side="right").sum())
        else:
            a = b = nk
            vis = (i1 - i0) * nk
        plan.tiles.append((i0, i1, a, b))
        plan.work += (i1 - i0) * b
        plan.visible += vis
    return plan


def _tile_mask(qpos, kpos, i0, i1, a, b, xp):
    """Boolean ``(i1 - i0, b - a)``: True where the key is visible."""
    m = kpos[None, a:b] <= qpos[i0:i1, None]
    return m if xp is np else xp.asarray(m)


# -------------------------------------------------------------------- forward
class ForwardAccumulator:
    """Online-softmax state of the local query rows.

    Args:
        shape: ``(batch, kv_heads, group, seq_q, head_dim)``.
        dtype: accumulation dtype.
        xp: array module.

    Attributes:
        acc: unnormalized output, ``shape``.
        m: running row max, ``shape[:-1]``, starts at ``-inf``.
        l: running row sum of ``exp(s - m)``, ``shape[:-1]``, starts at 0.
    """

    def __init__(self, shape, dtype, xp=np):
        self.xp = xp
        self.acc = xp.zeros(shape, dtype=dtype)
        self.m = xp.full(shape[:-1], -np.inf, dtype=dtype)
        self.l = xp.zeros(shape[:-1], dtype=dtype)

    def update(self, i0: int, i1: int, s, vb) -> None:
        """Fold one tile into rows ``i0:i1``: ``s`` its (scaled, masked with
        ``-inf``) scores ``(B, Hkv, G, i1 - i0, nk)``, overwritten; ``vb`` the
        tile's values ``(B, Hkv, nk, D)``."""
        xp = self.xp
        bsz, hk, g, lt, nk = s.shape
        m_old = self.m[..., i0:i1]
        m_new = xp.maximum(m_old, s.max(axis=-1))
        m_safe = xp.where(xp.isneginf(m_new), 0, m_new)
        alpha = xp.exp(m_old - m_safe)
        s -= m_safe[..., None]
        p = xp.exp(s, out=s)
        self.l[..., i0:i1] = self.l[..., i0:i1] * alpha + p.sum(axis=-1)
        pv = xp.matmul(p.reshape(bsz, hk, g * lt, nk), vb).reshape(bsz, hk, g, lt, vb.shape[-1])
        acc = self.acc[..., i0:i1, :]
        acc *= alpha[..., None]
        acc += pv
        self.m[..., i0:i1] = m_new

    def finalize(self):
        """Return ``(out, lse)`` heads-major: out ``(B, Hkv, G, L, D)``, lse
        ``(B, Hkv, G, L)``; rows with no visible key give out 0 and lse ``-inf``."""
        xp = self.xp
        seen = self.l > 0
        l_safe = xp.where(seen, self.l, 1)
        out = self.acc / l_safe[..., None]
        lse = xp.where(seen, self.m + xp.log(l_safe), -np.inf)
        return out, lse


def forward_block(qh, kh, vh, plan: TilePlan, qpos, kpos, state: ForwardAccumulator) -> None:
    """Accumulate one K/V block into ``state``.

    Args:
        qh: queries, pre-multiplied by the softmax scale, ``(B, Hkv, G, Lq, D)``
            in the accumulation dtype.
        kh: keys ``(B, Hkv, Lk, D)``, accumulation dtype.
        vh: values ``(B, Hkv, Lk, D)``, accumulation dtype.
        plan: from :func:`tile_plan` for these positions.
        qpos, kpos: host positions used by ``plan`` (for the causal mask).
        state: the accumulator, updated in place.
    """
    xp = state.xp
    bsz, hk, g, _, d = qh.shape
    for i0, i1, a, b in plan.tiles:
        lt = i1 - i0
        q = qh[:, :, :, i0:i1, :].reshape(bsz, hk, g * lt, d)
        s = xp.matmul(q, kh[:, :, :b, :].swapaxes(-1, -2)).reshape(bsz, hk, g, lt, b)
        if b > a:
            mask = _tile_mask(qpos, kpos, i0, i1, a, b, xp)
            tail = s[..., a:]
            tail[...] = xp.where(mask, tail, -np.inf)
        state.update(i0, i1, s, vh[:, :, :b, :])


# ------------------------------------------------------------------- backward
def backward_operands(q, out, lse, dout, kv_heads: int, scale: float, dtype, xp=np):
    """The heads-major operands of a backward (FlashAttention-2): ``(qh, doh,
    dh, lseh, dqh)`` with ``qh`` scaled by ``scale``, ``dh = rowsum(dout * out)``,
    ``lseh`` ``(B, Hkv, G, L)`` and a zero dq accumulator shaped like ``qh``;
    ``q``, ``out``, ``dout`` ``(B, L, H, D)``, ``lse`` ``(B, H, L)``."""
    bsz, L, H = q.shape[0], q.shape[1], q.shape[2]
    qh = to_heads_major(q, kv_heads, dtype, xp)
    qh *= scale
    doh = to_heads_major(dout, kv_heads, dtype, xp)
    dh = (doh * to_heads_major(out, kv_heads, dtype, xp)).sum(axis=-1)
    lseh = xp.ascontiguousarray(xp.asarray(lse).astype(dtype, copy=False).reshape(bsz, kv_heads, H // kv_heads, L))
    return qh, doh, dh, lseh, xp.zeros_like(qh)


def backward_block(qh, kh, vh, doh, lseh, dh, plan: TilePlan, qpos, kpos, dqh, dkh, dvh) -> None:
    """Gradients of one K/V block (FlashAttention-2 backward with the global lse).

    Args:
        qh: queries pre-multiplied by the softmax scale, ``(B, Hkv, G, Lq, D)``.
        kh, vh: the block's keys and values ``(B, Hkv, Lk, D)``.
        doh: output gradient ``(B, Hkv, G, Lq, D)``.
        lseh: global log-sum-exp of the query rows ``(B, Hkv, G, Lq)``.
        dh: ``D = rowsum(dout * out)``, ``(B, Hkv, G, Lq)``.
        plan, qpos, kpos: as in :func:`forward_block`.
        dqh: ``(B, Hkv, G, Lq, D)``, accumulates ``dS @ K`` (the caller applies
            the softmax scale once at the end).
        dkh, dvh: ``(B, Hkv, Lk, D)``, accumulate the block's key and value
            gradients, summed over each query group (grouped-query attention).
    All arrays are in the accumulation dtype; the three gradients are updated in place.
    """
    xp = get_array_module(qh)
    bsz, hk, g, _, d = qh.shape
    lse_safe = xp.where(xp.isneginf(lseh), np.inf, lseh)
    for i0, i1, a, b in plan.tiles:
        lt = i1 - i0
        q = qh[:, :, :, i0:i1, :].reshape(bsz, hk, g * lt, d)
        do = doh[:, :, :, i0:i1, :].reshape(bsz, hk, g * lt, d)
        k = kh[:, :, :b, :]
        v = vh[:, :, :b, :]
        s = xp.matmul(q, k.swapaxes(-1, -2)).reshape(bsz, hk, g, lt, b)
        s -= lse_safe[..., i0:i1, None]
        p = xp.exp(s, out=s)
        if b > a:
            mask = _tile_mask(qpos, kpos, i0, i1, a, b, xp)
            tail = p[..., a:]
            tail[...] = xp.where(mask, tail, 0)
        p2 = p.reshape(bsz, hk, g * lt, b)
        dvh[:, :, :b, :] += xp.matmul(p2.swapaxes(-1, -2), do)
        dp = xp.matmul(do, v.swapaxes(-1, -2)).reshape(bsz, hk, g, lt, b)
        dp -= dh[..., i0:i1, None]
        dp *= p
        ds = dp.reshape(bsz, hk, g * lt, b)
        dqh[:, :, :, i0:i1, :] += xp.matmul(ds, k).reshape(bsz, hk, g, lt, d)
        dkh[:, :, :b, :] += xp.matmul(ds.swapaxes(-1, -2), q)


# -------------------------------------------------- single-rank blocked attention
def _single_rank_inputs(q, k, v, softmax_scale, positions, seq_len):
    """Shared set-up of the single-rank kernels: array module, accumulation
    dtype, shape, kv heads, scale, positions, true length, and heads-major
    ``q * scale``, ``k``, ``v`` in the accumulation dtype."""
    xp = get_array_module(q)
    cdt = compute_dtype(q.dtype)
    bsz, n, h, d = q.shape
    hk = k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    pos = np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
    slen = int(pos[-1]) + 1 if seq_len is None and n else (0 if seq_len is None else int(seq_len))
    qh = to_heads_major(q, hk, cdt, xp)
    qh *= scale
    kh = to_heads_major(k, hk, cdt, xp)[:, :, 0]
    vh = to_heads_major(v, hk, cdt, xp)[:, :, 0]
    return xp, cdt, (bsz, n, h, d), hk, scale, pos, slen, qh, kh, vh


def attention_forward(q, k, v, causal=False, softmax_scale=None, *, positions=None, seq_len=None, tile=128):
    """Blocked attention on one rank (no communication): the single-rank
    baseline and the local kernel of Ulysses.

    Args:
        q: ``(batch, seq, heads, head_dim)``.
        k, v: ``(batch, seq, kv_heads, head_dim)``, ``heads % kv_heads == 0``.
        causal: causal mask on ``positions``.
        softmax_scale: default ``head_dim ** -0.5``.
        positions: sorted int64 positions of the ``seq`` tokens (default ``arange``).
        seq_len: positions ``>= seq_len`` are padding (default: all valid).
        tile: query rows per tile.

    Returns:
        tuple: ``out`` like ``q`` (input dtype) and ``lse`` ``(batch, heads, seq)``
        in the accumulation dtype.
    """
    xp, cdt, (bsz, n, h, d), hk, scale, pos, slen, qh, kh, vh = _single_rank_inputs(
        q, k, v, softmax_scale, positions, seq_len)
    state = ForwardAccumulator(qh.shape, cdt, xp)
    plan = tile_plan(pos, pos, slen, causal, tile)
    forward_block(qh, kh, vh, plan, pos, pos, state)
    out, lse = state.finalize()
    return from_heads_major(out, q.dtype, xp), lse.reshape(bsz, h, n)


def attention_backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None, *, positions=None,
                       seq_len=None, tile=128):
    """Backward of :func:`attention_forward` on one rank.

    Returns:
        tuple: ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``.
    """
    xp, cdt, (bsz, n, h, d), hk, scale, pos, slen, qh, kh, vh = _single_rank_inputs(
        q, k, v, softmax_scale, positions, seq_len)
    doh = to_heads_major(dout, hk, cdt, xp)
    dh = (doh * to_heads_major(out, hk, cdt, xp)).sum(axis=-1)
    lseh = xp.asarray(lse, dtype=cdt).reshape(bsz, hk, h // hk, n)
    dqh = xp.zeros_like(qh)
    dkh = xp.zeros_like(kh)
    dvh = xp.zeros_like(vh)
    plan = tile_plan(pos, pos, slen, causal, tile)
    backward_block(qh, kh, vh, doh, lseh, dh, plan, pos, pos, dqh, dkh, dvh)
    dqh *= scale
    dk = xp.ascontiguousarray(dkh.transpose(0, 2, 1, 3).astype(k.dtype, copy=False))
    dv = xp.ascontiguousarray(dvh.transpose(0, 2, 1, 3).astype(v.dtype, copy=False))
    return from_heads_major(dqh, q.dtype, xp), dk, dv
