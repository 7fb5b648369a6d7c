"""Device and pinned host memory, and copies between them, on the caller's stream.

The staging rules every layer shares when MPI is not CUDA-aware: host staging
buffers are page-locked (pinned) and made once per plan; device<->host copies
are asynchronous on CuPy's current stream; a send waits for that stream only
(:func:`stream_synchronize`), never for the whole device.

With CuPy on a real GPU the copies are ``cudaMemcpyAsync`` on raw addresses
(any array with ``__cuda_array_interface__``); otherwise (numba-only installs,
numba's CUDA simulator) numba's copy methods on arrays made kernel-ready by
:meth:`commlib.core.buffer.Buffer.as_numba`.  CuPy and numba are imported on
first use only.
"""
from __future__ import annotations

import numpy as np

from .buffer import as_buffer, cupy_usable
from .device import simulator_enabled as _sim

__all__ = ["pinned_empty", "mapped_empty", "device_empty", "to_host_async", "to_device_async",
           "stream_synchronize", "StreamMark"]

_DEFAULT = 4  # cudaMemcpyDefault (unified addressing: pinned host and device alike)


def pinned_empty(nbytes: int) -> np.ndarray:
    """A 1-D uint8 numpy array of ``nbytes`` bytes in page-locked host memory."""
    if cupy_usable():
        import cupy  # noqa: PLC0415

        mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, np.uint8, nbytes)  # the array keeps ``mem`` alive
    from numba import cuda  # noqa: PLC0415

    return cuda.pinned_array(nbytes, np.uint8)


def mapped_empty(nbytes: int):
    """``nbytes`` bytes of pinned host memory mapped into the device's address
    space (numba ``mapped_array``: a numpy array with a
    ``__cuda_array_interface__`` giving its device address)."""
    from numba import cuda  # noqa: PLC0415

    return cuda.mapped_array(nbytes, np.uint8)


def device_empty(nbytes: int, like=None):
    """A 1-D uint8 device array: CuPy when CuPy runs and ``like`` is not a numba
    array, else numba."""
    if cupy_usable() and not (like is not None and as_buffer(like).kind == "numba"):
        import cupy  # noqa: PLC0415

        return cupy.empty(nbytes, np.uint8)
    from numba import cuda  # noqa: PLC0415

    return cuda.device_array(nbytes, np.uint8)


def _flat_numba(arr):
    b = as_buffer(arr)
    a = b.as_numba()
    return a.reshape(b.size) if len(b.shape) != 1 else a


def to_host_async(dev, host: np.ndarray, start: int, stop: int) -> None:
    """Copy bytes ``[start, stop)`` of the 1-D uint8 device array ``dev`` into
    the same bytes of pinned ``host``, asynchronously on the current stream
    (synchronously on the numba path)."""
    if stop <= start:
        return
    if cupy_usable():
        import cupy  # noqa: PLC0415

        src = as_buffer(dev).ptr + start
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data + start, src, stop - start, _DEFAULT,
                                      cupy.cuda.get_current_stream().ptr)
        return
    _flat_numba(dev)[start:stop].copy_to_host(host[start:stop])


def to_device_async(host: np.ndarray, dev, start: int, stop: int) -> None:
    """Copy bytes ``[start, stop)`` of pinned ``host`` into the same bytes of the
    1-D uint8 device array ``dev``, asynchronously on the current stream."""
    if stop <= start:
        return
    if cupy_usable():
        import cupy  # noqa: PLC0415

        dst = as_buffer(dev).ptr + start
        cupy.cuda.runtime.memcpyAsync(dst, host.ctypes.data + start, stop - start, _DEFAULT,
                                      cupy.cuda.get_current_stream().ptr)
        return
    _flat_numba(dev)[start:stop].copy_to_device(host[start:stop])


def stream_synchronize() -> None:
    """Wait for the current stream (CuPy's), or numba's default stream."""
    if cupy_usable():
        import cupy  # noqa: PLC0415

        cupy.cuda.get_current_stream().synchronize()
        return
    from numba import cuda  # noqa: PLC0415

    if not _sim():
        cuda.default_stream().synchronize()  # pragma: no cover - needs a GPU


class StreamMark:
    """A reusable CUDA event: :meth:`record` marks the current stream's work so
    far, :meth:`wait` blocks the host until it is done (no-op on the numba
    path, whose copies are synchronous)."""

    __slots__ = ("_ev", "_live")

    def __init__(self):
        self._ev = None
        self._live = False
        if cupy_usable():
            import cupy  # noqa: PLC0415

            self._ev = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)

    def record(self) -> None:
        if self._ev is not None:
            self._ev.record()
            self._live = True

    def wait(self) -> None:
        if self._live:
            self._ev.synchronize()
            self._live = False
