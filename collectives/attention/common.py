"""Argument checks shared by the attention algorithms.

Each rank first checks its own arguments; then the ranks agree through
:mod:`commlib.collectives.agreement` (the protocol the collectives use), before
any K/V message is posted, in one round (:func:`..agreement.agree_call`): that
no rank's arguments were invalid and that every rank passed the same shapes,
dtype and options (a header of attention's own fields).  So a bad call — on one rank or on all, including
shapes that differ between ranks — raises :class:`InvalidArgument` on every
rank instead of deadlocking the ring.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from commlib.core.buffer import as_buffer, cupy_usable

from commlib.core.errors import CommError, InvalidArgument
from commlib.core.seconds import check_timeout

from .blocks import SUPPORTED_DTYPES, compute_dtype, get_array_module
from .layout import layout_of
from .spec import FORMATS, AttnSpec, MaskSpec, agree_spec

__all__ = ["AttnSpec", "validate", "is_comm", "comm_last", "FORMATS", "in_format"]


def is_comm(x) -> bool:
    """Whether ``x`` looks like a communicator (a :class:`commlib.Communicator`,
    a transport, anything with ``rank`` and ``size`` that is not an array):
    what tells the attention calls' argument order apart."""
    return x is not None and not hasattr(x, "shape") and hasattr(x, "rank") and hasattr(x, "size")


def comm_last(op: str, arrays: tuple, comm, *, stacklevel: int = 3, sharding: bool = False):
    """The arrays and the communicator of an attention call written either way.

    The documented order, the same in the numpy/CuPy and the torch layer, is
    the arrays first and the communicator after them (``ring_attention(q, k,
    v, comm)``, as :func:`torch.nn.functional.scaled_dot_product_attention`
    takes q, k, v first).  The old numpy order, the communicator first
    (``ring_attention(comm, q, k, v)``), still works with a
    ``DeprecationWarning``: the positional arguments are shifted back.

    Args:
        op: the call's name, for the messages.
        arrays: the positional arrays as the call received them (``q, k, v``,
            or ``q, k, v, out, lse, dout`` for a backward).
        comm: what the call received in the communicator's slot.
        sharding: a ``commlib.nn.Sharding`` is accepted (the torch layer,
            which takes its layout); else refused.

    Returns:
        tuple: ``(arrays, comm)`` in the documented order.

    Raises:
        InvalidArgument: no communicator in the communicator's slot nor, in
            the old order, in the first one (naming the rank when a
            communicator sits in another slot); a ``commlib.nn.Sharding``
            (the torch layer's; its layout would be ignored here).
    """
    if is_comm(arrays[0]) and not is_comm(comm):
        warnings.warn(f"{op}(comm, q, k, v, ...) is deprecated: pass the communicator after the arrays, "
                      f"{op}(q, k, v, comm, ...) (one order in commlib and commlib.nn)", DeprecationWarning,
                      stacklevel=stacklevel)
        return tuple(arrays[1:]) + (comm,), arrays[0]
    if not is_comm(comm):
        where = next((i for i, a in enumerate(arrays) if is_comm(a)), None)
        rank = None if where is None else getattr(arrays[where], "rank", None)
        slot = "" if where is None else f" (a communicator was passed as argument {where + 1})"
        n = len(arrays)
        raise InvalidArgument(f"argument {n + 1} must be the communicator (a commlib.Communicator or a transport "
                              f"with rank, size, isend, irecv and waitall), got {type(comm).__name__}{slot}; "
                              f"the order is {op}({', '.join(_NAMES[n])}, comm, ...)", rank=rank, op=op)
    if not sharding and hasattr(comm, "layout") and callable(getattr(comm, "shard", None)) \
            and is_comm(getattr(comm, "comm", None)):
        # a commlib.nn.Sharding: its layout would be ignored here (the numpy calls take layout=)
        raise InvalidArgument(f"a commlib.nn.Sharding (layout {comm.layout!r}) is for torch tensors; for numpy/CuPy "
                              f"arrays pass its communicator and layout: {op}(..., sharding.comm, "
                              f"layout=sharding.layout)", rank=getattr(comm, "rank", None), op=op)
    return tuple(arrays), comm


_NAMES = {3: ("q", "k", "v"), 6: ("q", "k", "v", "out", "lse", "dout")}

def in_format(qkv_format, *arrays):
    """Swap the 4-d arrays' axes 1 and 2 (a view) when ``qkv_format`` is
    ``"bhsd"``: the calls' inputs to ``"bshd"`` and their results back; lse
    (3-d) and anything else pass unchanged.

    Returns:
        tuple: ``(arrays, problem)``: ``problem`` a message for an unknown
        ``qkv_format`` (the arrays then unchanged), to be agreed, else None.
    """
    if not isinstance(qkv_format, str) or qkv_format not in FORMATS:
        return arrays, f"qkv_format must be one of {FORMATS}, got {qkv_format!r}"
    if qkv_format == "bhsd":
        arrays = tuple(x.swapaxes(1, 2) if getattr(x, "ndim", 0) == 4 else x for x in arrays)
    return arrays, None


def _dtype_name(x) -> str:
    try:
        return np.dtype(x.dtype).name
    except TypeError:  # pragma: no cover - exotic dtype objects
        return str(x.dtype)


def as_array_api(*arrays):
    """The arrays as numpy or CuPy: numpy and CuPy arrays as they are; any
    other device array (torch CUDA tensors, numba device arrays, anything with
    ``__cuda_array_interface__`` or DLPack) wrapped as a CuPy array sharing its
    memory, through the one device-array adapter, when CuPy runs; anything else
    unchanged (the argument check then refuses it).  Outputs of the attention
    calls are then CuPy arrays (``torch.as_tensor(out, device="cuda")`` wraps
    one without a copy)."""
    out = []
    for x in arrays:
        if x is None or isinstance(x, np.ndarray) or type(x).__module__.split(".")[0] == "cupy":
            out.append(x)
            continue
        try:
            b = as_buffer(x, op="attention")
        except CommError:
            out.append(x)
            continue
        out.append(b.as_cupy() if b.is_device and cupy_usable() else x)
    return tuple(out)


def validate(transport, q, k, v, *, causal, layout, softmax_scale, seq_len, tile, op, extra=None,
             timeout=None, window=None, problem=None, qkv_format="bshd") -> AttnSpec:
    """Check an attention call on every rank together and return its :class:`.spec.AttnSpec`.

    Args:
        transport: the call's transport (:func:`.transport.transport_of`).
        layout: a name of :data:`.layout.LAYOUTS` or a :class:`.layout.Layout`
            (the spec holds the Layout).
        timeout: the call's ``timeout``: None or a finite number of seconds
            > 0 (0, a poll, would strand the other ranks mid-ring).  Checked
            here so that a bad value on one rank is refused on every rank
            before any message is posted; valid values may differ by rank.
        window: None or a sliding window ``(left, right)`` (ints >= -1,
            :func:`.window.window_of`); the spec holds its effective value.
        problem: a message the caller found wrong before (an unknown
            ``qkv_format``), raised first, agreed like the others.
        qkv_format: the caller's tensor order (agreed: ranks passing
            different orders are refused).

    Raises:
        InvalidArgument: on every rank alike when any rank's arguments are bad
            (that rank names its problem, the others name that rank) or when
            the ranks' shapes, dtypes or options differ.
    """
    found, refused, spec = problem, None, None
    try:
        if found is not None:
            raise InvalidArgument(found, rank=transport.rank, op=op)
        spec = _validate_local(transport, q, k, v, causal=causal, layout=layout, softmax_scale=softmax_scale,
                               seq_len=seq_len, tile=tile, op=op, extra=extra, window=window, timeout=timeout,
                               qkv_format=qkv_format)
        check_timeout(timeout, op=op, rank=transport.rank)
    except InvalidArgument as exc:
        refused = exc
    # one round: did any rank refuse, and do the specs agree, in attention's words
    return agree_spec(transport, spec, refused, op=op, options=_OPTIONS, timeout=timeout)


#: the numpy/CuPy calls' own agreed options (:attr:`.spec.AttnSpec.options`)
_OPTIONS = ("tile",)


def _validate_local(transport, q, k, v, *, causal, layout, softmax_scale, seq_len, tile, op, extra=None,
                    window=None, timeout=None, qkv_format="bshd") -> AttnSpec:
    """Check this rank's arguments and return its :class:`.spec.AttnSpec`.

    Args:
        extra: ``{name: (array, expected_shape, dtype or None)}`` for the
            backward's ``out``, ``lse`` and ``dout`` (dtype None: float32 or float64).

    Raises:
        InvalidArgument: naming ``transport.rank`` and ``op``.
    """
    rank = transport.rank
    size = transport.size

    def bad(msg):
        return InvalidArgument(msg, rank=rank, op=op)

    layout = layout_of(layout, rank=rank, op=op)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise bad(f"{name} must be a numpy or CuPy array, got {type(x).__name__}")
        if x.ndim != 4:
            raise bad(f"{name} must be 4-d (batch, seq_local, heads, head_dim), got shape {tuple(x.shape)}")
    if type(q).__module__.split(".")[0] == "torch":
        raise bad(f"q is a torch tensor: the numpy/CuPy {op} would lose its autograd graph; use "
                  f"commlib.nn.{op.removesuffix('_backward')} (a torch autograd function, the same arguments)")
    xp = get_array_module(q)
    if xp is np and not isinstance(q, np.ndarray):
        raise bad(f"q is a {type(q).__name__}: pass numpy or CuPy arrays (cupy.asarray wraps numba device "
                  "arrays without a copy)")
    for name, x in (("k", k), ("v", v)):
        if get_array_module(x) is not xp:
            raise bad(f"q and {name} live in different array modules (numpy vs CuPy)")
    dname = _dtype_name(q)
    if dname not in SUPPORTED_DTYPES:
        raise bad(f"dtype {dname} is not supported; use one of {SUPPORTED_DTYPES}")
    for name, x in (("k", k), ("v", v)):
        if _dtype_name(x) != dname:
            raise bad(f"{name} has dtype {_dtype_name(x)}, q has {dname}")
    bsz, L, h, d = (int(s) for s in q.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise bad(f"k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    kb, kl, hk, kd = (int(s) for s in k.shape)
    if kb != bsz or kl != L or kd != d:
        raise bad(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch, seq_local or head_dim")
    if hk < 1 or h % hk:
        raise bad(f"heads {h} is not a multiple of kv_heads {hk}")
    if layout.seq_local_problem(L):
        raise bad(f"{layout.seq_local_problem(L)} (pad with shard_sequence)")
    n = size * L if seq_len is None else seq_len
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise bad(f"seq_len must be a non-negative int, got {seq_len!r}")
    n = int(n)
    if layout.local_seq_len(n, size) != L:
        raise bad(f"seq_local {L} does not match seq_len {n} on {size} ranks with layout {layout!r} "
                  f"(expected {layout.local_seq_len(n, size)}; shard with shard_sequence)")
    if softmax_scale is None:
        scale = d ** -0.5 if d else 1.0
    else:
        try:
            scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise bad(f"softmax_scale must be a positive float, got {softmax_scale!r}") from None
        if not (math.isfinite(scale) and scale > 0):
            raise bad(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)) or tile < 1:
        raise bad(f"tile must be a positive int, got {tile!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise bad(f"causal must be a bool, got {causal!r}")
    for name, (x, shape, dt) in (extra or {}).items():
        if not hasattr(x, "shape"):
            raise bad(f"{name} must be an array, got {type(x).__name__}")
        if get_array_module(x) is not xp:
            raise bad(f"q and {name} live in different array modules (numpy vs CuPy)")
        if tuple(x.shape) != tuple(shape):
            raise bad(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
        xd = _dtype_name(x)
        if dt is None:
            if xd not in ("float32", "float64"):
                raise bad(f"{name} must be float32 or float64, got {xd}")
        elif xd != dt:
            raise bad(f"{name} has dtype {xd}, expected {dt}")
    mask = MaskSpec.checked(causal, total=n, bad=bad, window=window)
    return AttnSpec(op, rank, size, bsz, L, h, hk, d, dname, scale, mask, layout, qkv_format, n,
                    (("tile", int(tile)),), timeout, xp, np.dtype(q.dtype), compute_dtype(q.dtype))
