"""Argument checks shared by the torch attention functions (one rank's view).

Each function raises what ``bad(message)`` builds (an
:class:`~commlib.core.errors.InvalidArgument` naming the rank and the call);
the callers then agree across ranks (:mod:`commlib.collectives.agreement`)
before any byte moves, so a bad call fails on every rank alike.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from commlib.collectives.attention.layout import agreement_bound as agreement_timeout  # noqa: F401
from commlib.core.seconds import timeout_problem

__all__ = ["DTYPES", "DTYPE_NAMES", "DEVICES", "check_qkv", "softmax_scale_of", "cu_seqlens_of", "timeout_of",
           "agreement_timeout", "grad_flags", "describe_grad", "no_double_backward"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
DEVICES = ("cpu", "cuda")


def check_qkv(q, k, v, bad) -> tuple[int, int, int, int, int]:
    """Check q ``(batch, seq_local, heads, head_dim)`` and k, v
    ``(batch, seq_local, kv_heads, head_dim)``: torch tensors of one supported
    dtype on one CPU or CUDA device, ``heads % kv_heads == 0``, nothing empty.

    Returns:
        ``(batch, seq_local, heads, kv_heads, head_dim)``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise bad(f"{name} must be a torch tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise bad(f"{name} must be 4-d (batch, seq_local, heads, head_dim), got shape {tuple(x.shape)}")
    if q.dtype not in DTYPES:
        raise bad(f"dtype {q.dtype} is not supported; use one of {DTYPE_NAMES}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise bad(f"{name} has dtype {x.dtype}, q has {q.dtype}")
        if x.device != q.device:
            raise bad(f"{name} is on {x.device}, q is on {q.device}")
    if q.device.type not in DEVICES:
        raise bad(f"device {q.device} is not supported; use CPU or CUDA tensors")
    bsz, L, h, d = (int(s) for s in q.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise bad(f"k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    kb, kl, hk, kd = (int(s) for s in k.shape)
    if kb != bsz or kl != L or kd != d:
        raise bad(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch, seq_local "
                  "or head_dim")
    if min(bsz, L, h, d) < 1:
        raise bad(f"empty q: shape {tuple(q.shape)}")
    if hk < 1 or h % hk:
        raise bad(f"heads {h} is not a multiple of kv_heads {hk}")
    return bsz, L, h, hk, d


def softmax_scale_of(softmax_scale, head_dim: int, bad) -> float:
    """The score scale: ``head_dim ** -0.5`` for None, else a positive finite float."""
    if softmax_scale is None:
        return head_dim ** -0.5
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise bad(f"softmax_scale must be a positive float, got {softmax_scale!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise bad(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    return scale


def cu_seqlens_of(cu, total: int, bad):
    """``cu_seqlens`` (FlashAttention's convention: global document boundaries
    ``0 = c_0 <= c_1 <= ... <= c_n = total``) as an int64 numpy array; None stays None.

    Args:
        cu: an integer tensor (any device) or sequence of ints.
        total: the global sequence length (tokens).
    """
    if cu is None:
        return None
    if isinstance(cu, torch.Tensor):
        if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise bad(f"cu_seqlens must hold integers, got a {cu.dtype} tensor")
        arr = cu.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(cu)
        except Exception:  # noqa: BLE001 - any unconvertible object is a bad argument
            raise bad(f"cu_seqlens must be a 1-d sequence of ints, got {type(cu).__name__}") from None
        if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
            raise bad(f"cu_seqlens must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.size < 2:
        raise bad(f"cu_seqlens must be 1-d with at least 2 entries, got shape {tuple(arr.shape)}")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or arr[-1] != total:
        raise bad(f"cu_seqlens must run from 0 to the global length size * seq_local = {total}, "
                  f"got {int(arr[0])} .. {int(arr[-1])}")
    if np.any(np.diff(arr) < 0):
        raise bad("cu_seqlens must be non-decreasing")
    return arr


def timeout_of(timeout, bad) -> float | None:
    """``timeout`` as seconds: None (no bound) or a finite number > 0 (not a
    bool); anything else raises ``bad(message)`` (:mod:`commlib.core.seconds`)."""
    problem = timeout_problem(timeout, zero=False)
    if problem is not None:
        raise bad(problem)
    return None if timeout is None else float(timeout)


def grad_flags(*tensors) -> int:
    """Bit ``i`` set when ``tensors[i]`` will receive a gradient from this call
    (grad mode on and ``requires_grad``): the ranks must agree on it, since the
    backward communicates and a rank without one would leave the others waiting."""
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad)


def describe_grad(value: int, names=("q", "k", "v")) -> str:
    """A :func:`grad_flags` value in words, for the disagreement message."""
    need = [n for i, n in enumerate(names) if value >> i & 1]
    return "requires_grad on " + ", ".join(need) if need else "no gradient (torch.no_grad or requires_grad=False)"


def no_double_backward(bad) -> None:
    """Refuse a backward run with ``create_graph=True`` (grad mode on inside
    the backward): the function's backward is not itself differentiable, and
    without this refusal the second-order terms would be silently dropped."""
    if torch.is_grad_enabled():
        raise bad("the backward is not differentiable (create_graph=True / double backward, e.g. a gradient "
                  "penalty): use ulysses_attention or hybrid_attention with ulysses_degree == size under "
                  "torch.nn.attention.sdpa_kernel(SDPBackend.MATH), or plain torch attention")
