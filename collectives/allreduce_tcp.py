"""The all-reduce row's path on a group whose transport carries first rounds on
tags of its own (the elastic peers' TCP transport): its header, thresholds,
first-round strategies and deferred delivery.

The engine (:meth:`commlib.collectives.engine.Engine.execute`) runs it in place
of the row's general first round and algorithms when the group says its
transport counts first rounds apart (``own_first_round``).  The strategy
follows from the call's size, the group's size and ``quantize`` alone
(:func:`choose_tcp_allreduce`, by :data:`TCP_ALLREDUCE_THRESHOLDS`), so every
member of a call picks the same one:

============== ============================================================
``small``      the vector rides in the argument agreement's row (at most
               :func:`~.one_round.small_capacity` bytes): at 2 members one
               message each way (:mod:`.pair_round`), at 3+ Bruck's
               all-gather over mirrored ranks (:func:`~.agreement.agree_on_own_tags`),
               reduced locally in the ring's order
``pair_exchange`` 2 members up to :data:`PAIR_EXCHANGE_MAX`: the header row then
               the whole vector, one message each way; combined as recursive
               doubling does (rank 0's vector on the left)
``one_shot``   3 members up to :data:`ONE_SHOT_TCP_MAX`: the all-gather's blocks
               are each member's row and whole vector (:mod:`.one_shot`)
``recursive_doubling`` 4+ members up to :data:`RECURSIVE_DOUBLING_TCP_MAX`: the
               mirrored agreement, then :mod:`.allreduce_recursive_doubling`
               out of place
``ring``       above: the header row in front of the ring's first chunk
               (:class:`~.agreement.RingHead`, no message of its own), or
               (``overlap_first_round`` False, or quantized) the bare row
               checked before the ring starts; :mod:`.allreduce_ring` in place
               under a copy-before-write snapshot
============== ============================================================

Every strategy but the ring computes out of place: the caller's buffer holds
its input until the group commits the call (the master's verdict), and the
row's ``deliver`` then writes the result (the ring restores from its snapshot
on an abort).  A member that sees a first message of another size, or a
neighbour's header that differs, raises
:class:`~.agreement.NeighbourRefusal`, which the group's recovery policy makes
every member's.

The group supplies (attributes of ``comm``): ``overlap_first_round`` (bool)
and ``first_round_joined(a, b)`` (whether ranks ``a`` and ``b``'s link carries
the ring head's row and chunk in one frame).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from commlib.core.buffer import grown
from commlib.core.errors import InvalidArgument
from commlib.transports.base import check_plain_dtype
from commlib.transports.quantize import QuantizingTransport

from .agreement import FirstRoundView, RingHead, agree_on_own_tags
from .allreduce_recursive_doubling import allreduce_recursive_doubling, combine_pair
from .allreduce_ring import allreduce_ring, ring_scratch
from .one_round import reduce_rows, small_capacity
from .one_shot import one_shot_bytes, one_shot_first_round
from .ops import OPS, dtype_code, dtype_name, get_op, is_floating
from .pair_round import message_bytes, pair_first_round
from .snapshot import LazySnapshot

__all__ = ["HEADER", "QUANTIZE", "PAIR_EXCHANGE_MAX", "RECURSIVE_DOUBLING_TCP_MAX", "ONE_SHOT_TCP_MAX",
           "TCP_ALLREDUCE_THRESHOLDS", "choose_tcp_allreduce", "TcpPath", "TcpPlans", "header", "describe",
           "PATH"]

#: the header of an elastic all-reduce (its argument agreement)
HEADER = ("operation", "count", "dtype", "op", "quantize")
#: the ``quantize`` values, coded 1.. in the header (0: a call travelling in the first round)
QUANTIZE = (None, "fp16", "int8")
_SMALL = 0
_OPERATION = 1

#: bytes up to which a 2-member unquantized all-reduce is one exchange of the whole
#: vector, shipped behind its header (:mod:`.pair_round`), instead of the ring's two
#: steps after the first round (measured on loopback, 2 cores: 4-256 KiB 1.3-1.8x
#: faster, 1 MiB even, 8 MiB slower)
PAIR_EXCHANGE_MAX = 1 << 20
#: bytes up to which an unquantized all-reduce on 4 or more members runs recursive
#: doubling (``ceil(log2 n)`` exchanges of the whole vector, plus two when ``n`` is
#: not a power of two) instead of the ring's ``2 (n - 1)`` steps of ``1/n`` of it
RECURSIVE_DOUBLING_TCP_MAX = 256 << 10
#: bytes up to which an unquantized all-reduce on 3 members is one-shot
#: (:mod:`.one_shot`).  Measured (benchmarks/ab_elastic.py, 3 peers on loopback, 2
#: cores, against recursive doubling and the ring in the same run): 4-256 KiB
#: 1.08-1.97x wall, 1.42-1.62x CPU; 512 KiB 1.15-1.41x wall against the ring; 1 MiB
#: 0.72x (the ring moves ``2 (n - 1) / n`` of the vector a member, one-shot two vectors)
ONE_SHOT_TCP_MAX = 512 << 10
#: the choice, as ``(max_bytes, strategy, min_ranks, max_ranks)``: the first entry
#: that fits wins, else the ring (a quantized call always takes the ring; a call of at
#: most :func:`~.one_round.small_capacity` bytes travels inside the first round)
TCP_ALLREDUCE_THRESHOLDS = ((PAIR_EXCHANGE_MAX, "pair_exchange", 2, 2),
                            (ONE_SHOT_TCP_MAX, "one_shot", 3, 3),
                            (RECURSIVE_DOUBLING_TCP_MAX, "recursive_doubling", 4, 1 << 30))


def choose_tcp_allreduce(nbytes: int, nranks: int, quantized: bool, thresholds=TCP_ALLREDUCE_THRESHOLDS) -> str:
    """The strategy: ``"small"``, ``"pair_exchange"``, ``"one_shot"``,
    ``"recursive_doubling"`` or ``"ring"`` (see the module docstring)."""
    if quantized:
        return "ring"
    if nranks > 1 and nbytes <= small_capacity(nranks):
        return "small"
    for max_bytes, algo, min_ranks, max_ranks in thresholds:
        if nbytes <= max_bytes and min_ranks <= nranks <= max_ranks:
            return algo
    return "ring"


def describe(name: str, value: int, operations=None):
    """Header codes as the user wrote them, for mismatch messages (``operations``:
    operation code -> collective name, the engine's table)."""
    if name == "quantize":
        return "none (one round)" if value == _SMALL else (QUANTIZE[value - 1] or "none") if 0 < value <= 3 else value
    if name == "dtype":
        return dtype_name(value)
    if name == "op":
        return next((o.name for o in OPS.values() if o.code == value), value)
    if name == "operation" and operations:  # another collective's first message
        return operations.get(value, value)
    return value


def header(buf, op, quantize, rank):
    """Validate one member's all-reduce arguments, before anything moves.

    The buffer's kind, layout and writability are checked on every call; what
    follows from its dtype, size, ``op`` and ``quantize`` alone is validated once
    per combination and kept.

    Returns:
        ``(values, local_error, op)``: the header ints (:data:`HEADER`), this
        member's :class:`InvalidArgument` or None, and the :class:`~.ops.Op`.
    """
    try:
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise InvalidArgument("buf must be a C-contiguous numpy array", rank=rank, op="allreduce")
        if not buf.flags.writeable:
            raise InvalidArgument("buf is read-only: the all-reduce writes its result into it", rank=rank,
                                  op="allreduce")
        if type(op) is str and (quantize is None or type(quantize) is str):  # hashable: the kept answer
            values, opx = _header_of(buf.dtype, buf.size, op, quantize, rank)
            return list(values), None, opx
        values, opx = _header_of.__wrapped__(buf.dtype, buf.size, op, quantize, rank)
    except InvalidArgument as exc:
        return [0] * len(HEADER), exc, None
    return list(values), None, opx


@functools.lru_cache(maxsize=256)
def _header_of(dtype, size: int, op, quantize, rank) -> tuple:
    """The header ints and the Op of a valid call on ``size`` elements of ``dtype``.

    Raises:
        InvalidArgument: a dtype, ``op`` or ``quantize`` the all-reduce refuses
            (never kept: raised anew on each call).
    """
    check_plain_dtype(dtype, rank, "allreduce", "buf")
    if dtype.kind not in "biufc":
        raise InvalidArgument(f"buf must have a numeric dtype, got {dtype}", rank=rank, op="allreduce")
    if not isinstance(op, str) or op not in OPS:
        raise InvalidArgument(f"op must be one of {', '.join(OPS)}, got {op!r}", rank=rank, op="allreduce")
    opx = get_op(op, rank=rank, opname="allreduce")
    opx.check(dtype, rank=rank, op="allreduce")
    if quantize not in QUANTIZE:
        raise InvalidArgument(f"quantize must be None, 'fp16' or 'int8', got {quantize!r}", rank=rank,
                              op="allreduce")
    if quantize is not None and not is_floating(dtype):
        raise InvalidArgument("quantize needs a floating dtype", rank=rank, op="allreduce")
    return (_OPERATION, size, dtype_code(dtype), opx.code, QUANTIZE.index(quantize) + 1), opx


class TcpPlans:
    """What the engine keeps for this path between calls (its plan cache for the
    row): the scratch buffers (grown to the largest call so far: no page faults
    on the hot path) and the ring head of the last ring-sized call.

    Attributes:
        scratch: the ring's snapshot; recursive doubling's receives.
        ring_keep: the in-place ring's receive scratch (:func:`~.allreduce_ring.ring_scratch`).
        pair_keep: the one-round, one-shot and recursive-doubling result.
        round_keep: the first round's messages (pair exchange, one-shot).
        head_keep: the ring head's row and the left neighbour's message.
        head_plan: ``(transport, key, RingHead)`` of the last ring-sized call.
    """

    __slots__ = ("scratch", "ring_keep", "pair_keep", "round_keep", "head_keep", "head_plan")

    def __init__(self):
        self.scratch = self.ring_keep = self.pair_keep = self.round_keep = self.head_keep = None
        self.head_plan = None


def _combine_pair_into(opx, flat, theirs, theirs_is_lower: bool) -> None:
    """The pair exchange's result into ``flat`` in place (after the commit):
    ``flat (op) theirs``, the lower rank's vector on the left, then the op's finalize."""
    combine_pair(opx, flat, flat, theirs, theirs_is_lower)
    opx.finalize(flat, 2)


def _ring_head(plans: TcpPlans, group, tr, values, flat, alone: bool, desc=describe) -> RingHead:
    """The ring's first round on ``tr``: a :class:`~.agreement.RingHead`, kept
    for the next call with the same header, chunk size and settings on the same
    transport (epoch), its row already encoded in a scratch no other path
    writes (``RingHead.renew``: the next first-round tag)."""
    n, r = tr.size, tr.rank
    chunk = -(-flat.size // n) * flat.itemsize
    in_chunk = getattr(group, "first_round_in_chunk", None)
    key = (tuple(values), chunk, alone, in_chunk)
    plan = plans.head_plan
    if plan is not None and plan[0] is tr and plan[1] == key:
        return plan[2].renew()
    cap = small_capacity(n)
    need = RingHead.need(len(values), cap, chunk)
    plans.head_keep = grown(plans.head_keep, need)
    fits = need <= tr.frame_max and not alone

    def joined(a, b):
        return fits and group.first_round_joined(a, b)

    head = RingHead(FirstRoundView(tr), values, op="allreduce", capacity=cap, keep=plans.head_keep,
                    send_joined=joined(r, (r + 1) % n), recv_joined=joined((r - 1) % n, r), names=HEADER,
                    describe=desc)
    plans.head_plan = (tr, key, head)
    return head


def _first_round(plans: TcpPlans, tr, values, algo, flat, timeout, desc=describe):
    """The argument agreement of a call that is not a ring's, carrying a small
    call's vector, a pair exchange's or a one-shot call's; every member's
    payload in rank order (None on 1 member)."""
    n = tr.size
    values = values[:4] + [_SMALL if algo == "small" else values[4]]
    if algo == "one_shot":  # every member's header and whole vector to every member
        plans.round_keep = grown(plans.round_keep, one_shot_bytes(len(values), n, flat.nbytes))
        return one_shot_first_round(FirstRoundView(tr), values, op="allreduce", vector=flat, keep=plans.round_keep,
                                    timeout=timeout, names=HEADER, describe=desc)
    payload = flat.view(np.uint8) if algo == "small" else None
    if n == 2:  # one message each way: the header row with the payload or the whole vector
        vector = flat if algo == "pair_exchange" else None
        nb = message_bytes(len(values), small_capacity(n), flat.nbytes if vector is not None else 0)
        plans.round_keep = grown(plans.round_keep, 2 * nb)
        return pair_first_round(FirstRoundView(tr), values, op="allreduce", capacity=small_capacity(n),
                                sendbuf=plans.round_keep[:nb], recvbuf=plans.round_keep[nb:2 * nb],
                                payload=payload, vector=vector, timeout=timeout, names=HEADER, describe=desc)
    if n > 2:
        return agree_on_own_tags(tr, values, op="allreduce", payload=payload, capacity=small_capacity(n),
                                 timeout=timeout, names=HEADER, describe=desc)
    return None


def _data(plans: TcpPlans, c, tr, flat, timeout, algo, rows, head=None):
    """The data part of one attempt; returns None when ``flat`` holds the result,
    else a callable that writes it into ``flat`` after the commit (until then
    ``flat`` holds the input, so an abort has nothing to restore)."""
    opx, quantize, nb = c.o, c.quantize, flat.nbytes
    if tr.size == 1:
        opx.finalize(flat, 1)  # the identity for every op: nothing to save
        return None
    if algo in ("small", "pair_exchange", "one_shot"):
        # every member's vector came in the first round, reduced out of place (bit-identical
        # on every member: the ring's order; the pair exchange as recursive doubling's,
        # combined straight into buf after the commit); a small or one-shot call's rows may
        # include buf itself (a gather send), so those reduce into a scratch and copy
        if algo == "pair_exchange":
            return functools.partial(_combine_pair_into, opx, flat, rows[1 - tr.rank][:nb].view(flat.dtype),
                                     tr.rank == 1)
        plans.pair_keep = grown(plans.pair_keep, nb)
        result = plans.pair_keep[:nb].view(flat.dtype)
        reduce_rows(rows, flat.dtype, flat.size, opx, result)
        return functools.partial(np.copyto, flat, result)
    if algo == "recursive_doubling":  # out of place, from flat (read, never written)
        plans.pair_keep = grown(plans.pair_keep, nb)
        plans.scratch = grown(plans.scratch, nb)
        result = plans.pair_keep[:nb].view(flat.dtype)
        allreduce_recursive_doubling(tr, result, opx, sendbuf=flat, timeout=timeout,
                                     tmp=plans.scratch[:nb].view(flat.dtype))
        return functools.partial(np.copyto, flat, result)
    # the ring in place: copy-before-write snapshot into a reused scratch (the copies
    # overlap the ring's transfers), restored only on an error
    plans.scratch = grown(plans.scratch, nb)
    snap = c.snapshot = LazySnapshot(flat, plans.scratch)
    plans.ring_keep, tmp = ring_scratch(plans.ring_keep, flat, tr.size)
    if quantize is None:
        allreduce_ring(tr, flat, opx, timeout=timeout, save=snap, tmp=tmp, head=head)
    else:
        # the quantizing view overwrites a chunk with its dequantized value when it first
        # sends it, before the ring's lazy saves: save everything up front
        snap.save_all()
        allreduce_ring(QuantizingTransport(tr, quantize), flat, opx, timeout=timeout, tmp=tmp)
    return None


def _prepare(c) -> list:
    """Step 1: the header ints (:data:`HEADER`); sets ``c.o``, ``c.sb`` (the flat view)."""
    values, error, opx = header(c.sendbuf, c.op, c.quantize, c.rank)
    if error is not None:
        raise error
    c.o, c.sb = opx, c.sendbuf.reshape(-1)
    return values


def _attempt(c, tr, timeout, survivors):
    """One attempt on ``tr``: the strategy's first round, then its data part;
    returns what the row's ``deliver`` takes (None, or the deferred write)."""
    flat, values = c.sb, c.header
    plans = c.ctx.plan_cache("allreduce", TcpPlans)
    group = c.ctx.comm
    c.snapshot = None
    algo = choose_tcp_allreduce(flat.nbytes, tr.size, c.quantize is not None, c.spec.tcp.thresholds)
    desc = functools.partial(describe, operations=c.operations)
    if algo == "ring" and tr.size > 1:
        # the header row in front of the ring's first chunk, compared before anything is
        # combined or written into buf; or (overlap_first_round False; a quantized ring
        # writes a chunk's dequantized value into buf as it sends it) that row alone first
        alone = c.quantize is not None or not group.overlap_first_round
        head = _ring_head(plans, group, tr, values, flat, alone, desc)
        if not alone:
            return _data(plans, c, tr, flat, timeout, algo, None, head=head)
        head.check_alone((tr.rank - 1) % tr.size, (tr.rank + 1) % tr.size, timeout)
        return _data(plans, c, tr, flat, timeout, algo, None)
    rows = _first_round(plans, tr, values, algo, flat, timeout, desc)
    return _data(plans, c, tr, flat, timeout, algo, rows)


def _deliver(c, finish):
    if finish is not None:  # committed: an out-of-place result goes into buf now
        finish()
    return c.sendbuf


@dataclass(frozen=True)
class TcpPath:
    """A row's path on a group whose transport carries first rounds on tags of
    its own: ``prepare(call) -> header ints`` (raises InvalidArgument),
    ``attempt(call, tp, timeout, survivors)`` (first round and algorithm),
    ``deliver(call, result)``, and the ``thresholds`` its choice reads."""

    prepare: Callable
    attempt: Callable
    deliver: Callable
    thresholds: tuple = ()


#: the all-reduce row's TCP path
PATH = TcpPath(_prepare, _attempt, _deliver, TCP_ALLREDUCE_THRESHOLDS)
