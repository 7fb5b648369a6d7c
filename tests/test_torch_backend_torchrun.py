"""The ``"commlib"`` torch.distributed backend under torchrun, with no MPI: every
check of tests/torch_backend_checks.py (float64 oracles, mismatched calls on
every rank, sub-groups and meshes) in 2 and 3 workers that find each other
through torch's store and talk over commlib's TCP transport.  Runs with mpi4py
made unimportable (tests/no_mpi first on PYTHONPATH, the workers inherit it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
import torch_backend_checks as checks  # noqa: E402

pytestmark = pytest.mark.timeout(300)
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("n", [2, 3])
def test_every_check_under_torchrun(n, seed):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           os.path.join(HERE, "torch_backend_worker.py"), str(seed)]
    proc = subprocess.run(cmd,
                          capture_output=True, text=True, timeout=240, env=env, cwd=HERE)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(n):
        assert f"rank {r} transport TCPCommunicator mpi4py loaded: False" in out, out[-4000:]
        for check in checks.ALL:
            assert f"rank {r} ok {check.__name__}" in out, out[-4000:]
