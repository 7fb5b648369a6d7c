"""One attention spec: the validated call every attention variant of both layers builds and agrees.

Every attention variant (the numpy/CuPy ring and Ulysses here, the torch
ring, bidirectional ring, Ulysses, hybrid and module in :mod:`commlib.nn`)
checks its own arguments into one :class:`AttnSpec`, then agrees across ranks
on its header in one round (:func:`agree_spec`, over
:func:`commlib.collectives.agreement.agree_call`).  The spec is
framework-neutral (no torch here: dtype and device by name); its mask
features — causal, packed documents (``cu_seqlens``), sliding window — are
one :class:`MaskSpec` member, whose fields, wire encoding and description in
a disagreement are declared here once.  So a new mask feature adds a field
to :class:`MaskSpec` (and its meaning in :func:`.window.visible_ranges`), not
one in each variant; a variant's own agreed options (the ring's
``bidirectional``, the hybrid's ``ulysses_degree``, the numpy tile, the torch
layer's device and gradient flags) ride in :attr:`AttnSpec.options`, named
and described by the same :func:`describe`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from commlib.core.errors import InvalidArgument

from ..agreement import agree_call
from .layout import LAYOUTS, Layout, agreement_bound
from .window import effective_window, window_of

__all__ = ["MaskSpec", "AttnSpec", "FIELDS", "DTYPES", "FORMATS", "DEVICES", "describe", "describe_grad",
           "agree_spec"]

#: the dtypes both layers take (their index is the header's code)
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: the tensor orders the attention calls take (Transformer Engine's names):
#: ``(batch, seq, heads, head_dim)`` and SDPA's ``(batch, heads, seq, head_dim)``
FORMATS = ("bshd", "bhsd")
#: device types (the torch layer's ``device`` option; code 2: any other)
DEVICES = ("cpu", "cuda")
#: ``requires_grad`` option value of a call that needs only to know whether
#: any of q, k, v gets a gradient (bit 3; bits 0-2: which of q, k, v do)
ANY_GRAD = 8


@dataclass(frozen=True)
class MaskSpec:
    """The mask features of an attention call, validated.

    Attributes:
        causal: a query sees no key at a later global position.
        cu_seqlens: global document boundaries ``(0, ..., total)`` (ints), or
            None (one document).
        window: the effective sliding window ``(left, right)``
            (:func:`.window.effective_window`: None when it hides nothing).
    """

    causal: bool = False
    cu_seqlens: tuple | None = None
    window: tuple | None = None

    #: the header fields, in wire order
    FIELDS: ClassVar[tuple] = ("causal", "cu_seqlens length", "cu_seqlens", "window left", "window right")

    @classmethod
    def of(cls, causal, cu_seqlens=None, window=None) -> "MaskSpec":
        """From validated values (``cu_seqlens`` any int sequence or array)."""
        cu = None if cu_seqlens is None else tuple(int(c) for c in np.asarray(cu_seqlens).reshape(-1))
        return cls(bool(causal), cu, None if window is None else (int(window[0]), int(window[1])))

    @classmethod
    def checked(cls, causal, *, total: int, bad, cu_seqlens=None, window=None) -> "MaskSpec":
        """The mask of a call's arguments: ``window`` checked
        (:func:`.window.window_of`: what ``bad(message)`` builds is raised)
        and reduced to its effective value over ``total`` tokens
        (:func:`.window.effective_window`); ``causal`` a checked bool,
        ``cu_seqlens`` checked boundaries or None.  Both layers' validations
        call this, so a new mask feature's check lands here too."""
        return cls.of(causal, cu_seqlens, effective_window(window_of(window, bad), bool(causal), int(total)))

    def header(self) -> tuple:
        """The fields of :attr:`FIELDS` as ints: ``cu_seqlens`` by its length
        (-1: none) and a 64-bit SHA-256 digest, the window as ``(-2, -2)`` when
        there is none."""
        if self.cu_seqlens is None:
            n, digest = -1, 0
        else:
            raw = np.asarray(self.cu_seqlens, dtype=np.int64).tobytes()
            n, digest = len(self.cu_seqlens), int.from_bytes(hashlib.sha256(raw).digest()[:8], "little", signed=True)
        left, right = self.window if self.window is not None else (-2, -2)
        return (int(self.causal), n, digest, left, right)

    @staticmethod
    def describe(name: str, value: int):
        """A mask field's header value as the caller wrote it; ``NotImplemented`` for another field."""
        if name == "causal":
            return bool(value)
        if name == "cu_seqlens length":
            return "none" if value < 0 else f"{value} entries"
        if name == "cu_seqlens":
            return "none" if value == 0 else f"digest {value & 0xFFFFFFFF:08x}"
        if name in ("window left", "window right"):
            return {-2: "no window", -1: "unbounded"}.get(value, value)
        return NotImplemented


def describe_grad(value: int, names=("q", "k", "v")) -> str:
    """A ``requires_grad`` header value in words: bit ``i`` set when
    ``names[i]`` gets a gradient, or :data:`ANY_GRAD` (any of them)."""
    if value & ANY_GRAD:
        return "a gradient of q, k or v"
    need = [n for i, n in enumerate(names) if value >> i & 1]
    return "requires_grad on " + ", ".join(need) if need else "no gradient (torch.no_grad or requires_grad=False)"


def _code(seq, value) -> int:
    return seq.index(value) if value in seq else len(seq)


@dataclass(frozen=True)
class AttnSpec:
    """A validated attention call, the same type in both layers.

    Attributes:
        op: the call's name (in errors); rank, size: this rank and the group's size.
        batch, seq_local, heads, kv_heads, head_dim: the shapes (q ``(batch,
            seq_local, heads, head_dim)``, k and v with ``kv_heads``).
        dtype: the inputs' dtype by name (one of :data:`DTYPES`).
        scale: the softmax scale.
        mask: the :class:`MaskSpec` (causal, documents, window).
        layout: the :class:`.layout.Layout` of the shards.
        qkv_format: the caller's tensor order (one of :data:`FORMATS`).
        seq_len: the true global length (``size * seq_local`` unless padded).
        options: ``((name, int), ...)``: the variant's own agreed options.
        timeout: the call's deadline (not agreed: it may differ by rank).
        xp, array_dtype, cdtype: the numpy/CuPy layer's array module, input
            dtype object and accumulation dtype (not agreed; None in the torch layer).
    """

    op: str
    rank: int
    size: int
    batch: int
    seq_local: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    scale: float
    mask: MaskSpec
    layout: Layout
    qkv_format: str = "bshd"
    seq_len: int | None = None
    options: tuple = ()
    timeout: object = field(default=None, compare=False)
    xp: object = field(default=None, compare=False)
    array_dtype: object = field(default=None, compare=False)
    cdtype: object = field(default=None, compare=False)

    def __post_init__(self):
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", self.size * self.seq_local)

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def cu_seqlens(self):
        return self.mask.cu_seqlens

    @property
    def window(self):
        return self.mask.window

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    def option(self, name: str):
        """The value of option ``name`` (KeyError if the variant has none)."""
        return dict(self.options)[name]

    def header(self) -> tuple:
        """The spec as the ints of :data:`FIELDS` then its options' (the
        scale by its float64 bits)."""
        return (self.batch, self.seq_local, self.heads, self.kv_heads, self.head_dim, _code(DTYPES, self.dtype),
                self.layout.code, _code(FORMATS, self.qkv_format), self.seq_len,
                int(np.float64(self.scale).view(np.int64)), *self.mask.header(),
                *(int(v) for _, v in self.options))


#: the header fields of every attention call, in wire order (a variant's options follow)
FIELDS = ("batch", "seq_local", "heads", "kv_heads", "head_dim", "dtype", "layout", "qkv_format", "seq_len",
          "softmax_scale") + MaskSpec.FIELDS


def describe(name: str, value: int):
    """A header field's value as the caller wrote it, for the disagreement message."""
    got = MaskSpec.describe(name, value)
    if got is not NotImplemented:
        return got
    names = {"dtype": DTYPES, "layout": LAYOUTS, "qkv_format": FORMATS, "device": DEVICES + ("other",)}
    if name in names:
        seq = names[name]
        return (repr(seq[value]) if name in ("layout", "qkv_format") else seq[value]) if 0 <= value < len(seq) \
            else value
    if name == "softmax_scale":
        return float(np.int64(value).view(np.float64))
    if name == "bidirectional":
        return bool(value)
    if name == "requires_grad":
        return describe_grad(value)
    return value


def _disagreement(message: str, *, rank, op) -> InvalidArgument:
    return InvalidArgument(f"ranks disagree on the call ({message}); every rank must pass the same shapes, "
                           "dtype, device, layout, qkv_format, options and mask (causal, cu_seqlens, window)",
                           rank=rank, op=op)


def agree_spec(tp, spec: AttnSpec | None, problem, *, op: str, options=(), timeout=None) -> AttnSpec | None:
    """One agreement round over ``spec``'s header (:func:`..agreement.agree_call`):
    did any rank refuse its own arguments (``problem``, then ``spec`` is
    None), and do the specs agree; bounded by the call's ``timeout`` (a rank
    that never makes the call must not strand the others).

    Args:
        options: the names of the variant's options (the same on every
            rank, whether or not its arguments were valid).

    Returns:
        ``spec``.

    Raises:
        InvalidArgument: on every rank alike (``problem`` on its rank, naming
            that rank elsewhere; the differing fields when the specs differ).
    """
    header = None if spec is None or problem is not None else spec.header()
    agree_call(tp, header, op=op, names=FIELDS + tuple(options), local_error=problem,
               timeout=agreement_bound(timeout), describe=describe, exc_type=_disagreement)
    return spec
