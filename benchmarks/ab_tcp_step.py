"""One exchange step of the TCP transport, this checkout against another build, interleaved.

Loopback A/B for changes to :class:`commlib.transports.tcp.TCPTransport`'s
hot path: two processes, each with a transport, run ``--steps`` steps of the
ring's shape (``irecv`` from the other, ``isend`` to it, ``waitall``; one
float32 message of ``--sizes`` bytes each way, a fresh tag per step) after 200
warm-up steps, once with the installed commlib (``after``) and once with the
build in ``--before`` (as for ``ab_elastic.py``: ``pip install --no-deps
--target DIR .`` in a worktree of the older commit), back to back in
alternating order.  Printed per size: the main thread's CPU time a step
(``time.thread_time``, the mean of the two processes) and the wall time a
step, medians over the repetitions, and the paired ratios with their verdict
(``ab_elastic.paired_summary``).  The main thread's CPU is what the transport's
Python costs the caller: the sender and receiver threads are not in it, and it
is steadier than the wall time on a shared machine.

Run::

    python -P benchmarks/ab_tcp_step.py --before /tmp/before_site --sizes 4096,262144 --reps 10
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, int_in  # noqa: E402
from ab_elastic import _sizes, add_before, check_before, interleave, paired_summary  # noqa: E402

SECRET = b"ab-tcp-step-benchmark-secret-012"
WARMUP = 200


def _rank(r: int, nbytes: int, steps: int, streams: int) -> None:
    """One side: listen, print the address, read the other's from stdin, run the steps."""
    import numpy as np

    from commlib.transports import tcp

    box, ready = [None], threading.Event()

    def on_conn(conn):
        ready.wait(10)
        h = conn.hello
        box[0].attach(h["src"], h["stream"], h["streams"], conn)

    lst = tcp.Listener("127.0.0.1:0", SECRET, on_conn)
    print(lst.address, flush=True)
    other = sys.stdin.readline().strip()

    def connect(peer, stream):
        return tcp.client_handshake(tcp.open_socket(other, 5), SECRET, {"src": r, "stream": stream, "streams": streams})

    t = box[0] = tcp.TCPTransport(r, 2, 1, connect, streams=streams, timeout=30)
    ready.set()
    peer = 1 - r
    sbuf = np.full(max(1, nbytes // 4), r + 1, np.float32)
    rbuf = np.zeros_like(sbuf)

    def step(tag):
        rq = t.irecv(rbuf, peer, tag)
        sq = t.isend(sbuf, peer, tag)
        t.waitall([rq, sq], 30.0)

    for tag in range(1, WARMUP + 1):
        step(tag)
    c0, w0 = time.thread_time(), time.perf_counter()
    for tag in range(WARMUP + 1, WARMUP + 1 + steps):
        step(tag)
    cpu, wall = (time.thread_time() - c0) / steps * 1e6, (time.perf_counter() - w0) / steps * 1e6
    if not (rbuf == peer + 1).all():
        raise SystemExit(f"ab_tcp_step: rank {r} received wrong bytes")
    print(f"cpu {cpu:.2f} wall {wall:.2f}", flush=True)
    sys.stdin.readline()  # both sides done before either closes
    t.close()
    lst.close()


def _one(site: str | None, nbytes: int, steps: int, streams: int) -> tuple[float, float]:
    """(main-thread CPU µs a step, mean of the two sides; wall µs a step, the slower side)."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-P", __file__, "--_rank"]
    ps = [subprocess.Popen(cmd + [str(r), str(nbytes), str(steps), str(streams)], env=env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE) for r in range(2)]
    try:
        addrs = [p.stdout.readline().strip() for p in ps]
        for p, a in zip(ps, addrs[::-1]):
            p.stdin.write(a + "\n")
            p.stdin.flush()
        lines = [p.stdout.readline() for p in ps]
        for p in ps:
            p.stdin.write("done\n")
            p.stdin.flush()
        for p in ps:
            p.wait(60)
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
    got = [re.match(r"cpu ([0-9.]+) wall ([0-9.]+)", ln) for ln in lines]
    if not all(got) or any(p.returncode for p in ps):
        raise SystemExit(f"ab_tcp_step: a run failed ({'before' if site else 'after'}, {nbytes} B): {lines}")
    return (sum(float(m[1]) for m in got) / 2, max(float(m[2]) for m in got))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_rank":
        _rank(*(int(x) for x in argv[1:5]))
        return 0
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                       epilog="Exit status 2 for bad values (argparse's one-line error).")
    add_before(ap)
    ap.add_argument("--sizes", type=_sizes, default=_sizes("4096,262144"),
                    help="comma-separated message sizes, bytes (default: 4096,262144)")
    ap.add_argument("--steps", type=int_in(1, 10**6, "steps"), default=2000, help="timed steps per run (default: 2000)")
    ap.add_argument("--streams", type=int_in(1, 64, "streams"), default=1,
                    help="TCP connections between the two (default: 1, as the elastic ring on loopback)")
    ap.add_argument("--reps", type=int_in(1, 1000, "repetitions"), default=10,
                    help="repetitions of every (size, side) run (default: 10)")
    a = ap.parse_args(argv)
    check_before(ap, a.before)
    res = interleave(a.before, a.sizes, a.reps, lambda site, s: _one(site, s, a.steps, a.streams))
    for k, what in ((0, "main-thread CPU us a step (mean of the 2 sides)"), (1, "wall us a step (the slower side)")):
        print(f"{a.streams} stream(s), {a.reps} repetitions of {a.steps} steps; {what}")
        for s in a.sizes:
            b, f = [x[k] for x in res[s]["before"]], [x[k] for x in res[s]["after"]]
            print(f"{s:>10} B  before median {statistics.median(b):8.1f}   after median {statistics.median(f):8.1f}   "
                  f"{paired_summary(b, f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
