"""The launch scripts in jobs/ as a user runs them: their refusals (exit status 2, one line), the
command lines they build (with stand-ins for mpirun, srun and python), and the elastic launcher's
handling of a master that cannot start. No MPI job, no Slurm, no training runs here: the real
runs of these programs are tested in test_heat.py and test_diloco.py."""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(REPO, "jobs")
SCRIPTS = ["mpirun/heat.sh", "mpirun/ft_allreduce_bench.sh", "mpirun/ft_collectives.sh", "slurm/heat.sbatch"]


#: the scripts' own settings: taken from the test, never from the environment pytest runs in
KNOBS = ("NP", "FT", "RANKS", "RUNS", "OUT", "MPIRUN", "MPIEXEC", "PYTHON", "GRID", "STEPS", "BACKEND",
         "CUDA_VISIBLE_DEVICES")


def _sh(script, *args, env=None, cwd=None, timeout=60):
    e = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("SLURM_")}
    e.update(env or {})
    return subprocess.run(["bash", os.path.join(JOBS, script), *args], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


def _stand_in(folder, name, body):
    """An executable ``folder/name`` running the bash ``body``."""
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# ------------------------------------------------------------------ shell scripts
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_and_passes_shellcheck(script):
    path = os.path.join(JOBS, script)
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    with open(path) as fh:
        assert "set -euo pipefail" in fh.read()
    sc = shutil.which("shellcheck")
    if sc is None:
        pytest.skip("shellcheck not installed (bash -n passed)")
    r = subprocess.run([sc, "-x", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("script", SCRIPTS[:3])
def test_script_help(script):
    r = _sh(script, "--help")
    assert r.returncode == 0 and "Environment" in r.stdout and r.stderr == "", (r.stdout, r.stderr)


@pytest.mark.parametrize("args,env,np_", [
    ((), {"NP": "2"}, "2"), (("3",), {}, "3"), (("3", "--", "--grid", "16"), {}, "3"),
    (("--", "--grid", "16"), {"NP": "8"}, "8"),  # the documented `NP=8 heat.sh -- ...` (was `-n --`)
    (("--", "--grid", "16"), {}, "4"),
])
def test_heat_sh_builds_the_mpirun_line(args, env, np_, tmp_path):
    """heat.sh passes NP to mpirun -n and everything after -- to the solver (stand-ins print it)."""
    echo = _stand_in(tmp_path, "echo_args", 'echo "$*"')
    r = _sh("mpirun/heat.sh", *args, env={"MPIRUN": echo, "PYTHON": echo, **env}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    rest = list(args[args.index("--") + 1:]) if "--" in args else []
    assert last.endswith(" ".join(["-n", np_, echo, "-P", "-m", "commlib.apps.heat", *rest])), last
    assert "-P -m commlib.cli info" in r.stdout  # provenance first


@pytest.mark.parametrize("ft", ["0", "1"])
def test_lm_sh_fault_tolerant_launch_line(ft, tmp_path):
    """FT=1: the ULFM launch line (without RDMA put) and --fault-tolerant before the user's options."""
    echo = _stand_in(tmp_path, "echo_args", 'echo "$*"')
    r = _sh("mpirun/lm.sh", "3", "--", "--steps", "5", env={"MPIRUN": echo, "PYTHON": echo, "FT": ft},
            cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    ulfm = "--with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum"
    assert (ulfm in last) == (ft == "1") and last.endswith(
        ("--fault-tolerant " if ft == "1" else "") + "--steps 5"), last
    assert " -n 3 " in last


@pytest.mark.parametrize("script,args,env,word", [
    ("mpirun/lm.sh", ("2",), {"FT": "yes"}, "FT"),
    ("mpirun/heat.sh", ("abc",), {}, "NP"), ("mpirun/heat.sh", ("0",), {}, "NP"),
    ("mpirun/heat.sh", ("2",), {"MPIRUN": "no-such-mpirun"}, "no-such-mpirun"),
    ("mpirun/ft_allreduce_bench.sh", (), {"RANKS": "2 x"}, "RANKS"),
    ("mpirun/ft_allreduce_bench.sh", (), {"PYTHON": "no-such-python"}, "no-such-python"),
    ("mpirun/ft_allreduce_bench.sh", ("--bogus",), {}, "arguments"),
    ("mpirun/ft_collectives.sh", (), {"RUNS": "-3"}, "RUNS"),
    ("mpirun/ft_collectives.sh", (), {"MPIEXEC": "no-such-mpiexec"}, "no-such-mpiexec"),
    ("slurm/heat.sbatch", (), {"SLURM_JOB_ID": ""}, "sbatch"),
])
def test_script_refuses_bad_values_in_one_line(script, args, env, word, tmp_path):
    r = _sh(script, *args, env=env, cwd=str(tmp_path))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and ": error: " in r.stderr and word in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing run


def test_ft_allreduce_bench_runs_from_any_folder(tmp_path):
    """The benchmark is found by the script's own location (it was a path relative to the repository
    root), and the JSON files land in the caller's folder."""
    echo = _stand_in(tmp_path, "echo_args", 'echo "$*"')
    r = _sh("mpirun/ft_allreduce_bench.sh", env={"MPIEXEC": echo, "RANKS": "2 3"}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if "bench_allreduce.py" in x]
    assert len(lines) == 2
    for np_, line in zip((2, 3), lines):
        words = line.split()
        bench = next(w for w in words if w.endswith("bench_allreduce.py"))
        assert os.path.isabs(bench) and os.path.isfile(bench)
        assert words[words.index("-n") + 1] == str(np_) and words[-1] == f"allreduce_{np_}.json"


@pytest.mark.parametrize("cvd,want", [(None, ["0", "1"]), ("3,5", ["3", "5"]), ("2", ["2", "2"]),
                                      ("GPU-a,GPU-b,GPU-c", ["GPU-a", "GPU-b"])])
def test_heat_sbatch_binds_one_gpu_per_task_and_splits_grid(cvd, want, tmp_path):
    """heat.sbatch under a stand-in srun (two tasks, SLURM_LOCALID 0 and 1): each task sees one GPU,
    the SLURM_LOCALID-th of those Slurm listed, and GRID='64 32 16' gives --grid 64 32 16."""
    _stand_in(tmp_path, "srun", 'while [[ "${1:-}" == --* ]]; do shift; done\n'
                                'for id in 0 1; do SLURM_LOCALID=$id "$@"; done')
    _stand_in(tmp_path, "python", 'echo "task=$SLURM_LOCALID gpu=${CUDA_VISIBLE_DEVICES:-unset} $*"')
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_CPUS_PER_TASK": "4",
           "GRID": "64 32 16"}
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    r = _sh("slurm/heat.sbatch", env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    runs = [x for x in r.stdout.splitlines() if "commlib.apps.heat" in x]
    assert [x.split()[1] for x in runs] == [f"gpu={g}" for g in want], runs
    assert all("--grid 64 32 16 --steps 1000 --backend cuda --json heat-77.json" in x for x in runs), runs


# ------------------------------------------------------------------ the elastic launcher
def _launch(*args, cwd, timeout=90):
    return subprocess.run([sys.executable, "-P", os.path.join(JOBS, "elastic", "launch_local.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


def _launcher_module():
    spec = importlib.util.spec_from_file_location("launch_local", os.path.join(JOBS, "elastic", "launch_local.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("text", ["nan:join", "inf:join", "-1:join", "1:leave", "1:kill:x", "1:join:2", "x:kill"])
def test_parse_churn_refuses(text):
    with pytest.raises(ValueError, match="bad churn event"):
        _launcher_module().parse_churn(text)


def test_parse_churn_sorts():
    assert _launcher_module().parse_churn(" 9:join, 6:kill:1,7:kill ") == [(6.0, "kill", 1), (7.0, "kill", None),
                                                                           (9.0, "join", None)]


@pytest.mark.parametrize("args", [["--timeout", "nan"], ["--timeout", "0"], ["--port", "70000"], ["--port", "-1"],
                                  ["--peers", "0"], ["--churn", "inf:join"], ["--secret-file", "{tmp}/missing"],
                                  ["--logdir", "{tmp}/file/logs"]], ids=" ".join)
def test_launch_local_refuses_bad_values_in_one_line(args, tmp_path):
    (tmp_path / "file").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    r = _launch("--logdir", str(tmp_path / "logs"), *args, cwd=str(tmp_path)) if "--logdir" not in args else \
        _launch(*args, cwd=str(tmp_path))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("launch_local.py: error: ") and args[0] in r.stderr, \
        r.stderr


@pytest.mark.timeout(120)
def test_launch_local_reports_a_master_that_cannot_start(tmp_path):
    """A short secret, or a port another program listens on: the master exits with status 2 and the
    launcher says why in one line at once (it waited 60 s, or took the other program for the
    master), starting no peer."""
    short = tmp_path / "short"
    short.write_bytes(b"x" * 4)
    r = _launch("--logdir", str(tmp_path / "a"), "--secret-file", str(short), cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "at least 16 bytes" in r.stderr, r.stderr
    assert not (tmp_path / "a" / "peer0.log").exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _launch("--logdir", str(tmp_path / "b"), "--port", str(port), cwd=str(tmp_path))
    assert r.returncode == 2 and "Address already in use" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "b" / "peer0.log").exists()


def test_launch_local_help():
    r = _launch("--help", cwd=REPO)
    assert r.returncode == 0 and "T:kill:I" in r.stdout and "--master-arg" in r.stdout
