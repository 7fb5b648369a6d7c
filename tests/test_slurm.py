"""Real Slurm jobs: a two-node cluster on this host (jobs/slurm/testcluster.sh: Debian's slurmctld
and two slurmd, started for this module and stopped at its end, by PID) runs the apps under
``srun`` and the job scripts under ``sbatch --wait``, with the MPI of this Python's mpi4py (the
Open MPI wheel under ``srun --mpi=pmix``, the MPICH wheel under ``--mpi=pmi2``). Each test reads
the app's ``--json``: the world size it reports and its check, not only the exit status.

Skipped, with one line, where Slurm cannot run: not root, the packages cannot be installed, or the
daemons do not start. The singleton guard's tests (commlib's warning when a Slurm step of several
tasks gives it an MPI world of 1) need no Slurm and always run.

The jobs are all submitted at once when the cluster is up (the module's ``jobs`` fixture) and each
test waits for its own: most of a job's time is Python and MPI starting up, which overlaps.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

import pytest

from waiting import wait_until  # noqa: E402 - tests/waiting.py

HAVE_TORCH = importlib.util.find_spec("torch") is not None  # the LM app's jobs need it

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
    """``commlib.init()`` twice in a process of its own, MPI world size 1, with ``env`` set."""
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


def test_singleton_error_mode_raises_on_every_task():
    """COMMLIB_SLURM_SINGLETON=error (the job scripts set it): init raises InvalidArgument, naming the fix,
    on task 3 too (the warning itself is said on task 0 only)."""
    r = _init_at_one_rank(SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="3", COMMLIB_SLURM_SINGLETON="error")
    assert r.returncode != 0 and "init done" not in r.stdout
    assert "InvalidArgument: rank 3: init: MPI world size 1 in a Slurm step of 4 tasks" in r.stderr, r.stderr
    assert "srun --mpi=" in r.stderr.splitlines()[-1]


@pytest.mark.parametrize("app", [["heat", "--steps", "2"], ["attention", "--seq", "64", "--heads", "2"],
                                 ["lm", "--steps", "2"], ["lm", "--steps", "2", "--fault-tolerant"]],
                         ids=["heat", "attention", "lm", "lm-ft"])
def test_apps_refuse_a_singleton_launch_in_one_line(app):
    """Each app, launched as a task alone in a Slurm step of 2 under COMMLIB_SLURM_SINGLETON=error (the
    job scripts' setting): one line on stderr, NAME: error: ..., naming the fix; exit status 2."""
    r = subprocess.run([PY, "-P", "-m", f"commlib.apps.{app[0]}", *app[1:]], capture_output=True, text=True,
                       env=_clean_env(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0", SLURM_PROCID="0",
                                      COMMLIB_SLURM_SINGLETON="error"), timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert lines[0].startswith(f"{app[0]}: error: rank 0: init: MPI world size 1 in a Slurm step of 2 tasks"), lines
    assert "srun --mpi=" in lines[0], lines


@pytest.mark.parametrize("env,found", [
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, True),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "3"}, True),  # a step without SLURM_STEP_NUM_TASKS
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4"}, False),  # a one-task step of a bigger job
    ({"SLURM_NTASKS": "4"}, False),  # the batch script's own process (no step)
    ({"SLURM_STEP_NUM_TASKS": "4", "OMPI_COMM_WORLD_SIZE": "1"}, False),  # mpiexec -n 1 inside a step: asked for
    ({"SLURM_STEP_NUM_TASKS": "4", "PMI_SIZE": "1"}, False),  # hydra's mpiexec -n 1
    ({}, False),
], ids=["step", "step-old-slurm", "one-task-step", "batch-script", "mpiexec-n1", "hydra-n1", "no-slurm"])
def test_which_worlds_of_one_are_singletons_by_mistake(env, found, monkeypatch):
    from commlib.transports.mpi_process import slurm_singleton  # noqa: PLC0415 (imports mpi4py.MPI)

    for k in list(os.environ):
        if k.startswith(("SLURM_", "OMPI_COMM_WORLD", "PMI_", "PMIX_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    msg = slurm_singleton(world_size=1)
    assert (msg is not None) == found, msg
    assert slurm_singleton(world_size=2) is None


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
    for attempt in (1, 2):  # a second start (new ports, new state) where the first failed
        try:
            r = subprocess.run(["bash", TESTCLUSTER, "start"], capture_output=True, text=True, env=cenv, timeout=600)
        except subprocess.TimeoutExpired:
            subprocess.run(["bash", TESTCLUSTER, "stop"], env=cenv, timeout=60)
            pytest.skip("Slurm tests skipped: testcluster.sh start took over 600 s")
        print(r.stdout, r.stderr, sep="")
        if r.returncode == 0 or attempt == 2:
            break
        sys.stderr.write(f"test_slurm: the test cluster did not start (exit {r.returncode}); starting it again\n")
        subprocess.run(["bash", TESTCLUSTER, "stop"], env=cenv, timeout=60)
    if r.returncode != 0:
        lines = [ln.strip() for ln in (r.stderr + "\n" + r.stdout).splitlines()
                 if ln.strip() and not ln.startswith("==> ")]  # tail's file headers say nothing
        why = " | ".join(lines[-3:]) or "(no output)"
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


# ------------------------------------------------------------------ the jobs
def _srun(slurm, *args, nodes=2, tasks=2):
    return ["srun", f"--mpi={slurm['mpi']}", f"--nodes={nodes}", f"--ntasks={tasks}", "--time=5", *args]


# the job scripts as a user runs them on CPUs: GPUs off, the settings through their variables
CPU_JOB = ("--gpus-per-task=0", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1")
# the LM app, small: a 1-layer model on 2 x 64 tokens, 3 steps, every loss checked against one process
LM_SMALL = ("--seq-len", "64", "--batch", "2", "--d-model", "32", "--heads", "2", "--layers", "1", "--steps", "3",
            "--eval-every", "3", "--threads", "1")


def _launches(slurm):
    """name -> (command line, extra environment) of every job this module runs."""
    mpi = slurm["mpi"]
    heat_job = {"GRID": "16", "STEPS": "5", "BACKEND": "numpy", "PYTHON": PY}
    out = {
        # the heat app, one task on each node
        "srun_heat": (_srun(slurm, PY, "-P", "-m", "commlib.apps.heat", "--dims", "2", "--grid", "32", "--steps",
                            "10", "--backend", "numpy", "--verify", "--no-progress", "--json", "heat.json"), {}),
        # the attention app (ring, zigzag), 2 tasks on one node
        "srun_attention": (_srun(slurm, PY, "-P", "-m", "commlib.apps.attention", "--seq", "256", "--heads", "2",
                                 "--check", "--quiet", "--json", "attn.json", nodes=1), {}),
        "sbatch_heat": (["sbatch", "--wait", "--time=5", *CPU_JOB, HEAT_SBATCH],
                        {**heat_job, "EXTRA": "--verify", "SRUN_MPI": mpi}),
        # srun --mpi=none: every task an MPI world of its own
        "sbatch_heat_singletons": (["sbatch", "--wait", "--time=5", *CPU_JOB, HEAT_SBATCH],
                                   {**heat_job, "SRUN_MPI": "none"}),
    }
    if mpi == "pmix":  # Open MPI. ULFM=1: Open MPI's mpiexec --with-ft ulfm inside the allocation
        ft = {"ULFM": "1", "MPIEXEC": os.path.join(os.path.dirname(PY), "mpiexec"), "OMPI_ALLOW_RUN_AS_ROOT": "1",
              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "SRUN_MPI": mpi}
        out["sbatch_heat_ft"] = (["sbatch", "--wait", "--time=5", *CPU_JOB, HEAT_SBATCH],
                                 {**HEAT_REQUEUE, "STEPS": "60", **ft, "EXTRA": "--kill 1:25 --checkpoint-every 10"})
        if HAVE_TORCH:
            out["sbatch_lm_ft"] = (["sbatch", "--wait", "--time=5", *CPU_JOB, LM_SBATCH],
                                   {**LM_REQUEUE, **ft, "EXTRA": "--eval-every 3 --kill 1:3:backward"})
    if HAVE_TORCH:
        out["srun_lm"] = (_srun(slurm, PY, "-P", "-m", "commlib.apps.lm", *LM_SMALL, "--dp", "2", "--verify",
                                "--no-progress", "--json", "lm.json", nodes=1), {})
        out["sbatch_lm"] = (["sbatch", "--wait", "--time=5", *CPU_JOB, LM_SBATCH],
                            {"DEVICE": "cpu", "SEQ_LEN": "64", "BATCH": "2", "D_MODEL": "32", "HEADS": "2",
                             "KV_HEADS": "2", "LAYERS": "1", "STEPS": "3", "THREADS": "1", "PYTHON": PY,
                             "EXTRA": "--verify --eval-every 3", "SRUN_MPI": mpi})
    return out


@dataclass
class Job:
    name: str
    cmd: list
    folder: object  # pathlib.Path: the submission folder (the apps' --json, the job's output file)
    proc: subprocess.Popen

    def wait(self, timeout=400):
        """(exit status, stdout, stderr, job id or None, the sbatch job's output file's text)."""
        rc = self.proc.wait(timeout=timeout)
        stdout = (self.folder / "launch.stdout").read_text()
        stderr = (self.folder / "launch.stderr").read_text()
        m = re.search(r"Submitted batch job (\d+)", stdout)
        job = m.group(1) if m else None
        outs = list(self.folder.glob(f"*-{job}.out")) if job else []
        text = outs[0].read_text() if outs else ""
        print("+", " ".join(self.cmd), "\n", stdout, stderr, text, sep="")
        return rc, stdout, stderr, job, text


#: the job each test waits for
TEST_JOB = {"test_srun_heat_on_two_nodes": "srun_heat", "test_srun_attention": "srun_attention",
            "test_sbatch_heat_script": "sbatch_heat",
            "test_sbatch_heat_script_refuses_a_launch_of_singletons": "sbatch_heat_singletons",
            "test_srun_lm_data_parallel": "srun_lm", "test_sbatch_lm_script": "sbatch_lm",
            "test_sbatch_jobs_stop_on_usr1_requeue_and_resume_on_one_node": "requeues"}
#: tests that wait for several jobs: their names (parametrized: the job's name from the parameter)
TEST_JOBS = {"test_sbatch_fault_tolerant_job_finishes_on_the_survivor":
             lambda item: f"sbatch_{item.callspec.params['app']}_ft"}


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory, request):
    """The jobs of :func:`_launches` that this run's tests wait for, started now, side by side:
    name -> :class:`Job`."""
    wanted = {TEST_JOB.get(item.originalname) for item in request.session.items}
    wanted |= {TEST_JOBS[item.originalname](item) for item in request.session.items
               if item.originalname in TEST_JOBS}
    started = {}
    if "requeues" in wanted:
        started["requeues"] = Requeues(slurm, tmp_path_factory.mktemp("requeues"))
        started["requeues"].start()
    for name, (cmd, env) in _launches(slurm).items():
        if name not in wanted:
            continue
        folder = tmp_path_factory.mktemp(name)
        with open(folder / "launch.stdout", "w") as out, open(folder / "launch.stderr", "w") as err:
            proc = subprocess.Popen(cmd, cwd=str(folder), env={**slurm["env"], **env}, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, text=True)
        started[name] = Job(name, cmd, folder, proc)
    try:
        yield started
    finally:
        for j in started.values():
            if isinstance(j, Requeues):
                continue  # its jobs end with the cluster
            if j.proc.poll() is None:
                j.proc.kill()
                j.proc.wait()


def test_srun_heat_on_two_nodes(jobs):
    """srun of the heat app, one task on each node: one MPI world of 2, bit-identical to one rank."""
    j = jobs["srun_heat"]
    rc, out, err, _, _ = j.wait()
    assert rc == 0, err
    res = json.loads((j.folder / "heat.json").read_text())
    assert res["ranks"] == 2 and res["verified"] is True, res
    assert "on 2 rank(s)" in out and "bit-identical" in out
    assert "world size 1" not in err


def test_srun_attention(jobs):
    """srun of the attention app over 2 tasks on one node: its dense check passes."""
    j = jobs["srun_attention"]
    rc, _, err, _, _ = j.wait()
    assert rc == 0, err
    res = json.loads((j.folder / "attn.json").read_text())
    assert res["ranks"] == 2 and res["seq_local"] == 128 and res["check"]["passed"] is True, res


def test_sbatch_heat_script(jobs, slurm):
    j = jobs["sbatch_heat"]
    rc, _, err, job, out = j.wait()
    assert rc == 0 and job, (err, out)
    res = json.loads((j.folder / f"heat-{job}.json").read_text())
    assert res["ranks"] == 2 and res["grid"] == [16, 16, 16] and res["steps"] == 5 and res["verified"] is True, res
    assert f"job {job} on 2 node(s), 2 tasks" in out and f"srun --mpi={slurm['mpi']}" in out
    # the provenance step's commlib info: its Slurm rows
    assert re.search(rf"^slurm_job +{job} on 2 node\(s\)$", out, re.M), out
    assert re.search(r"^slurm_step +\d+: 1 task\(s\) on 1 node\(s\); this is task 0 on c1$", out, re.M), out
    assert re.search(r"^pmi +(PMIx \(namespace|PMI-1/PMI-2)", out, re.M) and "slurm_singleton" not in out, out


def test_sbatch_heat_script_refuses_a_launch_of_singletons(jobs, slurm):
    """srun --mpi=none starts each task as an MPI world of 1: the script fails, naming the fix."""
    j = jobs["sbatch_heat_singletons"]
    rc, _, err, job, out = j.wait()
    assert rc != 0 and job, (err, out)
    assert f"srun --mpi={slurm['mpi']}" in out and "world size 1 in a Slurm step of 2 tasks" in out, out
    assert "heat.sbatch: error: the heat step failed" in out
    assert not (j.folder / f"heat-{job}.json").exists()


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed (the LM app needs it)")
def test_srun_lm_data_parallel(jobs):
    """srun of the LM app with --dp 2 over 2 tasks: mesh 2 x 1, losses equal to one process's."""
    j = jobs["srun_lm"]
    rc, _, err, _, _ = j.wait()
    assert rc == 0, err
    res = json.loads((j.folder / "lm.json").read_text())
    assert res["ranks"] == 2 and res["mesh"] == {"dp": 2, "cp": 1} and res["verify"]["passed"] is True, res


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed (the LM app needs it)")
def test_sbatch_lm_script(jobs):
    """lm.sbatch on CPUs, one task on each node: the context sharded over both (cp 2), losses checked."""
    j = jobs["sbatch_lm"]
    rc, _, err, job, out = j.wait()
    assert rc == 0 and job, (err, out)
    res = json.loads((j.folder / f"lm-{job}.json").read_text())
    assert res["ranks"] == 2 and res["mesh"] == {"dp": 1, "cp": 2} and res["verify"]["passed"] is True, res
    assert len(res["steps"]) == 3 and (j.folder / f"lm-{job}.png").exists()
    assert f"job {job} on 2 node(s), 2 tasks" in out


# ------------------------------------------------------------------ preemption, requeue, failures
def _job_state(slurm, job) -> dict:
    """``scontrol show job``'s fields of ``job`` ({} once Slurm has forgotten it)."""
    r = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=slurm["env"],
                       timeout=30)
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv) if r.returncode == 0 else {}


def _ctld_log(slurm, job) -> str:
    """slurmctld's lines about ``job`` (for a failure's message)."""
    try:
        with open(os.path.join(slurm["dir"], "log", "slurmctld.log"), errors="replace") as fh:
            return "".join(x for x in fh if re.search(rf"JobId={job}\b", x))[-3000:]
    except OSError:
        return ""


def _submit(slurm, folder, script, env) -> str:
    # a long time limit: the scripts' own --signal=B:USR1@T would come at once under --time=5
    r = subprocess.run(["sbatch", "--parsable", "--time=30", "--signal=B:USR1@10", *CPU_JOB, script],
                       capture_output=True, text=True,
                       cwd=str(folder), env={**slurm["env"], **env}, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


#: the states a job ends in
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")


def _ended(slurm, job):
    """The state ``job`` ended in ("GONE" once Slurm has forgotten it), or None while it is not over."""
    st = _job_state(slurm, job).get("JobState", "GONE")
    return st if st in FINAL + ("GONE",) else None


def _ftcs_oracle(grid, steps):
    """The heat field after ``steps`` FTCS steps from sin(pi x) sin(pi y) sin(pi z) (alpha 1, cfl 0.5):
    plain numpy on the whole grid, the app's per-cell order of operations (bit-comparable)."""
    from oracles import ftcs_heat  # noqa: PLC0415 - tests/oracles.py

    from commlib.apps.heat import time_step  # noqa: PLC0415  (dt and the coefficients)

    _, _, n, c = time_step(grid, 1.0, 0.5, steps, None)
    return ftcs_heat(grid, c, n)


#: the heat run long enough (2000 steps) to be still going when the signal comes
HEAT_REQUEUE = {"GRID": "12", "STEPS": "2000", "BACKEND": "numpy", "PYTHON": PY}
LM_REQUEUE = {"DEVICE": "cpu", "SEQ_LEN": "64", "BATCH": "2", "D_MODEL": "32", "HEADS": "2", "KV_HEADS": "2",
              "LAYERS": "1", "STEPS": "6", "THREADS": "1", "PYTHON": PY, "EXTRA": "--eval-every 3"}
LM_REQUEUE_ARGV = ["--seq-len", "64", "--batch", "2", "--d-model", "32", "--heads", "2", "--kv-heads", "2",
                   "--layers", "1", "--steps", "6", "--eval-every", "3"]


class Requeues(threading.Thread):
    """The stop-and-requeue jobs, driven in a thread of their own so that their waits (start-up,
    the requeue, the second run) overlap the module's other jobs: heat.sbatch and lm.sbatch at
    2 nodes x 1 task, each sent SIGUSR1 through its batch script (what --signal=B:USR1@T does)
    once the app says it catches it, then given one node for its requeued run (and a start in
    2 s instead of Slurm's 2 min); beside them a heat job its user cancels (scancel: SIGTERM).
    ``error`` holds what went wrong, ``jobs``/``cancel`` the job ids."""

    def __init__(self, slurm, folder):
        super().__init__(daemon=True)
        self.slurm, self.folder, self.error = slurm, folder, None
        self.jobs, self.cancel = {}, None

    def log(self, app, job=None):
        p = self.folder / app / f"{'heat' if app == 'cancel' else app}-{job or self.jobs[app]}.out"
        return p.read_text(errors="replace") if p.exists() else ""

    def run(self):
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - the test raises it
            self.error = exc

    def _run(self):
        slurm, mpi = self.slurm, {"SRUN_MPI": self.slurm["mpi"]}
        runs = {"heat": (HEAT_SBATCH, {**HEAT_REQUEUE, **mpi})}
        if HAVE_TORCH:
            runs["lm"] = (LM_SBATCH, {**LM_REQUEUE, **mpi})
        for app, (script, env) in runs.items():
            (self.folder / app).mkdir()
            self.jobs[app] = _submit(slurm, self.folder / app, script, env)
        (self.folder / "cancel").mkdir()
        self.cancel = _submit(slurm, self.folder / "cancel", HEAT_SBATCH, {**HEAT_REQUEUE, **mpi})
        for app in runs:  # the app caught the signals: send one
            wait_until(lambda: f"{app}: on SIGUSR1" in self.log(app), 180, f"{app}: the stop-signal line")
            subprocess.run(["scancel", "--signal=USR1", "--batch", self.jobs[app]], env=slurm["env"], check=True,
                           timeout=30)
        wait_until(lambda: "heat: on SIGUSR1" in self.log("cancel", self.cancel), 180, "the cancel job")
        subprocess.run(["scancel", self.cancel], env=slurm["env"], check=True, timeout=30)
        for app in runs:  # requeued: one node this time, in 2 s (in the second of the requeue the job's
            # old credential is still revoked and its start fails)
            wait_until(lambda: _job_state(slurm, self.jobs[app]).get("Restarts") == "1" and
                       _job_state(slurm, self.jobs[app]).get("JobState") == "PENDING", 180,
                       f"{app}: requeued\n{self.log(app)}")
            subprocess.run(["scontrol", "update", f"JobId={self.jobs[app]}", "NumNodes=1", "NumTasks=1",
                            "StartTime=now+2"], env=slurm["env"], check=True, timeout=30)
        for app in runs:
            state = wait_until(lambda: _ended(slurm, self.jobs[app]), 240, f"{app}: the end")
            assert state in ("COMPLETED", "GONE"), (state, self.log(app)[-3000:], _ctld_log(slurm, self.jobs[app]))
        state = wait_until(lambda: _ended(slurm, self.cancel), 120, "the cancelled job's end")
        assert state in ("CANCELLED", "GONE"), (state, self.log("cancel", self.cancel)[-3000:])


def test_sbatch_jobs_stop_on_usr1_requeue_and_resume_on_one_node(jobs):
    """heat.sbatch and lm.sbatch stopped by SIGUSR1 at 2 tasks (:class:`Requeues`): the step
    checkpoints and exits 75, the script requeues the job, the requeued run resumes on 1 task and
    ends with the heat field of plain FTCS steps bit for bit and the LM losses of a single-process
    training. The job cancelled instead (SIGTERM) checkpoints too and stays cancelled."""
    import numpy as np  # noqa: PLC0415

    from lm_oracle import assert_losses, oracle  # noqa: PLC0415 - tests/lm_oracle.py

    d = jobs["requeues"]
    d.join(timeout=600)
    assert not d.is_alive(), "the requeue jobs did not end within 600 s"
    if d.error is not None:
        raise d.error
    steps = int(HEAT_REQUEUE["STEPS"])
    for app, job in d.jobs.items():
        text = d.log(app)
        print(text)
        stopped = re.search(rf"{app}: SIGUSR1: stopped after step (\d+) of (\d+)", text)
        assert stopped and f"requeueing job {job}" in text, text
        assert "on 1 node(s), 1 tasks" in text and "resumes from" in text, text
        step = int(stopped.group(1))
        res = json.loads((d.folder / app / f"{app}-{job}.json").read_text())
        if app == "heat":
            assert res["ranks"] == 1 and res["extra"]["resumed"]["from_step"] == step, res
            assert res["extra"]["resumed"]["ranks_then"] == 2
            with np.load(d.folder / app / f"heat-{job}.ckpt" / "heat.npz") as z:
                field, meta = z["field"], json.loads(str(z["meta"]))
            assert meta["step"] == res["steps"] == steps
            assert np.array_equal(field, _ftcs_oracle([12] * 3, steps)), "the resumed field differs from FTCS's"
        else:
            r = res["resumed"]
            assert res["ranks"] == 1 and (r["from_step"], r["ranks_then"], r["ranks_now"]) == (step, 2, 1), r
            assert_losses(res, oracle(LM_REQUEUE_ARGV), 1e-4, "lm resumed after SIGUSR1 and a requeue")
    text = d.log("cancel", d.cancel)
    print(text)
    # the step sees SIGTERM from Slurm and SIGUSR1 from the script: whichever came first
    assert re.search(rf"heat: SIG(TERM|USR1): stopped after step \d+ of {steps}", text), text
    assert "requeueing" not in text and text.count("== provenance") == 1, text
    assert f"to continue: CHECKPOINT=heat-{d.cancel}.ckpt sbatch" in text, text
    with np.load(d.folder / "cancel" / f"heat-{d.cancel}.ckpt" / "heat.npz") as z:
        assert 1 <= json.loads(str(z["meta"]))["step"] < steps


@pytest.mark.parametrize("app", ["heat", "lm"])
def test_sbatch_fault_tolerant_job_finishes_on_the_survivor(app, jobs):
    """ULFM=1: the job script launches mpiexec --with-ft ulfm inside the allocation (2 nodes x 1 task)
    and a task dies (--kill): the job completes on the survivor, says so, and its result equals a
    failure-free one (heat: plain FTCS steps' error against the exact solution, bit for bit; LM: a
    single-process training's losses)."""
    if app == "lm" and not HAVE_TORCH:
        pytest.skip("torch not installed (the LM app needs it)")
    if f"sbatch_{app}_ft" not in jobs:
        pytest.skip("ULFM under sbatch: Open MPI's mpiexec --with-ft ulfm (this Python has MPICH)")
    import numpy as np  # noqa: PLC0415

    from lm_oracle import assert_losses, oracle  # noqa: PLC0415

    j = jobs[f"sbatch_{app}_ft"]
    rc, _, err, job, text = j.wait()
    assert rc == 0 and job, (err, text[-3000:])
    res = json.loads((j.folder / f"{app}-{job}.json").read_text())
    if app == "heat":
        from commlib.apps.heat import exact_solution, time_step  # noqa: PLC0415

        assert res["ranks"] == 1 and res["extra"]["failed"] == [1], res
        assert "lost COMM_WORLD ranks [1]" in text
        grid = [12] * 3
        ex = exact_solution(grid, [0, 0, 0], grid, 60 * time_step(grid, 1.0, 0.5, 60, None)[1], 1.0)
        want = float(np.max(np.abs(_ftcs_oracle(grid, 60) - ex)))
        assert res["max_error"] == want, (res["max_error"], want)
    else:
        assert res["ranks"] == 2 and res["ranks_final"] == 1, res
        assert [(f["world_rank"], f["step"]) for f in res["failures"]] == [(1, 3)], res["failures"]
        assert "failure: COMM_WORLD rank 1 lost in step 3" in text
        assert_losses(res, oracle(LM_REQUEUE_ARGV), 1e-4, "lm under sbatch with a task killed")
