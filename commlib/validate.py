"""Collective argument checks: fail on every rank alike, before any byte moves.

A bad argument on one rank (a field allocated with the wrong remainder, say)
must not leave the other ranks blocked in a receive.  :func:`check_all` lets
each rank state its local problem (or None) and raises on every rank when any
rank has one.
"""
from __future__ import annotations

import numpy as np

from .core.errors import InvalidArgument

__all__ = ["check_all"]


def check_all(comm, problem: str | None, op: str, exc_type=InvalidArgument) -> None:
    """Collectively check a local condition.

    Args:
        comm: a commlib Communicator (uses its ``mpi_comm``) or an ``MPI.Comm``.
        problem: this rank's problem, or None when its arguments are fine.
        op: operation name for the message.
        exc_type: the CommError subclass to raise.

    Raises:
        exc_type: on every rank when any rank has a problem: the rank with the
            problem reports it, the others name the rank(s) that rejected the
            call. One ``Allgather`` of one int per rank; nothing is pickled.
    """
    from mpi4py import MPI  # noqa: PLC0415

    mpi_comm = getattr(comm, "mpi_comm", comm)
    size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    flags = np.zeros(size, dtype=np.int32)
    mine = np.array([1 if problem else 0], dtype=np.int32)
    mpi_comm.Allgather([mine, MPI.INT], [flags, MPI.INT])
    bad = [int(r) for r in np.flatnonzero(flags)]
    if not bad:
        return
    if problem:
        raise exc_type(problem, rank=rank, op=op)
    raise exc_type(f"rank(s) {bad} rejected the call (see their error); nothing was sent", rank=rank, op=op)
