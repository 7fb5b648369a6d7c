"""The heat solver's command line stopped by a signal and resumed (``--checkpoint``, ``--resume``),
as one process of its own: SIGTERM sent by the test once the app says it catches it; exit status 75,
a checkpoint of a step before the last; the resume ends with the field of plain numpy FTCS steps
(the test's own loop), bit for bit. And the refusals: one line, exit status 2, nothing run.
(Under Slurm, with a requeue and another rank count: tests/test_slurm.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from oracles import ftcs_heat  # noqa: E402 - tests/oracles.py
from waiting import wait_until  # noqa: E402 - tests/waiting.py

GRID, STEPS = 10, 20000  # steps: the first run must still be going when the signal comes
ARGS = ["--dims", "3", "--grid", str(GRID), "--steps", str(STEPS), "--backend", "numpy", "--no-progress"]


def _env():
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_COMM", "PMIX_", "PRTE_", "PMI_", "SLURM_"))}


def _heat(*args, **kw):
    return subprocess.run([sys.executable, "-P", "-m", "commlib.apps.heat", *args], capture_output=True, text=True,
                          env=_env(), timeout=120, **kw)


def _ftcs(n, steps):
    """``steps`` FTCS steps (alpha 1, cfl 0.5) on ``n``^3 interior points from sin sin sin, zero boundary."""
    h = 1.0 / (n + 1)
    dt = 0.5 / (2 * 3 / h ** 2)
    c = 1.0 * dt / h ** 2
    return ftcs_heat((n, n, n), (c, c, c), steps)


@pytest.mark.timeout(200)
def test_sigterm_checkpoints_and_the_resume_ends_with_the_uninterrupted_field(tmp_path):
    ck = tmp_path / "ck"
    log = tmp_path / "err.txt"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-P", "-m", "commlib.apps.heat", *ARGS, "--checkpoint", str(ck)],
                             stdout=subprocess.PIPE, stderr=err, text=True, env=_env())
        try:
            wait_until(lambda: "heat: on SIGUSR1 or SIGTERM" in log.read_text() or p.poll() is not None, 100,
                       "the stop-signal line")
            p.terminate()  # SIGTERM
            rc = p.wait(timeout=100)
        finally:
            if p.poll() is None:
                p.kill()
    text = log.read_text()
    assert rc == 75, text
    with np.load(ck / "heat.npz") as z:
        meta = json.loads(str(z["meta"]))
    assert 1 <= meta["step"] < STEPS and meta["ranks"] == 1, meta
    assert f"heat: SIGTERM: stopped after step {meta['step']} of {STEPS}" in text, text
    out = tmp_path / "r.json"
    r = _heat(*ARGS, "--checkpoint", str(ck), "--resume", str(ck), "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["steps"] == STEPS and res["extra"]["resumed"]["from_step"] == meta["step"], res
    with np.load(ck / "heat.npz") as z:
        field, meta = z["field"], json.loads(str(z["meta"]))
    assert meta["step"] == STEPS
    assert np.array_equal(field, _ftcs(GRID, STEPS))


@pytest.mark.timeout(100)
@pytest.mark.parametrize("case", ["no-checkpoint", "other-grid", "fault-tolerant", "time-block"])
def test_refusals_are_one_line_exit_2(case, tmp_path):
    ck = tmp_path / "ck"
    if case == "other-grid":
        short = [a if a != str(STEPS) else "3" for a in ARGS]
        assert _heat(*short, "--checkpoint", str(ck)).returncode == 0  # a finished run's checkpoint
    argv = {"no-checkpoint": [*ARGS, "--resume", str(tmp_path)],
            "other-grid": ["--dims", "3", "--grid", "11", "--steps", "3", *ARGS[6:], "--resume", str(ck)],
            "fault-tolerant": [*ARGS, "--checkpoint", str(ck), "--fault-tolerant"],
            "time-block": [*ARGS[:-3], "--backend", "numba", "--time-block", "2", "--checkpoint", str(ck)]}[case]
    r = _heat(*argv)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("heat: error: "), r.stderr
    word = {"no-checkpoint": "no checkpoint", "other-grid": "another run", "fault-tolerant": "--fault-tolerant",
            "time-block": "--time-block 1"}[case]
    assert word in r.stderr, r.stderr
