"""What a query sees, as one spec: the mask features every attention call agrees on.

Every attention variant of both layers (the numpy/CuPy ring and Ulysses here,
the torch ring, Ulysses and hybrid in :mod:`commlib.nn`) validates its own
arguments, then agrees across ranks on one header
(:func:`commlib.collectives.agreement.agree_call`).  The header's mask part
— causal, packed documents (``cu_seqlens``), sliding window — is this
:class:`MaskSpec`: its fields, their wire encoding and their description in a
disagreement are declared here once, so a new mask feature adds a field here
(and its meaning in :func:`.window.visible_ranges`), not one in each variant.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

__all__ = ["MaskSpec", "describe_with"]


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


def describe_with(own: Callable[[str, int], object]) -> Callable[[str, int], object]:
    """A header's ``describe``: :meth:`MaskSpec.describe` for the mask's
    fields, ``own(name, value)`` for the variant's."""
    def describe(name: str, value: int):
        got = MaskSpec.describe(name, value)
        return own(name, value) if got is NotImplemented else got
    return describe
