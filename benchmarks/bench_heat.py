"""Heat solver throughput per backend against the memory-bandwidth roofline.

Every rank first measures its copy bandwidth while all ranks copy at once
(STREAM-style ``numpy.copyto`` of a 64 MiB float64 array: 16 bytes moved per
element), then each backend runs the solver.  FTCS reads one value and writes
one per update when neighbours hit in cache: 16 bytes per lattice update, so
the roofline is ``copy_bandwidth / 16`` updates per second per rank.  The
ratio printed is the solver's MLUPS per rank over that roofline.

    mpiexec -n 4 python benchmarks/bench_heat.py --grid 96 --steps 100 --json heat_bench.json
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import best_of, write_json  # noqa: E402

import commlib  # noqa: E402
from commlib.apps import heat  # noqa: E402


def copy_bandwidth(comm, nbytes=64 << 20):
    """Bytes per second one rank copies while every rank copies (STREAM copy, 2 x nbytes moved)."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    t = best_of(lambda: np.copyto(b, a), repeat=5, barrier=comm.barrier)
    return 2 * a.nbytes / t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, default=3, choices=(2, 3))
    p.add_argument("--grid", type=int, default=96, help="interior points per dimension (default 96)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--backends", nargs="+", default=["numpy", "numba"], choices=heat.BACKENDS)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    comm = commlib.init()
    bw = comm.mpi_comm.allreduce(copy_bandwidth(comm), op=MPI.MIN)
    roof = bw / 16 / 1e6  # MLUPS per rank
    rows = []
    grid = [args.grid] * args.dims
    for backend in args.backends:
        heat.solve(comm, grid, steps=2, backend=backend)  # warm-up (JIT, caches)
        res, _ = heat.solve(comm, grid, steps=args.steps, backend=backend)
        per_rank = res.mlups / comm.size
        rows.append({"backend": backend, "mlups": res.mlups, "mlups_per_rank": per_rank,
                     "roofline_mlups_per_rank": roof, "fraction_of_roofline": per_rank / roof,
                     "comm_fraction": res.comm_fraction})
    if comm.rank == 0:
        print(f"# heat {args.dims}-D grid {args.grid}^{args.dims}, {comm.size} ranks, {args.steps} steps")
        print(f"# copy bandwidth per rank (all copying): {bw / 1e9:.2f} GB/s -> roofline {roof:.1f} MLUPS/rank "
              "(16 B per update)")
        print(f"{'backend':<8} {'MLUPS':>9} {'per rank':>9} {'roofline':>9} {'ratio':>7} {'comm':>6}")
        for r in rows:
            print(f"{r['backend']:<8} {r['mlups']:9.1f} {r['mlups_per_rank']:9.1f} {r['roofline_mlups_per_rank']:9.1f} "
                  f"{r['fraction_of_roofline']:7.2f} {r['comm_fraction']:6.1%}")
        write_json(args.json, {"ranks": comm.size, "grid": grid, "steps": args.steps,
                               "copy_bandwidth_Bps": bw, "rows": rows})


if __name__ == "__main__":
    main()
