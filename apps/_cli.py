"""Command-line plumbing shared by the apps.

Light on purpose: a command line is parsed and checked before anything
imports mpi4py.MPI (loading the MPI library), numba or CuPy, so a refusal
costs only the interpreter's start.  The job's rank and size come from the
launcher's environment until MPI is up.
"""
from __future__ import annotations

import sys

from commlib.cli import RANK_VARS, SIZE_VARS, env_int, unwritable  # noqa: F401 (light: no MPI)
from commlib.cli import OneLineParser as _BaseParser

__all__ = ["OneLineParser", "world_rank", "world_size", "unwritable"]


class OneLineParser(_BaseParser):
    """argparse, but a refusal is one line on stderr (``NAME: error: ...``),
    printed by rank 0 only (MPI's rank once MPI is up, else the launcher's),
    then ``SystemExit(2)``; every rank parses the same command line, so every
    rank exits alike, before MPI communicates.

    Args:
        name: the short name in the error line (``heat``, ``attention``).
        **kwargs: as for :class:`argparse.ArgumentParser`.
    """

    def __init__(self, name: str, **kwargs):
        super().__init__(name, **kwargs)

    def rank(self) -> int:
        return world_rank()


def _mpi_world():
    """mpi4py's COMM_WORLD when MPI is already initialized, else None (never
    imports mpi4py.MPI: that loads the MPI library)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi.COMM_WORLD
    except Exception:  # noqa: BLE001
        pass
    return None


def world_rank() -> int:
    """This process's rank in MPI's world: from MPI when it is initialized, else
    from the launcher's environment (0 without a launcher)."""
    world = _mpi_world()
    if world is not None:
        return world.Get_rank()
    rank = env_int(RANK_VARS)
    return 0 if rank is None else rank


def world_size() -> int | None:
    """The number of ranks in MPI's world: from MPI when it is initialized, else
    from the launcher's environment; None when neither tells (no launcher, a
    singleton of 1 rank, or one that names no size: check again once MPI is
    up)."""
    world = _mpi_world()
    if world is not None:
        return world.Get_size()
    return env_int(SIZE_VARS)
