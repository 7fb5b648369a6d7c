"""Fault-injection tests: ranks die during collectives, survivors must cope.

A driver (plain ``pytest``, no mpiexec) launches many small jobs of
``tests/ft_worker.py``, each with a hard timeout, so a hanging rank can never
hang the suite:

- Open MPI with ULFM: ``mpiexec --with-ft ulfm --mca btl tcp,self --mca
  btl_tcp_flags send,inplace,need-ack,need-csum --prtemca
  state_base_error_non_zero_exit 0`` (``launch.FT_ARGS``: the TCP BTL without
  RDMA put, docs/faults-and-security.md; the last, else prterun ends the whole job when a
  rank exits with a non-zero status, as ``os._exit(17)`` does); 3 to 6
  ranks, one or two victims killed (``os._exit`` or SIGKILL) before, during
  (at a random point-to-point send: any ring/tree step or the header
  exchange) or after a random collective.  Every survivor must finish every
  call with the exact result over the surviving ranks' inputs (bit-identical
  across survivors), see the same failed set, get the failure callback, and
  ``mpiexec`` must return within seconds.  ``COMMLIB_FT_CASES`` (default 20:
  a failure in one run of five goes unseen with probability 0.8^20 = 1.2 %)
  sets the number of randomized cases, ``COMMLIB_FT_SEED`` the seed (printed; default: ``COMMLIB_TEST_SEED``, tests/seeds.py);
  the random-*time* kills of 64 MiB allreduces are tests/test_ft_kill.py's.
- MPICH (no ULFM): a victim ``os._exit``\\ s; every survivor must raise
  ``CommTimeout``/``ProcessFailed`` within the timeout and the job must end; a
  SIGKILLed victim makes hydra end the job at once.

Run: ``python -m pytest -q tests/test_ft.py`` (with either venv's python).
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import mpi4py

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from launch import FINALIZE_TIMEOUT, LAUNCH_ATTEMPTS, ft_args, launcher_failed  # noqa: E402 - tests/launch.py
from seeds import test_seed  # noqa: E402 - tests/seeds.py

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "ft_worker.py")
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
LIB = MPI.Get_library_version()
IS_OMPI = "Open MPI" in LIB
IS_MPICH = "MPICH" in LIB
NCALLS = 8
REPLICATED = {0, 1, 3, 4, 6, 7}  # calls whose result is the same on every rank

SEED = int(os.environ.get("COMMLIB_FT_SEED") or test_seed())  # the suite's seed unless set here
# 20 randomized runs catch a failure that happens one run in five with probability
# 1 - 0.8**20 = 98.8% (the deterministic corners below come on top)
NCASES = int(os.environ.get("COMMLIB_FT_CASES", "20"))


# the byte transfer layers of the ULFM jobs (COMMLIB_TEST_FT_BTL overrides)
FT_BTL = os.environ.get("COMMLIB_TEST_FT_BTL", "tcp,self")


def _ulfm_symbols():
    from commlib.core.device import ulfm_available

    return ulfm_available()


def _run(nprocs, spec, timeout=45, env_extra=None, ulfm=True):
    env = dict(os.environ, COMMLIB_TIMEOUT=env_extra.pop("COMMLIB_TIMEOUT", "10") if env_extra else "10",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    env.update(env_extra or {})
    if IS_OMPI:
        cmd = [MPIEXEC, "--oversubscribe"]
        if ulfm:
            # a rank that exits non-zero must not make prterun end the job
            cmd += ft_args(FT_BTL)  # the TCP BTL without RDMA put (tests/launch.py)
    else:
        cmd = [MPIEXEC, "-disable-auto-cleanup"]
    cmd += ["-n", str(nprocs), sys.executable, WORKER, json.dumps(spec)]
    for _ in range(LAUNCH_ATTEMPTS):
        out_dir = tempfile.mkdtemp(prefix="commlib-ft-")
        env["FT_OUT_DIR"] = out_dir
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            pytest.fail(f"mpiexec did not return within {timeout} s (spec {spec}):\n{out.decode(errors='replace')[-3000:]}")
        wall = time.monotonic() - t0
        text = out.decode(errors="replace")
        results = {}
        for f in Path(out_dir).glob("rank*.json"):
            r = json.loads(f.read_text())
            results[r["rank"]] = r
        shutil.rmtree(out_dir, ignore_errors=True)
        if not launcher_failed(text, results):
            break
        print(f"[test_ft] the launcher failed before any rank ran; launching again:\n{text[-500:]}")
    return results, wall, text, p.returncode


def _cases(n):
    rng = random.Random(SEED)
    cases = []
    for i in range(n):
        nprocs = rng.randint(3, 6)
        nfail = 1 if (nprocs == 3 or rng.random() < 0.5) else 2
        victims = rng.sample(range(1, nprocs), nfail)  # rank 0 is the bcast root
        spec = []
        for v in victims:
            call = rng.randrange(NCALLS)
            u = rng.random()
            point = -1 if u < 0.15 else (10_000 if u > 0.85 else rng.randrange(14))
            spec.append([v, call, point, rng.choice(["exit", "kill"])])
        cases.append((nprocs, spec, i))
    return cases


needs_ulfm = pytest.mark.skipif(not (IS_OMPI and _ulfm_symbols()), reason="needs Open MPI with ULFM")


def _check_recovered(nprocs, spec, results, wall, text, on_failure="shrink"):
    victims = sorted(v[0] for v in spec)
    survivors = [r for r in range(nprocs) if r not in victims]
    missing = [r for r in survivors if r not in results]
    assert not missing, f"survivors {missing} printed no result (spec {spec}):\n{text[-4000:]}"
    for r in survivors:
        res = results[r]
        assert res["mode"] == "ulfm"
        assert res["ok"], f"rank {r}: {res} (spec {spec})\n{text[-3000:]}"
        assert len(res["hashes"]) == NCALLS
        assert res["failed"] == victims, (res["failed"], victims)
        assert sorted(x for cb in res["callbacks"] for x in cb) == victims
        assert all(t < 2.0 for t in res["recoveries"]), res["recoveries"]
    for c in REPLICATED:
        hs = {results[r]["hashes"][c] for r in survivors}
        assert len(hs) == 1, f"call {c}: results differ across survivors {hs} (spec {spec})"
    assert wall < 30, f"job took {wall:.1f} s"


@needs_ulfm
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs,spec,case", _cases(NCASES), ids=lambda x: None)
def test_random_kill_points(nprocs, spec, case):
    """Randomized kill points (seed in COMMLIB_FT_SEED; printed on failure)."""
    results, wall, text, _ = _run(nprocs, {"victims": spec, "seed": SEED + case})
    _check_recovered(nprocs, spec, results, wall, text + f"\n[seed {SEED}, case {case}]")


# Deterministic corners: before / first step / mid ring, for each collective, and after
# the last (noticed in the final barrier). "After call c" would be the same point of
# the program as "before call c + 1" (nothing runs between them but bookkeeping), so
# it is not repeated for the others.
CORNERS = [(4, [[2, c, p, how]]) for c in range(NCALLS) for p, how in ((-1, "kill"), (0, "exit"), (3, "kill"))]
CORNERS += [(4, [[2, NCALLS - 1, 10_000, "exit"]])]
CORNERS += [(6, [[1, 0, 2, "kill"], [4, 0, 5, "kill"]]),   # two failures in the same call
            (5, [[3, 7, 1, "exit"], [4, 2, 0, "kill"]]),
            (3, [[1, 0, 1, "kill"], [2, 5, -1, "exit"]])]  # down to one rank


@needs_ulfm
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs,spec", CORNERS)
def test_kill_corners(nprocs, spec):
    results, wall, text, _ = _run(nprocs, {"victims": spec, "seed": 3})
    _check_recovered(nprocs, spec, results, wall, text)


@needs_ulfm
@pytest.mark.timeout(60)
def test_no_failure_clean_exit():
    results, wall, text, rc = _run(4, {"victims": [], "seed": 5})
    assert rc == 0, text[-2000:]
    assert sorted(results) == [0, 1, 2, 3] and all(r["ok"] and not r["failed"] for r in results.values())


@needs_ulfm
@pytest.mark.timeout(150)
def test_ulfm_barrier_holds_every_rank_until_the_last_enters():
    """tests/test_collectives.py's late-rank barrier test (every algorithm: the
    last rank enters only after the others said they are about to, and none may
    leave before it does) on a ULFM fault-tolerant communicator, 3 ranks."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               COMMLIB_TEST_FT_MODE="ulfm", COMMLIB_FINALIZE_TIMEOUT=FINALIZE_TIMEOUT)
    cmd = [MPIEXEC, "--oversubscribe", *ft_args(FT_BTL), "-n", "3", sys.executable, "-P", "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "--with-mpi", "-m", "mpi", "--timeout=100", "--timeout-method=thread",
           str(HERE / "test_collectives.py"), "-k", "barrier_holds and ft"]
    for _ in range(LAUNCH_ATTEMPTS):
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=130,
                           cwd=HERE.parent)
        text = p.stdout.decode(errors="replace")
        if not launcher_failed(text, "passed" in text or "failed" in text):
            break
    assert p.returncode == 0 and "6 passed" in text, text[-4000:]  # 3 algorithms, with and without the agreement


@needs_ulfm
@pytest.mark.timeout(60)
def test_on_failure_raise():
    spec = [[2, 1, 1, "kill"]]
    results, wall, text, _ = _run(4, {"victims": spec, "seed": 9, "on_failure": "raise"})
    for r in (0, 1, 3):
        res = results[r]
        assert res["raised"] == [[1, [2]]], res
        assert res["ok"], res  # later calls run on the shrunk communicator
    assert wall < 30


@needs_ulfm
@pytest.mark.timeout(90)
@pytest.mark.parametrize("call,point", [(0, 1), (5, 0)])
def test_stalled_peer_times_out(call, point):
    """A live rank that stops answering mid-collective (no ULFM failure to
    report): the watchdog revokes after COMMLIB_TIMEOUT, and once the stalled
    rank is back every rank, itself included, raises CommTimeout: no one hangs,
    no one returns a result the others lack.  The error is marked ``recovered``
    (the communicator was revoked and rebuilt inside the call), so a
    ResilientRunner redoes the step without a second shrink."""
    spec = [[2, call, point, "stall"]]
    # a stall shorter than the hard bound (timeout + grace): no fail-stop
    results, wall, text, rc = _run(4, {"victims": spec, "seed": 3},
                                   env_extra={"COMMLIB_TIMEOUT": "2", "FT_STALL": "6", "COMMLIB_FT_GRACE": "8"})
    assert sorted(results) == [0, 1, 2, 3], text[-3000:]
    for r, res in results.items():
        assert res.get("error") == "CommTimeout", res
        assert "timeout" in res["message"], res
        assert res["failed"] == [], res
        assert res["recovered"] is True, res
        assert len(res["hashes"]) == call, res  # the calls before it all succeeded
    assert wall < 60, wall


@needs_ulfm
@pytest.mark.timeout(90)
def test_stall_past_hard_bound_fails_the_rank():
    """A rank stalled inside a collective (no CPU, as when blocked on a lock)
    past timeout + grace fails itself: one line on stderr, exit status 70; the
    others treat it as a failure, shrink and finish with the right result."""
    spec = [[2, 1, 1, "stall"]]
    results, wall, text, rc = _run(4, {"victims": spec, "seed": 3},
                                   env_extra={"COMMLIB_TIMEOUT": "2", "FT_STALL": "30", "COMMLIB_FT_GRACE": "1"})
    lines = [ln for ln in text.splitlines() if "fail-stop" in ln]
    assert len(lines) == 1 and "rank 2 " in lines[0] and "allreduce" in lines[0], text[-3000:]
    assert sorted(results) == [0, 1, 3], text[-3000:]
    _check_recovered(4, spec, results, wall, text)


@pytest.mark.skipif(not IS_MPICH, reason="bounded-error checks run under MPICH (no ULFM)")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call,point", [(0, 3), (1, 0), (2, 2), (3, 1), (4, -1), (5, 4), (6, 0), (7, 10_000)])
def test_no_ulfm_bounded_error(call, point):
    """Without ULFM a dead peer (os._exit) makes every survivor raise within the timeout."""
    spec = [[2, call, point, "exit"]]
    results, wall, text, _ = _run(4, {"victims": spec, "seed": 1}, env_extra={"COMMLIB_TIMEOUT": "2"})
    for r in (0, 1, 3):
        res = results.get(r)
        assert res is not None, f"rank {r} printed nothing:\n{text[-3000:]}"
        assert res["mode"] == "timeout"
        if point == 10_000 and call == NCALLS - 1:
            continue  # died after the last call: nothing left to fail
        assert res["error"] in ("CommTimeout", "ProcessFailed"), res
        assert f"rank {res['rank']}" in res["message"] or "rank" in res["message"]
        assert res["elapsed"] < 2 * 2 * 4 + 5, res
    assert wall < 40, wall


@pytest.mark.skipif(not IS_MPICH, reason="MPICH only")
@pytest.mark.timeout(60)
def test_no_ulfm_sigkill_ends_job():
    """Under hydra a SIGKILLed rank ends the whole job at once: bounded, no hang."""
    results, wall, text, rc = _run(4, {"victims": [[1, 0, 2, "kill"]], "seed": 1}, env_extra={"COMMLIB_TIMEOUT": "2"})
    assert rc != 0 and wall < 20


# --------------------------------------------------------------- the watchdog
class _StubTransport:
    """Records revokes; ``block`` makes a revoke hang (a wedged MPI library)."""

    def __init__(self, block=False):
        import threading

        self.revoked = threading.Event()
        self.block = block

    def revoke(self):
        self.revoked.set()
        if self.block:
            time.sleep(3600)


def _hooked_watchdog():
    from commlib.collectives.ft import Watchdog

    stops = []
    return Watchdog(exit=stops.append), stops


@pytest.mark.timeout(30)
def test_watchdog_soft_deadline_revokes():
    """Past ``timeout`` the watchdog revokes; a rank that then leaves MPI in
    time is not failed."""
    wd, stops = _hooked_watchdog()
    tp = _StubTransport()
    w = wd.arm(tp, 0.2, "allreduce", 3, grace=1.0)
    assert tp.revoked.wait(5)
    assert wd.step(w, "agree", 5.0)  # reports the soft deadline as passed
    wd.disarm(w)
    time.sleep(1.3)
    assert stops == []


@pytest.mark.timeout(30)
def test_watchdog_disarm_in_time_does_nothing():
    wd, stops = _hooked_watchdog()
    tp = _StubTransport()
    for _ in range(100):  # the fast path: arm, step, disarm
        w = wd.arm(tp, 0.5, "allreduce", 0, grace=0.5)
        wd.step(w, "agree", 1.0)
        assert not wd.disarm(w)
    time.sleep(1.2)
    assert not tp.revoked.is_set() and stops == []


@pytest.mark.timeout(30)
def test_watchdog_fail_stop_when_revoke_blocks():
    """The TCP-deadlock shape: the attempt never returns and the revoke itself
    blocks; the watchdog still fails the rank at timeout + grace, naming the
    rank, the call, the step and the time."""
    wd, stops = _hooked_watchdog()
    tp = _StubTransport(block=True)
    t0 = time.monotonic()
    wd.arm(tp, 0.3, "allreduce", 2, grace=0.4)
    while not stops and time.monotonic() - t0 < 10:
        time.sleep(0.01)  # the "stuck" caller (a C call that released the GIL)
    dt = time.monotonic() - t0
    assert len(stops) == 1 and 0.65 <= dt < 2.5, (stops, dt)
    msg = stops[0]
    assert "rank 2" in msg and "allreduce" in msg and "attempt" in msg and "fail-stop" in msg
    assert "status 70" in msg


@pytest.mark.timeout(30)
def test_watchdog_spinning_thread_gets_the_cap():
    """Past the hard bound a thread that still uses CPU (spinning in MPI_Testall
    on a peer that its own watchdog will fail first) is given up to one more
    grace; a blocked one is failed at the bound."""
    wd, stops = _hooked_watchdog()
    tp = _StubTransport()
    t0 = time.monotonic()
    wd.arm(tp, 0.2, "allreduce", 1, grace=0.4)
    while not stops and time.monotonic() - t0 < 10:
        pass  # spin, as a healthy rank does
    dt = time.monotonic() - t0
    assert len(stops) == 1 and "still waiting" in stops[0], stops
    assert 0.9 <= dt < 2.5, dt  # the cap: 0.2 + 0.4 + 0.4


@pytest.mark.timeout(30)
def test_watchdog_spinning_thread_with_wedged_revoke_fails_at_the_bound():
    """A thread spinning forever inside one MPI call (seen: mca_btl_tcp_send
    under MPI_Testall) uses CPU, but its revoke does not return: failed at
    timeout + grace, not at the cap."""
    wd, stops = _hooked_watchdog()
    tp = _StubTransport(block=True)
    t0 = time.monotonic()
    wd.arm(tp, 0.2, "allreduce", 1, grace=1.0)
    while not stops and time.monotonic() - t0 < 10:
        pass
    dt = time.monotonic() - t0
    assert len(stops) == 1 and "revoke has not returned" in stops[0], stops
    assert 1.1 <= dt < 2.1, dt  # the bound (1.2 s), not the cap (2.2 s)


@pytest.mark.timeout(30)
def test_watchdog_bounds_each_step():
    """A step with only a hard bound (agree, shrink, revoke) fails the rank
    when it overruns, even with no attempt deadline armed; several watches at
    once (calls from two threads) keep their own deadlines."""
    wd, stops = _hooked_watchdog()
    tp = _StubTransport()
    w1 = wd.arm(tp, 30.0, "bcast", 1, grace=1.0)
    w2 = wd.arm(tp, 30.0, "allreduce", 1, grace=1.0)
    t0 = time.monotonic()
    wd.step(w2, "agree", 0.3)
    while not stops and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert len(stops) == 1 and "allreduce stuck in agree" in stops[0], stops
    assert 0.25 <= time.monotonic() - t0 < 2.0
    assert not wd.disarm(w1) and not tp.revoked.is_set()


@pytest.mark.timeout(30)
def test_watchdog_fails_an_idle_process_early_in_the_shrink():
    """A process that uses no CPU in the shrink (which follows an agreement all
    live ranks joined) is blocked inside MPI, which polls in every wait (the
    second hang of the cascade in docs/faults-and-security.md ("A rank wedged in the shrink")): failed within a window of
    half a grace, long before the step's hard bound.  In the agreement the
    same idleness is only judged at the hard bound."""
    wd, stops = _hooked_watchdog()
    tp = _StubTransport()
    w = wd.arm(tp, 30.0, "allreduce", 3, grace=1.0)
    t0 = time.monotonic()
    wd.step(w, "shrink", 30.0)
    while not stops and time.monotonic() - t0 < 10:
        time.sleep(0.05)  # blocked, as in pthread_mutex_lock
    dt = time.monotonic() - t0
    assert len(stops) == 1 and "stuck in shrink" in stops[0] and "whole process" in stops[0], stops
    assert 0.45 <= dt < 3.0, dt  # the window (0.5 s), far from the hard bound (30 s)
    stops.clear()
    w = wd.arm(tp, 30.0, "allreduce", 3, grace=1.0)
    wd.step(w, "agree", 30.0)
    time.sleep(2.0)  # a healthy rank waiting in MPIX_Comm_agree can look like this
    wd.disarm(w)
    assert stops == []


@pytest.mark.timeout(30)
def test_watchdog_leaves_a_polling_process_in_the_shrink_alone():
    """A process that polls while it waits in the shrink (for a peer the watchdog
    of which fails it) is not failed before the hard bound, and neither is an
    attempt whose thread blocks (that has its own rules)."""
    wd, stops = _hooked_watchdog()
    tp = _StubTransport()
    w = wd.arm(tp, 30.0, "allreduce", 1, grace=0.4)
    t0 = time.monotonic()
    wd.step(w, "shrink", 30.0)
    while time.monotonic() - t0 < 1.5:
        pass  # Open MPI's progress loop
    assert stops == []
    wd.disarm(w)
    w = wd.arm(tp, 30.0, "allreduce", 1, grace=0.4)
    time.sleep(1.0)
    wd.disarm(w)
    assert stops == []


_FAILSTOP_SCRIPT = r"""
import ctypes, sys, time
import mpi4py
mpi4py.rc.initialize = False
from commlib.collectives.ft import Watchdog
class Wedged:
    def revoke(self):
        time.sleep(3600)
wd = Watchdog()
wd.arm(Wedged(), 0.5, "allreduce", 4, grace=0.5)
if sys.argv[1] == "c":
    ctypes.CDLL(None).sleep(60)  # stuck in a C call that released the GIL, as mpi4py's MPI calls do
else:
    time.sleep(60)
print("not reached")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["c", "py"])
def test_watchdog_fail_stop_exits_process(how):
    """For real: one line on stderr, then exit status 70 (FAILSTOP_EXIT_STATUS)."""
    from commlib.collectives.ft import FAILSTOP_EXIT_STATUS

    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-P", "-c", _FAILSTOP_SCRIPT, how], capture_output=True, text=True,
                       timeout=90, env=env)
    dt = time.monotonic() - t0
    assert p.returncode == FAILSTOP_EXIT_STATUS == 70, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if "fail-stop" in ln]
    assert len(lines) == 1 and "rank 4" in lines[0] and "allreduce stuck in attempt" in lines[0], p.stderr
    assert "not reached" not in p.stdout
    assert dt < 60, dt  # 1 s after the imports (which take seconds on a loaded 2-core box)
