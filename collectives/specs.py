"""The collective specifications: one row per collective, carrying its algorithms.

The engine (:mod:`commlib.collectives.engine`) runs every collective from its
row in :data:`SPECS`; the row says everything about the collective that is
not the engine's generic sequence (validate, first round, choose, snapshot,
run under the recovery policy, return):

========== ===================================================================
header     the fields of :data:`commlib.core.agreement.FIELDS` the call's
           header fills (``operation`` always: the row's ``code``)
prepare    ``prepare(call) -> dict``: validates this rank's arguments locally
           (raising :class:`~commlib.InvalidArgument` /
           :class:`~commlib.BufferError`, which the engine turns into the same
           error on every rank), picks the algorithm (:meth:`CollectiveSpec.choose`)
           and returns the header
one_round  the small path, up to :func:`~.one_round.small_capacity` bytes
           under ``algorithm="auto"``: ``payload(call)`` (the bytes the first
           round carries) and ``finish(call, tp, rows, survivors)`` (the result
           from every rank's payload, :mod:`.one_round`); None: no small path
table      the algorithms (:class:`Algorithm`: host run, device variant, the
           plain function the engine's cached host plan calls); ``"auto"``
           picks by ``thresholds``, the first of ``table`` above them
stage      ``stage(call, small)``: the host (or device) views the algorithm
           runs on, made once per call after the first round
snapshot   ``snapshot(call) -> restorer | None`` in fault-tolerant mode, for
           collectives that overwrite their input (a retry needs it back);
           None when the input is only read
deliver    ``deliver(call, result)``: what the call returns (a staged result
           copied back, a ``recvbuf`` filled, or a new array of ``sendbuf``'s
           kind: numpy for a host ``sendbuf``, the same kind of device array
           for a device one, :func:`.staging.deliver`)
rooted     the header's ``root`` is renumbered in the shrunk group, and a lost
           root ends the call
tcp        the row's path on a group whose transport carries first rounds on
           tags of its own (the elastic peers' TCP transport), or None: its
           header, first-round strategies, thresholds and deferred delivery
           (:class:`~.allreduce_tcp.TcpPath`; the all-reduce's:
           :mod:`.allreduce_tcp`, thresholds :data:`TCP_ALLREDUCE_THRESHOLDS`)
========== ===================================================================

A :class:`Call` carries one call through those steps.  Every function here is
algorithm-side code: it reads host or device views and calls one algorithm
module (:mod:`.allreduce_ring`, ...) or the transport's native collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from commlib.core.agreement import FIELDS
from commlib.core.errors import InvalidArgument

from . import ops
from ._common import chunk_bounds
from .allgather_ring import allgather_ring
from .allreduce_tcp import (ONE_SHOT_TCP_MAX, PAIR_EXCHANGE_MAX, RECURSIVE_DOUBLING_TCP_MAX, TCP_ALLREDUCE_THRESHOLDS,
                            choose_tcp_allreduce)
from .allreduce_tcp import PATH as _ALLREDUCE_TCP
from .allreduce_recursive_doubling import allreduce_recursive_doubling
from .allreduce_ring import allreduce_ring
from .alltoall_pairwise import alltoall_pairwise
from .barrier import barrier_dissemination
from .bcast_binomial import bcast_binomial
from .one_round import reduce_rows, root_payload, small_capacity
from .reduce_scatter_ring import reduce_scatter_ring_inplace
from .staging import Staged, deliver, device_view, wrap

__all__ = ["Algorithm", "OneRound", "CollectiveSpec", "Call", "SPECS", "PAIR_EXCHANGE_MAX", "ONE_SHOT_TCP_MAX",
           "RECURSIVE_DOUBLING_TCP_MAX", "TCP_ALLREDUCE_THRESHOLDS", "choose_tcp_allreduce"]


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of a collective.

    Attributes:
        name: its ``algorithm=`` value.
        run: ``run(call, tp, timeout, survivors)`` on the call's host views;
            returns the result :attr:`CollectiveSpec.deliver` takes.
        device: the same algorithm on device buffers, reduced on the device
            (same messages, same bits), or None (device buffers are staged).
        host: the plain algorithm function, ``fn(tp, buf, op, *, sendbuf, ...)``,
            that the engine's cached plan for host numpy arrays calls without
            staging (allreduce's ring and recursive doubling), or None.
    """

    name: str
    run: Callable
    device: Callable | None = None
    host: Callable | None = None


@dataclass(frozen=True)
class OneRound:
    """The one-round small path of a collective (:mod:`.one_round`).

    Attributes:
        payload: ``payload(call)``: the 1-D host array the first round carries,
            or None when the call is not small (then the large path runs).
        finish: ``finish(call, tp, rows, survivors)``: the result, from the
            gathered payloads ``rows`` (uint8, shape ``(size, capacity)``).
    """

    payload: Callable
    finish: Callable


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective: its header, validation, algorithms and needs (see the module docstring).

    Attributes:
        algorithms: accepted ``algorithm=`` values: ``"auto"``, then the names
            in :attr:`table` (the first is the default above every threshold).
        thresholds: ``(max_bytes, algorithm)`` or ``(max_bytes, algorithm,
            min_ranks)`` entries ``"auto"`` picks from, in order (an entry with
            ``min_ranks`` applies on groups of at least that many ranks).
    """

    name: str
    code: int
    header: tuple
    prepare: Callable
    table: tuple
    deliver: Callable
    thresholds: tuple = ()
    one_round: OneRound | None = None
    stage: Callable | None = None
    snapshot: Callable | None = None
    rooted: bool = False
    tcp: object = None
    algorithms: tuple = field(init=False)
    impl: Mapping[str, Algorithm] = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "algorithms", ("auto",) + tuple(a.name for a in self.table))
        object.__setattr__(self, "impl", {a.name: a for a in self.table})
        unknown = set(self.header) - set(FIELDS)
        if unknown:  # pragma: no cover - a row written wrong
            raise ValueError(f"{self.name}: header fields {sorted(unknown)} not in {FIELDS}")

    @property
    def small(self) -> bool:
        """True when a small call travels inside the first round."""
        return self.one_round is not None

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
        """``algorithm``'s number in the header (1 for ``"auto"``'s first
        entry...; 0 is the one-round small path)."""
        return self.algorithms.index(algorithm) + 1

    def values(self, fields: Mapping[str, int]) -> list:
        """The header as ints in :data:`~commlib.core.agreement.FIELDS` order:
        ``operation`` is this row's code, the fields of :attr:`header` come
        from ``fields``, the rest are 0."""
        return [self.code] + [int(fields.get(k, 0)) if k in self.header else 0 for k in FIELDS[1:]]


class Call:
    """One collective call on its way through the engine.

    Set by the engine: ``spec``, ``ctx`` (the communicator's
    :class:`~commlib.collectives.engine.Engine`: ``staging()``,
    ``lazy_snapshot(buf)``, ``comm``), ``rank``, ``size`` (the group at the
    start of the call), ``ft`` (fault tolerant), the arguments ``sendbuf``
    (bcast: ``buf``), ``recvbuf``, ``op``, ``algorithm``, ``root`` (and
    ``root_rank``: it as an int when it is a rank of the group, else None),
    ``payload`` (the one-round bytes, or None) and ``agreed`` (the first round
    ran in this attempt: every rank has entered the call).  Set by the row's functions:
    the checked buffers ``sb``/``rb``, ``o`` (the :class:`~.ops.Op`),
    ``algo`` (the algorithm chosen), the host views ``src``/``dst``
    (:class:`~.staging.Staged`), ``dev`` (device views, when the device
    variant runs), ``snapshot`` (a restorer), and per-collective facts
    (``inplace``, ``shape``, ``blk``).
    """

    # defaults at class level: a call sets only what its collective uses
    payload = sb = rb = o = algo = src = dst = dev = snapshot = shape = blk = quantize = header = operations = None
    inplace = staged = agreed = False

    def __init__(self, spec: CollectiveSpec, ctx, sendbuf=None, recvbuf=None, op="sum", algorithm: str = "auto",
                 root=None):
        comm = ctx.comm
        self.spec, self.ctx = spec, ctx
        self.rank, self.size, self.ft = comm.rank, comm.size, comm.ft is not None
        self.sendbuf, self.recvbuf, self.op, self.algorithm = sendbuf, recvbuf, op, algorithm
        self.root = root
        self.root_rank = int(root) if spec.rooted and valid_root(root, self.size) else None

    def run(self, tp, timeout, survivors):
        """The chosen algorithm, once, over ``tp`` (its device variant when
        :attr:`dev` is set); an attempt of :func:`~.ft.run_collective`."""
        algo = self.spec.impl[self.algo]
        return (algo.device if self.dev is not None else algo.run)(self, tp, timeout, survivors)

    def restore(self) -> None:
        """Put the input back (before a retry, and before an error leaves the call)."""
        if self.snapshot is not None:
            self.snapshot.restore()

    def native_dtype(self, dtype):
        """The wire library's datatype for ``dtype`` (None: it has none)."""
        return self.ctx.comm.transport.native_dtype(dtype)

    def staged_host(self, b, role: str, down: bool = True) -> Staged:
        """A :class:`~.staging.Staged` host view of ``b`` through the communicator's pinned staging."""
        return Staged(b, self.ctx.staging, role, down)

    def deliver_into(self, out, shape):
        """:func:`~.staging.deliver` of ``out`` into ``recvbuf``, or returned
        shaped ``shape`` as a new array of ``sendbuf``'s kind (:attr:`sb`)."""
        return deliver(self.recvbuf, out, self.spec.name, shape, staging=self.ctx.staging, rank=self.rank,
                       like=self.sb)


def valid_root(root, size: int) -> bool:
    """``root`` is a rank of a group of ``size`` (an int, not a bool: ``True``
    is no rank, though Python counts it as 1)."""
    return isinstance(root, (int, np.integer)) and not isinstance(root, bool) and 0 <= int(root) < size


class _FullCopy:
    """A full copy of a host buffer, put back on every :meth:`restore` (bcast's
    input; a small in-place allreduce's, whose one-round payload is that copy)."""

    __slots__ = ("buf", "copy")

    def __init__(self, buf: np.ndarray, copy: np.ndarray | None = None):
        self.buf, self.copy = buf, (np.array(buf, copy=True) if copy is None else copy)

    def restore(self) -> None:
        self.buf[...] = self.copy


class _DeviceCopy:
    """A device copy of a device buffer reduced in place, put back on :meth:`restore`."""

    __slots__ = ("kind", "dev", "saved", "stream")

    def __init__(self, kind, dev, stream):
        from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

        self.kind, self.dev, self.stream = kind, dev, stream
        self.saved = dr.device_empty(kind, dev.size, dev.dtype)
        dr.d2d(kind, dev, self.saved, stream)

    def restore(self) -> None:
        from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

        dr.d2d(self.kind, self.saved, self.dev, self.stream)


# --------------------------------------------------------------------- allreduce
def _allreduce_prepare(c: Call) -> dict:
    name, rank = c.spec.name, c.rank
    c.inplace = c.recvbuf is None or c.recvbuf is c.sendbuf
    # in place (no recvbuf) the result goes into sendbuf: it must be writable
    sb = wrap(c.sendbuf, name, "sendbuf", rank, written="its result (in place: recvbuf is None)" if c.inplace else None)
    o = ops.get_op(c.op, rank=rank, opname=name)
    o.check(sb.dtype, rank=rank, op=name)
    rb = sb if c.inplace else wrap(c.recvbuf, name, "recvbuf", rank, written="its result")
    if not c.inplace and (rb.size != sb.size or rb.dtype != sb.dtype):
        raise InvalidArgument(f"recvbuf ({rb.size} x {rb.dtype}) does not match sendbuf "
                              f"({sb.size} x {sb.dtype})", rank=rank, op=name)
    algo = c.spec.choose(c.algorithm, sb.nbytes, rank=rank, nranks=c.size)
    if algo == "mpi" and c.native_dtype(sb.dtype) is None:
        raise InvalidArgument(f"MPI has no datatype for {sb.dtype.name}; use algorithm='ring'", rank=rank, op=name)
    c.sb, c.rb, c.o, c.algo = sb, rb, o, algo
    return {"count": sb.size, "dtype": ops.dtype_code(sb.dtype), "op": o.code,
            "algorithm": c.spec.algorithm_code(algo)}


def _small_payload(c: Call):
    """The input's host view when the call is small (``"auto"``, at most the
    first round's capacity), else None."""
    if c.algorithm != "auto" or c.sb.nbytes > small_capacity(c.size):
        return None
    c.src = c.staged_host(c.sb, "src")
    return c.src.host


def _allreduce_payload(c: Call):
    host = _small_payload(c)
    # fault tolerance may retry after this rank wrote its result: keep the input
    return host.copy() if host is not None and c.inplace and c.ft else host


def _allreduce_finish(c: Call, tp, rows, survivors) -> None:
    work = c.dst.host
    reduce_rows(rows, work.dtype, work.size, c.o, work)


def _allreduce_stage(c: Call, small: bool) -> None:
    # 0 elements take the host path: nothing to reduce, and numba-cuda on a GPU
    # raises on any slice of an empty device array (a NULL allocation)
    if not small and c.algo == "ring" and c.sb.size:
        dsrc = device_view(c.sb)
        ddst = dsrc if c.inplace else device_view(c.rb)
        if dsrc is not None and ddst is not None and dsrc[0] == ddst[0]:
            # the ring on device buffers: reduced on the device, staged per
            # segment through pinned memory when the transport is not CUDA-aware
            kind, dev, stream = ddst
            c.dev = (kind, dev, None if c.inplace else dsrc[1], stream)
            return
    if c.src is None:  # a small call staged it for its payload
        c.src = c.staged_host(c.sb, "src")
    c.dst = c.src if c.inplace else c.staged_host(c.rb, "dst", down=False)


def _allreduce_snapshot(c: Call):
    # Out of place the input survives a retry (sendbuf is only read).  In
    # place the ring saves each chunk lazily, just before it first overwrites
    # it, behind that step's transfer; the others save it all up front.
    if not c.inplace:
        return None
    if c.dev is not None:
        kind, dev, _, stream = c.dev
        return _DeviceCopy(kind, dev, stream)
    if c.payload is not None:  # one round: the payload is already a copy of the input (_allreduce_payload)
        return _FullCopy(c.dst.host, c.payload)
    return c.ctx.lazy_snapshot(c.dst.host)


def _allreduce_source(c: Call):
    return None if c.inplace else c.src.host


def _allreduce_ring(c: Call, tp, timeout, survivors) -> None:
    allreduce_ring(tp, c.dst.host, c.o, sendbuf=_allreduce_source(c), timeout=timeout, save=c.snapshot)


def _allreduce_ring_device(c: Call, tp, timeout, survivors) -> None:
    from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

    kind, dev, dsrc, stream = c.dev
    entry = None if tp.cuda_aware else c.ctx.staging().get("ring", kind, dev.size, dev.dtype)
    dr.allreduce_ring_device(tp, dev, c.o, kind=kind, src=dsrc, timeout=timeout, entry=entry, stream=stream)


def _allreduce_recursive_doubling(c: Call, tp, timeout, survivors) -> None:
    if c.snapshot is not None:
        c.snapshot.save_all()
    allreduce_recursive_doubling(tp, c.dst.host, c.o, sendbuf=_allreduce_source(c), timeout=timeout)


def _allreduce_native(c: Call, tp, timeout, survivors) -> None:
    if c.snapshot is not None:
        c.snapshot.save_all()
    work = c.dst.host
    tp.native_allreduce(_allreduce_source(c), work, c.o.name)
    c.o.finalize(work, tp.size)


def _allreduce_deliver(c: Call, result):
    if c.dst is not None:
        c.dst.flush()
    return c.sendbuf if c.inplace else c.recvbuf


# ---------------------------------------------------------------- reduce_scatter
def _reduce_scatter_prepare(c: Call) -> dict:
    name, rank = c.spec.name, c.rank
    sb = wrap(c.sendbuf, name, "sendbuf", rank)
    o = ops.get_op(c.op, rank=rank, opname=name)
    o.check(sb.dtype, rank=rank, op=name)
    algo = c.spec.choose(c.algorithm, sb.nbytes, rank=rank)
    if algo == "mpi" and (c.native_dtype(sb.dtype) is None or sb.size % c.size):
        raise InvalidArgument("algorithm='mpi' needs an MPI datatype and count divisible by size", rank=rank, op=name)
    b = chunk_bounds(sb.size, c.size)
    mylen = int(b[rank + 1] - b[rank])
    if c.recvbuf is not None:
        rb = wrap(c.recvbuf, name, "recvbuf", rank, written="its block of the result")
        if rb.size != mylen or rb.dtype != sb.dtype:
            raise InvalidArgument(f"recvbuf must hold {mylen} x {sb.dtype.name}, has {rb.size} x {rb.dtype}",
                                  rank=rank, op=name)
    c.sb, c.o, c.algo = sb, o, algo
    return {"count": sb.size, "dtype": ops.dtype_code(sb.dtype), "op": o.code,
            "algorithm": c.spec.algorithm_code(algo)}


def _reduce_scatter_finish(c: Call, tp, rows, survivors):
    host = c.src.host
    full = np.empty(host.size, host.dtype)
    reduce_rows(rows, full.dtype, full.size, c.o, full)
    b = chunk_bounds(host.size, tp.size)
    return full[b[tp.rank]:b[tp.rank + 1]].copy()


def _reduce_scatter_stage(c: Call, small: bool) -> None:
    if not small and c.algo == "ring" and c.src is None and c.sb.size:  # 0 elements: as allreduce's
        dv = device_view(c.sb)
        if dv is not None:
            c.dev = dv
            return
    if c.src is None:
        c.src = c.staged_host(c.sb, "src")


def _reduce_scatter_ring(c: Call, tp, timeout, survivors):
    n, r = tp.size, tp.rank
    bounds = chunk_bounds(c.src.host.size, n)
    work = np.array(c.src.host, copy=True)
    reduce_scatter_ring_inplace(tp, work, c.o, bounds, timeout=timeout)
    out = work[bounds[r]:bounds[r + 1]]
    c.o.finalize(out, n)
    return out


def _reduce_scatter_ring_device(c: Call, tp, timeout, survivors):
    """The ring reduce-scatter of a device ``sendbuf``, reduced on the device
    (same order and bits as the host ring); returns this rank's block as a
    device array of the kernels' kind (CuPy or numba, :func:`.staging.device_view`),
    which the row's ``deliver`` copies into ``recvbuf`` or a new array of
    ``sendbuf``'s own kind (a torch tensor's block is a torch tensor)."""
    from commlib.collectives import _device_reduce as dr  # noqa: PLC0415

    kind, dsrc, stream = c.dev
    n, r = tp.size, tp.rank
    b = [int(x) for x in chunk_bounds(dsrc.size, n)]
    work = dr.device_empty(kind, dsrc.size, dsrc.dtype)
    if n == 1:
        dr.d2d(kind, dsrc, work, stream)
    else:
        entry = None if tp.cuda_aware else c.ctx.staging().get("ring", kind, dsrc.size, dsrc.dtype)
        dr.reduce_scatter_ring_device(tp, work, c.o, b, kind=kind, src=dsrc, timeout=timeout, entry=entry,
                                      stream=stream)
    mine = work[b[r]:b[r + 1]]
    dr.finalize(mine, n, c.o, kind, stream)
    return mine


def _reduce_scatter_native(c: Call, tp, timeout, survivors):
    n, r = tp.size, tp.rank
    bounds = chunk_bounds(c.src.host.size, n)
    out = np.empty(int(bounds[r + 1] - bounds[r]), dtype=c.src.host.dtype)
    tp.native_reduce_scatter_block(c.src.host, out, c.o.name)
    c.o.finalize(out, n)
    return out


def _reduce_scatter_deliver(c: Call, out):
    return c.deliver_into(out, out.shape)


# --------------------------------------------------------------------- allgather
def _allgather_prepare(c: Call) -> dict:
    name, rank = c.spec.name, c.rank
    sb = wrap(c.sendbuf, name, "sendbuf", rank)
    algo = c.spec.choose(c.algorithm, rank=rank)
    if c.recvbuf is not None:
        rb = wrap(c.recvbuf, name, "recvbuf", rank, written="every rank's block")
        if rb.size != sb.size * c.size or rb.dtype != sb.dtype:
            raise InvalidArgument(f"recvbuf must hold {c.size} x {sb.size} x {sb.dtype.name}, "
                                  f"has {rb.size} x {rb.dtype}", rank=rank, op=name)
    c.sb, c.algo, c.shape = sb, algo, tuple(sb.shape)
    return {"count": sb.size, "dtype": ops.dtype_code(sb.dtype), "algorithm": c.spec.algorithm_code(algo)}


def _stage_src(c: Call, small: bool) -> None:
    if c.src is None:
        c.src = c.staged_host(c.sb, "src")


def _allgather_ring(c: Call, tp, timeout, survivors):
    src = c.src.host
    out = np.empty(tp.size * src.size, dtype=src.dtype)
    allgather_ring(tp, src, out, timeout=timeout)
    return out


def _allgather_native(c: Call, tp, timeout, survivors):
    src = c.src.host
    out = np.empty(tp.size * src.size, dtype=src.dtype)
    tp.native_allgather(src, out)
    return out


def _allgather_deliver(c: Call, out):
    return c.deliver_into(out, (c.ctx.comm.size,) + c.shape)  # the group after the call (shrunk or not)


# ------------------------------------------------------------------------- bcast
def _bcast_prepare(c: Call) -> dict:
    name, rank = c.spec.name, c.rank
    b = wrap(c.sendbuf, name, "buf", rank)
    algo = c.spec.choose(c.algorithm, rank=rank)
    if c.root_rank is None:
        what = "not a rank (a bool)" if isinstance(c.root, (bool, np.bool_)) else f"out of range [0, {c.size})"
        raise InvalidArgument(f"root {c.root!r} {what}", rank=rank, op=name)
    if rank != c.root_rank:  # the root's buf is only read: read-only is fine there
        wrap(b, name, "buf", rank, written=f"root {c.root_rank}'s data")
    c.src, c.algo = c.staged_host(b, "buf"), algo  # before the first round: a small call carries it
    return {"count": b.size, "dtype": ops.dtype_code(b.dtype), "root": c.root_rank,
            "algorithm": c.spec.algorithm_code(algo)}


def _bcast_payload(c: Call):
    h = c.src.host
    return h if c.algorithm == "auto" and h.nbytes <= small_capacity(c.size) else None


def _bcast_finish(c: Call, tp, rows, survivors) -> None:
    if c.rank != c.root_rank:  # the root holds its data already (and its buf may be read-only)
        root_payload(rows, survivors.index(c.root_rank), c.src.host)


def _bcast_snapshot(c: Call):
    # the root's buf is only read (it may be read-only): nothing to put back there
    return _FullCopy(c.src.host) if c.rank != c.root_rank else None


def _bcast_binomial(c: Call, tp, timeout, survivors) -> None:
    bcast_binomial(tp, c.src.host, survivors.index(c.root_rank), timeout=timeout)


def _bcast_native(c: Call, tp, timeout, survivors) -> None:
    tp.native_bcast(c.src.host, survivors.index(c.root_rank))


def _bcast_deliver(c: Call, result):
    c.src.flush()
    return c.sendbuf


# ---------------------------------------------------------------------- alltoall
def _alltoall_prepare(c: Call) -> dict:
    name, rank, nblk = c.spec.name, c.rank, c.size
    sb = wrap(c.sendbuf, name, "sendbuf", rank)
    algo = c.spec.choose(c.algorithm, rank=rank)
    if sb.size % nblk:
        raise InvalidArgument(f"sendbuf has {sb.size} elements, not a multiple of size {nblk}", rank=rank, op=name)
    if c.recvbuf is not None:
        rb = wrap(c.recvbuf, name, "recvbuf", rank, written="the blocks it receives")
        if rb.size != sb.size or rb.dtype != sb.dtype:
            raise InvalidArgument("recvbuf must match sendbuf in count and dtype", rank=rank, op=name)
        if rb.obj is sb.obj:
            raise InvalidArgument("alltoall cannot run in place", rank=rank, op=name)
    c.sb, c.algo, c.blk = sb, algo, sb.size // nblk
    return {"count": sb.size, "dtype": ops.dtype_code(sb.dtype), "algorithm": c.spec.algorithm_code(algo)}


def _alltoall_blocks(c: Call, tp, survivors):
    """``(send, out)``: the blocks addressed to the surviving ranks, in their
    new order, and the receive array (``tp.size`` blocks)."""
    src, blk = c.src.host, c.blk
    send = src.reshape(c.size, blk)[list(survivors)].reshape(-1) if len(survivors) != c.size else src
    return np.ascontiguousarray(send), np.empty(tp.size * blk, dtype=src.dtype)


def _alltoall_pairwise(c: Call, tp, timeout, survivors):
    send, out = _alltoall_blocks(c, tp, survivors)
    alltoall_pairwise(tp, send, out, timeout=timeout)
    return out


def _alltoall_native(c: Call, tp, timeout, survivors):
    send, out = _alltoall_blocks(c, tp, survivors)
    tp.native_alltoall(send, out)
    return out


def _alltoall_deliver(c: Call, out):
    return c.deliver_into(out, (c.ctx.comm.size, c.blk))


# ----------------------------------------------------------------------- barrier
# The first round of a barrier agrees on its algorithm (a bad or different one on
# any rank is refused on every rank) and is itself a barrier: no rank leaves its
# all-gather before it heard, transitively, from every rank.  So "auto" and
# "dissemination" are that round alone (Bruck's all-gather, the dissemination
# pattern with a row per message, under bounded waits; the native all-gather
# when waits need no bound): one round, as the unchecked barrier was.  "mpi" runs
# MPI_Barrier after it, as asked.  Without the first round (COMMLIB_CHECK_ARGS=0)
# "dissemination" runs Hensgen, Finkel & Manber's barrier itself.
def _barrier_prepare(c: Call) -> dict:
    algorithm = c.algorithm
    if algorithm == "auto":  # the first round alone (above)
        algorithm = "dissemination"
    c.algo = c.spec.choose(algorithm, rank=c.rank)
    return {"algorithm": c.spec.algorithm_code(c.algo)}


def _barrier_dissemination(c: Call, tp, timeout, survivors) -> None:
    if not c.agreed:  # the first round did not run: it is no barrier here
        barrier_dissemination(tp, timeout=timeout)


def _barrier_native(c: Call, tp, timeout, survivors) -> None:
    tp.native_barrier()


def _nothing(c: Call, result) -> None:
    return None


# ------------------------------------------------------------------------ the table
#: the collectives (allreduce "auto": recursive doubling up to 256 KiB on 3 or
#: more ranks, ring above; measured with benchmarks/bench_allreduce.py at 2 and
#: 4 ranks, shared memory, 2 cores: the two cross between 64 and 256 KiB.  At 2
#: ranks the ring from the one-round capacity on: with both on the host fast
#: path the ring was 0.13-0.93x MPI at 2-128 KiB against recursive doubling's
#: 0.11-0.57x, and the two give the same bits there, every op being commutative)
SPECS: dict[str, CollectiveSpec] = {s.name: s for s in (
    CollectiveSpec(
        "allreduce", 1, ("count", "dtype", "op", "algorithm"), _allreduce_prepare,
        (Algorithm("ring", _allreduce_ring, device=_allreduce_ring_device, host=allreduce_ring),
         Algorithm("recursive_doubling", _allreduce_recursive_doubling, host=allreduce_recursive_doubling),
         Algorithm("mpi", _allreduce_native)),
        _allreduce_deliver, thresholds=((256 * 1024, "recursive_doubling", 3),),
        one_round=OneRound(_allreduce_payload, _allreduce_finish), stage=_allreduce_stage,
        snapshot=_allreduce_snapshot, tcp=_ALLREDUCE_TCP),
    CollectiveSpec(
        "reduce_scatter", 2, ("count", "dtype", "op", "algorithm"), _reduce_scatter_prepare,
        (Algorithm("ring", _reduce_scatter_ring, device=_reduce_scatter_ring_device),
         Algorithm("mpi", _reduce_scatter_native)),
        _reduce_scatter_deliver, one_round=OneRound(_small_payload, _reduce_scatter_finish),
        stage=_reduce_scatter_stage),
    CollectiveSpec(
        "allgather", 3, ("count", "dtype", "algorithm"), _allgather_prepare,
        (Algorithm("ring", _allgather_ring), Algorithm("mpi", _allgather_native)),
        _allgather_deliver, stage=_stage_src),
    CollectiveSpec(
        "bcast", 4, ("count", "dtype", "root", "algorithm"), _bcast_prepare,
        (Algorithm("binomial", _bcast_binomial), Algorithm("mpi", _bcast_native)),
        _bcast_deliver, one_round=OneRound(_bcast_payload, _bcast_finish), snapshot=_bcast_snapshot, rooted=True),
    CollectiveSpec(
        "alltoall", 5, ("count", "dtype", "algorithm"), _alltoall_prepare,
        (Algorithm("pairwise", _alltoall_pairwise), Algorithm("mpi", _alltoall_native)),
        _alltoall_deliver, stage=_stage_src),
    CollectiveSpec(
        "barrier", 6, ("algorithm",), _barrier_prepare,
        (Algorithm("dissemination", _barrier_dissemination), Algorithm("mpi", _barrier_native)),
        _nothing),
)}
