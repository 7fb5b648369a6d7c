"""``pack`` and ``unpack``: move a datatype's bytes between a buffer and a
contiguous byte array, on the host (numba) or on the device (numba.cuda).

The packed bytes equal ``MPI_Pack``'s (MPI-4.0 §5.2) for a homogeneous run: the
type map's bytes in type-map order, element after element, ``count * size``
bytes in all.  The buffer's first byte is the type map's origin (displacement 0),
or ``origin`` bytes into the buffer when given (for types with negative
displacements, e.g. negative strides).

A plan per ``(datatype, count)`` is built once and cached on the type: the
canonical strided block of all ``count`` elements (or the offsets/lengths form),
the widest word the alignment allows, the byte range touched (for validation)
and, lazily, whether an unpack would write a byte twice.  Everything is checked
before a byte moves.
"""
from __future__ import annotations

import numpy as np

from commlib.errors import BufferError, DatatypeError

from . import _host
from . import canonical as _c
from .types import Datatype, as_datatype

__all__ = ["pack", "unpack", "plan_for"]

_WORD = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}
_TILE_LIMIT = 1 << 16  # tile an irregular element over count when this small
_ENUM_LIMIT = 1 << 24  # blocks enumerated for the exact overlap check


def _word_of(values) -> int:
    acc = 0
    for v in values:
        acc |= int(v)
    w = 8
    while w > 1 and acc % w:
        w //= 2
    return w


class Plan:
    """How to pack ``count`` elements of one type (cached on the type).

    Attributes:
        kind: ``"empty"``, ``"contig"`` (one run), ``"strided"`` or ``"blocks"``.
        nbytes: packed bytes, ``count * size``.
        lo, hi: lowest byte offset touched, one past the highest (bytes, from the origin).
        word: widest word (bytes) dividing every offset, length and stride.
        layout: the canonical StridedBlock (all count elements), or Blocks of one
            element (then ``count`` and ``extent`` repeat it).
    """

    __slots__ = ("kind", "nbytes", "lo", "hi", "word", "layout", "count", "extent", "_words",
                 "_overlap", "_dev", "start")

    def __init__(self, t: Datatype, count: int):
        self.count = count
        self.extent = t.extent
        self.nbytes = count * t.size
        self._words = {}
        self._dev = {}
        self._overlap = None
        lay = t.canonical()
        if self.nbytes == 0:
            self.kind, self.layout, self.lo, self.hi, self.word, self.start = "empty", _c.EMPTY, 0, 0, 8, 0
            return
        if isinstance(lay, _c.Blocks) and lay.nblocks * count <= _TILE_LIMIT and count > 1:
            lay = _c.replicate(lay, (count,), (t.extent,))
            count = 1
        if isinstance(lay, _c.StridedBlock):
            lay = _c.normalize(lay.start, lay.counts + (count,), lay.strides + (t.extent,))
            self.count, self.extent = 1, 0
            self.layout = lay
            self.kind = "contig" if lay.ndim == 1 else "strided"
            self.lo, self.hi = lay.bounds()
            self.start = lay.start
            self.word = _word_of((lay.start, lay.counts[0]) + tuple(abs(s) for s in lay.strides[1:]))
        else:
            self.count = count
            self.layout = lay
            self.kind = "blocks"
            lo, hi = lay.bounds()
            span = (count - 1) * t.extent
            self.lo, self.hi = lo + min(0, span), hi + max(0, span)
            self.start = 0
            acc = int(np.bitwise_or.reduce(lay.offsets)) | int(np.bitwise_or.reduce(lay.lengths)) | abs(t.extent)
            self.word = _word_of((acc,))

    # ----------------------------------------------------------- word scaling
    def words(self, w: int):
        """Layout arrays scaled to ``w``-byte words (cached)."""
        r = self._words.get(w)
        if r is None:
            lay = self.layout
            if self.kind == "strided":
                r = (lay.counts[0] // w,
                     np.array(lay.counts[1:], np.int64),
                     np.array([s // w for s in lay.strides[1:]], np.int64))
            elif self.kind == "blocks":
                r = (lay.offsets // w, lay.lengths // w, self.extent // w)
            else:
                r = ()
            self._words[w] = r
        return r

    # ----------------------------------------------------------- overlap
    def overlaps(self) -> bool:
        """True when some byte is touched twice (an unpack would be ill-defined)."""
        if self._overlap is None:
            self._overlap = self._compute_overlap()
        return self._overlap

    def _compute_overlap(self) -> bool:
        if self.kind in ("empty", "contig"):
            return False
        if self.kind == "strided":
            lay = self.layout
            dims = sorted(zip(lay.strides[1:], lay.counts[1:]), key=lambda x: abs(x[0]))
            span = lay.counts[0]
            ok = True
            for s, c in dims:
                if abs(s) < span:
                    ok = False
                    break
                span += abs(s) * (c - 1)
            if ok:
                return False
            if lay.size // lay.counts[0] > _ENUM_LIMIT:
                return True  # conservative
            blocks = lay.to_blocks()
            offs, lens = blocks.offsets, blocks.lengths
        else:
            b = self.layout
            if b.nblocks * self.count > _ENUM_LIMIT:
                return True  # pragma: no cover - conservative
            d = np.arange(self.count, dtype=np.int64)[:, None] * self.extent
            offs = (d + b.offsets[None, :]).ravel()
            lens = np.broadcast_to(b.lengths[None, :], (self.count, b.nblocks)).ravel()
        order = np.argsort(offs, kind="stable")
        o, n = offs[order], lens[order]
        return bool(np.any(o[:-1] + n[:-1] > o[1:]))


def plan_for(datatype, count: int = 1) -> Plan:
    """The cached :class:`Plan` for ``count`` elements of ``datatype``."""
    t = datatype if isinstance(datatype, Datatype) else as_datatype(datatype, "pack")
    p = t._plans.get(count)
    if p is None:
        p = t._plans[count] = Plan(t, count)
    return p


def _resolve(datatype, count, op):
    if isinstance(datatype, Datatype):
        t = datatype
    else:
        try:
            t = as_datatype(datatype, op)
        except DatatypeError as exc:
            raise DatatypeError(exc.detail, op=op) from None
    if type(count) is not int:
        try:
            count = int(count)
        except (TypeError, ValueError):
            raise DatatypeError(f"count must be an int, got {count!r}", op=op) from None
    if count < 0:
        raise DatatypeError(f"count must be >= 0, got {count}", op=op)
    p = t._plans.get(count)
    if p is None:
        p = t._plans[count] = Plan(t, count)
    return t, p


def _host_bytes(buf, op):
    """1-D uint8 view of a host array's memory (no copy)."""
    if buf.flags.c_contiguous:
        if buf.ndim == 1 and buf.dtype.itemsize == 1:
            return buf if buf.dtype == np.uint8 else buf.view(np.uint8)
        return buf.reshape(-1).view(np.uint8)
    if buf.flags.f_contiguous:
        return buf.reshape(-1, order="F").view(np.uint8)
    raise BufferError(
        f"buffer of shape {buf.shape} and strides {buf.strides} is not contiguous in memory; "
        "pack reads raw bytes from its first byte (describe the strides with the datatype instead)",
        op=op,
    )


def _short(t) -> str:
    r = repr(t)
    return r if len(r) <= 160 else r[:157] + "..."


def _fit_error(t, p, count, nbytes, origin, op, what="buffer"):
    return DatatypeError(
        f"{what} of {nbytes} bytes does not hold {count} element(s) of {_short(t)}: the type map "
        f"touches bytes [{p.lo + origin}, {p.hi + origin}) from the buffer start "
        f"(true_lb={t.true_lb}, true_extent={t.true_extent}, extent={t.extent}); nothing was written",
        op=op,
    )


def _wview(u8, w):
    if w == 1:
        return u8
    n = u8.shape[0]
    if n % w:
        u8 = u8[: n - n % w]
    return u8.view(_WORD[w])


def _eff_word(p, origin):
    w = p.word
    while w > 1 and origin % w:
        w //= 2
    return w


def pack(buf, datatype, count=1, out=None, *, origin=0):
    """Pack ``count`` elements of ``datatype`` from ``buf`` into contiguous bytes.

    Args:
        buf: numpy array (any dtype, C- or F-contiguous memory) or device array
            (numba, the CUDA simulator's, CuPy, DLPack); its first byte is the
            type map's origin (plus ``origin``).
        datatype: a commlib :class:`Datatype`, a committed ``MPI.Datatype``, or a
            numpy dtype.
        count: number of elements, each ``datatype.extent`` bytes after the last.
        out: optional preallocated 1-D uint8 array of at least ``count *
            datatype.size`` bytes on the same side (host/device) as ``buf``, to
            avoid an allocation per call.
        origin: byte offset in ``buf`` of displacement 0 (default 0).

    Returns:
        1-D uint8 array of ``count * datatype.size`` bytes: numpy for a host
        buffer, a numba device array for a device buffer (packed on the device).
        When ``out`` is larger, a view of its first bytes.

    Raises:
        DatatypeError: the type is unusable (uncommitted/freed MPI type,
            unsupported combiner) or does not fit ``buf``/``out``; nothing is written.
        BufferError: ``buf`` or ``out`` is not a usable array.
    """
    t, p = _resolve(datatype, count, "pack")
    if type(buf) is np.ndarray:
        u8 = _host_bytes(buf, "pack")
    else:
        return _pack_device(buf, t, p, count, out, origin)
    nb = p.nbytes
    if p.lo + origin < 0 or p.hi + origin > u8.shape[0]:
        if nb:
            raise _fit_error(t, p, count, u8.shape[0], origin, "pack")
    if out is None:
        out = np.empty(nb, np.uint8)
    else:
        out = _check_out(out, nb, "pack")
    kind = p.kind
    if kind == "contig":
        s = p.start + origin
        out[:nb] = u8[s:s + nb]
    elif kind == "strided":
        w = p.word if not origin else _eff_word(p, origin)
        c0, oc, os = p.words(w)
        _host.pack_strided(_wview(u8, w), _wview(out, w) if out.shape[0] == nb else _wview(out[:nb], w),
                           (p.start + origin) // w, c0, oc, os)
    elif kind == "blocks":
        w = p.word if not origin else _eff_word(p, origin)
        offs, lens, ext = p.words(w)
        _host.pack_blocks(_wview(u8, w), _wview(out[:nb], w), origin // w, offs, lens, p.count, ext)
    return out if out.shape[0] == nb else out[:nb]


def _check_out(out, nb, op):
    if type(out) is not np.ndarray or out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
        raise BufferError("out must be a contiguous 1-D numpy uint8 array for a host buffer", op=op)
    if out.shape[0] < nb:
        raise DatatypeError(f"out holds {out.shape[0]} bytes, the packed data needs {nb}", op=op)
    return out


def unpack(packed, datatype, buf, count=1, *, origin=0):
    """Unpack ``count`` elements of ``datatype`` from contiguous bytes into ``buf``.

    Args:
        packed: 1-D array holding at least ``count * datatype.size`` bytes (any
            dtype; numpy for host ``buf``, device array for device ``buf``).
        datatype: a commlib :class:`Datatype`, a committed ``MPI.Datatype``, or a
            numpy dtype.
        buf: destination array (C- or F-contiguous memory); its first byte is the
            type map's origin (plus ``origin``).
        count: number of elements.
        origin: byte offset in ``buf`` of displacement 0 (default 0).

    Returns:
        ``buf``.

    Raises:
        DatatypeError: the type is unusable, does not fit ``buf``, ``packed`` is
            too short, or the type map writes some byte twice (overlapping
            targets); nothing is written.
        BufferError: ``buf`` or ``packed`` is not a usable array.
    """
    t, p = _resolve(datatype, count, "unpack")
    if type(buf) is not np.ndarray:
        return _unpack_device(packed, t, p, buf, count, origin)
    u8 = _host_bytes(buf, "unpack")
    nb = p.nbytes
    if type(packed) is not np.ndarray:
        raise BufferError(f"packed must be a numpy array for a host buffer, got {type(packed).__name__}",
                          op="unpack")
    src = _host_bytes(packed, "unpack")
    if src.shape[0] < nb:
        raise DatatypeError(f"packed holds {src.shape[0]} bytes, {count} element(s) of {_short(t)} "
                            f"need {nb}; nothing was written", op="unpack")
    if nb == 0:
        return buf
    if p.lo + origin < 0 or p.hi + origin > u8.shape[0]:
        raise _fit_error(t, p, count, u8.shape[0], origin, "unpack")
    if p.overlaps():
        raise DatatypeError(f"{count} element(s) of {_short(t)} write some bytes more than once "
                            "(overlapping unpack targets); nothing was written", op="unpack")
    kind = p.kind
    if kind == "contig":
        s = p.start + origin
        u8[s:s + nb] = src[:nb]
    elif kind == "strided":
        w = p.word if not origin else _eff_word(p, origin)
        c0, oc, os = p.words(w)
        _host.unpack_strided(_wview(src[:nb] if src.shape[0] != nb else src, w), _wview(u8, w),
                             (p.start + origin) // w, c0, oc, os)
    else:
        w = p.word if not origin else _eff_word(p, origin)
        offs, lens, ext = p.words(w)
        _host.unpack_blocks(_wview(src[:nb], w), _wview(u8, w), origin // w, offs, lens, p.count, ext)
    return buf


# ------------------------------------------------------------------ device


def _device_bytes(buf, op):
    from commlib.buffer import as_buffer  # noqa: PLC0415

    b = as_buffer(buf, op=op)
    if not b.is_device:
        arr = b.array()
        if isinstance(arr, np.ndarray):
            return None, _host_bytes(arr, op)
    if not b.dense:
        raise BufferError(f"device buffer of shape {b.shape} is not contiguous in memory", op=op)
    return b, b.byte_view()


def _pack_device(buf, t, p, count, out, origin):
    b, u8 = _device_bytes(buf, "pack")
    if b is None:  # a host object that is not an ndarray (memoryview, DLPack on CPU)
        return pack(u8, t, count, out, origin=origin)
    from . import _device  # noqa: PLC0415

    n = u8.shape[0]
    if p.nbytes and (p.lo + origin < 0 or p.hi + origin > n):
        raise _fit_error(t, p, count, n, origin, "pack")
    return _device.pack(u8, p, out, origin)


def _unpack_device(packed, t, p, buf, count, origin):
    b, u8 = _device_bytes(buf, "unpack")
    if b is None:
        unpack(packed if isinstance(packed, np.ndarray) else np.asarray(packed), t, u8, count, origin=origin)
        return buf
    from . import _device  # noqa: PLC0415

    pb, src = _device_bytes(packed, "unpack")
    if pb is None:
        raise BufferError("packed must be a device array for a device buffer", op="unpack")
    nb = p.nbytes
    if src.shape[0] < nb:
        raise DatatypeError(f"packed holds {src.shape[0]} bytes, {count} element(s) of {_short(t)} "
                            f"need {nb}; nothing was written", op="unpack")
    if nb == 0:
        return buf
    n = u8.shape[0]
    if p.lo + origin < 0 or p.hi + origin > n:
        raise _fit_error(t, p, count, n, origin, "unpack")
    if p.overlaps():
        raise DatatypeError(f"{count} element(s) of {_short(t)} write some bytes more than once "
                            "(overlapping unpack targets); nothing was written", op="unpack")
    _device.unpack(src, p, u8, origin)
    return buf
