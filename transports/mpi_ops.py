"""Reductions, grid shapes and persistent collectives for the MPI transport:
``MPI.Op`` by name, the native collectives' op for a dtype, the reverse lookup
registered with :func:`commlib.transports.base.register_op_names``,
``MPI_Dims_create``, the node map after a shrink, and the persistent all-gather
of :meth:`~commlib.transports.mpi.MPITransport.allgather_plan`."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import to_numpy_dtype

from commlib.core.errors import InvalidArgument

from .failures import raise_classified

from .base import register_op_names

__all__ = ["mpi_op", "native_op", "op_name", "dims_create", "shrunk_node_peers", "persistent_allgather",
           "free_plans"]


_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
        "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}


def mpi_op(name: str) -> MPI.Op:
    """The ``MPI.Op`` of a reduction named ``name`` (``"avg"``: ``MPI_SUM``; divide afterwards)."""
    return _OPS[name]


#: integer dtypes whose ``MPI_SUM`` Open MPI's ``op/avx`` component computes with
#: saturating vector adds (``vpaddsb``/``vpaddsw``), so a sum that overflows clamps
#: at the type's bound instead of wrapping as numpy, and every commlib algorithm,
#: does (200 + 200 as uint8: 255, not 144; from 64 elements on; open-mpi/ompi#8045,
#: closed "wontfix").
_SATURATING = frozenset(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16))
_wrapping_sum_op: MPI.Op | None = None


def _wrapping_sum(inbuf, inoutbuf, datatype) -> None:
    """A user-defined ``MPI_SUM`` for :data:`_SATURATING` dtypes: numpy's wrapping add."""
    dtype = to_numpy_dtype(datatype)
    a = np.frombuffer(inbuf, dtype)
    b = np.frombuffer(inoutbuf, dtype)
    np.add(a, b, out=b)


def native_op(name: str, dtype) -> MPI.Op:
    """The ``MPI.Op`` the native collectives reduce ``dtype`` with for ``name``:
    :func:`mpi_op`'s, except a sum (``"sum"``, ``"avg"``) of 8- and 16-bit
    integers, which goes through a user-defined commutative op (numpy's add,
    created once, on every rank alike whatever its CPU) because Open MPI's AVX
    reduction saturates those (:data:`_SATURATING`).  That op runs in Python:
    slower than the library's, but the same bits as the ring and recursive
    doubling."""
    global _wrapping_sum_op
    if name in ("sum", "avg") and np.dtype(dtype) in _SATURATING:
        if _wrapping_sum_op is None:
            _wrapping_sum_op = MPI.Op.Create(_wrapping_sum, commute=True)
        return _wrapping_sum_op
    return _OPS[name]


@register_op_names
def op_name(op) -> str | None:
    """The name (``"sum"``...) of a predefined ``MPI.Op`` such as ``MPI.SUM``, or None.

    Registered with :func:`commlib.transports.base.register_op_names` when this
    module is imported, so the collectives (``commlib.collectives.ops.get_op``)
    accept ``MPI.Op`` objects without importing MPI themselves."""
    if not isinstance(op, MPI.Op):
        return None
    for name, o in _OPS.items():
        if name != "avg" and op == o:
            return name
    return None


def dims_create(nnodes: int, dims) -> tuple[int, ...]:
    """A balanced Cartesian grid of ``nnodes`` ranks (``MPI_Dims_create``, MPI-4.0 §8.5.2);
    ``dims``: one entry per dimension, 0 where free.

    Raises:
        InvalidArgument: ``nnodes`` cannot be split so.
    """
    d = [int(x) for x in dims]
    try:
        return tuple(int(x) for x in MPI.Compute_dims(int(nnodes), d))
    except MPI.Exception as exc:
        raise InvalidArgument(f"{nnodes} ranks cannot fill dims {d}: {exc}", op="compute_dims") from None


def shrunk_node_peers(node_peers, kept) -> frozenset:
    """The node peers after a shrink: new rank ``i`` was rank ``kept[i]`` before
    it, and is on this rank's node exactly when that rank was."""
    return frozenset(i for i, old in enumerate(kept) if old in node_peers)


def persistent_allgather(comm: MPI.Comm, sendbuf, recvbuf, rank: int, keep: list):
    """A function that runs one ``MPI_Allgather_init`` request (MPI-4.0 §6.12,
    persistent collectives) of ``sendbuf`` into ``recvbuf`` (host arrays) each
    time it is called: ``Start`` then ``Wait``, an MPI error classified as
    ``native_allgather``'s.  The request is appended to ``keep`` (for
    :func:`free_plans`).  None where the library or mpi4py has no persistent
    collectives (MPI before 4.0): every rank alike, the library being one."""
    try:
        req = comm.Allgather_init(sendbuf, recvbuf)
    except (AttributeError, NotImplementedError, MPI.Exception):
        return None
    keep.append(req)
    start, wait = req.Start, req.Wait

    def run() -> None:
        try:
            start()
            wait()
        except MPI.Exception as exc:
            raise_classified(exc, (), rank, "allgather")

    return run


def free_plans(requests: list) -> None:
    """Free the (inactive) persistent requests of :func:`persistent_allgather`."""
    while requests:
        try:
            requests.pop().Free()
        except MPI.Exception:  # noqa: PERF203 - a revoked or failed communicator: nothing left to free
            pass
