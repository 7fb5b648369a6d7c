"""Elastic peers (commlib.elastic) on loopback: all-reduce busbw, stream scaling through a
WAN-emulating proxy, time from a SIGKILL to the next all-reduce, DiLoCo bytes per outer step,
a joiner's state sync against the measured bandwidth (and with its donor SIGKILLed).

Sections (``--sections``, all by default), each measured side by side in one run:

- ``allreduce``: float32 sum, 4 B .. 64 MiB, at 2 and 4 peers (``--peers``): commlib.elastic
  (authenticated, ``--streams`` connections per pair) against Open MPI's ``Allreduce`` over
  its TCP transport (``mpiexec --mca btl tcp,self``, mpi4py) and, where torch is installed,
  torch.distributed's gloo, and against the floor of the same ring over plain Python
  sockets (``python_sockets``: one loopback connection per neighbour, a sender thread and
  ``recv_into``, numpy's add; no frames, authentication, master, snapshot or fault
  tolerance). OSU/nccl-tests style: best of ``--trials`` trials, each trial timed over
  enough calls for ~0.2 s, the slowest peer's time; busbw = bytes / time * 2 (n - 1) / n.
  Ratios commlib / each baseline per size.
- ``wan``: 2 peers whose data connections pass through a user-space proxy (this script,
  another process) that adds ``--wan-latency-ms`` each way and caps each TCP connection at
  ``--wan-rate-mbps``; all-reduce of ``--wan-bytes`` with 1 and with 4 streams. The peers
  listen on fixed ports and advertise the proxy's (``connect(bind=, advertise=)``).  Above
  ``PAIR_EXCHANGE_MAX`` (the ring) each run is repeated with ``Peer.overlap_first_round =
  False``, the first round before the ring's first chunk: the baseline of the overlap.
- ``kill``: 4 peers all-reduce 64 KiB in a loop; a random one is SIGKILLed, and the time to
  the first all-reduce completed over the survivors only (its size is 3) is taken, the
  slowest survivor's; a new peer then joins and the next trial starts (``--kill-trials``).
- ``diloco``: ``python -m commlib.apps.diloco`` at 2 peers, without and with int8: payload
  bytes each peer's transport sent per outer step (the transport's counter) beside the
  ring estimate 2 (P-1)/P * buffer, and the final held-out accuracy.
- ``sync``: a joiner's state sync (``Peer.sync_shared_state``). 2 peers hold the same
  ``--sync-bytes`` of float32 (4 tensors, from a seed) at revision 1, a joiner holds zeros of
  the same layout at revision 0; once the group is 3 all three call ``sync_shared_state``. The
  joiner's ``seconds`` (its call to its return: hashing, plan, fetch over ``--streams``
  connections, verification), checked bit for bit against the seed, against the issue's limit
  bytes / bandwidth + 1 s, the bandwidth measured in the same trial: the same bytes from this
  process to a receiver process over one plain loopback TCP socket and over as many sockets as
  the fetch opens, the faster (``--sync-trials`` trials: median and max). Then one donor-death
  trial: both donors throttled (``COMMLIB_ELASTIC_SERVE_RATE``) so one donor's transfer takes
  ``--sync-throttle-s``, the donor serving the joiner SIGKILLed ``--sync-kill-after`` s after
  the joiner's first state byte landed; the joiner must finish from the other donor with
  verified bits, against bytes / throttle rate + 1 s.

The numbers come from whatever machine runs it (here: 2 shared cores, loopback): ratios
taken in one run mean something, absolute times little.

Run::

    python benchmarks/bench_elastic.py --json elastic.json --plot elastic.png
    python benchmarks/bench_elastic.py --sections allreduce --peers 2 --max-bytes 4194304
    python benchmarks/bench_elastic.py --sections sync --sync-bytes 134217728 --sync-trials 3
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, find_mpiexec, float_in as _float_in, int_in as _int_in  # noqa: E402
from _util import writable_file as _writable_file, write_json  # noqa: E402

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
PY = [sys.executable, "-P"]


def sizes(lo, hi):
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 4 if n < (1 << 20) else 2
    return out


def _streams_text(streams):
    """``--streams`` for a worker's command line (None: ``auto``)."""
    return "auto" if streams is None else str(streams)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iters_for(nbytes, budget=0.2, bw=2e8):
    """Calls per timed trial: ~``budget`` seconds at ~``bw`` B/s, 3..200."""
    return int(max(3, min(200, budget * bw / max(nbytes, 1) if nbytes > 4096 else 200 if nbytes < 1024 else 60)))


# ============================================================== workers (separate processes)
def _time_sizes(allreduce, barrier, reduce_max, sz, trials, check):
    rows = []
    for nbytes in sz:
        count = max(1, nbytes // 4)
        x = np.ones(count, np.float32)
        it = iters_for(nbytes)
        allreduce(x)  # warm-up (connections, buffers), checked: every peer gives ones, the sum is n
        check(x)
        x[...] = 0  # timed calls reduce zeros: exact and constant, nothing to reset between calls
        best = float("inf")
        for _ in range(trials):
            barrier()
            t = time.perf_counter()
            for _ in range(it):
                allreduce(x)
            best = min(best, reduce_max((time.perf_counter() - t) / it))
        rows.append({"bytes": count * 4, "iters": it, "time_s": best})
    return rows


def _join_group(el, a, **kw):
    """Connect to the master and vote (``update_topology``) until the group has
    ``a.n`` peers (at most 120 s)."""
    peer = el.connect(a.master, secret_file=a.secret, streams=a.streams, timeout=60, **kw)
    deadline = time.monotonic() + 120
    while peer.size < a.n:
        peer.update_topology()
        if time.monotonic() > deadline:
            raise SystemExit(f"only {peer.size} peers")
        time.sleep(0.02)
    return peer


def worker_elastic(a):
    import commlib.elastic as el  # noqa: PLC0415

    kw = {}
    if a.bind:
        kw = {"bind": a.bind, "advertise": a.advertise}
    peer = _join_group(el, a, **kw)
    peer.overlap_first_round = not a.first_round_first
    if a.bind:
        # the emulated WAN: the proxy's addresses are loopback ones, but the link is not
        # (the first chunk keeps its striping over the link's connections)
        peer.first_round_in_chunk = False
    n = peer.size
    one = np.zeros(1, np.float64)

    def barrier():
        one[0] = 0
        peer.allreduce(one)

    def reduce_max(v):
        one[0] = v
        return float(peer.allreduce(one, op="max")[0])

    def check(x):
        # a peer declared dead mid-run shrinks the group: the survivors' result is then
        # right for the smaller group, but the timings are no longer of n peers
        assert peer.size == n, f"the group shrank to {peer.size} peers (epoch {peer.epoch}, stats {peer.stats})"
        assert np.all(x == n), "wrong all-reduce result"

    def ar(x):
        peer.allreduce(x, op="sum")

    rows = _time_sizes(ar, barrier, reduce_max, [int(s) for s in a.sizes.split(",")], a.trials, check)
    if peer.rank == 0:
        with open(a.out, "w") as fh:
            json.dump({"rows": rows, "peers": n, "streams": _streams_text(a.streams),
                       "stats_rank0": peer.stats}, fh)
    barrier()
    peer.close()


def worker_mpi(a):
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    n = comm.size

    def ar(x):
        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)

    def check(x):
        assert np.all(x == n)

    rows = _time_sizes(ar, comm.Barrier, lambda v: comm.allreduce(v, op=MPI.MAX),
                       [int(s) for s in a.sizes.split(",")], a.trials, check)
    if comm.rank == 0:
        with open(a.out, "w") as fh:
            json.dump({"rows": rows, "peers": n, "mpi": MPI.Get_library_version().split("\n")[0].strip("\x00 ")},
                      fh)


def worker_gloo(a):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.n)
    n = a.n
    one = torch.zeros(1, dtype=torch.float64)

    def ar(x):
        dist.all_reduce(torch.from_numpy(x))

    def check(x):
        assert np.all(x == n)

    def reduce_max(v):
        one[0] = v
        dist.all_reduce(one, op=dist.ReduceOp.MAX)
        return float(one[0])

    rows = _time_sizes(ar, dist.barrier, reduce_max, [int(s) for s in a.sizes.split(",")], a.trials, check)
    if a.rank == 0:
        with open(a.out, "w") as fh:
            json.dump({"rows": rows, "peers": n, "torch": torch.__version__}, fh)
    dist.destroy_process_group()


def worker_sockring(a):
    """The floor for a ring over Python sockets: the same ring all-reduce as
    commlib.elastic (reduce-scatter then allgather, 2 (n - 1) steps, numpy's add,
    chunks as numpy.array_split cuts them) over plain loopback sockets, one
    connection to each neighbour: no frames, authentication, master, snapshot or
    fault tolerance. A sender thread writes (``sendall``) while the main thread
    receives (``recv_into`` straight into the destination)."""
    import queue  # noqa: PLC0415

    ports = [int(p) for p in a.map.split(",")]
    n, r = a.n, a.rank
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", ports[r]))
    ls.listen(1)
    deadline = time.monotonic() + 60
    while True:
        try:
            right = socket.create_connection(("127.0.0.1", ports[(r + 1) % n]), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    left = ls.accept()[0]
    for c in (left, right):
        c.settimeout(None)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    jobs, done = queue.SimpleQueue(), queue.SimpleQueue()

    def sender():
        while True:
            mv = jobs.get()
            if mv is None:
                return
            right.sendall(mv)
            done.put(True)

    threading.Thread(target=sender, daemon=True).start()

    def recv_into(mv):
        got = 0
        while got < len(mv):
            k = left.recv_into(mv[got:])
            if k == 0:
                raise SystemExit("sockring: a neighbour closed")
            got += k

    def step(send, recv):
        jobs.put(memoryview(send).cast("B"))
        recv_into(memoryview(recv).cast("B"))
        done.get()

    from commlib.collectives._common import chunk_bounds_list  # noqa: PLC0415

    plans = {}  # per size: chunk bounds (numpy.array_split's cut) and the receive scratch

    def ar(x):
        if x.size not in plans:
            b = chunk_bounds_list(x.size, n)
            plans[x.size] = (b, np.empty(max(b[i + 1] - b[i] for i in range(n)), x.dtype))
        bounds, tmp = plans[x.size]
        for s in range(n - 1):
            sc, rc = (r - s) % n, (r - s - 1) % n
            dst = x[bounds[rc]:bounds[rc + 1]]
            step(x[bounds[sc]:bounds[sc + 1]], tmp[:dst.size])
            np.add(dst, tmp[:dst.size], out=dst)
        for s in range(n - 1):
            sc, rc = (r - s + 1) % n, (r - s) % n
            step(x[bounds[sc]:bounds[sc + 1]], x[bounds[rc]:bounds[rc + 1]])

    cell, got = np.zeros(1, np.float64), np.zeros(1, np.float64)

    def send_value(v):
        cell[0] = v
        jobs.put(memoryview(cell).cast("B"))
        done.get()

    def lap_max(v):
        # one lap carries the running maximum to rank 0, a second hands it to everyone
        if r == 0:
            send_value(v)
            recv_into(memoryview(got).cast("B"))
            m = float(got[0])
            send_value(m)
            return m
        recv_into(memoryview(got).cast("B"))
        send_value(max(v, float(got[0])))
        recv_into(memoryview(got).cast("B"))
        m = float(got[0])
        if r != n - 1:
            send_value(m)
        return m

    def check(x):
        assert np.all(x == n), "wrong all-reduce result"

    rows = _time_sizes(ar, lambda: lap_max(0.0), lap_max, [int(s) for s in a.sizes.split(",")], a.trials, check)
    if r == 0:
        with open(a.out, "w") as fh:
            json.dump({"rows": rows, "peers": n}, fh)
    lap_max(0.0)
    jobs.put(None)
    return 0


def worker_loop(a):
    """All-reduce 64 KiB forever; one line per completion: wall time, epoch, size."""
    import commlib.elastic as el  # noqa: PLC0415

    peer = el.connect(a.master, secret_file=a.secret, streams=a.streams, timeout=30)
    x = np.ones(16384, np.float32)
    with open(a.out, "a", buffering=1) as fh:
        while True:
            peer.update_topology()
            peer.allreduce(x, op="avg")
            x[...] = 1
            fh.write(f"{time.time():.6f} {peer.epoch} {peer.size}\n")


def worker_proxy(a):
    """WAN-emulating TCP proxy: for each ``listen:target`` pair, every accepted connection is
    forwarded to ``target`` with ``--latency-ms`` added each way and each direction of each
    connection capped at ``--rate-mbps`` (token bucket, 64 KiB burst)."""
    delay = a.latency_ms / 1e3
    rate = a.rate_mbps * 1e6 / 8

    def pump(src, dst):
        import collections  # noqa: PLC0415

        q = collections.deque()
        cv = threading.Condition()
        done = []

        def reader():
            try:
                while True:
                    b = src.recv(65536)
                    with cv:
                        q.append((time.monotonic() + delay, b))
                        cv.notify()
                    if not b:
                        return
            except OSError:
                with cv:
                    q.append((time.monotonic(), b""))
                    cv.notify()

        threading.Thread(target=reader, daemon=True).start()
        next_free = time.monotonic()
        try:
            while True:
                with cv:
                    while not q:
                        cv.wait()
                    due, b = q.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not b:
                    break
                now = time.monotonic()
                next_free = max(next_free, now - 65536 / rate) + len(b) / rate
                if next_free > now:
                    time.sleep(next_free - now)
                dst.sendall(b)
        except OSError:
            pass
        finally:
            done.append(1)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve(lport, target):
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", lport))
        ls.listen(64)
        th, tp = target.rsplit(":", 1)
        while True:
            c, _ = ls.accept()
            try:
                u = socket.create_connection((th, int(tp)))
            except OSError:
                c.close()
                continue
            for s in (c, u):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=pump, args=(c, u), daemon=True).start()
            threading.Thread(target=pump, args=(u, c), daemon=True).start()

    for pair in a.map.split(","):
        lp, target = pair.split(":", 1)
        threading.Thread(target=serve, args=(int(lp), target), daemon=True).start()
    print("proxy ready", flush=True)
    while True:
        time.sleep(3600)


SYNC_TENSORS = 4
SYNC_SEED = 20250


def sync_state(nbytes, seed):
    """The sync section's shared state: ``nbytes // 4`` float32 over SYNC_TENSORS 1-D tensors
    ``t0``.. (nearly equal sizes), standard normal from ``seed``; ``seed`` None: zeros of the
    same layout, every page touched (a joiner's stale copy, not a lazily mapped one)."""
    base, extra = divmod(nbytes // 4, SYNC_TENSORS)
    rng = None if seed is None else np.random.default_rng(seed)
    out = {}
    for i in range(SYNC_TENSORS):
        count = base + (i < extra)
        if rng is None:
            a = np.empty(count, np.float32)
            a.fill(0)
        else:
            a = rng.standard_normal(count, dtype=np.float32)
        out[f"t{i}"] = a
    return out


def _write_atomic(path, obj):
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".tmp", path)


def _watch_fetch(state, range_bytes, stop, started_path, samples):
    """The joiner's view of its fetch, polled every 5 ms until ``stop``: the fetch asks for
    ``range_bytes`` ranges of each tensor in name order and receives each in place, front to
    back, so a range whose last float32 is no longer 0 has landed (the seeded values are never
    exactly 0). Appends (wall time, landed bytes) at each change; the first state byte seen
    creates ``started_path`` (the driver's cue for the donor-death trial)."""
    per = []
    for k in sorted(state):
        a = state[k]
        offs = list(range(0, a.nbytes, range_bytes))
        last = np.array([(min(o + range_bytes, a.nbytes)) // 4 - 1 for o in offs], np.int64)
        size = np.array([min(range_bytes, a.nbytes - o) for o in offs], np.int64)
        per.append((a, np.array([o // 4 for o in offs], np.int64), last, size))
    started, landed = False, 0
    while not stop.is_set():
        now = time.time()
        if not started and any(np.any(a[f] != 0) for a, f, _, _ in per):
            started = True
            samples.append((now, 0))
            _write_atomic(started_path, {"t": now})
        got = int(sum(int(sz[a[la] != 0].sum()) for a, _, la, sz in per))
        if got != landed:
            landed = got
            samples.append((now, got))
        stop.wait(0.005)


def worker_sync(a):
    """One peer of the sync section (``--role donor`` or ``joiner``); writes ``--out``.ready
    (its id, rank, the joiner's first donor) once the group is ``--n``, then ``--out``."""
    import hashlib  # noqa: PLC0415

    import commlib.elastic as el  # noqa: PLC0415

    joiner = a.role == "joiner"
    state = sync_state(a.sync_bytes, None if joiner else a.seed)
    peer = _join_group(el, a)
    members = list(peer.members)
    info = {"role": a.role, "id": peer.id, "rank": peer.rank, "members": members, "pid": os.getpid(),
            "streams": peer.streams}
    stop, samples, watcher = threading.Event(), [], None
    if joiner:
        donors = [m for m in members if m != peer.id]  # the plan lists the donors in ring order
        info["first_donor"] = donors[peer.rank % len(donors)]  # Peer._fetch starts at rank % donors
        watcher = threading.Thread(target=_watch_fetch, daemon=True,
                                   args=(state, getattr(el.Peer, "_RANGE", 4 << 20), stop, a.out + ".started",
                                         samples))
        watcher.start()
    _write_atomic(a.out + ".ready", info)
    t_call = time.time()
    res = peer.sync_shared_state(state, 0 if joiner else 1)
    t_return = time.time()
    stop.set()
    out = dict(info, result=res, t_call=t_call, t_return=t_return)
    if joiner:
        watcher.join(5)
        want = sync_state(a.sync_bytes, a.seed)
        out["verified"] = (res["revision"] == 1 and sorted(state) == sorted(want)
                           and all(state[k].dtype == want[k].dtype and state[k].shape == want[k].shape
                                   and np.array_equal(state[k].view(np.uint32), want[k].view(np.uint32))
                                   for k in want))
        t = time.perf_counter()
        for k in sorted(state):
            hashlib.sha256(memoryview(state[k]).cast("B")).digest()
        out["sha256_pass_s"] = time.perf_counter() - t
        out["samples"] = samples
    _write_atomic(a.out, out)
    peer.close()


def worker_sink(a):
    """Receiver of the sync section's bandwidth baseline: prints its port, then for each count
    ``k`` in ``--sizes`` accepts ``k`` connections; each sends a 16-byte (start, end) header and
    those bytes of ``--sync-bytes``, received in place into one touched buffer; then 1 byte back."""
    buf = np.empty(a.sync_bytes, np.uint8)
    buf.fill(0)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    ls.settimeout(120)
    print(ls.getsockname()[1], flush=True)
    errors = []

    def rx(c):
        try:
            hdr = b""
            while len(hdr) < 16:
                b = c.recv(16 - len(hdr))
                if not b:
                    raise ConnectionError("closed")
                hdr += b
            lo, hi = struct.unpack("<QQ", hdr)
            mv = memoryview(buf)[lo:hi]
            while mv:
                n = c.recv_into(mv)
                if n == 0:
                    raise ConnectionError("closed")
                mv = mv[n:]
            c.sendall(b"k")
        except OSError as exc:
            errors.append(exc)
        finally:
            c.close()

    for k in (int(x) for x in a.sizes.split(",")):
        conns = []
        for _ in range(k):
            c = ls.accept()[0]
            c.settimeout(120)
            conns.append(c)
        ths = [threading.Thread(target=rx, args=(c,), daemon=True) for c in conns]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        if errors:
            raise SystemExit(f"sink: {errors[0]!r}")
    return 0


# ============================================================== driver
class Master:
    def __init__(self, tmp):
        self.secret = os.path.join(tmp, "secret")
        with open(self.secret, "wb") as fh:
            fh.write(secrets.token_bytes(32))
        os.chmod(self.secret, 0o600)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(os.path.join(tmp, f"master{self.port}.log"), "wb")
        self.proc = subprocess.Popen(PY + ["-m", "commlib.cli", "master", "--bind", self.address, "--secret-file",
                                           self.secret], stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("master did not start")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _run_all(procs, timeout):
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"worker timed out after {timeout} s") from None
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise RuntimeError(f"worker exit status {bad}")


def run_elastic(tmp, n, sz, trials, streams, timeout, wan=None, first_round_first=False):
    m = Master(tmp)
    out = os.path.join(tmp, f"el_{n}_{streams}_{'wan' if wan else 'lo'}.json")
    procs, proxy = [], None
    try:
        binds = [None] * n
        if wan is not None:  # peer i listens on real[i], advertises the proxy's port front[i]
            real = [free_port() for _ in range(n)]
            front = [free_port() for _ in range(n)]
            binds = [(f"127.0.0.1:{real[i]}", f"127.0.0.1:{front[i]}") for i in range(n)]
            proxy = subprocess.Popen(PY + [HERE, "--worker", "proxy", "--map",
                                           ",".join(f"{front[i]}:127.0.0.1:{real[i]}" for i in range(n)),
                                           "--latency-ms", str(wan[0]), "--rate-mbps", str(wan[1])],
                                     stdout=subprocess.PIPE, cwd=REPO, text=True)
            proxy.stdout.readline()
        for i in range(n):
            cmd = PY + [HERE, "--worker", "elastic", "--master", m.address, "--secret", m.secret, "--n", str(n),
                        "--sizes", ",".join(map(str, sz)), "--trials", str(trials), "--streams", _streams_text(streams),
                        "--out", out]
            if binds[i]:
                cmd += ["--bind", binds[i][0], "--advertise", binds[i][1]]
            if first_round_first:
                cmd += ["--first-round-first"]
            procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=open(os.path.join(tmp, f"el{i}.log"), "wb"),
                                          stderr=subprocess.STDOUT))
        _run_all(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if proxy is not None:
            proxy.kill()
        m.stop()
    with open(out) as fh:
        return json.load(fh)


def run_mpi(tmp, n, sz, trials, timeout):
    out = os.path.join(tmp, f"mpi_{n}.json")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return None
    cmd = [mpiexec, "--oversubscribe", "--mca", "btl", "tcp,self", "-n", str(n)] + PY + [
        HERE, "--worker", "mpi", "--sizes", ",".join(map(str, sz)), "--trials", str(trials), "--out", out]
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"mpiexec failed: {r.stderr[-2000:]}")
    with open(out) as fh:
        return json.load(fh)


def run_gloo(tmp, n, sz, trials, timeout):
    try:
        import importlib.util  # noqa: PLC0415

        if importlib.util.find_spec("torch") is None:
            return None
    except ImportError:
        return None
    return _run_ranks(tmp, "gloo", n, sz, trials, timeout, ["--port", str(free_port())])


def run_sockring(tmp, n, sz, trials, timeout):
    return _run_ranks(tmp, "sockring", n, sz, trials, timeout,
                      ["--map", ",".join(str(free_port()) for _ in range(n))])


def _run_ranks(tmp, worker, n, sz, trials, timeout, extra):
    """Start ``n`` ``--worker`` processes (ranks 0..n-1) and return rank 0's JSON."""
    out = os.path.join(tmp, f"{worker}_{n}.json")
    procs = [subprocess.Popen(PY + [HERE, "--worker", worker, "--rank", str(r), "--n", str(n), "--sizes",
                                    ",".join(map(str, sz)), "--trials", str(trials), "--out", out] + extra,
                              cwd=REPO, stdout=open(os.path.join(tmp, f"{worker}{r}.log"), "wb"),
                              stderr=subprocess.STDOUT) for r in range(n)]
    try:
        _run_all(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    with open(out) as fh:
        return json.load(fh)


#: the all-reduce section's baselines: Open MPI over TCP, gloo, and the floor of the same
#: ring over plain Python sockets (worker_sockring)
BASELINES = ("openmpi_tcp", "gloo", "python_sockets")


def section_allreduce(args, tmp, log):
    sz = sizes(args.min_bytes, args.max_bytes)
    res = {}
    for n in args.peers:
        factor = 2 * (n - 1) / n
        runs = {"commlib.elastic": run_elastic(tmp, n, sz, args.trials, args.streams, args.timeout)}
        log(f"  elastic at {n} peers done")
        runs["openmpi_tcp"] = run_mpi(tmp, n, sz, args.trials, args.timeout)
        log(f"  Open MPI at {n} peers done" if runs["openmpi_tcp"] is not None else
            "  Open MPI baseline SKIPPED: no mpiexec beside this python or on PATH")
        runs["gloo"] = run_gloo(tmp, n, sz, args.trials, args.timeout)
        if runs["gloo"] is None:
            log("  gloo baseline SKIPPED: torch is not installed for this python")
        runs["python_sockets"] = run_sockring(tmp, n, sz, args.trials, args.timeout)
        rows = []
        for i, b in enumerate(sz):
            row = {"bytes": runs["commlib.elastic"]["rows"][i]["bytes"]}
            for k, r in runs.items():
                if r is None:
                    continue
                t = r["rows"][i]["time_s"]
                row[k] = {"time_us": t * 1e6, "busbw_GBps": row["bytes"] / t / 1e9 * factor}
            el = row["commlib.elastic"]["busbw_GBps"]
            for k in BASELINES:
                if k in row:
                    row[f"ratio_vs_{k}"] = el / row[k]["busbw_GBps"]
            rows.append(row)
            log(f"  {n} peers {row['bytes']:>10d} B  elastic {el:8.4f} GB/s"
                + "".join(f"  {k} {row[k]['busbw_GBps']:8.4f} ({row[f'ratio_vs_{k}']:.2f}x)"
                          for k in BASELINES if k in row))
        big = [r for r in rows if r["bytes"] >= 4 << 20]
        summ = {}
        for k in BASELINES:
            vals = [r[f"ratio_vs_{k}"] for r in big if f"ratio_vs_{k}" in r]
            if vals:
                summ[k] = {"min_ratio_ge_4MiB": min(vals), "median_ratio_ge_4MiB": statistics.median(vals)}
        res[str(n)] = {"rows": rows, "summary": summ, "mpi": (runs["openmpi_tcp"] or {}).get("mpi"),
                       "torch": (runs["gloo"] or {}).get("torch")}
        log(f"  {n} peers, ratios at >= 4 MiB: {summ}")
    return res


def section_wan(args, tmp, log):
    from commlib.elastic import PAIR_EXCHANGE_MAX  # noqa: PLC0415

    out = {"latency_ms": args.wan_latency_ms, "rate_mbps_per_connection": args.wan_rate_mbps,
           "bytes": args.wan_bytes, "streams": {}}
    for s in (1, 4):
        r = run_elastic(tmp, 2, [args.wan_bytes], max(1, args.trials // 2), s, args.timeout,
                        wan=(args.wan_latency_ms, args.wan_rate_mbps))
        t = r["rows"][0]["time_s"]
        out["streams"][str(s)] = {"time_s": t, "busbw_MBps": r["rows"][0]["bytes"] / t / 1e6}
        log(f"  wan {s} stream(s): {t:.3f} s per all-reduce of {args.wan_bytes} B (ring: first round overlapped)")
        if args.wan_bytes > PAIR_EXCHANGE_MAX:
            # the baseline: the ring's first round before its first chunk (Peer.overlap_first_round)
            b = run_elastic(tmp, 2, [args.wan_bytes], max(1, args.trials // 2), s, args.timeout,
                            wan=(args.wan_latency_ms, args.wan_rate_mbps), first_round_first=True)["rows"][0]["time_s"]
            out["streams"][str(s)].update(first_round_first_time_s=b, overlap_speedup=b / t)
            log(f"  wan {s} stream(s), first round before the ring: {b:.3f} s; overlapped {b / t:.2f}x "
                f"({(b - t) * 1e3:.1f} ms a call)")
    out["ratio_4_vs_1"] = out["streams"]["1"]["time_s"] / out["streams"]["4"]["time_s"]
    log(f"  4 streams / 1 stream: {out['ratio_4_vs_1']:.2f}x")
    return out


def section_kill(args, tmp, log):
    m = Master(tmp)
    procs = []
    rng = random.Random(1)
    n = 4

    def start():
        k = len(procs)
        f = os.path.join(tmp, f"loop{k}.txt")
        p = subprocess.Popen(PY + [HERE, "--worker", "loop", "--master", m.address, "--secret", m.secret,
                                   "--streams", _streams_text(args.streams), "--out", f],
                             cwd=REPO, stdout=open(os.path.join(tmp, f"loop{k}.log"), "wb"), stderr=subprocess.STDOUT)
        procs.append((p, f))

    def lines(f, after):
        try:
            with open(f) as fh:
                return [tuple(float(x) for x in ln.split()) for ln in fh if ln.strip() and float(ln.split()[0]) > after]
        except (OSError, ValueError, IndexError):
            return []

    def wait_all_at(size, after, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [(p, f) for p, f in procs if p.poll() is None]
            firsts = []
            for p, f in live:
                got = [ln for ln in lines(f, after) if int(ln[2]) == size]
                if not got:
                    break
                firsts.append(got[0][0])
            else:
                if len(firsts) == size:
                    return max(firsts)
            time.sleep(0.02)
        return None

    times = []
    try:
        for _ in range(n):
            start()
        if wait_all_at(n, 0, 120) is None:
            raise RuntimeError("the kill benchmark's peers never formed a group of 4")
        for trial in range(args.kill_trials):
            time.sleep(0.5)
            live = [pf for pf in procs if pf[0].poll() is None]
            victim = rng.choice(live)[0]
            t_kill = time.time()
            victim.send_signal(signal.SIGKILL)
            t_next = wait_all_at(n - 1, t_kill, 60)
            if t_next is None:
                log(f"  trial {trial}: no all-reduce over the survivors within 60 s")
                times.append(float("inf"))
            else:
                times.append(t_next - t_kill)
                log(f"  trial {trial}: {times[-1]:.3f} s from SIGKILL to the next all-reduce over the survivors")
            start()
            if wait_all_at(n, time.time(), 120) is None:
                raise RuntimeError("the replacement peer never joined")
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        m.stop()
    fin = sorted(t for t in times if t != float("inf"))
    return {"peers": n, "trials": len(times), "seconds": times,
            "median_s": statistics.median(times) if times else None,
            "p90_s": fin[int(0.9 * (len(fin) - 1))] if fin else None, "max_s": max(times) if times else None}


def section_diloco(args, tmp, log):
    out = {}
    for q in ("none", "int8"):
        m = Master(tmp)
        procs = []
        try:
            for i in range(2):
                procs.append(subprocess.Popen(
                    PY + ["-m", "commlib.apps.diloco", "--master", m.address, "--secret-file", m.secret,
                          "--min-peers", "2", "--outer-steps", str(args.diloco_steps), "--quantize", q,
                          "--no-progress", "--json", os.path.join(tmp, f"diloco_{q}_{i}.json")],
                    cwd=REPO, stdout=open(os.path.join(tmp, f"diloco_{q}_{i}.log"), "wb"), stderr=subprocess.STDOUT))
            _run_all(procs, args.timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            m.stop()
        with open(os.path.join(tmp, f"diloco_{q}_0.json")) as fh:
            rep = json.load(fh)
        out[q] = {"params": rep["config"]["params"], "buffer_bytes": rep["config"]["params"] * 4,
                  "counted_bytes_per_outer_step": rep["mean_counted_bytes_per_outer_step"],
                  "estimated_bytes_per_outer_step": rep["mean_estimated_bytes_per_outer_step"],
                  "final_accuracy": rep["final_accuracy"], "outer_steps": rep["outer_steps_done"]}
        log(f"  diloco quantize={q}: {out[q]}")
    if out["none"]["counted_bytes_per_outer_step"] and out["int8"]["counted_bytes_per_outer_step"]:
        out["ratio_none_vs_int8"] = out["none"]["counted_bytes_per_outer_step"] / out["int8"][
            "counted_bytes_per_outer_step"]
    return out


def _sync_bandwidth(tmp, payload, counts, timeout):
    """Bytes/s of ``payload`` from this process to a receiver process (``worker_sink``) over
    ``k`` plain loopback TCP sockets (default options), for each ``k`` in ``counts``: from the
    first byte sent (sockets already connected) to the last socket's 1-byte reply."""
    sink = subprocess.Popen(PY + [HERE, "--worker", "sink", "--sync-bytes", str(len(payload)),
                                  "--sizes", ",".join(map(str, counts))],
                            stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "sink.log"), "ab"), cwd=REPO,
                            text=True, env=dict(os.environ, MPI4PY_RC_INITIALIZE="0"))
    out = {}
    try:
        port = int(sink.stdout.readline())
        for k in counts:
            socks = [socket.create_connection(("127.0.0.1", port), timeout=timeout) for _ in range(k)]
            bounds = [len(payload) * i // k for i in range(k + 1)]
            errors = []

            def tx(sk, lo, hi):
                try:
                    sk.sendall(struct.pack("<QQ", lo, hi))
                    sk.sendall(memoryview(payload)[lo:hi])
                    if sk.recv(1) != b"k":
                        raise ConnectionError("no reply")
                except OSError as exc:
                    errors.append(exc)

            ths = [threading.Thread(target=tx, args=(sk, bounds[i], bounds[i + 1]), daemon=True)
                   for i, sk in enumerate(socks)]
            t = time.perf_counter()
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            dt = time.perf_counter() - t
            for sk in socks:
                sk.close()
            if errors:
                raise RuntimeError(f"bandwidth baseline: {errors[0]!r}")
            out[k] = len(payload) / dt
        sink.wait(30)
    finally:
        if sink.poll() is None:
            sink.kill()
    return out


def _wait_file(path, procs, deadline, what):
    while not os.path.exists(path):
        bad = [p.returncode for p in procs if p.poll() is not None and p.returncode != 0]
        if bad:
            raise RuntimeError(f"a sync worker exited with status {bad} before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within the timeout")
        time.sleep(0.005)
    with open(path) as fh:
        return json.load(fh)


def _sync_trial(args, tmp, name, rate=None, kill_after=None):
    """One master, 2 donors and a joiner (separate processes); returns the joiner's record,
    and with ``kill_after`` the kill's. ``rate``: COMMLIB_ELASTIC_SERVE_RATE of every peer."""
    m = Master(tmp)
    env = dict(os.environ, MPI4PY_RC_INITIALIZE="0")
    if rate is not None:
        env["COMMLIB_ELASTIC_SERVE_RATE"] = repr(rate)
    procs, outs = {}, {}
    deadline = time.monotonic() + args.timeout
    try:
        for role, who in (("donor", "d0"), ("donor", "d1"), ("joiner", "j")):
            outs[who] = os.path.join(tmp, f"{name}_{who}.json")
            procs[who] = subprocess.Popen(
                PY + [HERE, "--worker", "sync", "--role", role, "--master", m.address, "--secret", m.secret,
                      "--n", "3", "--sync-bytes", str(args.sync_bytes), "--seed", str(SYNC_SEED),
                      "--streams", _streams_text(args.streams), "--out", outs[who]],
                cwd=REPO, env=env, stdout=open(os.path.join(tmp, f"{name}_{who}.log"), "wb"), stderr=subprocess.STDOUT)
        kill = None
        if kill_after is None:
            _run_all(list(procs.values()), args.timeout)
        else:
            ps = list(procs.values())
            info = {w: _wait_file(outs[w] + ".ready", ps, deadline, f"{w} in a group of 3") for w in procs}
            victim = next(w for w in ("d0", "d1") if info[w]["id"] == info["j"]["first_donor"])
            t0 = _wait_file(outs["j"] + ".started", ps, deadline, "the joiner's first state byte")["t"]
            time.sleep(max(0.0, t0 + kill_after - time.time()))
            t_kill = time.time()
            procs[victim].send_signal(signal.SIGKILL)
            _run_all([p for w, p in procs.items() if w != victim], max(1.0, deadline - time.monotonic()))
            procs[victim].wait(10)
            kill = {"victim_id": info[victim]["id"], "t_kill": t_kill, "t_first_byte": t0,
                    "victim_status": procs[victim].returncode}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        m.stop()
    with open(outs["j"]) as fh:
        j = json.load(fh)
    if not j["verified"]:
        raise RuntimeError(f"{name}: the joiner's state does not equal the donors' (revision "
                           f"{j['result']['revision']})")
    samples = j["samples"]
    first = next((t for t, _ in samples), None)
    last = next((t for t, n in samples if n >= args.sync_bytes), None)
    rec = {"sync_s": j["result"]["seconds"], "bytes_received": j["result"]["bytes_received"],
           "donor": j["result"]["donor"], "first_donor": j["first_donor"], "joiner_rank": j["rank"],
           "fetch_connections": j["streams"], "verified": True, "sha256_pass_s": j["sha256_pass_s"],
           "call_to_first_byte_s": None if first is None else first - j["t_call"],
           "first_to_last_byte_s": None if first is None or last is None else last - first,
           "last_byte_to_return_s": None if last is None else j["t_return"] - last}
    if kill is not None:
        landed = max((n for t, n in samples if t <= kill["t_kill"]), default=0)
        rec.update(kill, killed_after_first_byte_s=kill["t_kill"] - kill["t_first_byte"],
                   killed_after_call_s=kill["t_kill"] - j["t_call"], landed_bytes_at_kill=landed,
                   mid_transfer=bool(0 < kill["t_kill"] - kill["t_first_byte"] and landed < args.sync_bytes
                                     and j["result"]["donor"] != kill["victim_id"]))
    return rec


def section_sync(args, tmp, log):
    nbytes = args.sync_bytes
    conns = 4 if args.streams is None else args.streams  # a fetch opens the joiner's `streams`
    # (commlib.elastic.AUTO_STREAMS = 4 with streams=None: the 1-per-pair loopback rule is the ring's)
    payload = np.ones(nbytes, np.uint8)
    counts = sorted({1, conns})
    out = {"bytes": nbytes, "tensors": SYNC_TENSORS, "donors": 2, "fetch_connections": conns,
           "baseline": f"the same bytes from the driver to a receiver process over {' and '.join(map(str, counts))} "
                       "plain loopback TCP socket(s), the faster", "trials": []}
    for trial in range(args.sync_trials):
        bw = _sync_bandwidth(tmp, payload, counts, args.timeout)
        r = _sync_trial(args, tmp, f"sync{trial}")
        best = max(bw.values())
        r.update({f"bandwidth_{k}_sockets_Bps": v for k, v in bw.items()})
        r.update(bandwidth_Bps=best, limit_s=nbytes / best + 1.0)
        r["ratio_limit_to_sync"] = r["limit_s"] / r["sync_s"]
        if r["fetch_connections"] != conns:
            raise RuntimeError(f"the joiner fetched over {r['fetch_connections']} connections, not {conns}")
        out["trials"].append(r)
        log(f"  trial {trial}: {nbytes} B in {r['sync_s']:.3f} s from donor {r['donor']} (verified); bandwidth "
            + ", ".join(f"{k} socket(s) {v / 1e9:.2f} GB/s" for k, v in bw.items())
            + f": limit {r['limit_s']:.3f} s, {r['ratio_limit_to_sync']:.2f}x; call to first byte "
            f"{r['call_to_first_byte_s']:.3f} s, transfer {r['first_to_last_byte_s']:.3f} s, last byte to return "
            f"{r['last_byte_to_return_s']:.3f} s (one SHA-256 pass {r['sha256_pass_s']:.3f} s)")
    ts = [r["sync_s"] for r in out["trials"]]
    ratios = [r["ratio_limit_to_sync"] for r in out["trials"]]
    bws = [r["bandwidth_Bps"] for r in out["trials"]]
    out.update(median_sync_s=statistics.median(ts), max_sync_s=max(ts), median_bandwidth_Bps=statistics.median(bws),
               median_limit_s=nbytes / statistics.median(bws) + 1.0, median_ratio=statistics.median(ratios),
               min_ratio=min(ratios), target_met=min(ratios) >= 1.0)
    rate = nbytes / (args.sync_throttle_s * conns)
    k = _sync_trial(args, tmp, "sync_kill", rate=rate, kill_after=args.sync_kill_after)
    k.update(serve_rate_Bps_per_connection=rate, serve_rate_Bps=rate * conns, limit_s=args.sync_throttle_s + 1.0)
    k["ratio_limit_to_sync"] = k["limit_s"] / k["sync_s"]
    out["donor_death"] = k
    log(f"  donor death: donors serve {rate / 1e6:.1f} MB/s per connection x {conns}; donor {k['victim_id']} "
        f"(serving the joiner) SIGKILLed {k['killed_after_first_byte_s']:.3f} s after the first byte, "
        f"{k['landed_bytes_at_kill']} of {nbytes} B landed ({'mid-transfer' if k['mid_transfer'] else 'NOT mid-transfer'}"
        f"); joiner done from donor {k['donor']} in {k['sync_s']:.3f} s (verified), limit {k['limit_s']:.3f} s, "
        f"{k['ratio_limit_to_sync']:.2f}x")
    return out


def plot(rec, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    a1, a2, a3, a4, a5, a6 = axes.ravel()
    a6.axis("off")
    for j, (n, r) in enumerate((rec.get("allreduce") or {}).items()):
        x = [row["bytes"] for row in r["rows"]]
        for i, k in enumerate(("commlib.elastic",) + BASELINES):
            if k in r["rows"][0]:
                a1.plot(x, [row[k]["busbw_GBps"] for row in r["rows"]], ["o-", "s--", "^:", "x-."][i], ms=3,
                        color=f"C{i}", alpha=1 if j else 0.55, label=f"{k}, {n} peers")
        for i, k in enumerate(BASELINES):
            if f"ratio_vs_{k}" in r["rows"][0]:
                a2.plot(x, [row[f"ratio_vs_{k}"] for row in r["rows"]], ".-", color=f"C{i + 1}",
                        alpha=1 if j else 0.55, label=f"vs {k}, {n} peers")
    if rec.get("allreduce"):
        a1.set(xscale="log", yscale="log", xlabel="bytes", ylabel="busbw (GB/s)", title="all-reduce on loopback")
        a2.axhline(1.0, color="C2", ls=":", lw=0.8, label="target 1.0x gloo (3-4 peers, 1-64 MiB)")
        a2.set(xscale="log", yscale="log", xlabel="bytes", ylabel="commlib.elastic busbw / baseline")
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
    else:  # the section was not run: no empty axes with a legend warning
        a1.axis("off")
        a2.axis("off")
    w = rec.get("wan")
    if w:
        a3.bar(["1 stream", "4 streams"], [w["streams"]["1"]["busbw_MBps"], w["streams"]["4"]["busbw_MBps"]])
        a3.set(ylabel="busbw (MB/s)", title=f"through the proxy: +{w['latency_ms']} ms,\n{w['rate_mbps_per_connection']}"
               f" Mbit/s per connection ({w['ratio_4_vs_1']:.2f}x)")
    else:
        a3.axis("off")
    k = rec.get("kill")
    if k and k["seconds"]:
        top = max(2.2, min(max(k["seconds"]), 10))  # 0.05 s bins from 0, the target in view
        a4.hist([min(s, 10) for s in k["seconds"]], bins=np.arange(0, top + 0.05, 0.05))
        a4.axvline(2.0, color="C3", ls=":", label="target median 2 s")
        a4.set(xlabel="seconds from SIGKILL to the next all-reduce", ylabel="trials",
               title=f"kill to next all-reduce, median {k['median_s']:.2f} s")
        a4.legend(fontsize=8)
    else:
        a4.axis("off")
    y = rec.get("sync")
    if y:
        rows = y["trials"] + [y["donor_death"]]
        names = [f"trial {i}" for i in range(len(y["trials"]))] + ["donor\nkilled"]
        x = np.arange(len(rows))
        a5.bar(x - 0.2, [r["sync_s"] for r in rows], 0.4, label="joiner sync (s)")
        a5.bar(x + 0.2, [r["limit_s"] for r in rows], 0.4, label="limit: bytes / bandwidth + 1 s")
        a5.set_xticks(x, names)
        a5.set(ylabel="seconds", title=f"joiner state sync, {y['bytes'] / 2 ** 20:.0f} MiB "
               f"(killed: limit = bytes / throttle + 1 s)")
        a5.legend(fontsize=8)
    else:
        a5.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SECTIONS = ("allreduce", "wan", "kill", "diloco", "sync")


def _streams_arg(text):
    """``--streams``: ``auto`` (None: the library's default) or 1..64."""
    if text == "auto":
        return None
    v = _int_in(1, 64, "connections")(text)
    return v


def _sections_arg(text):
    secs = [s for s in text.split(",") if s]
    bad = [s for s in secs if s not in SECTIONS]
    if not secs or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(SECTIONS)}, got {text!r}")
    return secs


def _peers_arg(text):
    try:
        peers = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated peer counts, got {text!r}") from None
    if not peers or any(not 2 <= p <= 64 for p in peers):
        raise argparse.ArgumentTypeError(f"every peer count must be 2..64, got {text!r}")
    return peers


def main(argv=None):
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sections", type=_sections_arg, default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, a subset of {','.join(SECTIONS)}")
    ap.add_argument("--peers", type=_peers_arg, default="2,4",
                    help="allreduce section: comma-separated peer counts (processes), each 2..64")
    ap.add_argument("--min-bytes", type=_int_in(4, 1 << 30, "bytes"), default=4,
                    help="allreduce section: smallest message, bytes (4 .. 1 GiB; sizes go x4 below 1 MiB, x2 above)")
    ap.add_argument("--max-bytes", type=_int_in(4, 1 << 30, "bytes"), default=64 << 20,
                    help="allreduce section: largest message, bytes (>= --min-bytes, <= 1 GiB)")
    ap.add_argument("--trials", type=_int_in(1, 1000, "trials"), default=3,
                    help="timed trials per size (the best is kept; each trial ~0.2 s of calls)")
    ap.add_argument("--streams", type=_streams_arg, default="auto",
                    help="commlib.elastic TCP connections per peer pair in the allreduce, kill and sync sections: "
                         "1..64, or auto (the library's default: 1 per ring pair on loopback; a state fetch "
                         "opens 4 even there)")
    ap.add_argument("--wan-latency-ms", type=_float_in(0, 10000, "milliseconds", lo_ok=True), default=20.0,
                    help="wan section: latency the proxy adds in each direction, milliseconds (0..10000)")
    ap.add_argument("--wan-rate-mbps", type=_float_in(0, 1e6, "Mbit/s"), default=40.0,
                    help="wan section: rate cap of each proxied TCP connection, Mbit/s per direction (> 0)")
    ap.add_argument("--wan-bytes", type=_int_in(4, 1 << 30, "bytes"), default=8 << 20,
                    help="wan section: all-reduce size, bytes (4 .. 1 GiB)")
    ap.add_argument("--kill-trials", type=_int_in(1, 1000, "trials"), default=8,
                    help="kill section: SIGKILLs, one per trial (1..1000)")
    ap.add_argument("--diloco-steps", type=_int_in(1, 10000, "steps"), default=8,
                    help="diloco section: outer steps of each DiLoCo run (1..10000)")
    ap.add_argument("--sync-bytes", type=_int_in(16, 1 << 30, "bytes"), default=128 << 20,
                    help="sync section: shared state, bytes (16 .. 1 GiB, a multiple of 4): float32 over "
                         f"{SYNC_TENSORS} tensors")
    ap.add_argument("--sync-trials", type=_int_in(1, 100, "trials"), default=3,
                    help="sync section: timed syncs, each with its own bandwidth baseline (1..100); "
                         "one donor-death trial follows")
    ap.add_argument("--sync-throttle-s", type=_float_in(0, 3600, "seconds"), default=1.5,
                    help="sync section, donor-death trial: seconds one donor's throttled transfer of "
                         "--sync-bytes takes: every donor serves each fetch connection at --sync-bytes / (this "
                         "* connections) bytes/s (COMMLIB_ELASTIC_SERVE_RATE) (> 0)")
    ap.add_argument("--sync-kill-after", type=_float_in(0, 3600, "seconds"), default=0.4,
                    help="sync section, donor-death trial: seconds after the joiner's first state byte "
                         "landed that the donor serving it is SIGKILLed (> 0, < --sync-throttle-s)")
    ap.add_argument("--timeout", type=_float_in(0, 86400, "seconds"), default=900.0,
                    help="seconds any one job (a set of worker processes) may take (> 0)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder with the workers' logs")
    ap.add_argument("--json", type=_writable_file, default=None,
                    help="write every figure to this JSON file (None: not written)")
    ap.add_argument("--plot", type=_writable_file, default=None,
                    help="write a PNG of the figures to this file (needs matplotlib; None: no plot)")
    # worker modes (internal)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    for k in ("--master", "--secret", "--sizes", "--out", "--bind", "--advertise", "--map", "--role"):
        ap.add_argument(k, default=None, help=argparse.SUPPRESS)
    for k in ("--n", "--port", "--rank", "--seed"):
        ap.add_argument(k, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--first-round-first", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--latency-ms", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rate-mbps", type=float, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return {"elastic": worker_elastic, "mpi": worker_mpi, "gloo": worker_gloo, "sockring": worker_sockring,
                "loop": worker_loop,
                "proxy": worker_proxy, "sync": worker_sync, "sink": worker_sink}[a.worker](a)
    if a.min_bytes > a.max_bytes:
        ap.error(f"--min-bytes ({a.min_bytes}) must not exceed --max-bytes ({a.max_bytes})")
    if a.sync_bytes % 4:
        ap.error(f"--sync-bytes must be a multiple of 4 (whole float32s), got {a.sync_bytes}")
    if a.sync_kill_after >= a.sync_throttle_s:
        ap.error(f"--sync-kill-after ({a.sync_kill_after:g} s) must be below --sync-throttle-s "
                 f"({a.sync_throttle_s:g} s): the kill would land after the transfer")
    secs = a.sections
    tmp = tempfile.mkdtemp(prefix="bench_elastic_")

    def log(msg):
        print(msg, flush=True)

    rec = {"benchmark": "elastic", "machine": f"{os.cpu_count()} cores, loopback", "streams": a.streams}
    t0 = time.time()
    try:
        for s in secs:
            log(f"== {s}")
            rec[s] = {"allreduce": section_allreduce, "wan": section_wan, "kill": section_kill,
                      "diloco": section_diloco, "sync": section_sync}[s](a, tmp, log)
    finally:
        rec["wall_s"] = time.time() - t0
        write_json(a.json, rec)
        if a.plot:
            plot(rec, a.plot)
        if a.keep:
            log(f"logs: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    log("== ratios from this run")
    for n, r in (rec.get("allreduce") or {}).items():
        log(f"  all-reduce >= 4 MiB, {n} peers: {r['summary']}  (issue 41 target: >= 1.0x gloo at 3 and 4 peers, 1-64 MiB)")
    if "wan" in rec:
        log(f"  proxy, 4 streams / 1 stream: {rec['wan']['ratio_4_vs_1']:.2f}x (target >= 3x)")
    if "kill" in rec:
        log(f"  SIGKILL to next all-reduce: median {rec['kill']['median_s']:.3f} s, max {rec['kill']['max_s']:.3f} s "
            f"over {rec['kill']['trials']} trials (target median <= 2 s)")
    if "diloco" in rec:
        log(f"  DiLoCo bytes per outer step (per peer, 2 peers): none {rec['diloco']['none']['counted_bytes_per_outer_step']}"
            f", int8 {rec['diloco']['int8']['counted_bytes_per_outer_step']} "
            f"(ratio {rec['diloco'].get('ratio_none_vs_int8')})")
    if "sync" in rec:
        y, k = rec["sync"], rec["sync"]["donor_death"]
        log(f"  joiner state sync, {y['bytes']} B: median {y['median_sync_s']:.3f} s, max {y['max_sync_s']:.3f} s over "
            f"{len(y['trials'])} trials; limit bytes / bandwidth + 1 s = {y['median_limit_s']:.3f} s at the median "
            f"{y['median_bandwidth_Bps'] / 1e9:.2f} GB/s: limit / sync median {y['median_ratio']:.2f}x, min "
            f"{y['min_ratio']:.2f}x (target >= 1x)")
        log(f"  donor SIGKILLed {'mid-transfer' if k['mid_transfer'] else 'NOT mid-transfer'}: joiner in sync from the "
            f"other donor in {k['sync_s']:.3f} s vs bytes / throttle rate + 1 s = {k['limit_s']:.3f} s: "
            f"{k['ratio_limit_to_sync']:.2f}x (target >= 1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
