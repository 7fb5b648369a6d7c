"""Host pack/unpack bandwidth: commlib against MPI_Pack/MPI_Unpack and memcpy.

For every (contiguous block length, number of strided dimensions) the benchmark
builds a subarray type whose canonical form is a strided block with contiguous
runs of ``block`` bytes and ``dims`` strided dimensions above them (``dims=1``
is a vector, ``dims=4`` a 4-D box of blocks), packing about ``--total`` bytes.
Measured side by side in one run, interleaved and best-of-``--repeat``:

* ``commlib``: :func:`commlib.datatypes.pack` into a preallocated ``out`` (and
  :func:`~commlib.datatypes.unpack` back);
* ``mpi``: ``MPI.Datatype.Pack`` / ``Unpack`` with the same MPI datatype
  (``type.to_mpi()``) and buffers;
* ``memcpy``: ``numpy.copyto`` of the same number of contiguous bytes.

Every shape is checked: commlib's packed bytes must equal MPI's, and unpacking
them must restore the buffer.  Printed: bandwidth (GB/s of packed bytes) and
the ratios ``mpi_time / commlib_time`` (> 1: commlib faster) and
``memcpy_time / commlib_time`` (the fraction of memcpy speed), with geometric
means and the targets of issues 2 and 3 (pack >= 1.0x MPI over all shapes,
>= 0.8x MPI for blocks >= 64 B, >= 0.7x memcpy for blocks >= 256 B).

Timings on shared 2-core machines are noisy: compare ratios from one run, not
absolute times across runs.

    python benchmarks/bench_pack.py --json pack.json --plot pack.png
    python benchmarks/bench_pack.py --quick
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, float_in, int_in, writable_file  # noqa: E402
from mpi4py import MPI  # noqa: E402

from commlib import datatypes as dts  # noqa: E402

BLOCKS = [2**k for k in range(17)]  # 1 B .. 64 KiB
DIMS = [1, 2, 3, 4]
_ELEM = {8: np.float64, 4: np.float32, 2: np.int16, 1: np.uint8}


def make_type(block: int, dims: int, total: int):
    """A subarray of a (dims+1)-D array: runs of ``block`` bytes, ``dims`` strided
    dimensions, about ``total`` packed bytes.  Returns ``(type, array)``."""
    w = next(w for w in (8, 4, 2, 1) if block % w == 0)
    nblocks = max(1, total // block)
    per = max(2, round(nblocks ** (1.0 / dims)))
    outer = [per] * (dims - 1)
    outer.append(max(2, nblocks // (per ** (dims - 1))))
    inner = block // w
    # one spare row/plane in every outer dimension, blocks every 2*block bytes
    sizes = [n + 1 for n in outer] + [2 * inner]
    subsizes = outer + [inner]
    starts = [1] * dims + [0]
    t = dts.Subarray(sizes, subsizes, starts, _ELEM[w])
    rng = np.random.default_rng(block * 10 + dims)
    arr = rng.integers(0, 255, size=int(np.prod(sizes)) * w, dtype=np.uint8).view(_ELEM[w]).reshape(sizes)
    return t, arr


def _time(fn, number):
    t = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t) / number


def measure(block, dims, total, repeat, min_time):
    t, arr = make_type(block, dims, total)
    m = t.to_mpi()
    nb = t.size
    out = np.empty(nb, np.uint8)
    mout = np.empty(nb, np.uint8)
    src = np.ascontiguousarray(arr.reshape(-1).view(np.uint8)[:nb]).copy()
    cdst = np.empty(nb, np.uint8)
    back = np.zeros_like(arr)
    mback = np.zeros_like(arr)
    # correctness, and warm-up (compiles the kernels)
    got = dts.pack(arr, t, 1, out)
    m.Pack(arr, mout, 0, MPI.COMM_SELF)
    if not np.array_equal(got, mout):
        raise AssertionError(f"packed bytes differ from MPI_Pack for {t!r}")
    dts.unpack(out, t, back)
    m.Unpack(mout, 0, mback, MPI.COMM_SELF)
    if not np.array_equal(back.view(np.uint8), mback.view(np.uint8)):  # bytes: random bits hold NaNs
        raise AssertionError(f"unpacked buffer differs from MPI_Unpack for {t!r}")

    fns = {
        "pack_commlib": lambda: dts.pack(arr, t, 1, out),
        "pack_mpi": lambda: m.Pack(arr, mout, 0, MPI.COMM_SELF),
        "memcpy": lambda: np.copyto(cdst, src),
        "unpack_commlib": lambda: dts.unpack(out, t, back),
        "unpack_mpi": lambda: m.Unpack(mout, 0, mback, MPI.COMM_SELF),
    }
    once = _time(fns["pack_mpi"], 3)
    number = max(1, int(min_time / max(once, 1e-7)))
    best = {k: math.inf for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():  # interleaved: noise hits every method alike
            best[k] = min(best[k], _time(fn, number))
    m.Free()
    rec = {
        "block": block,
        "dims": dims,
        "bytes": nb,
        "seconds": best,
        "gbps": {k: nb / v / 1e9 for k, v in best.items()},
        "pack_vs_mpi": best["pack_mpi"] / best["pack_commlib"],
        "pack_vs_memcpy": best["memcpy"] / best["pack_commlib"],
        "unpack_vs_mpi": best["unpack_mpi"] / best["unpack_commlib"],
        "unpack_vs_memcpy": best["memcpy"] / best["unpack_commlib"],
        "canonical": repr(t.canonical()),
    }
    return rec


def geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summarize(rows):
    def sel(key, pred=lambda r: True):
        return [r[key] for r in rows if pred(r)]

    s = {}
    for op in ("pack", "unpack"):
        s[f"{op}_vs_mpi_geomean"] = geomean(sel(f"{op}_vs_mpi"))
        s[f"{op}_vs_mpi_geomean_ge64B"] = geomean(sel(f"{op}_vs_mpi", lambda r: r["block"] >= 64))
        s[f"{op}_vs_mpi_min_ge64B"] = min(sel(f"{op}_vs_mpi", lambda r: r["block"] >= 64), default=float("nan"))
        s[f"{op}_vs_memcpy_geomean_ge256B"] = geomean(sel(f"{op}_vs_memcpy", lambda r: r["block"] >= 256))
        s[f"{op}_vs_memcpy_min_ge256B"] = min(sel(f"{op}_vs_memcpy", lambda r: r["block"] >= 256),
                                               default=float("nan"))
    s["targets"] = {
        "pack >= 1.0x MPI (geomean, all shapes)": s["pack_vs_mpi_geomean"] >= 1.0,
        "pack >= 0.8x MPI (geomean, blocks >= 64 B)": s["pack_vs_mpi_geomean_ge64B"] >= 0.8,
        "pack >= 0.7x memcpy (geomean, blocks >= 256 B)": s["pack_vs_memcpy_geomean_ge256B"] >= 0.7,
    }
    return s


def plot(rows, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    dims = sorted({r["dims"] for r in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(4 * len(dims), 7), squeeze=False, sharey="row")
    for j, d in enumerate(dims):
        rs = sorted((r for r in rows if r["dims"] == d), key=lambda r: r["block"])
        x = [r["block"] for r in rs]
        ax = axes[0][j]
        for key, style in (("pack_commlib", "o-"), ("pack_mpi", "s--"), ("unpack_commlib", "^-"),
                           ("unpack_mpi", "v--"), ("memcpy", "k:")):
            ax.plot(x, [r["gbps"][key] for r in rs], style, label=key, ms=3)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{d} strided dim{'s' if d > 1 else ''}")
        ax.set_xlabel("block (bytes)")
        if j == 0:
            ax.set_ylabel("GB/s (packed bytes)")
            ax.legend(fontsize=7)
        ax = axes[1][j]
        ax.plot(x, [r["pack_vs_mpi"] for r in rs], "o-", label="pack: MPI time / commlib time", ms=3)
        ax.plot(x, [r["unpack_vs_mpi"] for r in rs], "^-", label="unpack: MPI / commlib", ms=3)
        ax.plot(x, [r["pack_vs_memcpy"] for r in rs], "s:", label="pack: memcpy / commlib", ms=3)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block (bytes)")
        if j == 0:
            ax.set_ylabel("ratio (>1: commlib faster)")
            ax.legend(fontsize=7)
    fig.suptitle("commlib host pack/unpack vs MPI_Pack and memcpy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = OneLineParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--total", type=int_in(1, 1 << 30, "bytes"), default=1 << 20,
                    help="packed bytes per shape, 1..2^30 (default 1 MiB)")
    ap.add_argument("--blocks", type=int_in(1, 1 << 24, "bytes"), nargs="+", default=BLOCKS,
                    help="contiguous block lengths in bytes, each 1..2^24 (default 1, 2, 4, ..., 65536)")
    ap.add_argument("--dims", type=int_in(1, 6, "dimensions"), nargs="+", default=DIMS,
                    help="numbers of strided dimensions, each 1..6 (default 1 2 3 4)")
    ap.add_argument("--repeat", type=int_in(1, 10000, "trials"), default=15,
                    help="interleaved trials per shape, best kept (default 15)")
    ap.add_argument("--min-time", type=float_in(0, 60, "seconds"), default=2e-3,
                    help="seconds per timed trial, sets the loop count, > 0 and <= 60 (default 0.002)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: blocks 1 8 64 256 4096 65536, 3 trials, 1 ms (overrides those options)")
    ap.add_argument("--json", metavar="PATH", type=writable_file,
                    help="write every measurement and the summary as JSON")
    ap.add_argument("--plot", metavar="PATH", type=writable_file,
                    help="write a PNG of bandwidth and ratios (matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks = [1, 8, 64, 256, 4096, 65536]
        args.repeat = 3
        args.min_time = 1e-3
    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(total=len(args.dims) * len(args.blocks), desc="shapes", unit="shape", file=sys.stderr,
               disable=True if args.no_progress else None, leave=False)

    rows = []
    print(f"{'block':>6} {'dims':>4} {'bytes':>8} | {'commlib':>8} {'mpi':>8} {'memcpy':>8} GB/s pack | "
          f"{'x mpi':>6} {'x memcpy':>8} | {'unpack x mpi':>12} {'x memcpy':>8}")
    for d in args.dims:
        for b in args.blocks:
            r = measure(b, d, args.total, args.repeat, args.min_time)
            bar.update()
            rows.append(r)
            g = r["gbps"]
            print(f"{b:>6} {d:>4} {r['bytes']:>8} | {g['pack_commlib']:8.2f} {g['pack_mpi']:8.2f} "
                  f"{g['memcpy']:8.2f}           | {r['pack_vs_mpi']:6.2f} {r['pack_vs_memcpy']:8.2f} | "
                  f"{r['unpack_vs_mpi']:12.2f} {r['unpack_vs_memcpy']:8.2f}", flush=True)
    bar.close()
    s = summarize(rows)
    print()
    for k, v in s.items():
        if k != "targets":
            print(f"{k:34s} {v:6.2f}")
    for k, ok in s["targets"].items():
        print(f"target {k:50s} {'met' if ok else 'MISSED'}")
    if args.json:
        import commlib  # noqa: PLC0415

        rec = {
            "benchmark": "bench_pack",
            "commlib": commlib.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0],
            "numpy": np.__version__,
            "total": args.total,
            "repeat": args.repeat,
            "rows": rows,
            "summary": s,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rec, fh, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
