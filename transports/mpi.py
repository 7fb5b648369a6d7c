"""The MPI transport: point-to-point over an mpi4py communicator.

Host buffers go to MPI as they are.  Device buffers go to MPI directly when the
library is CUDA-aware (:func:`commlib.core.device.cuda_aware`); otherwise they are
staged through host memory: a send copies device→host before ``Isend``, a
receive ``Irecv``s into host memory and, when the request completes, copies up
exactly the bytes that arrived (the status's count) into the same bytes of the
device buffer, in memory order.  A message shorter than the buffer thus leaves
the rest of it as it was, as MPI's own receive into host memory does (MPI-4.0
§3.2.4), without a device→host copy of the buffer before the receive.  The
producing stream is synchronized before MPI reads a device buffer.

This module (with its request handle, :mod:`~commlib.transports.mpi_request`,
its reductions, :mod:`~commlib.transports.mpi_ops`, and
:mod:`~commlib.transports.failures`) is the only place in commlib that calls
MPI to communicate: point to point, persistent requests, MPI's own
collectives (``native_*``), communicator and grid creation and queries, and
ULFM's revoke / agree / shrink.  Every MPI error leaves it as a classified
:class:`~commlib.CommError`.
"""
from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from commlib.core.buffer import Buffer, as_buffer
from commlib.core.device import cuda_aware
from commlib.core.errors import BufferError, CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import timeout_problem, wait_bound_ok

from .base import CompletedRequest, Request, Transport, Wire, check_plain_dtype
from .failures import is_process_failure, mpi_failed_ranks, raise_classified, to_comm_error
from .mpi_ops import dims_create, free_plans, mpi_op, native_op, op_name, persistent_allgather, shrunk_node_peers
from .mpi_request import ABANDONED, MPIRequest, cancel_receive, copy_up, raise_completion_error
from .mpi_topo import Topology

_BYTE = MPI.BYTE
_U8 = np.dtype(np.uint8)  # builtin dtypes are singletons: `is` is the cheap test
PROC_NULL, ANY_SOURCE, ANY_TAG = MPI.PROC_NULL, MPI.ANY_SOURCE, MPI.ANY_TAG

__all__ = ["MPITransport", "MPIRequest", "PROC_NULL", "ANY_SOURCE", "ANY_TAG", "mpi_op", "op_name", "dims_create"]


class MPITransport(Topology, Transport):
    """The transport contract over an ``MPI.Comm``.

    Creating one is collective over ``comm`` (it learns which ranks share this
    rank's node, ``MPI_Comm_split_type``), so a point-to-point call never runs
    a hidden collective; not when ``node_peers`` is given (:meth:`dup` and
    :meth:`shrink` derive them from this transport's).

    Args:
        comm: the mpi4py communicator (not duplicated; the transport owns it
            from now on and frees it in :meth:`close`, unless it is
            ``COMM_WORLD``/``COMM_SELF``).
        cuda_aware: override CUDA-awareness detection (None: detect).
        node_peers: the ranks of ``comm`` on this node, when the caller knows
            them (a duplicate of a known group); None: computed here, collectively.

    Attributes:
        comm: the ``MPI.Comm``.
        node_peers: frozenset of ranks of ``comm`` on this rank's node.
        tag_ub: ``MPI_TAG_UB`` of ``comm``.
    """

    name = "mpi"

    def __init__(self, comm: MPI.Comm, cuda_aware: bool | None = None, node_peers=None):
        self.comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self.cuda_aware = _detect(cuda_aware)
        self._statuses: list = []  # reused by waitall
        self._raw_lists: dict = {}  # id(list of persistent requests) -> (list, its MPI.Request objects)
        self._plans: list = []  # persistent collectives of allgather_plan, freed by close()
        ub = comm.Get_attr(MPI.TAG_UB)
        self.tag_ub = int(ub) if ub is not None else 32767
        super().__init__()
        self.thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.node_peers = frozenset(node_peers) if node_peers is not None else self._node_peers()

    def _node_peers(self) -> frozenset:
        if self._size == 1:
            return frozenset((0,))
        try:
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            try:
                g, mine = node.Get_group(), self.comm.Get_group()
                ranks = MPI.Group.Translate_ranks(g, list(range(node.Get_size())), mine)
                g.Free()
                mine.Free()
            finally:
                node.Free()
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "node_peers")
        return frozenset(int(r) for r in ranks)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # ----------------------------------------------------------------- helpers
    def check_peer(self, peer: int, what: str, op: str) -> None:
        """As :meth:`Transport.check_peer`; ``PROC_NULL`` (and ``ANY_SOURCE`` as a source) pass."""
        if peer == MPI.PROC_NULL or (what == "source" and peer == MPI.ANY_SOURCE):
            return
        if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) or not 0 <= peer < self._size:
            raise InvalidArgument(f"{what} {peer!r} out of range [0, {self._size})", rank=self._rank, op=op)

    def _wrap(self, buf, op: str) -> Buffer:
        b = as_buffer(buf, op=op, rank=self._rank)
        check_plain_dtype(b.dtype, self._rank, op)
        if not b.dense:
            raise BufferError(
                "buffer is not contiguous; pass datatype= or a contiguous array", rank=self._rank, op=op
            )
        return b

    def check(self, buf, peer: int, op: str, receive: bool = False) -> None:
        """Validate one side of a point-to-point call without posting anything
        (``sendrecv`` checks both sides before either is posted).

        Raises:
            InvalidArgument: ``peer`` out of range, or a dtype with references.
            BufferError: ``buf`` is not a usable contiguous buffer, or a read-only
                one to receive into.
        """
        self.check_peer(peer, "source" if receive else "dest", op)
        if isinstance(buf, Wire):
            b = as_buffer(buf.obj, op=op, rank=self._rank)
            check_plain_dtype(b.dtype, self._rank, op)
        else:
            b = self._wrap(buf, op)
        if receive and b.readonly:
            raise BufferError("the receive buffer is read-only; pass a writable array", rank=self._rank, op=op)

    def _spec(self, buf, op: str, receive: bool):
        """``(MPI buffer spec, keep-alive, on_complete)`` for ``buf`` (array or
        :class:`Wire`); device memory is synchronized, or staged through host
        memory when MPI is not CUDA-aware."""
        if isinstance(buf, Wire):
            obj, count, dt = buf
            mdt = _BYTE if dt == "byte" else MPI.PACKED if dt == "packed" else dt
            b = as_buffer(obj, op=op, rank=self._rank)
            check_plain_dtype(b.dtype, self._rank, op)
            if receive and b.readonly:
                raise BufferError("the receive buffer is read-only; pass a writable array", rank=self._rank, op=op)
            if b.is_device and not self.cuda_aware:
                if not isinstance(dt, str):
                    raise BufferError("an MPI datatype over device memory needs CUDA-aware MPI",
                                      rank=self._rank, op=op)
                if receive:
                    host = np.empty(b.nbytes, np.uint8)
                    return [host, count, mdt], host, copy_up(b, host)
                host = b.to_host()
                return [host, count, mdt], host, None
            if b.is_device:
                b.synchronize()
                return [b.obj, count, mdt], b, None
            mem = b.byte_view() if b.nbytes else np.empty(0, np.uint8)
            return [mem, count, mdt], b, None
        b = self._wrap(buf, op)
        if receive and b.readonly:
            raise BufferError("the receive buffer is read-only; pass a writable array", rank=self._rank, op=op)
        if b.is_device and not self.cuda_aware:
            if receive:
                host = np.empty(b.nbytes, np.uint8)
                return [host, b.nbytes, _BYTE], host, copy_up(b, host)
            host = b.to_host()
            return [host, b.nbytes, _BYTE], host, None
        b.synchronize()
        return self._mpi_buf(b), b, None

    @staticmethod
    def _mpi_buf(b: Buffer):
        if b.is_device:
            return [b.obj, b.nbytes, _BYTE]
        return [b.byte_view() if b.nbytes else np.empty(0, np.uint8), b.nbytes, _BYTE]

    def synchronize(self, buf) -> None:
        """Wait for the stream that produced device ``buf`` (no-op for host memory)."""
        b = as_buffer(buf.obj if isinstance(buf, Wire) else buf, op="synchronize", rank=self._rank)
        if b.is_device:
            b.synchronize()

    # --------------------------------------------------------------- contract
    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        if type(buf) is np.ndarray and buf.flags.c_contiguous and 0 <= dest < self._size and not buf.dtype.hasobject:
            # fast path (collectives' hot loop): host, C-contiguous; every
            # microsecond here is paid once per rank along a ring's critical path
            try:
                return MPIRequest(self.comm.Isend([buf, _BYTE], dest, tag), keep=buf, rank=self._rank)
            except MPI.Exception as exc:
                raise_classified(exc, (), self._rank, "isend")
        op = "isend"
        self.check_peer(dest, "dest", op)
        spec, keep, _ = self._spec(buf, op, False)
        if dest == MPI.PROC_NULL:
            return CompletedRequest()
        try:
            return MPIRequest(self.comm.Isend(spec, dest, tag), keep=keep, rank=self._rank)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, op)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        if (type(buf) is np.ndarray and buf.flags.c_contiguous and buf.flags.writeable and 0 <= source < self._size
                and not buf.dtype.hasobject):
            try:  # as isend
                return MPIRequest(self.comm.Irecv([buf, _BYTE], source, tag), keep=buf, rank=self._rank)
            except MPI.Exception as exc:
                raise_classified(exc, (), self._rank, "irecv")
        op = "irecv"
        self.check_peer(source, "source", op)
        spec, keep, done = self._spec(buf, op, True)
        if source == MPI.PROC_NULL:
            return CompletedRequest()
        try:
            return MPIRequest(self.comm.Irecv(spec, source, tag), on_complete=done, keep=keep, rank=self._rank)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, op)

    def send(self, buf, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Blocking send; ``timeout``: seconds it may wait (None: no bound), then
        :class:`CommTimeout` (the send stays posted: MPI cannot withdraw it, so
        ``buf`` must stay unchanged until a receiver takes it)."""
        op = "send"
        self.check_peer(dest, "dest", op)
        spec, keep, _ = self._spec(buf, op, False)
        if timeout is not None:
            if dest != MPI.PROC_NULL:
                self._bounded(self._post(lambda: self.comm.Isend(spec, dest, tag), op), keep, timeout, op,
                              False)
            return
        try:
            if self.fault_tolerant:
                self._complete([self.comm.Isend(spec, dest, tag)], op)
                return
            self.comm.Send(spec, dest, tag)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, op)

    def send_checked(self, wire: Wire, dest: int, tag: int = 0) -> None:
        """A blocking send of a message the caller built and checked: ``wire`` a
        :class:`Wire` over a contiguous host numpy array, to a valid ``dest`` (the
        typed point-to-point's cached plans, :mod:`commlib.typed_p2p`); no
        staging, no bound: only on a transport that is not fault tolerant, for a
        call with no timeout (else :meth:`send`)."""
        obj, count, dt = wire
        try:
            self.comm.Send([obj, count, MPI.PACKED if type(dt) is str else dt], dest, tag)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "send")

    def recv_checked(self, wire: Wire, source: int, tag: int = 0, *, status: bool = True) -> MPI.Status | None:
        """:meth:`send_checked`'s receive, into a checked, writable host ``wire``;
        returns the ``MPI.Status`` (None with ``status=False``: ``MPI_STATUS_IGNORE``);
        a truncated message raises as :meth:`recv` does."""
        obj, count, dt = wire
        status = MPI.Status() if status else None
        try:
            self.comm.Recv([obj, count, MPI.PACKED if type(dt) is str else dt], source, tag, status)
        except MPI.Exception as exc:
            raise_completion_error(exc, (status,) if status is not None else (), self._rank, "recv")
        return status

    def recv(self, buf, source: int, tag: int = 0, *, timeout: float | None = None) -> MPI.Status:
        """Blocking receive; returns the ``MPI.Status`` (source, tag, byte count).
        ``timeout``: seconds it may wait (None: no bound), then
        :class:`CommTimeout` with the receive cancelled (nothing is written into
        ``buf`` afterwards)."""
        op = "recv"
        self.check_peer(source, "source", op)
        spec, keep, done = self._spec(buf, op, True)
        status = MPI.Status()
        if timeout is not None:
            if source != MPI.PROC_NULL:
                st = self._bounded(self._post(lambda: self.comm.Irecv(spec, source, tag), op), keep, timeout, op,
                                   True)
                status = MPI.Status(st)
                if done is not None:
                    done(status.Get_count(_BYTE))
            return status
        try:
            self.comm.Recv(spec, source, tag, status)
        except MPI.Exception as exc:
            raise_completion_error(exc, (status,), self._rank, op)
        if done is not None:
            done(status.Get_count(_BYTE))  # PROC_NULL: 0 bytes
        return status

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, sendtag: int = 0, recvtag: int = 0, *,
                 timeout: float | None = None) -> None:
        if timeout is not None:  # the user's bounded exchange (a fault-tolerant communicator)
            op = "sendrecv"
            self.check(recvbuf, source, op, receive=True)  # both sides before either is posted
            self.check(sendbuf, dest, op)
            reqs = self._post_pair(sendbuf, dest, recvbuf, source, sendtag, recvtag)
            try:
                self.waitall(reqs, timeout, op=op)
            except CommTimeout:
                if not cancel_receive(reqs[0]):
                    _KEPT.append(recvbuf)  # MPI may still write it
                raise
            return
        if (type(sendbuf) is np.ndarray and type(recvbuf) is np.ndarray and sendbuf.flags.c_contiguous
                and recvbuf.flags.c_contiguous and recvbuf.flags.writeable
                and 0 <= dest < self._size and 0 <= source < self._size
                and not sendbuf.dtype.hasobject and not recvbuf.dtype.hasobject):
            # fast path (one step of a collective): host, C-contiguous, one MPI call
            try:
                if not self.fault_tolerant:
                    self.comm.Sendrecv([sendbuf, _BYTE], dest, sendtag, [recvbuf, _BYTE], source, recvtag)
                else:  # explicit requests (see Transport.fault_tolerant)
                    self._complete([self.comm.Irecv([recvbuf, _BYTE], source, recvtag),
                                    self.comm.Isend([sendbuf, _BYTE], dest, sendtag)], "sendrecv")
            except MPI.Exception as exc:
                raise_completion_error(exc, (), self._rank, "sendrecv")
            return
        op = "sendrecv"
        self.check(recvbuf, source, op, receive=True)  # both sides before either is posted
        self.check(sendbuf, dest, op)
        self.waitall(self._post_pair(sendbuf, dest, recvbuf, source, sendtag, recvtag), op=op)

    def _post_pair(self, sendbuf, dest, recvbuf, source, sendtag, recvtag) -> list:
        """Post a sendrecv's receive, then its send; a send that fails to post
        withdraws the receive first (left posted, it would take a later message)."""
        rreq = self.irecv(recvbuf, source, recvtag)
        try:
            return [rreq, self.isend(sendbuf, dest, sendtag)]
        except BaseException:
            if not cancel_receive(rreq):
                _KEPT.append(recvbuf)
            raise

    def _post(self, start, op: str) -> MPI.Request:
        try:
            return start()
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, op)

    def _bounded(self, req: MPI.Request, keep, timeout: float, op: str, receive: bool) -> MPI.Status:
        """Complete one posted request within ``timeout`` seconds; its status.
        On :class:`CommTimeout` a receive is cancelled (so nothing lands in the
        user's buffer afterwards) and a send is kept alive, never freed."""
        try:
            self._poll([req], timeout, op)
        except CommTimeout:
            if receive:
                if not cancel_receive(req):
                    _KEPT.append(keep)  # MPI may still write it
            else:
                ABANDONED.append(req)
                _KEPT.append(keep)
            raise
        return self._statuses[0]

    def poll(self, tag: int, nbytes: int):
        """A message with ``tag`` from any rank if one has arrived
        (``MPI_Iprobe``, then ``MPI_Recv`` of at most ``nbytes`` bytes); else None.

        Probes twice: Open MPI's ob1 matches a probe against the messages it
        has already taken in and only then runs its progress engine, so after
        a stretch without MPI calls the first probe misses a message that has
        long been delivered (seen: an abort notice missed 1 s after it was sent)."""
        try:
            if not self.comm.Iprobe(MPI.ANY_SOURCE, tag) and not self.comm.Iprobe(MPI.ANY_SOURCE, tag):
                return None
            buf = np.zeros(nbytes, np.uint8)
            self.comm.Recv([buf, _BYTE], MPI.ANY_SOURCE, tag)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "poll")
        return buf

    # ------------------------------------------------- persistent requests
    def send_init(self, buf, dest: int, tag: int = 0) -> MPIRequest:
        """A persistent send (``MPI_Send_init``) of a host buffer, or of a device
        buffer when MPI is CUDA-aware, for exchanges repeated every step.  Start
        with :meth:`startall`, complete with :meth:`waitall`.

        Raises:
            BufferError: a device buffer without CUDA-aware MPI (stage it first).
        """
        return self._persistent(buf, dest, tag, "send_init")

    def recv_init(self, buf, source: int, tag: int = 0) -> MPIRequest:
        """A persistent receive (``MPI_Recv_init``); see :meth:`send_init`."""
        return self._persistent(buf, source, tag, "recv_init")

    def _persistent(self, buf, peer, tag, op):
        self.check_peer(peer, "dest" if op == "send_init" else "source", op)
        b = self._wrap(buf, op)
        if b.is_device and not self.cuda_aware:
            raise BufferError("persistent requests on device buffers need CUDA-aware MPI; stage through host",
                              rank=self._rank, op=op)
        init = self.comm.Send_init if op == "send_init" else self.comm.Recv_init
        try:
            return MPIRequest(init(self._mpi_buf(b), peer, tag), keep=b, persistent=True, rank=self._rank)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, op)

    def startall(self, requests) -> None:
        """Start persistent requests (``MPI_Startall``).  A list started again
        and again (a halo exchange's, every step) reuses its ``MPI.Request``
        list, as :meth:`waitall` does."""
        if not requests:
            return
        raw = self._raw(requests)
        for r in requests:
            r._done = False
        try:
            MPI.Prequest.Startall(raw)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "startall")

    def _raw(self, requests) -> list:
        """The ``MPI.Request`` objects of a list of persistent requests, cached per list object."""
        got = self._raw_lists.get(id(requests))
        if got is not None and got[0] is requests and len(got[1]) == len(requests):
            return got[1]
        raw = [r.req for r in requests]
        if all(r.persistent and r._on_complete is None for r in requests):
            if len(self._raw_lists) >= 64:
                self._raw_lists.pop(next(iter(self._raw_lists)))
            self._raw_lists[id(requests)] = (requests, raw)
        return raw

    def free_requests(self, requests) -> None:
        """Free inactive persistent requests (and forget the request lists cached for them)."""
        self._raw_lists.clear()
        for r in requests:
            if r.req != MPI.REQUEST_NULL:
                try:
                    r.req.Free()
                except MPI.Exception as exc:
                    raise_classified(exc, (), self._rank, "free_requests")

    # ------------------------------------------------------------ completion
    def waitall(self, requests, timeout: float | None = None, op: str = "waitall") -> None:
        """Wait for ``requests``: with ``timeout=None`` one ``MPI_Waitall`` (an
        ``MPI_Testall`` spin on a fault-tolerant transport, see
        ``Transport.fault_tolerant``); else by polling ``MPI_Testall`` until
        ``timeout`` seconds pass.

        Raises:
            CommTimeout: when ``timeout`` passes first.
            ProcessFailed: a peer failed or the communicator was revoked.
            CommError: any other MPI error.
            InvalidArgument: ``timeout`` is NaN, infinite, negative, a bool or not a
                number (0: poll once).
        """
        if timeout is not None and not wait_bound_ok(timeout):
            raise InvalidArgument(timeout_problem(timeout, zero=True) or f"timeout {timeout!r} out of range",
                                  rank=self._rank, op=op)
        got = self._raw_lists.get(id(requests))
        if got is None and timeout is None and requests and getattr(requests[0], "persistent", False):
            self._raw(requests)  # caches the list when every request is persistent
            got = self._raw_lists.get(id(requests))
        if got is not None and got[0] is requests and timeout is None and len(got[1]) == len(requests):
            # a persistent list started together (halo): no per-call list building
            self._complete(got[1], op)
            for r in requests:
                r._done = True
                if r._callbacks:
                    r._fire()
            return
        try:
            pending = [r for r in requests if not r._done]
            reqs = [r.req for r in pending]
        except AttributeError:  # not all MPIRequest: one by one
            for r in requests:
                if isinstance(r, MPIRequest):
                    self.waitall([r], timeout, op)
                else:
                    r.wait(timeout)
            return
        if not reqs:
            return
        if timeout is None:
            self._complete(reqs, op)
        else:
            self._poll(reqs, timeout, op)
        counts = None
        for r in pending:
            if r._on_complete is not None:
                # a staged or typed receive among them: the bytes each got, all read
                # before any callback runs (one may reuse these status objects)
                st = self._statuses
                counts = [None if q._on_complete is None else st[i].Get_count(_BYTE) for i, q in enumerate(pending)]
                break
        if counts is None:  # host buffers only (the hot path): no count needed
            for r in pending:
                r._finish()
        else:
            for r, n in zip(pending, counts):
                r._finish(n)

    def _statuses_for(self, n: int) -> list:
        st = self._statuses
        while len(st) < n:
            st.append(MPI.Status())
        return st[:n]

    def _complete(self, reqs: list, op: str = "waitall") -> None:
        """Complete ``MPI.Request`` objects with no deadline, on reused status
        objects: one ``MPI_Waitall``, or on a fault-tolerant transport a
        ``MPI_Testall`` spin (see ``Transport.fault_tolerant``; the FT watchdog
        bounds it).  An error is classified and the requests still pending are
        kept alive, never freed.
        """
        st = self._statuses_for(len(reqs))
        try:
            if not self.fault_tolerant:
                MPI.Request.Waitall(reqs, st)
            else:
                while not MPI.Request.Testall(reqs, st):
                    pass
        except MPI.Exception as exc:
            ABANDONED.extend(q for q in reqs if q != MPI.REQUEST_NULL)
            raise_completion_error(exc, st, self._rank, op)

    def _poll(self, reqs: list, timeout: float, op: str) -> None:
        st = self._statuses_for(len(reqs))
        deadline = time.monotonic() + timeout
        spins = 0
        try:
            while not MPI.Request.Testall(reqs, st):
                spins += 1
                if spins > 64:
                    if time.monotonic() > deadline:
                        raise CommTimeout(
                            f"{len(reqs)} request(s) not complete after {timeout:.3g} s (peer dead or stalled?)",
                            rank=self._rank, op=op)
                    # yield the core (oversubscribed ranks) without a timer:
                    # time.sleep(0) here made a 1-4 MiB ring 17-120% slower
                    os.sched_yield()
        except MPI.Exception as exc:
            ABANDONED.extend(q for q in reqs if q != MPI.REQUEST_NULL)
            raise_completion_error(exc, st, self._rank, op)

    # --------------------------------------------------- native collectives
    @staticmethod
    def native_dtype(dtype) -> MPI.Datatype | None:
        """The predefined ``MPI.Datatype`` MPI can reduce for a numpy dtype, or None."""
        dtype = np.dtype(dtype)
        if dtype.name == "float16" or dtype.kind not in "iubf":  # no MPI reductions on these
            return None
        return MPI._typedict.get(f"{dtype.kind}{dtype.itemsize}")  # predefined (reductions need them)

    def _native(self, op: str, fn, *args) -> None:
        try:
            fn(*args)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, op)

    def native_allreduce(self, sendbuf, recvbuf, op: str) -> None:
        """``MPI_Allreduce`` of host arrays; ``sendbuf=None`` reduces ``recvbuf``
        in place.  ``op``: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``,
        ``"band"``, ``"bor"``, ``"bxor"`` (the ``MPI.Op`` of :func:`native_op`)."""
        dt = self.native_dtype(recvbuf.dtype)
        s = MPI.IN_PLACE if sendbuf is None else [sendbuf, dt]
        self._native("allreduce", self.comm.Allreduce, s, [recvbuf, dt], native_op(op, recvbuf.dtype))

    def native_reduce_scatter_block(self, sendbuf, recvbuf, op: str) -> None:
        """``MPI_Reduce_scatter_block`` of host arrays (``recvbuf.size`` per rank)."""
        dt = self.native_dtype(recvbuf.dtype)
        self._native("reduce_scatter", self.comm.Reduce_scatter_block, [sendbuf, dt], [recvbuf, dt],
                     native_op(op, recvbuf.dtype))

    def native_allgather(self, sendbuf, recvbuf) -> None:
        """``MPI_Allgather`` of the bytes of host arrays."""
        if sendbuf.dtype is _U8 and recvbuf.dtype is _U8:  # the first round's rows: as they are
            try:
                self.comm.Allgather(sendbuf, recvbuf)
            except MPI.Exception as exc:
                raise_classified(exc, (), self._rank, "allgather")
            return
        n = sendbuf.nbytes
        self._native("allgather", self.comm.Allgather, [sendbuf.view(np.uint8), n, _BYTE],
                     [recvbuf.view(np.uint8), n, _BYTE])

    def allgather_plan(self, sendbuf, recvbuf):
        """:meth:`Transport.allgather_plan`: a persistent ``MPI_Allgather_init``
        (:func:`~.mpi_ops.persistent_allgather`), freed by :meth:`close`."""
        run = persistent_allgather(self.comm, sendbuf, recvbuf, self._rank, self._plans)
        return run if run is not None else super().allgather_plan(sendbuf, recvbuf)

    def native_bcast(self, buf, root: int) -> None:
        """``MPI_Bcast`` of the bytes of a host array."""
        self._native("bcast", self.comm.Bcast, [buf.view(np.uint8), buf.nbytes, _BYTE], root)

    def native_alltoall(self, sendbuf, recvbuf) -> None:
        """``MPI_Alltoall`` of equal byte blocks of host arrays."""
        n = sendbuf.nbytes // self._size
        self._native("alltoall", self.comm.Alltoall, [sendbuf.view(np.uint8), n, _BYTE],
                     [recvbuf.view(np.uint8), n, _BYTE])

    def native_barrier(self) -> None:
        """``MPI_Barrier``."""
        self._native("barrier", self.comm.Barrier)

    barrier = native_barrier

    # --------------------------------------------------- groups and ULFM
    def dup(self) -> "MPITransport":
        """A transport over a duplicate communicator (collective)."""
        try:
            c = self.comm.Dup()
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "dup")
        t = MPITransport(c, cuda_aware=self.cuda_aware, node_peers=self.node_peers)
        t.fault_tolerant = self.fault_tolerant
        return t

    def idup(self, timeout: float, n: int = 1, op: str = "dup") -> list:
        """``n`` transports over duplicates of this communicator (``MPI_Comm_idup``,
        collective), waited for at most ``timeout`` seconds; for fault-tolerant
        communicators, whose no blocking call may wait forever.

        A rank whose peers do not call (yet) gets :class:`CommTimeout`; its
        duplicates stay posted (MPI can neither cancel nor free a pending
        ``MPI_Comm_idup``) and the next ``idup`` of this transport waits for them
        first instead of posting new ones, so that they match the peers' first
        duplicates whenever those come.  Meanwhile this communicator stays usable
        for point-to-point traffic (any other collective on it would be matched
        against the pending duplicates: erroneous in MPI).

        Returns ``n`` :class:`MPITransport` (``fault_tolerant`` as this one's,
        errors returned as exceptions); ``timeout``: finite seconds > 0.

        Raises:
            CommTimeout: not complete within ``timeout`` (they stay posted, see above).
            ProcessFailed / CommError: the duplication failed (ULFM: a peer died).
        """
        pending = self.__dict__.setdefault("_idups", [])
        while len(pending) < n:
            pending.append(self.comm.Idup())  # (new comm, request), valid once complete
        mine = pending[:n]
        try:
            self._poll([req for _, req in mine], timeout, op)
        except CommTimeout as exc:
            raise CommTimeout(f"{exc.detail}: the peers have not joined this MPI_Comm_idup (a collective); "
                              "it stays posted and the next duplicate of this communicator waits for it",
                              rank=self._rank, op=op) from None
        except CommError as exc:
            del pending[:n]  # failed: its requests went to ABANDONED; its comms are kept, never freed
            ABANDONED.extend(c for c, _ in mine)
            failed = () if isinstance(exc, ProcessFailed) else self.failed_ranks()
            if failed:  # the duplication failed on a dead peer (ULFM): say so, whatever code MPI gave
                raise ProcessFailed(f"rank(s) {list(failed)} failed during MPI_Comm_idup ({exc.detail})", failed=failed,
                                    rank=self._rank, op=op) from exc
            raise
        del pending[:n]
        out = []
        for c, _ in mine:
            c.Set_errhandler(MPI.ERRORS_RETURN)
            t = MPITransport(c, cuda_aware=self.cuda_aware, node_peers=self.node_peers)
            t.fault_tolerant = self.fault_tolerant
            out.append(t)
        return out

    def split(self, color: int, key: int = 0) -> "MPITransport":
        """A transport over ``MPI_Comm_split(color, key)`` (collective)."""
        try:
            c = self.comm.Split(color, key)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "split")
        return MPITransport(c, cuda_aware=self.cuda_aware)

    def set_errors_return(self) -> None:
        """Errors on this communicator come back as exceptions (``MPI_ERRORS_RETURN``)."""
        try:
            self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "set_errors_return")

    def world_ranks(self, ranks=None) -> tuple[int, ...]:
        """``COMM_WORLD`` ranks of ``ranks`` of this group (default: every rank)."""
        ranks = list(range(self._size)) if ranks is None else list(ranks)
        if not ranks:
            return ()
        g, w = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            return tuple(int(x) for x in MPI.Group.Translate_ranks(g, ranks, w))
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "world_ranks")
        finally:
            g.Free()
            w.Free()

    def is_failure(self, exc: BaseException) -> bool:
        """``MPI_ERR_PROC_FAILED(_PENDING)``, ``MPI_ERR_REVOKED``, or a classified
        :class:`ProcessFailed` / :class:`CommTimeout`."""
        return is_process_failure(exc)

    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks the local ULFM runtime knows to have failed (empty without ULFM)."""
        return mpi_failed_ranks(self.comm)

    def revoke(self) -> None:
        """``MPIX_Comm_revoke``; a no-op without ULFM or when already revoked."""
        try:
            self.comm.Revoke()
        except (NotImplementedError, Exception):  # noqa: BLE001
            pass

    def agree(self, flag: int) -> int:
        """``MPIX_Comm_agree``: bitwise AND of ``flag`` over the live ranks.

        Raises:
            ProcessFailed: a failure not yet acknowledged (the caller then
                treats the agreement as failed on every survivor).
        """
        try:
            return int(self.comm.Agree(int(flag)))
        except MPI.Exception as exc:
            raise to_comm_error(exc, rank=self._rank, op="agree") from exc

    def ack_failed(self) -> None:
        """Acknowledge the failures seen so far (``MPIX_Comm_ack_failed``)."""
        try:
            self.comm.Ack_failed()
        except Exception:  # noqa: BLE001
            pass

    def shrink(self):
        """``MPIX_Comm_shrink``: a transport over the live ranks (collective over them).

        Returns:
            (MPITransport, list[int]): the new transport, and for each of its
            ranks the rank it had in this group.
        """
        try:
            new = self.comm.Shrink()
        except MPI.Exception as exc:
            raise to_comm_error(exc, rank=self._rank, op="shrink") from exc
        new.Set_errhandler(MPI.ERRORS_RETURN)  # a shrunk comm gets MPI_ERRORS_ARE_FATAL otherwise
        og, ng = self.comm.Get_group(), new.Get_group()
        try:
            kept = [int(x) for x in MPI.Group.Translate_ranks(ng, list(range(ng.Get_size())), og)]
        finally:
            og.Free()
            ng.Free()
        # which survivors share this rank's node follows from the old group: no
        # MPI_Comm_split_type here. A collective that builds a communicator is a window
        # in which Open MPI 5.0's ULFM can crash when another rank dies (the failure
        # handler revokes a communicator still under construction: SIGSEGV in
        # ompi_comm_revoke_local); the recovery path keeps as few as it can.
        t = MPITransport(new, cuda_aware=self.cuda_aware, node_peers=shrunk_node_peers(self.node_peers, kept))
        t.fault_tolerant = self.fault_tolerant
        return t, kept

    def abort(self, errorcode: int = 1) -> None:
        """``MPI_Abort``: end every process of the job."""
        self.comm.Abort(int(errorcode))

    def close(self) -> None:
        # duplicates still posted (idup timed out): MPI can neither cancel nor free
        # them; the handles are kept for ever rather than dropped
        ABANDONED.extend(x for pair in self.__dict__.pop("_idups", ()) for x in pair)
        free_plans(self._plans)
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.comm != MPI.COMM_NULL:
            try:
                self.comm.Free()
            except MPI.Exception as exc:  # pragma: no cover
                raise CommError(f"MPI_Comm_free failed: {exc}", rank=self._rank, op="close") from exc


_KEPT: list = []  # buffers of sends a bounded wait gave up on (MPI may still read them)


def _detect(flag: bool | None) -> bool:
    return cuda_aware() if flag is None else bool(flag)
