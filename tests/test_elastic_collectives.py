"""The elastic peer's collectives beside the all-reduce (bcast, allgather,
reduce_scatter, alltoall, barrier), run by the collective engine under the
master's recovery policy (commlib/elastic/group.py), on loopback.

* every collective at 2, 3 and 4 peers against numpy oracles written here (the
  ring's reduction order from tests/oracles.py for reduce_scatter), bit parity
  across peers (SHA-256);
* bad or differing arguments raise InvalidArgument on every peer with no data
  byte sent and every buffer as it was;
* the barrier: no peer leaves before the last one entered (the check is run
  against a barrier that returns at once too, and must catch it);
* ``timeout=2`` against a stalled member raises CommTimeout within 2.5 s;
* real process kills (SIGKILL) inside each collective: peers are forked from a
  process that has imported commlib (fork: milliseconds a peer, against about a
  second for a fresh interpreter), a victim kills itself at a random moment
  after entering the collective drawn for the trial, a replacement joins, and
  every completed call of every survivor is checked against the oracle over the
  members of the epoch it committed in; a broadcast whose root died raises
  PeerFailure on every survivor, its buffer restored.
  ``COMMLIB_KILL_TRIALS`` sets the trials per collective (default 14: a failure
  that one kill in five shows is missed with probability 0.8**14 < 0.05 per
  collective, counting every kill; most land inside the armed call, the count is
  printed and at least 5 per collective asserted), ``COMMLIB_KILL_SEED`` the seed
  (printed).

The forked peers are this file run as a script (``zygote`` mode).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

SECRET = b"collectives-secret-0123456789abcdef"
COLLS = ("bcast", "allgather", "reduce_scatter", "alltoall", "barrier")

pytestmark = pytest.mark.timeout(240)


def _h(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:32]


def chunk_bounds(count: int, n: int) -> list:
    """The ring's blocks (written here, not imported: the first ``count % n`` one longer)."""
    base, extra = divmod(count, n)
    return [i * base + min(i, extra) for i in range(n + 1)]


def ring_reduce(inputs):
    """The ring's sum of ``inputs`` in its fixed order (tests/oracles.py)."""
    from oracles import ring_oracle  # noqa: PLC0415 - tests/ is on the path

    return ring_oracle(inputs, "sum")


# ------------------------------------------------------------ in-process groups
def _group(n, timeout=20.0):
    import commlib.elastic as el
    from test_elastic import form

    master = el.Master(secret=SECRET).start()
    peers = [el.connect(master.address, secret=SECRET, timeout=timeout) for _ in range(n)]
    form(peers, n)
    return master, sorted(peers, key=lambda p: p.rank)


def _close(master, peers):
    for p in peers:
        p.close()
    master.stop()


def _outcomes(peers, fn):
    from test_elastic import run_outcomes

    return run_outcomes(peers, fn)


def _all(peers, fn):
    from test_elastic import run_peers

    return run_peers(peers, fn)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_collective_against_numpy(n):
    """Sizes inside the first round (one round), a few KiB and ~1 MiB, float64,
    float32 and int32; every result equal to the oracle, bit for bit."""
    master, peers = _group(n)
    try:
        for count, dtype in ((3, np.float64), (1000, np.float32), (131_075, np.float64), (2048, np.int32)):
            def data(i, k=0):
                g = np.random.default_rng([n, count, i, k])
                if dtype == np.int32:
                    return g.integers(-1000, 1000, count).astype(dtype)
                return g.standard_normal(count).astype(dtype)

            xs = [data(i) for i in range(n)]
            for root in range(n):
                bufs = [x.copy() if i == root else np.zeros_like(x) for i, x in enumerate(xs)]
                _all(peers, lambda i, p: p.bcast(bufs[i], root=root, timeout=20))
                assert all(_h(b) == _h(xs[root]) for b in bufs), (count, root)
            got = _all(peers, lambda i, p: p.allgather(xs[i], timeout=20))
            want = np.stack(xs)
            assert all(g.shape == (n, count) and _h(g) == _h(want) for g in got)
            got = _all(peers, lambda i, p: p.reduce_scatter(xs[i], timeout=20))
            total, b = ring_reduce(xs), chunk_bounds(count, n)
            for i, g in enumerate(got):
                assert _h(g) == _h(total[b[i]:b[i + 1]]), (count, dtype, i)
            blk = count // n + 1
            ys = [np.resize(x, n * blk) for x in xs]
            got = _all(peers, lambda i, p: p.alltoall(ys[i], timeout=20))
            for i, g in enumerate(got):
                assert g.shape == (n, blk)
                assert _h(g) == _h(np.stack([ys[j].reshape(n, blk)[i] for j in range(n)]))
            assert _all(peers, lambda i, p: p.barrier(timeout=20)) == [None] * n
    finally:
        _close(master, peers)


BAD = {
    # name: (collective, per-peer arguments of peer i (last peer is the odd one))
    "count": ("allgather", lambda i, n: (np.ones(10 + (i == n - 1)),), {}),
    "dtype": ("reduce_scatter", lambda i, n: (np.ones(12, np.float32 if i == n - 1 else np.float64),), {}),
    "op": ("reduce_scatter", lambda i, n: (np.ones(12),), lambda i, n: {"op": "max" if i == n - 1 else "sum"}),
    "root": ("bcast", lambda i, n: (np.ones(5),), lambda i, n: {"root": 1 if i == n - 1 else 0}),
    "root-range": ("bcast", lambda i, n: (np.ones(5),), lambda i, n: {"root": n if i == n - 1 else 0}),
    "read-only": ("bcast", lambda i, n: (np.ones(5),), {}),
    "not-divisible": ("alltoall", lambda i, n: (np.ones(n * 4 + (i == n - 1)),), {}),
    "timeout-nan": ("barrier", lambda i, n: (), lambda i, n: {"timeout": float("nan") if i == n - 1 else 20}),
    "non-numeric": ("allgather", lambda i, n: (np.ones(4) if i != n - 1 else np.array(["abcd"] * 4),), {}),
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_refused_everywhere_before_any_byte_moves(n, case):
    """One peer's bad or differing argument: every peer raises InvalidArgument, no
    data-plane byte is sent (only the first round's rows), every buffer holds its
    input; the next call completes on every peer."""
    import commlib

    master, peers = _group(n)
    try:
        coll, args_of, kw_of = BAD[case]
        args = [args_of(i, n) for i in range(n)]
        if case == "read-only":
            args[-1][0].flags.writeable = False  # the last peer is no root: its buf is written
        kws = [kw_of(i, n) if callable(kw_of) else {"timeout": 20} for i in range(n)]
        for kw in kws:
            kw.setdefault("timeout", 20)
        before = [[a.copy() for a in arg] for arg in args]
        sent = [p.stats["bytes_sent"] for p in peers]
        out = _outcomes(peers, lambda i, p: getattr(p, coll)(*args[i], **kws[i]))
        for i, (r, exc, dt) in enumerate(out):
            assert isinstance(exc, commlib.InvalidArgument), (i, repr(exc))
            assert all(_h(a) == _h(b) for a, b in zip(args[i], before[i]))
        assert [p.stats["bytes_sent"] for p in peers] == sent, "data bytes moved before the refusal"
        got = _all(peers, lambda i, p: p.allgather(np.full(3, i), timeout=20))
        assert all(_h(g) == _h(np.repeat(np.arange(n), 3).reshape(n, 3)) for g in got)
    finally:
        _close(master, peers)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mine,theirs", [("allreduce", "allgather"), ("reduce_scatter", "allreduce"),
                                         ("bcast", "allgather"), ("allreduce-ring", "barrier")])
def test_members_calling_different_collectives_are_refused_at_once(n, mine, theirs):
    """The last peer calls another collective than the others (whose first messages
    may differ in form: the all-reduce's carry its data): every peer raises
    InvalidArgument well before the timeout, buffers as they were; the next call
    completes."""
    import commlib

    master, peers = _group(n)
    try:
        def call(i, p):
            which = theirs if i == n - 1 else mine
            x = np.ones(300_000 if which.endswith("-ring") else 10)
            which = which.split("-")[0]
            if which == "bcast":
                return p.bcast(x, root=0, timeout=10)
            if which == "barrier":
                return p.barrier(timeout=10)
            return getattr(p, which)(x, timeout=10)

        out = _outcomes(peers, call)
        for i, (r, exc, dt) in enumerate(out):
            assert isinstance(exc, commlib.InvalidArgument), (i, repr(exc))
            assert dt < 3, f"peer {i} took {dt:.2f} s"
        got = _all(peers, lambda i, p: p.allgather(np.full(3, i), timeout=20))
        assert all(_h(g) == _h(np.repeat(np.arange(n), 3).reshape(n, 3)) for g in got)
    finally:
        _close(master, peers)


def barrier_violations(peers, barrier) -> list:
    """Run ``barrier(peer)`` on every peer, the last one entering only after the
    others had a chance to leave; returns what went wrong (empty: a barrier).
    Each early peer, on leaving, reads whether the late one has entered."""
    n = len(peers)
    entered, left_early, go = threading.Event(), threading.Event(), threading.Event()
    seen = [None] * n

    def early(i, p):
        barrier(p)
        seen[i] = entered.is_set()
        left_early.set()

    def late(i, p):
        go.wait(30)
        entered.set()
        barrier(p)

    threads = [threading.Thread(target=early if i < n - 1 else late, args=(i, p)) for i, p in enumerate(peers)]
    for t in threads:
        t.start()
    left_before = left_early.wait(0.5)  # a peer that leaves before the late one entered does so by now
    go.set()
    for t in threads:
        t.join(40)
    problems = [f"peer {i} left before the last peer entered" for i in range(n - 1) if seen[i] is not True]
    if left_before:
        problems.append("a peer left while the last one had not entered")
    return problems


@pytest.mark.parametrize("n", [2, 3, 4])
def test_barrier_holds_every_peer_until_the_last_entered(n):
    master, peers = _group(n)
    try:
        assert barrier_violations(peers, lambda p: p.barrier(timeout=30)) == []
        # the check catches a barrier that returns at once
        assert barrier_violations(peers, lambda p: None) != []
    finally:
        _close(master, peers)


def _call_with_timeout_2(p, name, buf):
    """Peer ``p``'s call ``name`` on ``buf`` with ``timeout=2`` (bcast from member 2)."""
    if name == "allreduce":
        return p.allreduce(buf, "sum", timeout=2)
    if name == "bcast":
        return p.bcast(buf, root=2, timeout=2)
    if name == "barrier":
        return p.barrier(timeout=2)
    if name == "update_topology":
        return p.update_topology(timeout=2)
    if name == "sync_shared_state":
        return p.sync_shared_state({"w": buf}, 1, timeout=2)
    return p.allgather(buf, timeout=2)


@pytest.mark.parametrize("call", ["allreduce-64B", "allreduce-1MiB", "allgather", "bcast", "barrier",
                                  "update_topology", "sync_shared_state"])
def test_timeout_2_against_a_stalled_member_raises_within_2_5_s(call):
    """Two of three members call with timeout=2 (the deadline of the whole call);
    the third stalls (never calls): both raise CommTimeout within 2.5 s, their
    buffers as they were."""
    import commlib

    master, peers = _group(3)
    try:
        nb = 1 << 20 if call.endswith("1MiB") else 64
        data = [np.full(nb // 4, i + 1.0, np.float32) for i in range(2)]
        bufs = [d.copy() for d in data]
        name = call.split("-")[0]

        def fn(i, p):
            return _call_with_timeout_2(p, name, bufs[i])

        out = _outcomes(peers[:2], fn)
        for i, (r, exc, dt) in enumerate(out):
            assert isinstance(exc, commlib.CommTimeout), repr(exc)
            assert dt < 2.5, f"peer {i} took {dt:.2f} s"
            assert _h(bufs[i]) == _h(data[i])
    finally:
        _close(master, peers)


@pytest.mark.parametrize("call", ["barrier", "allreduce-64B", "allreduce-1MiB", "allgather"])
def test_a_member_stalled_before_its_report_holds_no_one_past_timeout_plus_0_5_s(call, monkeypatch):
    """Every member enters the call; one stalls after its attempt, before it reports to
    the master (held on an event): the others raise CommTimeout within timeout + 0.5 s
    (no verdict by then: they give the call up and take the master's answer), their
    buffers as they were; released, the stalled one raises CommTimeout too; the next
    call completes on all three."""
    import commlib
    from commlib.elastic import group

    master, peers = _group(3)
    release = threading.Event()
    settle = group.MasterPolicy.settle

    def stalled_settle(self, tp, outcome):
        if self.peer is peers[2]:
            release.wait(30)
        return settle(self, tp, outcome)

    monkeypatch.setattr(group.MasterPolicy, "settle", stalled_settle)
    try:
        nb = 1 << 20 if call.endswith("1MiB") else 64
        data = [np.full(nb // 4, i + 1.0, np.float32) for i in range(3)]
        bufs = [d.copy() for d in data]
        name = call.split("-")[0]

        def fn(i, p):
            return _call_with_timeout_2(p, name, bufs[i])

        threads_out = {}
        stalled = threading.Thread(target=lambda: threads_out.setdefault(
            "x", _outcomes(peers[2:], lambda i, p: fn(2, p))))
        stalled.start()
        out = _outcomes(peers[:2], lambda i, p: fn(i, p))
        release.set()
        stalled.join(30)
        for i, (r, exc, dt) in enumerate(out):
            assert isinstance(exc, commlib.CommTimeout), repr(exc)
            assert dt < 2.5, f"peer {i} took {dt:.2f} s"
            assert _h(bufs[i]) == _h(data[i])
        assert isinstance(threads_out["x"][0][1], commlib.CommTimeout), threads_out
        assert _h(bufs[2]) == _h(data[2])
        monkeypatch.setattr(group.MasterPolicy, "settle", settle)
        got = _all(peers, lambda i, p: p.allgather(np.full(3, i), timeout=20))
        assert all(_h(g) == _h(np.repeat(np.arange(3), 3).reshape(3, 3)) for g in got)
    finally:
        release.set()
        _close(master, peers)


# ------------------------------------------------------------- process kills
def _count(step: int, coll: str) -> int:
    return int(np.random.default_rng([step, COLLS.index(coll), 99]).choice([5, 3000, 150_000, 400_000]))


def _input(pid: int, step: int, coll: str, count: int) -> np.ndarray:
    return np.random.default_rng([pid, step, COLLS.index(coll)]).standard_normal(count)


def worker(address: str, out: str) -> int:
    """A peer: at each step every collective once; a ``.arm`` file ({"c", "u"})
    makes it SIGKILL itself a random moment (``u`` in [0, 1) of the call's expected
    length) after entering collective ``c``."""
    import commlib.elastic as el

    peer = el.connect(address, secret=SECRET, timeout=10.0)
    fh = open(out, "a", buffering=1)
    while not os.path.exists(out + ".stop"):
        peer.update_topology()
        step = peer.step
        fh.write(json.dumps({"k": "step", "step": step, "id": peer.id, "size": peer.size}) + "\n")
        kill = None
        if os.path.exists(out + ".arm"):
            with open(out + ".arm") as f:
                kill = json.load(f)
            os.unlink(out + ".arm")
        for coll in COLLS:
            members0, size0 = list(peer.members), peer.size
            count = _count(step, coll)
            if coll == "alltoall":
                count = (count // size0 + 1) * size0
            x = _input(peer.id, step, coll, count)
            buf = x.copy()
            root = step % size0
            if kill is not None and kill["c"] == coll:
                # a random moment of the call: a fraction u of its expected length here (the
                # master's round trip, then the bytes at ~200 MB/s)
                delay = kill["u"] * (0.0005 + count * 8 / 200e6)
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            aborts = peer.stats["aborts"]
            rec = {"k": "c", "step": step, "c": coll, "id": peer.id, "members0": members0, "root": root}
            try:
                if coll == "bcast":
                    peer.bcast(buf, root=root)
                    res = buf
                elif coll == "allgather":
                    res = peer.allgather(buf)
                elif coll == "reduce_scatter":
                    res = peer.reduce_scatter(buf)
                elif coll == "alltoall":
                    res = peer.alltoall(buf)
                else:
                    res = peer.barrier()
                rec.update(h=None if res is None else _h(res), members=list(peer.members), rank=peer.rank)
            except el.PeerFailure as exc:
                rec.update(err=type(exc).__name__, why=str(exc)[:300], restored=_h(buf) == _h(x))
            rec["ab"] = peer.stats["aborts"] - aborts
            fh.write(json.dumps(rec) + "\n")
    peer.close()
    fh.write(json.dumps({"k": "exit"}) + "\n")
    return 0


def zygote() -> int:
    """Fork a peer (:func:`worker`) for each ``address out`` line of stdin; print its pid."""
    import traceback

    import commlib.elastic  # noqa: F401 - imported once, before any fork

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    for line in sys.stdin:
        address, out = line.split()
        pid = os.fork()
        if pid == 0:
            fd = os.open(out + ".err", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 2)
            rc = 1
            try:
                rc = worker(address, out)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            sys.stderr.flush()
            os._exit(rc)
        print(pid, flush=True)
    return 0


def _records(path):
    recs = []
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                try:
                    recs.append(json.loads(line))
                except ValueError:  # a line cut by the kill
                    pass
    return recs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _want(rec, step, coll):
    """The oracle's hash of what peer ``rec['id']`` holds after ``coll`` of ``step``."""
    members, members0, me = rec["members"], rec["members0"], rec["id"]
    count = _count(step, coll)
    if coll == "alltoall":
        count = (count // len(members0) + 1) * len(members0)
    xs = {pid: _input(pid, step, coll, count) for pid in set(members) | set(members0)}
    if coll == "bcast":
        return _h(xs[members0[rec["root"]]])
    if coll == "allgather":
        return _h(np.stack([xs[pid] for pid in members]))
    if coll == "reduce_scatter":
        b = chunk_bounds(count, len(members))
        r = members.index(me)
        return _h(ring_reduce([xs[pid] for pid in members])[b[r]:b[r + 1]])
    if coll == "alltoall":
        blk = count // len(members0)
        return _h(np.stack([xs[pid].reshape(len(members0), blk)[members0.index(me)] for pid in members]))
    return None


def test_sigkill_inside_each_collective(tmp_path):
    import commlib.elastic as el

    trials = int(os.environ.get("COMMLIB_KILL_TRIALS", "14"))
    seed = int(os.environ.get("COMMLIB_KILL_SEED", str(random.randrange(1 << 30))))
    print(f"\nCOMMLIB_KILL_SEED={seed}")
    rng = random.Random(seed)
    schedule = [c for c in COLLS for _ in range(trials)]
    rng.shuffle(schedule)
    master = el.Master(secret=SECRET).start()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MPI4PY_RC_INITIALIZE="0")
    zyg = subprocess.Popen([sys.executable, "-P", __file__, "zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, env=env)
    workers: dict = {}  # path -> pid
    armed: dict = {}    # path -> (collective, delay)
    n = 0

    def spawn():
        nonlocal n
        path = str(tmp_path / f"peer{n}.jsonl")
        n += 1
        zyg.stdin.write(f"{master.address} {path}\n")
        zyg.stdin.flush()
        workers[path] = int(zyg.stdout.readline())
        return path

    def until(pred, what, seconds=30.0):
        deadline = time.monotonic() + seconds
        while not pred():
            for p, pid in workers.items():
                if p not in armed and not _alive(pid) and not os.path.exists(p + ".stop"):
                    pytest.fail(f"peer {p} exited on its own: " + open(p + ".err").read()[-3000:])
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def joined(path, size):
        return any(r["k"] == "step" and r["size"] >= size for r in _records(path))

    try:
        for _ in range(3):
            spawn()
        until(lambda: all(joined(p, 3) for p in workers), "the first group")
        for t, coll in enumerate(schedule):
            live = [p for p in workers if p not in armed]
            victim = rng.choice(live)
            u = rng.random()
            armed[victim] = (coll, u)
            with open(victim + ".arm.tmp", "w") as f:
                json.dump({"c": coll, "u": u}, f)
            os.rename(victim + ".arm.tmp", victim + ".arm")
            until(lambda: not _alive(workers[victim]), f"trial {t}: the victim's death")
            target = 3 + t % 2  # groups of 3 and 4 peers
            new = [spawn() for _ in range(target - (len(live) - 1))]
            until(lambda: all(joined(p, target) for p in new), f"trial {t}: the joiners")
        for p in workers:
            if p not in armed:
                open(p + ".stop", "w").close()
        until(lambda: all(any(r["k"] == "exit" for r in _records(p)) for p in workers if p not in armed),
              "the peers' exit")
    finally:
        for pid in workers.values():
            try:  # a peer may exit between a liveness check and the kill: no check, no race
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        zyg.stdin.close()
        zyg.wait(10)
        master.stop()

    calls: dict = {}
    for p in workers:
        for r in _records(p):
            if r["k"] == "c":
                calls.setdefault((r["step"], r["c"]), []).append(r)
    landed = dict.fromkeys(COLLS, 0)
    root_lost = 0
    for (step, coll), rs in sorted(calls.items()):
        errs = [r for r in rs if "err" in r]
        if errs:
            # only a broadcast whose root died raises; on every survivor alike, buffers restored
            assert len(errs) == len(rs), f"step {step} {coll}: some survivors raised, others returned: {rs}"
            assert len({r["err"] for r in errs}) == 1, f"step {step} {coll}: survivors raised different errors"
            assert coll == "bcast", f"step {step} {coll} raised: {errs[0]['why']}"
            assert all(r["restored"] for r in errs), f"step {step} bcast: a buffer was not restored"
            root_lost += 1
            continue
        assert len({tuple(r["members"]) for r in rs}) == 1, f"step {step} {coll}: members differ"
        # every member read the same rank, size and members before the call (the epoch of
        # its last committed call or vote)
        assert len({tuple(r["members0"]) for r in rs}) == 1, f"step {step} {coll}: views differ"
        assert {r["id"] for r in rs} <= set(rs[0]["members"])
        for r in rs:
            assert r["h"] == _want(r, step, coll), f"step {step} {coll}: peer {r['id']} holds a wrong result"
        if coll in ("bcast", "allgather"):
            assert len({r["h"] for r in rs}) == 1
        if any(r["ab"] for r in rs):
            landed[coll] += 1
    inside = dict.fromkeys(COLLS, 0)  # kills while the victim was inside the armed collective
    aborted = dict.fromkeys(COLLS, 0)  # ... and before the master committed it (the survivors retried)
    for p, (coll, _) in armed.items():
        steps = [r["step"] for r in _records(p) if r["k"] == "step"]
        mine = [r for r in _records(p) if r["k"] == "c" and r["c"] == coll and steps and r["step"] == steps[-1]]
        rs = calls.get((steps[-1], coll), []) if steps else []
        if steps and not mine:
            inside[coll] += 1
            aborted[coll] += any(r.get("ab") or "err" in r for r in rs)
    print(f"kills while the victim was inside the armed collective: {inside} of {trials} each, of which the "
          f"survivors saw aborted: {aborted}; calls the survivors saw aborted (any cause): {landed}, "
          f"broadcasts whose root died: {root_lost}, calls checked: {sum(len(v) for v in calls.values())}, "
          f"master {master.stats}")
    for coll in COLLS:
        assert inside[coll] >= 5, f"too few kills landed inside a {coll}: {inside}"


if __name__ == "__main__":
    sys.exit(zygote())
