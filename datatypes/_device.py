"""Device pack/unpack: chooses the kernels and adapts the arrays.

Two implementations of the same algorithm (see :mod:`._device_cuda` for it):

* on a real GPU with CuPy installed, CUDA C kernels compiled once with NVRTC
  and launched through CuPy on raw device addresses (:mod:`._device_cuda`);
  any array with ``__cuda_array_interface__`` (CuPy, numba, torch, mapped
  pinned host memory) or DLPack goes in by address, no wrapper objects;
* otherwise (numba-only installs, and numba's CUDA simulator in CI), the
  numba.cuda kernels below, on arrays made kernel-ready by the one adapter,
  :meth:`commlib.core.buffer.Buffer.as_numba`.

The numba ``rows`` kernel is the same row-team mapping as the CUDA C one, so
the simulator checks its index arithmetic: ``tpr`` threads per row of ``n0``
words, one division per outer dimension per row.  Under the simulator the
launch is kept small because every simulated thread is a Python thread.
"""
from __future__ import annotations

import numpy as np
from numba import config, cuda

from commlib.core.buffer import Buffer, as_buffer, cupy_usable
from commlib.core.config import config as _config
from commlib.core.errors import BufferError, DatatypeError

from ._launch import team_lg

__all__ = ["pack", "unpack", "prepare", "use_cuda_kernels", "new_like", "on_stream"]

WORD = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}
_SIM = bool(config.ENABLE_CUDASIM)
_THREADS = 32 if _SIM else 256


def use_cuda_kernels() -> bool:
    """True when the CUDA C kernels (CuPy) run; False for the numba kernels
    (no CuPy, the simulator, or ``COMMLIB_DEVICE_KERNELS=numba``)."""
    return not _SIM and _config.device_kernels != "numba" and cupy_usable()


# --------------------------------------------------------------- numba kernels
@cuda.jit(device=True)
def _row_offset(r, start, oc, os):  # pragma: no cover - device code
    """Word offset of row ``r``: ``start`` plus its multi-index (outer counts
    ``oc``, fastest first) dotted with the strides ``os``."""
    off = start
    for d in range(oc.shape[0]):
        c = oc[d]
        q = r // c
        off += (r - q * c) * os[d]
        r = q
    return off


@cuda.jit
def _k_rows(src, dst, start, n0, nrows, oc, os, lg, to_packed):  # pragma: no cover - device code
    if lg < 0:  # flat: one thread per word
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        total = n0 * nrows
        while i < total:
            r = i // n0
            k = i - r * n0
            off = _row_offset(r, start, oc, os)
            if to_packed:
                dst[i] = src[off + k]
            else:
                dst[off + k] = src[i]
            i += step
        return
    t = cuda.threadIdx.x
    tpr = 1 << lg
    lane = t & (tpr - 1)
    rpb = cuda.blockDim.x >> lg
    r = cuda.blockIdx.x * rpb + (t >> lg)
    step = cuda.gridDim.x * rpb
    while r < nrows:
        off = _row_offset(r, start, oc, os)
        base = r * n0
        k = lane
        while k < n0:
            if to_packed:
                dst[base + k] = src[off + k]
            else:
                dst[off + k] = src[base + k]
            k += tpr
        r += step


@cuda.jit
def _k_runs(src, dst, start, offs, cum, lens, per, extent, count, to_packed):  # pragma: no cover - device code
    lane = cuda.threadIdx.x & 31
    g = cuda.grid(1) >> 5
    nw = cuda.gridsize(1) >> 5
    n = offs.shape[0]
    total = n * count
    while g < total:
        e = g // n
        run = g - e * n
        boff = start + e * extent + offs[run]
        poff = e * per + cum[run]
        k = lane
        while k < lens[run]:
            if to_packed:
                dst[poff + k] = src[boff + k]
            else:
                dst[boff + k] = src[poff + k]
            k += 32
        g += nw


def _lg(n0: int) -> int:
    return team_lg(n0, _THREADS)


def _wview(u8, w):
    if w == 1:
        return u8
    n = u8.shape[0]
    if n % w:
        u8 = u8[: n - n % w]
    return u8.view(WORD[w])


def _numba_args(p, w):
    """Device copies of the plan's word-scaled arrays (cached on the plan)."""
    a = p._dev.get(("numba", w))
    if a is None:
        if p.kind == "strided":
            c0, oc, os = p.words(w)
            nrows = int(np.prod(oc)) if oc.shape[0] else 1
            lg = _lg(c0)
            per = _THREADS if lg < 0 else _THREADS >> lg  # words or rows per block
            n = nrows * c0 if lg < 0 else nrows
            blocks = 1 if _SIM else max(1, min(-(-n // per), 16384))
            a = (c0, nrows, cuda.to_device(oc), cuda.to_device(os), _lg(c0), blocks)
        else:
            offs, lens, ext = p.words(w)
            cum = np.zeros(lens.shape[0], np.int64)
            np.cumsum(lens[:-1], out=cum[1:])
            warps = offs.shape[0] * p.count
            blocks = 1 if _SIM else max(1, min(-(-warps // (_THREADS // 32)), 16384))
            a = (cuda.to_device(offs), cuda.to_device(cum), cuda.to_device(lens), int(lens.sum()), ext, blocks)
        p._dev[("numba", w)] = a
    return a


def _numba_move(buf8, packed8, p, origin, to_packed):
    """Numba path: ``buf8``/``packed8`` are 1-D uint8 numba device arrays
    (``packed8`` may be longer than the plan's bytes: a caller's larger ``out``)."""
    if packed8.shape[0] != p.nbytes:
        packed8 = packed8[:p.nbytes]
    if p.kind == "contig":
        s = p.start + origin
        run = buf8[s:s + p.nbytes]
        if to_packed:
            packed8.copy_to_device(run)
        else:
            run.copy_to_device(packed8)
        return
    w = min(p.word, 8)
    while w > 1 and origin % w:
        w //= 2
    bw, pw = _wview(buf8, w), _wview(packed8, w)
    src, dst = (bw, pw) if to_packed else (pw, bw)
    start = (p.start + origin) // w  # p.start is 0 for the offsets/lengths form
    if p.kind == "strided":
        c0, nrows, oc, os, lg, blocks = _numba_args(p, w)
        _k_rows[blocks, _THREADS](src, dst, start, c0, nrows, oc, os, lg, to_packed)
    else:
        offs, cum, lens, per, ext, blocks = _numba_args(p, w)
        _k_runs[blocks, _THREADS](src, dst, start, offs, cum, lens, per, ext, p.count, to_packed)


# -------------------------------------------------------------------- streams
class _NoStream:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_STREAM = _NoStream()


def on_stream(stream):
    """A context manager making ``stream`` the stream device work is issued on.

    Args:
        stream: None (CuPy's current stream, the default), a CuPy stream, or
            any CUDA stream handle: an int, a numba stream (``.handle``), a
            torch stream (``.cuda_stream``).  With the numba kernels (no CuPy)
            the work runs on numba's default stream and ``stream`` is only
            synchronized before it.

    Raises:
        BufferError: ``stream`` is none of these.
    """
    if stream is None:
        return _NO_STREAM
    if not (isinstance(stream, int) or any(hasattr(stream, a) for a in ("cuda_stream", "ptr", "handle",
                                                                         "synchronize"))):
        raise BufferError(f"stream must be a CuPy stream, a CUDA stream handle (int), a numba or torch stream, "
                          f"got {type(stream).__name__}", op="pack")
    if not use_cuda_kernels():
        return _NumbaStream(stream)
    import cupy  # noqa: PLC0415

    if isinstance(stream, cupy.cuda.Stream):
        return stream
    return cupy.cuda.ExternalStream(_handle(stream))


def _handle(stream) -> int:
    for attr in ("cuda_stream", "ptr"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    h = getattr(stream, "handle", None)
    if h is not None:
        return int(getattr(h, "value", h) or 0)
    if isinstance(stream, int):
        return stream
    raise BufferError(f"stream must be a CuPy stream, a CUDA stream handle (int), a numba or torch stream, "
                      f"got {type(stream).__name__}", op="pack")


class _NumbaStream:
    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        if not _SIM and hasattr(self.stream, "synchronize"):
            self.stream.synchronize()
        return self.stream

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------- adapters
def _bytes_numba(b: Buffer):
    """1-D uint8 numba device array over a dense device buffer (no copy)."""
    arr = b.as_numba()
    order = "C" if b.contiguous else "F"
    flat = arr.reshape(b.size, order=order) if b.size and len(b.shape) != 1 else arr
    return flat.view(np.uint8)


def new_like(b: Buffer, nbytes: int):
    """A new 1-D uint8 device array of ``nbytes`` bytes, of the buffer's own
    library where it has one (numba for numba arrays, CuPy otherwise when the
    CUDA C kernels run, numba else)."""
    if use_cuda_kernels() and b.kind != "numba":
        import cupy  # noqa: PLC0415

        return cupy.empty(nbytes, np.uint8)
    return cuda.device_array(nbytes, dtype=np.uint8)


def _out_buffer(out, nb, op):
    """The caller's ``out`` as a Buffer: a 1-D uint8 device array (or mapped
    pinned host memory, which has a device address) of at least ``nb`` bytes."""
    ob = as_buffer(out, op=op)
    if not ob.is_device and not hasattr(out, "__cuda_array_interface__"):
        raise BufferError("out must be a 1-D uint8 device array (or mapped pinned memory) for a device buffer",
                          op=op)
    if ob.dtype != np.uint8 or len(ob.shape) != 1 or (ob.shape[0] > 1 and tuple(ob.strides) != (1,)):
        raise BufferError("out must be a contiguous 1-D uint8 device array for a device buffer", op=op)
    if ob.shape[0] < nb:
        raise DatatypeError(f"out holds {ob.shape[0]} bytes, the packed data needs {nb}", op=op)
    if not ob.is_device:  # mapped host memory (a numpy subclass): use its device address
        ob = as_buffer(cai_only(out), op=op)
    return ob


class cai_only:
    """Exposes only an object's ``__cuda_array_interface__`` (numba's mapped
    arrays are numpy subclasses, which :func:`as_buffer` would see as host)."""

    def __init__(self, obj):
        self.obj = obj
        self.__cuda_array_interface__ = obj.__cuda_array_interface__


def _addr(b: Buffer) -> int:
    return b.ptr


def pack(b: Buffer, p, out, origin):
    """Pack on the device from buffer ``b``; returns a 1-D uint8 device array
    of ``p.nbytes`` bytes (a view of ``out`` when given)."""
    nb = p.nbytes
    if out is None:
        out = new_like(b, nb)
        ob = as_buffer(out)
    else:
        ob = _out_buffer(out, nb, "pack")
        if ob.shape[0] != nb:
            out = out[:nb]
    _move(b, ob, p, origin, True)
    return out


def unpack(src: Buffer, p, b: Buffer, origin):
    """Unpack on the device from packed bytes ``src`` into buffer ``b``."""
    _move(b, src, p, origin, False)


def _move(b: Buffer, packed: Buffer, p, origin, to_packed):
    if p.nbytes == 0:
        return
    if use_cuda_kernels():
        from . import _device_cuda as dc  # noqa: PLC0415

        launch = dc.prepare(p, _addr(b) + origin, _addr(packed), to_packed)
        if launch is not None:
            dc.order_after((b.stream, packed.stream))
            launch.launch()
            return
    _numba_move(_bytes_numba(b), _bytes_numba(packed), p, origin, to_packed)


def prepare(p, b: Buffer, packed: Buffer, origin: int, to_packed: bool):
    """A no-argument callable repeating one pack (``to_packed``) or unpack of
    plan ``p`` between ``b`` and ``packed`` -- everything but the launch done
    here, once (for :class:`~commlib.datatypes.pack.Packer`)."""
    if p.nbytes == 0:
        return lambda: None
    if use_cuda_kernels():
        from . import _device_cuda as dc  # noqa: PLC0415

        launch = dc.prepare(p, _addr(b) + origin, _addr(packed), to_packed)
        if launch is not None:
            streams = tuple(s for s in (b.stream, packed.stream) if s not in (None, 0, 1, 2))
            if streams:
                def go():
                    dc.order_after(streams)
                    launch.launch()
                return go
            return launch.launch
    b8, p8 = _bytes_numba(b), _bytes_numba(packed)
    return lambda: _numba_move(b8, p8, p, origin, to_packed)


def prepare_batch(pieces, to_packed: bool):
    """A no-argument callable moving every piece ``(plan, buffer Buffer,
    packed Buffer, packed byte offset)`` in as few launches as the kernels
    allow (one for all strided pieces with the CUDA C kernels)."""
    if use_cuda_kernels():
        from . import _device_cuda as dc  # noqa: PLC0415

        launches = dc.prepare_batch([(p, _addr(b), _addr(pk) + o) for p, b, pk, o in pieces], to_packed)
        streams = tuple({s for _, b, pk, _ in pieces for s in (b.stream, pk.stream) if s not in (None, 0, 1, 2)})
        fns = [x.launch for x in launches]

        def go():
            if streams:
                dc.order_after(streams)
            for f in fns:
                f()
        return go
    moves = []
    for p, b, pk, o in pieces:
        if p.nbytes:
            p8 = _bytes_numba(pk)[o:o + p.nbytes]
            moves.append((_bytes_numba(b), p8, p))

    def go_numba():
        for b8, p8, p in moves:
            _numba_move(b8, p8, p, 0, to_packed)
    return go_numba
