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

import operator

import numpy as np

from commlib.core.buffer import as_buffer
from commlib.core.errors import BufferError, DatatypeError, InvalidArgument

from . import canonical as _c
from .constructors import Datatype, as_datatype

__all__ = ["pack", "unpack", "plan_for", "Packer"]

# 16-byte words move as complex128: loads and stores of SSE/NEON registers copy
# the bits unchanged (no arithmetic touches them), and a 16-byte block becomes
# one element of a gather instead of a two-word inner loop.
WORD = {16: np.complex128, 8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}
_U8 = np.empty(0, np.uint8).dtype
_TILE_LIMIT = 1 << 16  # tile an irregular element over count when this small
_ENUM_LIMIT = 1 << 24  # blocks enumerated for the exact overlap check


def _word_of(values) -> int:
    acc = 0
    for v in values:
        acc |= int(v)
    w = 16
    while w > 1 and acc % w:
        w //= 2
    return w


class Plan:
    """How to pack ``count`` elements of one type (cached on the type).

    Attributes:
        kind: ``"empty"``, ``"contig"`` (one run), ``"strided"`` or ``"blocks"``.
        nbytes: packed bytes, ``count * size``.
        lo, hi: lowest byte offset touched, one past the highest (bytes, from the origin).
        word: widest word (bytes, up to 16 on the host; device kernels use at
            most 8) dividing every offset, length and stride.
        layout: the canonical StridedBlock (all count elements), or Blocks of one
            element (then ``count`` and ``extent`` repeat it).
    """

    __slots__ = ("kind", "nbytes", "lo", "hi", "word", "layout", "count", "extent", "_words",
                 "_overlap", "_dev", "start", "hk", "uk", "hw", "hp", "_at")

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
            self._at = {}
            self.hk = self.uk = self.hw = self.hp = None
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
        self._at = {}
        # the hot path reads these four slots: pack kernel, unpack kernel,
        # word witness, parameter array (origin 0)
        self.hk, self.uk, self.hw, self.hp = self.host_at(0)

    def host_at(self, origin: int):
        """``(pack kernel, unpack kernel, word witness, prm)`` with the type map
        ``origin`` bytes into the buffer (cached)."""
        r = self._at.get(origin)
        if r is None:
            w = self.word
            while w > 1 and origin % w:
                w //= 2
            wit = WORD[w](0)
            # numba loads with the first host kernel, not with commlib: a job that
            # never packs a derived datatype starts without it (0.4 s a process)
            from . import _host  # noqa: PLC0415
            if self.kind in ("strided", "contig"):
                c0, oc, os = self.words(w)
                prm = np.array([(self.start + origin) // w, c0, oc.shape[0], *oc, *os], np.int64)
                r = (_host.pack_strided, _host.unpack_strided, wit, prm)
            else:
                offs, lens, ext = self.words(w)
                prm = np.concatenate((np.array([origin // w, self.count, ext, offs.shape[0]], np.int64), offs, lens))
                r = (_host.pack_blocks, _host.unpack_blocks, wit, prm)
            if len(self._at) < 64:
                self._at[origin] = r
        return r

    # ----------------------------------------------------------- word scaling
    def words(self, w: int):
        """Layout arrays scaled to ``w``-byte words (cached)."""
        r = self._words.get(w)
        if r is None:
            lay = self.layout
            if self.kind in ("strided", "contig"):
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
        # ints and numpy integers only: 2.5 or True is refused, not truncated
        try:
            if isinstance(count, (bool, np.bool_)):
                raise TypeError
            count = operator.index(count)
        except TypeError:
            raise DatatypeError(f"count must be an int, got {count!r}", op=op) from None
    if count < 0:
        raise DatatypeError(f"count must be >= 0, got {count}", op=op)
    p = t._plans.get(count)
    if p is None:
        p = t._plans[count] = Plan(t, count)
    return t, p


_NUMBA_OK: dict = {}


def _numba_ok(dt) -> bool:
    """Whether the host kernels take arrays of this dtype as they are (native
    bool, integer, float32/64, complex64/128); others are passed as byte views."""
    ok = _NUMBA_OK.get(dt)
    if ok is None:
        ok = _NUMBA_OK[dt] = bool(dt.isnative and dt.char in "?bBhHiIlLqQfdFD")
    return ok


_KERNEL_DTYPES = frozenset(np.dtype(c) for c in "?bBhHiIlLqQfdFD")


def _origin(origin, op):
    """``origin`` as an int (ints and numpy integers; a float is refused, not truncated)."""
    if isinstance(origin, (bool, np.bool_)):
        raise DatatypeError(f"origin must be an int (bytes), got {origin!r}", op=op)
    try:
        return operator.index(origin)
    except TypeError:
        raise DatatypeError(f"origin must be an int (bytes), got {origin!r}", op=op) from None


def _read_only(what, op):
    return BufferError(f"{what} is read-only (its writeable flag is cleared, or it is an immutable object "
                       "such as bytes); nothing was written", op=op)


def _not_contiguous(buf, op):
    return BufferError(
        f"buffer of shape {buf.shape} and strides {buf.strides} is not contiguous in memory; "
        "pack reads raw bytes from its first byte (describe the strides with the datatype instead)",
        op=op,
    )


def _host_array(buf, op):
    """``buf`` itself when the kernels can take it (contiguous, a dtype numba
    types), else a 1-D uint8 view of its memory; raises for non-contiguous."""
    fl = buf.flags
    if not (fl.c_contiguous or fl.f_contiguous):
        raise _not_contiguous(buf, op)
    if _numba_ok(buf.dtype):
        return buf
    if buf.dtype.hasobject:
        raise InvalidArgument(f"buffer has dtype {buf.dtype}, which holds Python object pointers (references), "
                              "not data bytes; use a numeric dtype", op=op)
    return buf.reshape(-1, order="C" if fl.c_contiguous else "F").view(np.uint8)


def _host_bytes(buf, op):
    """1-D uint8 view of a host array's memory (no copy)."""
    b = _host_array(buf, op)
    if b.ndim == 1 and b.dtype == np.uint8:
        return b
    return b.reshape(-1, order="C" if b.flags.c_contiguous else "F").view(np.uint8)


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


def pack(buf, datatype, count=1, out=None, *, origin=0, stream=None):
    """Pack ``count`` elements of ``datatype`` from ``buf`` into contiguous bytes.

    Args:
        buf: numpy array (any dtype, C- or F-contiguous memory) or device array
            (CuPy, numba -- the CUDA simulator's too --, torch, anything with
            ``__cuda_array_interface__`` or DLPack); its first byte is the type
            map's origin (plus ``origin``).
        datatype: a commlib :class:`Datatype`, a committed ``MPI.Datatype``, or a
            numpy dtype.
        count: number of elements (an int or numpy integer; a float is refused),
            each ``datatype.extent`` bytes after the last.
        out: optional preallocated 1-D uint8 array of at least ``count *
            datatype.size`` bytes on the same side (host/device) as ``buf``, to
            avoid an allocation per call.
        origin: byte offset in ``buf`` of displacement 0 (default 0).
        stream: for a device buffer, the CUDA stream the pack is issued on
            (a CuPy stream, an int handle, a numba or torch stream); default
            CuPy's current stream.  The call returns once the work is queued.

    Returns:
        1-D uint8 array of ``count * datatype.size`` bytes: numpy for a host
        buffer; for a device buffer (packed on the device, on CuPy's current
        stream, ordered after the producer stream the array reports), a numba
        device array for a numba buffer and a CuPy array otherwise (a numba one
        where CuPy is not installed).  When ``out`` is larger, a view of its
        first bytes.

    Raises:
        DatatypeError: the type is unusable (uncommitted/freed MPI type,
            unsupported combiner) or does not fit ``buf``/``out``; nothing is written.
        BufferError: ``buf`` or ``out`` is not a usable array, or ``out`` is read-only.
        InvalidArgument: ``buf`` holds Python objects (``dtype=object``).
    """
    if count.__class__ is int:
        try:
            p = datatype._plans[count]
            t = datatype
        except (AttributeError, KeyError):
            t, p = _resolve(datatype, count, "pack")
    else:
        t, p = _resolve(datatype, count, "pack")
    if origin.__class__ is not int:
        origin = _origin(origin, "pack")
    if buf.__class__ is not np.ndarray:
        if stream is not None:
            from ._device import on_stream  # noqa: PLC0415

            with on_stream(stream):
                return _pack_device(buf, t, p, count, out, origin)
        return _pack_device(buf, t, p, count, out, origin)
    fl = buf.flags
    if not (fl.c_contiguous or fl.f_contiguous):
        raise _not_contiguous(buf, "pack")
    arr = buf if buf.dtype in _KERNEL_DTYPES else _host_array(buf, "pack")
    nb = p.nbytes
    if p.lo + origin < 0 or p.hi + origin > buf.nbytes:
        if nb:
            raise _fit_error(t, p, count, buf.nbytes, origin, "pack")
    if out is None:
        out = np.empty(nb, _U8)
    elif (out.__class__ is not np.ndarray or out.dtype is not _U8 or out.shape != (nb,) or out.strides != (1,)
          or not out.flags.writeable):
        out = _check_out(out, nb, "pack")[:nb]
    if nb:
        if origin:
            k = p.host_at(origin)
            k[0](arr, out, k[2], k[3])
        else:
            p.hk(arr, out, p.hw, p.hp)
    return out


def _check_out(out, nb, op):
    if type(out) is not np.ndarray or out.dtype != np.uint8 or out.ndim != 1 or not (
            out.flags.c_contiguous or out.shape[0] <= 1):
        raise BufferError("out must be a contiguous 1-D numpy uint8 array for a host buffer", op=op)
    if out.shape[0] < nb:
        raise DatatypeError(f"out holds {out.shape[0]} bytes, the packed data needs {nb}", op=op)
    if not out.flags.writeable:
        raise _read_only("out", op)
    return out


def unpack(packed, datatype, buf, count=1, *, origin=0, stream=None):
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
        stream: for a device buffer, the CUDA stream the unpack is issued on
            (as for :func:`pack`).

    Returns:
        ``buf``.

    Raises:
        DatatypeError: the type is unusable, does not fit ``buf``, ``packed`` is
            too short, or the type map writes some byte twice (overlapping
            targets); nothing is written.
        BufferError: ``buf`` or ``packed`` is not a usable array, or ``buf`` is
            read-only (``writeable`` cleared, ``bytes``, a read-only device array).
        InvalidArgument: ``buf`` holds Python objects (``dtype=object``).
    """
    if count.__class__ is int:
        try:
            p = datatype._plans[count]
            t = datatype
        except (AttributeError, KeyError):
            t, p = _resolve(datatype, count, "unpack")
    else:
        t, p = _resolve(datatype, count, "unpack")
    if origin.__class__ is not int:
        origin = _origin(origin, "unpack")
    if buf.__class__ is not np.ndarray:
        if stream is not None:
            from ._device import on_stream  # noqa: PLC0415

            with on_stream(stream):
                return _unpack_device(packed, t, p, buf, count, origin)
        return _unpack_device(packed, t, p, buf, count, origin)
    fl = buf.flags
    if not (fl.c_contiguous or fl.f_contiguous):
        raise _not_contiguous(buf, "unpack")
    if not fl.writeable:
        raise _read_only("buf", "unpack")
    arr = buf if buf.dtype in _KERNEL_DTYPES else _host_array(buf, "unpack")
    nb = p.nbytes
    if packed.__class__ is not np.ndarray:
        raise BufferError(f"packed must be a numpy array for a host buffer, got {type(packed).__name__}",
                          op="unpack")
    src = packed if packed.dtype in _KERNEL_DTYPES else _host_array(packed, "unpack")
    if packed.nbytes < nb:
        raise DatatypeError(f"packed holds {packed.nbytes} bytes, {count} element(s) of {_short(t)} "
                            f"need {nb}; nothing was written", op="unpack")
    if not (packed.flags.c_contiguous or packed.flags.f_contiguous):
        raise _not_contiguous(packed, "unpack")
    if nb == 0:
        return buf
    if p.lo + origin < 0 or p.hi + origin > buf.nbytes:
        raise _fit_error(t, p, count, buf.nbytes, origin, "unpack")
    ov = p._overlap
    if ov is None:
        ov = p.overlaps()
    if ov:
        raise DatatypeError(f"{count} element(s) of {_short(t)} write some bytes more than once "
                            "(overlapping unpack targets); nothing was written", op="unpack")
    if origin:
        k = p.host_at(origin)
        k[1](arr, src, k[2], k[3])
    else:
        p.uk(arr, src, p.hw, p.hp)
    return buf


# ------------------------------------------------------------------ device


def _device_buffer(buf, op):
    """``(Buffer, None)`` for a dense device buffer, ``(None, host bytes)`` for a
    host object that is not an ndarray (memoryview, DLPack on the CPU)."""
    b = as_buffer(buf, op=op)
    if not b.is_device:
        arr = b.array()
        if isinstance(arr, np.ndarray):  # numpy subclasses (np.memmap, ...) as plain ndarrays
            return None, _host_bytes(np.asarray(arr), op)
    if not b.dense:
        raise BufferError(f"device buffer of shape {b.shape} is not contiguous in memory", op=op)
    return b, None


def _pack_device(buf, t, p, count, out, origin):
    b, host = _device_buffer(buf, "pack")
    if b is None:  # a host object that is not an ndarray (memoryview, DLPack on CPU)
        return pack(host, t, count, out, origin=origin)
    from . import _device  # noqa: PLC0415  - numba.cuda: heavy, only for device buffers

    n = b.nbytes
    if p.nbytes and (p.lo + origin < 0 or p.hi + origin > n):
        raise _fit_error(t, p, count, n, origin, "pack")
    return _device.pack(b, p, out, origin)


def _unpack_device(packed, t, p, buf, count, origin):
    b, host = _device_buffer(buf, "unpack")
    if b is not None and b.readonly:
        raise _read_only("buf", "unpack")
    if b is None:
        unpack(packed if isinstance(packed, np.ndarray) else np.asarray(packed), t, host, count, origin=origin)
        return buf
    from . import _device  # noqa: PLC0415  - numba.cuda: heavy, only for device buffers

    pb = packed_device(packed)
    nb = p.nbytes
    if pb.nbytes < nb:
        raise DatatypeError(f"packed holds {pb.nbytes} bytes, {count} element(s) of {_short(t)} "
                            f"need {nb}; nothing was written", op="unpack")
    if nb == 0:
        return buf
    n = b.nbytes
    if p.lo + origin < 0 or p.hi + origin > n:
        raise _fit_error(t, p, count, n, origin, "unpack")
    if p.overlaps():
        raise DatatypeError(f"{count} element(s) of {_short(t)} write some bytes more than once "
                            "(overlapping unpack targets); nothing was written", op="unpack")
    _device.unpack(pb, p, b, origin)
    return buf


def packed_device(packed):
    """The packed bytes of a device unpack as a dense device Buffer (mapped
    pinned host memory counts: kernels read it through its device address)."""
    pb = as_buffer(packed, op="unpack")
    if not pb.is_device and hasattr(packed, "__cuda_array_interface__"):
        from ._device import cai_only  # noqa: PLC0415

        pb = as_buffer(cai_only(packed), op="unpack")
    if not pb.is_device:
        raise BufferError("packed must be a device array for a device buffer", op="unpack")
    if not pb.dense:
        raise BufferError(f"packed device array of shape {pb.shape} is not contiguous in memory", op="unpack")
    return pb


class Packer:
    """Pack and unpack one ``(datatype, buffer, count)`` over and over, with every
    check done once, at construction — for hot loops such as a halo exchange
    that packs the same faces of the same field every step.

    The packer keeps references to ``buf`` and its output array, so the memory
    stays valid; build a new packer when the field array is replaced.

    Args:
        datatype: a commlib type, a committed ``MPI.Datatype`` or a numpy dtype.
        buf: the buffer (host or device array, as for :func:`pack`).
        count: number of elements.
        out: optional preallocated 1-D uint8 array (same side as ``buf``) of at
            least ``count * datatype.size`` bytes; allocated when omitted.
        origin: byte offset in ``buf`` of displacement 0.
        stream: for a device buffer, the CUDA stream every :meth:`pack` and
            :meth:`unpack` is issued on (as for :func:`pack`; default CuPy's
            current stream at each call).

    Attributes:
        out: the 1-D uint8 array of ``count * datatype.size`` bytes that
            :meth:`pack` fills and :meth:`unpack` reads by default.
        nbytes: packed bytes.

    Raises:
        DatatypeError, BufferError: as :func:`pack` (and, for :meth:`unpack`,
            overlapping targets are reported at the first :meth:`unpack`).
    """

    __slots__ = ("datatype", "buf", "count", "origin", "out", "nbytes", "_plan", "_host", "_arr", "_dpack",
                 "_dunpack", "_dother", "_stream", "_stream_arg")

    def __init__(self, datatype, buf, count=1, out=None, *, origin=0, stream=None):
        self.out = pack(buf, datatype, count, out, origin=origin, stream=stream)  # validates everything once
        t, p = _resolve(datatype, count, "Packer")
        self.datatype, self.buf, self.count, self.origin = t, buf, count, _origin(origin, "Packer")
        self.nbytes = p.nbytes
        self._plan = p
        self._host = self._dpack = self._dunpack = None
        self._dother = {}
        self._stream, self._stream_arg = None, stream
        if buf.__class__ is not np.ndarray and p.nbytes:
            b, _ = _device_buffer(buf, "Packer")
            if b is not None:  # a device buffer: the launch is prepared once, here
                from . import _device  # noqa: PLC0415

                ob = packed_device(self.out)
                self._stream = None if stream is None else _device.on_stream(stream)
                self._dpack = _device.prepare(p, b, ob, self.origin, True)
                if not p.overlaps() and not b.readonly:
                    self._dunpack = _device.prepare(p, b, ob, self.origin, False)
                    self._dother = {id(self.out): (self._dunpack, self.out)}
        if buf.__class__ is np.ndarray and p.nbytes:
            arr = buf if buf.dtype in _KERNEL_DTYPES else _host_array(buf, "Packer")
            k = p.host_at(self.origin)
            self._arr = arr
            self._host = (k[0], k[1], arr, self.out, k[2], k[3])

    def pack(self):
        """Pack ``buf`` into :attr:`out` and return it."""
        h = self._host
        if h is not None:
            h[0](h[2], h[3], h[4], h[5])
            return self.out
        if self._dpack is not None:
            if self._stream is None:
                self._dpack()
            else:
                with self._stream:
                    self._dpack()
            return self.out
        return pack(self.buf, self.datatype, self.count, self.out, origin=self.origin, stream=self._stream_arg)

    __call__ = pack

    def _prepare_unpack(self, packed):
        """Check ``packed`` once and prepare the unpack launch from it (kept,
        with a reference to ``packed``, for the next calls with the same array)."""
        from . import _device  # noqa: PLC0415

        pb = packed_device(packed)
        if pb.nbytes < self.nbytes:
            return None  # unpack() raises the precise error
        b, _ = _device_buffer(self.buf, "Packer.unpack")
        got = (_device.prepare(self._plan, b, pb, self.origin, False), packed)
        self._dother[id(packed)] = got
        return got

    def unpack(self, packed=None):
        """Unpack ``packed`` (default :attr:`out`) into ``buf`` and return ``buf``."""
        h = self._host
        if h is not None and (packed is None or packed is self.out):
            if not self.buf.flags.writeable:
                raise _read_only("buf", "Packer.unpack")
            p = self._plan
            if p._overlap is None and p.overlaps() or p._overlap:
                raise DatatypeError(f"{self.count} element(s) of {_short(self.datatype)} write some bytes "
                                    "more than once (overlapping unpack targets); nothing was written",
                                    op="Packer.unpack")
            h[1](h[2], h[3], h[4], h[5])
            return self.buf
        d = self._dunpack
        if d is not None:
            if packed is not None:
                got = self._dother.get(id(packed))
                if got is None and len(self._dother) < 8:
                    got = self._prepare_unpack(packed)
                d = got[0] if got is not None and got[1] is packed else None
            if d is not None:
                if self._stream is None:
                    d()
                else:
                    with self._stream:
                        d()
                return self.buf
        return unpack(self.out if packed is None else packed, self.datatype, self.buf, self.count,
                      origin=self.origin, stream=self._stream_arg)
