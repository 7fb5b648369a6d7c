"""Heat solver throughput per backend against a bandwidth roofline measured on
the solver's own working set.

FTCS reads one value of ``u`` and writes one of ``un`` per lattice update when
the stencil's neighbours hit in the nearer caches: 16 bytes per update, the
traffic of a STREAM copy.  So the roofline is ``copy_bandwidth / 16`` updates
per second per rank, and the copy must run over the same working set as the
solver: here every rank copies between two float64 arrays of its padded block
shape (the two fields ``u`` and ``un``, ghost cells included), back and forth
as the solver swaps them, all ranks at once (they share the memory system).
Which level of the memory hierarchy that measures depends on the working set:
when every rank's two fields together fit in the last-level cache (read from
``/sys``), the roofline is *cache* bandwidth and is labelled so; otherwise it
is DRAM bandwidth.  A copy of 64 MiB arrays (DRAM on any current CPU) is
printed beside it for reference.  The roofline is the best of two measurements,
before and after the solver runs (it is a limit: noise only lowers it), and the
minimum over ranks; the ratio printed is the solver's MLUPS per rank over it.

    mpiexec -n 2 python benchmarks/bench_heat.py --grid 96 --steps 100 --json heat_bench.json
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, best_of, int_in, writable_file, write_json  # noqa: E402

import commlib  # noqa: E402
from commlib.apps import heat  # noqa: E402

BYTES_PER_UPDATE = 16  # read u, write un


def copy_bandwidth(comm, shape, min_bytes=512 << 20, repeat=5):
    """Bytes per second one rank moves copying between two float64 arrays of
    ``shape`` (a -> b, b -> a, ...; 2 x nbytes per copy) while every rank does
    the same; repeated so one trial moves at least ``min_bytes``."""
    a = np.ones(shape)
    b = np.zeros_like(a)  # touched: no first-touch page faults in the timing
    moved = 2 * a.nbytes
    pairs = max(1, -(-min_bytes // (2 * moved)))

    def run():
        for _ in range(pairs):
            np.copyto(b, a)
            np.copyto(a, b)

    run()  # warm the caches / TLB as the solver's warm-up does
    t = best_of(run, repeat=repeat, barrier=comm.barrier)
    return 2 * pairs * moved / t


def last_level_cache_bytes():
    """Size of the largest unified/data CPU cache from ``/sys`` (None if unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        for entry in os.listdir(base):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(base, entry, "type"), encoding="ascii") as fh:
                if fh.read().strip() == "Instruction":
                    continue
            with open(os.path.join(base, entry, "size"), encoding="ascii") as fh:
                s = fh.read().strip()
            n = int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]] if s[-1] in "KMG" else int(s)
            best = n if best is None else max(best, n)
    except (OSError, ValueError, KeyError):
        return None
    return best


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, default=3, choices=(2, 3), help="2-D or 3-D grid (default 3)")
    p.add_argument("--grid", type=int_in(1, 1 << 16, "points"), default=96,
                   help="interior points per dimension (default 96)")
    p.add_argument("--steps", type=int_in(1, 10 ** 7, "steps"), default=100, help="time steps timed (default 100)")
    p.add_argument("--backends", nargs="+", default=["numpy", "numba"], choices=heat.BACKENDS,
                   help="backends timed, each after a 2-step warm-up (default: numpy numba)")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    comm = commlib.init()
    grid = [args.grid] * args.dims

    # this rank's block (owned cells) -> the padded shape of u and un
    _, local = heat.solve(comm, grid, steps=1, backend="numpy")
    padded = tuple(n + 2 for n in local.shape)
    ws = 2 * int(np.prod(padded)) * 8  # bytes of u + un on this rank
    host = np.array([zlib.crc32(socket.gethostname().encode())], dtype=np.int64)
    hosts = comm.allgather(host).reshape(-1)
    wss = comm.allgather(np.array([ws], dtype=np.int64)).reshape(-1)
    node_ws = int(wss[hosts == host[0]].sum())  # the working set of every rank on this node
    llc = last_level_cache_bytes()
    in_cache = llc is not None and node_ws <= llc
    level = ("last-level cache" if in_cache else "DRAM") if llc is not None else "unknown level"

    bw_before = copy_bandwidth(comm, padded)
    rows = []
    for backend in args.backends:
        heat.solve(comm, grid, steps=2, backend=backend)  # warm-up (JIT, caches)
        res, _ = heat.solve(comm, grid, steps=args.steps, backend=backend)
        rows.append({"backend": backend, "mlups": res.mlups, "mlups_per_rank": res.mlups / comm.size,
                     "comm_fraction": res.comm_fraction})
    bw_after = copy_bandwidth(comm, padded)
    bw = float(comm.allreduce(np.array([max(bw_before, bw_after)]), op="min")[0])
    dram = float(comm.allreduce(np.array([copy_bandwidth(comm, (64 << 20) // 8)]), op="min")[0])
    roof = bw / BYTES_PER_UPDATE / 1e6  # MLUPS per rank
    for r in rows:
        r["roofline_mlups_per_rank"] = roof
        r["fraction_of_roofline"] = r["mlups_per_rank"] / roof
    if comm.rank == 0:
        mib = 1 << 20
        print(f"# heat {args.dims}-D grid {args.grid}^{args.dims}, {comm.size} ranks, {args.steps} steps")
        print(f"# working set: u + un {'x'.join(map(str, padded))} float64 = {ws / mib:.1f} MiB on rank 0, "
              f"{node_ws / mib:.1f} MiB on its node; last-level cache "
              f"{f'{llc / mib:.0f} MiB' if llc else 'unknown'} -> {level}")
        print(f"# roofline: {level} copy bandwidth at that working set, all ranks copying: {bw / 1e9:.2f} GB/s "
              f"per rank -> {roof:.1f} MLUPS/rank ({BYTES_PER_UPDATE} B per update)")
        print(f"# (reference: DRAM copy of 64 MiB arrays, all ranks copying: {dram / 1e9:.2f} GB/s per rank -> "
              f"{dram / BYTES_PER_UPDATE / 1e6:.1f} MLUPS/rank)")
        print(f"{'backend':<8} {'MLUPS':>9} {'per rank':>9} {'roofline':>9} {'ratio':>7} {'comm':>6}")
        for r in rows:
            print(f"{r['backend']:<8} {r['mlups']:9.1f} {r['mlups_per_rank']:9.1f} {r['roofline_mlups_per_rank']:9.1f} "
                  f"{r['fraction_of_roofline']:7.2f} {r['comm_fraction']:6.1%}")
        write_json(args.json, {"ranks": comm.size, "grid": grid, "steps": args.steps,
                               "working_set_bytes_per_rank": ws, "working_set_bytes_per_node": node_ws,
                               "last_level_cache_bytes": llc, "roofline_level": level,
                               "copy_bandwidth_Bps": bw, "dram_copy_bandwidth_Bps": dram, "rows": rows})


if __name__ == "__main__":
    main()
