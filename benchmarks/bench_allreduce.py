"""Allreduce bandwidth: commlib's algorithms against ``MPI.Comm.Allreduce``.

OSU/nccl-tests style: for each message size (4 B .. 64 MiB of float32 by
default) every variant runs interleaved in the same job, best of ``--trials``
trials, each trial ``iters`` calls (fewer for large messages); the result is
checked against MPI's own Allreduce on every size.  Reported per size:

- time (us), algbw = bytes / time (GB/s), busbw = algbw * 2 (n - 1) / n
  (the factor nccl-tests use for allreduce: the bytes each rank must move);
- ratio = commlib busbw / MPI busbw, side by side from one run;
- the load average at the start and end (other jobs on the cores make every
  figure noisy: compare ratios only from runs on a quiet machine).

Run::

    mpiexec --oversubscribe -n 2 python benchmarks/bench_allreduce.py --json ar2.json
    mpiexec --oversubscribe -n 4 python benchmarks/bench_allreduce.py --json ar4.json --plot ar4.png

Options: ``--min-bytes``, ``--max-bytes``, ``--trials``, ``--variants
ring,recursive_doubling,auto,mpi``, ``--no-check-args`` (skip commlib's
first round of large calls, see ``commlib.collectives.engine``; small calls keep it).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, int_in, subset_of, writable_file, write_json  # noqa: E402

VARIANTS = ("ring", "recursive_doubling", "auto", "mpi")


def main(argv=None):
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--min-bytes", type=int_in(4, 1 << 32, "bytes"), default=4,
                    help="smallest message, bytes (sizes go x4 below 1 MiB, x2 above, up to --max-bytes)")
    ap.add_argument("--max-bytes", type=int_in(4, 1 << 32, "bytes"), default=64 << 20,
                    help="largest message, bytes (>= --min-bytes)")
    ap.add_argument("--trials", type=int_in(1, 10000, "trials"), default=5,
                    help="timed trials per size and variant (the best is kept)")
    ap.add_argument("--variants", type=subset_of(VARIANTS), default="ring,recursive_doubling,auto",
                    help="comma-separated commlib algorithms to time beside MPI.Comm.Allreduce: "
                         + ", ".join(VARIANTS))
    ap.add_argument("--no-check-args", action="store_true",
                    help="skip commlib's argument-agreement first round of large calls (COMMLIB_CHECK_ARGS=0)")
    ap.add_argument("--fault-tolerant", action="store_true", help="run commlib variants in FT mode")
    ap.add_argument("--json", type=writable_file, default=None,
                    help="write every row (time, algbw, busbw, ratio) to this JSON file")
    ap.add_argument("--plot", type=writable_file, default=None,
                    help="PNG: busbw and ratio to MPI against message size")
    args = ap.parse_args(argv)
    if args.min_bytes > args.max_bytes:
        ap.error(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if args.no_check_args:
        os.environ["COMMLIB_CHECK_ARGS"] = "0"

    import commlib
    from mpi4py import MPI

    comm = commlib.init(fault_tolerant=args.fault_tolerant)
    mpi = comm.mpi_comm.Dup()
    n, rank = comm.size, comm.rank
    variants = args.variants
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    load_start = os.getloadavg()
    if rank == 0:  # shared machines: the ratio means little when other jobs hold the cores
        print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
              f"({os.cpu_count()} CPUs, {n} ranks)", flush=True)
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = max(1, nbytes // 4)
        rng = np.random.default_rng(rank)
        x = rng.integers(-8, 8, count).astype(np.float32)  # exact sums: any order agrees
        ref = np.empty_like(x)
        mpi.Allreduce(x, ref, MPI.SUM)
        iters = max(5, min(200, int(2e7 // max(nbytes, 1))))  # ~20 ms a trial: 3 calls were too noisy
        out = np.empty_like(x)
        fns = {"MPI.Allreduce": lambda: mpi.Allreduce(x, out, MPI.SUM)}
        for v in variants:
            fns[v] = (lambda v=v: comm.allreduce(x, out, op="sum", algorithm=v))
        best = {k: float("inf") for k in fns}
        for _ in range(args.trials):
            for k, fn in fns.items():  # interleaved: same noise for every variant
                fn()
                if k != "MPI.Allreduce":
                    assert np.array_equal(out, ref), f"{k} wrong at {nbytes} B"
                mpi.Barrier()
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                dt = (time.perf_counter() - t) / iters
                dt = mpi.allreduce(dt, op=MPI.MAX)
                best[k] = min(best[k], dt)
        row = {"bytes": count * 4, "iters": iters}
        for k, dt in best.items():
            algbw = count * 4 / dt / 1e9
            row[k] = {"time_us": dt * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor}
        for v in variants:
            row[v]["ratio_vs_mpi"] = row[v]["busbw_GBps"] / row["MPI.Allreduce"]["busbw_GBps"]
        rows.append(row)
        if rank == 0:
            cells = "  ".join(f"{v}: {row[v]['busbw_GBps']:7.3f} ({row[v]['ratio_vs_mpi']:.2f}x)" for v in variants)
            print(f"{count * 4:>10d} B  MPI {row['MPI.Allreduce']['busbw_GBps']:7.3f} GB/s  {cells}", flush=True)
        nbytes *= 4 if nbytes < (1 << 20) else 2
    if rank == 0:
        load_end = os.getloadavg()
        print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}", flush=True)
        big = [r for r in rows if r["bytes"] >= (1 << 20)]
        summary = {v: {"min_ratio_ge_1MiB": min((r[v]["ratio_vs_mpi"] for r in big), default=None),
                       "median_ratio_ge_1MiB": float(np.median([r[v]["ratio_vs_mpi"] for r in big])) if big else None}
                   for v in variants}
        print("ratios at >= 1 MiB (commlib busbw / MPI busbw):", summary)
        write_json(args.json, {"benchmark": "allreduce", "ranks": n, "mpi": MPI.Get_library_version().split("\n")[0].strip("\x00 "),
                               "fault_tolerant": comm.fault_tolerant, "check_args": not args.no_check_args,
                               "loadavg_start": load_start, "loadavg_end": load_end, "cpus": os.cpu_count(),
                               "busbw_factor": factor, "rows": rows, "summary": summary})
        if args.plot:
            plot(rows, ["MPI.Allreduce"] + variants, n, args.plot)


def plot(rows, keys, n, path):
    """busbw (GB/s) and commlib/MPI busbw ratio against message size (bytes)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    x = [r["bytes"] for r in rows]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for i, k in enumerate(keys):  # one colour per variant in both panels
        a1.plot(x, [r[k]["busbw_GBps"] for r in rows], "o-" if k == "MPI.Allreduce" else ".-", label=k, ms=3,
                color=f"C{i}")
        if k != "MPI.Allreduce":
            a2.plot(x, [r[k]["ratio_vs_mpi"] for r in rows], ".-", label=k, ms=3, color=f"C{i}")
    a2.axhline(1.0, color="grey", ls=":", label="target 1.0x (ring, >= 1 MiB)")
    a2.hlines(0.2, 8, 1024, color="black", ls="--", lw=0.8, label="target 0.2x (8 B-1 KiB, within 5x latency)")
    a2.axvline(1 << 20, color="grey", ls="--", lw=0.8)
    a1.set(xscale="log", yscale="log", ylabel="busbw (GB/s)", title=f"allreduce float32 sum, {n} ranks")
    a2.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw / MPI busbw")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
