"""One view type over every array commlib accepts.

:func:`as_buffer` wraps numpy arrays, CuPy arrays, numba device arrays (the CUDA
simulator's ``FakeCUDAArray`` included, which has no ``__cuda_array_interface__``)
and anything exporting DLPack, and tells the layers below what they need:
device or host, dtype, shape, strides, size in bytes, a raw byte view, and how to
synchronize the producing stream before a transport reads the memory.

Detection order: numpy ``ndarray``; ``__cuda_array_interface__``;
``__dlpack_device__``; ``__cuda_ndarray__`` (numba's simulator); the buffer
protocol.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import BufferError

__all__ = ["Buffer", "as_buffer", "is_device_array"]

_DLPACK_CPU = 1
_DLPACK_CUDA = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _is_simulator_array(obj) -> bool:
    return hasattr(obj, "__cuda_ndarray__") and not hasattr(obj, "__cuda_array_interface__")


def is_device_array(obj) -> bool:
    """True when ``obj`` lives in GPU memory (or is a numba CUDA-simulator device array)."""
    if isinstance(obj, np.ndarray):
        return False
    if hasattr(obj, "__cuda_array_interface__") or _is_simulator_array(obj):
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
        if self.kind in ("numba", "numba-sim"):
            flat = arr.reshape(self.size, order=order) if self.size else arr
            return flat.view(np.uint8)
        flat = arr.reshape(-1, order=order)
        return flat.view(np.uint8)

    def synchronize(self) -> None:
        """Wait for the stream that produced a device buffer, so a transport
        (MPI) reading it sees finished data.  A no-op for host buffers."""
        if not self.is_device:
            return
        if self.kind == "cupy":
            import cupy  # noqa: PLC0415

            cupy.cuda.get_current_stream().synchronize()
            return
        if self.kind in ("numba", "numba-sim"):
            stream = getattr(self.obj, "stream", 0)
            if stream:
                stream.synchronize()
            else:
                from numba import cuda  # noqa: PLC0415

                cuda.synchronize()
            return
        cai = getattr(self.obj, "__cuda_array_interface__", None)
        if cai and cai.get("stream"):  # pragma: no cover - needs a GPU
            from numba import cuda  # noqa: PLC0415

            cuda.external_stream(cai["stream"]).synchronize()

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
        if self.kind in ("numba", "numba-sim"):
            if out is not None:
                self.obj.copy_to_host(out)
                return out
            return self.obj.copy_to_host()
        from numba import cuda  # noqa: PLC0415  # pragma: no cover - needs a GPU

        return cuda.as_cuda_array(self.obj).copy_to_host(out)  # pragma: no cover

    def from_host(self, host: np.ndarray) -> None:
        """Copy a numpy array of the same shape and dtype into this buffer."""
        if not self.is_device:
            np.copyto(self.array(), host.reshape(self.shape))
            return
        if self.kind == "cupy":
            self.obj.set(host)
            return
        if self.kind in ("numba", "numba-sim"):
            self.obj.copy_to_device(host)
            return
        from numba import cuda  # noqa: PLC0415  # pragma: no cover - needs a GPU

        cuda.as_cuda_array(self.obj).copy_to_device(host)  # pragma: no cover


def _contiguity(shape, strides, itemsize):
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
    if hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"]) if not cai.get("descr") or len(cai["descr"]) == 1 else np.dtype(cai["descr"])
        if hasattr(obj, "dtype"):
            dtype = np.dtype(obj.dtype)
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        if strides is None:
            strides = tuple(np.empty(shape, dtype=np.uint8).strides[i] * dtype.itemsize for i in range(len(shape))) if shape else ()
        strides = tuple(strides)
        mod = type(obj).__module__.split(".")[0]
        kind = "cupy" if mod == "cupy" else ("numba" if mod == "numba" or mod == "numba_cuda" else "dlpack")
        c, f = _contiguity(shape, strides, dtype.itemsize)
        return Buffer(obj, kind, True, dtype, shape, strides, math.prod(shape) * dtype.itemsize, c, f)
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
            from numba import cuda  # noqa: PLC0415

            return as_buffer(cuda.from_dlpack(obj) if hasattr(cuda, "from_dlpack") else obj, op=op, rank=rank)
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


def _from_numpy(arr: np.ndarray, kind: str) -> Buffer:
    return Buffer(
        arr, kind, False, arr.dtype, arr.shape, arr.strides, arr.nbytes,
        arr.flags.c_contiguous, arr.flags.f_contiguous,
    )
