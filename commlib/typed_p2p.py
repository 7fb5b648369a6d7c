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
"""
from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI

from commlib.core.buffer import as_buffer
from commlib.core.errors import DatatypeError
from commlib.transports.base import CompletedRequest, Request
from commlib.transports.mpi import MPIRequest

__all__ = ["typed_send", "typed_recv", "typed_isend", "typed_irecv", "locality_of", "resolve"]


def resolve(comm, buf, datatype, count, op):
    """Validate ``(buf, datatype, count)``; returns ``(Buffer, commlib type, plan)``.

    Raises:
        DatatypeError: the datatype is unusable or ``count`` elements do not fit
            ``buf`` (bytes touched outside it); raised before any byte moves.
        BufferError: ``buf`` is not contiguous in memory.
    """
    from commlib.datatypes import as_datatype, plan_for  # noqa: PLC0415

    try:
        t = as_datatype(datatype, op)
    except DatatypeError as exc:
        raise DatatypeError(exc.detail, rank=comm.rank, op=op) from None
    if not isinstance(count, (int, np.integer)) or count < 0:
        raise DatatypeError(f"count must be a non-negative int, got {count!r}", rank=comm.rank, op=op)
    b = as_buffer(buf, op=op, rank=comm.rank)
    if not b.dense:
        raise DatatypeError("buffer must be contiguous in memory; the datatype describes the layout",
                            rank=comm.rank, op=op)
    p = plan_for(t, int(count))
    if p.nbytes and (p.lo < 0 or p.hi > b.nbytes):
        raise DatatypeError(
            f"{count} element(s) of {t!r} touch bytes [{p.lo}, {p.hi}) but the buffer holds {b.nbytes}; "
            "nothing was sent", rank=comm.rank, op=op)
    return b, t, p


def locality_of(comm, peer: int) -> str:
    """``"intra"`` when ``peer`` shares this rank's node, else ``"inter"``."""
    peers = comm.__dict__.get("_node_peers")
    if peers is None:
        peers = comm.__dict__["_node_peers"] = _node_peers(comm.mpi_comm)
    return "intra" if peer in peers else "inter"


_node_cache: dict = {}


def _node_peers(mpi_comm) -> frozenset:
    key = mpi_comm.py2f()
    got = _node_cache.get(key)
    if got is None:
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        ranks = MPI.Group.Translate_ranks(node.Get_group(), list(range(node.Get_size())), mpi_comm.Get_group())
        node.Free()
        got = _node_cache[key] = frozenset(ranks)
    return got


@functools.lru_cache(maxsize=None)
def _mpi_type_cached(t):
    return t.to_mpi()


def _choose(comm, b, t, count, peer, strategy):
    if strategy is not None:
        return strategy
    if not _FORCED():
        memo = comm.__dict__.setdefault("_strategy_memo", {})
        from commlib.datatypes import strategy as _strategy  # noqa: PLC0415

        key = (id(t), count, b.is_device, peer, _strategy.generation)
        got = memo.get(key)
        if got is not None and got[0] is t:
            return got[1]
        s = _choose_uncached(comm, b, t, count, peer)
        if len(memo) < 4096:
            memo[key] = (t, s)
        return s
    return _choose_uncached(comm, b, t, count, peer)


def _FORCED():  # noqa: N802
    import os  # noqa: PLC0415

    return os.environ.get("COMMLIB_DATATYPE_STRATEGY")


def _choose_uncached(comm, b, t, count, peer):
    from commlib.datatypes.strategy import default_model  # noqa: PLC0415

    loc = "intra" if peer in (MPI.PROC_NULL, MPI.ANY_SOURCE) else locality_of(comm, peer)
    return default_model().choose(t, count, device=b.is_device, locality=loc, cuda_aware=comm.cuda_aware)


def _mpi_spec(comm, b, t, count, op):
    """``[buffer, count, MPI datatype]`` for the "mpi" strategy (MPI's own engine)."""
    if b.is_device and not comm.cuda_aware:
        raise DatatypeError("strategy 'mpi' on a device buffer needs CUDA-aware MPI", rank=comm.rank, op=op)
    b.synchronize()
    return [b.obj if b.is_device else b.byte_view(), count, _mpi_type_cached(t)]


def _pack_out(b, p, strategy):
    if strategy in ("pack", "staged", "device"):
        return None
    from numba import cuda  # noqa: PLC0415  - "mapped": pinned host memory the kernel writes

    return cuda.mapped_array(p.nbytes, np.uint8)


def _prepare_send(comm, buf, dest, datatype, count, strategy, op):
    """Validate and pack (or not): returns the MPI buffer spec to send and what
    must stay alive until the send completes; None for ``PROC_NULL``."""
    from commlib.datatypes import pack  # noqa: PLC0415

    comm.transport._check_peer(dest, "dest", op)
    b, t, p = resolve(comm, buf, datatype, count, op)
    if dest == MPI.PROC_NULL:
        return None
    s = _choose(comm, b, t, count, dest, strategy)
    if s == "mpi":
        return _mpi_spec(comm, b, t, count, op), b
    packed = pack(b.obj, t, count, out=_pack_out(b, p, s))
    if b.is_device and s in ("staged", "mapped"):
        if s == "staged":
            packed = packed.copy_to_host()
        else:
            from numba import cuda  # noqa: PLC0415

            cuda.synchronize()
            packed = np.asarray(packed.copy_to_host() if hasattr(packed, "copy_to_host") else packed)
    elif b.is_device:
        as_buffer(packed).synchronize()
    return [packed, p.nbytes, MPI.PACKED], packed


def _prepare_recv(comm, buf, source, datatype, count, strategy, op):
    """Validate; returns ``(MPI buffer spec, on_complete or None, keep)``, None for ``PROC_NULL``."""
    from commlib.datatypes import unpack  # noqa: PLC0415

    comm.transport._check_peer(source, "source", op)
    b, t, p = resolve(comm, buf, datatype, count, op)
    if source == MPI.PROC_NULL:
        return None
    s = _choose(comm, b, t, count, source, strategy)
    if s == "mpi":
        return _mpi_spec(comm, b, t, count, op), None, b
    if b.is_device and s == "device":
        from numba import cuda  # noqa: PLC0415

        wire = cuda.device_array(p.nbytes, np.uint8)
        done = lambda: unpack(wire, t, b.obj, count)  # noqa: E731
    elif b.is_device:
        wire = np.empty(p.nbytes, np.uint8)

        def done():
            from numba import cuda  # noqa: PLC0415

            unpack(cuda.to_device(wire), t, b.obj, count)
    else:
        wire = np.empty(p.nbytes, np.uint8)
        done = lambda: unpack(wire, t, b.obj, count)  # noqa: E731
    return [wire, p.nbytes, MPI.PACKED], done, wire


def typed_isend(comm, buf, dest, datatype, count=1, tag=0, strategy=None) -> Request:
    """Non-blocking send of ``count`` elements of ``datatype`` from ``buf``; see module doc."""
    got = _prepare_send(comm, buf, dest, datatype, count, strategy, "isend")
    if got is None:
        return CompletedRequest()
    spec, keep = got
    return MPIRequest(comm.mpi_comm.Isend(spec, dest, tag), keep=keep)


def typed_irecv(comm, buf, source, datatype, count=1, tag=MPI.ANY_TAG, strategy=None) -> Request:
    """Non-blocking receive of ``count`` elements of ``datatype`` into ``buf``."""
    got = _prepare_recv(comm, buf, source, datatype, count, strategy, "irecv")
    if got is None:
        return CompletedRequest()
    spec, done, keep = got
    return MPIRequest(comm.mpi_comm.Irecv(spec, source, tag), on_complete=done, keep=keep)


def typed_send(comm, buf, dest, datatype, count=1, tag=0, strategy=None) -> None:
    """Blocking send of ``count`` elements of ``datatype`` from ``buf``."""
    got = _prepare_send(comm, buf, dest, datatype, count, strategy, "send")
    if got is not None:
        comm.mpi_comm.Send(got[0], dest, tag)


def typed_recv(comm, buf, source, datatype, count=1, tag=MPI.ANY_TAG, strategy=None) -> None:
    """Blocking receive of ``count`` elements of ``datatype`` into ``buf``."""
    got = _prepare_recv(comm, buf, source, datatype, count, strategy, "recv")
    if got is not None:
        comm.mpi_comm.Recv(got[0], source, tag)
        if got[1] is not None:
            got[1]()
