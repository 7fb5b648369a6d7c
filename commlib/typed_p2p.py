"""Point-to-point sends of non-contiguous data described by a datatype.

``Communicator.send/recv/isend/irecv/sendrecv(..., datatype=, count=)`` land
here.  The datatype (a commlib type or any committed ``MPI.Datatype``) is
checked against the buffer first — ``count`` elements must lie inside it, which
``MPI_Send`` would not check — then the strategy model
(:mod:`commlib.datatypes.strategy`) picks how the bytes travel: the MPI
datatype handed to MPI, or commlib's pack kernels (on the device for device
buffers) with the packed bytes sent as ``MPI_PACKED``.  Sender and receiver
choose independently; MPI-4.0 §5.2 pairs ``MPI_PACKED`` with any type
signature, so any pair of strategies interoperates.

A receive may get a shorter message than ``count`` elements (MPI-4.0 §3.2.4):
whatever the strategy, only the bytes that arrived are written, as MPI's own
receive with the datatype does; a longer message is MPI's truncation error.  A
read-only receive buffer is refused before anything is posted.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from commlib.core import devmem
from commlib.core.buffer import as_buffer
from commlib.core.config import config
from commlib.core.errors import BufferError, CommError, DatatypeError
from commlib.datatypes import Datatype as _Datatype
from commlib.datatypes import as_datatype, pack, plan_for, unpack
from commlib.datatypes import strategy as _strategy
from commlib.datatypes.strategy import default_model
from commlib.transports.base import CompletedRequest, Request, Wire, check_plain_dtype
from commlib.transports.mpi import ANY_SOURCE, ANY_TAG, PROC_NULL, MPITransport

__all__ = ["typed_send", "typed_recv", "fast_p2p", "typed_isend", "typed_irecv", "typed_sendrecv", "locality_of", "resolve"]


def resolve(comm, buf, datatype, count, op, receive: bool = False):
    """Validate ``(buf, datatype, count)``; returns ``(Buffer, commlib type, plan)``.

    Args:
        receive: True for a receive (the messages then say nothing was posted).

    Raises:
        DatatypeError: the datatype is unusable (null, freed, uncommitted, or
            any error MPI reports reading it) or ``count`` elements do not fit
            ``buf`` (bytes touched outside it); raised before any byte moves.
        InvalidArgument: ``buf``'s dtype holds references (``dtype=object``).
        BufferError: ``buf`` is read-only (a receive).
    """
    nothing = "no receive was posted" if receive else "nothing was sent"
    try:
        t = as_datatype(datatype, op)
    except CommError as exc:
        raise DatatypeError(f"{exc.detail}; {nothing}", rank=comm.rank, op=op) from None
    except Exception as exc:  # noqa: BLE001 - MPI's own error reading a stale handle (MPI_ERR_INTERN...)
        raise DatatypeError(f"datatype {datatype!r} cannot be read ({type(exc).__name__}: {exc}; a freed or "
                            f"invalid handle?); {nothing}", rank=comm.rank, op=op) from None
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise DatatypeError(f"count must be a non-negative int, got {count!r}; {nothing}", rank=comm.rank, op=op)
    b = as_buffer(buf, op=op, rank=comm.rank)
    check_plain_dtype(b.dtype, comm.rank, op)
    if receive and b.readonly:
        raise BufferError(f"the receive buffer is read-only (writeable flag cleared, or an immutable object); "
                          f"{nothing}", rank=comm.rank, op=op)
    if not b.dense:
        raise DatatypeError(f"buffer must be contiguous in memory; the datatype describes the layout; {nothing}",
                            rank=comm.rank, op=op)
    p = plan_for(t, int(count))
    if p.nbytes and (p.lo < 0 or p.hi > b.nbytes):
        raise DatatypeError(
            f"{count} element(s) of {t!r} touch bytes [{p.lo}, {p.hi}) but the buffer holds {b.nbytes}; {nothing}",
            rank=comm.rank, op=op)
    return b, t, p


def locality_of(comm, peer: int) -> str:
    """``"intra"`` when ``peer`` shares this rank's node, else ``"inter"`` (from
    the node map the transport learned, collectively, when it was created)."""
    return "intra" if peer in comm.transport.node_peers else "inter"


class MPITypes:
    """Committed MPI types of commlib datatypes, per communicator, freed with it
    (not an ``lru_cache`` that keeps every committed type for ever)."""

    __slots__ = ("types",)

    def __init__(self):
        self.types: dict = {}

    def get(self, t):
        got = self.types.get(t)
        if got is None:
            if len(self.types) >= 256:  # bounded: free the oldest
                old = next(iter(self.types))
                self.types.pop(old).Free()
            got = self.types[t] = t.to_mpi()
        return got

    def free(self) -> None:
        for mt in self.types.values():
            mt.Free()
        self.types.clear()


def _choose(comm, b, t, count, peer, strategy, forced=None):
    """The strategy: ``strategy`` if given, else the forced one
    (``forced``, or ``config.datatype_strategy`` read now when None), else the
    model's choice for this peer's locality (memoized per communicator)."""
    if strategy is not None:
        return strategy
    if forced is None:
        forced = config.datatype_strategy
    if forced:
        return forced
    memo = comm._strategy_memo
    key = (id(t), count, b.is_device, peer, _strategy.generation)
    got = memo.get(key)
    if got is not None and got[0] is t:
        return got[1]
    loc = "intra" if peer in (PROC_NULL, ANY_SOURCE) else locality_of(comm, peer)
    s = default_model().choose(t, count, device=b.is_device, locality=loc, cuda_aware=comm.cuda_aware)
    if len(memo) < 4096:
        memo[key] = (t, s)
    return s


_PLANS_CAP = 1024  # plans per communicator (a program uses a handful of shapes)


class _HostPlan:
    """The outcome of validating and choosing for one key: the commlib type,
    its pack plan, the strategy, and the packed size in bytes; and what else
    the outcome depended on, checked at each use (the buffer's dtype and byte
    size, the strategy argument, the forced strategy, the model generation)."""

    __slots__ = ("t", "p", "s", "n", "dtype", "nbytes", "strategy", "forced", "generation")

    def __init__(self, t, p, s, buf, strategy, forced):
        self.t, self.p, self.s, self.n = t, p, s, p.nbytes
        self.dtype, self.nbytes, self.strategy, self.forced = buf.dtype, buf.nbytes, strategy, forced
        self.generation = _strategy.generation


def _host_plan(comm, buf, peer, datatype, count, strategy, op, receive):
    """The cached plan for a host numpy ``buf``, or None when this call does
    not qualify (the general path then validates it and raises as usual).

    Qualifies: ``buf`` exactly a C-contiguous, non-empty ``numpy.ndarray``
    (writeable for a receive), ``peer`` an in-range int (or ``ANY_SOURCE`` for
    a receive), ``count`` an int (not a bool).  The datatype is resolved on
    every call (:func:`commlib.datatypes.as_datatype`; for an ``MPI.Datatype``
    the handle's cached attribute, which ``MPI_Type_free`` deletes), and the
    plan is served only for the very type object it was made for (it holds a
    reference, so ``id`` is not reused while it lives).  Everything else the
    general path's checks and choice read is in the key (count, peer,
    send/receive) or checked on the plan (the buffer's dtype and byte size,
    the strategy argument, the forced strategy as set, the model generation).  A miss runs :func:`resolve` and
    the strategy choice (every check, every error) and caches only a successful outcome.
    """
    if type(buf) is not np.ndarray or type(count) is not int or type(peer) is not int:
        return None
    flags = buf.flags
    if not flags.c_contiguous or (receive and not flags.writeable) or not buf.nbytes:
        return None
    if type(datatype) is MPI.Datatype or not isinstance(datatype, _Datatype):
        try:
            t = as_datatype(datatype, op)
        except Exception:  # noqa: BLE001 - the general path says what is wrong
            return None
    else:
        t = datatype
    forced = config.datatype_strategy if strategy is None else None  # read at each call (config's contract)
    key = (id(t), count, peer, receive)  # ints: a cheap hash; the rest is checked on the plan
    got = comm._typed_plans.get(key)
    if (got is not None and got.t is t and got.nbytes == buf.nbytes and got.strategy == strategy
            and got.forced == forced and got.generation == _strategy.generation
            and (got.dtype is buf.dtype or got.dtype == buf.dtype)):
        return got  # made for this peer, in range then (a shrink, which renumbers ranks, clears the plans)
    if not 0 <= peer < comm.transport.size and not (receive and peer == ANY_SOURCE):
        return None
    plans = comm._typed_plans
    b, t2, p = resolve(comm, buf, t, count, op, receive)  # raises as the general path does
    got = _HostPlan(t2, p, _choose(comm, b, t2, count, peer, strategy, forced), buf, strategy, forced)
    if len(plans) >= _PLANS_CAP:
        plans.clear()
    plans[key] = got
    return got


def _timeout(comm, timeout):
    """A call's ``timeout``: the one it was given, else the communicator's
    ``p2p_timeout`` (None: no bound)."""
    return getattr(comm, "p2p_timeout", None) if timeout is None else timeout


def _direct(comm, timeout):
    """The MPI transport whose :meth:`~commlib.transports.mpi.MPITransport.send_checked`
    and ``recv_checked`` a blocking typed call with a cached plan may use (a plain
    transport: not fault tolerant, no timeout for this call), else None."""
    tp = comm.transport
    if type(tp) is MPITransport and not tp.fault_tolerant and timeout is None:
        return tp
    return None


def _mpi_wire(comm, b, t, count, op) -> Wire:
    """The "mpi" strategy: ``count`` elements of the MPI datatype over ``b`` (MPI's own engine)."""
    if b.is_device and not comm.cuda_aware:
        raise DatatypeError("strategy 'mpi' on a device buffer needs CUDA-aware MPI", rank=comm.rank, op=op)
    return Wire(b.obj if b.is_device else b.byte_view(), count, comm._mpi_types.get(t))


def _prepare(comm, buf, peer, datatype, count, strategy, op, receive):
    """Validate ``(buf, datatype, count)`` and choose the strategy: ``(Buffer,
    type, plan, strategy)``, or None for ``PROC_NULL``.  The peer is checked
    first, so a bad rank is refused before anything is packed."""
    comm.transport.check_peer(peer, "source" if receive else "dest", op)
    b, t, p = resolve(comm, buf, datatype, count, op, receive)
    if peer == PROC_NULL:
        return None
    return b, t, p, _choose(comm, b, t, count, peer, strategy)


def _send_wire(comm, buf, dest, datatype, count, strategy, op) -> Wire | None:
    """Validate and pack (or not): the :class:`Wire` message to send; None for ``PROC_NULL``."""
    got = _prepare(comm, buf, dest, datatype, count, strategy, op, False)
    if got is None:
        return None
    b, t, p, s = got
    if s == "mpi":
        return _mpi_wire(comm, b, t, count, op)
    if not p.nbytes:  # nothing to pack: no 0-byte mapped, pinned or device allocation (a GPU may refuse one)
        return Wire(np.empty(0, np.uint8), 0, "packed")
    if s == "mapped" and b.is_device:
        # mapped pinned host memory the device kernel writes through its device
        # address; the stream is synchronized before MPI reads the host side
        mapped = devmem.mapped_empty(p.nbytes)
        pack(b.obj, t, count, out=mapped)
        devmem.stream_synchronize()
        return Wire(np.asarray(mapped), p.nbytes, "packed")
    packed = pack(b.obj, t, count)
    if b.is_device and s == "staged":
        host = np.empty(p.nbytes, np.uint8)
        devmem.to_host_async(packed, host, 0, p.nbytes)
        devmem.stream_synchronize()
        return Wire(host, p.nbytes, "packed")
    return Wire(packed, p.nbytes, "packed")  # the transport synchronizes device memory before sending


def _recv_wire(comm, buf, source, datatype, count, strategy, op):
    """Validate; ``(Wire to receive into, unpack(nbytes) to run on completion, or
    None)``; None for ``PROC_NULL``.

    A message may be shorter than ``count`` elements (MPI-4.0 §3.2.4: only the
    elements received are written).  ``unpack(nbytes)`` unpacks the ``nbytes``
    bytes received (every completion path knows them: the blocking receive's
    status, and the transport passes a request's byte count to its
    ``then`` callbacks) and leaves the rest of ``buf`` as it was, so the wire
    buffer starts uninitialized: nothing is packed into it before the receive.
    """
    got = _prepare(comm, buf, source, datatype, count, strategy, op, True)
    if got is None:
        return None
    b, t, p, s = got
    if s == "mpi":
        return _mpi_wire(comm, b, t, count, op), None
    n = p.nbytes
    if not n:  # nothing arrives or is unpacked (a longer message is still MPI's truncation error)
        return Wire(np.empty(0, np.uint8), 0, "packed"), None
    if b.is_device and s == "device":
        wire = devmem.device_empty(n, like=b.obj)
    elif b.is_device and s == "mapped":  # MPI writes host memory the unpack kernel reads in place
        wire = devmem.mapped_empty(n)
    else:  # host, or staged: received on the host, copied to the device, unpacked there
        wire = np.empty(n, np.uint8)
    mem = np.asarray(wire) if b.is_device and s == "mapped" else wire
    return Wire(mem, n, "packed"), lambda nbytes=None: _unpack_received(wire, t, b, count, nbytes, s)


def _to_device(host, like):
    dev = devmem.device_empty(host.shape[0], like=like)
    devmem.to_device_async(host, dev, 0, host.shape[0])
    return dev


def _unpack_received(wire, t, b, count, nbytes, s):
    """Unpack the first ``nbytes`` bytes of ``wire`` (all of it when None: a
    caller that knows no count, which no receive path of this module is) as
    elements of ``t`` into ``b``: whole elements, then the leading bytes of a
    partial one (merged into that element's current bytes); nothing else of
    ``b`` is written."""
    staged = b.is_device and s not in ("device", "mapped")
    full = count * t.size
    if nbytes is None or nbytes >= full:
        unpack(_to_device(wire, b.obj) if staged else wire, t, b.obj, count)
        return
    k, rem = divmod(nbytes, t.size)
    if k:
        whole = wire[:k * t.size]
        unpack(_to_device(whole, b.obj) if staged else whole, t, b.obj, k)
    if rem:  # a partial element (the sender's type signature differs)
        origin = k * t.extent
        cur = pack(b.obj, t, 1, origin=origin)
        if b.is_device:
            host = np.empty(t.size, np.uint8)
            devmem.to_host_async(cur, host, 0, t.size)
            tail = wire[k * t.size:nbytes]
            if not isinstance(tail, np.ndarray):
                tail_h = np.empty(nbytes, np.uint8)
                devmem.to_host_async(wire, tail_h, k * t.size, nbytes)
                devmem.stream_synchronize()
                tail = tail_h[k * t.size:nbytes]
            devmem.stream_synchronize()
            host[:rem] = tail
            unpack(_to_device(host, b.obj), t, b.obj, 1, origin=origin)
        else:
            cur[:rem] = wire[k * t.size:nbytes]
            unpack(cur, t, b.obj, 1, origin=origin)


def typed_isend(comm, buf, dest, datatype, count=1, tag=0, strategy=None) -> Request:
    """Non-blocking send of ``count`` elements of ``datatype`` from ``buf``; see module doc."""
    w = _any_send_wire(comm, buf, dest, datatype, count, strategy, "isend")
    return CompletedRequest() if w is None else comm.transport.isend(w, dest, tag)


def typed_irecv(comm, buf, source, datatype, count=1, tag=ANY_TAG, strategy=None) -> Request:
    """Non-blocking receive of ``count`` elements of ``datatype`` into ``buf``."""
    got = _any_recv_wire(comm, buf, source, datatype, count, strategy, "irecv")
    if got is None:
        return CompletedRequest()
    w, done = got
    req = comm.transport.irecv(w, source, tag)
    return req if done is None else req.then(done)  # unpack what arrived, on success only


def _any_send_wire(comm, buf, dest, datatype, count, strategy, op) -> Wire | None:
    """:func:`_send_wire`, from a cached plan when the call qualifies."""
    pl = _host_plan(comm, buf, dest, datatype, count, strategy, op, False)
    if pl is None:
        return _send_wire(comm, buf, dest, datatype, count, strategy, op)
    return _host_send_wire(comm, buf, pl, count)


def _any_recv_wire(comm, buf, source, datatype, count, strategy, op):
    """:func:`_recv_wire`, from a cached plan when the call qualifies."""
    pl = _host_plan(comm, buf, source, datatype, count, strategy, op, True)
    if pl is None:
        return _recv_wire(comm, buf, source, datatype, count, strategy, op)
    return _host_recv_wire(comm, buf, pl, count, op)


def _host_send_wire(comm, buf, pl, count) -> Wire:
    """:func:`_send_wire` for a host array with a cached plan (same bytes)."""
    if pl.s == "mpi":
        return Wire(buf, count, comm._mpi_types.get(pl.t))
    if not pl.n:
        return Wire(np.empty(0, np.uint8), 0, "packed")
    return Wire(pack(buf, pl.t, count), pl.n, "packed")


def _host_recv_wire(comm, buf, pl, count, op):
    """:func:`_recv_wire` for a host array with a cached plan."""
    if pl.s == "mpi":
        return Wire(buf, count, comm._mpi_types.get(pl.t)), None
    n = pl.n
    if not n:
        return Wire(np.empty(0, np.uint8), 0, "packed"), None
    wire = np.empty(n, np.uint8)
    return Wire(wire, n, "packed"), lambda nbytes=None: _host_unpack(comm, wire, pl.t, buf, count, nbytes, pl.s, op)


def _host_unpack(comm, wire, t, buf, count, nbytes, s, op):
    """:func:`_unpack_received` into a host array (a whole message: one unpack)."""
    if nbytes is None or nbytes >= count * t.size:
        unpack(wire, t, buf, count)
    else:
        _unpack_received(wire, t, as_buffer(buf, op=op, rank=comm.rank), count, nbytes, s)


def fast_p2p(comm, which: int, buf, peer, datatype, count, tag) -> bool:
    """A blocking typed call that repeats the last one to or from ``peer``
    (``which``: 0 :func:`typed_send`, 1 :func:`typed_recv`; strategy "mpi", no
    timeout, a plain MPI transport), made from that call's plan: one
    ``MPI_Send`` or ``MPI_Recv`` with the datatype, and True; False when it is
    not the same call (nothing sent or received).

    The same call: the same commlib type object and count (ints), a
    C-contiguous numpy ``buf`` of the same dtype and size (writeable for a
    receive), the same plain transport, forced strategy and model generation,
    and its MPI type still committed: what the plan's checks and choice read,
    checked again in one frame, a fraction of :func:`_host_plan`'s time."""
    m = comm._typed_last[which].get(peer)
    if m is None:
        return False
    pl, mcount, mt, tp = m
    if (pl.t is not datatype or type(count) is not int or count != mcount or type(buf) is not np.ndarray
            or buf.dtype is not pl.dtype or buf.nbytes != pl.nbytes or tp is not comm.transport):
        return False
    flags = buf.flags
    if (not flags.c_contiguous or (which and not flags.writeable) or pl.generation != _strategy.generation
            or pl.forced != config.datatype_strategy or comm._mpi_types.types.get(pl.t) is not mt):
        return False
    if which:
        tp.recv_checked((buf, count, mt), peer, tag, status=False)
    else:
        tp.send_checked((buf, count, mt), peer, tag)
    return True


def typed_send(comm, buf, dest, datatype, count=1, tag=0, strategy=None, timeout=None) -> None:
    """Blocking send of ``count`` elements of ``datatype`` from ``buf``; ``timeout``
    seconds (None: the communicator's ``p2p_timeout``)."""
    timeout = _timeout(comm, timeout)
    pl = _host_plan(comm, buf, dest, datatype, count, strategy, "send", False)
    if pl is None:
        w = _send_wire(comm, buf, dest, datatype, count, strategy, "send")
        tp = None
    else:
        tp = _direct(comm, timeout)
        if tp is not None and pl.s == "mpi":  # the hot path: MPI's own datatype engine, nothing staged
            mt = comm._mpi_types.get(pl.t)
            tp.send_checked((buf, count, mt), dest, tag)
            if strategy is None and pl.t is datatype:
                comm._typed_last[0][dest] = (pl, count, mt, tp)  # fast_p2p's, next time
            return
        w = _host_send_wire(comm, buf, pl, count)
    if tp is not None:  # the plan checked what MPITransport.send checks: its MPI step alone
        tp.send_checked(w, dest, tag)
    elif w is not None:
        comm.transport.send(w, dest, tag, timeout=timeout)


def typed_recv(comm, buf, source, datatype, count=1, tag=ANY_TAG, strategy=None, timeout=None) -> None:
    """Blocking receive of ``count`` elements of ``datatype`` into ``buf``; ``timeout``
    as :func:`typed_send`'s."""
    timeout = _timeout(comm, timeout)
    pl = _host_plan(comm, buf, source, datatype, count, strategy, "recv", True)
    if pl is None:
        got = _recv_wire(comm, buf, source, datatype, count, strategy, "recv")
        tp = None
    else:
        tp = _direct(comm, timeout)
        if tp is not None and pl.s == "mpi":  # the hot path: MPI writes what arrives, no status to read
            mt = comm._mpi_types.get(pl.t)
            tp.recv_checked((buf, count, mt), source, tag, status=False)
            if strategy is None and pl.t is datatype:
                comm._typed_last[1][source] = (pl, count, mt, tp)  # fast_p2p's, next time
            return
        got = _host_recv_wire(comm, buf, pl, count, "recv")
    if got is None:
        return
    if tp is not None:  # as for the send: MPITransport.recv's MPI step alone
        status = tp.recv_checked(got[0], source, tag)
    else:
        status = comm.transport.recv(got[0], source, tag, timeout=timeout)
    if got[1] is not None:
        # the bytes that arrived (a message may be shorter than count elements)
        got[1](status.Get_count(MPI.BYTE) if isinstance(status, MPI.Status) else None)


def typed_sendrecv(comm, sendbuf, dest, recvbuf, source, sendtag, recvtag, sendtype=None, sendcount=1,
                   recvtype=None, recvcount=1, strategy=None, timeout=None) -> None:
    """``sendrecv`` where either side has a datatype (the other, if None, sends
    or receives the buffer's bytes).  Both sides are validated (and the send
    packed) before either message is posted, so a bad argument on one side
    leaves no receive or send behind."""
    op = "sendrecv"
    tp = comm.transport
    if recvtype is not None:
        got = _any_recv_wire(comm, recvbuf, source, recvtype, recvcount, strategy, op)
        rwire, done = got if got is not None else (None, None)
    else:
        tp.check(recvbuf, source, op, receive=True)
        rwire, done = recvbuf, None
    if sendtype is not None:
        swire = _any_send_wire(comm, sendbuf, dest, sendtype, sendcount, strategy, op)
    else:
        tp.check(sendbuf, dest, op)
        swire = sendbuf
    reqs = []
    if rwire is not None and source != PROC_NULL:
        r = tp.irecv(rwire, source, recvtag)
        reqs.append(r if done is None else r.then(done))
    if swire is not None and dest != PROC_NULL:
        reqs.append(tp.isend(swire, dest, sendtag))
    tp.waitall(reqs, _timeout(comm, timeout), op=op)
