"""Per-call latency of the elastic all-reduce, this checkout against another build, interleaved.

Loopback A/B for changes to :mod:`commlib.elastic` and its TCP transport: for
each repetition and size, a fresh master and ``--peers`` peer processes run
``--iters`` all-reduces of a float32 vector after ``--warmup`` calls, once with
the installed commlib (``after``) and once with the build in ``--before`` (a
folder made by ``pip install --no-deps --target DIR .`` in a worktree of the
older commit), one after the other, so both sides see the same machine
noise.  Printed per size: the median and minimum of the per-call time over
the repetitions (the slowest peer's mean of each run), and after/before as a
speed ratio (above 1: this checkout is faster); then the same for the CPU
time a call costs a peer process (all its threads, ``time.process_time``; the
slowest peer's), steadier than the wall time where the peers outnumber the
cores (4 peers on 2 cores: wall medians of one build ranged 4.7-10 ms a
call at 3 peers, 1 MiB, run to run).  The bench_elastic busbw
figures come from best-of-trials of ~0.2 s each; on a shared 2-core machine
their run-to-run spread is ±30%, which this harness's medians narrow.  Each
line ends with the repetitions' paired ratios (the two runs of a repetition
run back to back, in alternating order): their median, their quartile range
and a verdict ("faster", "slower", or "within the spread" when the range holds
1), so a ratio of 0.94x is read against the machine's own spread.

Run::

    git worktree add /tmp/before <rev>
    (cd /tmp/before && pip install -q --no-deps --no-build-isolation --target /tmp/before_site .)
    python -P benchmarks/ab_elastic.py --before /tmp/before_site --peers 2 --sizes 4096,65536,1048576
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, int_in  # noqa: E402

SECRET = b"ab-elastic-benchmark-secret-0123"


def _peer(addr: str, n: int, nbytes: int, iters: int, warmup: int) -> None:
    import numpy as np

    import commlib.elastic as el

    p = el.connect(addr, secret=SECRET, timeout=30)
    while p.size != n or p.rank is None:
        p.update_topology()
        time.sleep(0.05)
    x = np.zeros(max(1, nbytes // 4), np.float32)
    for _ in range(warmup):
        p.allreduce(x)
    t, c = time.perf_counter(), time.process_time()
    for _ in range(iters):
        p.allreduce(x)
    print(f"us/call {(time.perf_counter() - t) / iters * 1e6:.1f} cpu {(time.process_time() - c) / iters * 1e6:.1f}",
          flush=True)
    p.close()


def _master(n: int, nbytes: int, iters: int, warmup: int) -> None:
    import commlib.elastic as el

    m = el.Master(bind="127.0.0.1:0", secret=SECRET).start()
    procs = [subprocess.Popen([sys.executable, "-P", __file__, "--_peer", m.address, str(n), str(nbytes), str(iters),
                              str(warmup)],
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    m.stop()
    times = [(float(w), float(c)) for o in outs for w, c in re.findall(r"us/call ([0-9.]+) cpu ([0-9.]+)", o)]
    if len(times) != n:
        raise SystemExit(f"ab_elastic: {n - len(times)} peer(s) did not report")
    print(f"us/call {max(w for w, _ in times):.1f} cpu {max(c for _, c in times):.1f}", flush=True)


def _one(site: str | None, n: int, nbytes: int, iters: int, warmup: int) -> tuple[float, float]:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-P", __file__, "--_master", str(n), str(nbytes), str(iters), str(warmup)],
                         env=env,
                         capture_output=True, text=True, timeout=900)
    m = re.findall(r"us/call ([0-9.]+) cpu ([0-9.]+)", out.stdout)
    if out.returncode or not m:
        raise SystemExit(f"ab_elastic: a run failed ({'before' if site else 'after'}, {nbytes} B): "
                         f"{(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return float(m[-1][0]), float(m[-1][1])


def _sizes(text: str) -> list[int]:
    size = int_in(4, 1 << 30, "bytes")
    sizes = [size(s) for s in text.split(",") if s]
    if not sizes:
        raise argparse.ArgumentTypeError("no size given")
    return sizes


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_peer":
        _peer(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5]))
        return 0
    if argv and argv[0] == "--_master":
        _master(int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                       epilog="Exit status 2 for bad values (argparse's one-line error).")
    add_before(ap)
    ap.add_argument("--peers", type=int_in(2, 64, "peers"), default=2, help="peer processes per run (default: 2)")
    ap.add_argument("--sizes", type=_sizes, default=_sizes("4096,65536,1048576"),
                    help="comma-separated all-reduce sizes, bytes (default: 4096,65536,1048576)")
    ap.add_argument("--reps", type=int_in(1, 1000, "repetitions"), default=4, help="repetitions of every (size, side) run (default: 4)")
    ap.add_argument("--iters", type=int_in(1, 10**6, "calls"), default=300,
                    help="timed calls per run (default: 300); keep a run above ~0.3 s: on an idle 16-core "
                    "machine runs of 100 calls (~50 ms) gave paired verdicts that longer runs reversed")
    ap.add_argument("--warmup", type=int_in(0, 10**5, "calls"), default=30,
                    help="untimed calls per run before the timed ones (default: 30)")
    a = ap.parse_args(argv)
    check_before(ap, a.before)
    res = interleave(a.before, a.sizes, a.reps, lambda site, s: _one(site, a.peers, s, a.iters, a.warmup))
    for k, what in ((0, "us per call (slowest peer's mean)"), (1, "CPU us per call and peer process (the slowest)")):
        print(f"{a.peers} peers, {a.reps} repetitions of {a.iters} calls; {what}")
        for s in a.sizes:
            b, f = [x[k] for x in res[s]["before"]], [x[k] for x in res[s]["after"]]
            print(f"{s:>10} B  before median {statistics.median(b):8.0f} min {min(b):8.0f}   "
                  f"after median {statistics.median(f):8.0f} min {min(f):8.0f}   "
                  f"after/before {statistics.median(b) / statistics.median(f):.2f}x (speed, medians)   "
                  f"{paired_summary(b, f)}")
    return 0


def add_before(ap: argparse.ArgumentParser) -> None:
    """The ``--before`` option of an A/B harness."""
    ap.add_argument("--before", required=True, help="folder of the older build (pip install --target), "
                    "put first on PYTHONPATH for the 'before' runs")


def check_before(ap: argparse.ArgumentParser, before: str) -> None:
    """Refuse (exit status 2) a ``--before`` folder without a commlib package."""
    if not os.path.isdir(os.path.join(before, "commlib")):
        ap.error(f"--before {before!r} holds no commlib package (make it with pip install --target)")


def interleave(before: str, sizes: list[int], reps: int, one) -> dict:
    """Run ``one(site, size)`` for both sides, ``reps`` times per size: ``site`` is
    ``before`` for the older build, None for this checkout.  The two runs of a
    repetition go back to back, their order alternating, so a drift of the
    machine's load favours neither side.

    Returns:
        ``{size: {"before": [result, ...], "after": [...]}}`` in repetition order.
    """
    res = {s: {"before": [], "after": []} for s in sizes}
    for rep in range(reps):
        for s in sizes:
            sides = (("before", before), ("after", None))
            for side, site in (sides if rep % 2 == 0 else sides[::-1]):
                res[s][side].append(one(site, s))
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    return res


def paired_summary(before: list[float], after: list[float]) -> str:
    """The repetitions' paired speed ratios (``before[i] / after[i]``, the two runs of
    repetition ``i`` back to back): their median and quartiles, and a verdict that
    calls a difference only when the quartile range excludes 1 (fewer than 4
    repetitions: no verdict)."""
    ratios = sorted(x / y for x, y in zip(before, after))
    med = statistics.median(ratios)
    if len(ratios) < 4:
        return f"paired {med:.2f}x"
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    verdict = "faster" if q1 > 1 else "slower" if q3 < 1 else "within the spread"
    return f"paired {med:.2f}x [{q1:.2f}, {q3:.2f}] {verdict}"


if __name__ == "__main__":
    sys.exit(main())
