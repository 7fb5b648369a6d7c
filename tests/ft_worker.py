"""Fault-injection worker, launched by tests/test_ft.py under mpiexec.

Runs a fixed sequence of collectives in fault-tolerant mode; the victim ranks
die (``os._exit`` or SIGKILL) at a chosen point: before a call, at the k-th
point-to-point send inside a call (``isend`` or ``sendrecv``: any algorithm step, header exchange
included) or after a call.  Every survivor checks each result against an oracle
computed from the inputs of the ranks the call ended with (the algorithms'
fixed reduction order makes exact oracles possible) and prints one JSON line::

    FTRESULT {"rank": ..., "ok": true, "hashes": [...], "failed": [...], ...}

Usage: ft_worker.py SPEC_JSON   with SPEC = {"victims": [[rank, call, point, how], ...],
                                              "mode": "recover" | "expect_error", "seed": int}
``point`` is -1 (before the call), k >= 0 (at the k-th send; after the call if
the call makes fewer), ``how`` is "exit", "kill" or "stall" (sleep ``FT_STALL``
seconds there, alive, then go on).

Timed mode (tests/test_ft_kill.py): SPEC = {"timed": {"n": elements, "calls": k},
"victims": [[rank, call, delay_ms, how], ...], "seed": int}.  Every rank runs
``k`` successive float32 allreduces of ``n`` elements (``algorithm="auto"``: the
ring at these sizes); a victim's timer thread acts ``delay_ms`` after it
entered call ``call``: "exit" (``os._exit``), "kill" (SIGKILL), "wedge_shrink"
(its next shrink blocks forever, using no CPU), "exit_in_dup" (it dies 30 ms
into its next ``dup``), or "wedge" (the
shape of Open MPI's TCP deadlock: from then on every completion wait and every
revoke of the victim blocks forever, inside a call that released the GIL; the
watchdog must fail the rank itself).  Each survivor records the SHA-256 of each
result; the lowest survivor also the SHA-256 of the ring oracle over the inputs
of the ranks the call ended with.
"""
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

import commlib
from commlib.collectives._common import chunk_bounds
from commlib.transports.mpi import MPITransport
from oracles import ring_oracle  # noqa: E402 - tests/ is the script directory

SPEC = json.loads(sys.argv[1])
from mpi4py import MPI  # noqa: E402

WORLD = MPI.COMM_WORLD.Get_rank()
NWORLD = MPI.COMM_WORLD.Get_size()
victim = [v for v in SPEC["victims"] if v[0] == WORLD]
victim = victim[0] if victim else None

_sends = {"armed": False, "left": 0}


def die():
    how = victim[3]
    sys.stdout.flush()
    if how == "stall":  # alive but silent for FT_STALL seconds, then carry on
        _sends["armed"] = False
        victim[1] = -1  # stall once
        time.sleep(float(os.environ.get("FT_STALL", "5")))
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(int(os.environ.get("FT_EXIT_CODE", "17")))


_orig_isend = MPITransport.isend


def _count_send():
    if _sends["armed"]:
        if _sends["left"] == 0:
            die()
        _sends["left"] -= 1


def _isend(self, buf, dest, tag=0):
    _count_send()
    return _orig_isend(self, buf, dest, tag)


_orig_sendrecv = MPITransport.sendrecv


def _sendrecv(self, sendbuf, dest, recvbuf, source, sendtag=0, recvtag=0):
    _count_send()
    return _orig_sendrecv(self, sendbuf, dest, recvbuf, source, sendtag, recvtag)


MPITransport.isend = _isend
MPITransport.sendrecv = _sendrecv


def data(kind, wr, call, n_at_call):
    rng = np.random.default_rng(1000 * call + wr + 7 * SPEC["seed"])
    if kind == "f32":
        return rng.uniform(-1, 1, 1003).astype(np.float32)
    if kind == "f32big":
        return rng.uniform(-1, 1, 100_000).astype(np.float32)  # 400 KB: "auto" picks the ring
    if kind == "intf64":
        return rng.integers(-100, 100, 37).astype(np.float64)
    if kind == "rs":
        return rng.uniform(-1, 1, 61).astype(np.float32)
    if kind == "ag":
        return rng.integers(0, 1 << 30, 9).astype(np.int32)
    if kind == "bc":
        return rng.uniform(-1, 1, 3000).astype(np.float64)
    if kind == "a2a":
        return rng.integers(0, 1 << 40, (n_at_call, 5)).astype(np.int64)
    raise ValueError(kind)


CALLS = ["allreduce_ring", "allreduce_rd", "reduce_scatter", "allgather", "bcast", "alltoall",
         "barrier", "allreduce_auto"]


def group(comm):
    failed = set(comm.failed_ranks)
    return [r for r in range(NWORLD) if r not in failed]


def run_call(comm, call, i):
    g0 = group(comm)
    n0 = len(g0)
    me0 = g0.index(WORLD)
    if call == "allreduce_ring":
        x = data("f32", WORLD, i, n0)
        out = comm.allreduce(x, np.empty_like(x), op="sum", algorithm="ring")
        g = group(comm)
        ref = ring_oracle([data("f32", w, i, n0) for w in g])
    elif call == "allreduce_rd":
        x = data("intf64", WORLD, i, n0)
        out = comm.allreduce(x, op="sum", algorithm="recursive_doubling")
        g = group(comm)
        ref = np.sum([data("intf64", w, i, n0) for w in g], axis=0)
    elif call == "allreduce_auto":
        x = data("f32big", WORLD, i, n0)
        out = comm.allreduce(x, op="avg")  # > 256 KiB: ring
        g = group(comm)
        ref = ring_oracle([data("f32big", w, i, n0) for w in g], "avg")
    elif call == "reduce_scatter":
        x = data("rs", WORLD, i, n0)
        out = comm.reduce_scatter(x, op="sum")
        g = group(comm)
        full = ring_oracle([data("rs", w, i, n0) for w in g])
        b = chunk_bounds(full.size, len(g))
        r = g.index(WORLD)
        ref = full[b[r]:b[r + 1]]
    elif call == "allgather":
        out = comm.allgather(data("ag", WORLD, i, n0))
        g = group(comm)
        ref = np.stack([data("ag", w, i, n0) for w in g])
    elif call == "bcast":
        x = data("bc", WORLD, i, n0) if WORLD == 0 else np.zeros(3000)
        out = comm.bcast(x, root=0)
        g = group(comm)
        ref = data("bc", 0, i, n0)
    elif call == "alltoall":
        out = comm.alltoall(data("a2a", WORLD, i, n0))
        g = group(comm)
        ref = np.stack([data("a2a", w, i, n0)[me0] for w in g])
    elif call == "barrier":
        comm.barrier()
        g = group(comm)
        out = ref = np.zeros(1)
    else:
        raise ValueError(call)
    ok = out.shape == ref.shape and out.tobytes() == ref.tobytes()
    assert comm.size == len(g) and comm.rank == g.index(WORLD), (comm.size, comm.rank, g)
    return ok, hashlib.sha1(out.tobytes()).hexdigest()[:12]


def dbg(*a):
    if os.environ.get("FTDEBUG"):
        print(f"[{WORLD}]", *a, file=sys.stderr, flush=True)


def _onterm(sig, frm):
    dbg("got signal", sig)
    os._exit(99)


def main():
    signal.signal(signal.SIGTERM, _onterm)
    timeout = float(os.environ.get("COMMLIB_TIMEOUT", "10"))
    comm = commlib.init(fault_tolerant=True, timeout=timeout, on_failure=SPEC.get("on_failure", "shrink"))
    lost_seen = []
    comm.add_failure_callback(lambda failed, c: lost_seen.append(list(failed)))
    res = {"rank": WORLD, "ok": True, "hashes": [], "mode": comm.fault_tolerant, "bad": []}
    t_start = time.monotonic()
    try:
        for i, call in enumerate(CALLS):
            if victim and victim[1] == i and victim[2] < 0:
                die()
            if victim and victim[1] == i:
                _sends["armed"], _sends["left"] = True, victim[2]
            t0 = time.monotonic()
            dbg("call", i, call)
            try:
                ok, h = run_call(comm, call, i)
            except commlib.ProcessFailed as exc:
                if SPEC.get("on_failure") != "raise":
                    raise
                res.setdefault("raised", []).append([i, list(exc.failed)])
                ok, h = run_call(comm, call, i)  # the shrunk communicator works
            _sends["armed"] = False
            if victim and victim[1] == i:
                die()  # "after": the call made fewer sends than k
            res["hashes"].append(h)
            if not ok:
                res["ok"] = False
                res["bad"].append(call)
            res.setdefault("t", []).append(round(time.monotonic() - t0, 4))
        dbg("final barrier")
        comm.barrier()  # a victim that died after the last call is noticed here
    except commlib.CommError as exc:
        res["ok"] = False
        res["error"] = type(exc).__name__
        res["message"] = str(exc)[:300]
        res["recovered"] = bool(getattr(exc, "recovered", False))
        res["elapsed"] = round(time.monotonic() - t_start, 3)
    res["failed"] = list(comm.failed_ranks)
    res["callbacks"] = lost_seen
    res["recoveries"] = [round(t, 4) for t, _ in (comm.ft.recoveries if comm.ft else [])]
    line = json.dumps(res)
    out_dir = os.environ.get("FT_OUT_DIR")
    if out_dir:  # launchers may interleave the ranks' stdout lines
        tmp = os.path.join(out_dir, f".rank{WORLD}.json")
        with open(tmp, "w") as fh:
            fh.write(line)
        os.replace(tmp, os.path.join(out_dir, f"rank{WORLD}.json"))
    print("FTRESULT " + line, flush=True)


def _timed_input(base, w, call):
    """Rank ``w``'s input to call ``call``: a rotation and scaling of one shared
    random array (cheap at 64 MiB; the sums still round differently in every
    order, so the oracle checks the reduction order too)."""
    x = np.roll(base, 1009 * w + 17 * call)
    x *= np.float32(1.0 + 0.37 * w + 0.011 * call)
    return x


def _wedge():
    """From now on this rank's MPI 'makes no progress': completion waits and
    revokes block forever (time.sleep releases the GIL, as mpi4py's calls do)."""
    def forever(*a, **k):
        while True:
            time.sleep(3600)
    MPITransport._complete = forever
    MPITransport._poll = forever
    MPITransport.revoke = forever


def _wedge_shrink():
    """From now on this rank's shrink blocks forever without using CPU: the
    shape of the second hang of the cascade in docs/faults-and-security.md ("A rank wedged in the shrink") (a survivor whose
    Open MPI deadlocks when another rank's failure reaches it in
    ``MPIX_Comm_shrink``)."""
    def forever(*a, **k):
        while True:
            time.sleep(3600)
    MPITransport.shrink = forever


def _exit_in_dup():
    """From now on this rank dies (``os._exit``) ``FT_DUP_EXIT_S`` seconds
    (default 0.03) into its next ``dup`` (recovery's, after the shrink), while
    the others build the new communicator with it: the window of Open MPI's
    crash in docs/faults-and-security.md."""
    import threading

    orig = MPITransport.dup

    def dup(self):
        threading.Timer(float(os.environ.get("FT_DUP_EXIT_S", "0.03")), lambda: os._exit(17)).start()
        return orig(self)
    MPITransport.dup = dup


def timed_main():
    import hashlib as _h
    import threading

    cfg = SPEC["timed"]
    n, ncalls = int(cfg["n"]), int(cfg["calls"])
    timeout = float(os.environ.get("COMMLIB_TIMEOUT", "10"))
    mine = [v for v in SPEC["victims"] if v[0] == WORLD]
    rng = np.random.default_rng(SPEC["seed"])
    base = rng.standard_normal(n, dtype=np.float32)
    comm = commlib.init(fault_tolerant=True, timeout=timeout)
    res = {"rank": WORLD, "ok": True, "hashes": [], "oracle": [], "t": [], "groups": []}
    out = np.empty(n, np.float32)
    t_start = time.monotonic()
    try:
        for i in range(ncalls):
            x = _timed_input(base, WORLD, i)
            timers = []
            for v in mine:
                if v[1] == i:
                    how = v[3]
                    fn = {"exit": lambda: os._exit(17), "kill": lambda: os.kill(os.getpid(), signal.SIGKILL),
                          "wedge": _wedge, "wedge_shrink": _wedge_shrink, "exit_in_dup": _exit_in_dup}[how]
                    t = threading.Timer(v[2] / 1000.0, fn)
                    t.daemon = True
                    timers.append(t)
            t0 = time.monotonic()
            for t in timers:
                t.start()
            comm.allreduce(x, out, op="sum")
            res["t"].append(round(time.monotonic() - t0, 3))
            g = group(comm)
            res["groups"].append(g)
            res["hashes"].append(_h.sha256(out.tobytes()).hexdigest())
        comm.barrier()
    except commlib.CommError as exc:
        res["ok"] = False
        res["error"] = type(exc).__name__
        res["message"] = str(exc)[:300]
    res["elapsed"] = round(time.monotonic() - t_start, 3)
    # the oracle after the last call (a rank busy for seconds between calls
    # would be a late peer): one rank is enough, the others compare hashes;
    # the lowest that no plan kills (a victim may die after the last call)
    # (the test driver may compute it itself, outside the job: "oracle": false)
    planned = {v[0] for v in SPEC["victims"]}
    keep = [r for r in (res["groups"][-1] if res["groups"] else []) if r not in planned]
    if SPEC.get("oracle", True) and keep and WORLD == min(keep):
        for i, g in enumerate(res["groups"]):
            ref = ring_oracle([_timed_input(base, w, i) for w in g])
            res["oracle"].append(_h.sha256(ref.tobytes()).hexdigest())
            del ref
    res["failed"] = list(comm.failed_ranks)
    res["recoveries"] = [round(t, 4) for t, _ in (comm.ft.recoveries if comm.ft else [])]
    line = json.dumps(res)
    out_dir = os.environ.get("FT_OUT_DIR")
    if out_dir:
        tmp = os.path.join(out_dir, f".rank{WORLD}.json")
        with open(tmp, "w") as fh:
            fh.write(line)
        os.replace(tmp, os.path.join(out_dir, f"rank{WORLD}.json"))
    print("FTRESULT " + line, flush=True)


if __name__ == "__main__":
    if "timed" in SPEC:
        timed_main()
    else:
        main()
