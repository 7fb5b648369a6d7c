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
   **snapshot** an input the algorithm overwrites (fault-tolerant mode);
5. **run** it over the transport under the recovery policy
   (:func:`commlib.collectives.ft.run_collective`: bounded waits, and under
   ULFM revoke/agree/shrink/retry, the snapshot restored before each retry);
6. **return** what the row's ``deliver`` makes of the result.

``COMMLIB_CHECK_ARGS=0`` skips the first round of large calls (small calls
keep it: it carries their data).

The one hot path, an allreduce of host numpy arrays outside fault-tolerant
mode, runs from a plan the engine caches per (dtype, count, op, algorithm)
(:class:`HostAllreduce`): the row its first round sends is the one
:func:`first_round` sends for the same call (both encode it with
:func:`~.agreement.encode_row`, the plan once, from the row's own ``prepare``), so the call costs one native
all-gather (plus the algorithm for a large call) and a few microseconds of
Python, with no per-call staging objects.  A barrier outside fault-tolerant
mode runs from a plan kept there too (:meth:`HostAllreduce.barrier`): its
first round (the argument agreement, itself a barrier) in the same kept rows.
"""
from __future__ import annotations

import functools

import numpy as np

from commlib.core.agreement import FIELDS
from commlib.core.buffer import grown
from commlib.core.config import config
from commlib.core.errors import BufferError, CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import Deadline, time_left, timeout_problem

from . import ops
from .agreement import agree, agree_on_own_tags, check_all, encode_row, judge
from .allreduce_ring import allreduce_ring, ring_scratch
from .barrier import barrier_dissemination
from .ft import run_collective
from .one_round import SMALL, apply_steps, reduce_rows, ring_order_steps, small_capacity
from .snapshot import LazySnapshot
from .specs import SPECS, Call, CollectiveSpec, valid_root
from .staging import Staged, wrap

__all__ = ["Engine", "CollectiveSpec", "SPECS", "HostAllreduce", "validate", "first_round",
           "reduce_rows", "small_capacity", "describe_field"]

_ROOT = FIELDS.index("root")
#: operation code -> collective name (a path's mismatch messages name another collective's call)
_OPERATIONS = {spec.code: name for name, spec in SPECS.items()}


def describe_field(opname: str):
    """A formatter for mismatch messages: header codes shown as the user wrote them."""
    spec = SPECS[opname]

    def describe(name: str, value: int):
        if name == "operation":
            return next((k for k, v in SPECS.items() if v.code == value), value)
        if name == "algorithm":
            if value == SMALL and spec.small:
                return "auto (one round)"
            return spec.algorithms[value - 1] if 0 < value <= len(spec.algorithms) else value
        if name == "op":
            return next((o.name for o in ops.OPS.values() if o.code == value), value)
        if name == "dtype":
            return ops.dtype_name(value)
        return value

    return describe


def first_round(transport, opname: str, values, local_error: CommError | None, payload: np.ndarray | None,
                timeout: float | None):
    """The first round of a collective: :func:`~commlib.collectives.agreement.agree`
    on the call's header, with room for :func:`~.one_round.small_capacity` payload bytes.

    Args:
        transport: the group's transport.
        opname: the operation.
        values: this rank's header (ints in :data:`commlib.core.agreement.FIELDS` order).
        local_error: this rank's argument error, or None.
        payload: 1-D host array whose bytes ride along, or None.
        timeout: the call's :class:`~commlib.core.seconds.Deadline` (every wait
            waits what is left of it), or None (unbounded; the native all-gather).

    Returns:
        np.ndarray: the gathered payloads, uint8, shape ``(size, capacity)``.

    A transport with first-round tags of its own (``first_round_tags``: the
    elastic group's TCP transport) runs it on them
    (:func:`~.agreement.agree_on_own_tags`), counted apart from the data plane.

    Raises:
        CommError: ``local_error`` on its rank, ``InvalidArgument`` on the others;
            ``InvalidArgument`` everywhere when the headers differ.
        ProcessFailed / CommTimeout: from the transport.
    """
    if getattr(transport, "first_round_tags", None) is not None:  # first rounds counted apart (the TCP transport)
        return agree_on_own_tags(transport, values, op=opname, local_error=local_error, payload=payload,
                                 capacity=small_capacity(transport.size), timeout=timeout,
                                 describe=describe_field(opname))
    return agree(transport, values, op=opname, local_error=local_error, payload=payload,
                 capacity=small_capacity(transport.size), timeout=timeout, describe=describe_field(opname))


def validate(c: Call):
    """Step 1 for call ``c``: the row's ``prepare``, then the one-round payload
    when the call is small.

    Returns:
        ``(values, local_error)``: the header as ints in
        :data:`~commlib.core.agreement.FIELDS` order (``algorithm`` 0 for a
        small call) and this rank's argument error (an InvalidArgument; a
        BufferError becomes one), or None.  ``c.payload`` is set.
    """
    spec = c.spec
    try:
        header = spec.prepare(c)
        c.payload = spec.one_round.payload(c) if spec.one_round is not None else None
        if c.payload is not None:
            header["algorithm"] = SMALL
        return spec.values(header), None
    except InvalidArgument as exc:
        return [0] * len(FIELDS), exc
    except BufferError as exc:
        return [0] * len(FIELDS), InvalidArgument(exc.detail, rank=c.rank, op=spec.name)


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
    of host allreduces (:class:`HostAllreduce`).
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
                rows = first_round(tp, opname, v, local_error, payload, timeout)
                c.agreed = True  # every rank entered the call (a barrier's first round is its barrier)
            elif local_error is not None:
                raise local_error
            elif payload is not None:  # one rank: its own payload is the result
                rows = payload.view(np.uint8).reshape(1, -1)
            if not c.staged:  # once per call: the views the path runs on, and its snapshot
                if spec.stage is not None:
                    spec.stage(c, payload is not None)
                if spec.snapshot is not None and c.ft:
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
    def allreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto", timeout=None):
        """:meth:`execute` of an allreduce; exact numpy arrays outside
        fault-tolerant mode and without a ``timeout`` run from the cached plan
        (:class:`HostAllreduce`), with the same messages and bits."""
        if (timeout is None and type(sendbuf) is np.ndarray and (recvbuf is None or type(recvbuf) is np.ndarray)
                and self.comm.ft is None):
            host = self._host
            if host is None:
                host = self._host = HostAllreduce(self.comm.collective_transport(), engine=self)
            done = host.allreduce(sendbuf, recvbuf, op, algorithm)
            if done is not None:
                return done
        return self.execute("allreduce", sendbuf, recvbuf, op, algorithm, timeout=timeout)

    def barrier(self, algorithm: str = "auto", timeout=None) -> None:
        """:meth:`execute` of a barrier; outside fault-tolerant mode and without
        a ``timeout`` from a plan kept per algorithm (:meth:`HostAllreduce.barrier`),
        with the same messages."""
        if timeout is None and self.comm.ft is None:
            host = self._host
            if host is None:
                host = self._host = HostAllreduce(self.comm.collective_transport(), engine=self)
            if host.barrier(algorithm):
                return
        self.execute("barrier", algorithm=algorithm, timeout=timeout)


class _RootLost(CommError):
    """The root of a rooted collective is among the failed ranks (internal).
    Every survivor finds it alike (``agreed``): a recovery policy decides the
    call with it at once, as an argument error, instead of retrying."""

    agreed = True


class HostAllreduce:
    """The engine's cached plans for allreduce of host numpy arrays (and for
    the barrier, :meth:`barrier`) on one transport.

    A plan is made once per (dtype, count, op) for a one-round small call, or
    (dtype, count, op, algorithm) for a large call that resolves to the ring
    or recursive doubling, by the general path's own steps: the allreduce
    row's ``prepare`` and one-round test give the header, and
    :func:`~.agreement.encode_row` encodes the row, as :func:`first_round` does.
    A call then copies its payload into the kept row, makes one native
    all-gather into the kept ``rows``, checks every rank's header against its
    own (bytes; :func:`~.agreement.judge` raises on every rank alike when one
    differs), and either combines the payloads in the ring's order (views kept
    in the plan: :func:`~.one_round.ring_order_steps`) or runs the row's
    algorithm function on the arrays themselves.  Same messages and bits as
    :meth:`Engine.execute`; on a 2-core machine the general path's per-call
    staging and bookkeeping took ~30 us a call, 15% of a 1 MiB ring at 2 ranks
    and 70-90% of a 2-32 KiB recursive doubling (benchmarks/bench_allreduce.py).

    Args:
        tp: the collective transport.
        cap: payload bytes per row; must be ``small_capacity(tp.size)`` (default).
        engine: the :class:`Engine` whose ``prepare`` calls build the plans
            (None: one of its own over a stand-in communicator of ``tp``).
    """

    __slots__ = ("tp", "cap", "engine", "head", "row", "rows", "heads", "plans", "large_plans", "current", "scratch")

    def __init__(self, tp, cap: int | None = None, *, engine: Engine | None = None):
        if cap is not None and cap != small_capacity(tp.size):
            raise ValueError(f"cap {cap} is not the first round's capacity {small_capacity(tp.size)}")
        self.tp, self.cap = tp, small_capacity(tp.size)
        self.engine = engine if engine is not None else Engine(_TransportComm(tp))
        self.head = self.row = self.rows = self.heads = None
        self.plans: dict = {}
        self.large_plans: dict = {}
        self.current = None
        self.scratch = None  # the in-place ring's receive scratch, kept (allreduce_ring.ring_scratch)

    def allreduce(self, sendbuf: np.ndarray, recvbuf, op, algorithm: str = "auto"):
        """Allreduce exact numpy arrays from a plan; None when the call does not
        qualify (not C-contiguous, a ``recvbuf`` that does not match, an
        algorithm without a host function, a bad argument: the general path
        then runs it, and raises any argument error on every rank)."""
        large = sendbuf.nbytes > self.cap or algorithm != "auto"
        if large and algorithm not in ("auto", "ring", "recursive_doubling"):
            return None
        out = sendbuf if recvbuf is None else recvbuf
        # the result goes into out (in place: sendbuf).  A read-only out is checked
        # here on every call, not by the plan (kept per dtype, count, op, not per
        # buffer): the general path refuses it, on every rank, before any byte moves
        if not (sendbuf.flags.c_contiguous and out.flags.writeable) or (
                out is not sendbuf and not (
                    out.flags.c_contiguous and out.dtype == sendbuf.dtype and out.size == sendbuf.size)):
            return None
        if type(op) is not str:  # an MPI.Op (unhashable) or an Op: key by name
            try:
                op = ops.get_op(op, opname="allreduce").name
            except InvalidArgument:
                return None
        if large:
            plan = self.large_plans.get((sendbuf.dtype, sendbuf.size, op, algorithm))
            if plan is None:
                plan = self.large_plan(sendbuf, op, algorithm, out)
            if not plan:
                return None
            self.run_large(plan, sendbuf, out)
            return out
        plan = self.plans.get((sendbuf.dtype, sendbuf.size, op))
        if plan is None:
            plan = self.plan(sendbuf, op, out)
            if plan is None:
                return None
        self.run(plan, sendbuf, out)
        return out

    # ------------------------------------------------------------------ plans
    def _header(self, sendbuf: np.ndarray, op, algorithm: str, out: np.ndarray | None = None):
        """``(header bytes, Call)`` of this call as the general path encodes
        it (the row's ``prepare`` and one-round test, then :func:`first_round`),
        into ``out`` (None or ``sendbuf``: in place; the header is the same
        either way); None when an argument is bad."""
        return self._encode(Call(SPECS["allreduce"], self.engine, sendbuf, None if out is sendbuf else out, op,
                                 algorithm))

    def _encode(self, c: Call):
        """``(header bytes, c)`` of call ``c`` as :func:`first_round` encodes it
        (after :func:`validate`); None when an argument is bad."""
        values, err = validate(c)
        if err is not None:
            return None
        n = self.tp.size
        if n == 1:
            return b"", c
        row = encode_row(values, capacity=self.cap)  # first_round's row of this call
        if self.row is None:  # the kept row and rows, shaped as first_round's
            self.head = row.size - self.cap
            self.row = np.zeros_like(row)
            self.rows = np.zeros((n, row.size), np.uint8)
            mv, rb = memoryview(self.rows).cast("B"), row.size
            self.heads = [mv[i * rb:i * rb + self.head] for i in range(n)]  # each rank's header, as received
        return row[:self.head].tobytes(), c

    @staticmethod
    def _keep(cache: dict, key, plan) -> None:
        if len(cache) >= 64:
            cache.pop(next(iter(cache)))
        cache[key] = plan

    def plan(self, sendbuf: np.ndarray, op, out: np.ndarray | None = None):
        """The one-round plan of ``sendbuf``'s (dtype, count) and ``op`` (a
        name): ``(header bytes, Op, payload view of the kept row, ring-order
        steps over views of the kept rows, payload bytes)``; None when the
        call (result into ``out``, None: in place) is not a one-round call or
        an argument is bad."""
        made = self._header(sendbuf, op, "auto", out)
        if made is None or made[1].payload is None:
            return None
        hbytes, c = made
        dtype, count, nb = sendbuf.dtype, sendbuf.size, sendbuf.nbytes
        if self.tp.size == 1:
            payload, steps = None, []
        else:
            h = self.head
            parts = [self.rows[i, h:h + nb].view(dtype) for i in range(self.tp.size)]
            payload, steps = memoryview(self.row[h:h + nb]), ring_order_steps(parts, count, c.o)
        plan = (hbytes, c.o, payload, steps, nb)
        self._keep(self.plans, (dtype, count, op), plan)
        return plan

    def large_plan(self, sendbuf: np.ndarray, op, algorithm: str, out: np.ndarray | None = None):
        """``(header bytes, Op, algorithm function)`` for a call (result into
        ``out``, None: in place) that ``algorithm`` resolves to an algorithm
        with a host function (the ring, recursive doubling) above the one-round
        capacity; False otherwise, or when an argument is bad (the general path
        raises it, on every rank).  Cached in :attr:`large_plans` under
        ``(dtype, count, op, algorithm)``."""
        made = self._header(sendbuf, op, algorithm, out)
        plan = False
        if made is not None and made[1].payload is None:
            hbytes, c = made
            fn = SPECS["allreduce"].impl[c.algo].host
            if fn is not None:
                plan = (hbytes, c.o, fn)
        self._keep(self.large_plans, (sendbuf.dtype, sendbuf.size, op, algorithm), plan)
        return plan

    # ------------------------------------------------------------------- runs
    def run(self, plan, sendbuf: np.ndarray, out: np.ndarray) -> None:
        """A one-round call: the first round, then the ring-order combination into ``out``."""
        # the hot path of every small host allreduce (a few microseconds of Python
        # around one MPI_Allgather): _gather_rows and apply_steps are inlined
        hbytes, o, payload, steps, nb = plan
        tp, n = self.tp, self.tp.size
        if n == 1:
            if out is not sendbuf:
                out[...] = sendbuf
            return
        if self.current is not plan:
            self.row[:self.head] = np.frombuffer(hbytes, np.uint8)
            self.current = plan
        if nb:
            try:
                payload[:] = sendbuf.data.cast("B")
            except (ValueError, TypeError):  # dtypes without a buffer format (bfloat16)
                np.frombuffer(payload, np.uint8)[...] = sendbuf.reshape(-1).view(np.uint8)
        tp.native_allgather(self.row, self.rows)
        for h in self.heads:
            if h.tobytes() != hbytes:
                self._judge(tp, hbytes)
        flat = out if out.ndim == 1 else out.reshape(-1)
        if len(steps) == 1 and len(steps[0][2]) == 2 and steps[0][1] - steps[0][0] == flat.shape[0]:
            a, b = steps[0][2]
            o.ufunc(a, b, out=flat)  # 2 ranks, a commutative op: one call (ring_order_steps)
        else:
            apply_steps(steps, o.ufunc, flat)
        if o.mean:
            o.finalize(flat, n)

    def _gather_rows(self, tp, hbytes: bytes, opname: str = "allreduce") -> None:
        """The first round: all-gather every rank's row (header ``hbytes``, then
        the payload); a header that differs from this rank's (another call, or a
        rank that erred) makes :func:`judge` raise, on every rank alike."""
        tp.native_allgather(self.row, self.rows)
        for h in self.heads:
            if h.tobytes() != hbytes:  # tobytes: faster than comparing views
                self._judge(tp, hbytes, opname)

    def _judge(self, tp, hbytes: bytes, opname: str = "allreduce") -> None:
        """A header differs from this rank's: :func:`judge` raises, on every rank alike."""
        judge(tp, self.rows[:, :self.head], np.frombuffer(hbytes, np.int64)[1:].tolist(), op=opname,
              describe=describe_field(opname))

    def barrier(self, algorithm) -> bool:
        """A barrier from a plan kept per ``algorithm``: the first round (the
        barrier's own row, in the kept row and rows; it is itself a barrier),
        then ``MPI_Barrier`` for ``"mpi"``; without the first round
        (``COMMLIB_CHECK_ARGS=0``) the dissemination barrier.  False when
        ``algorithm`` is bad (not a string, or not a barrier's): the general
        path refuses it, on every rank."""
        if type(algorithm) is not str:
            return False
        key = ("barrier", algorithm)
        plan = self.plans.get(key)
        if plan is None:
            made = self._encode(Call(SPECS["barrier"], self.engine, algorithm=algorithm))
            if made is None:
                return False
            plan = (made[0], made[1].algo)
            self._keep(self.plans, key, plan)
        hbytes, algo = plan
        tp = self.tp
        if tp.size > 1:
            if config.check_args:
                if self.current is not plan:
                    self.row[:self.head] = np.frombuffer(hbytes, np.uint8)
                    self.current = plan
                self._gather_rows(tp, hbytes, "barrier")
            elif algo == "dissemination":
                barrier_dissemination(tp)
        if algo == "mpi":
            tp.native_barrier()
        return True

    def run_large(self, plan, sendbuf: np.ndarray, out: np.ndarray) -> None:
        """The first round (when ``COMMLIB_CHECK_ARGS``), then the plan's
        algorithm (:func:`.allreduce_ring` or
        :func:`.allreduce_recursive_doubling`) on C-contiguous host arrays
        (``out is sendbuf``: in place)."""
        hbytes, o, fn = plan
        tp, n = self.tp, self.tp.size
        if n > 1 and config.check_args:
            if self.current is not plan:
                self.row[:self.head] = np.frombuffer(hbytes, np.uint8)
                self.current = plan
            self._gather_rows(tp, hbytes)
        work = out if out.ndim == 1 else out.reshape(-1)
        src = None if out is sendbuf else (sendbuf if sendbuf.ndim == 1 else sendbuf.reshape(-1))
        if fn is allreduce_ring:
            tmp = None
            if src is None:  # in place: the partials need a receive scratch, kept between calls
                self.scratch, tmp = ring_scratch(self.scratch, work, n)
            allreduce_ring(tp, work, o, sendbuf=src, tmp=tmp)
        else:
            fn(tp, work, o, sendbuf=src)


class _TransportComm:
    """The little of a communicator a :class:`HostAllreduce` made without an
    :class:`Engine` needs to build plans: the group of one transport, not fault tolerant."""

    ft = None

    def __init__(self, tp):
        self.transport = tp

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size
