"""Collective operations of :class:`commlib.Communicator` (a mixin): the front ends.

Each collective method checks nothing itself: it hands its arguments to the
communicator's :class:`~commlib.collectives.engine.Engine`, which runs the
collective from its row of :data:`commlib.collectives.specs.SPECS`: a first
round that makes every rank agree on the call (a mismatch or a bad argument
on any rank raises :class:`~commlib.errors.InvalidArgument` on every rank,
before any payload moves) and, for a small ``algorithm="auto"`` allreduce,
reduce_scatter or bcast, carries the data itself, so the call is one round of
messages.  Larger calls then run one algorithm of :mod:`commlib.collectives`
(``"ring"``, ``"recursive_doubling"``, ...) or the transport's native
collective (``algorithm="mpi"``) on the transport reserved for collectives,
through :func:`commlib.collectives.ft.run_collective` (bounded waits, and
under ULFM revoke/agree/shrink/retry, in fault-tolerant mode).

Device buffers (CuPy, numba, the CUDA simulator's): the ring allreduce and
reduce_scatter reduce on the device (:mod:`commlib.collectives._device_reduce`,
same order and bits as the host ring), handing device buffers to the transport
when it is CUDA-aware and otherwise staging each segment through pinned host
buffers the communicator keeps; the other algorithms, and one-round small
calls, run on a pinned host copy made and written back asynchronously on the
caller's stream (:mod:`commlib.collectives.staging`).

``COMMLIB_CHECK_ARGS=0`` skips the first round of large calls (small calls
keep it: it carries their data).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from commlib.collectives.agreement import agree_header
from commlib.collectives.barrier import barrier_dissemination
from commlib.collectives.engine import SPECS, Engine
from commlib.collectives.ft import recover
from commlib.core.errors import CommError, InvalidArgument
from commlib.transports.base import CompletedRequest, FutureRequest

__all__ = ["CollectiveMixin", "ALGORITHMS"]

ALGORITHMS = {name: spec.algorithms for name, spec in SPECS.items()}


class CollectiveMixin:
    """Collective methods; mixed into :class:`commlib.Communicator`.

    The host class provides ``transport``, ``rank``, ``size``, ``cuda_aware``,
    ``_coll_tp``, ``_ft`` and ``_worker``; the mixin implements the
    fault-tolerance protocol of :func:`commlib.collectives.ft.run_collective`
    (``ft``, ``collective_transport()``, ``shrink()``).  Every collective is a
    front end of the communicator's :class:`~commlib.collectives.engine.Engine`
    (made on first use), which runs it from its row of
    :data:`~commlib.collectives.specs.SPECS`.
    """

    # ------------------------------------------------ fault-tolerance protocol
    @property
    def ft(self):
        """The :class:`~commlib.collectives.ft.FaultTolerance` state, or None."""
        return self._ft

    #: :meth:`collective_transport` takes a ``timeout`` (the attention layer asks before passing one)
    bounded_first_use = True

    def collective_transport(self, op: str = "collective_transport", timeout: float | None = None):
        """The transport commlib's own traffic (collectives, attention) runs on:
        a duplicate of this communicator, so it never meets the user's messages.

        A fault-tolerant communicator makes it when it is created (``init``,
        ``dup``, ``split``, ``cart_create``, a shrink), while every rank is in
        that collective call; any other communicator makes it on first use,
        collectively over the group (made for every communicator at once, the
        2048 context ids of MPICH ran out after about 2000 ``init`` calls).
        Should a fault-tolerant one lack it, it is made by ``MPI_Comm_idup``
        waited for at most the fault-tolerant timeout, so that a first call
        made on one rank alone raises instead of waiting for ever.

        Args:
            op: the operation that needs it, for errors.
            timeout: a communicator that is not fault tolerant makes it within
                this many seconds (a finite number > 0: a call's own timeout,
                e.g. an attention call's) by a bounded ``MPI_Comm_idup``; None:
                a blocking ``MPI_Comm_dup``.

        Raises:
            CommTimeout: made here with a bound (the fault-tolerant timeout, or
                ``timeout``), and the peers did not join the duplication within
                it (it stays posted: the next call waits for it again, see
                :meth:`MPITransport.idup`).
        """
        tp = self._coll_tp
        if tp is None:
            if self._ft is None and timeout is not None:
                tp = self._coll_tp = self.transport.idup(timeout, op=op)[0]
                tp.fault_tolerant = False
            elif self._ft is None:
                tp = self._coll_tp = self.transport.dup()
                tp.fault_tolerant = False
            else:
                tp = self._coll_tp = self.transport.idup(self._ft.timeout, op=op)[0]
                tp.fault_tolerant = True
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
            barrier_dissemination(new)  # commlib's own: no MPI collective when fault tolerant
        except CommError:
            user = new  # another failure: the next attempt notices and shrinks again
        self.transport = user
        self._coll_tp = new
        # typed point to point's plans and strategy choices name ranks of the old group
        self._typed_plans.clear()
        self._strategy_memo.clear()
        for last in self._typed_last:
            last.clear()
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
        return self._engine().sendrecv(sendbuf, dest, recvbuf, source, name)

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
    _coll_engine = None  # this communicator's collectives.engine.Engine, made on first use

    def _engine(self) -> Engine:
        """The communicator's collective engine (created on first use)."""
        eng = self._coll_engine
        if eng is None:
            eng = self._coll_engine = Engine(self)
        return eng

    def _staging(self):
        """This communicator's pinned staging buffers for device arrays (created on first use)."""
        return self._engine().staging()

    # ---------------------------------------------------------- the collectives
    def allreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto", *, timeout: float | None = None):
        """Combine ``sendbuf`` element-wise over all ranks; every rank gets the result.

        **In place by default**: ``comm.allreduce(x)`` overwrites ``x`` with the
        result and returns ``x`` itself.  mpi4py's lowercase ``allreduce(x)``
        returns a new object and leaves ``x`` as it was; here pass ``recvbuf``
        (or ``x.copy()``) to keep the input.

        Args:
            sendbuf: contiguous array (numpy, CuPy, numba device), any shape,
                ``count`` elements of float16, bfloat16, float32, float64, an
                integer dtype or bool; same count and dtype on every rank.
            recvbuf: array of the same shape/dtype for the result; None (the
                default) reduces in place into ``sendbuf``.
            op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"`` (floats),
                ``"band"``, ``"bor"``, ``"bxor"`` (integers), or an ``MPI.Op``.
            algorithm: ``"ring"`` (Patarasuk & Yuan 2009), ``"recursive_doubling"``
                (Thakur, Rabenseifner & Gropp 2005), ``"mpi"`` (the transport's
                native ``MPI_Allreduce``) or ``"auto"``: up to
                ``COMMLIB_SMALL_BYTES`` (1024) bytes one round that gathers every
                rank's data with the argument header and reduces it locally in
                rank order; recursive doubling up to 256 KiB on 3 or more ranks;
                ring above (on 2 ranks, ring above the one round).
            timeout: the deadline of the whole call, in seconds (a finite
                number > 0): the first round and every step of the algorithm
                wait what is left of it, and past it the call raises
                :class:`~commlib.CommTimeout` naming the rank and the operation.
                None: the communicator's default, its fault-tolerant
                ``timeout`` (``commlib.init(fault_tolerant=True, timeout=...)``)
                when it is fault tolerant, else no bound (MPI's semantics: wait
                as long as it takes).  Pass None on every rank or a number on
                every rank (the bounded call's first round is point to point,
                the unbounded one MPI's own all-gather).  ``algorithm="mpi"``
                waits inside the library's collective after the first round:
                only the first round is bounded then (and, under ULFM, the
                watchdog).  A plain communicator whose call timed out keeps the
                call's messages posted: treat it as broken.  In place, a
                bounded call keeps a copy of each part of the buffer before it
                overwrites it, so that a ``CommTimeout`` leaves the buffer
                holding the input again, as a fault-tolerant call does; the
                copy costs a pass over the buffer.

        Returns:
            The array holding the result (``recvbuf``, or ``sendbuf`` in place).
            Bit-identical on every rank.  After a recovered failure, the
            reduction over the surviving ranks' inputs.

        Raises:
            InvalidArgument: an op unfit for the dtype, mismatched count/dtype/op
                across ranks, an unknown algorithm, a read-only ``recvbuf`` (or
                ``sendbuf`` in place), a ``timeout`` that is not None or a
                finite number > 0 (NaN, infinite, negative, 0, a bool), on any
                rank (on every rank, before any byte moves).
            BufferError: unsupported or non-contiguous buffers.
            CommTimeout: ``timeout`` passed (naming the rank and the operation);
                an in-place buffer holds its input again.
            ProcessFailed: fault-tolerant mode, see ``commlib.init``.
        """
        return (self._coll_engine or self._engine()).allreduce(sendbuf, recvbuf, op, algorithm, timeout)

    def reduce_scatter(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto", *,
                       timeout: float | None = None):
        """Reduce ``sendbuf`` over all ranks and give rank ``r`` block ``r``
        (``MPI_Reduce_scatter_block`` when ``count`` divides evenly).

        Args:
            sendbuf: contiguous array of ``count`` elements (any shape, flattened
                in memory order); same count and dtype on every rank.  Block ``r``
                is elements ``[b[r], b[r+1])`` with ``b = chunk_bounds(count, size)``
                (``count // size`` each when it divides, as MPI).
            recvbuf: array of ``b[r+1]-b[r]`` elements of ``sendbuf``'s dtype
                for block ``rank`` (None: allocated, see Returns).
            op: as :meth:`allreduce`.
            algorithm: ``"ring"``, ``"mpi"`` or ``"auto"`` (one round up to
                ``COMMLIB_SMALL_BYTES``, as :meth:`allreduce`; ring above).
            timeout: the deadline of the whole call, in seconds, as :meth:`allreduce`.

        Returns:
            ``recvbuf``, or a new array of shape ``(b[r+1]-b[r],)`` and
            ``sendbuf``'s dtype: this rank's reduced block.  A new array is of
            ``sendbuf``'s kind whatever the algorithm: numpy for a host
            ``sendbuf``, a numba device array for a numba one, CuPy for CuPy, a
            torch tensor on the same device for a torch CUDA tensor (other
            device arrays: CuPy where it runs, else numba); a result computed on
            the host (staged algorithms, ``"mpi"``, the one round) is copied up
            once at the end.  After a recovered failure the blocks are over the
            shrunk group (a new array when ``recvbuf`` no longer fits).

        Raises:
            InvalidArgument, BufferError, ProcessFailed, CommTimeout: as :meth:`allreduce`.
        """
        return self._engine().execute("reduce_scatter", sendbuf, recvbuf, op, algorithm, timeout=timeout)

    def allgather(self, sendbuf, recvbuf=None, algorithm: str = "auto", *, timeout: float | None = None):
        """Gather every rank's ``sendbuf`` on every rank (``MPI_Allgather``).

        Args:
            sendbuf: contiguous array, shape ``S``, same count and dtype everywhere.
            recvbuf: array of ``size * count`` elements of ``sendbuf``'s dtype,
                e.g. shape ``(size, *S)`` (None: allocated, see Returns).
            algorithm: ``"ring"`` (Patarasuk & Yuan 2009), ``"mpi"`` or ``"auto"`` (ring).
            timeout: the deadline of the whole call, in seconds, as :meth:`allreduce`.

        Returns:
            ``recvbuf``, or a new C-ordered array of shape ``(size, *S)`` and
            ``sendbuf``'s dtype, of ``sendbuf``'s kind (as :meth:`reduce_scatter`:
            a device ``sendbuf`` gives the same kind of device array, a host one
            numpy): block ``i`` is rank ``i``'s ``sendbuf`` (its elements in
            memory order).  After a recovered failure, the blocks of the
            surviving ranks in the new rank order, shape ``(new_size, *S)`` (a
            new array when ``recvbuf`` no longer fits).

        Raises:
            InvalidArgument, BufferError, ProcessFailed, CommTimeout: as :meth:`allreduce`.
        """
        return self._engine().execute("allgather", sendbuf, recvbuf, algorithm=algorithm, timeout=timeout)

    def bcast(self, buf, root: int = 0, algorithm: str = "auto", *, timeout: float | None = None):
        """Broadcast ``buf`` from ``root`` to every rank, in place (``MPI_Bcast``).

        Args:
            buf: contiguous array, same count and dtype on every rank.
            root: the rank whose data is sent, in ``[0, size)``.
            algorithm: ``"binomial"`` (binomial tree, pipelined in 1 MiB segments;
                Thakur, Rabenseifner & Gropp 2005), ``"mpi"`` or ``"auto"`` (one
                round up to ``COMMLIB_SMALL_BYTES``, binomial above).
            timeout: the deadline of the whole call, in seconds, as :meth:`allreduce`.

        Returns:
            buf, holding the root's data.

        Raises:
            InvalidArgument: root out of range (or a bool) or different across
                ranks, a read-only ``buf`` on a rank other than the root, a bad
                ``timeout`` (every rank).
            CommTimeout: ``timeout`` passed (naming the rank and the operation).
            ProcessFailed: fault-tolerant mode and the root failed (every survivor).
        """
        return (self._coll_engine or self._engine()).bcast(buf, root, algorithm, timeout)

    def alltoall(self, sendbuf, recvbuf=None, algorithm: str = "auto", *, timeout: float | None = None):
        """Every rank sends block ``j`` of ``sendbuf`` to rank ``j`` (``MPI_Alltoall``).

        Args:
            sendbuf: contiguous array of ``size * count`` elements, e.g. shape
                ``(size, ...)``; block ``j`` goes to rank ``j``.
            recvbuf: array of ``sendbuf``'s element count and dtype (None:
                allocated, see Returns); block ``i`` receives rank ``i``'s block
                ``rank``.
            algorithm: ``"pairwise"`` (Thakur, Rabenseifner & Gropp 2005), ``"mpi"``
                or ``"auto"`` (pairwise).
            timeout: the deadline of the whole call, in seconds, as :meth:`allreduce`.

        Returns:
            ``recvbuf``, or a new C-ordered array of shape ``(size, count)``
            and ``sendbuf``'s dtype, of ``sendbuf``'s kind (as :meth:`reduce_scatter`:
            a device ``sendbuf`` gives the same kind of device array, a host one
            numpy).  After a recovered failure, blocks addressed to failed ranks
            are dropped and the result has ``new_size`` blocks in the new rank
            order (a new array).

        Raises:
            InvalidArgument: count not divisible by size, mismatch across ranks,
                a bad ``timeout`` (every rank).
            CommTimeout: ``timeout`` passed (naming the rank and the operation).
        """
        return self._engine().execute("alltoall", sendbuf, recvbuf, algorithm=algorithm, timeout=timeout)

    def barrier(self, algorithm: str = "auto", *, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier.

        Like every collective, the barrier starts with the argument agreement,
        whose all-gather is itself a barrier (no rank leaves it before hearing,
        transitively, from every rank): an algorithm that is unknown on one
        rank, or differs across ranks, raises :class:`InvalidArgument` on every
        rank instead of leaving the others waiting.

        Args:
            algorithm: ``"dissemination"`` or ``"auto"`` (that round alone: Bruck's
                all-gather, the dissemination pattern of Hensgen, Finkel & Manber
                1988, with bounded waits in fault-tolerant mode, else the native
                all-gather; without the round, ``COMMLIB_CHECK_ARGS=0``, the
                dissemination barrier itself), or ``"mpi"`` (``MPI_Barrier``
                after the round).  The same on every rank.
            timeout: the deadline of the whole call, in seconds, as :meth:`allreduce`.

        Raises:
            InvalidArgument: an unknown algorithm, or different ones across
                ranks, a bad ``timeout`` (every rank).
            CommTimeout: ``timeout`` passed (naming the rank and the operation).
            ProcessFailed: fault-tolerant mode, see ``commlib.init``.
        """
        (self._coll_engine or self._engine()).barrier(algorithm, timeout)

    def agree_arguments(self, values, names, *, op: str, local_error: CommError | None = None,
                        describe: Callable[[str, int], object] | None = None,
                        timeout: float | None = None) -> None:
        """Argument agreement for a caller's own collective step (an app's
        problem size, a library's options), as every commlib collective runs
        it first: each rank passes its values and, if it found its own
        arguments bad, that error; every rank then raises together, before any
        byte of the step moves, or returns having checked that all ranks hold
        the same values.  One all-gather of ``8 (1 + len(values))`` bytes per
        rank (MPI's native all-gather, or a bounded point-to-point one when
        ``timeout`` is given or the communicator is fault tolerant).

        Args:
            values: this rank's ints (the same count on every rank; encode
                floats as their bits, e.g. ``struct.unpack("<q", struct.pack("<d", x))``).
            names: one name per value, for the message that says which differ.
            op: the step's name, for the errors.
            local_error: this rank's own argument error (a :class:`CommError`),
                or None.
            describe: ``describe(name, value)`` formats a value for the
                message (default: the int).
            timeout: the deadline of the call, in seconds (None: the
                communicator's fault-tolerant timeout, or no bound).

        Raises:
            CommError: ``local_error`` on the rank that passed it, and
                :class:`InvalidArgument` naming that rank on every other.
            InvalidArgument: on every rank, when the values differ (naming the
                fields and ranks).
            CommTimeout / ProcessFailed: a rank did not take part in time, or died.
        """
        if len(names) != len(values):
            raise InvalidArgument(f"{len(values)} values but {len(names)} names", rank=self.rank, op=op)
        if timeout is None and self.ft is not None:
            timeout = self.ft.timeout
        agree_header(self.transport, [int(v) for v in values], op=op, local_error=local_error,
                     timeout=timeout, names=list(names), describe=describe)

    # ---------------------------------------------------------- non-blocking
    def iallreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto", *, timeout: float | None = None):
        """Non-blocking :meth:`allreduce`; returns a request (``wait``/``test``,
        and ``concurrent.futures.Future``'s ``result``/``done``/``add_done_callback``).

        The collective runs on a per-communicator worker thread (calls complete in
        the order they were started) when MPI provides ``MPI_THREAD_MULTIPLE`` and
        the communicator is not fault tolerant; otherwise it runs before this
        returns and the request is already complete.  Do not touch the buffers
        until the request completes.  ``timeout``: the deadline of the
        collective, in seconds, as :meth:`allreduce`, counted from when it
        starts running (on the worker thread: after the calls started before
        it); ``wait(timeout)`` bounds the wait for the request itself.
        """
        return self._nonblocking(self.allreduce, sendbuf, recvbuf, op, algorithm, timeout=timeout)

    def ireduce_scatter(self, sendbuf, recvbuf, op="sum", algorithm: str = "auto", *, timeout: float | None = None):
        """Non-blocking :meth:`reduce_scatter` (``recvbuf`` required); see :meth:`iallreduce`."""
        return self._nonblocking(self.reduce_scatter, sendbuf, recvbuf, op, algorithm, timeout=timeout)

    def iallgather(self, sendbuf, recvbuf, algorithm: str = "auto", *, timeout: float | None = None):
        """Non-blocking :meth:`allgather` (``recvbuf`` required); see :meth:`iallreduce`."""
        return self._nonblocking(self.allgather, sendbuf, recvbuf, algorithm, timeout=timeout)

    def ibcast(self, buf, root: int = 0, algorithm: str = "auto", *, timeout: float | None = None):
        """Non-blocking :meth:`bcast`; see :meth:`iallreduce`."""
        return self._nonblocking(self.bcast, buf, root, algorithm, timeout=timeout)

    def ialltoall(self, sendbuf, recvbuf, algorithm: str = "auto", *, timeout: float | None = None):
        """Non-blocking :meth:`alltoall` (``recvbuf`` required); see :meth:`iallreduce`."""
        return self._nonblocking(self.alltoall, sendbuf, recvbuf, algorithm, timeout=timeout)

    def _nonblocking(self, fn, *args, **kwargs):
        if self._ft is not None or not self.transport.thread_multiple:
            try:
                return CompletedRequest(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - delivered by wait(), as a Future would
                return _FailedRequest(exc)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commlib-collectives")
        return FutureRequest(self._worker.submit(fn, *args, **kwargs))


class _FailedRequest(CompletedRequest):
    """A request whose operation already failed: ``wait``/``test`` raise its error."""

    def __init__(self, exc: BaseException):
        super().__init__()
        self._exc = exc

    def test(self) -> bool:
        raise self._exc
