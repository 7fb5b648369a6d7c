"""The MPI transport: point-to-point over an mpi4py communicator.

Host buffers go to MPI as they are.  Device buffers go to MPI directly when the
library is CUDA-aware (:func:`commlib.core.device.cuda_aware`); otherwise they are
staged through host memory: a send copies device→host before ``Isend``, a
receive ``Irecv``s into host memory and copies host→device when the request
completes.  The producing stream is synchronized before MPI reads a device
buffer.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI

from commlib.core.buffer import Buffer, as_buffer
from commlib.core.device import cuda_aware
from commlib.core.errors import BufferError, CommError, InvalidArgument

from .base import CompletedRequest, Request, Transport
from .failures import mpi_waitall, raise_classified

_BYTE = MPI.BYTE
# requests abandoned while pending (see MPIRequest.__del__); never freed
_ABANDONED: list = []

__all__ = ["MPITransport", "MPIRequest"]


class MPIRequest(Request):
    """Wraps an ``MPI.Request``; ``on_complete`` runs once when it finishes
    (host→device copy of a staged receive)."""

    __slots__ = ("req", "_on_complete", "_done", "_keep")

    def __init__(self, req: MPI.Request, on_complete: Callable[[], None] | None = None, keep=None):
        self.req = req
        self._on_complete = on_complete
        self._done = False
        self._keep = keep  # staging buffers must outlive the MPI request

    def _finish(self) -> None:
        self._done = True
        if self._on_complete is not None:
            cb, self._on_complete = self._on_complete, None
            cb()
        self._keep = None

    def test(self) -> bool:
        if self._done:
            return True
        if self.req.Test():
            self._finish()
            return True
        return False

    def _wait_forever(self) -> None:
        if not self._done:
            self.req.Wait()
            self._finish()

    def __del__(self):
        # mpi4py frees an active request when its object dies; a send freed
        # that way and failing later (a peer died) makes Open MPI's ULFM abort
        # the whole job ("Send error after request freed").  Requests dropped
        # while still pending (an error left them behind) are kept instead.
        if not self._done:
            try:
                req = self.req
                if req is not None and req != MPI.REQUEST_NULL:
                    _ABANDONED.append(req)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def cancel(self) -> None:
        """Cancel a pending operation (used when recovering from a failure)."""
        if not self._done:
            try:
                self.req.Cancel()
            except MPI.Exception:
                pass


class MPITransport(Transport):
    """Point-to-point transport over an ``MPI.Comm``.

    Args:
        comm: the mpi4py communicator (not duplicated; the caller owns it).
        cuda_aware: override CUDA-awareness detection (None: detect).
    """

    name = "mpi"

    def __init__(self, comm: MPI.Comm, cuda_aware: bool | None = None):
        self.comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self.cuda_aware = _detect(cuda_aware)
        self._statuses: list = []  # reused by waitall

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # ----------------------------------------------------------------- helpers
    def _check_peer(self, peer: int, what: str, op: str) -> None:
        if peer == MPI.PROC_NULL or (what == "source" and peer == MPI.ANY_SOURCE):
            return
        if not 0 <= peer < self._size:
            raise InvalidArgument(f"{what} {peer} out of range [0, {self._size})", rank=self._rank, op=op)

    def _wrap(self, buf, op: str) -> Buffer:
        b = as_buffer(buf, op=op, rank=self._rank)
        if not b.dense:
            raise BufferError(
                "buffer is not contiguous; pass datatype= or a contiguous array", rank=self._rank, op=op
            )
        return b

    @staticmethod
    def _mpi_buf(b: Buffer):
        if b.is_device:
            return [b.obj, b.nbytes, MPI.BYTE]
        return [b.byte_view() if b.nbytes else np.empty(0, np.uint8), b.nbytes, MPI.BYTE]

    # --------------------------------------------------------------- contract
    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        if type(buf) is np.ndarray and buf.flags.c_contiguous and 0 <= dest < self._size:
            # fast path (collectives' hot loop): host, C-contiguous; every
            # microsecond here is paid once per rank along a ring's critical path
            return MPIRequest(self.comm.Isend([buf, _BYTE], dest, tag), keep=buf)
        op = "isend"
        self._check_peer(dest, "dest", op)
        b = self._wrap(buf, op)
        if dest == MPI.PROC_NULL:
            return CompletedRequest()
        if b.is_device and not self.cuda_aware:
            host = b.to_host()
            return MPIRequest(self.comm.Isend([host, b.nbytes, MPI.BYTE], dest, tag), keep=host)
        b.synchronize()
        return MPIRequest(self.comm.Isend(self._mpi_buf(b), dest, tag), keep=b)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        if type(buf) is np.ndarray and buf.flags.c_contiguous and buf.flags.writeable and 0 <= source < self._size:
            return MPIRequest(self.comm.Irecv([buf, _BYTE], source, tag), keep=buf)  # fast path, as isend
        op = "irecv"
        self._check_peer(source, "source", op)
        b = self._wrap(buf, op)
        if source == MPI.PROC_NULL:
            return CompletedRequest()
        if b.is_device and not self.cuda_aware:
            host = np.empty(b.shape, dtype=b.dtype)
            return MPIRequest(
                self.comm.Irecv([host, b.nbytes, MPI.BYTE], source, tag), on_complete=lambda: b.from_host(host), keep=host
            )
        b.synchronize()
        return MPIRequest(self.comm.Irecv(self._mpi_buf(b), source, tag), keep=b)

    def send(self, buf, dest: int, tag: int = 0) -> None:
        op = "send"
        self._check_peer(dest, "dest", op)
        b = self._wrap(buf, op)
        if b.is_device and not self.cuda_aware:
            self.comm.Send([b.to_host(), b.nbytes, MPI.BYTE], dest, tag)
            return
        b.synchronize()
        self.comm.Send(self._mpi_buf(b), dest, tag)

    def recv(self, buf, source: int, tag: int = 0) -> MPI.Status:
        op = "recv"
        self._check_peer(source, "source", op)
        b = self._wrap(buf, op)
        status = MPI.Status()
        if b.is_device and not self.cuda_aware:
            host = np.empty(b.shape, dtype=b.dtype)
            self.comm.Recv([host, b.nbytes, MPI.BYTE], source, tag, status)
            b.from_host(host)
            return status
        b.synchronize()
        self.comm.Recv(self._mpi_buf(b), source, tag, status)
        return status

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, sendtag: int = 0, recvtag: int = 0) -> None:
        if (type(sendbuf) is np.ndarray and type(recvbuf) is np.ndarray and sendbuf.flags.c_contiguous
                and recvbuf.flags.c_contiguous and recvbuf.flags.writeable
                and 0 <= dest < self._size and 0 <= source < self._size):
            # fast path (one step of a collective): host, C-contiguous, one MPI call
            if not self.fault_tolerant:
                self.comm.Sendrecv([sendbuf, _BYTE], dest, sendtag, [recvbuf, _BYTE], source, recvtag)
            else:  # explicit requests (see Transport.fault_tolerant)
                self._complete([self.comm.Irecv([recvbuf, _BYTE], source, recvtag),
                                self.comm.Isend([sendbuf, _BYTE], dest, sendtag)])
            return
        op = "sendrecv"
        self._check_peer(dest, "dest", op)
        self._check_peer(source, "source", op)
        sb = self._wrap(sendbuf, op)
        rb = self._wrap(recvbuf, op)
        if (sb.is_device or rb.is_device) and not self.cuda_aware:
            super().sendrecv(sb, dest, rb, source, sendtag, recvtag)
            return
        sb.synchronize()
        rb.synchronize()
        self.comm.Sendrecv(self._mpi_buf(sb), dest, sendtag, self._mpi_buf(rb), source, recvtag)

    def barrier(self) -> None:
        self.comm.Barrier()

    # ------------------------------------------------- persistent requests
    def send_init(self, buf, dest: int, tag: int = 0) -> MPI.Prequest:
        """A persistent send (``MPI_Send_init``) of a host buffer (or a device
        buffer when MPI is CUDA-aware), for exchanges repeated every step.
        Start with ``MPI.Prequest.Startall``; complete with ``MPI.Request.Waitall``.

        Raises:
            BufferError: a device buffer without CUDA-aware MPI (stage it first).
        """
        return self._persistent(buf, dest, tag, "send_init")

    def recv_init(self, buf, source: int, tag: int = 0) -> MPI.Prequest:
        """A persistent receive (``MPI_Recv_init``); see :meth:`send_init`."""
        return self._persistent(buf, source, tag, "recv_init")

    def _persistent(self, buf, peer, tag, op):
        self._check_peer(peer, "dest" if op == "send_init" else "source", op)
        b = self._wrap(buf, op)
        if b.is_device and not self.cuda_aware:
            raise BufferError("persistent requests on device buffers need CUDA-aware MPI; stage through host",
                              rank=self._rank, op=op)
        init = self.comm.Send_init if op == "send_init" else self.comm.Recv_init
        return init(self._mpi_buf(b), peer, tag)

    def waitall(self, requests, timeout: float | None = None) -> None:
        """Wait for ``requests``: with ``timeout=None`` one ``MPI_Waitall`` (a
        ``MPI_Testall`` spin on a fault-tolerant transport, see
        ``Transport.fault_tolerant``); else by polling ``MPI_Testall`` until
        ``timeout`` seconds pass.  A process failure or revocation raises
        :class:`~commlib.core.errors.ProcessFailed`; other MPI errors propagate as ``MPI.Exception``
        (see :mod:`commlib.transports.failures`).

        Raises:
            CommTimeout: when ``timeout`` passes first.
        """
        if timeout is None:
            # fast path (collectives' hot loop): reused status objects; every
            # microsecond here is paid once per rank along a ring's critical path
            try:
                reqs = [r.req for r in requests]
            except AttributeError:  # not all MPIRequest: the general path
                mpi_waitall(requests, timeout, rank=self._rank)
                return
            self._complete(reqs)
            for r in requests:
                r._finish()
            return
        mpi_waitall(requests, timeout, rank=self._rank)

    def _complete(self, reqs: list) -> None:
        """Complete ``MPI.Request`` objects with no deadline, on reused status
        objects: one ``MPI_Waitall``, or on a fault-tolerant transport a
        ``MPI_Testall`` spin (see ``Transport.fault_tolerant``; the FT watchdog
        bounds it).  An error is classified (``raise_classified``) and the
        requests still pending are kept alive, never freed.
        """
        st = self._statuses
        while len(st) < len(reqs):
            st.append(MPI.Status())
        st = st[:len(reqs)]
        try:
            if not self.fault_tolerant:
                MPI.Request.Waitall(reqs, st)
            else:
                while not MPI.Request.Testall(reqs, st):
                    pass
        except MPI.Exception as exc:
            _ABANDONED.extend(q for q in reqs if q != MPI.REQUEST_NULL)
            raise_classified(exc, st, self._rank)

    def close(self) -> None:
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.comm != MPI.COMM_NULL:
            try:
                self.comm.Free()
            except MPI.Exception as exc:  # pragma: no cover
                raise CommError(f"MPI_Comm_free failed: {exc}", rank=self._rank, op="close") from exc


def _detect(flag: bool | None) -> bool:
    return cuda_aware() if flag is None else bool(flag)
