"""Collective operations of :class:`commlib.Communicator` (a mixin).

Each method validates its arguments, checks that every rank passed the same
count, dtype, op, root and algorithm (a small header exchange over the
transport, so a mismatch raises :class:`~commlib.core.errors.InvalidArgument` on
every rank instead of deadlocking or returning garbage), stages device buffers
through host memory, and runs one algorithm of :mod:`commlib.collectives`
(``algorithm="ring"``, ``"recursive_doubling"``, ...), or MPI's own collective
(``algorithm="mpi"``), on a duplicate of the communicator reserved for
collectives.  In fault-tolerant mode (``commlib.init(fault_tolerant=True)``)
the run goes through :func:`commlib.collectives.ft.run_collective`: bounded
waits, and under ULFM revoke/agree/shrink/retry.

Set ``COMMLIB_CHECK_ARGS=0`` before importing commlib to skip the header
exchange (saves one ``log2(n)``-step round per call).
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np

from commlib.core.buffer import Buffer, as_buffer
from commlib.core.errors import BufferError, CommError, InvalidArgument, ProcessFailed

__all__ = ["CollectiveMixin", "ALGORITHMS", "AUTO_THRESHOLDS"]

ALGORITHMS = {
    "allreduce": ("auto", "ring", "recursive_doubling", "mpi"),
    "reduce_scatter": ("auto", "ring", "mpi"),
    "allgather": ("auto", "ring", "mpi"),
    "bcast": ("auto", "binomial", "mpi"),
    "alltoall": ("auto", "pairwise", "mpi"),
    "barrier": ("auto", "dissemination", "mpi"),
}

AUTO_THRESHOLDS = {
    # allreduce: recursive doubling up to this many bytes, ring above
    # (measured with benchmarks/bench_allreduce.py at 2 and 4 ranks, shared
    # memory, 2 cores: the two cross between 64 and 256 KiB)
    "allreduce_rd_max_bytes": 256 * 1024,
}

_KIND = {"allreduce": 1, "reduce_scatter": 2, "allgather": 3, "bcast": 4, "alltoall": 5, "barrier": 6}
_HEADER_FIELDS = ("operation", "count", "dtype", "op", "root", "algorithm")


def _field_name(opname: str, i: int, value: int):
    """A header field's value as the user wrote it (operation, algorithm, op
    and dtype names instead of their codes), for argument-mismatch errors."""
    field = _HEADER_FIELDS[i]
    if field == "operation":
        return next((k for k, v in _KIND.items() if v == value), value)
    if field == "algorithm":
        names = ALGORITHMS.get(opname, ())
        return names[value - 1] if 0 < value <= len(names) else value
    from commlib.collectives import ops as _ops  # noqa: PLC0415

    if field == "op":
        return next((o.name for o in _ops.OPS.values() if o.code == value), value)
    if field == "dtype":
        import ml_dtypes  # noqa: PLC0415

        for d in [*np.sctypeDict.values(), ml_dtypes.bfloat16]:
            try:
                if _ops.dtype_code(d) == value:
                    return np.dtype(d).name
            except TypeError:
                continue
    return value


# read once, at import (an os.environ lookup costs ~1 us, paid on every call)
_CHECK_ARGS = os.environ.get("COMMLIB_CHECK_ARGS", "1").strip().lower() not in ("0", "false", "no", "off")


def _check_args_enabled() -> bool:
    return _CHECK_ARGS


class _Staged:
    """A 1-D host view of a user buffer (device buffers copied to host)."""

    __slots__ = ("buf", "host", "shape")

    def __init__(self, b: Buffer):
        self.buf = b
        self.shape = b.shape
        if b.is_device:
            self.host = b.to_host().reshape(-1)
        else:
            self.host = np.asarray(b.array()).ravel(order="K")

    def flush(self) -> None:
        """Copy the host result back into a device buffer."""
        if self.buf.is_device:
            self.buf.from_host(self.host.reshape(self.shape))


class CollectiveMixin:
    """Collective methods; mixed into :class:`commlib.Communicator`.

    The host class provides ``mpi_comm``, ``transport``, ``rank``, ``size``,
    ``cuda_aware`` and ``_ft`` (a :class:`commlib.collectives.ft.FaultTolerance`
    or None).
    """

    _ft = None

    # --------------------------------------------------------------- plumbing
    def _coll_transport(self):
        """Transport over a duplicate communicator reserved for collectives
        (created on first use; collective over the group)."""
        tp = self.__dict__.get("_coll_tp")
        if tp is None:
            from commlib.transports.mpi import MPITransport  # noqa: PLC0415

            tp = MPITransport(self.mpi_comm.Dup(), cuda_aware=self.cuda_aware)
            tp.fault_tolerant = self._ft is not None
            self._coll_tp = tp
        return tp

    def _shrink(self, tp, call_group):
        """ULFM recovery: shrink the collective communicator, rebuild this
        communicator over the survivors, run the failure callbacks.

        Returns:
            (lost_world, survivors): lost ranks numbered as in ``COMM_WORLD``;
            survivors as ranks of ``call_group`` in the new rank order.
        """
        from mpi4py import MPI  # noqa: PLC0415

        from commlib.transports.mpi import MPITransport  # noqa: PLC0415

        old = tp.comm
        try:
            old.Revoke()
        except Exception:  # noqa: BLE001
            pass
        if self.mpi_comm is not old:
            try:
                self.mpi_comm.Revoke()  # interrupt user point-to-point on the old group
            except Exception:  # noqa: BLE001
                pass
        new = old.Shrink()
        new.Set_errhandler(MPI.ERRORS_RETURN)  # a shrunk comm gets MPI_ERRORS_ARE_FATAL otherwise
        old_grp, new_grp = old.Get_group(), new.Get_group()
        world_grp = MPI.COMM_WORLD.Get_group()
        try:
            n_new = new_grp.Get_size()
            kept = set(MPI.Group.Translate_ranks(new_grp, list(range(n_new)), old_grp))
            lost_old = [r for r in range(old_grp.Get_size()) if r not in kept]
            lost_world = tuple(sorted(int(x) for x in MPI.Group.Translate_ranks(old_grp, lost_old, world_grp))) \
                if lost_old else ()
            survivors = [int(x) for x in MPI.Group.Translate_ranks(new_grp, list(range(n_new)), call_group)]
        finally:
            for g in (old_grp, new_grp, world_grp):
                g.Free()
        try:
            user = new.Dup()
            user.Set_errhandler(MPI.ERRORS_RETURN)
            # no survivor leaves (and maybe dies) while another still creates
            # communicators: Open MPI 5.0 can crash handling a failure then
            new.Barrier()
        except MPI.Exception:
            user = new  # another failure: the next attempt notices and shrinks again
        self.mpi_comm = user
        self.transport = MPITransport(user, cuda_aware=self.cuda_aware)
        self._coll_tp = MPITransport(new, cuda_aware=self.cuda_aware)
        self._coll_tp.fault_tolerant = True
        ft = self._ft
        if lost_world:
            ft.failed = tuple(sorted(set(ft.failed) | set(lost_world)))
            for cb in list(ft.callbacks):
                cb(lost_world, self)
        return lost_world, survivors

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

        The exchange runs on the collectives' communicator with bounded waits
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
        sb = self._wrap(sendbuf, name, "sendbuf")
        rb = self._wrap(recvbuf, name, "recvbuf")
        for peer, what in ((dest, "dest"), (source, "source")):
            if not 0 <= int(peer) < self.size:
                raise InvalidArgument(f"{what} {peer} out of range [0, {self.size})", rank=self.rank, op=name)
        src, dst = _Staged(sb), _Staged(rb)

        def attempt(tp, timeout, survivors):
            from commlib.collectives._common import waitall  # noqa: PLC0415

            rq = tp.irecv(dst.host, int(source), 161)
            sq = tp.isend(src.host, int(dest), 161)
            waitall(tp, [rq, sq], timeout)

        self._run(name, attempt, on_failure="raise")
        dst.flush()
        return recvbuf

    def recover(self) -> tuple:
        """Revoke, agree and shrink after the application saw a failure in its
        own traffic; every survivor calls it.  Returns the lost ``COMM_WORLD``
        ranks.  See :func:`commlib.collectives.ft.recover`."""
        from commlib.collectives.ft import recover  # noqa: PLC0415

        return recover(self)

    @property
    def failed_ranks(self) -> tuple:
        """``COMM_WORLD`` ranks lost so far (fault-tolerant mode; else empty)."""
        return self._ft.failed if self._ft is not None else ()

    @property
    def fault_tolerant(self) -> str | None:
        """``"ulfm"``, ``"timeout"`` or None (not fault tolerant)."""
        return self._ft.mode if self._ft is not None else None

    def _check_header(self, tp, opname, fields: dict, local_error, timeout):
        """Exchange ``fields`` (ints) and a local-error flag; raise
        InvalidArgument on every rank when any rank erred or the fields differ."""
        err_flag = 0 if local_error is None else 1
        if tp.size == 1 or not _check_args_enabled():
            if local_error is not None:
                raise local_error
            return
        vals = [int(fields.get(k, 0)) for k in _HEADER_FIELDS]
        if err_flag:
            vals = [0] * len(vals)
        v = np.array(vals + [-x for x in vals] + [-err_flag, -(tp.rank + 1) * err_flag], dtype=np.int64)
        if (self._ft is None or self._ft.mode == "ulfm") and hasattr(tp, "comm"):
            # MPI's own allreduce is the cheapest; under ULFM no MPI call blocks
            # forever after a failure (it errs, or a survivor's revoke interrupts it)
            from mpi4py import MPI  # noqa: PLC0415

            tp.comm.Allreduce(MPI.IN_PLACE, [v, MPI.INT64_T], MPI.MIN)
        else:  # bounded waits over the transport
            from commlib.collectives.allreduce_recursive_doubling import allreduce_recursive_doubling  # noqa: PLC0415

            allreduce_recursive_doubling(tp, v, "min", timeout=timeout)
        k = len(vals)
        v = v.tolist()  # Python ints: the checks below cost no numpy scalar ops
        if v[-2] != 0:
            if local_error is not None:
                raise local_error
            raise InvalidArgument(f"rank {-v[-1] - 1} (at least) passed invalid arguments",
                                  rank=tp.rank, op=opname)
        lo, hi = v[:k], [-x for x in v[k:2 * k]]
        bad = [f"{_HEADER_FIELDS[i]} differs across ranks (at least {_field_name(opname, i, lo[i])} and "
               f"{_field_name(opname, i, hi[i])}; this rank {_field_name(opname, i, vals[i])})"
               for i in range(k) if lo[i] != hi[i]]
        if bad:
            raise InvalidArgument("; ".join(bad), rank=tp.rank, op=opname)

    def _fail_everywhere(self, opname, local_error):
        """This rank's arguments are invalid: take part in the header exchange
        (so the other ranks raise too) and raise ``local_error``."""
        def attempt(tp, timeout, survivors):
            self._check_header(tp, opname, {}, local_error, timeout)

        self._run(opname, attempt)
        raise local_error  # pragma: no cover - _check_header raised already

    def _algo(self, opname, algorithm, nbytes=0, dtype_ok_for_mpi=True) -> str:
        choices = ALGORITHMS[opname]
        if algorithm not in choices:
            raise InvalidArgument(f"algorithm {algorithm!r} not in {choices}", rank=self.rank, op=opname)
        if algorithm != "auto":
            return algorithm
        if opname == "allreduce":
            return "recursive_doubling" if nbytes <= AUTO_THRESHOLDS["allreduce_rd_max_bytes"] else "ring"
        return choices[1]

    @staticmethod
    def _algo_code(opname, algorithm) -> int:
        return ALGORITHMS[opname].index(algorithm) + 1

    def _run(self, opname, attempt, restore=None, on_failure=None):
        from commlib.collectives.ft import run_collective  # noqa: PLC0415

        return run_collective(self, opname, attempt, restore, on_failure)

    def _wrap(self, obj, opname, what="buffer") -> Buffer:
        b = as_buffer(obj, op=opname, rank=self.rank)
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
                (Thakur, Rabenseifner & Gropp 2005), ``"mpi"`` (``MPI_Allreduce``)
                or ``"auto"`` (recursive doubling up to 256 KiB, ring above).

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
        opname = "allreduce"
        from commlib.collectives import ops as _ops  # noqa: PLC0415

        local_error = None
        inplace = recvbuf is None or recvbuf is sendbuf
        try:
            sb = self._wrap(sendbuf, opname, "sendbuf")
            o = _ops.get_op(op, rank=self.rank, opname=opname)
            o.check(sb.dtype, rank=self.rank, op=opname)
            rb = sb if inplace else self._wrap(recvbuf, opname, "recvbuf")
            if not inplace and (rb.size != sb.size or rb.dtype != sb.dtype):
                raise InvalidArgument(f"recvbuf ({rb.size} x {rb.dtype}) does not match sendbuf "
                                      f"({sb.size} x {sb.dtype})", rank=self.rank, op=opname)
            algo = self._algo(opname, algorithm, sb.nbytes)
            if algo == "mpi" and _ops.mpi_datatype(sb.dtype) is None:
                raise InvalidArgument(f"MPI has no datatype for {sb.dtype.name}; use algorithm='ring'",
                                      rank=self.rank, op=opname)
            fields = {"operation": _KIND[opname], "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                      "op": o.code, "algorithm": self._algo_code(opname, algo)}
        except InvalidArgument as exc:
            local_error, fields = exc, {}
        except BufferError as exc:
            local_error, fields = InvalidArgument(str(exc.detail), rank=self.rank, op=opname), {}
        if local_error is not None:
            self._fail_everywhere(opname, local_error)

        src = _Staged(sb)
        dst = src if inplace else _Staged(rb)
        # The input must survive a retry: out of place it does (sendbuf is only
        # read); in place, fault-tolerant mode keeps a snapshot and restores it
        # before a retry, so the fast in-place algorithm runs on the user's buffer.
        # The ring saves each chunk lazily, just before it first overwrites it,
        # behind that step's transfer (LazySnapshot); the others copy up front.
        source = None if inplace else src.host
        snapshot = self._snapshot(dst.host) if (inplace and self._ft is not None) else None

        def attempt(tp, timeout, survivors):
            self._check_header(tp, opname, fields, None, timeout)
            work = dst.host
            if algo == "ring":
                from commlib.collectives.allreduce_ring import allreduce_ring  # noqa: PLC0415

                allreduce_ring(tp, work, o, sendbuf=source, timeout=timeout, save=snapshot)
                return
            if snapshot is not None:
                snapshot.save_all()
            if algo == "recursive_doubling":
                from commlib.collectives.allreduce_recursive_doubling import allreduce_recursive_doubling  # noqa: PLC0415

                allreduce_recursive_doubling(tp, work, o, sendbuf=source, timeout=timeout)
            else:
                from mpi4py import MPI  # noqa: PLC0415

                dt = _ops.mpi_datatype(work.dtype)
                if source is None:
                    tp.comm.Allreduce(MPI.IN_PLACE, [work, dt], _ops.mpi_op(o))
                else:
                    tp.comm.Allreduce([source, dt], [work, dt], _ops.mpi_op(o))
                o.finalize(work, tp.size)

        self._run(opname, attempt, snapshot.restore if snapshot is not None else None)
        dst.flush()
        return sendbuf if inplace else recvbuf

    def _snapshot(self, buf: np.ndarray):
        """A :class:`~commlib.collectives.ft.LazySnapshot` of ``buf`` whose copy
        lives in a scratch buffer kept by the communicator (grown as needed), so
        repeated fault-tolerant calls do not pay fresh page faults each time."""
        from commlib.collectives.ft import LazySnapshot  # noqa: PLC0415

        scratch = self.__dict__.get("_ft_scratch")
        if scratch is None or scratch.nbytes < buf.nbytes:
            scratch = np.empty(buf.nbytes, dtype=np.uint8)
            self._ft_scratch = scratch
        return LazySnapshot(buf, scratch)

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
            op, algorithm: as :meth:`allreduce` (algorithms ``"ring"``, ``"mpi"``).

        Returns:
            np.ndarray or recvbuf: this rank's reduced block, shape ``(b[r+1]-b[r],)``.
            After a recovered failure the blocks are over the shrunk group (a new
            array when ``recvbuf`` no longer fits).

        Raises:
            InvalidArgument, BufferError, ProcessFailed, CommTimeout: as :meth:`allreduce`.
        """
        opname = "reduce_scatter"
        from commlib.collectives import ops as _ops  # noqa: PLC0415
        from commlib.collectives._common import chunk_bounds  # noqa: PLC0415

        local_error = None
        try:
            sb = self._wrap(sendbuf, opname, "sendbuf")
            o = _ops.get_op(op, rank=self.rank, opname=opname)
            o.check(sb.dtype, rank=self.rank, op=opname)
            algo = self._algo(opname, algorithm)
            if algo == "mpi" and (_ops.mpi_datatype(sb.dtype) is None or sb.size % self.size):
                raise InvalidArgument("algorithm='mpi' needs an MPI datatype and count divisible by size",
                                      rank=self.rank, op=opname)
            b = chunk_bounds(sb.size, self.size)
            mylen = int(b[self.rank + 1] - b[self.rank])
            rb = None
            if recvbuf is not None:
                rb = self._wrap(recvbuf, opname, "recvbuf")
                if rb.size != mylen or rb.dtype != sb.dtype:
                    raise InvalidArgument(f"recvbuf must hold {mylen} x {sb.dtype.name}, has {rb.size} x {rb.dtype}",
                                          rank=self.rank, op=opname)
            fields = {"operation": _KIND[opname], "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                      "op": o.code, "algorithm": self._algo_code(opname, algo)}
        except (InvalidArgument, BufferError) as exc:
            local_error = exc if isinstance(exc, InvalidArgument) else InvalidArgument(exc.detail, rank=self.rank, op=opname)
            self._fail_everywhere(opname, local_error)

        src = _Staged(sb)

        def attempt(tp, timeout, survivors):
            self._check_header(tp, opname, fields, None, timeout)
            n, r = tp.size, tp.rank
            bounds = chunk_bounds(src.host.size, n)
            if algo == "mpi":
                out = np.empty(int(bounds[r + 1] - bounds[r]), dtype=src.host.dtype)
                dt = _ops.mpi_datatype(out.dtype)
                tp.comm.Reduce_scatter_block([src.host, dt], [out, dt], _ops.mpi_op(o))
                o.finalize(out, n)
                return out
            from commlib.collectives.reduce_scatter_ring import reduce_scatter_ring_inplace  # noqa: PLC0415

            work = np.array(src.host, copy=True)
            reduce_scatter_ring_inplace(tp, work, o, bounds, timeout=timeout)
            out = work[bounds[r]:bounds[r + 1]]
            o.finalize(out, n)
            return out

        out = self._run(opname, attempt)
        if rb is not None and rb.size == out.size:
            st = _Staged(rb)
            st.host[...] = out
            st.flush()
            return recvbuf
        return out

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
        opname = "allgather"
        from commlib.collectives import ops as _ops  # noqa: PLC0415

        local_error = None
        try:
            sb = self._wrap(sendbuf, opname, "sendbuf")
            algo = self._algo(opname, algorithm)
            rb = None
            if recvbuf is not None:
                rb = self._wrap(recvbuf, opname, "recvbuf")
                if rb.size != sb.size * self.size or rb.dtype != sb.dtype:
                    raise InvalidArgument(f"recvbuf must hold {self.size} x {sb.size} x {sb.dtype.name}, "
                                          f"has {rb.size} x {rb.dtype}", rank=self.rank, op=opname)
            fields = {"operation": _KIND[opname], "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                      "algorithm": self._algo_code(opname, algo)}
        except (InvalidArgument, BufferError) as exc:
            local_error = exc if isinstance(exc, InvalidArgument) else InvalidArgument(exc.detail, rank=self.rank, op=opname)
            self._fail_everywhere(opname, local_error)

        src = _Staged(sb)

        def attempt(tp, timeout, survivors):
            self._check_header(tp, opname, fields, None, timeout)
            out = np.empty(tp.size * src.host.size, dtype=src.host.dtype)
            if algo == "mpi":
                tp.comm.Allgather([src.host.view(np.uint8), src.host.nbytes, _byte()],
                                  [out.view(np.uint8), src.host.nbytes, _byte()])
            else:
                from commlib.collectives.allgather_ring import allgather_ring  # noqa: PLC0415

                allgather_ring(tp, src.host, out, timeout=timeout)
            return out

        out = self._run(opname, attempt)
        if rb is not None and rb.size == out.size:
            st = _Staged(rb)
            st.host[...] = out
            st.flush()
            return recvbuf
        return out.reshape((self.size,) + tuple(sb.shape))

    # ----------------------------------------------------------------- bcast
    def bcast(self, buf, root: int = 0, algorithm: str = "auto"):
        """Broadcast ``buf`` from ``root`` to every rank, in place (``MPI_Bcast``).

        Args:
            buf: contiguous array, same count and dtype on every rank.
            root: the rank whose data is sent, in ``[0, size)``.
            algorithm: ``"binomial"`` (binomial tree, pipelined in 1 MiB segments;
                Thakur, Rabenseifner & Gropp 2005), ``"mpi"`` or ``"auto"`` (binomial).

        Returns:
            buf, holding the root's data.

        Raises:
            InvalidArgument: root out of range or different across ranks (every rank).
            ProcessFailed: fault-tolerant mode and the root failed (every survivor).
        """
        opname = "bcast"
        from commlib.collectives import ops as _ops  # noqa: PLC0415

        local_error = None
        try:
            b = self._wrap(buf, opname, "buf")
            algo = self._algo(opname, algorithm)
            if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
                raise InvalidArgument(f"root {root} out of range [0, {self.size})", rank=self.rank, op=opname)
            fields = {"operation": _KIND[opname], "count": b.size, "dtype": _ops.dtype_code(b.dtype),
                      "root": int(root), "algorithm": self._algo_code(opname, algo)}
        except (InvalidArgument, BufferError) as exc:
            local_error = exc if isinstance(exc, InvalidArgument) else InvalidArgument(exc.detail, rank=self.rank, op=opname)
            self._fail_everywhere(opname, local_error)

        st = _Staged(b)
        saved = np.array(st.host, copy=True) if self._ft is not None else None
        root = int(root)

        def restore():
            st.host[...] = saved

        def attempt(tp, timeout, survivors):
            if root not in survivors:  # not a failure to recover from: every survivor raises
                raise CommError(f"bcast root {root} failed", rank=tp.rank, op=opname)
            newroot = survivors.index(root)
            f = dict(fields, root=newroot)
            self._check_header(tp, opname, f, None, timeout)
            if algo == "mpi":
                tp.comm.Bcast([st.host.view(np.uint8), st.host.nbytes, _byte()], root=newroot)
            else:
                from commlib.collectives.bcast_binomial import bcast_binomial  # noqa: PLC0415

                bcast_binomial(tp, st.host, newroot, timeout=timeout)

        try:
            self._run(opname, attempt, restore)
        except CommError as exc:
            if "bcast root" in str(exc):
                raise ProcessFailed(f"bcast root {root} failed; no survivor holds its data",
                                    failed=self.failed_ranks, rank=self.rank, op=opname) from None
            raise
        st.flush()
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
        opname = "alltoall"
        from commlib.collectives import ops as _ops  # noqa: PLC0415

        local_error = None
        try:
            sb = self._wrap(sendbuf, opname, "sendbuf")
            algo = self._algo(opname, algorithm)
            if sb.size % self.size:
                raise InvalidArgument(f"sendbuf has {sb.size} elements, not a multiple of size {self.size}",
                                      rank=self.rank, op=opname)
            rb = None
            if recvbuf is not None:
                rb = self._wrap(recvbuf, opname, "recvbuf")
                if rb.size != sb.size or rb.dtype != sb.dtype:
                    raise InvalidArgument("recvbuf must match sendbuf in count and dtype", rank=self.rank, op=opname)
                if rb.obj is sb.obj:
                    raise InvalidArgument("alltoall cannot run in place", rank=self.rank, op=opname)
            fields = {"operation": _KIND[opname], "count": sb.size, "dtype": _ops.dtype_code(sb.dtype),
                      "algorithm": self._algo_code(opname, algo)}
        except (InvalidArgument, BufferError) as exc:
            local_error = exc if isinstance(exc, InvalidArgument) else InvalidArgument(exc.detail, rank=self.rank, op=opname)
            self._fail_everywhere(opname, local_error)

        src = _Staged(sb)
        nblk = self.size
        blk = src.host.size // nblk

        def attempt(tp, timeout, survivors):
            self._check_header(tp, opname, fields, None, timeout)
            send = src.host.reshape(nblk, blk)[survivors].reshape(-1) if len(survivors) != nblk else src.host
            out = np.empty(tp.size * blk, dtype=src.host.dtype)
            if algo == "mpi":
                tp.comm.Alltoall([send.view(np.uint8), blk * send.itemsize, _byte()],
                                 [out.view(np.uint8), blk * send.itemsize, _byte()])
            else:
                from commlib.collectives.alltoall_pairwise import alltoall_pairwise  # noqa: PLC0415

                alltoall_pairwise(tp, np.ascontiguousarray(send), out, timeout=timeout)
            return out

        out = self._run(opname, attempt)
        if rb is not None and rb.size == out.size:
            st = _Staged(rb)
            st.host[...] = out
            st.flush()
            return recvbuf
        return out.reshape(self.size, blk)

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
        algo = self._algo(opname, algorithm)

        def attempt(tp, timeout, survivors):
            if algo == "mpi":
                tp.comm.Barrier()
            else:
                from commlib.collectives.barrier import barrier_dissemination  # noqa: PLC0415

                barrier_dissemination(tp, timeout=timeout)

        self._run(opname, attempt)

    # ---------------------------------------------------------- non-blocking
    def iallreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto"):
        """Non-blocking :meth:`allreduce`; returns a request (``wait``/``test``).

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
        from mpi4py import MPI  # noqa: PLC0415

        if self._ft is not None or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            req = _ThreadRequest()
            try:
                req._result = fn(*args)
            except BaseException as exc:  # noqa: BLE001
                req._error = exc
            req._done.set()
            return req
        worker = self.__dict__.get("_worker")
        if worker is None:
            worker = self._worker = _Worker()
        return worker.submit(fn, args)


def _byte():
    from mpi4py import MPI  # noqa: PLC0415

    return MPI.BYTE


class _ThreadRequest:
    """Request of a collective running on a worker thread (see ``iallreduce``)."""

    def __init__(self):
        self._done = threading.Event()
        self._result = None
        self._error = None

    def test(self) -> bool:
        """True when complete (raises the collective's error, if any)."""
        if self._done.is_set():
            if self._error is not None:
                raise self._error
            return True
        return False

    def wait(self, timeout: float | None = None):
        """Wait (``timeout`` seconds, None: forever) and return the collective's result.

        Raises:
            CommTimeout: ``timeout`` passed first.
        """
        from commlib.core.errors import CommTimeout  # noqa: PLC0415

        if not self._done.wait(timeout):
            raise CommTimeout(f"collective not complete after {timeout} s", op="wait")
        if self._error is not None:
            raise self._error
        return self._result


class _Worker:
    """One daemon thread running submitted collectives in order."""

    def __init__(self):
        import queue  # noqa: PLC0415

        self._q = queue.Queue()
        self._t = threading.Thread(target=self._loop, name="commlib-collectives", daemon=True)
        self._t.start()

    def _loop(self):
        while True:
            fn, args, req = self._q.get()
            try:
                req._result = fn(*args)
            except BaseException as exc:  # noqa: BLE001
                req._error = exc
            req._done.set()

    def submit(self, fn, args):
        req = _ThreadRequest()
        self._q.put((fn, args, req))
        return req
