"""Checkpoints of the heat solver's command line: stop on a signal, requeue, resume.

With ``--checkpoint DIR`` the run writes ``DIR/heat.npz`` (the gathered field
and what it is the field of) when SIGUSR1 or SIGTERM stopped it after a step
(every rank agrees on that step: :class:`commlib.apps._cli.StopSignals`), and
at its end; ``--resume DIR`` continues from it on any rank count.  The field
is float64, whole (rank 0 gathers it and writes: a temporary file, fsync,
:func:`os.replace`), and every rank of the resumed run reads it: a shared
file system, or one machine.  The arithmetic of each cell is the same
whatever the decomposition, so a resumed run ends with the field of an
uninterrupted one, bit for bit.

Only numpy here: a command line checks ``--resume`` before MPI starts.
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np

__all__ = ["FILE", "FORMAT", "VERSION", "describe", "check_resume", "read_checkpoint", "write_checkpoint"]

#: the checkpoint's name in its folder
FILE = "heat.npz"
FORMAT = "commlib.apps.heat checkpoint"
VERSION = 1


def describe(grid, steps, alpha, cfl, dt) -> dict:
    """What a checkpoint must match to be continued: the grid, the run's steps,
    ``alpha``, ``cfl`` and the time step ``dt`` (JSON values)."""
    return dict(grid=[int(n) for n in grid], steps=int(steps), alpha=float(alpha), cfl=float(cfl), dt=float(dt))


def write_checkpoint(directory: str, step: int, field, run: dict, ranks: int) -> str:
    """Write ``field`` (the whole grid after ``step`` steps) of the run ``run``
    (:func:`describe`) atomically into ``directory`` (made if missing);
    returns the path.  Raises OSError (the previous checkpoint is then kept)."""
    os.makedirs(directory, exist_ok=True)
    meta = dict(format=FORMAT, version=VERSION, step=int(step), ranks=int(ranks), **run)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, field=np.ascontiguousarray(field, dtype=np.float64), meta=np.array(json.dumps(meta)))
            fh.flush()
            os.fsync(fh.fileno())
        path = os.path.join(directory, FILE)
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            os.unlink(tmp)
    return path


def read_checkpoint(directory: str):
    """``(meta, field)`` of ``directory``'s checkpoint.  Raises ValueError with
    one line: no checkpoint, or not a readable one."""
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint in {directory} (no {FILE})")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta, field = json.loads(str(z["meta"])), z["field"]
    except Exception as exc:  # noqa: BLE001 - truncated, not a zip, no such member: one line
        raise ValueError(f"{path} is not a readable heat checkpoint ({' '.join(str(exc).split())[:120]})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path} is not a heat checkpoint of format version {VERSION}")
    if list(field.shape) != meta.get("grid") or field.dtype != np.float64:
        raise ValueError(f"{path} is corrupted: a field of shape {list(field.shape)} for grid {meta.get('grid')}")
    return meta, field


def check_resume(meta: dict, run: dict) -> str | None:
    """What stops the checkpoint ``meta`` continuing the run ``run`` (:func:`describe`), in one
    line, or None."""
    diff = []
    for k in ("grid", "steps", "alpha", "cfl", "dt"):
        a, b = meta.get(k), run[k]
        if a != b:  # the floats bit for bit: the same arithmetic or none
            diff.append(f"{k} {a} in the checkpoint, {b} in this run")
    if not diff and not 0 <= int(meta.get("step", -1)) <= run["steps"]:
        diff.append(f"step {meta.get('step')} is not a step of this run")
    return "the checkpoint is of another run: " + "; ".join(diff) if diff else None
