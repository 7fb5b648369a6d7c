"""One view type over every array commlib accepts.

:func:`as_buffer` wraps numpy arrays, CuPy arrays, numba device arrays (the CUDA
simulator's ``FakeCUDAArray`` included, which has no ``__cuda_array_interface__``)
and anything exporting DLPack, and tells the layers below what they need:
device or host, dtype, shape, strides, size in bytes, a raw byte view, and how to
synchronize the producing stream before a transport reads the memory.

Detection order: numpy ``ndarray``; ``__cuda_array_interface__``;
``__dlpack_device__``; ``__cuda_ndarray__`` (numba's simulator); the buffer
protocol.

This module is also the one adapter between foreign device arrays and the
device kernels: a :class:`Buffer` of a device array records the raw device
address (``ptr``) and the producer's stream from the CUDA Array Interface
(version 3, https://numba.readthedocs.io/en/stable/cuda/cuda_array_interface.html),
and :meth:`Buffer.as_numba` / :meth:`Buffer.as_cupy` turn it into the array
type a kernel takes, zero-copy.  Nothing below this module hands a CuPy or
torch array to numba's host-copy functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import config
from .errors import BufferError

__all__ = ["Buffer", "as_buffer", "is_device_array", "cupy_usable", "grown"]

_DLPACK_CPU = 1
_DLPACK_CUDA = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _has_cai(obj) -> bool:
    """True when ``obj`` exports ``__cuda_array_interface__``.  A torch CUDA tensor
    that requires grad raises RuntimeError from that property (``hasattr`` lets it
    through): it counts as an exporter, and :func:`as_buffer` names the fix."""
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except RuntimeError:
        return True


def _is_simulator_array(obj) -> bool:
    return hasattr(obj, "__cuda_ndarray__") and not _has_cai(obj)


def is_device_array(obj) -> bool:
    """True when ``obj`` lives in GPU memory (or is a numba CUDA-simulator device array)."""
    if isinstance(obj, np.ndarray):
        return False
    if _has_cai(obj) or _is_simulator_array(obj):
        return True
    if hasattr(obj, "__dlpack_device__"):
        try:
            return obj.__dlpack_device__()[0] in _DLPACK_CUDA
        except Exception:  # pragma: no cover - exotic exporters
            return False
    return False


@dataclass
class Buffer:
    """A typed view of one array.

    Attributes:
        obj: the array the user passed (never copied).
        kind: ``"numpy"``, ``"cupy"``, ``"numba"``, ``"numba-sim"`` or ``"dlpack"``.
        is_device: True for GPU memory (and simulator device arrays).
        dtype: numpy dtype of the elements.
        shape: tuple of ints.
        strides: tuple of ints, bytes.
        nbytes: ``prod(shape) * itemsize``, bytes.
        contiguous: True if the elements are C-contiguous.
        f_contiguous: True if the elements are Fortran-contiguous.
        ptr: device address of the first byte (from ``__cuda_array_interface__``;
            0 for host buffers and the simulator's arrays, which have none).
        stream: the producer's CUDA stream handle from the interface (None when
            the producer gave none: then work is ordered on the default stream).
        readonly: True when the memory must not be written: a host array's
            ``writeable`` flag cleared (numpy, a read-only buffer-protocol
            object such as ``bytes``, a read-only DLPack export), or the CUDA
            Array Interface's read-only flag.  Device arrays without such a
            flag (CuPy, numba, the simulator's) are writable.
    """

    obj: Any
    kind: str
    is_device: bool
    dtype: np.dtype
    shape: tuple
    strides: tuple
    nbytes: int
    contiguous: bool
    f_contiguous: bool
    ptr: int = 0
    stream: int | None = None
    readonly: bool = False

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def dense(self) -> bool:
        """True when the elements occupy one gap-free run of memory (C or F order)."""
        return self.contiguous or self.f_contiguous

    # ------------------------------------------------------------------ views
    def array(self):
        """The array as its own library's type, with numpy-like indexing
        (numpy, CuPy or numba device array)."""
        if self.kind == "dlpack" and not self.is_device:
            return np.from_dlpack(self.obj)
        return self.obj

    def byte_view(self):
        """A 1-D uint8 view of the same memory (numpy for host buffers, the
        array's own type for device buffers).

        Raises:
            BufferError: when the buffer is not contiguous in memory.
        """
        if not self.dense:
            raise BufferError("byte_view needs a contiguous buffer", op="Buffer.byte_view")
        arr = self.array()
        order = "C" if self.contiguous else "F"
        if self.kind == "cai":  # a foreign device array: through a kernel-ready type
            arr = self.as_cupy() if cupy_usable() else self.as_numba()
            if not cupy_usable():
                flat = arr.reshape(self.size, order=order) if self.size else arr
                return flat.view(np.uint8)
        if self.kind in ("numba", "numba-sim"):
            flat = arr.reshape(self.size, order=order) if self.size else arr
            return flat.view(np.uint8)
        flat = arr.reshape(-1, order=order)
        return flat.view(np.uint8)

    def as_numba(self):
        """The buffer as an array numba.cuda kernels take, sharing memory:
        a numba device array as it is; anything else with the CUDA Array
        Interface wrapped without a copy (on a GPU by
        ``numba.cuda.from_cuda_array_interface``; under the CUDA simulator, where
        device memory is host memory, as a simulator array over the same
        address).  Host arrays are returned unchanged."""
        if not self.is_device or self.kind in ("numba", "numba-sim"):
            return self.obj
        cai = self.obj.__cuda_array_interface__
        from numba import cuda  # noqa: PLC0415 - only for device buffers

        if _simulator():
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # noqa: PLC0415

            return FakeCUDAArray(_host_view(self, cai))
        return cuda.from_cuda_array_interface(cai, owner=self.obj, sync=False)  # pragma: no cover - GPU

    def as_cupy(self):
        """The buffer as a CuPy array sharing memory (zero-copy through the
        CUDA Array Interface).  Raises ImportError without CuPy."""
        import cupy  # noqa: PLC0415

        if self.kind == "cupy":
            return self.obj
        return cupy.asarray(self.obj)  # pragma: no cover - needs a GPU

    def synchronize(self) -> None:
        """Wait for the stream that produced a device buffer, so a transport
        (MPI) reading it sees finished data: the interface's stream, else
        CuPy's current stream for CuPy arrays, else the array's numba stream,
        else the default stream -- never a device-wide synchronize.  A no-op
        for host buffers."""
        if not self.is_device:
            return
        if self.kind == "numba-sim":
            return  # the simulator runs kernels synchronously
        if self.stream not in (None, 0):  # pragma: no cover - needs a GPU
            _external_stream_sync(self.stream)
            return
        if self.kind == "cupy":
            import cupy  # noqa: PLC0415

            cupy.cuda.get_current_stream().synchronize()
            return
        stream = getattr(self.obj, "stream", 0) if self.kind == "numba" else 0
        from numba import cuda  # noqa: PLC0415

        if _simulator():
            return
        (stream or cuda.default_stream()).synchronize()  # pragma: no cover - needs a GPU

    def to_host(self, out: np.ndarray | None = None) -> np.ndarray:
        """Copy (device) or view (host) the buffer as a numpy array of the same shape.

        Args:
            out: optional preallocated numpy array of the same shape and dtype
                (reused for staging so steady-state transfers do not allocate).
        """
        if not self.is_device:
            arr = self.array()
            if out is not None:
                np.copyto(out, arr)
                return out
            return np.asarray(arr)
        if self.kind == "cupy":
            import cupy  # noqa: PLC0415

            return cupy.asnumpy(self.obj, out=out)
        # numba arrays as they are; any other CUDA Array Interface exporter through
        # the zero-copy numba view of :meth:`as_numba` (numba.cuda has no
        # ``as_cuda_array`` under the simulator)
        arr = self.obj if self.kind in ("numba", "numba-sim") else self.as_numba()
        if out is not None:
            arr.copy_to_host(out)
            return out
        return arr.copy_to_host()

    def empty(self, shape) -> Any:
        """A new, uninitialized, C-ordered array of ``shape`` and this buffer's
        dtype, of the same kind as :attr:`obj`: numpy for host buffers (numpy,
        buffer-protocol objects, host DLPack); a numba device array for numba
        and simulator arrays (on the array's own stream); CuPy for CuPy (on its
        device); a torch tensor on the same device for a torch CUDA tensor;
        any other ``__cuda_array_interface__`` exporter gets the kernel-ready
        type (CuPy where it runs, else numba), a DLPack-only device exporter
        CuPy (:func:`as_buffer` took it as CuPy).  Collectives that allocate their
        result make it here, so a device ``sendbuf`` gives a device result."""
        shape = tuple(int(n) for n in shape)
        if not self.is_device:
            return np.empty(shape, self.dtype)
        kind = self.kind
        if kind == "cai" and type(self.obj).__module__.split(".")[0] == "torch":  # pragma: no cover - GPU
            # the tensor's own allocator (its dtype and device), without importing torch here
            return self.obj.new_empty(shape, requires_grad=False)
        if kind == "cupy" or (kind not in ("numba", "numba-sim") and cupy_usable()):  # pragma: no cover - GPU
            import cupy  # noqa: PLC0415

            dev = getattr(self.obj, "device", None) if kind == "cupy" else None
            if dev is None:
                return cupy.empty(shape, self.dtype)
            with dev:
                return cupy.empty(shape, self.dtype)
        from numba import cuda  # noqa: PLC0415

        stream = getattr(self.obj, "stream", 0) if kind == "numba" else 0
        if self.dtype.name == "bfloat16":  # numba has no bfloat16 dtype: uint8 memory viewed as it
            flat = cuda.device_array(math.prod(shape) * self.dtype.itemsize, np.uint8, stream=stream)
            return flat.view(self.dtype).reshape(shape)
        return cuda.device_array(shape, self.dtype, stream=stream)

    def from_host(self, host: np.ndarray) -> None:
        """Copy a numpy array of the same shape and dtype into this buffer."""
        if not self.is_device:
            np.copyto(self.array(), host.reshape(self.shape))
            return
        if self.kind == "cupy":
            self.obj.set(host)
            return
        arr = self.obj if self.kind in ("numba", "numba-sim") else self.as_numba()
        arr.copy_to_device(host)


def _simulator() -> bool:
    return config.cuda_simulator


def cupy_usable() -> bool:
    """True when CuPy imports and a real GPU is in use (not the CUDA simulator);
    checked once."""
    global _CUPY_OK
    if _CUPY_OK is None:
        _CUPY_OK = False
        if not _simulator():
            try:
                import cupy  # noqa: PLC0415

                _CUPY_OK = cupy.cuda.runtime.getDeviceCount() > 0
            except Exception:  # ImportError, no driver, no device
                _CUPY_OK = False
    return _CUPY_OK


_CUPY_OK = None


def _external_stream_sync(handle: int) -> None:  # pragma: no cover - needs a GPU
    if cupy_usable():
        import cupy  # noqa: PLC0415

        cupy.cuda.ExternalStream(handle).synchronize()
        return
    from numba import cuda  # noqa: PLC0415

    cuda.external_stream(handle).synchronize()


def _host_view(b: "Buffer", cai) -> np.ndarray:
    """Under the simulator, device memory is host memory: a numpy view of the
    interface's address with its shape and strides (no copy)."""
    import ctypes  # noqa: PLC0415

    ptr = cai["data"][0]
    lo, hi = _extent(b.shape, b.strides, b.dtype.itemsize)
    if b.nbytes == 0:
        return np.empty(b.shape, b.dtype)
    raw = (ctypes.c_uint8 * (hi - lo)).from_address(ptr + lo)
    return np.ndarray(b.shape, b.dtype, buffer=raw, offset=-lo, strides=b.strides)


def _extent(shape, strides, itemsize):
    """Byte range ``[lo, hi)`` the elements of an array touch, from element 0."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        if s < 0:
            lo += s * (n - 1)
        else:
            hi += s * (n - 1)
    return lo, hi + itemsize


def _contiguity(shape, strides, itemsize):
    if 0 in shape:
        return True, True  # no element: any strides describe it
    c = f = True
    expect = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            c = False
        expect *= n
    expect = itemsize
    for n, s in zip(shape, strides):
        if n != 1 and s != expect:
            f = False
        expect *= n
    return c, f


def as_buffer(obj, *, op: str = "as_buffer", rank: int | None = None) -> Buffer:
    """Wrap an array as a :class:`Buffer`.

    Args:
        obj: numpy array, CuPy array, numba device array (real or simulated),
            a DLPack exporter, or a host object supporting the buffer protocol.
        op: operation name used in error messages.
        rank: rank used in error messages.

    Returns:
        Buffer: a view that shares memory with ``obj``.

    Raises:
        BufferError: when ``obj`` is not an array commlib understands.
    """
    if isinstance(obj, Buffer):
        return obj
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, "numpy")
    if _has_cai(obj):
        try:
            cai = obj.__cuda_array_interface__
        except RuntimeError as exc:  # torch: "Can't get __cuda_array_interface__ on Variable that requires grad"
            raise BufferError(f"{type(obj).__name__} does not export its memory ({exc}); for a tensor that "
                              "requires grad pass tensor.detach() (the collectives move bytes, not gradients; "
                              "commlib.nn's attention functions are the autograd-aware ones)",
                              rank=rank, op=op) from None
        return _from_cai(obj, cai, op, rank)
    if _is_simulator_array(obj):
        dtype = np.dtype(obj.dtype)
        shape = tuple(obj.shape)
        strides = tuple(obj.strides)
        c, f = _contiguity(shape, strides, dtype.itemsize)
        return Buffer(obj, "numba-sim", True, dtype, shape, strides, math.prod(shape) * dtype.itemsize, c, f)
    if hasattr(obj, "__dlpack_device__"):
        dev = obj.__dlpack_device__()[0]
        if dev == _DLPACK_CPU:
            arr = np.from_dlpack(obj)
            b = _from_numpy(arr, "dlpack")
            b.obj = obj
            return b
        if dev in _DLPACK_CUDA:  # pragma: no cover - needs a GPU
            if cupy_usable():
                import cupy  # noqa: PLC0415

                return as_buffer(cupy.from_dlpack(obj), op=op, rank=rank)  # shares the memory
            raise BufferError(f"{type(obj).__name__} exports DLPack device memory only; install CuPy "
                              "(the cuda12/cuda13 extra) to use it", rank=rank, op=op)
    try:
        arr = np.asarray(memoryview(obj))
    except TypeError:
        raise BufferError(
            f"unsupported buffer type {type(obj).__name__}: pass a numpy, CuPy or numba "
            "device array, or an object with DLPack",
            rank=rank,
            op=op,
        ) from None
    return _from_numpy(arr, "numpy")


def _from_cai(obj, cai, op, rank) -> Buffer:
    """A device Buffer from a CUDA Array Interface dict (version 0-3): typestr,
    shape, strides (None = C order), data = (address, read-only), stream.

    Raises:
        BufferError: a malformed interface: a missing or unknown entry, a
            negative extent, strides of another length than the shape, a null
            address for a non-empty array, or a ``mask`` (not supported)."""
    try:
        descr = cai.get("descr")
        dtype = np.dtype(cai["typestr"]) if not descr or len(descr) == 1 else np.dtype(descr)
        shape = tuple(int(n) for n in cai["shape"])
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise BufferError(f"malformed __cuda_array_interface__ on {type(obj).__name__}: {exc}",
                          rank=rank, op=op) from None
    strides = cai.get("strides")
    if strides is None:
        acc, rev = dtype.itemsize, []
        for n in reversed(shape):
            rev.append(acc)
            acc *= n
        strides = tuple(reversed(rev))
    strides = tuple(int(x) for x in strides)
    problem = None
    if any(n < 0 for n in shape):
        problem = f"negative extent in shape {shape}"
    elif len(strides) != len(shape):
        problem = f"strides {strides} do not match shape {shape}"
    elif cai.get("mask") is not None:
        problem = "masked arrays (a 'mask' entry) are not supported; pass the unmasked data"
    elif not ptr and math.prod(shape):
        problem = "a null data pointer for a non-empty array"
    if problem is not None:
        raise BufferError(f"malformed __cuda_array_interface__ on {type(obj).__name__}: {problem}",
                          rank=rank, op=op)
    mod = type(obj).__module__.split(".")[0]
    kind = "cupy" if mod == "cupy" else ("numba" if mod in ("numba", "numba_cuda") else "cai")
    c, f = _contiguity(shape, strides, dtype.itemsize)
    stream = cai.get("stream")
    return Buffer(obj, kind, True, dtype, shape, strides, math.prod(shape) * dtype.itemsize, c, f,
                  int(ptr or 0), None if stream is None else int(stream), bool(readonly))


def _from_numpy(arr: np.ndarray, kind: str) -> Buffer:
    return Buffer(
        arr, kind, False, arr.dtype, arr.shape, arr.strides, arr.nbytes,
        arr.flags.c_contiguous, arr.flags.f_contiguous, readonly=not arr.flags.writeable,
    )


def grown(keep: np.ndarray | None, nbytes: int) -> np.ndarray:
    """A host scratch of at least ``nbytes`` bytes (uint8, 1-D): ``keep`` when it
    is large enough, else a new one to keep instead.  Callers that repeat large
    calls hold one and pass it back, so a fresh buffer of many MiB does not cost
    page faults on every call."""
    if keep is None or keep.nbytes < nbytes:
        keep = np.empty(max(nbytes, 1), np.uint8)
    return keep
