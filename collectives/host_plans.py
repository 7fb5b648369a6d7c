"""The engine's cached plans for small collectives of host numpy arrays.

The one hot path of the engine: an allreduce, a broadcast or a barrier of
exact numpy arrays outside fault-tolerant mode and without a ``timeout``
(:meth:`~.engine.Engine.allreduce`, ``bcast``, ``barrier``).  A plan is made
once per call shape, keyed by the row of :data:`~.specs.SPECS` and the call's
shape (``("allreduce", dtype, count, op)``, ``("bcast", dtype, count, root, algorithm)``,
``("barrier", algorithm)``, and for a large allreduce ``("allreduce", dtype,
count, op, algorithm)``), by the general path's own steps: the row's
``prepare`` and one-round test give the header (:func:`~.first_round.validate`)
and :func:`~.agreement.encode_row` encodes it, as :func:`~.first_round.first_round`
does.  A call then writes its payload into the group's kept row
(:class:`~.first_round.FirstRoundRows`, shared with the general path), runs the
kept all-gather (a persistent collective on MPI), checks every rank's header
against its own (bytes; :func:`~.agreement.judge` raises on every rank alike
when one differs) and finishes from the gathered rows: the ring-order
combination (views kept in the plan: :func:`~.one_round.ring_order_steps`), the
root's payload, nothing (a barrier); or, for a large allreduce, the row's
algorithm function on the arrays themselves.  Same first-round messages and
result bits as :meth:`~.engine.Engine.execute` (a broadcast's non-root rows
carry a payload nobody reads: the plan leaves it as it was).

On a 2-core machine the general path's per-call staging and bookkeeping took
~30 us a call, 15% of a 1 MiB ring at 2 ranks and 70-90% of a 2-32 KiB
recursive doubling; a planned 8-byte allreduce at 2 ranks costs the all-gather
(0.74 us) and about 1.3 us of Python (benchmarks/bench_small.py; docs/performance.md).
"""
from __future__ import annotations

import numpy as np

from commlib.core.config import config
from commlib.core.errors import InvalidArgument

from . import ops
from .agreement import encode_row, judge
from .allreduce_ring import allreduce_ring, ring_scratch
from .barrier import barrier_dissemination
from .bcast_binomial import bcast_binomial
from .first_round import describe_field, validate
from .one_round import apply_steps, ring_order_steps
from .specs import SPECS, Call, valid_root

__all__ = ["HostPlans"]

#: plans kept per row (a program uses a handful of shapes); the oldest goes first
PLANS_MAX = 64


class HostPlans:
    """The host plans of one engine's collective transport.

    Args:
        engine: the :class:`~.engine.Engine` whose ``prepare`` calls build the
            plans; its transport's :class:`~.first_round.FirstRoundRows` (made
            on first use, ``engine.first_round_rows(tp)``) hold the rows.
        tp: the collective transport.
    """

    __slots__ = ("tp", "engine", "kept", "plans", "scratch")

    def __init__(self, engine, tp):
        self.tp, self.engine = tp, engine
        self.kept = engine.first_round_rows(tp) if tp.size > 1 else None
        self.plans: dict = {}
        self.scratch = None  # the in-place ring's receive scratch, kept (allreduce_ring.ring_scratch)

    # ------------------------------------------------------------ allreduce
    def allreduce(self, sendbuf: np.ndarray, recvbuf, op, algorithm: str = "auto"):
        """Allreduce exact numpy arrays from a plan; None when the call does not
        qualify (not C-contiguous, a ``recvbuf`` that does not match, an
        algorithm without a host function, a bad argument: the general path
        then runs it, and raises any argument error on every rank)."""
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
        if algorithm == "auto":
            plan = self.plans.get(("allreduce", sendbuf.dtype, sendbuf.size, op))
            if plan is None:
                plan = self._allreduce_plan(sendbuf, op, out)
            if plan:  # one round: _first_round and the combination, inlined (the hot path)
                header, payload, ufunc, two, steps, mean = plan
                k = self.kept
                if k is None:  # one rank
                    if out is not sendbuf:
                        out[...] = sendbuf
                    return out
                if k.current is not plan:
                    k.row[:k.head] = header[0]
                    k.current = plan
                payload[...] = sendbuf if sendbuf.ndim == 1 else sendbuf.reshape(-1)
                k.gather()
                hb = header[1]
                for h in k.heads:
                    if h.tobytes() != hb:  # tobytes: faster than comparing views
                        self._judge(header, "allreduce")
                flat = out if out.ndim == 1 else out.reshape(-1)
                if two is not None:
                    ufunc(two[0], two[1], out=flat)  # out= (positional is deprecated for np.maximum/minimum)
                else:
                    apply_steps(steps, ufunc, flat)
                if mean is not None:
                    mean.finalize(flat, self.tp.size)
                return out
            if plan is None:
                return None
        elif algorithm not in ("ring", "recursive_doubling"):
            return None
        plan = self.plans.get(("allreduce", sendbuf.dtype, sendbuf.size, op, algorithm))
        if plan is None:
            plan = self._large_plan(sendbuf, op, algorithm, out)
        if not plan:
            return None
        self._large(plan, sendbuf, out)
        return out

    def _allreduce_plan(self, sendbuf: np.ndarray, op, out: np.ndarray):
        """The plan of an ``"auto"`` allreduce of ``sendbuf``'s (dtype, count) and
        ``op`` (a name), result into ``out`` (``sendbuf``: in place): for a
        one-round call ``(header, payload view of the kept row, ufunc, the two
        operands of a 2-rank commutative sum or None, ring-order steps, Op)``;
        False for a larger call (the large plans then serve it); None when an
        argument is bad."""
        made = self._encode(Call(SPECS["allreduce"], self.engine, sendbuf, None if out is sendbuf else out, op))
        if made is None:
            return None
        header, c = made
        if c.payload is None:
            plan = False
        else:
            dtype, count, nb = sendbuf.dtype, sendbuf.size, sendbuf.nbytes
            payload, two, steps = None, None, []
            if self.kept is not None:
                k, h = self.kept, self.kept.head
                parts = [k.rows[i, h:h + nb].view(dtype) for i in range(self.tp.size)]
                payload, steps = k.row[h:h + nb].view(dtype), ring_order_steps(parts, count, c.o)
                if len(steps) == 1 and len(steps[0][2]) == 2 and steps[0][1] - steps[0][0] == count:
                    two = steps[0][2]  # 2 ranks, a commutative op: one ufunc call (ring_order_steps)
            plan = (header, payload, c.o.ufunc, two, steps, c.o if c.o.mean else None)
        self._keep(("allreduce", sendbuf.dtype, sendbuf.size, op), plan)
        return plan

    def _large_plan(self, sendbuf: np.ndarray, op, algorithm: str, out: np.ndarray):
        """``(header, Op, algorithm function)`` for a call (result into ``out``)
        that ``algorithm`` resolves to an algorithm with a host function (the
        ring, recursive doubling) above the one-round capacity; False
        otherwise, or when an argument is bad (the general path raises it, on
        every rank)."""
        made = self._encode(Call(SPECS["allreduce"], self.engine, sendbuf, None if out is sendbuf else out, op,
                                 algorithm))
        plan = False
        if made is not None and made[1].payload is None:
            header, c = made
            fn = SPECS["allreduce"].impl[c.algo].host
            if fn is not None:
                plan = (header, c.o, fn)
        self._keep(("allreduce", sendbuf.dtype, sendbuf.size, op, algorithm), plan)
        return plan

    def _large(self, plan, sendbuf: np.ndarray, out: np.ndarray) -> None:
        """The first round (when ``COMMLIB_CHECK_ARGS``), then the plan's
        algorithm (:func:`.allreduce_ring` or
        :func:`.allreduce_recursive_doubling`) on C-contiguous host arrays
        (``out is sendbuf``: in place)."""
        header, o, fn = plan
        tp, n = self.tp, self.tp.size
        if n > 1 and config.check_args:
            self._first_round(plan, header, "allreduce")
        work = out if out.ndim == 1 else out.reshape(-1)
        src = None if out is sendbuf else (sendbuf if sendbuf.ndim == 1 else sendbuf.reshape(-1))
        if fn is allreduce_ring:
            tmp = None
            if src is None:  # in place: the partials need a receive scratch, kept between calls
                self.scratch, tmp = ring_scratch(self.scratch, work, n)
            allreduce_ring(tp, work, o, sendbuf=src, tmp=tmp)
        else:
            fn(tp, work, o, sendbuf=src)

    # ---------------------------------------------------------------- bcast
    def bcast(self, buf: np.ndarray, root, algorithm: str = "auto") -> bool:
        """Broadcast exact numpy array ``buf`` from ``root`` from a plan; False when
        the call does not qualify (an algorithm other than ``"auto"`` or
        ``"binomial"``, not C-contiguous, a read-only ``buf`` off the root, a bad
        argument: the general path then runs it, and refuses a bad argument on
        every rank).  A one-round call takes the root's payload from the
        gathered rows; a larger one runs the first round (when
        ``COMMLIB_CHECK_ARGS``) then the binomial tree on ``buf`` itself."""
        if type(root) is not int or not buf.flags.c_contiguous or type(algorithm) is not str:
            return False
        key = ("bcast", buf.dtype, buf.size, root, algorithm)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._bcast_plan(buf, root, algorithm, key)
        if not plan:
            return False
        header, payload, theirs, mine = plan
        k = self.kept
        if k is None:  # one rank: its buf is the result
            return True
        if not mine and not buf.flags.writeable:
            return False
        if theirs is None:  # above the one-round capacity
            if config.check_args:
                self._first_round(plan, header, "bcast")
            bcast_binomial(self.tp, buf if buf.ndim == 1 else buf.reshape(-1), root)
            return True
        self._first_round(plan, header, "bcast", payload, buf if mine else None)
        if not mine:
            (buf if buf.ndim == 1 else buf.reshape(-1))[...] = theirs
        return True

    def _bcast_plan(self, buf: np.ndarray, root: int, algorithm: str, key):
        """``(header, payload view of the kept row, root's payload in the kept
        rows as buf's dtype, whether this rank is the root)``; for a call above
        the one-round capacity that resolves to the binomial tree the same with
        no payload views (None, None); False when the call does not qualify or
        an argument is bad."""
        plan = False
        if valid_root(root, self.tp.size) and algorithm in ("auto", "binomial"):
            made = self._encode(Call(SPECS["bcast"], self.engine, buf, root=root, algorithm=algorithm))
            if made is not None:
                header, c = made
                mine = root == self.tp.rank
                if c.payload is not None:
                    payload = theirs = None
                    if self.kept is not None:
                        k, h, nb = self.kept, self.kept.head, buf.nbytes
                        payload, theirs = k.row[h:h + nb].view(buf.dtype), k.rows[root, h:h + nb].view(buf.dtype)
                    plan = (header, payload, theirs, mine)
                elif c.algo == "binomial":
                    plan = (header, None, None, mine)
        self._keep(key, plan)
        return plan

    # -------------------------------------------------------------- barrier
    def barrier(self, algorithm) -> bool:
        """A barrier from a plan kept per ``algorithm``: the first round (the
        barrier's own row, in the kept rows; it is itself a barrier), then
        ``MPI_Barrier`` for ``"mpi"``; without the first round
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
            self._keep(key, plan)
        header, algo = plan
        tp = self.tp
        if tp.size > 1:
            if config.check_args:
                self._first_round(plan, header, "barrier")
            elif algo == "dissemination":
                barrier_dissemination(tp)
        if algo == "mpi":
            tp.native_barrier()
        return True

    # -------------------------------------------------------------- helpers
    def _encode(self, c: Call):
        """``((header as uint8 array, as bytes), c)`` of call ``c`` as
        :func:`~.first_round.first_round` encodes it (after
        :func:`~.first_round.validate`); None when an argument is bad."""
        values, err = validate(c)
        if err is not None:
            return None
        if self.kept is None:
            return (None, b""), c
        head = self.kept.head
        row = encode_row(values, capacity=self.kept.cap)  # first_round's row of this call
        return (row[:head].copy(), row[:head].tobytes()), c

    def _keep(self, key, plan) -> None:
        if len(self.plans) >= PLANS_MAX:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = plan

    def _first_round(self, plan, header, opname: str, payload=None, arr: np.ndarray | None = None) -> None:
        """The first round: all-gather every rank's row (``header``, then, when
        ``arr`` is given, its bytes copied into ``payload``, the kept row's
        payload view); a header that differs from this rank's (another call, or
        a rank that erred) makes :func:`~.agreement.judge` raise, on every rank alike."""
        k = self.kept
        if k.current is not plan:
            k.row[:k.head] = header[0]
            k.current = plan
        if arr is not None:  # a copy of the same dtype: the bytes as they are
            payload[...] = arr if arr.ndim == 1 else arr.reshape(-1)
        k.gather()
        hb = header[1]
        for h in k.heads:
            if h.tobytes() != hb:  # tobytes: faster than comparing views
                self._judge(header, opname)

    def _judge(self, header, opname: str) -> None:
        """A header differs from this rank's: :func:`~.agreement.judge` raises, on every rank alike."""
        k = self.kept
        judge(self.tp, k.rows[:, :k.head], np.frombuffer(header[1], np.int64)[1:].tolist(), op=opname,
              describe=describe_field(opname))
