"""The collectives' view of a user buffer: checked, and on the host.

Every collective algorithm of :mod:`commlib.collectives` takes 1-D host arrays
(the ring allreduce and reduce-scatter also have a device variant,
:mod:`commlib.collectives._device_reduce`).  This module turns the user's
buffer into one:

- :func:`wrap`: any array (numpy, CuPy, numba device, DLPack) as a
  :class:`~commlib.core.buffer.Buffer`, refused unless its elements are plain
  bytes and it is contiguous (and writable, where the collective writes it);
- :class:`Staged`: a 1-D host view, host buffers viewed, C-contiguous device
  buffers copied through pinned memory that the communicator keeps per
  (role, count, dtype), asynchronously on the caller's stream;
- :func:`device_view`: a device buffer the device kernels can drive;
- :func:`deliver`: a result copied into the caller's ``recvbuf``, or returned
  as a new array of ``sendbuf``'s kind (numpy, or the same kind of device array).

It lives with the collectives, not the user API, because the engine
(:mod:`commlib.collectives.engine`) stages and restores buffers itself: an
algorithm never calls back up into the layer that called it.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from commlib.core.buffer import Buffer, as_buffer
from commlib.core.errors import BufferError, InvalidArgument
from commlib.transports.base import check_plain_dtype

__all__ = ["wrap", "Staged", "device_view", "device_kind", "to_host", "deliver"]


def wrap(obj, opname: str, what: str = "buffer", rank=None, *, written: str | None = None) -> Buffer:
    """``obj`` as a :class:`~commlib.core.buffer.Buffer` a collective can use.

    Args:
        obj: the user's array.
        opname, what, rank: for errors (``what``: the argument's name).
        written: None when the collective only reads ``obj``; else what it
            writes there (``"its result"``...): the buffer must then be
            writable (:attr:`~commlib.core.buffer.Buffer.readonly` clear), a
            check made with the others, before the argument agreement, so a
            read-only buffer is refused on every rank before any byte moves.

    Raises:
        BufferError: not an array, elements holding references, or not contiguous.
        InvalidArgument: ``written`` and ``obj`` is read-only.
    """
    b = as_buffer(obj, op=opname, rank=rank)
    check_plain_dtype(b.dtype, rank, opname, what)
    if not b.dense:
        raise BufferError(f"{what} is not contiguous", rank=rank, op=opname)
    if written is not None and b.readonly:
        raise InvalidArgument(f"{what} is read-only, but {opname} writes {written} into it; "
                              f"pass a writable array", rank=rank, op=opname)
    return b


class Staged:
    """A 1-D host view of a user buffer.

    Host buffers are viewed.  C-contiguous device buffers (CuPy, numba, the
    CUDA simulator's) are copied into pinned host memory from ``staging()``
    (a :class:`~commlib.collectives._device_reduce.StagingCache`, kept per
    (role, count, dtype)), asynchronously on the caller's stream; :meth:`flush`
    copies back the same way, without waiting (the caller's later work on that
    stream is ordered after it).  Other device buffers, or no ``staging``,
    take a fresh pageable copy.

    Args:
        b: the buffer.
        staging: zero-argument callable giving the communicator's staging cache, or None.
        role: the cache key's role (``"src"``, ``"dst"``, ``"buf"``, ``"out"``).
        down: copy a device buffer's contents to the host now (False: the host
            side is only written, e.g. a ``recvbuf``).
    """

    __slots__ = ("buf", "host", "shape", "dev", "kind", "entry", "stream")

    def __init__(self, b: Buffer, staging: Callable | None = None, role: str = "src", down: bool = True):
        self.buf = b
        self.shape = b.shape
        self.dev = self.entry = None
        if not b.is_device:
            self.host = np.asarray(b.array()).ravel(order="K")
            return
        dv = device_view(b)
        if dv is None or staging is None:
            # memory order, as host buffers (ravel(order="K")): an F-ordered
            # device buffer is flattened column-major
            self.host = b.to_host().reshape(-1, order=_order(b))
            return
        from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

        self.kind, self.dev, self.stream = dv
        self.entry = staging().get(role, self.kind, b.size, b.dtype)
        self.host = dr.stage_down(self.kind, self.dev, self.entry, self.stream) if down else self.entry.host

    def flush(self) -> None:
        """Copy the host result back into a device buffer."""
        if not self.buf.is_device:
            return
        if self.entry is not None:
            from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

            dr.stage_up(self.kind, self.entry, self.dev, self.stream)
        else:
            self.buf.from_host(self.host.reshape(self.shape, order=_order(self.buf)))


def _order(b: Buffer) -> str:
    """The memory order of a dense buffer: ``"F"`` only when it is F- and not C-contiguous."""
    return "F" if b.f_contiguous and not b.contiguous else "C"


def device_kind(arr) -> str:
    """``"cupy"`` or ``"numba"`` for a device array."""
    from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

    return dr.as_device_array(arr)[0]


def to_host(arr) -> np.ndarray:
    """A device array's contents as a new numpy array."""
    return arr.get() if device_kind(arr) == "cupy" else arr.copy_to_host()


def device_view(b: Buffer):
    """``(kind, 1-D device array, caller's stream)`` for a C-contiguous device
    buffer the device kernels can drive, else None (host, F-order, DLPack-only)."""
    if not b.is_device or not b.contiguous:
        return None
    from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

    kind, arr = dr.as_device_array(b.obj)
    return kind, dr.flat(kind, arr), dr.stream_of(kind, arr)


def deliver(recvbuf, out, opname: str, shape, *, staging: Callable | None = None, rank=None,
            like: Buffer | None = None):
    """Copy a result into ``recvbuf`` when it fits, else return it shaped ``shape``.

    Args:
        recvbuf: the caller's receive buffer, or None.
        out: the result, a 1-D numpy array or a device array (from the device
            variant of an algorithm).
        opname, rank: for errors.
        shape: the shape of a returned result.
        staging: as :class:`Staged`.
        like: the call's ``sendbuf`` (a :class:`~commlib.core.buffer.Buffer`):
            a returned result is a new array of its kind
            (:meth:`~commlib.core.buffer.Buffer.empty`); None: numpy.

    Returns:
        ``recvbuf``, holding the result, when it has ``out``'s size; else a new
        C-ordered array of ``shape`` and ``out``'s dtype: of ``like``'s kind
        when ``like`` is a device buffer (a host result copied up once, on the
        caller's stream, through the pinned staging; a device result copied on
        the device), else numpy.
    """
    dev = not isinstance(out, np.ndarray)
    if recvbuf is not None:
        rb = wrap(recvbuf, opname, "recvbuf", rank)
        if rb.size == out.size:
            _copy_into(rb, out, staging)
            return recvbuf
    if like is not None and like.is_device:
        # a device sendbuf gets a device result of its own kind: allocated here,
        # filled as a recvbuf would be (C order, as the host result's reshape)
        res = like.empty(shape)
        _copy_into(as_buffer(res, op=opname, rank=rank), out, staging)
        return res
    if dev:
        out = to_host(out)
    return out.reshape(shape)


def _copy_into(rb: Buffer, out, staging: Callable | None) -> None:
    """``out`` (1-D, numpy or device) copied into the dense buffer ``rb`` of the
    same size, in ``rb``'s memory order: on the device when both are device
    arrays of one kind, else through the host (:class:`Staged`)."""
    if not isinstance(out, np.ndarray):
        dv = device_view(rb)
        if dv is not None and dv[0] == device_kind(out):
            from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

            dr.d2d(dv[0], out, dv[1], dv[2])  # nothing (no slice) for 0 elements
            return
        out = to_host(out)
    st = Staged(rb, staging, "out", down=False)
    st.host[...] = out.reshape(-1)
    st.flush()
