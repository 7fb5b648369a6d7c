"""Small-call latency: commlib's allreduce, bcast and barrier against mpi4py's own.

What an iterative solver pays every step (two dot products, a convergence
flag): for each call and size, commlib's call (``Communicator.allreduce``,
``bcast``, ``barrier`` with ``algorithm="auto"`` and the argument agreement
on, the default) and mpi4py's buffer call (``Allreduce``, ``Bcast``,
``Barrier``) run interleaved in the same job, best of ``--trials`` trials of
``--iters`` calls each.  Printed per row: both latencies (us) and the ratio
MPI time / commlib time (1: as fast as MPI; below 1: slower), with the load
average at the start and end (compare ratios only from a quiet machine).
Every result is checked against mpi4py's.

Run::

    mpiexec -n 2 python benchmarks/bench_small.py
    mpiexec -n 2 python benchmarks/bench_small.py --max-bytes 32768 --json small.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, geomean, int_in, writable_file, write_json  # noqa: E402


def _best(comm, fn, iters: int, trials: int) -> float:
    """Best mean seconds per call over ``trials`` trials of ``iters`` calls (after a warm-up)."""
    for _ in range(min(iters, 200)):
        fn()
    best = float("inf")
    for _ in range(trials):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return comm.allreduce(best, op=_max())  # the slowest rank's time: the call's


def _max():
    from mpi4py import MPI  # noqa: PLC0415

    return MPI.MAX


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--min-bytes", type=int_in(8, 1 << 26, "bytes"), default=8,
                    help="smallest allreduce/bcast message, bytes (float64 elements; sizes go x4)")
    ap.add_argument("--max-bytes", type=int_in(8, 1 << 26, "bytes"), default=32768,
                    help="largest allreduce/bcast message, bytes (>= --min-bytes)")
    ap.add_argument("--iters", type=int_in(1, 10 ** 7, "calls"), default=5000,
                    help="calls per trial (sizes above 4 KiB run a quarter of them)")
    ap.add_argument("--trials", type=int_in(1, 1000, "trials"), default=7, help="trials per row (the best is kept)")
    ap.add_argument("--json", type=writable_file, default=None, help="write every row to this JSON file")
    args = ap.parse_args(argv)
    if args.min_bytes > args.max_bytes:
        ap.error(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    import commlib  # noqa: PLC0415

    c = commlib.init()
    mpi = c.mpi_comm
    if c.size < 2:
        ap.error("needs 2 or more ranks: run with mpiexec -n 2")
    load0 = os.getloadavg()
    rows = []
    sizes = []
    nb = args.min_bytes // 8 * 8
    while nb <= args.max_bytes:
        sizes.append(nb)
        nb *= 4
    for nb in sizes:
        iters = args.iters if nb <= 4096 else max(1, args.iters // 4)
        x = np.arange(nb // 8, dtype=np.float64) + c.rank
        y, z = np.empty_like(x), np.empty_like(x)
        t_mpi = _best(mpi, lambda x=x, y=y: mpi.Allreduce(x, y), iters, args.trials)
        t_c = _best(mpi, lambda x=x, z=z: c.allreduce(x, z), iters, args.trials)
        if z.tobytes() != y.tobytes():
            raise SystemExit(f"allreduce of {nb} B differs from MPI's")
        rows.append({"call": "allreduce", "bytes": nb, "mpi_s": t_mpi, "commlib_s": t_c})
        b = np.arange(nb // 8, dtype=np.float64) * (c.rank == 0)
        t_mpi = _best(mpi, lambda b=b: mpi.Bcast(b, 0), iters, args.trials)
        t_c = _best(mpi, lambda b=b: c.bcast(b, 0), iters, args.trials)
        if b.tobytes() != np.arange(nb // 8, dtype=np.float64).tobytes():
            raise SystemExit(f"bcast of {nb} B gave a wrong result")
        rows.append({"call": "bcast", "bytes": nb, "mpi_s": t_mpi, "commlib_s": t_c})
    t_mpi = _best(mpi, mpi.Barrier, args.iters, args.trials)
    t_c = _best(mpi, c.barrier, args.iters, args.trials)
    rows.append({"call": "barrier", "bytes": 0, "mpi_s": t_mpi, "commlib_s": t_c})
    load1 = os.getloadavg()
    for r in rows:
        r["ratio"] = r["mpi_s"] / r["commlib_s"]
    if c.rank == 0:
        print(f"# {c.size} ranks; load average at start {load0[0]:.2f}, at end {load1[0]:.2f} "
              f"({os.cpu_count()} CPUs); ratio = MPI time / commlib time")
        print(f"{'call':>10} {'bytes':>8} {'MPI us':>8} {'commlib us':>11} {'ratio':>6}")
        for r in rows:
            print(f"{r['call']:>10} {r['bytes']:8d} {r['mpi_s'] * 1e6:8.2f} {r['commlib_s'] * 1e6:11.2f} "
                  f"{r['ratio']:6.2f}")
        for call in ("allreduce", "bcast", "barrier"):
            rs = [r["ratio"] for r in rows if r["call"] == call]
            print(f"{call}: ratio {min(rs):.2f}-{max(rs):.2f} (geometric mean {geomean(rs):.2f})")
        if args.json:
            write_json(args.json, {"ranks": c.size, "load": [load0, load1], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
