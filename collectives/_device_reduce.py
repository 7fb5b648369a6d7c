"""Reductions and ring collectives on device buffers (CuPy or numba.cuda), and pinned staging.

Conventions:

- **Adapter**: kernels never see a foreign array.  :func:`as_device_array`
  turns a user's device array into ``(kind, array)``: ``"cupy"`` (a CuPy
  array: CuPy arrays as they are, other ``__cuda_array_interface__`` objects
  through ``cupy.asarray`` when CuPy imports) or ``"numba"`` (numba device
  arrays and the CUDA simulator's arrays as they are, other CAI objects
  through ``numba.cuda.as_cuda_array``).
- **Element-wise, operand order fixed**: ``combine(a, b, out, op)`` computes
  ``out[i] = a[i] (op) b[i]`` with the host path's semantics (numpy's
  ``ufunc(a, b, out=out)``): IEEE ``+``/``*`` in the buffer's dtype (float16
  and bfloat16 round once from float32, which equals a correctly rounded
  half-precision operation), integer wrap-around, ``min``/``max`` as
  ``(a <= b or isnan(a)) ? a : b``.  The ring algorithms below combine the
  same operands in the same order as :mod:`.reduce_scatter_ring`, so a device
  ring, a host ring and every rank give the same bits.
- **Streams**: every device operation runs on the caller's stream (CuPy's
  current stream; a numba array's own ``stream``, else the default stream) and
  is ordered against the wire with events, never a device-wide synchronize.
- **Staging** (MPI not CUDA-aware): pinned host buffers from a per-communicator
  :class:`StagingCache` (one set per (role, count, dtype), LRU-bounded), copied
  asynchronously on the caller's stream.  The ring reduce-scatter runs in
  segments of :data:`SEGMENT_BYTES`: an incoming segment is copied up, reduced
  on the device and its result copied down and forwarded while later segments
  are still on the wire (see :func:`reduce_scatter_ring_device`).

Nothing here calls MPI: every message goes through the transport.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from commlib.core.buffer import as_buffer, cupy_usable
from commlib.core.errors import BufferError
from commlib.core.seconds import deadline_of

from ._common import next_tag, waitall, exchange
from .allgather_ring import allgather_ring_inplace

__all__ = ["as_device_array", "combine", "reduce_into", "finalize", "StagingCache",
           "reduce_scatter_ring_device", "allreduce_ring_device", "SEGMENT_BYTES"]

SEGMENT_BYTES = 2 << 20
"""Pipeline segment of the staged ring (bytes): large enough for PCIe copies to
run near peak, small enough that copies of one segment overlap the transfer
of the next."""

_BF16 = "bfloat16"


# --------------------------------------------------------------------- adapter
def as_device_array(obj):
    """``(kind, array)`` for a device array: ``kind`` is ``"cupy"`` or ``"numba"``,
    through the shared adapter (:meth:`commlib.core.buffer.Buffer.as_cupy` /
    :meth:`~commlib.core.buffer.Buffer.as_numba`, zero-copy).

    Raises:
        BufferError: ``obj`` is not a device array this module can drive.
    """
    b = as_buffer(obj, op="device_reduce")
    if not b.is_device:
        raise BufferError(f"{type(obj).__name__} is not a device array", op="device_reduce")
    if b.kind == "cupy":
        return "cupy", obj
    if b.kind in ("numba", "numba-sim"):
        return "numba", obj
    if cupy_usable():
        return "cupy", b.as_cupy()
    return "numba", b.as_numba()


def flat(kind: str, arr):
    """A 1-D view of a C-contiguous device array."""
    n = math.prod(arr.shape)
    if len(arr.shape) == 1:
        return arr
    return arr.reshape(-1) if kind == "cupy" else arr.reshape(n)


# --------------------------------------------------------------- numba kernels
_NUMBA = {}
cuda = None  # numba.cuda, imported by _numba_kernels on first use


def _numba_kernels():
    if _NUMBA:
        return _NUMBA
    # a module global, not a local: the simulator swaps the global ``cuda`` a kernel sees
    global cuda  # noqa: PLW0603
    from numba import cuda  # noqa: PLC0415

    def make(body):
        @cuda.jit
        def k(a, b, out):
            i = cuda.grid(1)
            step = cuda.gridsize(1)
            while i < out.size:
                out[i] = body(a[i], b[i])
                i += step
        return k

    # a NaN operand propagates with its own bits, as numpy's loops do (the
    # GPU's arithmetic would return its canonical NaN, e.g. 0x7fff in float16)
    @cuda.jit(device=True)
    def _sum(x, y):
        r = x + y
        if r != r:
            r = x if x != x else (y if y != y else r)
        return r

    @cuda.jit(device=True)
    def _prod(x, y):
        r = x * y
        if r != r:
            r = x if x != x else (y if y != y else r)
        return r

    @cuda.jit(device=True)
    def _min(x, y):
        return x if (x <= y or x != x) else y

    @cuda.jit(device=True)
    def _max(x, y):
        return x if (x >= y or x != x) else y

    @cuda.jit(device=True)
    def _band(x, y):
        return x & y

    @cuda.jit(device=True)
    def _bor(x, y):
        return x | y

    @cuda.jit(device=True)
    def _bxor(x, y):
        return x ^ y

    @cuda.jit
    def divide(a, n):
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        while i < a.size:
            a[i] = a[i] / n  # float64 quotient rounded once to a's dtype: IEEE division in that dtype
            i += step

    _NUMBA.update(sum=make(_sum), avg=make(_sum), prod=make(_prod), min=make(_min), max=make(_max),
                  band=make(_band), bor=make(_bor), bxor=make(_bxor), divide=divide)
    return _NUMBA


def _launch(n: int):
    threads = 128 if n >= 128 else max(1, n)
    return min(4096, (n + threads - 1) // threads), threads


# ---------------------------------------------------------------- CuPy kernels
_CUPY = {}
_BF16_C = r"""
__device__ __forceinline__ float bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"""
_BF16_BODY = {
    "sum": "out = f2bf(bf2f(a) + bf2f(b))",
    "avg": "out = f2bf(bf2f(a) + bf2f(b))",
    "prod": "out = f2bf(bf2f(a) * bf2f(b))",
    "min": "float x = bf2f(a), y = bf2f(b); out = (x <= y || x != x) ? a : b",
    "max": "float x = bf2f(a), y = bf2f(b); out = (x >= y || x != x) ? a : b",
}
_GENERIC_BODY = {
    "min": "out = (a <= b || a != a) ? a : b",
    "max": "out = (a >= b || a != a) ? a : b",
}


def _cupy_kernel(name: str, bf16: bool):
    key = (name, bf16)
    k = _CUPY.get(key)
    if k is None:
        import cupy  # noqa: PLC0415

        if bf16:
            k = cupy.ElementwiseKernel("uint16 a, uint16 b", "uint16 out", _BF16_BODY[name],
                                       f"commlib_bf16_{name}", preamble=_BF16_C)
        elif name == "divide_bf16":
            k = cupy.ElementwiseKernel("uint16 a, float64 n", "uint16 out", "out = f2bf((float)(bf2f(a) / n))",
                                       "commlib_bf16_div", preamble=_BF16_C)
        else:
            k = cupy.ElementwiseKernel("T a, T b", "T out", _GENERIC_BODY[name], f"commlib_{name}")
        _CUPY[key] = k
    return k


_HOST_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
               "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
_CUPY_UFUNC = {"sum": "add", "avg": "add", "prod": "multiply", "band": "bitwise_and",
               "bor": "bitwise_or", "bxor": "bitwise_xor"}


# ------------------------------------------------------------------ reductions
def _name(op) -> str:
    return op if isinstance(op, str) else op.name


def combine(a, b, out, op, kind: str | None = None, stream=None) -> None:
    """``out[i] = a[i] (op) b[i]`` on the device (1-D, same size and dtype; ``out`` may be ``a``).

    Args:
        a, b, out: device arrays of the same kind (see :func:`as_device_array`).
        op: an :class:`~.ops.Op` or its name.
        kind: ``"cupy"`` or ``"numba"`` (None: from ``out``).
        stream: the stream (None: CuPy's current stream / ``out``'s numba stream).
    """
    name = _name(op)
    if kind is None:
        kind, out = as_device_array(out)
        a, b = as_device_array(a)[1], as_device_array(b)[1]
    n = out.size
    if n == 0:
        return
    bf16 = np.dtype(out.dtype).name == _BF16
    if kind == "cupy":
        import cupy  # noqa: PLC0415

        with (stream if stream is not None else cupy.cuda.get_current_stream()):
            if bf16:
                _cupy_kernel(name, True)(a.view(cupy.uint16), b.view(cupy.uint16), out.view(cupy.uint16))
            elif name in _CUPY_UFUNC:
                getattr(cupy, _CUPY_UFUNC[name])(a, b, out=out)
            else:
                _cupy_kernel(name, False)(a, b, out)
        return
    if bf16:  # numba has no bfloat16: reduce through the host (same bits, slow; CuPy takes the kernel path)
        ha, hb = a.copy_to_host(), b.copy_to_host()
        _HOST_UFUNC[name](ha, hb, out=ha)
        out.copy_to_device(ha, stream=_numba_stream(out) if stream is None else stream)
        return
    k = _numba_kernels()[name]
    blocks, threads = _launch(n)
    k[blocks, threads, _numba_stream(out) if stream is None else stream](a, b, out)


def reduce_into(acc, incoming, op, stream=None) -> None:
    """``acc <- acc (op) incoming`` on the device, element-wise (1-D device arrays)."""
    kind, acc = as_device_array(acc)
    combine(acc, as_device_array(incoming)[1], acc, op, kind, stream)


def finalize(arr, size: int, op, kind: str | None = None, stream=None) -> None:
    """The post-reduction step on the device (``avg``: divide by ``size``, IEEE, in ``arr``'s dtype)."""
    if not getattr(op, "mean", False) or size <= 1:
        return
    if kind is None:
        kind, arr = as_device_array(arr)
    if arr.size == 0:
        return
    bf16 = np.dtype(arr.dtype).name == _BF16
    if kind == "cupy":
        import cupy  # noqa: PLC0415

        with (stream if stream is not None else cupy.cuda.get_current_stream()):
            if bf16:
                u = arr.view(cupy.uint16)
                _cupy_kernel("divide_bf16", False)(u, float(size), u)
            else:
                cupy.divide(arr, cupy.asarray(size, dtype=arr.dtype), out=arr)
        return
    if bf16:
        h = arr.copy_to_host()
        op.finalize(h, size)
        arr.copy_to_device(h)
        return
    blocks, threads = _launch(arr.size)
    _numba_kernels()["divide"][blocks, threads, _numba_stream(arr) if stream is None else stream](arr, float(size))


# --------------------------------------------------------- copies and streams
def _numba_stream(arr):
    s = getattr(arr, "stream", 0)
    if s:
        return s
    from numba import cuda  # noqa: PLC0415

    return cuda.default_stream()


def stream_of(kind: str, arr):
    """The caller's stream for ``arr``."""
    if kind == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.cuda.get_current_stream()
    return _numba_stream(arr)


def d2h(kind, dev, host, stream) -> None:
    """Asynchronous copy of device ``dev`` into pinned ``host`` (same size) on ``stream``."""
    if dev.size == 0:
        return
    if kind == "cupy":
        dev.get(stream=stream, out=host, blocking=False)
    else:
        dev.copy_to_host(host, stream=stream)


def h2d(kind, host, dev, stream) -> None:
    """Asynchronous copy of pinned ``host`` into device ``dev`` on ``stream``."""
    if dev.size == 0:
        return
    if kind == "cupy":
        dev.set(host, stream=stream)
    else:
        dev.copy_to_device(host, stream=stream)


def d2d(kind, src, dst, stream) -> None:
    """Device-to-device copy ``dst[...] = src`` on ``stream``."""
    if dst.size == 0:
        return
    if kind == "cupy":
        import cupy  # noqa: PLC0415

        with stream:
            cupy.copyto(dst, src)
    elif np.dtype(dst.dtype).name == _BF16:  # numba has no bfloat16 dtype: through the host
        dst.copy_to_device(src.copy_to_host(), stream=stream)
    else:
        dst.copy_to_device(src, stream=stream)


def record(kind, stream):
    """An event recorded on ``stream`` (``.synchronize()`` waits for the work before it)."""
    if kind == "cupy":
        import cupy  # noqa: PLC0415

        ev = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        return ev
    from numba import cuda  # noqa: PLC0415

    try:
        ev = cuda.event(timing=False)
    except TypeError:  # the simulator's Event takes no arguments
        ev = cuda.event()
    ev.record(stream)
    return ev


def device_empty(kind, n: int, dtype):
    if kind == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.empty(n, dtype=dtype)
    from numba import cuda  # noqa: PLC0415

    if np.dtype(dtype).name == _BF16:
        return cuda.device_array(n * 2, np.uint8).view(np.dtype(dtype))
    return cuda.device_array(n, dtype)


def pinned_empty(kind, n: int, dtype) -> np.ndarray:
    """A page-locked host array of ``n`` elements of ``dtype``."""
    dtype = np.dtype(dtype)
    nbytes = max(1, n * dtype.itemsize)
    if kind == "cupy":
        import cupy  # noqa: PLC0415

        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        raw = np.frombuffer(mem, np.uint8, nbytes)
    else:
        from numba import cuda  # noqa: PLC0415

        raw = cuda.pinned_array(nbytes, np.uint8)
    return raw[:n * dtype.itemsize].view(dtype)


# --------------------------------------------------------------------- staging
class StagingEntry:
    """Pinned host buffers (and device scratch) for one (role, count, dtype).

    Attributes:
        host: pinned, ``count`` elements: the whole vector's host mirror.
        pending: an event the last asynchronous copy out of ``host`` recorded
            (waited for before ``host`` is written again), or None.
    """

    __slots__ = ("kind", "count", "dtype", "host", "tmp", "dtmp", "pending")

    def __init__(self, kind, count, dtype):
        self.kind, self.count, self.dtype = kind, count, np.dtype(dtype)
        self.host = pinned_empty(kind, count, dtype)
        self.tmp = None
        self.dtmp = None
        self.pending = None

    def ready(self) -> None:
        """Wait until no asynchronous copy still reads ``host`` or the scratch."""
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None

    def scratch(self, maxlen: int):
        """``(two pinned receive buffers, one device buffer)`` of ``maxlen`` elements each."""
        if self.tmp is None or self.tmp[0].size < maxlen:
            self.tmp = (pinned_empty(self.kind, maxlen, self.dtype), pinned_empty(self.kind, maxlen, self.dtype))
            self.dtmp = device_empty(self.kind, maxlen, self.dtype)
        return self.tmp, self.dtmp


class StagingCache:
    """Pinned staging buffers of one communicator, reused across calls.

    Keyed by ``(role, kind, count, dtype)``; at most ``bound`` entries (least
    recently used dropped first, after its pending copies finished).
    """

    def __init__(self, bound: int = 8):
        self.bound = bound
        self.entries: OrderedDict = OrderedDict()

    def get(self, role: str, kind: str, count: int, dtype) -> StagingEntry:
        key = (role, kind, count, np.dtype(dtype).str, np.dtype(dtype).name)
        e = self.entries.get(key)
        if e is None:
            while len(self.entries) >= self.bound:
                _, old = self.entries.popitem(last=False)
                old.ready()
            e = self.entries[key] = StagingEntry(kind, count, dtype)
        else:
            self.entries.move_to_end(key)
        e.ready()
        return e


def stage_down(kind, dev, entry: StagingEntry, stream) -> np.ndarray:
    """Copy 1-D device ``dev`` into ``entry.host`` and wait for it; returns the host view."""
    d2h(kind, dev, entry.host, stream)
    record(kind, stream).synchronize()
    return entry.host


def stage_up(kind, entry: StagingEntry, dev, stream, lo: int = 0, hi: int | None = None) -> None:
    """Copy ``entry.host[lo:hi]`` into ``dev[lo:hi]`` asynchronously on ``stream``
    (the caller's later work on that stream sees it; ``entry`` waits before reuse)."""
    hi = dev.size if hi is None else hi
    if hi > lo:
        h2d(kind, entry.host[lo:hi], dev[lo:hi], stream)
        entry.pending = record(kind, stream)


# ----------------------------------------------------------------- ring phases
def _segments(a: int, b: int, seg: int):
    return [(s, min(b, s + seg)) for s in range(a, b, seg)] if b > a else []


def reduce_scatter_ring_device(tp, work, op, bounds, *, kind: str, src=None, timeout=None,
                               entry: StagingEntry | None = None, stream=None,
                               segment_bytes: int | None = None) -> None:
    """The ring reduce-scatter of :mod:`.reduce_scatter_ring` on a device vector.

    Same chunks, same messages, same reduction order (own contribution
    ``(op)`` the partial from the left), so the bits equal the host ring's.

    Args:
        tp: the transport (``size`` n, ``rank`` r).
        work: 1-D device array (of ``kind``); on return chunk r holds the
            reduced chunk r (other chunks partial results).
        op: an :class:`~.ops.Op`.
        bounds: ``n + 1`` chunk offsets.
        src: this rank's input when it is not ``work`` (device, not modified).
        entry: pinned staging (MPI not CUDA-aware): incoming segments land in
            pinned memory, go up, are reduced on the device, and the reduced
            segment comes down and is forwarded at once (the next step sends
            exactly that chunk); on return ``entry.host`` holds chunk r as
            well.  None: device buffers go to the transport directly.
        segment_bytes: pipeline segment (staged path; None: :data:`SEGMENT_BYTES`).
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = tp.size, tp.rank
    bounds = [int(x) for x in bounds]
    if n == 1 or bounds[-1] == bounds[0]:
        # one rank, or nothing to reduce: no message (every rank has the same
        # bounds, so every rank returns here); an empty device vector is not
        # sliced (on a GPU numba raises on a slice of a 0-element array)
        return
    stream = stream_of(kind, work) if stream is None else stream
    right, left = (r + 1) % n, (r - 1) % n
    tag = next_tag(tp)
    local = work if src is None else src
    maxlen = max(bounds[i + 1] - bounds[i] for i in range(n))
    if entry is None:
        dtmp = device_empty(kind, maxlen, work.dtype)
        for s in range(n - 1):
            sc, rc = (r - s - 1) % n, (r - s - 2) % n
            a, b = bounds[rc], bounds[rc + 1]
            send = (local if s == 0 else work)[bounds[sc]:bounds[sc + 1]]
            tp.synchronize(send)  # the reduction that produced it finished before the wire reads it
            exchange(tp, send, right, dtmp[:b - a], left, tag, timeout)
            combine(dtmp[:b - a], local[a:b], work[a:b], op, kind, stream)  # partial (op) own: ring_order
        record(kind, stream).synchronize()
        return
    seg = max(1, (SEGMENT_BYTES if segment_bytes is None else segment_bytes) // max(1, work.dtype.itemsize))
    (t0, t1), dtmp = entry.scratch(maxlen)
    host = entry.host
    sc0 = (r - 1) % n
    first = _segments(bounds[sc0], bounds[sc0 + 1], seg)
    for lo, hi in first:
        d2h(kind, local[lo:hi], host[lo:hi], stream)
    record(kind, stream).synchronize()
    sends = [tp.isend(host[lo:hi], right, tag) for lo, hi in first]
    for s in range(n - 1):
        rc = (r - s - 2) % n
        a, b = bounds[rc], bounds[rc + 1]
        tmp = t0 if s % 2 == 0 else t1
        segs = _segments(a, b, seg)
        recvs = [tp.irecv(tmp[lo - a:hi - a], left, tag) for lo, hi in segs]
        forward = s < n - 2
        nxt = []
        for (lo, hi), rq in zip(segs, recvs):
            waitall(tp, [rq], timeout)
            h2d(kind, tmp[lo - a:hi - a], dtmp[lo - a:hi - a], stream)
            combine(dtmp[lo - a:hi - a], local[lo:hi], work[lo:hi], op, kind, stream)  # partial (op) own
            d2h(kind, work[lo:hi], host[lo:hi], stream)
            if forward:  # the next step sends exactly this chunk: forward each segment as it is ready
                record(kind, stream).synchronize()
                nxt.append(tp.isend(host[lo:hi], right, tag))
        waitall(tp, sends, timeout)
        sends = nxt
    record(kind, stream).synchronize()


def allreduce_ring_device(tp, work, op, *, kind: str, src=None, timeout=None, entry: StagingEntry | None = None,
                          stream=None, segment_bytes: int | None = None) -> None:
    """Ring allreduce (Patarasuk & Yuan 2009) of a 1-D device vector, reduced on the device.

    The reduce-scatter of :func:`reduce_scatter_ring_device`, ``avg``'s
    division on the device, then the ring allgather: over device buffers when
    ``entry`` is None (CUDA-aware transport), else over the pinned host mirror
    ``entry.host`` followed by one asynchronous copy up of the other ranks'
    chunks.  Bit-identical to :func:`.allreduce_ring.allreduce_ring` on the
    same inputs.  A vector of 0 elements (the same count on every rank)
    returns at once: no message, and no slice of the empty device array.

    Args: as :func:`reduce_scatter_ring_device`.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = tp.size, tp.rank
    stream = stream_of(kind, work) if stream is None else stream
    if n == 1:
        if src is not None:
            d2d(kind, src, work, stream)
        finalize(work, 1, op, kind, stream)
        return
    count = work.size
    if count == 0:
        # nothing to reduce, send or divide (every rank has the same count): no
        # message, and the empty device vector is never sliced -- numba-cuda on
        # a GPU raises "non-empty slice into empty slice" on any slice of a
        # 0-element array (its allocation is NULL)
        return
    base, extra = divmod(count, n)
    bounds = [i * base + min(i, extra) for i in range(n + 1)]
    reduce_scatter_ring_device(tp, work, op, bounds, kind=kind, src=src, timeout=timeout, entry=entry,
                               stream=stream, segment_bytes=segment_bytes)
    a, b = bounds[r], bounds[r + 1]
    if entry is None:
        finalize(work[a:b], n, op, kind, stream)
        record(kind, stream).synchronize()
        allgather_ring_inplace(tp, work, bounds, timeout=timeout)
        return
    host = entry.host
    if getattr(op, "mean", False):
        finalize(work[a:b], n, op, kind, stream)
        d2h(kind, work[a:b], host[a:b], stream)
        record(kind, stream).synchronize()
    allgather_ring_inplace(tp, host, bounds, timeout=timeout)
    if a > 0:
        h2d(kind, host[:a], work[:a], stream)
    if b < count:
        h2d(kind, host[b:], work[b:], stream)
    entry.pending = record(kind, stream)
