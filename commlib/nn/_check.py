"""Argument checks shared by the torch attention functions, and their one validation.

Each check raises what ``bad(message)`` builds (an
:class:`~commlib.core.errors.InvalidArgument` naming the rank and the call);
:func:`validate` runs them into the one attention spec
(:class:`commlib.collectives.attention.spec.AttnSpec`) and agrees it across
ranks in one round before any byte moves, so a bad call fails on every rank
alike.  Every torch variant (ring, bidirectional, Ulysses, hybrid) validates
through it.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from commlib.collectives.attention.layout import agreement_bound as agreement_timeout  # noqa: F401
from commlib.collectives.attention.layout import layout_of
from commlib.collectives.attention.spec import ANY_GRAD, DEVICES, AttnSpec, MaskSpec, agree_spec, describe_grad
from commlib.collectives.attention.spec import DTYPES as DTYPE_NAMES
from commlib.core.errors import InvalidArgument
from commlib.core.seconds import Deadline, timeout_problem

__all__ = ["DTYPES", "DTYPE_NAMES", "DEVICES", "check_qkv", "softmax_scale_of", "cu_seqlens_of", "timeout_of",
           "agreement_timeout", "grad_flags", "describe_grad", "no_double_backward", "autocast_inputs",
           "autocast_off", "sdpa_keywords", "call_problem", "bool_option", "device_code", "validate"]

#: the torch dtypes of :data:`commlib.collectives.attention.spec.DTYPES`, in its order
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def timeout_of(timeout, bad):
    """``timeout`` as seconds: None (no bound) or a finite number > 0 (not a
    bool), or the call's :class:`~commlib.core.seconds.Deadline` (kept as it
    is); anything else raises ``bad(message)`` (:mod:`commlib.core.seconds`)."""
    problem = timeout_problem(timeout, zero=False)
    if problem is not None:
        raise bad(problem)
    if timeout is None or type(timeout) is Deadline:
        return timeout
    return float(timeout)


def grad_flags(*tensors) -> int:
    """Bit ``i`` set when ``tensors[i]`` will receive a gradient from this call
    (grad mode on and ``requires_grad``): the ranks must agree on it, since the
    backward communicates and a rank without one would leave the others waiting."""
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad)


def no_double_backward(bad) -> None:
    """Refuse a backward run with ``create_graph=True`` (grad mode on inside
    the backward): the function's backward is not itself differentiable, and
    without this refusal the second-order terms would be silently dropped."""
    if torch.is_grad_enabled():
        raise bad("the backward is not differentiable (create_graph=True / double backward, e.g. a gradient "
                  "penalty): use ulysses_attention or hybrid_attention with ulysses_degree == size under "
                  "torch.nn.attention.sdpa_kernel(SDPBackend.MATH), or plain torch attention")


def autocast_inputs(*tensors):
    """Cast the inputs as autocast casts those of
    :func:`torch.nn.functional.scaled_dot_product_attention` (an op on
    autocast's lower-precision list): when autocast is on for the tensors'
    device type (CPU or CUDA), every floating-point tensor on that device
    type except float64 goes to autocast's dtype (``torch.get_autocast_dtype``,
    e.g. bfloat16), by a differentiable ``.to`` whose backward returns the
    gradient in the tensor's own dtype.  Anything else passes unchanged
    (the argument checks judge it).

    Returns:
        tuple: ``(tensors, context)``: the (cast) tensors and a context
        manager to run the call in, autocast switched off for that device
        type when it was on (the call's block math and merges then run in
        the cast dtype and the float32/float64 accumulators, as documented,
        and nothing inside is cast twice), else a null context.
    """
    dev = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), None)
    if dev not in DEVICES or not torch.is_autocast_enabled(dev):
        return tensors, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(dev)
    cast = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.device.type == dev and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)
    return cast, torch.autocast(dev, enabled=False)


def autocast_off(device_type: str):
    """A context with autocast switched off for ``device_type`` (for a
    backward: if ``loss.backward()`` runs inside an autocast region, the
    block math still runs in the saved tensors' dtypes)."""
    if device_type in DEVICES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def call_problem(sdpa: dict, bad) -> None:
    """Raise ``bad(message)`` for what the public front found wrong with the
    call on this rank (``sdpa["problem"]``, :mod:`commlib.nn._front`: a
    communicator or layout mix-up, a ``qkv_format`` the shapes contradict), so
    that it is agreed like the other local checks; the first of them."""
    problem = sdpa.get("problem")
    if problem is not None:
        raise bad(problem)


def sdpa_keywords(causal, softmax_scale, heads: int, kv_heads: int, bad, *, attn_mask=None, dropout_p=0.0,
                  is_causal=None, scale=None, enable_gqa=None, problem=None):
    """Resolve the keywords of :func:`torch.nn.functional.scaled_dot_product_attention`
    that the attention calls take, so that a call written for SDPA works or
    fails clearly (``bad(message)``, on every rank alike once agreed):

    * ``is_causal``: SDPA's name for ``causal`` (a bool; passing both with
      different values is refused).
    * ``scale``: SDPA's name for ``softmax_scale`` (passing both is refused).
    * ``enable_gqa``: None or True (grouped-query attention is always on);
      False needs ``heads == kv_heads``, as SDPA requires.
    * ``attn_mask``: only None; masks are ``causal`` and ``cu_seqlens``.
    * ``dropout_p``: only 0 (attention dropout is not implemented).
    * ``problem``: not SDPA's: the front's finding, raised by :func:`call_problem` before.

    Returns:
        tuple: ``(causal, softmax_scale)``, still to be checked by the caller.
    """
    if attn_mask is not None:
        raise bad("attn_mask is not supported (an arbitrary mask cannot be sharded over the ring); use "
                  "causal=True for a causal mask and cu_seqlens=[0, ..., seq_len] for packed documents "
                  "(block-diagonal masks)")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise bad(f"dropout_p must be a number, got {dropout_p!r}")
    if dropout_p != 0:
        raise bad(f"dropout_p={dropout_p!r} is not supported (no attention dropout); pass dropout_p=0.0 and "
                  "regularize elsewhere, e.g. torch.nn.Dropout on the attention output")
    if is_causal is not None:
        if not isinstance(is_causal, (bool, np.bool_)):
            raise bad(f"is_causal must be a bool, got {is_causal!r}")
        if isinstance(causal, (bool, np.bool_)) and causal and not is_causal:
            raise bad("causal=True and is_causal=False disagree; pass one of them (is_causal is SDPA's name "
                      "for causal)")
        causal = bool(is_causal) or causal
    if scale is not None:
        if softmax_scale is not None:
            raise bad(f"pass softmax_scale or scale (SDPA's name for it), not both; got {softmax_scale!r} "
                      f"and {scale!r}")
        softmax_scale = scale
    if enable_gqa is not None:
        if not isinstance(enable_gqa, (bool, np.bool_)):
            raise bad(f"enable_gqa must be a bool, got {enable_gqa!r}")
        if not enable_gqa and heads != kv_heads:
            raise bad(f"enable_gqa=False needs as many kv_heads as heads, got {kv_heads} and {heads}; "
                      "pass enable_gqa=True (or leave it out) for grouped-query attention")
    return causal, softmax_scale


def bool_option(x) -> int:
    """A bool option's header value: 0 or 1, -1 for anything else (for the checks to refuse)."""
    return int(bool(x)) if isinstance(x, (bool, np.bool_)) else -1


def device_code(device: torch.device) -> int:
    """A device's code in an agreed header: its index in :data:`DEVICES`, else ``len(DEVICES)``."""
    return DEVICES.index(device.type) if device.type in DEVICES else len(DEVICES)


def validate(tp, q, k, v, *, op: str, causal, softmax_scale, layout, qkv_format, cu_seqlens, window, timeout,
             sdpa: dict, grads: str = "each", options=(), checks=None) -> AttnSpec:
    """Check a torch attention call on every rank together: its :class:`AttnSpec`.

    This rank's checks first (the front's ``problem``, the tensors, SDPA's
    keywords, layout, scale, timeout, ``cu_seqlens``, window, then
    ``checks(spec)``), then one agreement round
    (:func:`commlib.collectives.attention.spec.agree_spec`): any rank's
    problem becomes an :class:`InvalidArgument` on every rank, and so do
    ranks whose specs differ (shapes, dtype, layout, ``qkv_format``, scale,
    mask, device, gradient flags, ``options``).  On one rank the local
    checks are the whole validation.

    Args:
        tp: the transport of the call's communicator.
        layout: a name or a :class:`~commlib.collectives.attention.layout.Layout`.
        qkv_format: the caller's tensor order (agreed).
        timeout: the call's deadline (:func:`commlib.nn._failure.bound`),
            or None or a number of seconds, checked here (None or finite > 0).
        sdpa: SDPA's keywords and the front's ``problem``
            (:func:`sdpa_keywords`, :func:`call_problem`); the spec's
            ``causal`` and ``scale`` are the resolved ones.
        grads: ``"each"``: which of q, k, v get a gradient is agreed (each
            has its own backward exchange); ``"any"``: only whether any does.
        options: ``((name, int), ...)`` the variant's own agreed options (the
            same names on every rank; a value the checks will refuse may be
            anything).
        checks: ``checks(spec, bad)``, the variant's own local checks.

    Raises:
        InvalidArgument: on every rank alike.
    """
    rank, size = tp.rank, tp.size
    spec = problem = None

    def bad(msg):
        return InvalidArgument(msg, rank=rank, op=op)

    try:
        call_problem(sdpa, bad)
        bsz, L, h, hk, d = check_qkv(q, k, v, bad)
        causal, softmax_scale = sdpa_keywords(causal, softmax_scale, h, hk, bad, **sdpa)
        lay = layout_of(layout, rank=rank, op=op)
        if lay.seq_local_problem(L):
            raise bad(f"{lay.seq_local_problem(L)} (shard with shard_sequence)")
        if not isinstance(causal, (bool, np.bool_)):
            raise bad(f"causal must be a bool, got {causal!r}")
        scale = softmax_scale_of(softmax_scale, d, bad)
        timeout = timeout_of(timeout, bad)
        cu = cu_seqlens_of(cu_seqlens, size * L, bad)
        mask = MaskSpec.checked(causal, total=size * L, bad=bad, cu_seqlens=cu, window=window)
        flags = grad_flags(q, k, v)
        opts = (("device", device_code(q.device)), ("requires_grad", ANY_GRAD if grads == "any" and flags else flags))
        spec = AttnSpec(op, rank, size, bsz, L, h, hk, d, DTYPE_NAMES[DTYPES.index(q.dtype)], scale, mask, lay,
                        qkv_format, size * L, opts + tuple((n, int(val)) for n, val in options), timeout)
        if checks is not None:
            checks(spec, bad)
    except InvalidArgument as exc:
        if size == 1:
            raise
        problem = exc
    if size == 1:  # nobody to disagree with
        return spec
    return agree_spec(tp, spec, problem, op=op, options=("device", "requires_grad") + tuple(n for n, _ in options),
                      timeout=timeout)
