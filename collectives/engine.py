"""The collective engine: one table of collective specifications and the first round every call makes.

Every collective call (``Communicator.allreduce``, ``reduce_scatter``,
``allgather``, ``bcast``, ``alltoall``) runs the same steps:

1. **validate** this rank's arguments locally (never raising yet);
2. **first round**: one all-gather of a fixed-size *row* per rank holding the
   call's header (:mod:`commlib.core.agreement`: error flag, operation, count,
   dtype, op, root, algorithm) and, for a small allreduce / reduce_scatter /
   bcast, the payload itself.  The row has the same size on every rank
   whatever its arguments (:func:`small_capacity` depends on the group size
   only), so ranks whose calls differ
   still make matching calls; every rank reads every header and raises the
   same :class:`~commlib.InvalidArgument` before any payload byte of a large
   call moves;
3. **small calls end here**: the payloads are in the gathered rows and each
   rank reduces them locally in rank order (0, 1, ..., size-1), so every rank
   computes the same bits: one round of messages instead of two;
4. **large calls** choose an algorithm (:data:`SPECS` thresholds) and run it
   over the transport, under fault tolerance (:func:`commlib.collectives.ft.run_collective`).

The first round is the one argument-agreement protocol of
:mod:`commlib.collectives.agreement`, given room for a payload.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from commlib.core.agreement import FIELDS
from commlib.core.config import config
from commlib.core.errors import BufferError, CommError, InvalidArgument, ProcessFailed

from . import ops
from ._common import chunk_bounds_list
from .agreement import agree, judge
from .allreduce_recursive_doubling import allreduce_recursive_doubling
from .allreduce_ring import allreduce_ring, ring_scratch
from .ft import run_collective

__all__ = ["CollectiveSpec", "SPECS", "SmallAllreduce", "execute", "first_round", "reduce_rows", "describe_field"]


@dataclass(frozen=True)
class CollectiveSpec:
    """What the engine knows about one collective.

    Attributes:
        name: the operation (``"allreduce"``...).
        code: its number in the header (``operation`` field).
        algorithms: accepted ``algorithm=`` values; ``"auto"`` first, then the default.
        small: True when a small call travels inside the first round.
        thresholds: ``(max_bytes, algorithm)`` or ``(max_bytes, algorithm,
            min_ranks)`` entries ``"auto"`` picks from, in order (an entry with
            ``min_ranks`` applies on groups of at least that many ranks); the
            default algorithm above them all.
        snapshot: True when fault-tolerant mode must keep the input for a retry
            (the operation overwrites its input in place).
    """

    name: str
    code: int
    algorithms: tuple
    small: bool = False
    thresholds: tuple = field(default_factory=tuple)
    snapshot: bool = False

    def choose(self, algorithm: str, nbytes: int = 0, *, rank=None, nranks: int | None = None) -> str:
        """The algorithm to run for ``algorithm`` (``"auto"`` by size in bytes
        and, where a threshold says so, by ``nranks``, the group's size).

        Raises:
            InvalidArgument: an algorithm this collective does not have.
        """
        if algorithm not in self.algorithms:
            raise InvalidArgument(f"algorithm {algorithm!r} not in {self.algorithms}", rank=rank, op=self.name)
        if algorithm != "auto":
            return algorithm
        for max_bytes, algo, *min_ranks in self.thresholds:
            if nbytes <= max_bytes and (not min_ranks or nranks is None or nranks >= min_ranks[0]):
                return algo
        return self.algorithms[1]

    def algorithm_code(self, algorithm: str) -> int:
        return self.algorithms.index(algorithm) + 1


#: the collectives, their algorithms and "auto" thresholds (allreduce: recursive
#: doubling up to 256 KiB, ring above; measured with benchmarks/bench_allreduce.py
#: at 2 and 4 ranks, shared memory, 2 cores: the two cross between 64 and 256 KiB.
#: At 2 ranks the ring from the one-round capacity on: with both on the host fast
#: path the ring was 0.13-0.93x MPI at 2-128 KiB against recursive doubling's
#: 0.11-0.57x, and the two give the same bits there, every op being commutative)
SPECS = {s.name: s for s in (
    CollectiveSpec("allreduce", 1, ("auto", "ring", "recursive_doubling", "mpi"), small=True,
                   thresholds=((256 * 1024, "recursive_doubling", 3),), snapshot=True),
    CollectiveSpec("reduce_scatter", 2, ("auto", "ring", "mpi"), small=True),
    CollectiveSpec("allgather", 3, ("auto", "ring", "mpi")),
    CollectiveSpec("bcast", 4, ("auto", "binomial", "mpi"), small=True, snapshot=True),
    CollectiveSpec("alltoall", 5, ("auto", "pairwise", "mpi")),
    CollectiveSpec("barrier", 6, ("auto", "dissemination", "mpi")),
)}

#: header code of the one-round small path (``"auto"`` below :func:`small_capacity`)
SMALL = 0
_NFIELDS = len(FIELDS)
_HEAD = 8 * (1 + _NFIELDS)  # bytes: error flag + fields, int64


def small_capacity(size: int) -> int:
    """Payload bytes a first-round row carries on a group of ``size`` ranks:
    ``COMMLIB_SMALL_BYTES``, capped so that a row gathered from every rank stays
    within 64 KiB (the first round must stay cheap for large calls too)."""
    return max(0, min(config.small_bytes, 65536 // max(size, 1) - _HEAD)) // 8 * 8


def describe_field(opname: str):
    """A formatter for mismatch messages: header codes shown as the user wrote them."""
    spec = SPECS[opname]

    def describe(name: str, value: int):
        if name == "operation":
            return next((k for k, v in SPECS.items() if v.code == value), value)
        if name == "algorithm":
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
    on the call's header, with room for :func:`small_capacity` payload bytes.

    Args:
        transport: the group's transport.
        opname: the operation.
        values: this rank's header (ints in :data:`commlib.core.agreement.FIELDS` order).
        local_error: this rank's argument error, or None.
        payload: 1-D host array whose bytes ride along, or None.
        timeout: seconds each wait may take (None: unbounded; native all-gather).

    Returns:
        np.ndarray: the gathered payloads, uint8, shape ``(size, capacity)``.

    Raises:
        CommError: ``local_error`` on its rank, ``InvalidArgument`` on the others;
            ``InvalidArgument`` everywhere when the headers differ.
        ProcessFailed / CommTimeout: from the transport.
    """
    return agree(transport, values, op=opname, local_error=local_error, payload=payload,
                 capacity=small_capacity(transport.size), timeout=timeout, describe=describe_field(opname))


def execute(comm, opname, prepare, run, *, small=None, restore=None, on_failure=None, root=None):
    """The engine: validate, agree, stage, run one collective under fault tolerance, return.

    Args:
        comm: the communicator, speaking the protocol of :func:`run_collective`
            (``ft``, ``rank``, ``size``, ``collective_transport()``, ``shrink()``)
            and ``failed_ranks``.
        opname: the operation.
        prepare: ``prepare()`` validates this rank's arguments and returns its
            header (a dict over :data:`commlib.core.agreement.FIELDS`);
            raises InvalidArgument / BufferError on a bad argument.  Every
            rank then raises alike, in the first round.
        run: ``run(tp, timeout, survivors, rows)`` finishes the call after
            the first round; ``rows`` holds the gathered payloads of a
            small call (None for a large one).
        small: ``small()`` after ``prepare``: the 1-D host array to carry
            in the first round (a small call), or None.
        restore: restores in-place input before a retry (fault tolerance).
        on_failure: overrides the communicator's ``on_failure``.
        root: the call's root (bcast): the header carries its rank in the
            current, possibly shrunk, group.

    Raises:
        InvalidArgument: on every rank, when any rank's arguments are bad
            or the ranks' calls differ.
        ProcessFailed / CommTimeout: see ``commlib.init``.
    """
    local_error = None
    values = [0] * 6
    payload = None
    try:
        header = prepare()
        payload = small() if small is not None else None
        if payload is not None:
            header["algorithm"] = SMALL
        values = [int(header.get(k, 0)) for k in FIELDS]
    except InvalidArgument as exc:
        local_error = exc
    except BufferError as exc:
        local_error = InvalidArgument(exc.detail, rank=comm.rank, op=opname)
    check = payload is not None or local_error is not None or config.check_args

    def attempt(tp, timeout, survivors):
        v = values
        if root is not None and local_error is None:
            if root not in survivors:  # not a failure to recover from: every survivor raises
                raise _RootLost(f"{opname} root {root} failed", rank=tp.rank, op=opname)
            v = values[:4] + [survivors.index(root)] + values[5:]
        rows = None
        if tp.size > 1 and check:
            rows = first_round(tp, opname, v, local_error, payload, timeout)
        elif local_error is not None:
            raise local_error
        elif payload is not None:  # one rank: its own payload is the result
            rows = payload.view(np.uint8).reshape(1, -1)
        return run(tp, timeout, survivors, rows if payload is not None else None)

    try:
        return run_collective(comm, opname, attempt, restore, on_failure)
    except _RootLost:
        raise ProcessFailed(f"{opname} root {root} failed; no survivor holds its data",
                            failed=comm.failed_ranks, rank=comm.rank, op=opname) from None


class _RootLost(CommError):
    """The root of a rooted collective is among the failed ranks (internal)."""


def ring_order_steps(parts: list, count: int, op) -> list:
    """The ring's reduction order over per-rank operands, as steps for :func:`apply_steps`.

    Element ``j`` of chunk ``c`` (``chunk_bounds(count, size)``) combines the
    ranks in :func:`~commlib.collectives.reduce_scatter_ring.ring_order` ``(c)``
    (``c+1, c+2, ...`` mod size), the order the ring allreduce and
    reduce_scatter use, so a one-round call and a ring call of the same data
    give the same bits.

    Args:
        parts: one 1-D array of ``count`` elements per rank, in rank order.
        count: elements per rank.
        op: an :class:`~commlib.collectives.ops.Op`.

    Returns:
        list of ``(lo, hi, operands)``: elements ``[lo, hi)`` combine ``operands`` left to right.
    """
    n = len(parts)
    if n == 2 and op.name in _COMMUTATIVE:
        # ring order at 2 ranks is (1, 0) for chunk 0 and (0, 1) for chunk 1;
        # IEEE 754 + and *, and the bitwise ops, are exactly commutative, so
        # one call over the whole vector gives the ring's bits
        return [(0, count, parts)]
    b = chunk_bounds_list(count, n)
    return [(b[c], b[c + 1], [parts[(c + 1 + k) % n][b[c]:b[c + 1]] for k in range(n)])
            for c in range(n) if b[c + 1] > b[c]]


def apply_steps(steps: list, ufunc, out: np.ndarray) -> None:
    """Combine each step's operands left to right with ``ufunc`` into ``out[lo:hi]`` (1-D)."""
    if len(steps) == 1 and len(steps[0][2]) == 2:  # the 2-rank commutative case: one call
        lo, hi, (a, b) = steps[0]
        ufunc(a, b, out=out if hi - lo == out.shape[0] else out[lo:hi])
        return
    whole = out.shape[0]
    for lo, hi, operands in steps:
        dst = out if hi - lo == whole else out[lo:hi]
        if len(operands) == 1:
            dst[...] = operands[0]
            continue
        ufunc(operands[0], operands[1], out=dst)
        for p in operands[2:]:
            ufunc(dst, p, out=dst)


def reduce_rows(payloads: np.ndarray, dtype, count: int, op, out: np.ndarray) -> None:
    """Reduce the ranks' first-round payloads into ``out`` in the ring's order
    (:func:`ring_order_steps`; bit-identical on every rank).

    Args:
        payloads: uint8, shape ``(size, capacity)`` from :func:`first_round`.
        dtype, count: the elements in each payload.
        op: an :class:`~commlib.collectives.ops.Op`.
        out: 1-D host array of ``count`` elements of ``dtype``.
    """
    nb = count * np.dtype(dtype).itemsize
    parts = [np.ascontiguousarray(p[:nb]).view(dtype) for p in payloads]
    apply_steps(ring_order_steps(parts, count, op), op.ufunc, out)
    op.finalize(out, len(parts))


class SmallAllreduce:
    """The one-round small allreduce of host numpy arrays on one transport, without
    the general path's staging: the same first-round row as :func:`first_round`
    and the same ring-order reduction as :func:`reduce_rows` (so the same bits).

    ``rows`` receives every rank's first-round row (``_HEAD`` header bytes, then
    ``cap`` payload bytes); a plan for (dtype, count, op) holds the header bytes,
    the op, and the payload views the ring-order reduction reads.
    """

    __slots__ = ("tp", "cap", "row", "rows", "heads", "plans", "large_plans", "current", "scratch")

    def __init__(self, tp, cap: int):
        self.tp, self.cap = tp, cap
        self.rows = np.zeros((tp.size, _HEAD + cap), np.uint8)
        self.row = np.zeros(_HEAD + cap, np.uint8)
        mv, rb = memoryview(self.rows).cast("B"), _HEAD + cap
        self.heads = [mv[i * rb:i * rb + _HEAD] for i in range(tp.size)]  # each rank's header, as received
        self.plans: dict = {}
        self.large_plans: dict = {}
        self.current = None
        self.scratch = None  # the in-place ring's receive scratch, kept (allreduce_ring.ring_scratch)

    def plan(self, dtype, count: int, op, rank):
        try:
            o = ops.get_op(op, rank=rank, opname="allreduce")
            o.check(dtype, rank=rank, op="allreduce")
        except InvalidArgument:
            return None  # the general path raises it, on every rank
        n, nb = self.tp.size, count * dtype.itemsize
        head = np.array([0, SPECS["allreduce"].code, count, ops.dtype_code(dtype), o.code, 0, SMALL], np.int64)
        parts = [self.rows[i, _HEAD:_HEAD + nb].view(dtype) for i in range(n)]
        steps = ring_order_steps(parts, count, o)
        plan = (head.view(np.uint8).tobytes(), o, memoryview(self.row[_HEAD:_HEAD + nb]), steps, nb)
        if len(self.plans) >= 64:
            self.plans.pop(next(iter(self.plans)))
        self.plans[(dtype, count, op)] = plan
        return plan

    def run(self, plan, sendbuf: np.ndarray, out: np.ndarray) -> None:
        # the hot path of every small host allreduce (a few microseconds of Python
        # around one MPI_Allgather): _gather_rows and apply_steps are inlined
        hbytes, o, payload, steps, nb = plan
        if self.current is not plan:
            self.row[:_HEAD] = np.frombuffer(hbytes, np.uint8)
            self.current = plan
        if nb:
            try:
                payload[:] = sendbuf.data.cast("B")
            except (ValueError, TypeError):  # dtypes without a buffer format (bfloat16)
                np.frombuffer(payload, np.uint8)[...] = sendbuf.reshape(-1).view(np.uint8)
        tp, n = self.tp, self.tp.size
        if n == 1:
            if out is not sendbuf:
                out[...] = sendbuf
            return
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

    def _gather_rows(self, tp, hbytes: bytes) -> None:
        """The first round: all-gather every rank's row (header ``hbytes``, then
        the payload); a header that differs from this rank's (another call, or a
        rank that erred) makes :func:`judge` raise, on every rank alike."""
        tp.native_allgather(self.row, self.rows)
        for h in self.heads:
            if h.tobytes() != hbytes:  # tobytes: faster than comparing views
                self._judge(tp, hbytes)

    def _judge(self, tp, hbytes: bytes) -> None:
        """A header differs from this rank's: :func:`judge` raises, on every rank alike."""
        judge(tp, self.rows[:, :_HEAD], np.frombuffer(hbytes, np.int64)[1:].tolist(), op="allreduce",
              describe=describe_field("allreduce"))

    # A host allreduce above the one-round capacity that resolves to the ring or
    # to recursive doubling takes the same first round (the header row above,
    # payload bytes ignored) and the same algorithm call as the general path,
    # without its per-call staging objects: on a 2-core machine that bookkeeping
    # took ~30 us a call, 15% of a 1 MiB ring at 2 ranks, and 70-90% of a 2-32 KiB
    # recursive doubling (benchmarks/bench_allreduce.py).

    def large_plan(self, dtype, count: int, op, algorithm: str, rank):
        """``(header bytes, Op, algorithm)`` for a host allreduce of ``count``
        elements of ``dtype`` that ``algorithm`` resolves to the ring or to
        recursive doubling, above the one-round capacity when ``"auto"``; False
        otherwise, or when an argument is bad (the general path raises it, on
        every rank).  Cached in :attr:`large_plans` under ``(dtype, count, op,
        algorithm)``."""
        spec = SPECS["allreduce"]
        nb = count * dtype.itemsize
        try:
            o = ops.get_op(op, rank=rank, opname="allreduce")
            o.check(dtype, rank=rank, op="allreduce")
            algo = spec.choose(algorithm, nb, rank=rank, nranks=self.tp.size)
        except InvalidArgument:
            o = algo = None
        plan = False
        if algo in _FAST_ALGORITHMS and not (algorithm == "auto" and nb <= self.cap):
            head = np.array([0, spec.code, count, ops.dtype_code(dtype), o.code, 0, spec.algorithm_code(algo)],
                            np.int64)
            plan = (head.view(np.uint8).tobytes(), o, _FAST_ALGORITHMS[algo])
        if len(self.large_plans) >= 64:
            self.large_plans.pop(next(iter(self.large_plans)))
        self.large_plans[(dtype, count, op, algorithm)] = plan
        return plan

    def run_large(self, plan, sendbuf: np.ndarray, out: np.ndarray) -> None:
        """The first round (when ``COMMLIB_CHECK_ARGS``), then the plan's
        algorithm (:func:`.allreduce_ring` or
        :func:`.allreduce_recursive_doubling`) on C-contiguous host arrays
        (``out is sendbuf``: in place)."""
        hbytes, o, fn = plan
        tp, n = self.tp, self.tp.size
        if n > 1 and config.check_args:
            if self.current is not plan:
                self.row[:_HEAD] = np.frombuffer(hbytes, np.uint8)
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


_FAST_ALGORITHMS = {"ring": allreduce_ring, "recursive_doubling": allreduce_recursive_doubling}
_COMMUTATIVE = ("sum", "prod", "avg", "band", "bor", "bxor")
