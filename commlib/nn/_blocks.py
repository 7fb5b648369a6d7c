"""Attention block math for the torch ring, on torch's fused kernels.

Conventions (every function here):

* heads-major tensors: ``q`` ``(B, H, Lq, D)``, ``k`` and ``v``
  ``(B, Hkv, Lk, D)`` with ``H % Hkv == 0`` (grouped-query attention: K/V are
  expanded to ``H`` heads here, locally, never on the wire; the ``dk``/``dv``
  of an expanded block are summed back over each query group).  Any strides
  with a unit last stride; ``(B, L, H, D)`` tensors enter as
  ``x.transpose(1, 2)`` views, which is the memory order the CPU kernel works
  in, so nothing is copied.
* ``kind``: ``"full"`` (every query sees every key) or ``"causal"`` (a
  square diagonal block, ``Lq == Lk``, query ``i`` sees keys ``0..i``).  The
  fused kernels' ``is_causal`` has no offset, so causal is only ever used on
  square diagonal blocks; other visibility patterns are cut into full and
  causal sub-blocks by :func:`plan_block`, or expressed as a ``mask``.
* ``mask``: optional bool ``(Lq, Lk)`` tensor, True where the query may see
  the key (combined with ``kind``).
* ``lse``: ``(B, H, Lq)`` log-sum-exp of the scaled scores, float32 (float64
  for float64 inputs); a row that sees no key has ``out`` 0 and ``lse``
  ``-inf``.
* ``scale``: the softmax scale (scores are ``scale * q k^T``).

Kernels: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward for float16, bfloat16, float32 and float64 (float64 is exact to
about 1e-15; masks go in as an additive float mask in the input dtype, which
the op takes with a correct lse, except that rows with no visible key get lse
0: they are set to ``-inf`` here).  On CUDA, float16/bfloat16 blocks without a mask take
cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``, head_dim
a multiple of 8 up to 128) on compute capability 9.0 and newer (Hopper: about
twice the flash kernel's speed there, and what torch's own SDPA picks), else
the flash kernel (``aten._scaled_dot_product_flash_attention``, head_dim a
multiple of 8 up to 256; also wherever cuDNN refuses a shape, remembered per
shape); :data:`CUDA_HALF_KERNEL` pins one of the two.  Masked blocks and
float32 take the memory-efficient kernel
(``aten._scaled_dot_product_efficient_attention``, masks as an additive bias;
its lse is padded to a multiple of 32 rows and is sliced); the backward of a
*masked* half-precision block runs that kernel in float32 (in half precision
its gradients were wrong on an H200, torch 2.11: ``tests/test_nn_cuda.py``).
Float64 on CUDA, or a kernel that refuses the shapes, takes an explicit
matmul fallback in the accumulation dtype.  :data:`KERNELS` counts the
calls of each.

Partial results are merged by :func:`merge` in float32 (float64 for float64
inputs), never in half precision (the bf16 error growth with ranks that
ring-flash-attention users report comes from half-precision merges).

The backward of a block takes the *global* ``out`` and ``lse`` of the rows
(as FlashAttention's backward does): ``P = exp(scale * q k^T - lse)`` is then
the block's share of the global softmax and ``rowsum(dout * out)`` the global
one, so the block's ``dq``/``dk``/``dv`` are its exact contributions.

Papers: FlashAttention (Dao et al. 2022, arXiv:2205.14135) and
FlashAttention-2 (Dao 2023, arXiv:2307.08691) for the lse-based forward and
backward; Ring Attention (Liu et al. 2023, arXiv:2310.01889) for the merge.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from commlib.collectives.attention.window import visible_ranges  # the one definition of what a query sees

__all__ = [
    "mask_tensor",
    "pack_kv",
    "heads_major",
    "PieceFold",
    "PieceGrads",
    "acc_dtype",
    "block_forward",
    "block_backward",
    "merge",
    "Piece",
    "visible_ranges",
    "plan_block",
    "plan_window_block",
    "explicit_forward",
    "explicit_backward",
]

_HALF = (torch.float16, torch.bfloat16)

#: CUDA kernel for float16/bfloat16 blocks without a mask: "auto" (cuDNN on
#: compute capability >= 9.0, else flash), "cudnn" or "flash"
CUDA_HALF_KERNEL = "auto"
#: calls per kernel and direction since import, e.g. ``KERNELS["cudnn_fwd"]``
#: (keys: ``{cpu,cudnn,flash,efficient,explicit}_{fwd,bwd}``)
KERNELS: Counter = Counter()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, Hkv, L, D)`` -> ``(B, H, L, D)``, each kv head repeated over its query group.

    One kv head expands as a stride-0 view on CPU (the CPU kernel reads any
    head stride); otherwise a local copy."""
    hk = x.shape[1]
    if hk == heads:
        return x
    if hk == 1 and not x.is_cuda:
        return x.expand(x.shape[0], heads, x.shape[2], x.shape[3])
    return x.repeat_interleave(heads // hk, dim=1)


def _group_sum(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, H, L, D)`` gradients of expanded K/V summed over each query group
    (in the accumulation dtype)."""
    h = dx.shape[1]
    if h == kv_heads:
        return dx
    return dx.unflatten(1, (kv_heads, h // kv_heads)).sum(2, dtype=acc_dtype(dx.dtype))


def _causal_mask(lq: int, lk: int, device) -> torch.Tensor:
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()


def _visible(kind: str, mask, lq: int, lk: int, device):
    """The bool visibility of a block, or None when it is plain full/causal."""
    if mask is None:
        return None
    mask = mask.to(device=device, dtype=torch.bool)
    if kind == "causal":
        mask = mask & _causal_mask(lq, lk, device)
    return mask


def _bias(mask: torch.Tensor, dtype: torch.dtype, pad: int = 1) -> torch.Tensor:
    """Additive float mask (0 where visible, -inf elsewhere); the last dimension's
    storage padded to a multiple of ``pad`` elements (the CUDA kernel's alignment)."""
    lq, lk = mask.shape
    lkp = -(-lk // pad) * pad
    b = torch.zeros(lq, lkp, dtype=dtype, device=mask.device)
    b[:, :lk].masked_fill_(~mask, -math.inf)
    return b[:, :lk]


def _fix_empty_rows(out, lse, mask):
    """Rows whose mask is all False: out 0 and lse -inf (the kernels give lse 0 or NaN)."""
    empty = ~mask.any(-1)
    if bool(empty.any()):
        out = out.masked_fill(empty[:, None], 0.0)
        lse = lse.masked_fill(empty, -math.inf)
    return out, lse


# ------------------------------------------------------------------ explicit
def explicit_forward(q, k, v, scale: float, kind: str = "full", mask=None):
    """Block forward with plain matmuls in the accumulation dtype (float64 on
    CUDA, and any case no fused kernel takes).  Arguments and results as
    :func:`block_forward`."""
    KERNELS["explicit_fwd"] += 1
    cd = acc_dtype(q.dtype)
    h, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    qf = q.to(cd)
    kf = _expand_kv(k, h).to(cd)
    vf = _expand_kv(v, h).to(cd)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    vis = _visible(kind, mask, lq, lk, q.device)
    if vis is None and kind == "causal":
        vis = _causal_mask(lq, lk, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(torch.isinf(m), 0.0)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    lse = (m + torch.log(denom)).squeeze(-1)
    out = torch.matmul(p / denom.clamp_min(torch.finfo(cd).tiny), vf)
    return out.to(q.dtype), lse


def explicit_backward(dout, q, k, v, out, lse, scale: float, kind: str = "full", mask=None):
    """Block backward with plain matmuls in the accumulation dtype; arguments
    and results as :func:`block_backward`."""
    KERNELS["explicit_bwd"] += 1
    cd = acc_dtype(q.dtype)
    h, hk, lq, lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    qf, dof, of = q.to(cd), dout.to(cd), out.to(cd)
    kf = _expand_kv(k, h).to(cd)
    vf = _expand_kv(v, h).to(cd)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    vis = _visible(kind, mask, lq, lk, q.device)
    if vis is None and kind == "causal":
        vis = _causal_mask(lq, lk, q.device)
    lse = lse.to(cd)
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # rows that see nothing: P = 0
    p = torch.exp(s - lse.unsqueeze(-1))
    if vis is not None:
        p = p.masked_fill(~vis, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    dsum = (dof * of).sum(-1, keepdim=True)
    ds = p * (dp - dsum)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dk, dv = _group_sum(dk, hk), _group_sum(dv, hk)
    return dq.to(q.dtype), dk, dv


# ------------------------------------------------------------------ CUDA
_RNG = {}
_CUDNN_REFUSED = set()  # (device, dtype, Lq, Lk, D, causal) cuDNN raised on: flash from then on
_CAPABILITY = {}


def _flash_rng(device, dtype):
    """The philox seed/offset tensors the CUDA flash forward returns without
    dropout, taken once per device from a tiny call, for the backward calls
    (which take them back unused when dropout is 0)."""
    key = (str(device), dtype)
    if key not in _RNG:
        x = torch.zeros(1, 1, 8, 8, dtype=dtype, device=device)
        res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        _RNG[key] = (res[6], res[7])
    return _RNG[key]


def _cudnn_rng(device, dtype):
    """cuDNN's philox seed/offset tensors (unused without dropout) and the
    number of dimensions of its lse (3, or 4 with a trailing 1), from a tiny call."""
    key = ("cudnn", str(device), dtype)
    if key not in _RNG:
        x = torch.zeros(1, 1, 8, 8, dtype=dtype, device=device)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
        _RNG[key] = (res[6], res[7], res[1].dim())
    return _RNG[key]


def _flash_ok(q, vis) -> bool:
    d = q.shape[-1]
    return vis is None and q.dtype in _HALF and d % 8 == 0 and d <= 256


def _cudnn_key(q, kf, causal):
    return (str(q.device), q.dtype, q.shape[2], kf.shape[2], q.shape[-1], causal)


def _cudnn_ok(q, kf, vis, causal) -> bool:
    d = q.shape[-1]
    if CUDA_HALF_KERNEL == "flash" or vis is not None or q.dtype not in _HALF or d % 8 or d > 128:
        return False
    if _cudnn_key(q, kf, causal) in _CUDNN_REFUSED:
        return False
    if CUDA_HALF_KERNEL == "cudnn":
        return True
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if dev not in _CAPABILITY:
        _CAPABILITY[dev] = torch.cuda.get_device_capability(dev) >= (9, 0) and torch.backends.cudnn.is_available()
    return _CAPABILITY[dev]


def _cuda_forward(q, kf, vf, scale, causal, vis):  # pragma: no cover - needs a GPU
    lq = q.shape[2]
    if _cudnn_ok(q, kf, vis, causal):
        try:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kf, vf, None, True, 0.0, causal, False,
                                                                     scale=scale)
            KERNELS["cudnn_fwd"] += 1
            lse = res[1]
            return res[0], (lse.squeeze(-1) if lse.dim() == 4 else lse)
        except RuntimeError:
            _CUDNN_REFUSED.add(_cudnn_key(q, kf, causal))
    if _flash_ok(q, vis):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, kf, vf, 0.0, causal, False, scale=scale)
        KERNELS["flash_fwd"] += 1
        return res[0], res[1]
    if q.dtype in _HALF or q.dtype == torch.float32:
        bias = None
        if vis is not None:
            bias = _bias(vis, q.dtype, 16).expand(q.shape[0], q.shape[1], lq, kf.shape[2])
        res = torch.ops.aten._scaled_dot_product_efficient_attention(q, kf, vf, bias, True, 0.0, causal,
                                                                     scale=scale)
        KERNELS["efficient_fwd"] += 1
        return res[0], res[1][..., :lq]
    raise NotImplementedError(f"no fused CUDA attention for {q.dtype}")


def _cuda_backward(dout, q, kf, vf, out, lse, scale, causal, vis):  # pragma: no cover - needs a GPU
    lq, lk = q.shape[2], kf.shape[2]
    if _cudnn_ok(q, kf, vis, causal):
        seed, offset, lse_dims = _cudnn_rng(q.device, q.dtype)
        lse_c = (lse if lse_dims == 3 else lse.unsqueeze(-1)).contiguous()
        if dout.stride() != out.stride():  # cuDNN reads both with one layout
            dout = dout.contiguous()
            out = out.contiguous()
        try:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, kf, vf, out, lse_c, seed, offset, None, None, None, lq, lk, 0.0, causal, scale=scale)
            KERNELS["cudnn_bwd"] += 1
            return res[0], res[1], res[2]
        except RuntimeError:
            _CUDNN_REFUSED.add(_cudnn_key(q, kf, causal))
    if _flash_ok(q, vis):
        seed, offset = _flash_rng(q.device, q.dtype)
        KERNELS["flash_bwd"] += 1
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, kf, vf, out, lse.contiguous(), None, None, lq, lk, 0.0, causal, seed, offset, scale=scale)
    if q.dtype in _HALF or q.dtype == torch.float32:
        dtype = q.dtype
        if vis is not None and dtype in _HALF:  # see the module docstring: float32 for masked half blocks
            dout, q, kf, vf, out = (x.float() for x in (dout, q, kf, vf, out))
        bias = None
        if vis is not None:
            bias = _bias(vis, q.dtype, 16).expand(q.shape[0], q.shape[1], lq, lk)
        lq32 = -(-lq // 32) * 32  # the kernel's lse is padded to a multiple of 32 rows
        lse_p = torch.full((*lse.shape[:-1], lq32), math.inf, dtype=torch.float32, device=lse.device)
        lse_p[..., :lq] = lse
        empty = torch.empty((), dtype=torch.int64, device=q.device)
        res = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, kf, vf, bias, out, lse_p, empty, empty, 0.0, [True, True, True, False], causal, scale=scale)
        KERNELS["efficient_bwd"] += 1
        return res[0].to(dtype), res[1].to(dtype), res[2].to(dtype)
    raise NotImplementedError(f"no fused CUDA attention for {q.dtype}")


# ------------------------------------------------------------------ public
def block_forward(q, k, v, scale: float, kind: str = "full", mask=None):
    """Attention of one block: queries ``q`` against keys/values ``k``/``v``.

    Args:
        q: ``(B, H, Lq, D)``; float16, bfloat16, float32 or float64; CPU or CUDA.
        k, v: ``(B, Hkv, Lk, D)``, same dtype and device; ``H % Hkv == 0``.
        scale: softmax scale.
        kind: ``"full"`` or ``"causal"`` (square: ``Lq == Lk``).
        mask: optional bool ``(Lq, Lk)``, True = visible (and-ed with ``kind``).

    Returns:
        tuple: ``out`` ``(B, H, Lq, D)`` in the input dtype and ``lse``
        ``(B, H, Lq)`` in float32 (float64 for float64 inputs).
    """
    if kind not in ("full", "causal"):
        raise ValueError(f"kind must be 'full' or 'causal', got {kind!r}")
    h, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    causal = kind == "causal"
    if causal and lq != lk:
        raise ValueError(f"a causal block must be square, got {lq} x {lk}")
    vis = _visible(kind, mask, lq, lk, q.device)
    q = _unit_last(q)
    kf, vf = _unit_last(_expand_kv(k, h)), _unit_last(_expand_kv(v, h))
    if q.is_cuda:  # pragma: no cover - needs a GPU
        try:
            out, lse = _cuda_forward(q, kf, vf, scale, causal and vis is None, vis)
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError):
            return explicit_forward(q, k, v, scale, kind, mask)
    elif q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        KERNELS["cpu_fwd"] += 1
        if vis is None:
            out, lse = op(q, kf, vf, 0.0, causal, scale=scale)
        else:
            out, lse = op(q, kf, vf, 0.0, False, attn_mask=_bias(vis, q.dtype), scale=scale)
    else:
        return explicit_forward(q, k, v, scale, kind, mask)
    if vis is not None:
        out, lse = _fix_empty_rows(out, lse, vis)
    return out, lse


def block_backward(dout, q, k, v, out, lse, scale: float, kind: str = "full", mask=None):
    """Gradients of one block, given the rows' global ``out`` and ``lse``.

    Args:
        dout: ``(B, H, Lq, D)``, the gradient of the rows' output, input dtype.
        q, k, v, scale, kind, mask: as in :func:`block_forward`.
        out: ``(B, H, Lq, D)``, the rows' final (merged) output, input dtype.
        lse: ``(B, H, Lq)``, the rows' final lse (float32, or float64), finite
            on every row that sees a key anywhere.

    Returns:
        tuple: ``dq`` ``(B, H, Lq, D)`` in the input dtype; ``dk``, ``dv``
        ``(B, Hkv, Lk, D)``: in the input dtype, or, when summed over a query
        group (``Hkv < H``), in the accumulation dtype.
    """
    h, hk, lq, lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    causal = kind == "causal"
    if causal and lq != lk:
        raise ValueError(f"a causal block must be square, got {lq} x {lk}")
    vis = _visible(kind, mask, lq, lk, q.device)
    q, dout, out = _unit_last(q), _unit_last(dout), _unit_last(out)
    kf, vf = _unit_last(_expand_kv(k, h)), _unit_last(_expand_kv(v, h))
    if q.is_cuda:  # pragma: no cover - needs a GPU
        try:
            dq, dk, dv = _cuda_backward(dout, q, kf, vf, out, lse, scale, causal and vis is None, vis)
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError):
            return explicit_backward(dout, q, k, v, out, lse, scale, kind, mask)
    elif q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        KERNELS["cpu_bwd"] += 1
        if vis is None:
            dq, dk, dv = op(dout, q, kf, vf, out, lse, 0.0, causal, scale=scale)
        else:
            dq, dk, dv = op(dout, q, kf, vf, out, lse, 0.0, False, attn_mask=_bias(vis, q.dtype), scale=scale)
    else:
        return explicit_backward(dout, q, k, v, out, lse, scale, kind, mask)
    return dq, _group_sum(dk, hk), _group_sum(dv, hk)


def merge(out_acc, lse_acc, out_blk, lse_blk):
    """Fold a block's ``(out, lse)`` into an accumulator, in place.

    ``lse = log(exp(lse_acc) + exp(lse_blk))`` and ``out`` the matching
    weighted sum, computed in the accumulator's dtype.  Rows that no block
    has seen yet (``-inf`` on both sides) stay ``out`` 0, ``lse`` ``-inf``.

    Args:
        out_acc: ``(..., L, D)`` float32 or float64 (written).
        lse_acc: ``(..., L)``, same dtype (written).
        out_blk: ``(..., L, D)``, any float dtype.
        lse_blk: ``(..., L)``.
    """
    new = torch.logaddexp(lse_acc, lse_blk.to(lse_acc.dtype))
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    w_acc = torch.exp(lse_acc - safe).unsqueeze(-1)
    w_blk = torch.exp(lse_blk - safe).unsqueeze(-1)
    out_acc.mul_(w_acc).addcmul_(out_blk, w_blk)
    lse_acc.copy_(new)
    return out_acc, lse_acc


# ------------------------------------------------------------------ planning (host, numpy)
class Piece(NamedTuple):
    """One kernel call of a block: query rows ``[q0, q1)`` against keys ``[k0, k1)``.

    ``kind`` is ``"full"`` or ``"causal"`` (square); ``mask`` is None or a bool
    numpy ``(q1 - q0, k1 - k0)`` array (True = visible)."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str
    mask: object = None

    @property
    def work(self) -> int:
        """Score entries the kernel computes (per batch and head)."""
        n = self.q1 - self.q0
        if self.kind == "causal":
            return n * (n + 1) // 2
        return n * (self.k1 - self.k0)


def _runs(lo, hi, max_runs):
    """Cut the rows into maximal runs of equal ``[lo, hi)`` ("full") or of
    equal ``lo`` and ``hi`` growing by one a row ("diag"); None past ``max_runs``."""
    n = len(lo)
    if n == 1:
        return [(0, 1, "full")]
    dlo, dhi = np.diff(lo), np.diff(hi)
    t = np.full(n - 1, 2, dtype=np.int8)          # 2: the rows do not continue a run
    t[(dlo == 0) & (dhi == 0)] = 0                # same range: a full rectangle
    t[(dlo == 0) & (dhi == 1)] = 1                # one more key a row: a diagonal
    cuts = np.flatnonzero(np.diff(t)) + 1
    if len(cuts) > max_runs:
        return None
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [n - 1]])        # transitions [s0, s1) link rows s0 .. s1
    runs, row = [], 0
    for s0, s1 in zip(starts.tolist(), ends.tolist()):
        if row > s1:
            continue
        a = max(row, s0)
        kind = int(t[s0])
        if kind == 2:
            if s1 - a > max_runs:
                return None
            runs.extend((i, i + 1, "full") for i in range(a, s1))
            row = s1
        else:
            runs.append((a, s1 + 1, "full" if kind == 0 else "diag"))
            row = s1 + 1
        if len(runs) > max_runs:
            return None
    if row < n:
        runs.append((row, n, "full"))
    return runs


#: score entries (per batch and head) one kernel call is charged in :func:`plan_block`'s choice
#: between pieces and one masked call
CALL_COST = 16384


def plan_block(qpos, kpos, causal: bool, cu_seqlens=None, *, call_cost: int | None = None, max_pieces: int = 64):
    """The kernel calls that compute one block exactly once per visible pair.

    Rows are cut into runs (:func:`_runs`); a run where every row sees the
    same keys is one ``"full"`` piece, a run where each row sees one key more
    than the previous is a ``"full"`` piece (the keys all its rows see) plus a
    square ``"causal"`` piece.  The contiguous, striped and zigzag layouts
    give at most two pieces per block this way (striped: the block whose key
    shard's rank is greater than the query shard's rank is the diagonal
    shifted by one row and one column).  When documents cut the block into
    many pieces, and one masked call over the visible rows and keys costs
    less than the pieces (``call_cost`` score entries charged per call), the
    block is one ``"full"`` piece with a mask.

    Args:
        qpos, kpos: ascending int64 positions.
        causal: causal masking.
        cu_seqlens: None or int64 document boundaries.
        call_cost: default :data:`CALL_COST`.
        max_pieces: more runs than this: one masked call.

    Returns:
        list of :class:`Piece` (empty: nothing visible).
    """
    if call_cost is None:
        call_cost = CALL_COST
    lo, hi = visible_ranges(qpos, kpos, causal, cu_seqlens)
    seen = hi > lo
    if not seen.any():
        return []
    lo = np.where(seen, lo, 0)
    hi = np.where(seen, hi, 0)
    pieces = []
    runs = _runs(lo, hi, max_pieces)
    if runs is not None:
        for a, b, kind in runs:
            l, h = int(lo[a]), int(hi[a])
            if b - a == 1:
                kind = "full"
            if kind == "full":
                if h > l:
                    pieces.append(Piece(a, b, l, h, "full"))
                continue
            if h == l:  # the run's first row sees nothing: start one row later
                a, h = a + 1, h + 1
            if a >= b:
                continue
            if h - 1 > l:
                pieces.append(Piece(a, b, l, h - 1, "full"))
            pieces.append(Piece(a, b, h - 1, h - 1 + (b - a), "causal"))
    rows = np.flatnonzero(seen)
    a0, b0 = int(rows[0]), int(rows[-1]) + 1
    k0, k1 = int(lo[seen].min()), int(hi[seen].max())
    box = (b0 - a0) * (k1 - k0)
    if runs is not None and (len(pieces) <= 2 or sum(p.work for p in pieces) + call_cost * len(pieces)
                             <= box + call_cost):
        return pieces
    ar = np.arange(k0, k1)
    mask = (ar >= lo[a0:b0, None]) & (ar < hi[a0:b0, None])
    return [Piece(a0, b0, k0, k1, "full", mask)]


#: query rows per tile in :func:`plan_window_block` (None: from the window, see there)
WINDOW_TILE = None


def plan_window_block(qpos, kpos, causal: bool, cu_seqlens, window, *, tile: int | None = None):
    """The kernel calls of one block under a sliding window: band-shaped
    visibility cut into query tiles.

    What a row of a sliding window sees moves by one key a row, so no run of
    rows shares a range (:func:`plan_block` would fall back to one masked
    call over the whole box, the cost of dense attention).  Here the visible
    rows are cut into tiles of ``tile`` rows; in each tile the keys every row
    sees are one ``"full"`` piece (a fused call, no mask), the keys some rows
    see to its right a square ``"causal"`` piece when they form the
    diagonal (causal windows) or else a masked piece, and those to its left a
    masked piece.  The work is about ``rows * (window + 2 * tile)`` score
    entries instead of ``rows * keys``.

    Args:
        qpos, kpos: ascending int64 positions.
        causal: causal masking.
        cu_seqlens: None or int64 document boundaries.
        window: ``(left, right)`` as in :func:`visible_ranges`.
        tile: rows per tile; default :data:`WINDOW_TILE`, else a quarter of
            the window's span, between 64 and 512 rows.

    Returns:
        list of :class:`Piece` (empty: nothing visible); every visible pair
        is computed exactly once.
    """
    lo, hi = visible_ranges(qpos, kpos, causal, cu_seqlens, window)
    seen = hi > lo
    if not seen.any():
        return []
    if tile is None:
        tile = WINDOW_TILE
    if tile is None:
        left, right = (int(w) for w in window)
        span = (left if left >= 0 else len(kpos)) + (0 if causal else (right if right >= 0 else len(kpos))) + 1
        tile = min(512, max(64, span // 4))
    rows = np.flatnonzero(seen)
    # runs of consecutive visible rows, each cut into tiles
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    pieces = []
    for run in np.split(rows, breaks):
        for a in range(int(run[0]), int(run[-1]) + 1, tile):
            b = min(a + tile, int(run[-1]) + 1)
            pieces.extend(_tile_pieces(a, b, lo[a:b], hi[a:b]))
    return pieces


def _tile_pieces(a, b, lo, hi):
    """Pieces of query rows ``[a, b)`` seeing keys ``[lo[i], hi[i])`` (every row sees one at least)."""
    n = b - a
    minlo, maxlo, minhi, maxhi = int(lo.min()), int(lo.max()), int(hi.min()), int(hi.max())

    def masked(k0, k1):
        ar = np.arange(k0, k1)
        mask = (ar >= lo[:, None]) & (ar < hi[:, None])
        if mask.all():
            return [Piece(a, b, k0, k1, "full")]
        return [Piece(a, b, k0, k1, "full", mask)] if mask.any() else []

    if minhi <= maxlo:  # no key every row sees: one masked call
        return masked(minlo, maxhi)
    out = []
    if maxlo > minlo:
        out += masked(minlo, maxlo)
    c0 = int(hi[0]) - 1  # a causal diagonal: row i sees up to key c0 + i
    if n > 1 and c0 >= maxlo and np.array_equal(hi, hi[0] + np.arange(n)):
        if c0 > maxlo:
            out.append(Piece(a, b, maxlo, c0, "full"))
        out.append(Piece(a, b, c0, c0 + n, "causal"))
        return out
    out.append(Piece(a, b, maxlo, minhi, "full"))
    if maxhi > minhi:
        out += masked(minhi, maxhi)
    return out


# ------------------------------------------------------- helpers of the ring and halo paths
def mask_tensor(piece, device):
    """A piece's boolean mask (numpy) as a tensor on ``device``, or None for a fused piece."""
    return None if piece.mask is None else torch.from_numpy(piece.mask).to(device)


def pack_kv(k, v, idx, dtype=None):
    """K and V (``(B, L, Hkv, D)``) of the tokens ``idx`` (None: all) in one
    contiguous ``(2, B, n, Hkv, D)`` buffer: one message per stream and step."""
    if idx is None:
        buf = torch.stack((k, v))
    else:
        idx = idx.to(k.device)
        buf = torch.stack((k.index_select(1, idx), v.index_select(1, idx)))
    return buf if dtype is None else buf.to(dtype)


def heads_major(buf):
    """``(2, B, n, Hkv, D)`` -> the ``(B, Hkv, n, D)`` views of K and V."""
    return buf[0].transpose(1, 2), buf[1].transpose(1, 2)


class PieceGrads:
    """The backward of a call's pieces against K/V blocks: each piece's dq is
    added into ``dqh`` (the heads-major view of the call's dq accumulator) and
    its dk/dv into the ``(2, B, n, Hkv, D)`` buffer the caller passes (the own
    shard's, or a partial going back to the rows' owner).

    Args:
        doh, qh, oh: dout, q, out, heads-major ``(B, H, L, D)``.
        lse: ``(B, H, L)`` log-sum-exp of the forward.
        scale: the softmax scale.
        dqh: heads-major view of the dq accumulator (accumulation dtype).
    """

    __slots__ = ("doh", "qh", "oh", "lse", "scale", "dqh")

    def __init__(self, doh, qh, oh, lse, scale, dqh):
        self.doh, self.qh, self.oh, self.lse, self.scale, self.dqh = doh, qh, oh, lse, scale, dqh

    def __call__(self, pieces, kb, vb, dkv) -> None:
        dkh, dvh = heads_major(dkv)
        doh, qh, oh, lse, dqh = self.doh, self.qh, self.oh, self.lse, self.dqh
        for p in pieces:
            rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
            dq_p, dk_p, dv_p = block_backward(doh[:, :, rows], qh[:, :, rows], kb[:, :, keys], vb[:, :, keys],
                                              oh[:, :, rows], lse[:, :, rows], self.scale, p.kind,
                                              mask_tensor(p, qh.device))
            dqh[:, :, rows] += dq_p
            dkh[:, :, keys] += dk_p
            dvh[:, :, keys] += dv_p


class PieceFold:
    """The forward of a call's pieces against K/V blocks, folded into one
    accumulator: the first block a query row sees is copied in, later ones
    merged by their log-sum-exp (:func:`merge`).

    Args:
        q: ``(B, L, H, D)`` local queries.
        scale: the softmax scale.

    Attributes:
        out: ``(B, L, H, D)`` accumulator (accumulation dtype).
        lse: ``(B, H, L)`` log-sum-exp (accumulation dtype; ``-inf`` where no key was seen).
    """

    __slots__ = ("qh", "scale", "out", "oh", "lse", "seen")

    def __init__(self, q, scale):
        B, L, H, D = q.shape
        cd = acc_dtype(q.dtype)
        self.qh, self.scale = q.transpose(1, 2), scale
        self.out = torch.zeros(B, L, H, D, dtype=cd, device=q.device)
        self.oh = self.out.transpose(1, 2)
        self.lse = torch.full((B, H, L), -math.inf, dtype=cd, device=q.device)
        self.seen = np.zeros(L, dtype=bool)

    def __call__(self, pieces, kb, vb) -> None:
        qh, oh, lse_acc, seen = self.qh, self.oh, self.lse, self.seen
        for p in pieces:
            o, lse = block_forward(qh[:, :, p.q0:p.q1], kb[:, :, p.k0:p.k1], vb[:, :, p.k0:p.k1], self.scale,
                                   p.kind, mask_tensor(p, qh.device))
            if not seen[p.q0:p.q1].any():  # the first block these rows see: a copy, no merge
                oh[:, :, p.q0:p.q1].copy_(o)
                lse_acc[:, :, p.q0:p.q1].copy_(lse)
            else:
                merge(oh[:, :, p.q0:p.q1], lse_acc[:, :, p.q0:p.q1], o, lse)
            seen[p.q0:p.q1] = True
