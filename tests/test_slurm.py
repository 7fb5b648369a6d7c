"""Real Slurm jobs: a two-node cluster on this host (jobs/slurm/testcluster.sh: Debian's slurmctld
and two slurmd, started for this module and stopped at its end, by PID) runs the apps under
``srun`` and the job scripts under ``sbatch --wait``, with the MPI of this Python's mpi4py (the
Open MPI wheel under ``srun --mpi=pmix``, the MPICH wheel under ``--mpi=pmi2``). Each test reads
the app's ``--json``: the world size it reports and its check, not only the exit status.

Skipped, with one line, where Slurm cannot run: not root, the packages cannot be installed, or the
daemons do not start. The singleton guard's tests (commlib's warning when a Slurm step of several
tasks gives it an MPI world of 1) need no Slurm and always run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTCLUSTER = os.path.join(REPO, "jobs", "slurm", "testcluster.sh")
HEAT_SBATCH = os.path.join(REPO, "jobs", "slurm", "heat.sbatch")
LM_SBATCH = os.path.join(REPO, "jobs", "slurm", "lm.sbatch")
PY = sys.executable  # the tasks run this venv's Python by its absolute path


def _clean_env(**extra) -> dict:
    """This process's environment without any launcher's or Slurm's variables (pytest may itself run
    under mpiexec or inside a Slurm job), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_COMM_WORLD", "PMIX_", "PMI_",
                                "HYDRA_", "COMMLIB_SLURM"))}
    env.update(extra)
    return env


def _mpi_library() -> str:
    r = subprocess.run([PY, "-P", "-c", "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"],
                       capture_output=True, text=True, env=_clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# ------------------------------------------------------------------ the singleton guard (no Slurm)
def _init_at_one_rank(**env):
    """``commlib.init()`` in a process of its own, MPI world size 1, with ``env`` set."""
    return subprocess.run([PY, "-P", "-c", "import commlib; commlib.init(); commlib.init(); print('init done')"],
                          capture_output=True, text=True, env=_clean_env(**env), timeout=60)


def test_singleton_in_a_slurm_step_warns_once_naming_the_srun_mpi_value():
    lib = _mpi_library()
    want = "pmi2" if "MPICH" in lib else "pmix"
    r = _init_at_one_rank(SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4", SLURM_STEP_ID="0", SLURM_PROCID="0")
    assert r.returncode == 0 and "init done" in r.stdout, r.stderr
    lines = [x for x in r.stderr.splitlines() if "RuntimeWarning" in x]
    assert len(lines) == 1, r.stderr  # once, though init ran twice
    assert "world size 1 in a Slurm step of 4 tasks" in lines[0] and f"srun --mpi={want}" in lines[0], lines


@pytest.mark.parametrize("env", [
    {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4"},  # a one-task step of a bigger job
    {"SLURM_NTASKS": "4"},  # the batch script's own process (no step)
    {"SLURM_STEP_NUM_TASKS": "4", "OMPI_COMM_WORLD_SIZE": "1"},  # mpiexec -n 1 inside the step: asked for
    {"SLURM_STEP_NUM_TASKS": "4", "COMMLIB_SLURM_SINGLETON": "off"},
], ids=["one-task-step", "batch-script", "mpiexec-n1", "off"])
def test_no_warning_where_a_world_of_one_is_meant(env):
    r = _init_at_one_rank(**env)
    assert r.returncode == 0 and "init done" in r.stdout and "Warning" not in r.stderr, r.stderr


def test_singleton_error_mode_raises_on_every_task():
    """COMMLIB_SLURM_SINGLETON=error (the job scripts set it): init raises InvalidArgument, naming the fix,
    on task 3 too (the warning itself is said on task 0 only)."""
    r = _init_at_one_rank(SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="3", COMMLIB_SLURM_SINGLETON="error")
    assert r.returncode != 0 and "init done" not in r.stdout
    assert "InvalidArgument: rank 3: init: MPI world size 1 in a Slurm step of 4 tasks" in r.stderr, r.stderr
    assert "srun --mpi=" in r.stderr.splitlines()[-1]


def test_srun_mpi_value_by_library():
    from commlib.transports.mpi_process import slurm_srun_mpi  # noqa: PLC0415 (imports mpi4py.MPI)

    assert slurm_srun_mpi("Open MPI v5.0.11, package: Open MPI") == "pmix"
    assert slurm_srun_mpi("MPICH Version:      4.3.1") == "pmi2"
    assert slurm_srun_mpi("Intel(R) MPI Library 2021.13") == "pmi2"
    assert "srun --mpi=list" in slurm_srun_mpi("Some MPI 1.0")


# ------------------------------------------------------------------ the cluster
@pytest.fixture(scope="module")
def slurm():
    """A two-node Slurm cluster for this module: ``{"env", "mpi", "dir"}``; skipped (one line) where it
    cannot run. Stopped at the end by PID, and by its watcher should this process die first."""
    if os.geteuid() != 0:
        pytest.skip("Slurm tests skipped: not root (slurmd must run as root)")
    if shutil.which("slurmd") is None and shutil.which("apt-get") is None:
        pytest.skip("Slurm tests skipped: no slurmd and no apt-get to install it")
    # a short path: the pmix plugin makes Unix sockets under the cluster's folder
    folder = tempfile.mkdtemp(prefix="commlib-slurm-")
    cenv = _clean_env(DIR=folder, NODES="2", CPUS="4", OWNER=str(os.getpid()))
    try:
        r = subprocess.run(["bash", TESTCLUSTER, "start"], capture_output=True, text=True, env=cenv, timeout=600)
    except subprocess.TimeoutExpired:
        subprocess.run(["bash", TESTCLUSTER, "stop"], env=cenv, timeout=60)
        pytest.skip("Slurm tests skipped: testcluster.sh start took over 600 s")
    print(r.stdout, r.stderr, sep="")
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["(no output)"])[-1]
        subprocess.run(["bash", TESTCLUSTER, "stop"], env=cenv, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"Slurm tests skipped: the test cluster did not start (exit {r.returncode}): {why}")
    conf = re.search(r"^SLURM_CONF=(.+)$", r.stdout, re.M).group(1)
    lib = _mpi_library()
    # the Open MPI wheel's PMIx client: its own security, not munge (this cluster has none)
    env = _clean_env(SLURM_CONF=conf, PMIX_MCA_psec="native")
    try:
        yield {"env": env, "mpi": "pmi2" if "MPICH" in lib else "pmix", "dir": folder}
    finally:
        s = subprocess.run(["bash", TESTCLUSTER, "stop"], capture_output=True, text=True, env=cenv, timeout=60)
        print(s.stdout, s.stderr, sep="")
        shutil.rmtree(folder, ignore_errors=True)


def _run(cmd, slurm, cwd, timeout=240, **env):
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(cwd), env={**slurm["env"], **env},
                       timeout=timeout, stdin=subprocess.DEVNULL)
    print("+", " ".join(cmd), "\n", r.stdout, r.stderr, sep="")
    return r


def _srun(slurm, *args, nodes=2, tasks=2):
    return ["srun", f"--mpi={slurm['mpi']}", f"--nodes={nodes}", f"--ntasks={tasks}", "--time=5", *args]


def test_srun_heat_on_two_nodes(slurm, tmp_path):
    """srun of the heat app, one task on each node: one MPI world of 2, bit-identical to one rank."""
    r = _run(_srun(slurm, PY, "-P", "-m", "commlib.apps.heat", "--dims", "2", "--grid", "32", "--steps", "10",
                   "--backend", "numpy", "--verify", "--no-progress", "--json", "heat.json"), slurm, tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "heat.json").read_text())
    assert res["ranks"] == 2 and res["verified"] is True, res
    assert "on 2 rank(s)" in r.stdout and "bit-identical" in r.stdout
    assert "world size 1" not in r.stderr


def test_srun_attention(slurm, tmp_path):
    """srun of the attention app (ring, zigzag) over 2 tasks on one node: its dense check passes."""
    r = _run(_srun(slurm, PY, "-P", "-m", "commlib.apps.attention", "--seq", "256", "--heads", "2", "--check",
                   "--quiet", "--json", "attn.json", nodes=1), slurm, tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "attn.json").read_text())
    assert res["ranks"] == 2 and res["seq_local"] == 128 and res["check"]["passed"] is True, res


def _sbatch(slurm, script, tmp_path, *options, **env):
    """``sbatch --wait`` of ``script`` from ``tmp_path``: (its result, its job id, its output file's text)."""
    r = _run(["sbatch", "--wait", "--time=5", *options, script], slurm, tmp_path, **env)
    m = re.search(r"Submitted batch job (\d+)", r.stdout)
    assert m, (r.stdout, r.stderr)
    job = m.group(1)
    outs = list(tmp_path.glob(f"*-{job}.out"))
    out = outs[0].read_text() if outs else ""
    print(out)
    return r, job, out


# the job scripts as a user runs them on CPUs: GPUs off, the settings through their variables
CPU_JOB = ("--gpus-per-task=0", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1")


def test_sbatch_heat_script(slurm, tmp_path):
    r, job, out = _sbatch(slurm, HEAT_SBATCH, tmp_path, *CPU_JOB, GRID="16", STEPS="5", BACKEND="numpy",
                          PYTHON=PY, EXTRA="--verify", SRUN_MPI=slurm["mpi"])
    assert r.returncode == 0, out
    res = json.loads((tmp_path / f"heat-{job}.json").read_text())
    assert res["ranks"] == 2 and res["grid"] == [16, 16, 16] and res["steps"] == 5 and res["verified"] is True, res
    assert f"job {job} on 2 node(s), 2 tasks" in out and f"srun --mpi={slurm['mpi']}" in out
    assert "world_size" in out  # the provenance step's commlib info


def test_sbatch_heat_script_refuses_a_launch_of_singletons(slurm, tmp_path):
    """srun --mpi=none starts each task as an MPI world of 1: the script fails, naming the fix."""
    r, job, out = _sbatch(slurm, HEAT_SBATCH, tmp_path, *CPU_JOB, GRID="16", STEPS="5", BACKEND="numpy",
                          PYTHON=PY, SRUN_MPI="none")
    assert r.returncode != 0, out
    assert f"srun --mpi={slurm['mpi']}" in out and "world size 1 in a Slurm step of 2 tasks" in out, out
    assert "heat.sbatch: error: the heat step failed" in out
    assert not (tmp_path / f"heat-{job}.json").exists()
