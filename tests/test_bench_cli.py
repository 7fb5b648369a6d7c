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

import os
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
])
def test_bench_help_gives_units_and_defaults(script, options):
    res = subprocess.run([sys.executable, "-P", str(BENCH / script), "--help"], capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0 and res.stderr == ""
    text = " ".join(res.stdout.split())
    for o in options:  # each option's own help: "--opt METAVAR ... (default ...)" before the next option
        own = text.split(f" {o} ", 1)[1].split(" --", 1)[0]
        assert "default" in own, (o, own)
