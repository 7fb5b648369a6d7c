"""The benchmarks' command lines: a bad value is one line on stderr and exit status 2.

Before, ``bench_allreduce.py --trials 0`` ended in a ZeroDivisionError traceback,
``bench_heat.py --steps -1`` printed negative MLUPS, ``bench_ft.py overhead
--trials 0`` printed NaN ratios, ``bench_allreduce.py --min-bytes -5`` ran until
killed and ``bench_halo3d.py --radius 0`` raised from inside MPI.  Each case runs
the script in a fresh interpreter, as a user would, and checks the status, that
stderr is one line naming the option, and that nothing was printed on stdout (no
benchmark ran).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

CASES = [
    ("bench_allreduce.py", ["--trials", "0"], "--trials: must be 1..10000 trials, got 0"),
    ("bench_allreduce.py", ["--min-bytes", "-5"], "--min-bytes: must be 4.."),
    ("bench_allreduce.py", ["--min-bytes", "100", "--max-bytes", "10"], "--min-bytes 100 is above --max-bytes 10"),
    ("bench_allreduce.py", ["--variants", "ring,tree"], "--variants: expected a comma-separated subset of"),
    ("bench_allreduce.py", ["--json", "/nonexistent/x.json"], "--json: cannot write a file at"),
    ("bench_halo.py", ["--sizes", "0"], "--sizes: expected 1..3 sizes"),
    ("bench_halo.py", ["--sizes", "4x4", "--width", "5"], "--width 5 is wider than the block 4x4"),
    ("bench_halo3d.py", ["--radius", "0"], "--radius: must be 1..64 ghost cells, got 0"),
    ("bench_heat.py", ["--steps", "-1"], "--steps: must be 1..10000000 steps, got -1"),
    ("bench_ft.py", ["overhead", "--trials", "0"], "--trials: must be 1..10000 trials, got 0"),
    ("bench_ft.py", ["recovery", "--ranks", "2"], "--ranks: must be 3..64 ranks, got 2"),
    ("bench_attention.py", ["--heads", "3", "--kv-heads", "2"], "--kv-heads 2 does not divide --heads 3"),
    ("bench_attention.py", ["--backend", "torch", "--causal", "maybe"], "--causal: choose from both,true,false"),
    ("bench_elastic.py", ["--wan-rate-mbps", "nan"], "--wan-rate-mbps: must be > 0"),
    ("soak_ulfm.py", ["--np", "2"], "--np: must be 3..64 ranks, got 2"),
    ("bench_pack.py", ["--blocks", "0"], "--blocks: must be 1.."),
    ("bench_pack.py", ["--dims", "0"], "--dims: must be 1..6"),
    ("bench_pack.py", ["--total", "-5"], "--total: must be 1.."),
    ("bench_pack.py", ["--min-time", "nan"], "--min-time: must be > 0"),
    ("bench_pack.py", ["--repeat", "0"], "--repeat: must be 1.."),
    ("bench_typed_pingpong.py", ["--blocks", "12"], "--blocks: must be a multiple of 8"),
    ("bench_typed_pingpong.py", ["--sizes", "8", "--blocks", "16"], "nothing to measure"),
    ("bench_typed_pingpong.py", ["--json", "/nonexistent/x.json"], "--json: cannot write a file at"),
    ("bench_small.py", ["--iters", "0"], "--iters: must be 1.."),
    ("bench_small.py", ["--min-bytes", "64", "--max-bytes", "8"], "--min-bytes 64 is above --max-bytes 8"),
    ("bench_torch_backend.py", ["--sizes", "6"], "--sizes: each size must be a multiple of 4 bytes"),
    ("bench_torch_backend.py", ["--sizes", "8,1x"], "--sizes: expected comma-separated sizes in bytes"),
    ("bench_torch_backend.py", ["--reps", "0"], "--reps: must be 1..10000 repetitions, got 0"),
    ("bench_torch_backend.py", ["--ddp-width", "-1"], "--ddp-width: must be 8..16384 features, got -1"),
    ("bench_torch_backend.py", ["--plot", "/nonexistent/x.png"], "--plot: cannot write a file at"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script,argv,words", CASES, ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_bad_value_is_one_line_and_exit_2(script, argv, words):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    res = subprocess.run([sys.executable, "-P", str(BENCH / script), *argv], capture_output=True, text=True,
                         timeout=100, env=env)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1 and ": error: " in lines[0], res.stderr
    assert words in lines[0], lines[0]
    assert res.stdout == "", res.stdout[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script,options", [
    ("bench_pack.py", ["--total", "--blocks", "--dims", "--repeat", "--min-time"]),
    ("bench_typed_pingpong.py", ["--sizes", "--blocks", "--repeat"]),
    ("bench_torch_backend.py", ["--sizes", "--reps", "--ddp-steps", "--ddp-reps", "--ddp-width", "--ddp-batch"]),
])
def test_bench_help_gives_units_and_defaults(script, options):
    res = subprocess.run([sys.executable, "-P", str(BENCH / script), "--help"], capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0 and res.stderr == ""
    text = " ".join(res.stdout.split())
    for o in options:  # each option's own help: "--opt METAVAR ... (default ...)" before the next option
        own = text.split(f" {o} ", 1)[1].split(" --", 1)[0]
        assert "default" in own, (o, own)


def _mpiexec() -> str:
    """The mpiexec beside this python (the venv's), else the one on PATH; skips without one."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec beside this python or on PATH")
    return mpiexec


@pytest.mark.timeout(120)
def test_bench_torch_backend_quick_run_at_2_ranks(tmp_path):
    """``--quick --sizes 8`` under ``mpiexec -n 2``: both groups run, the row, the DDP line and the
    JSON come out (the figures themselves are not judged: speed is the benchmark's, not a test's)."""
    pytest.importorskip("torch")
    mpiexec = _mpiexec()
    out = tmp_path / "tb.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpiexec, "--oversubscribe", "-n", "2", sys.executable, "-P", str(BENCH / "bench_torch_backend.py"),
           "--quick", "--sizes", "8", "--reps", "1", "--ddp-reps", "1", "--ddp-steps", "1", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert "mpiexec, 2 ranks" in res.stdout and "DDP step" in res.stdout, res.stdout
    rec = json.loads(out.read_text())
    assert rec["launcher"] == "mpiexec" and rec["ranks"] == 2
    assert [r["bytes"] for r in rec["rows"]] == [8] and rec["rows"][0]["target"] == 10.0
    assert rec["rows"][0]["commlib"]["time_us"] > 0 and rec["rows"][0]["gloo"]["time_us"] > 0
    assert rec["ddp"]["max_param_diff"] <= 1e-6 * max(1.0, rec["ddp"]["param_scale"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("halo", ["auto", "mpi"])
def test_bench_heat_quick_run_with_profile_at_2_ranks(tmp_path, halo):
    """Two small grids under ``mpiexec -n 2`` with ``--profile``: commlib and the hand-written
    solver end with the same field, the ghost cells went the way asked, and every phase of the
    profile is a share of the step it was timed in (figures themselves are the benchmark's)."""
    mpiexec = _mpiexec()
    out = tmp_path / "heat.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpiexec, "--oversubscribe", "-n", "2", sys.executable, "-P", str(BENCH / "bench_heat.py"),
           "--grids", "20x18x16", "40x36", "--steps", "12", "--trials", "1", "--profile", "--halo", halo,
           "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    rec = json.loads(out.read_text())
    want = "shm" if halo == "auto" else "mpi"
    for row in rec["rows"]:
        assert row["same_field"] is True and row["commlib_halo"] == want
        # the arithmetic ceiling was measured, and the lower ceiling is at most the copy roofline
        assert row["update_in_cache_mlups"]["min"] > 0
        assert row["commlib_over_lower_ceiling"]["median"] >= row["commlib_over_roofline"]["median"] * (1 - 1e-12)
        prof = row["profile"]
        assert prof["halo"] == want and len(set(prof["planes"])) == 1, prof
        for r in range(2):
            spent = sum(prof["us_per_step"][ph][r] for ph in prof["us_per_step"])
            assert 0 < spent <= prof["total_us"][r], prof
    assert "ghost cells: " + want in res.stdout
