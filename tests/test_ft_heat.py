"""The heat solver survives killed ranks (``--fault-tolerant``, ULFM only).

Each case launches ``python -m commlib.apps.heat --fault-tolerant --verify``
under ``mpiexec --with-ft ulfm`` with ranks SIGKILLed mid-run, and checks that
the survivors finish, that the field equals a single-process (failure-free) run
bit for bit, and that the error against the exact solution equals the
failure-free run's.  Hard timeouts: a hang fails the test instead of CI.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import mpi4py

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from commlib.core.device import ulfm_available  # noqa: E402
from launch import FINALIZE_TIMEOUT, FT_ARGS, LAUNCH_ATTEMPTS, launcher_failed  # noqa: E402 - tests/launch.py

pytestmark = pytest.mark.skipif(not ("Open MPI" in MPI.Get_library_version() and ulfm_available()),
                                reason="needs Open MPI with ULFM")
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def _heat(n, args, ft=True, timeout=90):
    out = tempfile.mktemp(suffix=".json")
    cmd = [MPIEXEC, "--oversubscribe"]
    if ft:
        cmd += FT_ARGS
    cmd += ["-n", str(n), sys.executable, "-P", "-m", "commlib.apps.heat", "--json", out, "--no-progress"] + args
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    for _ in range(LAUNCH_ATTEMPTS):
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            text = p.communicate(timeout=timeout)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"heat did not finish within {timeout} s: {cmd}")
        if not launcher_failed(text, os.path.exists(out)):
            break
    assert os.path.exists(out), text[-3000:]
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    return res, text


CASES = [
    (4, ["--dims", "2", "--grid", "64", "--steps", "200", "--backend", "numpy"], ["2:57"]),
    (4, ["--dims", "2", "--grid", "48", "--steps", "100", "--backend", "numpy"], ["0:40"]),  # rank 0, at a checkpoint step
    (5, ["--dims", "3", "--grid", "24", "--steps", "120", "--backend", "numba"], ["1:33", "4:80"]),  # two, apart
    (6, ["--dims", "2", "--grid", "60", "--steps", "100", "--backend", "numpy"], ["3:10", "5:10"]),  # two at once
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n,args,kills", CASES)
def test_heat_survives_kills(n, args, kills):
    ref, _ = _heat(n, args + ["--fault-tolerant", "--checkpoint-every", "20"])  # no failure
    kill_args = [a for k in kills for a in ("--kill", k)]
    res, text = _heat(n, args + ["--fault-tolerant", "--checkpoint-every", "20", "--verify"] + kill_args)
    lost = sorted(int(k.split(":")[0]) for k in kills)
    assert res["extra"]["failed"] == lost, text[-2000:]
    assert res["ranks"] == n - len(lost)
    assert res["verified"] is True, text[-2000:]  # bit-identical to one process, failure-free
    # the field is bit-identical (verified); the norm sums blocks of another decomposition
    assert res["l2_error"] == pytest.approx(ref["l2_error"], rel=1e-12)
    assert res["max_error"] == ref["max_error"]
    assert res["rel_l2_error"] < 1e-3
    assert all(t < 2.0 for t in res["extra"]["recovery_s"])


@pytest.mark.timeout(120)
def test_heat_ft_without_failure_matches_plain():
    args = ["--dims", "2", "--grid", "40", "--steps", "60", "--backend", "numpy"]
    plain, _ = _heat(3, args, ft=False)
    ft, _ = _heat(3, args + ["--fault-tolerant"])
    assert ft["l2_error"] == pytest.approx(plain["l2_error"], rel=1e-12) and ft["extra"]["failed"] == []
