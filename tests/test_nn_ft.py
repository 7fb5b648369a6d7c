"""A rank SIGKILLed inside commlib.nn attention, forward or backward, on a fault-tolerant communicator.

Each job is one ``mpiexec --with-ft ulfm`` run (``launch.FT_ARGS``) of this
file in worker mode on 4 ranks, ``commlib.init(fault_tolerant=True,
on_failure="raise", timeout=T)``, with three kills (4 -> 3 -> 2 -> 1 ranks),
each inside one variant: ring, bidirectional ring, Ulysses or hybrid (Ulysses
x ring; a 2 x 2 grid on 4 ranks), in a random layout, causal or not.  A
*step* is the attention call on this rank's shard (float64),
``loss.backward()`` and a small ``comm.allreduce`` of the loss (the gradient
all-reduce of a training step).  Per kill:

1. a step on all ranks, checked against the oracle; it also counts the
   transport waits (``MPITransport.waitall``) each phase makes on each rank;
2. a step in which the victim SIGKILLs itself (``os.kill``) at a random
   point: on entering the k-th wait of the forward (argument agreement and
   ring/all-to-all steps) or of the backward, or from a tensor hook on the
   attention output when autograd's backward reaches it;
3. every survivor must raise within ``T + G`` seconds of the kill (the
   victim's clock, written just before it dies), from the attention call,
   from ``loss.backward()``, or from the all-reduce with ``recovered = True``;
   and it must be ``ProcessFailed``: a ``CommTimeout`` (the other documented
   error) would mean a survivor waited out its bound, released by nobody's
   revoke.  Each calls ``comm.recover()`` unless the error says
   ``recovered`` (the caller's rule, commlib.nn's docstring);
4. a step of the same variant on the shrunk communicator (the same object),
   the sequence re-sharded over the survivors (the hybrid with a Ulysses
   degree that divides the new size), checked against the oracle.

The oracle: float64 ``torch.nn.functional.scaled_dot_product_attention`` on
the whole sequence with autograd (out and dq, dk, dv of ``sum(out * w)``),
cut into this rank's shard by positions computed here (not by
``commlib.nn.shard_sequence``).  Tolerance 1e-9 absolute on values of order
1 (float64 rounding over a few merges; a dropped rank or block is O(1) off).

Unit tests (stand-in communicators whose collectives transport changes, as
a shrink changes it): the hybrid's grid cache is keyed by the group and the
old group's grid is revoked; a split that shrank raises ``recovered``; a
failed call revokes its family (user transport, sub-communicators, from the
backward too) unless the communicator already shrank inside it (then the
error is marked ``recovered`` and nothing is revoked).

Settings (environment): ``COMMLIB_NN_FT_JOBS`` (default 6: 18 kills, the
variants in turn), ``COMMLIB_NN_FT_PAR`` (jobs at once, default 2),
``COMMLIB_NN_FT_TIMEOUT`` (``T``, default 6 s), ``COMMLIB_FT_GRACE`` (``G``,
default 2 s), ``COMMLIB_NN_FT_SEED`` (default: the time; printed, with each
job's trials).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

VARIANTS = ("ring", "bidirectional", "ulysses", "hybrid")
LAYOUTS = ("contiguous", "striped", "zigzag")
NP = 4
KILLS = 3  # 4 -> 3 -> 2 -> 1 ranks
B, SEQ, H, HKV, D = 1, 48, 12, 12, 8  # SEQ: a multiple of 2P for P = 4, 3, 2; H: of 4, 3, 2
TOL = 1e-9


# ----------------------------------------------------------------- the worker
def _positions(layout, rank, size, L):
    """Global positions of rank's tokens (written here, independent of commlib's layouts)."""
    if layout == "contiguous":
        return list(range(rank * L, (rank + 1) * L))
    if layout == "striped":
        return [rank + size * i for i in range(L)]
    h = L // 2  # zigzag: chunks rank and 2P-1-rank of 2P
    return list(range(rank * h, rank * h + h)) + list(range((2 * size - 1 - rank) * h, (2 * size - rank) * h))


def _oracle(torch, q, k, v, w, causal):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal).transpose(1, 2)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def worker(spec):  # noqa: C901 - one job's script, top to bottom
    import numpy as np
    import torch

    import commlib
    import commlib.nn as cnn
    from commlib.transports.mpi import MPITransport
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_rank()
    out_dir = Path(os.environ["NNFT_OUT_DIR"])
    T = float(os.environ["COMMLIB_TIMEOUT"])
    comm = commlib.init(fault_tolerant=True, on_failure="raise", timeout=T)
    g = torch.Generator().manual_seed(spec["seed"])
    q, k, v, w = (torch.randn(B, SEQ, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV, H))
    refs = {c: _oracle(torch, q, k, v, w, c) for c in (False, True)}

    # wait counting and the kill
    state = {"phase": None, "counts": {}, "arm": None}
    orig_waitall = MPITransport.waitall

    def die(trial):
        (out_dir / f"kill{trial}.json").write_text(json.dumps({"world": world, "t": time.time()}))
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def counted_waitall(self, requests, timeout=None, op="waitall"):
        ph = state["phase"]
        if ph is not None:
            n = state["counts"][ph] = state["counts"].get(ph, 0) + 1
            arm = state["arm"]
            if arm is not None and arm[0] == ph and arm[1] == n:
                die(arm[2])
        return orig_waitall(self, requests, timeout, op)

    MPITransport.waitall = counted_waitall

    def attention(tr, qs, ks, vs, degree):
        variant, layout, causal = tr["variant"], tr["layout"], tr["causal"]
        if variant in ("ring", "bidirectional"):
            return cnn.ring_attention(qs, ks, vs, comm, causal=causal, layout=layout,
                                      bidirectional=variant == "bidirectional")
        if variant == "ulysses" and layout == "contiguous":
            return cnn.ulysses_attention(qs, ks, vs, comm, causal=causal)
        return cnn.hybrid_attention(qs, ks, vs, comm, degree, causal=causal, layout=layout)

    def step(tr, degree, hook=None):
        """One step on this rank's shard: (out, dq, dk, dv) and the shard's positions."""
        P, r = comm.size, comm.rank
        pos = torch.tensor(_positions(tr["layout"], r, P, SEQ // P))
        qs, ks, vs = (x.index_select(1, pos).clone().requires_grad_() for x in (q, k, v))
        state["phase"] = "forward"
        out = attention(tr, qs, ks, vs, degree)
        state["phase"] = None
        if hook is not None:
            out.register_hook(hook)
        loss = (out * w.index_select(1, pos)).sum()
        state["phase"] = "backward"
        loss.backward()
        state["phase"] = None
        comm.allreduce(np.array([loss.item()]))  # the step's gradient all-reduce
        return (out.detach(), qs.grad, ks.grad, vs.grad), pos

    rng = random.Random(spec["seed"])

    def degree_for(variant, P):
        if variant == "ulysses":
            return P
        if variant == "hybrid":  # a grid of 2 x 2 on 4 ranks; on fewer, a degree dividing them (1: the ring)
            return 2 if P == 4 else rng.choice([d for d in (1, P) if H % d == 0])
        return 1

    report = {"world": world, "spec": spec, "verify": [], "trials": []}

    def save():
        (out_dir / f"rank{world}.json").write_text(json.dumps(report))

    def verify(tr, degree, count=False):
        """A step checked against the oracle; with ``count``, one more step
        counting the waits each phase makes (a first call's own waits, e.g. the
        hybrid grid's split, are not the kill step's)."""
        res, pos = step(tr, degree)
        err = max(float((a - b.index_select(1, pos)).abs().max()) for a, b in zip(res, refs[tr["causal"]]))
        report["verify"].append({"size": comm.size, "variant": tr["variant"], "degree": degree, "err": err,
                                 "world_ranks": list(comm.world_ranks)})
        save()
        if not count:
            return None
        state["counts"] = {}
        step(tr, degree)
        report["verify"][-1]["counts"] = dict(state["counts"])
        return dict(state["counts"])

    for trial, tr in enumerate(spec["trials"]):
        degree = degree_for(tr["variant"], comm.size)
        counts = verify(tr, degree, count=True)
        victim = tr["victim"] % comm.size
        hook = None
        state["counts"] = {}
        if comm.rank == victim:
            if tr["phase"] == "hook":
                hook = lambda grad: die(trial)  # noqa: E731 - backward reached the attention's output
            else:
                # u in [0, 1] (rounded: 1.0 happens) picks one of the phase's n waits, 1..n
                n = counts.get(tr["phase"], 0)
                state["arm"] = (tr["phase"], 1 + min(int(tr["u"] * n), max(n - 1, 0)), trial)
        entry = {"degree": degree, "victim_world": comm.world_ranks[victim]}
        try:
            step(tr, degree, hook)
            entry["error"] = None
        except (commlib.ProcessFailed, commlib.CommTimeout) as exc:
            entry.update(error=type(exc).__name__, message=str(exc)[:300], t_raise=time.time(),
                         recovered=bool(getattr(exc, "recovered", False)), phase=state["phase"] or "allreduce")
            state["phase"] = None
            if not entry["recovered"]:  # the caller's rule
                comm.recover()
            entry["t_recovered"] = time.time()
        except Exception as exc:  # noqa: BLE001 - reported, the driver fails the run
            entry.update(error=type(exc).__name__, message=str(exc)[:300], t_raise=time.time(),
                         recovered=False, phase=state["phase"])
            report["trials"].append(entry)
            save()
            raise
        state["phase"] = None
        state["arm"] = None  # a kill point the step did not reach must not fire in the checks after it
        entry["size_after"] = comm.size
        entry["failed"] = list(comm.failed_ranks)
        report["trials"].append(entry)
        save()
        verify(tr, degree_for(tr["variant"], comm.size))  # the same variant on the shrunk communicator
    report["done"] = True
    save()


# ----------------------------------------------------------------- the driver
def plan(seed, jobs):
    """Per job: ``KILLS`` trials, each ``{"variant", "layout", "causal", "victim": rank index, "phase":
    "forward" | "backward" | "hook", "u": where among the phase's waits}``; the variants go round
    ``VARIANTS`` over all the jobs' trials, so each gets a share and the hybrid meets the 2 x 2 grid."""
    rng = random.Random(seed)
    out = []
    for j in range(jobs):
        trials = []
        for i in range(KILLS):
            variant = VARIANTS[(KILLS * j + i) % len(VARIANTS)]
            trial = {"variant": variant, "layout": rng.choice(LAYOUTS), "causal": rng.random() < 0.5,
                     "victim": rng.randrange(NP - i),
                     "phase": rng.choice(("forward", "forward", "backward", "backward", "hook")),
                     "u": round(rng.random(), 3)}
            if variant == "hybrid" and i == 0 and not any(job["trials"][0]["variant"] == "hybrid" for job in out):
                # the first hybrid on the 2 x 2 grid dies in its first all-to-alls (waits 5-7 of the
                # forward's 12 when written): a rank of the other Ulysses group then waits in its ring
                # on a live neighbour that raised, released only by that neighbour's revoke of their
                # ring sub-communicator (without it: CommTimeout after T, measured)
                trial.update(phase="forward", u=round(0.34 + 0.15 * rng.random(), 3))
            trials.append(trial)
        out.append({"trials": trials, "seed": rng.randrange(1 << 30)})
    return out


def run_job(spec, timeout, grace):
    from launch import FINALIZE_TIMEOUT, FT_ARGS, LAUNCH_ATTEMPTS, launcher_failed

    env = dict(os.environ, COMMLIB_TIMEOUT=str(timeout), COMMLIB_FT_GRACE=str(grace), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    limit = 90 + KILLS * (timeout + 4 * grace)  # launch and torch imports on a loaded 2-core box, the kills
    for _ in range(LAUNCH_ATTEMPTS):
        out_dir = tempfile.mkdtemp(prefix="commlib-nnft-")
        env["NNFT_OUT_DIR"] = out_dir
        cmd = [mpiexec, "--oversubscribe", *FT_ARGS, "-n", str(NP), sys.executable, "-P", str(Path(__file__)),
               "worker", json.dumps(spec)]
        log = Path(out_dir) / "output.txt"
        t0 = time.monotonic()
        with open(log, "wb") as fh:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        hung = False
        try:
            p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        wall = time.monotonic() - t0
        text = log.read_bytes().decode(errors="replace")
        ranks = {}
        for f in Path(out_dir).glob("rank*.json"):
            r = json.loads(f.read_text())
            ranks[r["world"]] = r
        kills = {}
        for f in Path(out_dir).glob("kill*.json"):
            kills[int(f.stem[4:])] = json.loads(f.read_text())
        shutil.rmtree(out_dir, ignore_errors=True)
        if hung or not launcher_failed(text, ranks):
            break
    return judge(spec, ranks, kills, text, wall, hung, timeout, grace)


def judge(spec, ranks, kills, text, wall, hung, timeout, grace):
    """The job's problems (empty: it passed) and figures."""
    o = {"spec": spec, "wall": round(wall, 1), "problems": [], "raise_s": [], "recover_s": []}
    if hung:
        o["problems"].append(f"mpiexec did not return within {wall:.0f} s")
    victims = {kills[t]["world"] for t in kills}
    for t in range(len(spec["trials"])):
        if t not in kills:
            o["problems"].append(f"trial {t}: the victim never died (kill point not reached)")
            continue
        tk = kills[t]["t"]
        for w, r in sorted(ranks.items()):
            if w in victims and len(r["trials"]) <= t:
                continue
            if len(r["trials"]) <= t:
                o["problems"].append(f"trial {t}: world rank {w} reported no outcome")
                continue
            e = r["trials"][t]
            if e["error"] not in ("ProcessFailed", "CommTimeout"):
                o["problems"].append(f"trial {t}: world rank {w} raised {e['error']}: {e.get('message')}")
                continue
            if e["error"] != "ProcessFailed":  # it waited out its bound: no failure report or revoke released it
                o["problems"].append(f"trial {t}: world rank {w} raised {e['error']} (not released by the failure): "
                                     f"{e.get('message')}")
            lat = e["t_raise"] - tk
            o["raise_s"].append(round(lat, 3))
            o.setdefault("where", []).append(f"{e['error']} in {e['phase']}{' (recovered)' if e['recovered'] else ''}")
            o["recover_s"].append(round(e["t_recovered"] - tk, 3))
            if lat > timeout + grace:
                o["problems"].append(f"trial {t}: world rank {w} raised {lat:.2f} s after the kill > T + G = "
                                     f"{timeout + grace:g} s")
            if e.get("size_after") != NP - 1 - t:
                o["problems"].append(f"trial {t}: world rank {w} has {e.get('size_after')} ranks after recovery")
            if kills[t]["world"] not in e.get("failed", ()):
                o["problems"].append(f"trial {t}: world rank {w}: failed {e.get('failed')} lacks the victim")
    alive = set(range(NP)) - victims
    for w in sorted(alive):
        r = ranks.get(w)
        if r is None or not r.get("done"):
            o["problems"].append(f"world rank {w} (no victim) did not finish")
            continue
        for i, ver in enumerate(r["verify"]):
            if not ver["err"] <= TOL:
                o["problems"].append(f"world rank {w}: {ver['variant']} step {i} on {ver['size']} ranks (degree "
                                     f"{ver['degree']}) differs from the oracle by {ver['err']:.3g}")
        want = [n for t in range(KILLS) for n in (NP - t, NP - t - 1)]  # before and after each kill
        if [v["size"] for v in r["verify"]] != want:
            o["problems"].append(f"world rank {w}: checked steps on {[v['size'] for v in r['verify']]} ranks, "
                                 f"not {want}")
    if o["problems"]:
        o["tail"] = text[-4000:]
    return o


def test_grid_cache_follows_the_group():
    """The hybrid's grid cache is keyed by the communicator's group: a new
    collectives transport (what a shrink makes) splits anew, and the old
    group's sub-communicators are revoked."""
    pytest.importorskip("torch")
    from commlib.nn import hybrid

    class Tp:
        def __init__(self):
            self.revoked = 0

        def revoke(self):
            self.revoked += 1

    class Comm:
        ft = object()

        def __init__(self, size):
            self.rank, self.size, self.tp, self.subs = 0, size, Tp(), []
            self.callbacks = []

        def collective_transport(self, *a, **k):
            return self.tp

        def add_failure_callback(self, fn):
            self.callbacks.append(fn)

        def split(self, color, key):
            sub = Comm(1)
            sub.transport = Tp()
            self.subs.append(sub)
            return sub

    comm = Comm(4)
    first = hybrid.grid(comm, 2)
    assert hybrid.grid(comm, 2) is first and len(comm.subs) == 2  # cached
    comm.tp, comm.size = Tp(), 2  # a shrink: a new collectives transport, fewer ranks
    for cb in comm.callbacks:
        cb((3,), comm)
    assert all(s.tp.revoked and s.transport.revoked for s in first)  # the old group's grid: revoked
    second = hybrid.grid(comm, 2)
    assert second is not first and len(comm.subs) == 4  # split anew for the new group

    # a split whose barrier recovered from a failure (on_failure="shrink"): the
    # colours were the old group's; the call raises, recovered, nothing cached
    from commlib import ProcessFailed

    class Shrinking(Comm):
        failed_ranks = (2,)

        def split(self, color, key):
            self.tp, self.size = Tp(), 3
            return super().split(color, key)

    comm = Shrinking(4)
    with pytest.raises(ProcessFailed) as info:
        hybrid.grid(comm, 2)
    assert info.value.recovered is True
    assert all(s.tp.revoked for s in comm.subs)


def test_failed_call_revokes_its_family_unless_already_recovered():
    """A call that fails revokes the transports linked to its own (the
    communicator's user transport, a grid's sub-communicators); one whose
    communicator shrank inside the call (its collectives transport replaced)
    marks the error ``recovered`` and revokes nothing (the new group must
    survive), as does an error that says ``recovered`` already."""
    pytest.importorskip("torch")
    from commlib import CommTimeout, InvalidArgument, ProcessFailed
    from commlib.nn import _failure

    class Tp:
        fault_tolerant = True

        def __init__(self):
            self.revoked = 0

        def revoke(self):
            self.revoked += 1

    class Ft:
        mode = "ulfm"

    class Comm:
        ft = Ft()

        def __init__(self):
            self.coll, self.transport = Tp(), Tp()

        def collective_transport(self, *a, **k):
            return self.coll

    def fail(exc, comm=None, tp=None, shrink=False):
        tp = tp or comm.coll
        try:
            with _failure.guarded(tp, comm):
                if shrink:
                    comm.coll, comm.transport = Tp(), Tp()
                raise exc
        except type(exc) as caught:
            return caught

    comm = Comm()
    sub = Tp()
    _failure.link_comm(comm, comm.coll)
    _failure.link(comm.coll, sub)
    exc = fail(ProcessFailed("peer died"), comm)
    assert not getattr(exc, "recovered", False)
    assert comm.coll.revoked and comm.transport.revoked and sub.revoked
    # from the backward (only the transport known): the same family
    old = comm.coll.revoked
    fail(CommTimeout("stalled"), tp=sub)
    assert comm.coll.revoked > old

    comm = Comm()
    _failure.link_comm(comm, comm.coll)
    first, user = comm.coll, comm.transport
    exc = fail(CommTimeout("no process lost; rebuilt"), comm, shrink=True)
    assert exc.recovered is True
    assert not (first.revoked or user.revoked or comm.coll.revoked or comm.transport.revoked)

    comm = Comm()
    done = ProcessFailed("shrunk inside a collective")
    done.recovered = True
    fail(done, comm)
    assert not (comm.coll.revoked or comm.transport.revoked)
    fail(InvalidArgument("bad argument, raised on every rank"), comm)
    assert not comm.coll.revoked


def test_plan_covers_every_variant_and_phase():
    p = plan(1, 6)
    trials = [t for j in p for t in j["trials"]]
    assert {t["variant"] for t in trials} == set(VARIANTS)
    assert {t["phase"] for t in trials} == {"forward", "backward", "hook"}
    assert any(j["trials"][0]["variant"] == "hybrid" for j in p)  # the 2 x 2 grid
    assert all(len(j["trials"]) == KILLS for j in p)


def _ulfm():
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    from commlib.core.device import ulfm_available

    return "Open MPI" in MPI.Get_library_version() and ulfm_available()


def test_kill_inside_attention():
    pytest.importorskip("torch")
    if not _ulfm():
        pytest.skip("needs Open MPI with ULFM")
    jobs = int(os.environ.get("COMMLIB_NN_FT_JOBS", "6"))
    par = int(os.environ.get("COMMLIB_NN_FT_PAR", "2"))
    timeout = float(os.environ.get("COMMLIB_NN_FT_TIMEOUT", "6"))
    grace = float(os.environ.get("COMMLIB_FT_GRACE", "2"))
    seed = int(os.environ.get("COMMLIB_NN_FT_SEED", str(int(time.time()) % 100000)))
    print(f"COMMLIB_NN_FT_SEED={seed} jobs={jobs} T={timeout} G={grace}")
    specs = plan(seed, jobs)
    with ThreadPoolExecutor(par) as ex:
        outcomes = list(ex.map(lambda s: run_job(s, timeout, grace), specs))
    lat = sorted(x for o in outcomes for x in o["raise_s"])
    rec = sorted(x for o in outcomes for x in o["recover_s"])
    for o in outcomes:
        trials = [(t["variant"], t["layout"], "causal" if t["causal"] else "full", t["victim"], t["phase"], t["u"])
                  for t in o["spec"]["trials"]]
        print(f"seed {o['spec']['seed']} wall {o['wall']} s trials {trials}\n  survivors raised after "
              f"{o['raise_s']} s in {o.get('where')}: {'OK' if not o['problems'] else o['problems']}")
    if lat:
        print(f"survivors' raise after the kill: median {lat[len(lat) // 2]:.3f} s, max {lat[-1]:.3f} s "
              f"(bound T + G = {timeout + grace:g} s); recovered by: median {rec[len(rec) // 2]:.3f} s, "
              f"max {rec[-1]:.3f} s")
    bad = [o for o in outcomes if o["problems"]]
    assert not bad, f"seed {seed}: " + "\n".join(f"{o['spec']}: {o['problems']}\n{o.get('tail', '')}" for o in bad)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    worker(json.loads(sys.argv[2]))
