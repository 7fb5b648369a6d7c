"""Randomized kill test: ranks die at random *times* during large fault-tolerant allreduces.

Each run is one ``mpiexec --with-ft ulfm`` job (``launch.FT_ARGS``: the TCP
BTL without RDMA put, docs/faults-and-security.md) of ``tests/ft_worker.py`` in
timed mode: NP ranks, three successive float32 allreduces of MIB MiB in
``commlib.init(fault_tolerant=True)`` mode, and one or two victims that die a
random 0-400 ms after entering a call (the first one included), by
``os._exit``, SIGKILL, or by *wedging* (from then on its MPI makes no progress
and its revoke blocks: the shape of Open MPI's TCP deadlock, docs/faults-and-security.md,
which the watchdog must turn into a fail-stop).  With buffers this large the
kill lands mid-transfer.  Every run must end with

- every survivor holding the same result of every call (SHA-256 across
  survivors) equal to the ring oracle over the inputs of the ranks the call
  ended with (computed by the lowest survivor after the last call), and the
  same failed set (the victims plus any rank the watchdog failed): recovery,
  required in at least nine runs in ten (18 of CI's 20), or, in the others,
  every survivor raising ``ProcessFailed``/``CommTimeout``;
- every call on every survivor, recovery included, within the call bound:
  by default what the watchdog guarantees with two stuck ranks in a row,
  ``2 T + 5 G + 5`` seconds (``T`` = ``COMMLIB_TIMEOUT``, ``G`` =
  ``COMMLIB_FT_GRACE``), past which a call is a hang; the summary counts the
  runs with a call over the issue's target, ``T + 5`` s, which the soak asserts
  (Open MPI's own hangs of a survivor, each turned into a fail-stop, can
  cascade past it: docs/faults-and-security.md);
- a run that does not recover (at most one in ten in all) may also end with
  no survivor, every one failed by its own watchdog (``failstopped``: Open MPI hung inside a recovery step on all
  of them; seen once in 20 runs in CI: both survivors spinning in
  ``MPIX_Comm_shrink`` for ``T + 4G``) or crashed by Open MPI while recovery
  built a communicator (``mpi_crashed``: a second victim died in that window;
  seen twice in CI, a SIGSEGV in ``ompi_comm_revoke_local``, docs/faults-and-security.md);
  the job still ends in bounded time;
- ``mpiexec`` returning, within the per-run limit (a subprocess timeout,
  then SIGKILL to the whole process group: a hang fails the test and never
  hangs the suite).

The runs go in parallel (``COMMLIB_KILL_PAR`` jobs at once). Settings, all
environment variables (the defaults are the CI configuration):

==========================  =======  ==============================================
``COMMLIB_KILL_RUNS``       ``20``   runs (soak by hand: ``COMMLIB_KILL_RUNS=100``)
``COMMLIB_KILL_NP``         ``4``    ranks per job (the issue's: 5)
``COMMLIB_KILL_MIB``        ``16``   MiB per allreduce (the issue's: 64)
``COMMLIB_KILL_PAR``        ``4``    jobs at once (a job mostly waits on its launch)
``COMMLIB_KILL_TIMEOUT``    ``8``    ``COMMLIB_TIMEOUT`` of the jobs, seconds
``COMMLIB_KILL_SEED``       (suite)  seed of the kill plan (printed on failure; default COMMLIB_TEST_SEED)
``COMMLIB_KILL_REPORT``     (none)   path: write every run's outcome as JSON
``COMMLIB_KILL_CALL_BOUND`` (above)  seconds any call may take (the soak: ``15``)
==========================  =======  ==============================================

``test_a_death_costs_only_the_victim`` is the CI-size ULFM soak (benchmarks/soak_ulfm.py
has the full one, A/B of the TCP BTL flags): only ``os._exit`` victims, and
no rank but them may die.

CI's 20 runs take about 2 minutes on a busy 2-core machine.  The issue's
target, by hand (about 40 s per run there; ``REPORT.partial`` grows as it goes)::

    COMMLIB_KILL_RUNS=100 COMMLIB_KILL_NP=5 COMMLIB_KILL_MIB=64 COMMLIB_KILL_TIMEOUT=10 COMMLIB_KILL_PAR=1 \\
      COMMLIB_KILL_CALL_BOUND=15 COMMLIB_KILL_REPORT=/tmp/kill.json python -P -m pytest -q -s tests/test_ft_kill.py
"""
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import mpi4py

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from launch import FINALIZE_TIMEOUT, FT_ARGS, LAUNCH_ATTEMPTS, launcher_failed  # noqa: E402 - tests/launch.py
from seeds import test_seed  # noqa: E402 - tests/seeds.py

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "ft_worker.py")
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
IS_OMPI = "Open MPI" in MPI.Get_library_version()

RUNS = int(os.environ.get("COMMLIB_KILL_RUNS", "20"))
NP = int(os.environ.get("COMMLIB_KILL_NP", "4"))
MIB = float(os.environ.get("COMMLIB_KILL_MIB", "16"))
PAR = int(os.environ.get("COMMLIB_KILL_PAR", "4"))
TIMEOUT = float(os.environ.get("COMMLIB_KILL_TIMEOUT", "8"))
GRACE = float(os.environ.get("COMMLIB_FT_GRACE", "2"))
SEED = int(os.environ.get("COMMLIB_KILL_SEED") or test_seed())  # the suite's seed unless set here
REPORT = os.environ.get("COMMLIB_KILL_REPORT")
# Per-call bound asserted (seconds). The default is what the watchdog guarantees
# with up to two stuck ranks in a row (a survivor Open MPI hung fails at up to
# T + 2G in its attempt (T + 3G before the cap shrank to one grace), then one
# hung in the agreement after it at up to T + 2G more), plus 5 s: a call past it is a hang. The target, every
# call within T + 5 s, is the soak's (COMMLIB_KILL_CALL_BOUND=15 with T = 10); the
# summary counts the runs over T + 5 s whatever the bound.
CALL_BOUND = float(os.environ.get("COMMLIB_KILL_CALL_BOUND", "0")) or 2 * TIMEOUT + 5 * GRACE + 5
CALLS = 3
STARTUP_S = 60  # launch, imports, and the three calls themselves under a loaded 2-core CI box
FAILSTOP = 70   # commlib.collectives.watchdog.FAILSTOP_EXIT_STATUS


# Open MPI 5.0's crash when a death is noticed while a communicator is being built
# (docs/faults-and-security.md, "A crash while recovery builds a communicator"): its
# failure handler revokes every communicator that holds the dead rank, the one still
# in ``ompi_comm_activate`` included, whose collectives are not selected yet.  A
# process's backtrace is that crash when it holds all three frames.
MPI_CRASH_FRAMES = ("ompi_comm_revoke_local", "ompi_comm_set_rank_failed", "ompi_comm_activate")
_BACKTRACE_LINE = re.compile(r"^\[([^\]\s]+:\d+)\] \[ ?\d+\] (.*)$", re.M)


def mpi_crash_pids(text: str):
    """``host:pid`` of each process whose backtrace in a job's output ``text``
    (Open MPI's signal handler: ``[host:pid] [ n] lib(function+offset)``) is
    that crash, sorted."""
    frames = {}
    for m in _BACKTRACE_LINE.finditer(text):
        frames.setdefault(m.group(1), []).append(m.group(2))
    return sorted(p for p, fs in frames.items()
                  if all(any(f"({name}+" in f for f in fs) for name in MPI_CRASH_FRAMES))


def _ulfm():
    from commlib.core.device import ulfm_available

    return IS_OMPI and ulfm_available()


def plan(seed: int, runs: int, nprocs: int):
    """The kill plan: per run ``[[rank, call, delay_ms, how], ...]``.  Run 0
    kills inside the first call, run 1 has two victims, run 2 wedges a rank;
    the rest are drawn: a third two victims, a tenth wedges."""
    rng = random.Random(seed)
    out = []
    for i in range(runs):
        two = i == 1 or (i > 2 and rng.random() < 1 / 3 and nprocs >= 4)
        victims = rng.sample(range(nprocs), 2 if two else 1)  # any rank, the lowest included
        spec = []
        for v in victims:
            call = 0 if i == 0 else (1 if i < 3 else rng.choice((0, 1, 1, 2)))
            how = "wedge" if (i == 2 or (i > 2 and rng.random() < 0.1)) else rng.choice(("exit", "exit", "kill"))
            spec.append([v, call, rng.randint(0, 400), how])
        if sum(s[3] == "wedge" for s in spec) > 1:
            spec[1][3] = "exit"
        out.append(spec)
    return out


def exit_plan(seed: int, runs: int, nprocs: int, calls: int = CALLS, two: float = 0.4, first: float = 0.4):
    """The soak's kill plans (benchmarks/soak_ulfm.py, test_a_death_costs_only_the_victim):
    per run ``[[rank, call, delay_ms, "exit"], ...]``, every victim calls ``os._exit``;
    two victims with probability ``two`` (any ranks); each victim's call is the
    first with probability ``first`` (else a later one, uniformly); its delay
    40-300 ms into the call (one in five 0-40 ms: right at the call's start)."""
    rng = random.Random(seed)
    out = []
    for _ in range(runs):
        victims = rng.sample(range(nprocs), 2 if rng.random() < two else 1)
        spec = []
        for v in victims:
            call = 0 if rng.random() < first else rng.randrange(1, calls)
            delay = rng.randint(0, 39) if rng.random() < 0.2 else rng.randint(40, 300)
            spec.append([v, call, delay, "exit"])
        out.append(spec)
    return out


def extra_deaths(o, nprocs):
    """Add to ``run_one``'s outcome ``o`` what one death cost beyond its victims:
    ``victims_planned``/``victims_died``, ``extra_ranks`` (ranks that died but no
    plan killed: a watchdog fail-stop after Open MPI wedged them, or any other
    death) and ``extra_failstop_ranks`` (those that printed the fail-stop line),
    and ``recovery_s``: per call with a kill, the slowest survivor's call time
    less the first kill's delay in that call (about kill to recovered result;
    the ranks enter a call within a few ms of each other), the run's worst."""
    victims = {v[0] for v in o["spec"]}
    dead = set(range(nprocs)) - set(o["survivors"])
    o["victims_planned"] = len(victims)
    o["victims_died"] = len(victims & dead)
    if o["outcome"] == "hang":  # no result files were read: nobody's fate is known
        o["extra_ranks"], o["extra_failstop_ranks"] = [], []
    else:
        o["extra_ranks"] = sorted(dead - victims)
        o["extra_failstop_ranks"] = sorted(r for r in o["extra_ranks"]
                                           if any(f"COMM_WORLD rank {r}," in ln for ln in o["failstop_lines"]))
    rec = []
    for c in sorted({v[1] for v in o["spec"]}):
        ts = [t[c] for t in o["call_times"].values() if len(t) > c]
        if ts:
            rec.append(max(ts) - min(v[2] for v in o["spec"] if v[1] == c) / 1000)
    o["recovery_s"] = round(max(rec), 3) if rec else None
    return o


def run_one(spec, seed, nprocs=NP, mib=MIB, timeout=TIMEOUT, ft_args=None):
    """One job; returns an outcome dict (never raises for the job's own faults).
    ``ft_args``: the job's fault-tolerance arguments to ``mpiexec`` (default
    ``launch.FT_ARGS``; benchmarks/soak_ulfm.py passes both arms of its A/B)."""
    n = int(mib * (1 << 20)) // 4
    env = dict(os.environ, COMMLIB_TIMEOUT=str(timeout), COMMLIB_FT_GRACE=str(GRACE),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    out_dir = tempfile.mkdtemp(prefix="commlib-kill-")
    env["FT_OUT_DIR"] = out_dir
    cmd = [MPIEXEC, "--oversubscribe", *(FT_ARGS if ft_args is None else ft_args), "-n", str(nprocs),
           sys.executable, WORKER,
           json.dumps({"timed": {"n": n, "calls": CALLS}, "victims": spec, "seed": seed, "oracle": False})]
    limit = STARTUP_S + timeout + 5
    log = Path(out_dir) / "output.txt"  # a file, not a pipe: a process that left the group cannot hold us
    for _ in range(LAUNCH_ATTEMPTS):
        t0 = time.monotonic()
        with open(log, "wb") as fh:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        hung = False
        try:
            p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        wall = time.monotonic() - t0
        text = log.read_bytes().decode(errors="replace")
        results = {}
        for f in Path(out_dir).glob("rank*.json"):
            r = json.loads(f.read_text())
            results[r["rank"]] = r
        if hung or not launcher_failed(text, results):
            break
    shutil.rmtree(out_dir, ignore_errors=True)
    return classify(spec, nprocs, results, text, wall, hung, timeout, seed, n)


def oracle_hashes(groups, seed, n):
    """SHA-256 of each call's ring oracle over the inputs of ``groups[call]``
    (the inputs of ft_worker.py's timed mode; ``test_oracle_matches_worker``
    checks this against the worker's own oracle)."""
    import hashlib

    import numpy as np

    from oracles import ring_oracle

    base = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    out = []
    for i, g in enumerate(groups):
        xs = []
        for w in g:
            x = np.roll(base, 1009 * w + 17 * i)
            x *= np.float32(1.0 + 0.37 * w + 0.011 * i)
            xs.append(x)
        out.append(hashlib.sha256(ring_oracle(xs).tobytes()).hexdigest())
    return out


def classify(spec, nprocs, results, text, wall, hung, timeout, seed=0, n=0, bound=None):
    """``outcome``: "recovered", "raised" (all survivors raised a documented
    error), "hang", "wrong" (a wrong or differing result), "failstopped" (no
    survivor: each was failed by its own watchdog), "mpi_crashed" (no survivor:
    each one not failed by its watchdog died of Open MPI's crash while building
    a communicator, ``mpi_crash_pids``), "bad" (anything else, e.g. no survivor
    or inconsistent failed sets).  ``mpi_crashes`` counts the processes that
    died of that crash, whatever the outcome."""
    bound = CALL_BOUND if bound is None else bound
    failstops = [ln for ln in text.splitlines() if "fail-stop" in ln and "commlib: rank" in ln]
    survivors = sorted(results)
    o = {"spec": spec, "wall": round(wall, 2), "failstops": len(failstops), "failstop_lines": failstops,
         "mpi_crashes": len(mpi_crash_pids(text)), "survivors": survivors,
         "call_times": {r: results[r]["t"] for r in survivors},
         "groups": results[survivors[0]].get("groups") if survivors else None, "problems": []}
    o["over_target"] = any(max(results[r]["t"], default=0) > timeout + 5 for r in survivors)
    kill_call = min(v[1] for v in spec)
    o["kill_call_time"] = max((results[r]["t"][kill_call] for r in survivors
                               if len(results[r]["t"]) > kill_call), default=None)
    if hung:
        o["outcome"] = "hang"
        o["problems"].append(f"mpiexec did not return within {wall:.0f} s")
        o["tail"] = text[-3000:]
        return o
    if not survivors:
        victims = {v[0] for v in spec}
        failed_self = {r for r in range(nprocs) if any(f"COMM_WORLD rank {r}," in ln for ln in failstops)}
        rest = set(range(nprocs)) - victims - failed_self
        # Open MPI hung inside a recovery step (seen: MPIX_Comm_shrink) on every
        # survivor and each one's watchdog failed it: bounded, documented, but no result
        if not rest:
            o["outcome"] = "failstopped"
        # or Open MPI crashed the others while recovery built a communicator (a second
        # victim died then): no commlib code runs in that window
        elif o["mpi_crashes"] >= len(rest):
            o["outcome"] = "mpi_crashed"
        else:
            o["outcome"] = "bad"
        o["problems"].append("no survivor reported")
        o["tail"] = text[-3000:]
        return o
    dead = sorted(set(range(nprocs)) - set(survivors))
    # a victim whose kill time falls after its last call ended may exit first:
    # it is then a survivor, checked like the others
    errors = {r: results[r].get("error") for r in survivors}
    if all(e is None for e in errors.values()):
        o["outcome"] = "recovered"
        for r in survivors:
            res = results[r]
            if len(res["hashes"]) != CALLS:
                o["problems"].append(f"rank {r}: {len(res['hashes'])} results")
            # a rank that died after the last call may go unnoticed: failed <= dead
            if not set(res["failed"]) <= set(dead) or res["failed"] != results[survivors[0]]["failed"]:
                o["problems"].append(f"rank {r}: failed {res['failed']}, the dead are {dead}")
            if max(res["t"], default=0) > bound:
                o["problems"].append(f"rank {r}: a call took {max(res['t'])} s > the bound, {bound:g} s")
        # the oracle, computed here after the job (outside its time limit)
        oracle = oracle_hashes(results[survivors[0]]["groups"], seed, n)
        for c in range(CALLS):
            hs = {results[r]["hashes"][c] for r in survivors if len(results[r]["hashes"]) > c}
            if len(hs) != 1:
                o["outcome"] = "wrong"
                o["problems"].append(f"call {c}: survivors differ")
            elif oracle is None or oracle[c] not in hs:
                o["outcome"] = "wrong"
                o["problems"].append(f"call {c}: result is not the oracle's")
    elif all(e in ("ProcessFailed", "CommTimeout") for e in errors.values()):
        o["outcome"] = "raised"
        o["errors"] = {r: results[r].get("message") for r in survivors}
    else:
        o["outcome"] = "bad"
        o["problems"].append(f"survivors disagree: {errors}")
    if o["problems"] and o["outcome"] == "recovered":
        o["outcome"] = "bad"
    if o["outcome"] != "recovered":
        o["tail"] = text[-3000:]
    return o


def summarize(outcomes):
    counts = {}
    for o in outcomes:
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    walls = sorted(o["wall"] for o in outcomes)
    kt = sorted(o["kill_call_time"] for o in outcomes if o["kill_call_time"] is not None)

    def q(xs, f):
        return round(xs[min(len(xs) - 1, int(f * len(xs)))], 2) if xs else None

    def unplanned(o):  # fail-stops of ranks the plan did not wedge: MPI really stopped, or a cascade
        wedged = {v[0] for v in o["spec"] if v[3] == "wedge"}
        return [ln for ln in o.get("failstop_lines", ())
                if not any(f"COMM_WORLD rank {r}," in ln for r in wedged)]

    return {"runs": len(outcomes), "counts": counts, "failstops": sum(o["failstops"] for o in outcomes),
            "runs_with_failstop": sum(1 for o in outcomes if o["failstops"]),
            "failstops_unplanned": sum(len(unplanned(o)) for o in outcomes),
            "runs_with_unplanned_failstop": sum(1 for o in outcomes if unplanned(o)),
            "runs_with_a_call_over_T_plus_5": sum(1 for o in outcomes if o.get("over_target")),
            "mpi_crashes": sum(o["mpi_crashes"] for o in outcomes),
            "wall_s": {"min": q(walls, 0), "median": q(walls, 0.5), "p90": q(walls, 0.9), "max": q(walls, 1)},
            "kill_call_s": {"min": q(kt, 0), "median": q(kt, 0.5), "p90": q(kt, 0.9), "max": q(kt, 1),
                            "mean": round(statistics.mean(kt), 2) if kt else None}}


@pytest.mark.skipif(not _ulfm(), reason="needs Open MPI with ULFM")
@pytest.mark.timeout(120)
def test_oracle_matches_worker():
    """The driver's oracle is the worker's (no kill; the worker computes its own)."""
    n = 3 * 40009  # > 256 KiB: "auto" picks the ring, whose order the oracle follows
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run([MPIEXEC, "--oversubscribe", "-n", "3", sys.executable, WORKER,
                          json.dumps({"timed": {"n": n, "calls": 2}, "victims": [], "seed": 5})],
                         capture_output=True, text=True, timeout=100, env=env, start_new_session=True)
    res = [json.loads(ln[9:]) for ln in out.stdout.splitlines() if ln.startswith("FTRESULT ")]
    assert len(res) == 3, out.stdout[-2000:] + out.stderr[-2000:]
    r0 = next(r for r in res if r["oracle"])
    assert r0["oracle"] == oracle_hashes(r0["groups"], 5, n) == r0["hashes"]


def test_plan_covers_the_corners():
    p = plan(1, 20, 4)
    assert p[0][0][1] == 0                      # inside the first collective
    assert len(p[1]) == 2                       # two victims
    assert p[2][0][3] == "wedge"                # MPI stops making progress
    assert all(0 <= v[2] <= 400 for s in p for v in s)
    assert max(v[2] for s in p for v in s) - min(v[2] for s in p for v in s) >= 200


def _backtrace(pid, frames):
    """Open MPI's signal-handler output for one process (as CI printed it)."""
    head = [f"[vm:{pid}] *** Process received signal ***", f"[vm:{pid}] Signal: Segmentation fault (11)",
            f"[vm:{pid}] [ 0] /lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7fc37c85a050]"]
    body = [f"[vm:{pid}] [{i + 1:2d}] /venv/lib/libmpi.so.40({f}+0x3f)[0x7fc373e745df]" for i, f in enumerate(frames)]
    return "\n".join(head + body + [f"[vm:{pid}] *** End of error message ***"])


# the crash CI saw (under PMPI_Comm_dup), and one elsewhere in Open MPI
_REVOKE_CRASH = ["ompi_comm_revoke_local", "ompi_comm_set_rank_failed", "ompi_errhandler_proc_failed_internal",
                 "opal_progress", "ompi_comm_activate", "ompi_comm_dup_with_info", "PMPI_Comm_dup"]
_OTHER_CRASH = ["mca_coll_ftagree_era_intra", "PMPIX_Comm_agree"]


def test_mpi_crash_is_told_from_other_deaths():
    """``classify`` calls a job left without survivors "mpi_crashed" only when
    every rank that was no victim died of Open MPI's crash while a communicator
    was being built (all three frames of ``MPI_CRASH_FRAMES`` in its own
    backtrace); any other death, or one such crash too few, is "bad"."""
    spec = [[1, 1, 187, "exit"], [2, 1, 262, "exit"]]
    both = _backtrace(6172, _REVOKE_CRASH) + "\n" + _backtrace(6175, _REVOKE_CRASH)
    assert mpi_crash_pids(both) == ["vm:6172", "vm:6175"]
    o = classify(spec, 4, {}, "prterun noticed ...\n" + both, 5.6, False, 8.0)
    assert (o["outcome"], o["mpi_crashes"]) == ("mpi_crashed", 2)
    # one survivor crashed elsewhere: not the known crash
    other = _backtrace(6172, _REVOKE_CRASH) + "\n" + _backtrace(6175, _OTHER_CRASH)
    assert mpi_crash_pids(other) == ["vm:6172"]
    assert classify(spec, 4, {}, other, 5.6, False, 8.0)["outcome"] == "bad"
    # the revoke frames without a communicator being built (no ompi_comm_activate)
    idle = _backtrace(6172, _REVOKE_CRASH[:4]) + "\n" + _backtrace(6175, _REVOKE_CRASH)
    assert classify(spec, 4, {}, idle, 5.6, False, 8.0)["outcome"] == "bad"
    # one victim only: two survivors, one crash line set
    assert classify(spec[:1], 4, {}, both, 5.6, False, 8.0)["outcome"] == "bad"


@pytest.mark.skipif(not _ulfm(), reason="needs Open MPI with ULFM")
@pytest.mark.timeout(STARTUP_S + 30 + 5 + 60)
def test_a_rank_wedged_in_the_shrink_is_failed_within_graces_not_timeouts():
    """The cascade of docs/faults-and-security.md, made deterministic: rank 1 dies at the
    start of a call, and rank 2's MPI then blocks (no CPU) inside the recovery's
    shrink.  The watchdog's process-idle test fails rank 2 about half a grace
    into the shrink, so every call ends within a few graces of the failure,
    whatever the timeout: here ``T`` = 30 s, and the call must take at most
    15 s (before, rank 2 was failed only at the shrink's hard bound ``T + 2G``,
    a call of over 34 s).  The survivors hold the ring oracle over ranks 0
    and 3."""
    spec = [[1, 1, 0, "exit"], [2, 0, 0, "wedge_shrink"]]
    o = run_one(spec, SEED, nprocs=4, mib=4, timeout=30.0)
    assert o["outcome"] == "recovered", (o["outcome"], o["problems"], o.get("tail", ""))
    assert o["survivors"] == [0, 3], o
    assert any("COMM_WORLD rank 2," in ln and "stuck in shrink" in ln and "whole process" in ln
               for ln in o["failstop_lines"]), o["failstop_lines"]
    slowest = max(max(t) for t in o["call_times"].values())
    print("wedged-in-shrink run:", o["call_times"], o["failstop_lines"])
    assert slowest <= 15.0, o["call_times"]


@pytest.mark.skipif(not _ulfm(), reason="needs Open MPI with ULFM")
@pytest.mark.timeout(2 * (STARTUP_S + 8 + 5) + 60)
@pytest.mark.parametrize("delay_s", [0.0, 0.01])
def test_a_second_death_inside_recovery_dup(delay_s, monkeypatch):
    """Rank 1 dies as the second call starts; rank 2 dies ``delay_s`` into
    the ``Dup`` that recovery makes after the shrink, while ranks 0 and 3
    build that communicator with it.  Recovery must notice the second death
    (in the ``Dup``, or the barrier after it) and shrink again within the same
    call: that call ends over ranks 0 and 3, and they hold the ring oracle
    over themselves for it and the next.  Open MPI's crash in that window
    ("mpi_crashed", docs/faults-and-security.md) was not seen in 17 such runs here (rank 2
    dying 0-30 ms into the Dup); it is told apart, not hidden."""
    monkeypatch.setenv("FT_DUP_EXIT_S", str(delay_s))
    o = run_one([[1, 1, 0, "exit"], [2, 1, 0, "exit_in_dup"]], SEED, nprocs=4, mib=16, timeout=8.0)
    print("death in recovery's dup:", o["outcome"], o["survivors"], o["call_times"], o["mpi_crashes"])
    if o["outcome"] == "mpi_crashed":
        pytest.xfail("Open MPI crashed the survivors while recovery built a communicator (docs/faults-and-security.md)")
    assert o["outcome"] == "recovered", (o["outcome"], o["problems"], o.get("tail", ""))
    assert o["survivors"] == [0, 3], o
    assert o["groups"] == [[0, 1, 2, 3], [0, 3], [0, 3]], o["groups"]
    assert all(t[1] <= 8.0 for t in o["call_times"].values()), o["call_times"]


@pytest.mark.skipif(not _ulfm(), reason="needs Open MPI with ULFM")
@pytest.mark.timeout(int(RUNS / max(PAR, 1) * (STARTUP_S + TIMEOUT + 5)) + 120)
def test_random_kill_times():
    """RUNS randomized kill times; 0 hangs, 0 wrong results, every run bounded,
    and recovery (the oracle's results over the survivors) in at least 90% of
    the runs (18 of CI's 20)."""
    kills = plan(SEED, RUNS, NP)
    t0 = time.monotonic()
    outcomes = [None] * len(kills)

    def one(i):
        outcomes[i] = run_one(kills[i], SEED + i)
        if REPORT:  # as it goes: a long soak can be read before it ends
            done = [o for o in outcomes if o is not None]
            Path(REPORT + ".partial").write_text(json.dumps({"summary": summarize(done), "runs": done}))

    with ThreadPoolExecutor(max_workers=max(PAR, 1)) as ex:
        list(ex.map(one, range(len(kills))))
    summary = summarize(outcomes)
    summary.update(seed=SEED, np=NP, mib=MIB, timeout=TIMEOUT, grace=GRACE, par=PAR, call_bound=CALL_BOUND,
                   total_s=round(time.monotonic() - t0, 1))
    print("\nkill test:", json.dumps(summary))
    if REPORT:
        Path(REPORT).write_text(json.dumps({"summary": summary, "runs": outcomes}, indent=1))
    # Never a hang, a wrong result or an inconsistent outcome. Recovery (every survivor
    # holding the oracle's result of every call) is required in at least nine runs in
    # ten (18 of 20): a build whose recovery never succeeds, every survivor raising,
    # fails. The rest may end bounded without a result: every survivor raising
    # ProcessFailed/CommTimeout, every survivor failed by its watchdog (MPI hung in a
    # recovery step on all of them), or crashed by Open MPI while recovery built a
    # communicator (docs/faults-and-security.md).
    bad = [(i, o) for i, o in enumerate(outcomes)
           if o["outcome"] not in ("recovered", "raised", "failstopped", "mpi_crashed")]
    assert not bad, "\n\n".join(
        f"run {i} (seed {SEED}, spec {o['spec']}): {o['outcome']}: {o['problems']}\n{o.get('tail', '')}"
        for i, o in bad[:3]) + f"\n\nsummary: {summary}"
    need = math.ceil(0.9 * RUNS)
    unrecovered = [(i, o) for i, o in enumerate(outcomes) if o["outcome"] != "recovered"]
    assert RUNS - len(unrecovered) >= need, (
        f"recovered in {RUNS - len(unrecovered)} of {RUNS} runs, fewer than {need} (seed {SEED}):\n\n" + "\n\n".join(
            f"run {i} (spec {o['spec']}): {o['outcome']}: {o.get('errors') or o['problems']}\n{o.get('tail', '')[-1500:]}"
            for i, o in unrecovered[:3]) + f"\n\nsummary: {summary}")


# The CI-size ULFM soak (benchmarks/soak_ulfm.py has the full one): one rank's
# death must cost exactly that rank.  Open MPI's TCP BTL with RDMA put on
# (its default) wedged a healthy survivor in ob1's FIN path in about one run
# in five, which the watchdog then fail-stopped; launch.FT_ARGS turns the put
# off (docs/faults-and-security.md, "The Open MPI defect and its flag").  Settings: COMMLIB_SOAK_RUNS
# (runs per case), COMMLIB_KILL_SEED.
SOAK_RUNS = int(os.environ.get("COMMLIB_SOAK_RUNS", "4"))
SOAK_PAR = 2  # two jobs at once on the 2-core CI box


@pytest.mark.skipif(not _ulfm(), reason="needs Open MPI with ULFM")
@pytest.mark.timeout(SOAK_RUNS * (STARTUP_S + 8 + 5) // SOAK_PAR + 120)
@pytest.mark.parametrize("nprocs,mib", [(4, 16), (5, 32)])
def test_a_death_costs_only_the_victim(nprocs, mib):
    """SOAK_RUNS jobs of ``nprocs`` ranks, three ``mib`` MiB float32 allreduces,
    launched as fault-tolerant jobs are (``launch.FT_ARGS``); one or two
    random victims ``os._exit`` 0-300 ms into a random call, the first call
    in run 0 and two victims in run 1.  Every run: no rank dies but the
    victims (0 extra fail-stops), every survivor holds every call's ring
    oracle over the ranks that call ended with (bit-identical), and the call
    with the kill returns within ``T`` (8 s) of it.  With Open MPI's default
    flags (``COMMLIB_TEST_FT_TCP_FLAGS=default``) the 5-rank case failed,
    2 of its 4 runs losing a second rank (docs/faults-and-security.md)."""
    seed = SEED + nprocs
    kills = exit_plan(seed, SOAK_RUNS, nprocs)
    kills[0][0][1] = 0                                   # a kill inside the first call
    if len(kills) > 1 and len(kills[1]) == 1:            # and two victims
        kills[1].append([(kills[1][0][0] + 2) % nprocs, 0, 150, "exit"])
    outcomes = [None] * len(kills)

    def one(i):
        outcomes[i] = extra_deaths(run_one(kills[i], seed + i, nprocs=nprocs, mib=mib, timeout=8.0), nprocs)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=SOAK_PAR) as ex:
        list(ex.map(one, range(len(kills))))
    print(f"\nsoak {nprocs} ranks x {mib:g} MiB, seed {seed}, {time.monotonic() - t0:.1f} s:",
          [(o["outcome"], o["extra_ranks"], o["recovery_s"], o["wall"]) for o in outcomes])
    # Open MPI's crash while recovery builds a communicator (a second victim died
    # then, run 1's shape): every extra death that crash, no fail-stop; tolerated in
    # one run of a case (docs/faults-and-security.md)
    crashed = [i for i, o in enumerate(outcomes)
               if o["outcome"] in ("recovered", "mpi_crashed") and o["extra_ranks"]
               and not o["extra_failstop_ranks"] and len(o["extra_ranks"]) <= o["mpi_crashes"]]
    if crashed:
        print(f"runs {crashed}: Open MPI crashed {[outcomes[i]['extra_ranks'] for i in crashed]} "
              f"while recovery built a communicator")
    tolerated = set(crashed) if len(crashed) <= 1 else set()
    # no stall either: a survivor Open MPI wedged but the revoke at T freed made a call of about T
    bad = [(i, o) for i, o in enumerate(outcomes) if i not in tolerated and (
           o["outcome"] != "recovered" or o["extra_ranks"] or (o["recovery_s"] or 0) >= 8.0)]
    assert not bad, "\n\n".join(
        f"run {i} (seed {seed}, spec {o['spec']}): {o['outcome']}, extra deaths {o['extra_ranks']} "
        f"(fail-stops {o['extra_failstop_ranks']}), recovery {o['recovery_s']} s: {o['problems']}\n{o.get('tail', '')}"
        for i, o in bad[:3])


def test_tcp_flags_parsing():
    """What commlib info and the ULFM warning read from btl_tcp_flags / btl."""
    from commlib.transports.mpi_process import (TCP_FLAGS_WITHOUT_PUT, _tcp_btl_selected, _tcp_flags_rdma,
                                                tcp_flags_text)

    from launch import TCP_FLAGS_WITHOUT_PUT as launched

    assert launched == TCP_FLAGS_WITHOUT_PUT
    assert not _tcp_flags_rdma(TCP_FLAGS_WITHOUT_PUT) and not _tcp_flags_rdma(0x39)
    assert _tcp_flags_rdma("send,put,inplace,need-ack,need-csum,hetero-rdma") and _tcp_flags_rdma(0x13b)
    assert _tcp_flags_rdma("send, get") and _tcp_flags_rdma("0x3") and _tcp_flags_rdma("3")
    assert not _tcp_flags_rdma("0x39") and not _tcp_flags_rdma("send,put-am")
    assert tcp_flags_text(0x39) == TCP_FLAGS_WITHOUT_PUT
    assert tcp_flags_text(0x13b) == "send,put,inplace,need-ack,need-csum,hetero-rdma"
    assert _tcp_btl_selected(None) and _tcp_btl_selected("tcp,self") and _tcp_btl_selected("^sm")
    assert not _tcp_btl_selected("self,sm") and not _tcp_btl_selected("^tcp,openib")
