"""``Communicator.dup`` of a fault-tolerant communicator after a peer died raises
:class:`commlib.ProcessFailed` naming the dead rank on every survivor, as every
other call does: Open MPI leaves an internal code (-2) in the failed
``MPI_Comm_idup`` requests' statuses, which ``MPI_Error_class`` refuses; that
refusal must not escape as an ``mpi4py.MPI.Exception``.

Each job: 3 ranks under ``mpiexec --with-ft ulfm``; rank 1 exits at once, ranks 0
and 2 call ``dup`` after a random delay and write what it raised.
"""
import json
import os
import sys
import time
from pathlib import Path

if __name__ != "__main__":
    import pytest

    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    from launch import FINALIZE_TIMEOUT, FT_ARGS, run_job  # tests/launch.py

    BIN = Path(sys.executable).parent

    def _ulfm():
        from commlib.core.device import ulfm_available

        return "Open MPI" in MPI.Get_library_version() and ulfm_available()

    @pytest.mark.timeout(120)
    @pytest.mark.skipif("not _ulfm()", reason="needs Open MPI with ULFM")
    @pytest.mark.parametrize("trial", range(3))
    def test_dup_after_a_death_raises_process_failed(trial, tmp_path):
        env = dict(os.environ, OUT=str(tmp_path), SEED=str(trial), OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", COMMLIB_FINALIZE_TIMEOUT=FINALIZE_TIMEOUT)
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        cmd = [str(BIN / "mpiexec"), "--oversubscribe", *FT_ARGS, "-n", "3", sys.executable, "-P", __file__]
        rc, text = run_job(cmd, env, 60, started=lambda _t: any(tmp_path.glob("rank*.json")))
        assert rc is not None, f"the job hung:\n{text[-3000:]}"
        res = {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}
        assert sorted(res) == [0, 2], text[-3000:]
        for r, got in res.items():
            assert got["error"] == "ProcessFailed", (r, got)
            assert 1 in got["failed"], (r, got)
            assert got["message"].startswith(f"rank {r}: dup: "), (r, got)


if __name__ == "__main__":
    import random

    import commlib

    comm = commlib.init(fault_tolerant=True, timeout=20.0)
    if comm.rank == 1:
        os._exit(0)
    random.seed(int(os.environ["SEED"]) * 10 + comm.rank)
    time.sleep(random.uniform(0.1, 0.6))
    out = {"error": None}
    try:
        comm.dup()
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        out = {"error": type(exc).__name__, "message": str(exc), "failed": list(getattr(exc, "failed", ()))}
    Path(os.environ["OUT"], f"rank{comm.rank}.json").write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)
