"""The collective engine: every collective call, from one table of specifications.

Every collective of a communicator (``allreduce``, ``reduce_scatter``,
``allgather``, ``bcast``, ``alltoall``, ``barrier``) is one call of
:meth:`Engine.execute` with its row of :data:`~commlib.collectives.specs.SPECS`,
which carries the collective's validation, header and algorithms.  The
engine alone runs the steps:

1. **validate** this rank's arguments locally (the row's ``prepare``; an
   error is kept, not raised yet) and encode the call's header;
2. **first round** (:func:`first_round`): one all-gather of a fixed-size
   *row* per rank holding the header (:mod:`commlib.core.agreement`: error
   flag, operation, count, dtype, op, root, algorithm) and, for a small
   ``"auto"`` allreduce / reduce_scatter / bcast, the payload itself.  The
   row has the same size on every rank whatever its arguments
   (:func:`~.one_round.small_capacity` depends on the group size only), so
   ranks whose calls differ still make matching calls; every rank reads every
   header and raises the same :class:`~commlib.InvalidArgument` before any
   payload byte of a large call moves;
3. **small calls end here**: the payloads are in the gathered rows and each
   rank combines them locally in the ring's order (:mod:`.one_round`), so
   every rank computes the same bits: one round of messages instead of two;
4. **choose** the algorithm (the row's thresholds, already applied by
   ``prepare``) and its host or device variant, stage the buffers, and
   **snapshot** an input the algorithm overwrites (fault-tolerant mode, and
   a plain call with a ``timeout``: its ``CommTimeout`` leaves the input as
   it was);
5. **run** it over the transport under the recovery policy
   (:func:`commlib.collectives.ft.run_collective`: bounded waits, and under
   ULFM revoke/agree/shrink/retry, the snapshot restored before each retry);
6. **return** what the row's ``deliver`` makes of the result.

``COMMLIB_CHECK_ARGS=0`` skips the first round of large calls (small calls
keep it: it carries their data).

The hot path, a small allreduce, broadcast or barrier of host numpy arrays
outside fault-tolerant mode and without a ``timeout``, runs from the plans
the engine caches per row and call shape (:class:`~.host_plans.HostPlans`): the
row its first round sends is the one :func:`first_round` sends for the same
call (both encode it with :func:`~.agreement.encode_row`, the plan once, from
the row's own ``prepare``), in the group's kept rows
(:class:`~.first_round.FirstRoundRows`), whose all-gather every unbounded
first round of the group runs, planned or not (a persistent collective on MPI,
which matches only itself).  The call costs that all-gather (plus the
algorithm for a large allreduce) and about 1.3 us of Python (2 ranks; docs/performance.md).
"""
from __future__ import annotations

import functools

import numpy as np

from commlib.core.agreement import FIELDS
from commlib.core.buffer import grown
from commlib.core.config import config
from commlib.core.errors import BufferError, CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import Deadline, time_left, timeout_problem

from .agreement import check_all
from .first_round import FirstRoundRows, describe_field, first_round, validate
from .ft import run_collective
from .host_plans import HostPlans
from .one_round import reduce_rows, small_capacity
from .snapshot import LazySnapshot
from .specs import SPECS, Call, CollectiveSpec, valid_root
from .staging import Staged, wrap

__all__ = ["Engine", "CollectiveSpec", "SPECS", "HostPlans", "FirstRoundRows", "validate", "first_round",
           "reduce_rows", "small_capacity", "describe_field"]

_ROOT = FIELDS.index("root")
#: operation code -> collective name (a path's mismatch messages name another collective's call)
_OPERATIONS = {spec.code: name for name, spec in SPECS.items()}


class Engine:
    """The collective engine of one communicator, with what it keeps between calls.

    Args:
        comm: the communicator, speaking the protocol of
            :func:`~commlib.collectives.ft.run_collective` (``ft``, ``rank``,
            ``size``, ``collective_transport()``, ``shrink()``), plus
            ``failed_ranks`` and ``transport`` (whose ``native_dtype`` says
            which dtypes the native collectives take).

    Kept: the pinned staging of device buffers (:meth:`staging`), the scratch
    of fault-tolerant snapshots (:meth:`lazy_snapshot`), and the cached plans
    of small host calls (:class:`~.host_plans.HostPlans`) with the kept rows of
    unbounded first rounds (:class:`~.first_round.FirstRoundRows`).
    """

    __slots__ = ("comm", "_staging", "_scratch", "_host", "_plans")

    def __init__(self, comm):
        self.comm = comm
        self._staging = self._scratch = self._host = None
        self._plans = {}

    def plan_cache(self, row: str, make):
        """What a row's path keeps between calls on this group (scratch buffers, a
        cached first round), made by ``make()`` on first use."""
        plans = self._plans.get(row)
        if plans is None:
            plans = self._plans[row] = make()
        return plans

    def staging(self):
        """The communicator's pinned staging buffers for device arrays
        (:class:`~commlib.collectives._device_reduce.StagingCache`, created on first use)."""
        cache = self._staging
        if cache is None:
            from ._device_reduce import StagingCache  # noqa: PLC0415 - numba/CuPy only when device arrays come

            cache = self._staging = StagingCache()
        return cache

    def lazy_snapshot(self, buf: np.ndarray) -> LazySnapshot:
        """A :class:`~commlib.collectives.snapshot.LazySnapshot` of ``buf`` whose copy
        lives in a scratch buffer kept here (grown as needed), so repeated
        fault-tolerant calls do not pay fresh page faults each time."""
        self._scratch = grown(self._scratch, buf.nbytes)
        return LazySnapshot(buf, self._scratch)

    # ------------------------------------------------------------ the general path
    def deadline(self, opname: str, timeout):
        """``(deadline, problem)`` of a call given ``timeout``: the
        :class:`~commlib.core.seconds.Deadline` of the whole call, from now
        (None: no bound), and why ``timeout`` is refused (None when it is valid).

        ``timeout`` None means the communicator's default: a fault-tolerant
        communicator's ``ft.timeout``, else no bound (MPI's semantics).  A
        refused timeout still gives the rank a bound for the first round, in
        which it tells the others (the fault-tolerant timeout, else
        ``COMMLIB_TIMEOUT``), so that it takes the same bounded, point-to-point
        first round as ranks that passed a valid one.
        """
        ft = self.comm.ft
        problem = timeout_problem(timeout)
        if problem is not None:
            return Deadline(ft.timeout if ft is not None else config.timeout, op=opname), problem
        if timeout is None:
            return (Deadline(ft.timeout, op=opname) if ft is not None else None), None
        return Deadline(timeout, op=opname), None

    def execute(self, opname: str, sendbuf=None, recvbuf=None, op="sum", algorithm: str = "auto", root=None, *,
                on_failure: str | None = None, timeout=None, quantize=None):
        """Run one collective: validate, first round, choose, snapshot, run under
        the recovery policy, return.

        Args:
            opname: the collective (a key of :data:`SPECS`).
            sendbuf, recvbuf, op, algorithm, root: the call's arguments as the
                user passed them (bcast's ``buf`` is ``sendbuf``).
            on_failure: overrides the communicator's ``on_failure``.
            timeout: the deadline of the whole call, in seconds (None: the
                communicator's default, :meth:`deadline`): the first round and
                every step of the algorithm wait what is left of it.
            quantize: the wire format of a row's TCP path (the elastic
                all-reduce: None, ``"fp16"``, ``"int8"``).

        A group whose transport carries first rounds on tags of its own
        (``comm.own_first_round``: the elastic peer) runs a row's ``tcp`` path
        where the row has one (:mod:`.allreduce_tcp`): its header, first-round
        strategies and deferred delivery in place of the general ones; such a
        group refuses a member's bad argument itself, before the call.

        Returns:
            What the row's ``deliver`` returns (the result array, ``recvbuf``...).

        Raises:
            InvalidArgument: on every rank, when any rank's arguments (its
                ``timeout`` included) are bad or the ranks' calls differ.
            CommTimeout: ``timeout`` passed before the call completed (naming
                the rank and the operation).
            ProcessFailed: see ``commlib.init``.
        """
        comm, spec = self.comm, SPECS[opname]
        deadline, bad_timeout = self.deadline(opname, timeout)
        c = Call(spec, self, sendbuf, recvbuf, op, algorithm, root)
        path = spec.tcp if getattr(comm, "own_first_round", False) else None
        if path is not None:  # the row's path on a transport with first-round tags of its own
            if bad_timeout is not None:
                raise InvalidArgument(bad_timeout, rank=c.rank, op=opname)
            c.quantize, c.operations = quantize, _OPERATIONS
            c.header = path.prepare(c)
            return path.deliver(c, run_collective(comm, opname, functools.partial(path.attempt, c), c.restore,
                                                  on_failure, deadline))
        values, local_error = validate(c)
        if bad_timeout is not None and local_error is None:
            values, local_error = [0] * len(FIELDS), InvalidArgument(bad_timeout, rank=c.rank, op=opname)
        payload = c.payload
        # a group whose recovery needs every call agreed (the elastic group: ``always_agree``) runs the first
        # round whatever COMMLIB_CHECK_ARGS says
        check = (payload is not None or local_error is not None or config.check_args
                 or getattr(comm, "always_agree", False))
        root_rank = c.root_rank

        def attempt(tp, timeout, survivors):
            v = values
            if root_rank is not None and local_error is None:
                if root_rank not in survivors:  # not a failure to recover from: every survivor raises
                    raise _RootLost(f"{opname} root {root_rank} failed", rank=tp.rank, op=opname)
                v = values[:_ROOT] + [survivors.index(root_rank)] + values[_ROOT + 1:]
            rows = None
            if tp.size > 1 and check:
                kept = None
                if timeout is None and tp.first_round_tags is None and tp.has_native("allgather"):
                    kept = self.first_round_rows(tp)  # the group's unbounded first rounds: one all-gather
                rows = first_round(tp, opname, v, local_error, payload, timeout, kept)
                c.agreed = True  # every rank entered the call (a barrier's first round is its barrier)
            elif local_error is not None:
                raise local_error
            elif payload is not None:  # one rank: its own payload is the result
                rows = payload.view(np.uint8).reshape(1, -1)
            if not c.staged:  # once per call: the views the path runs on, and its snapshot
                if spec.stage is not None:
                    spec.stage(c, payload is not None)
                # a snapshot where an error can stop the call midway: fault-tolerant mode (a retry), and a
                # plain call with a deadline (its CommTimeout must leave the input as it was)
                if spec.snapshot is not None and (c.ft or deadline is not None):
                    c.snapshot = spec.snapshot(c)
                c.staged = True
            if payload is not None:
                return spec.one_round.finish(c, tp, rows, survivors)
            return c.run(tp, timeout, survivors)

        try:
            result = run_collective(comm, opname, attempt, c.restore, on_failure, deadline)
        except _RootLost:
            raise ProcessFailed(f"{opname} root {root_rank} failed; no survivor holds its data",
                                failed=comm.failed_ranks, rank=comm.rank, op=opname) from None
        except CommTimeout as exc:
            if comm.ft is None:  # no recovery policy put the input back: the call's snapshot does
                c.restore()
            if comm.ft is not None or deadline is None or exc.op == opname:
                raise  # named the call already (the recovery policy, or a wait under the call's deadline)
            # a plain communicator: the call's deadline passed (its requests stay posted)
            raise CommTimeout(f"not complete within its timeout of {deadline.timeout:g} s (the deadline of the "
                              f"whole call; {exc.detail}{' in ' + exc.op if exc.op and exc.op != opname else ''})",
                              rank=comm.rank, op=opname) from exc
        return spec.deliver(c, result)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, opname: str = "sendrecv_resilient"):
        """One exchange with ``dest``/``source`` as a fault-tolerant step every
        rank takes: a flag per rank agreed first (a bad argument anywhere is
        refused on every rank, before any byte moves), then the exchange on the
        collective transport with bounded waits, under the recovery policy
        with ``on_failure="raise"`` (not retried: ``dest``/``source`` name
        other ranks after a shrink).  Returns ``recvbuf``.

        Raises:
            InvalidArgument: on every rank, when any rank's arguments are bad.
            ProcessFailed / CommTimeout: a failure (after recovery, on every survivor).
        """
        comm = self.comm
        rank, size = comm.rank, comm.size
        problem = src = dst = None
        try:
            sb = wrap(sendbuf, opname, "sendbuf", rank)
            rb = wrap(recvbuf, opname, "recvbuf", rank, written="what it receives")
            for peer, what in ((dest, "dest"), (source, "source")):
                if isinstance(peer, bool) or not valid_root(peer, size):
                    raise InvalidArgument(f"{what} {peer!r} out of range [0, {size})", rank=rank, op=opname)
            src, dst = Staged(sb, self.staging, "src"), Staged(rb, self.staging, "dst", down=False)
        except (InvalidArgument, BufferError) as exc:
            problem = exc.detail

        def attempt(tp, timeout, survivors):
            # every rank raises alike, before any byte moves (one flag per rank)
            check_all(tp, problem, opname, timeout=timeout)
            tag = tp.tags.slot()
            tp.waitall([tp.irecv(dst.host, int(source), tag), tp.isend(src.host, int(dest), tag)], time_left(timeout),
                       op=opname)

        run_collective(comm, opname, attempt, on_failure="raise")
        dst.flush()
        return recvbuf

    # -------------------------------------------------------------- the hot path
    def first_round_rows(self, tp) -> FirstRoundRows:
        """The kept rows of ``tp``'s unbounded first rounds (:class:`~.first_round.FirstRoundRows`),
        made at the first one (the same call on every rank)."""
        kept = self._plans.get("first_round")
        if kept is None or kept.tp is not tp:
            kept = self._plans["first_round"] = FirstRoundRows(tp)
        return kept

    def host_plans(self) -> HostPlans:
        """The plans of small host calls (:class:`~.host_plans.HostPlans`), made on first use."""
        plans = self._host
        if plans is None or plans.tp is not self.comm.collective_transport():
            plans = self._host = HostPlans(self, self.comm.collective_transport())
        return plans

    def allreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto", timeout=None):
        """:meth:`execute` of an allreduce; exact numpy arrays outside
        fault-tolerant mode and without a ``timeout`` run from a cached plan
        (:class:`~.host_plans.HostPlans`), with the same messages and bits."""
        if (timeout is None and type(sendbuf) is np.ndarray and (recvbuf is None or type(recvbuf) is np.ndarray)
                and self.comm.ft is None):
            done = (self._host or self.host_plans()).allreduce(sendbuf, recvbuf, op, algorithm)
            if done is not None:
                return done
        return self.execute("allreduce", sendbuf, recvbuf, op, algorithm, timeout=timeout)

    def bcast(self, buf, root=0, algorithm: str = "auto", timeout=None):
        """:meth:`execute` of a broadcast; a small exact numpy array outside
        fault-tolerant mode and without a ``timeout`` from a cached plan."""
        if timeout is None and type(buf) is np.ndarray and self.comm.ft is None:
            if (self._host or self.host_plans()).bcast(buf, root, algorithm):
                return buf
        return self.execute("bcast", buf, root=root, algorithm=algorithm, timeout=timeout)

    def barrier(self, algorithm: str = "auto", timeout=None) -> None:
        """:meth:`execute` of a barrier; outside fault-tolerant mode and without
        a ``timeout`` from a plan kept per algorithm, with the same messages."""
        if timeout is None and self.comm.ft is None and (self._host or self.host_plans()).barrier(algorithm):
            return
        self.execute("barrier", algorithm=algorithm, timeout=timeout)


class _RootLost(CommError):
    """The root of a rooted collective is among the failed ranks (internal).
    Every survivor finds it alike (``agreed``): a recovery policy decides the
    call with it at once, as an argument error, instead of retrying."""

    agreed = True
