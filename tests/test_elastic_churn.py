"""Elastic churn and donor failure, with real processes killed by SIGKILL (loopback only).

* ``test_churn``: a master (in the test process) and 3 to 6 peer processes;
  every 1-3 s a peer is started (p=0.6) or SIGKILLed (p=0.4), at least 2 alive.
  Each peer loops: ``update_topology`` → ``sync_shared_state`` → an int64 and a
  float32 all-reduce of inputs seeded by (peer id, step) → state update, and
  appends a JSON record per completed operation.  Checks: every completed
  all-reduce is bit-identical on every peer that completed it, the int64 one
  equals the sum over exactly the members of the epoch it completed in
  (recomputed here from the seeds), state hashes are identical after every
  sync, steps keep completing, and no peer hangs or fails (each wait is bounded).
  ``COMMLIB_CHURN_SECONDS`` sets the churn time (default 45), ``COMMLIB_CHURN_SEED``
  (else ``COMMLIB_TEST_SEED``) the kill plan.
* ``test_donor_killed_mid_transfer``: a joiner fetches state from a donor that
  serves slowly (``COMMLIB_ELASTIC_SERVE_RATE``) and is SIGKILLed once its first
  bytes have reached the joiner (checked: some, not all, had arrived); the joiner
  completes from the other donor and verifies the hashes.

The peer processes are this file run as a script (``worker`` / ``donor`` mode).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

SECRET = "churn-secret-0123456789abcdef"
COUNT = 20_000


def f_int(pid: int, step: int) -> np.ndarray:
    return np.random.default_rng([pid, step, 1]).integers(-1 << 20, 1 << 20, COUNT, dtype=np.int64)


def f_float(pid: int, step: int) -> np.ndarray:
    return np.random.default_rng([pid, step, 2]).standard_normal(COUNT).astype(np.float32)


def _h(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:32]


# ---------------------------------------------------------------- peer processes
def worker(address: str, out: str) -> int:
    import commlib.elastic as el

    peer = el.connect(address, secret=SECRET, streams=2, timeout=15.0)
    fh = open(out, "a", buffering=1)
    state = {"w": np.zeros(16_384, np.float32)}
    rev = 0
    while not os.path.exists(out + ".stop"):
        peer.update_topology()
        step = peer.step
        r = peer.sync_shared_state(state, rev)
        rev = r["revision"]
        fh.write(json.dumps({"k": "sync", "step": step, "rev": rev, "h": _h(state["w"]), "id": peer.id,
                             "got": r["bytes_received"]}) + "\n")
        a = f_int(peer.id, step)
        b = f_float(peer.id, step)
        peer.allreduce(a, "sum")
        e1 = peer.epoch
        m1 = list(peer.members)
        peer.allreduce(b, "avg", quantize="int8" if step % 2 else None)
        fh.write(json.dumps({"k": "ar", "step": step, "e": e1, "members": m1, "hi": _h(a), "id": peer.id,
                             "hf": _h(b), "t": time.time()}) + "\n")
        state["w"] += b[:16_384]
        rev += 1
    peer.close()
    return 0


def donor(address: str, out: str, nbytes: int) -> int:
    import commlib.elastic as el

    peer = el.connect(address, secret=SECRET, streams=2, timeout=30.0)
    state = {"w": np.random.default_rng(7).standard_normal(nbytes // 4).astype(np.float32)}
    with open(out, "a", buffering=1) as fh:
        while not os.path.exists(out + ".stop"):
            peer.update_topology()
            fh.write(json.dumps({"k": "step", "step": peer.step, "size": peer.size, "rank": peer.rank}) + "\n")
            peer.sync_shared_state(state, 5)
            time.sleep(0.05)
    peer.close()
    return 0


# ---------------------------------------------------------------- test helpers
def _spawn(mode: str, address: str, out: str, *extra, env=None):
    e = dict(os.environ, MPI4PY_RC_INITIALIZE="0", PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-P", __file__, mode, address, out, *map(str, extra)], env=e,
                            stdout=subprocess.DEVNULL, stderr=open(out + ".err", "w"))


def _records(paths):
    recs = []
    for p in paths:
        if not os.path.exists(p):
            continue
        with open(p) as fh:
            for line in fh:
                try:
                    recs.append(json.loads(line))
                except ValueError:  # a line cut by SIGKILL
                    pass
    return recs


@pytest.mark.timeout(240)
def test_churn(tmp_path):
    import commlib.elastic as el
    from seeds import test_seed

    seconds = float(os.environ.get("COMMLIB_CHURN_SECONDS", "45"))
    rng = random.Random(int(os.environ.get("COMMLIB_CHURN_SEED") or test_seed()))
    master = el.Master(secret=SECRET.encode()).start()
    procs: dict = {}   # path -> Popen
    killed: set = set()
    kill_times = []
    n = 0

    def start():
        nonlocal n
        path = str(tmp_path / f"peer{n}.jsonl")
        n += 1
        procs[path] = _spawn("worker", master.address, path)

    try:
        for _ in range(3):
            start()
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(1.0, 3.0))
            alive = [p for p, pr in procs.items() if pr.poll() is None]
            for p in alive:
                assert procs[p].poll() is None
            dead_unplanned = [p for p, pr in procs.items() if pr.poll() is not None and p not in killed]
            assert not dead_unplanned, "a peer exited on its own: " + open(dead_unplanned[0] + ".err").read()[-3000:]
            if (rng.random() < 0.6 and len(alive) < 6) or len(alive) <= 2:
                start()
            else:
                victim = rng.choice(alive)
                procs[victim].send_signal(signal.SIGKILL)
                killed.add(victim)
                kill_times.append((time.time(), victim))
        for p in procs:
            open(p + ".stop", "w").close()
        for p, pr in procs.items():
            if p in killed:
                pr.wait(10)
                continue
            try:
                rc = pr.wait(40)
            except subprocess.TimeoutExpired:
                pr.kill()
                pytest.fail(f"peer {p} hung at shutdown: " + open(p + ".err").read()[-3000:])
            assert rc == 0, f"peer {p} failed: " + open(p + ".err").read()[-3000:]
    finally:
        for pr in procs.values():
            if pr.poll() is None:
                pr.kill()
        master.stop()

    recs = _records(list(procs))
    ars = [r for r in recs if r["k"] == "ar"]
    syncs = [r for r in recs if r["k"] == "sync"]
    # every completed int64 all-reduce: one hash per (step), equal to the exact sum over its members
    by_step: dict = {}
    for r in ars:
        by_step.setdefault(r["step"], []).append(r)
    for step, rs in by_step.items():
        assert len({r["hi"] for r in rs}) == 1, f"int64 all-reduce of step {step} differs between peers"
        assert len({r["hf"] for r in rs}) == 1, f"float32 all-reduce of step {step} differs between peers"
        assert len({tuple(r["members"]) for r in rs}) == 1
        members = rs[0]["members"]
        assert {r["id"] for r in rs} <= set(members)
        want = np.sum([f_int(pid, step) for pid in members], axis=0)
        assert rs[0]["hi"] == _h(want), f"step {step}: result is not the sum over members {members}"
    sync_by_step: dict = {}
    for r in syncs:
        sync_by_step.setdefault(r["step"], []).append(r)
    for step, rs in sync_by_step.items():
        assert len({(r["h"], r["rev"]) for r in rs}) == 1, f"state differs after the sync of step {step}"
    assert len(by_step) >= max(5, seconds / 6), f"too little progress: {len(by_step)} steps in {seconds} s"
    assert killed, "the schedule killed nobody"
    joins = sum(1 for r in syncs if r["got"] > 0)
    # kill → the next all-reduce completed without the victim (among every survivor's records)
    recover = []
    for t_kill, victim in kill_times:
        vid = {r["id"] for r in _records([victim])}
        after = [r["t"] for r in ars if r["t"] > t_kill and not vid & set(r["members"])]
        if vid and after:
            recover.append(min(after) - t_kill)
    med = float(np.median(recover)) if recover else float("nan")
    print(f"\nchurn: {n} peers started, {len(killed)} killed, {len(by_step)} steps completed, "
          f"{len(ars)} peer-results checked, {joins} state transfers, kill->next all-reduce "
          f"median {med:.3f} s max {max(recover, default=float('nan')):.3f} s, master {master.stats}")
    assert not recover or med <= 2.0, f"median recovery {med:.2f} s"


@pytest.mark.timeout(120)
def test_donor_killed_mid_transfer(tmp_path):
    import commlib.elastic as el
    from waiting import wait_until  # (here: this file also runs as a script, without tests/ on the path)

    nbytes = 24 << 20
    master = el.Master(secret=SECRET.encode()).start()
    paths = [str(tmp_path / f"donor{i}.jsonl") for i in range(2)]
    procs = []
    try:
        # donor 0 serves slowly (so it dies mid-transfer: 24 MiB at 10 MB/s take 2.5 s), donor 1 at full speed
        procs.append(_spawn("donor", master.address, paths[0], nbytes, env={"COMMLIB_ELASTIC_SERVE_RATE": "10e6"}))
        deadline = time.monotonic() + 30
        while not _records(paths[:1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        procs.append(_spawn("donor", master.address, paths[1], nbytes))
        while not any(r.get("size") == 2 for r in _records(paths[1:])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(r.get("size") == 2 for r in _records(paths[1:])), "donors did not form a group"
        joiner = el.connect(master.address, secret=SECRET, streams=2, timeout=30.0)
        assert joiner.update_topology() and joiner.size == 3 and joiner.rank == 2
        # the joiner's first donor is rank 2 % 2 = 0: the slow one
        state = {"w": np.zeros(nbytes // 4, np.float32)}
        import threading

        w = state["w"]  # fetched in place (same dtype and shape): its bytes show the transfer's progress
        at_kill = {}

        def kill_once_under_way():
            # the donor's standard normals are never 0: a non-zero element has arrived
            wait_until(lambda: w[:256].any(), timeout=60, what="the first donor's bytes at the joiner")
            procs[0].send_signal(signal.SIGKILL)
            at_kill["t"] = time.monotonic()
            at_kill["got"] = int(np.count_nonzero(w))  # an upper bound of what came before the kill

        threading.Thread(target=kill_once_under_way, daemon=True).start()
        t0 = time.monotonic()
        res = joiner.sync_shared_state(state, 0)
        dt = time.monotonic() - t0
        assert state["w"] is w, "the state was not fetched in place"
        got = at_kill.get("got", 0) * 4
        assert 0 < got < nbytes, f"the kill did not land mid-transfer: {got} of {nbytes} bytes had arrived"
        want = np.random.default_rng(7).standard_normal(nbytes // 4).astype(np.float32)
        assert _h(state["w"]) == _h(want)
        assert res["revision"] == 5 and res["bytes_received"] >= nbytes
        assert res["donor"] == 2, "the joiner should have finished from the second donor (peer id 2)"
        assert procs[0].wait(5) == -signal.SIGKILL
        print(f"\njoiner synced {res['bytes_received']} bytes in {dt:.2f} s, donor {res['donor']} "
              f"(first donor killed at {at_kill['t'] - t0:.2f} s, {got} bytes in)")
        # the group goes on: the survivors vote and step
        assert joiner.update_topology() is True and joiner.size == 2
        joiner.close()
        for p in paths:
            open(p + ".stop", "w").close()
        assert procs[1].wait(30) == 0, open(paths[1] + ".err").read()[-3000:]
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
        master.stop()


if __name__ == "__main__":
    mode, address, out = sys.argv[1:4]
    if mode == "worker":
        sys.exit(worker(address, out))
    sys.exit(donor(address, out, int(sys.argv[4])))
