"""Command-line plumbing shared by the apps."""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["OneLineParser", "world_rank", "unwritable"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a refusal is one line on stderr (``NAME: error: ...``),
    printed by rank 0 only, then ``SystemExit(2)``; every rank parses the same
    command line, so every rank exits alike, before MPI communicates.

    Args:
        name: the short name in the error line (``heat``, ``attention``).
        **kwargs: as for :class:`argparse.ArgumentParser`.
    """

    def __init__(self, name: str, **kwargs):
        super().__init__(**kwargs)
        self.short_name = name

    def error(self, message):  # noqa: D401 - argparse's hook
        if world_rank() == 0:
            sys.stderr.write(f"{self.short_name}: error: {message}\n")
            sys.stderr.flush()
        raise SystemExit(2)


def world_rank() -> int:
    """This process's rank in MPI's world (0 when MPI is not usable)."""
    try:
        from mpi4py import MPI  # noqa: PLC0415 - initialized by commlib's import

        return MPI.COMM_WORLD.Get_rank()
    except Exception:  # noqa: BLE001
        return 0


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (None when it can), without creating it;
    for checking ``--json``/``--plot`` paths before a run."""
    if not path:
        return "empty path"
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "not writable"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"directory {parent} is not writable"
