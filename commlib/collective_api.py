"""Collective operations of :class:`commlib.Communicator` (a mixin).

Each method validates its arguments locally, then goes through the engine of
:mod:`commlib.collectives.engine`: a first round that makes every rank agree
on the call (a mismatch or a bad argument on any rank raises
:class:`~commlib.errors.InvalidArgument` on every rank, before any payload
moves) and, for a small ``algorithm="auto"`` allreduce, reduce_scatter or
bcast, carries the data itself, so the call is one round of messages.  Larger
calls then run one algorithm of :mod:`commlib.collectives` (``"ring"``,
``"recursive_doubling"``, ...) or the transport's native collective
(``algorithm="mpi"``) on the transport reserved for collectives, through
:func:`commlib.collectives.ft.run_collective` (bounded waits, and under ULFM
revoke/agree/shrink/retry, in fault-tolerant mode).

Device buffers (CuPy, numba, the CUDA simulator's): the ring allreduce and
reduce_scatter reduce on the device (:mod:`commlib.collectives._device_reduce`,
same order and bits as the host ring), handing device buffers to the transport
when it is CUDA-aware and otherwise staging each segment through pinned host
buffers the communicator keeps; the other algorithms, and one-round small
calls, run on a pinned host copy made and written back asynchronously on the
caller's stream.

``COMMLIB_CHECK_ARGS=0`` skips the first round of large calls (small calls
keep it: it carries their data).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from commlib.collectives import ops as _ops
from commlib.collectives._common import chunk_bounds
from commlib.collectives.allgather_ring import allgather_ring
from commlib.collectives.allreduce_recursive_doubling import allreduce_recursive_doubling
from commlib.collectives.allreduce_ring import allreduce_ring
from commlib.collectives.alltoall_pairwise import alltoall_pairwise
from commlib.collectives.barrier import barrier_dissemination
from commlib.collectives.bcast_binomial import bcast_binomial
from commlib.collectives.engine import SPECS, SmallAllreduce, execute, reduce_rows, small_capacity
from commlib.collectives.ft import recover, run_collective
from commlib.collectives.snapshot import LazySnapshot
from commlib.collectives.reduce_scatter_ring import reduce_scatter_ring_inplace
from commlib.core.buffer import Buffer, as_buffer, grown
from commlib.core.errors import BufferError, CommError, InvalidArgument
from commlib.collectives.agreement import check_all
from commlib.transports.base import CompletedRequest, FutureRequest, check_plain_dtype

__all__ = ["CollectiveMixin", "ALGORITHMS"]

ALGORITHMS = {name: spec.algorithms for name, spec in SPECS.items()}


class _Staged:
    """A 1-D host view of a user buffer.

    Host buffers are viewed.  C-contiguous device buffers (CuPy, numba, the
    CUDA simulator's) are copied into pinned host memory that the communicator
    keeps per (role, count, dtype) (:class:`~commlib.collectives._device_reduce.StagingCache`),
    asynchronously on the caller's stream; :meth:`flush` copies back the same
    way, without waiting (the caller's later work on that stream is ordered
    after it).  Other device buffers take a fresh pageable copy.
    """

    __slots__ = ("buf", "host", "shape", "dev", "kind", "entry", "stream")

    def __init__(self, b: Buffer, comm=None, role: str = "src", down: bool = True):
        self.buf = b
        self.shape = b.shape
        self.dev = self.entry = None
        if not b.is_device:
            self.host = np.asarray(b.array()).ravel(order="K")
            return
        dv = _device_view(b)
        if dv is None or comm is None:
            self.host = b.to_host().reshape(-1)
            return
        from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

        self.kind, self.dev, self.stream = dv
        self.entry = comm._staging().get(role, self.kind, b.size, b.dtype)
        self.host = dr.stage_down(self.kind, self.dev, self.entry, self.stream) if down else self.entry.host

    def flush(self) -> None:
        """Copy the host result back into a device buffer."""
        if not self.buf.is_device:
            return
        if self.entry is not None:
            from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

            dr.stage_up(self.kind, self.entry, self.dev, self.stream)
        else:
            self.buf.from_host(self.host.reshape(self.shape))


def _device_kind(arr) -> str:
    from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

    return dr.as_device_array(arr)[0]


def _to_host(arr) -> np.ndarray:
    return arr.get() if _device_kind(arr) == "cupy" else arr.copy_to_host()


def _device_view(b: Buffer):
    """``(kind, 1-D device array, caller's stream)`` for a C-contiguous device
    buffer the device kernels can drive, else None (host, F-order, DLPack-only)."""
    if not b.is_device or not b.contiguous:
        return None
    from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

    kind, arr = dr.as_device_array(b.obj)
    return kind, dr.flat(kind, arr), dr.stream_of(kind, arr)


class CollectiveMixin:
    """Collective methods; mixed into :class:`commlib.Communicator`.

    The host class provides ``transport``, ``rank``, ``size``, ``cuda_aware``,
    ``_coll_tp`` and ``_ft``; the mixin implements the fault-tolerance protocol
    of :func:`commlib.collectives.ft.run_collective` (``ft``,
    ``collective_transport()``, ``shrink()``).
    """

    # ------------------------------------------------ fault-tolerance protocol
    @property
    def ft(self):
        """The :class:`~commlib.collectives.ft.FaultTolerance` state, or None."""
        return self._ft

    def collective_transport(self):
        """The transport commlib's own traffic (collectives, attention) runs on:
        a duplicate of this communicator, so it never meets the user's messages
        (created on first use; collective over the group)."""
        tp = self._coll_tp
        if tp is None:
            tp = self._coll_tp = self.transport.dup()
            tp.fault_tolerant = self._ft is not None
        return tp

    def shrink(self, tp):
        """ULFM recovery: shrink the collective transport, rebuild this
        communicator over the survivors, run the failure callbacks.

        Returns:
            (lost_world, kept): lost ranks numbered as in ``COMM_WORLD``; for
            each new rank, its rank before the shrink.
        """
        tp.revoke()
        if self.transport is not tp:
            self.transport.revoke()  # interrupt user point-to-point on the old group
        before = tp.world_ranks()
        new, kept = tp.shrink()
        lost_world = tuple(sorted(set(before) - {before[k] for k in kept}))
        try:
            user = new.dup()
            user.set_errors_return()
            # no survivor leaves (and maybe dies) while another still creates
            # communicators: Open MPI 5.0 can crash handling a failure then
            new.native_barrier()
        except CommError:
            user = new  # another failure: the next attempt notices and shrinks again
        self.transport = user
        self._coll_tp = new
        new.fault_tolerant = True
        ft = self._ft
        if lost_world:
            ft.failed = tuple(sorted(set(ft.failed) | set(lost_world)))
            for cb in list(ft.callbacks):
                cb(lost_world, self)
        return lost_world, kept

    def add_failure_callback(self, fn: Callable) -> None:
        """Register ``fn(failed, comm)``, called on every survivor after the
        communicator shrank; ``failed`` is a sorted tuple of ``COMM_WORLD`` ranks
        lost in that failure, ``comm`` this (already shrunk) communicator.
        Use it to redistribute work.  Fault-tolerant mode only."""
        if self._ft is None:
            raise InvalidArgument("failure callbacks need commlib.init(fault_tolerant=True)",
                                  rank=self.rank, op="add_failure_callback")
        self._ft.callbacks.append(fn)

    def sendrecv_resilient(self, sendbuf, dest: int, recvbuf, source: int, name: str = "sendrecv_resilient"):
        """Exchange with ``dest``/``source`` as one fault-tolerant step (every rank calls it).

        The exchange runs on the collectives' transport with bounded waits
        and, in fault-tolerant mode, ends with an agreement: it returns on every
        rank only if it succeeded on every rank (e.g. a buddy checkpoint is then
        safe to commit).  On a failure the communicator is shrunk and
        :class:`ProcessFailed` (``recovered = True``) is raised on every survivor;
        it is not retried, since ``dest``/``source`` mean other ranks afterwards.

        Args:
            sendbuf, recvbuf: contiguous arrays (host or device; device staged).
            dest, source: ranks of this communicator.
            name: operation name for errors.
        """
        problem = None
        try:
            sb = self._wrap(sendbuf, name, "sendbuf")
            rb = self._wrap(recvbuf, name, "recvbuf")
            for peer, what in ((dest, "dest"), (source, "source")):
                if (isinstance(peer, bool) or not isinstance(peer, (int, np.integer))
                        or not 0 <= int(peer) < self.size):
                    raise InvalidArgument(f"{what} {peer!r} out of range [0, {self.size})", rank=self.rank, op=name)
            src, dst = _Staged(sb, self, "src"), _Staged(rb, self, "dst", down=False)
        except (InvalidArgument, BufferError) as exc:
            problem = exc.detail

        def attempt(tp, timeout, survivors):
            # every rank raises alike, before any byte moves (one flag per rank)
            check_all(tp, problem, name, timeout=timeout)
            tag = tp.tags.slot()
            tp.waitall([tp.irecv(dst.host, int(source), tag), tp.isend(src.host, int(dest), tag)], timeout, op=name)

        run_collective(self, name, attempt, on_failure="raise")
        dst.flush()
        return recvbuf

    def recover(self) -> tuple:
        """Revoke, agree and shrink after the application saw a failure in its
        own traffic; every survivor calls it.  Returns the lost ``COMM_WORLD``
        ranks.  See :func:`commlib.collectives.ft.recover`."""
        return recover(self)

    @property
    def failed_ranks(self) -> tuple:
        """``COMM_WORLD`` ranks lost so far (fault-tolerant mode; else empty)."""
        return self._ft.failed if self._ft is not None else ()

    @property
    def fault_tolerant(self) -> str | None:
        """``"ulfm"``, ``"timeout"`` or None (not fault tolerant)."""
        return self._ft.mode if self._ft is not None else None

    # ------------------------------------------------------------ the engine
    def _staging(self):
        """This communicator's pinned staging buffers for device arrays (created on first use)."""
        cache = getattr(self, "_dev_staging", None)
        if cache is None:
            from commlib.collectives._device_reduce import StagingCache  # noqa: PLC0415

            cache = self._dev_staging = StagingCache()
        return cache

    def _wrap(self, obj, opname, what="buffer") -> Buffer:
        b = as_buffer(obj, op=opname, rank=self.rank)
        check_plain_dtype(b.dtype, self.rank, opname, what)
        if not b.dense:
            raise BufferError(f"{what} is not contiguous", rank=self.rank, op=opname)
        return b

    # ------------------------------------------------------------- allreduce
    def allreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto"):
        """Combine ``sendbuf`` element-wise over all ranks; every rank gets the result.

        Args:
            sendbuf: contiguous array (numpy, CuPy, numba device), any shape,
                ``count`` elements of float16, bfloat16, float32, float64, an
                integer dtype or bool; same count and dtype on every rank.
            recvbuf: array of the same shape/dtype for the result; None reduces
                in place into ``sendbuf``.
            op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"`` (floats),
                ``"band"``, ``"bor"``, ``"bxor"`` (integers), or an ``MPI.Op``.
            algorithm: ``"ring"`` (Patarasuk & Yuan 2009), ``"recursive_doubling"``
                (Thakur, Rabenseifner & Gropp 2005), ``"mpi"`` (the transport's
                native ``MPI_Allreduce``) or ``"auto"``: up to
                ``COMMLIB_SMALL_BYTES`` (1024) bytes one round that gathers every
                rank's data with the argument header and reduces it locally in
                rank order; recursive doubling up to 256 KiB on 3 or more ranks;
                ring above (on 2 ranks, ring above the one round).

        Returns:
            The array holding the result (``recvbuf``, or ``sendbuf`` in place).
            Bit-identical on every rank.  After a recovered failure, the
            reduction over the surviving ranks' inputs.

        Raises:
            InvalidArgument: an op unfit for the dtype, mismatched count/dtype/op
                across ranks (on every rank), an unknown algorithm.
            BufferError: unsupported or non-contiguous buffers.
            ProcessFailed / CommTimeout: fault-tolerant mode, see ``commlib.init``.
        """
        if (type(sendbuf) is np.ndarray and self._ft is None
                and (recvbuf is None or type(recvbuf) is np.ndarray)):
            done = self._small_allreduce(sendbuf, recvbuf, op, algorithm)
            if done is not None:
                return done
        opname, spec = "allreduce", SPECS["allreduce"]
        inplace = recvbuf is None or recvbuf is sendbuf
        st = {}

        def prepare():
            sb = self._wrap(sendbuf, opname, "sendbuf")
            o = _ops.get_op(op, rank=self.rank, opname=opname)
            o.check(sb.dtype, rank=self.rank, op=opname)
            rb = sb if inplace else self._wrap(recvbuf, opname, "recvbuf")
            if not inplace and (rb.size != sb.size or rb.dtype != sb.dtype):
                raise InvalidArgument(f"recvbuf ({rb.size} x {rb.dtype}) does not match sendbuf "
                                      f"({sb.size} x {sb.dtype})", rank=self.rank, op=opname)
            algo = spec.choose(algorithm, sb.nbytes, rank=self.rank, nranks=self.size)
            if algo == "mpi" and self.transport.native_dtype(sb.dtype) is None:
                raise InvalidArgument(f"MPI has no datatype for {sb.dtype.name}; use algorithm='ring'",
                                      rank=self.rank, op=opname)
            st.update(sb=sb, rb=rb, o=o, algo=algo)
            return {"operation": spec.code, "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                    "op": o.code, "algorithm": spec.algorithm_code(algo)}

        def small():
            sb = st["sb"]
            if algorithm != "auto" or sb.nbytes > small_capacity(self.size):
                return None
            src = _Staged(sb, self, "src")
            st["src"] = src
            # fault tolerance may retry after this rank wrote its result: keep the input
            return src.host.copy() if (inplace and self._ft is not None) else src.host

        def setup():
            if st["algo"] == "ring" and "src" not in st:
                dsrc = _device_view(st["sb"])
                ddst = dsrc if inplace else _device_view(st["rb"])
                if dsrc is not None and ddst is not None and dsrc[0] == ddst[0]:
                    device_setup(dsrc, ddst)
                    return
            src = st.get("src") or _Staged(st["sb"], self, "src")
            dst = src if inplace else _Staged(st["rb"], self, "dst", down=False)
            st["src"], st["dst"] = src, dst
            # The input must survive a retry: out of place it does (sendbuf is only
            # read); in place, fault-tolerant mode keeps a snapshot and restores it
            # before a retry.  The ring saves each chunk lazily, just before it
            # first overwrites it, behind that step's transfer; the others copy up front.
            st["snapshot"] = self._snapshot(dst.host) if (inplace and spec.snapshot and self._ft is not None) else None

        def device_setup(dsrc, ddst):
            # the ring on device buffers: reduced on the device, staged per segment
            # through pinned memory when the transport is not CUDA-aware
            from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

            kind, dev, stream = ddst
            st["dev"] = (kind, dev, None if inplace else dsrc[1], stream)
            st["dst"] = None
            if inplace and self._ft is not None:  # input kept on the device for a retry
                saved = dr.device_empty(kind, dev.size, dev.dtype)
                dr.d2d(kind, dev, saved, stream)
                st["dev_saved"] = saved

        def run_device(tp, timeout):
            from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

            kind, dev, dsrc, stream = st["dev"]
            entry = None if tp.cuda_aware else self._staging().get("ring", kind, dev.size, dev.dtype)
            dr.allreduce_ring_device(tp, dev, st["o"], kind=kind, src=dsrc, timeout=timeout, entry=entry,
                                     stream=stream)

        def run(tp, timeout, survivors, rows):
            if "dst" not in st:
                setup()
            if "dev" in st and rows is None:
                return run_device(tp, timeout)
            work, o, algo, snapshot = st["dst"].host, st["o"], st["algo"], st["snapshot"]
            source = None if inplace else st["src"].host
            if rows is not None:
                reduce_rows(rows, work.dtype, work.size, o, work)
            elif algo == "ring":
                allreduce_ring(tp, work, o, sendbuf=source, timeout=timeout, save=snapshot)
            else:
                if snapshot is not None:
                    snapshot.save_all()
                if algo == "recursive_doubling" or tp.size == 1 and algo != "mpi":
                    allreduce_recursive_doubling(tp, work, o, sendbuf=source, timeout=timeout)
                else:
                    tp.native_allreduce(source, work, o.name)
                    o.finalize(work, tp.size)

        def restore():
            if st.get("snapshot") is not None:
                st["snapshot"].restore()
            if st.get("dev_saved") is not None:
                from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

                kind, dev, _, stream = st["dev"]
                dr.d2d(kind, st["dev_saved"], dev, stream)

        execute(self, opname, prepare, run, small=small, restore=restore)
        if st.get("dst") is not None:
            st["dst"].flush()
        return sendbuf if inplace else recvbuf

    def _small_allreduce(self, sendbuf: np.ndarray, recvbuf, op, algorithm: str = "auto"):
        """Host numpy arrays without the general path's staging objects: the
        one-round small allreduce (``"auto"``, at most the first-round
        capacity), or a large call that resolves to the ring (the same
        first-round row, then :func:`allreduce_ring`).  The same messages and
        bits as the engine, on buffers and views the communicator keeps per
        (dtype, count, op).  Returns None when the call does not qualify (the
        general path then handles it, and raises any argument error)."""
        small = self._small
        if small is None:
            tp = self.collective_transport()
            small = self._small = SmallAllreduce(tp, small_capacity(tp.size))
        large = sendbuf.nbytes > small.cap or algorithm != "auto"
        if large and algorithm not in ("auto", "ring", "recursive_doubling"):
            return None
        if not sendbuf.flags.c_contiguous or (
                recvbuf is not None and recvbuf is not sendbuf and not (
                    recvbuf.flags.c_contiguous and recvbuf.flags.writeable and recvbuf.dtype == sendbuf.dtype
                    and recvbuf.size == sendbuf.size)):
            return None
        if type(op) is not str:  # an MPI.Op (unhashable) or an Op: key by name
            try:
                op = _ops.get_op(op, rank=self.rank, opname="allreduce").name
            except InvalidArgument:
                return None
        if large:
            if recvbuf is None or recvbuf is sendbuf:
                if not sendbuf.flags.writeable:
                    return None
                recvbuf = sendbuf
            plan = small.large_plans.get((sendbuf.dtype, sendbuf.size, op, algorithm))
            if plan is None:
                plan = small.large_plan(sendbuf.dtype, sendbuf.size, op, algorithm, self.rank)
            if not plan:
                return None
            small.run_large(plan, sendbuf, recvbuf)
            return recvbuf
        plan = small.plans.get((sendbuf.dtype, sendbuf.size, op))
        if plan is None:
            plan = small.plan(sendbuf.dtype, sendbuf.size, op, self.rank)
            if plan is None:
                return None
        out = sendbuf if recvbuf is None else recvbuf
        small.run(plan, sendbuf, out)
        return out

    def _snapshot(self, buf: np.ndarray):
        """A :class:`~commlib.collectives.snapshot.LazySnapshot` of ``buf`` whose copy
        lives in a scratch buffer kept by the communicator (grown as needed), so
        repeated fault-tolerant calls do not pay fresh page faults each time."""
        self._ft_scratch = grown(self._ft_scratch, buf.nbytes)
        return LazySnapshot(buf, self._ft_scratch)

    # -------------------------------------------------------- reduce_scatter
    def reduce_scatter(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto"):
        """Reduce ``sendbuf`` over all ranks and give rank ``r`` block ``r``
        (``MPI_Reduce_scatter_block`` when ``count`` divides evenly).

        Args:
            sendbuf: contiguous array of ``count`` elements (any shape, flattened
                in memory order); same count and dtype on every rank.  Block ``r``
                is elements ``[b[r], b[r+1])`` with ``b = chunk_bounds(count, size)``
                (``count // size`` each when it divides, as MPI).
            recvbuf: 1-D array for block ``rank`` (None: allocated).
            op: as :meth:`allreduce`.
            algorithm: ``"ring"``, ``"mpi"`` or ``"auto"`` (one round up to
                ``COMMLIB_SMALL_BYTES``, as :meth:`allreduce`; ring above).

        Returns:
            np.ndarray or recvbuf: this rank's reduced block, shape ``(b[r+1]-b[r],)``.
            After a recovered failure the blocks are over the shrunk group (a new
            array when ``recvbuf`` no longer fits).

        Raises:
            InvalidArgument, BufferError, ProcessFailed, CommTimeout: as :meth:`allreduce`.
        """
        opname, spec = "reduce_scatter", SPECS["reduce_scatter"]
        st = {}

        def prepare():
            sb = self._wrap(sendbuf, opname, "sendbuf")
            o = _ops.get_op(op, rank=self.rank, opname=opname)
            o.check(sb.dtype, rank=self.rank, op=opname)
            algo = spec.choose(algorithm, sb.nbytes, rank=self.rank)
            if algo == "mpi" and (self.transport.native_dtype(sb.dtype) is None or sb.size % self.size):
                raise InvalidArgument("algorithm='mpi' needs an MPI datatype and count divisible by size",
                                      rank=self.rank, op=opname)
            b = chunk_bounds(sb.size, self.size)
            mylen = int(b[self.rank + 1] - b[self.rank])
            if recvbuf is not None:
                rb = self._wrap(recvbuf, opname, "recvbuf")
                if rb.size != mylen or rb.dtype != sb.dtype:
                    raise InvalidArgument(f"recvbuf must hold {mylen} x {sb.dtype.name}, has {rb.size} x {rb.dtype}",
                                          rank=self.rank, op=opname)
            st.update(sb=sb, o=o, algo=algo)
            return {"operation": spec.code, "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                    "op": o.code, "algorithm": spec.algorithm_code(algo)}

        def small():
            sb = st["sb"]
            if algorithm != "auto" or sb.nbytes > small_capacity(self.size):
                return None
            st["src"] = _Staged(sb, self, "src")
            return st["src"].host

        def run(tp, timeout, survivors, rows):
            o, algo = st["o"], st["algo"]
            n, r = tp.size, tp.rank
            if rows is None and algo == "ring" and "src" not in st:
                dv = _device_view(st["sb"])
                if dv is not None:
                    return self._reduce_scatter_device(tp, dv, o, timeout)
            if "src" not in st:
                st["src"] = _Staged(st["sb"], self, "src")
            src = st["src"]
            bounds = chunk_bounds(src.host.size, n)
            if rows is not None:
                full = np.empty(src.host.size, src.host.dtype)
                reduce_rows(rows, full.dtype, full.size, o, full)
                return full[bounds[r]:bounds[r + 1]].copy()
            if algo == "mpi":
                out = np.empty(int(bounds[r + 1] - bounds[r]), dtype=src.host.dtype)
                tp.native_reduce_scatter_block(src.host, out, o.name)
                o.finalize(out, n)
                return out
            work = np.array(src.host, copy=True)
            reduce_scatter_ring_inplace(tp, work, o, bounds, timeout=timeout)
            out = work[bounds[r]:bounds[r + 1]]
            o.finalize(out, n)
            return out

        out = execute(self, opname, prepare, run, small=small)
        return self._deliver(recvbuf, out, opname, out.shape)

    def _reduce_scatter_device(self, tp, dv, o, timeout):
        """The ring reduce-scatter of a device ``sendbuf``, reduced on the device
        (same order and bits as the host ring); returns this rank's block as
        the same kind of device array."""
        from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

        kind, dsrc, stream = dv
        n, r = tp.size, tp.rank
        b = [int(x) for x in chunk_bounds(dsrc.size, n)]
        work = dr.device_empty(kind, dsrc.size, dsrc.dtype)
        if n == 1:
            dr.d2d(kind, dsrc, work, stream)
        else:
            entry = None if tp.cuda_aware else self._staging().get("ring", kind, dsrc.size, dsrc.dtype)
            dr.reduce_scatter_ring_device(tp, work, o, b, kind=kind, src=dsrc, timeout=timeout, entry=entry,
                                          stream=stream)
        mine = work[b[r]:b[r + 1]]
        dr.finalize(mine, n, o, kind, stream)
        return mine

    def _deliver(self, recvbuf, out, opname: str, shape):
        """Copy a result into ``recvbuf`` when it fits (else return it, shaped; a
        device result comes back to the host, as a staged one does)."""
        dev = not isinstance(out, np.ndarray)
        if recvbuf is not None:
            rb = self._wrap(recvbuf, opname, "recvbuf")
            if rb.size == out.size:
                if dev:
                    dv = _device_view(rb)
                    if dv is not None and dv[0] == _device_kind(out):
                        from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

                        dr.d2d(dv[0], out, dv[1], dv[2])
                        return recvbuf
                    out = _to_host(out)
                st = _Staged(rb, self, "out", down=False)
                st.host[...] = out.reshape(-1)
                st.flush()
                return recvbuf
        if dev:
            out = _to_host(out)
        return out.reshape(shape)

    # ------------------------------------------------------------- allgather
    def allgather(self, sendbuf, recvbuf=None, algorithm: str = "auto"):
        """Gather every rank's ``sendbuf`` on every rank (``MPI_Allgather``).

        Args:
            sendbuf: contiguous array, shape ``S``, same count and dtype everywhere.
            recvbuf: array of ``size * count`` elements, e.g. shape ``(size, *S)``
                (None: allocated as numpy with that shape).
            algorithm: ``"ring"`` (Patarasuk & Yuan 2009), ``"mpi"`` or ``"auto"`` (ring).

        Returns:
            recvbuf (or a new array): block ``i`` is rank ``i``'s ``sendbuf``.
            After a recovered failure, the blocks of the surviving ranks in the
            new rank order, shape ``(new_size, *S)`` (a new array when ``recvbuf``
            no longer fits).

        Raises:
            InvalidArgument, BufferError, ProcessFailed, CommTimeout: as :meth:`allreduce`.
        """
        opname, spec = "allgather", SPECS["allgather"]
        st = {}

        def prepare():
            sb = self._wrap(sendbuf, opname, "sendbuf")
            algo = spec.choose(algorithm, rank=self.rank)
            if recvbuf is not None:
                rb = self._wrap(recvbuf, opname, "recvbuf")
                if rb.size != sb.size * self.size or rb.dtype != sb.dtype:
                    raise InvalidArgument(f"recvbuf must hold {self.size} x {sb.size} x {sb.dtype.name}, "
                                          f"has {rb.size} x {rb.dtype}", rank=self.rank, op=opname)
            st.update(src=_Staged(sb, self, "src"), algo=algo, shape=tuple(sb.shape))
            return {"operation": spec.code, "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                    "algorithm": spec.algorithm_code(algo)}

        def run(tp, timeout, survivors, rows):
            src = st["src"].host
            out = np.empty(tp.size * src.size, dtype=src.dtype)
            if st["algo"] == "mpi":
                tp.native_allgather(src, out)
            else:
                allgather_ring(tp, src, out, timeout=timeout)
            return out

        out = execute(self, opname, prepare, run)
        return self._deliver(recvbuf, out, opname, (self.size,) + st["shape"])

    # ----------------------------------------------------------------- bcast
    def bcast(self, buf, root: int = 0, algorithm: str = "auto"):
        """Broadcast ``buf`` from ``root`` to every rank, in place (``MPI_Bcast``).

        Args:
            buf: contiguous array, same count and dtype on every rank.
            root: the rank whose data is sent, in ``[0, size)``.
            algorithm: ``"binomial"`` (binomial tree, pipelined in 1 MiB segments;
                Thakur, Rabenseifner & Gropp 2005), ``"mpi"`` or ``"auto"`` (one
                round up to ``COMMLIB_SMALL_BYTES``, binomial above).

        Returns:
            buf, holding the root's data.

        Raises:
            InvalidArgument: root out of range or different across ranks (every rank).
            ProcessFailed: fault-tolerant mode and the root failed (every survivor).
        """
        opname, spec = "bcast", SPECS["bcast"]
        st = {}
        ok_root = isinstance(root, (int, np.integer)) and 0 <= int(root) < self.size

        def prepare():
            b = self._wrap(buf, opname, "buf")
            algo = spec.choose(algorithm, rank=self.rank)
            if not ok_root:
                raise InvalidArgument(f"root {root} out of range [0, {self.size})", rank=self.rank, op=opname)
            s = _Staged(b, self, "buf")
            st.update(st=s, algo=algo, saved=np.array(s.host, copy=True) if spec.snapshot and self._ft is not None else None)
            return {"operation": spec.code, "count": b.size, "dtype": _ops.dtype_code(b.dtype),
                    "root": int(root), "algorithm": spec.algorithm_code(algo)}

        def small():
            h = st["st"].host
            return h if algorithm == "auto" and h.nbytes <= small_capacity(self.size) else None

        def run(tp, timeout, survivors, rows):
            h = st["st"].host
            newroot = survivors.index(int(root))
            if rows is not None:
                h[...] = np.ascontiguousarray(rows[newroot, :h.nbytes]).view(h.dtype)
            elif st["algo"] == "mpi":
                tp.native_bcast(h, newroot)
            else:
                bcast_binomial(tp, h, newroot, timeout=timeout)

        def restore():
            if st.get("saved") is not None:
                st["st"].host[...] = st["saved"]

        execute(self, opname, prepare, run, small=small, restore=restore,
                         root=int(root) if ok_root else None)
        st["st"].flush()
        return buf

    # -------------------------------------------------------------- alltoall
    def alltoall(self, sendbuf, recvbuf=None, algorithm: str = "auto"):
        """Every rank sends block ``j`` of ``sendbuf`` to rank ``j`` (``MPI_Alltoall``).

        Args:
            sendbuf: contiguous array of ``size * count`` elements, e.g. shape
                ``(size, ...)``; block ``j`` goes to rank ``j``.
            recvbuf: array like ``sendbuf`` (None: allocated); block ``i`` receives
                rank ``i``'s block ``rank``.
            algorithm: ``"pairwise"`` (Thakur, Rabenseifner & Gropp 2005), ``"mpi"``
                or ``"auto"`` (pairwise).

        Returns:
            recvbuf (or a new array of shape ``(size, count)``).  After a recovered
            failure, blocks addressed to failed ranks are dropped and the result
            has ``new_size`` blocks in the new rank order (a new array).

        Raises:
            InvalidArgument: count not divisible by size, mismatch across ranks.
        """
        opname, spec = "alltoall", SPECS["alltoall"]
        st = {}
        nblk = self.size

        def prepare():
            sb = self._wrap(sendbuf, opname, "sendbuf")
            algo = spec.choose(algorithm, rank=self.rank)
            if sb.size % nblk:
                raise InvalidArgument(f"sendbuf has {sb.size} elements, not a multiple of size {nblk}",
                                      rank=self.rank, op=opname)
            if recvbuf is not None:
                rb = self._wrap(recvbuf, opname, "recvbuf")
                if rb.size != sb.size or rb.dtype != sb.dtype:
                    raise InvalidArgument("recvbuf must match sendbuf in count and dtype", rank=self.rank, op=opname)
                if rb.obj is sb.obj:
                    raise InvalidArgument("alltoall cannot run in place", rank=self.rank, op=opname)
            st.update(src=_Staged(sb, self, "src"), algo=algo, blk=sb.size // nblk)
            return {"operation": spec.code, "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                    "algorithm": spec.algorithm_code(algo)}

        def run(tp, timeout, survivors, rows):
            src, blk = st["src"].host, st["blk"]
            send = src.reshape(nblk, blk)[list(survivors)].reshape(-1) if len(survivors) != nblk else src
            out = np.empty(tp.size * blk, dtype=src.dtype)
            if st["algo"] == "mpi":
                tp.native_alltoall(np.ascontiguousarray(send), out)
            else:
                alltoall_pairwise(tp, np.ascontiguousarray(send), out, timeout=timeout)
            return out

        out = execute(self, opname, prepare, run)
        return self._deliver(recvbuf, out, opname, (self.size, st["blk"]))

    # --------------------------------------------------------------- barrier
    def barrier(self, algorithm: str = "auto") -> None:
        """Block until every rank has entered the barrier.

        Args:
            algorithm: ``"dissemination"`` (Hensgen, Finkel & Manber 1988),
                ``"mpi"`` (``MPI_Barrier``) or ``"auto"`` (``"mpi"`` when not
                fault tolerant, else dissemination with bounded waits).
        """
        opname = "barrier"
        if algorithm == "auto":
            algorithm = "mpi" if self._ft is None else "dissemination"
        algo = SPECS[opname].choose(algorithm, rank=self.rank)

        def attempt(tp, timeout, survivors):
            if algo == "mpi":
                tp.native_barrier()
            else:
                barrier_dissemination(tp, timeout=timeout)

        run_collective(self, opname, attempt)

    # ---------------------------------------------------------- non-blocking
    def iallreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto"):
        """Non-blocking :meth:`allreduce`; returns a request (``wait``/``test``,
        and ``concurrent.futures.Future``'s ``result``/``done``/``add_done_callback``).

        The collective runs on a per-communicator worker thread (calls complete in
        the order they were started) when MPI provides ``MPI_THREAD_MULTIPLE`` and
        the communicator is not fault tolerant; otherwise it runs before this
        returns and the request is already complete.  Do not touch the buffers
        until the request completes.
        """
        return self._nonblocking(self.allreduce, sendbuf, recvbuf, op, algorithm)

    def ireduce_scatter(self, sendbuf, recvbuf, op="sum", algorithm: str = "auto"):
        """Non-blocking :meth:`reduce_scatter` (``recvbuf`` required); see :meth:`iallreduce`."""
        return self._nonblocking(self.reduce_scatter, sendbuf, recvbuf, op, algorithm)

    def iallgather(self, sendbuf, recvbuf, algorithm: str = "auto"):
        """Non-blocking :meth:`allgather` (``recvbuf`` required); see :meth:`iallreduce`."""
        return self._nonblocking(self.allgather, sendbuf, recvbuf, algorithm)

    def ibcast(self, buf, root: int = 0, algorithm: str = "auto"):
        """Non-blocking :meth:`bcast`; see :meth:`iallreduce`."""
        return self._nonblocking(self.bcast, buf, root, algorithm)

    def ialltoall(self, sendbuf, recvbuf, algorithm: str = "auto"):
        """Non-blocking :meth:`alltoall` (``recvbuf`` required); see :meth:`iallreduce`."""
        return self._nonblocking(self.alltoall, sendbuf, recvbuf, algorithm)

    def _nonblocking(self, fn, *args):
        if self._ft is not None or not self.transport.thread_multiple:
            try:
                return CompletedRequest(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered by wait(), as a Future would
                return _FailedRequest(exc)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commlib-collectives")
        return FutureRequest(self._worker.submit(fn, *args))


class _FailedRequest(CompletedRequest):
    """A request whose operation already failed: ``wait``/``test`` raise its error."""

    def __init__(self, exc: BaseException):
        super().__init__()
        self._exc = exc

    def test(self) -> bool:
        raise self._exc
