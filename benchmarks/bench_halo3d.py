"""TEMPI-style 3-D halo exchange: 26 neighbours, radius 3, several fields.

commlib's HaloExchange (faces, edges and corners packed by commlib's kernels,
all messages in flight at once) against the same exchange done with mpi4py
and MPI subarray datatypes (one Isend/Irecv per neighbour per field, MPI's
datatype engine packing).  Both fill the same ghost cells; the results are
compared on every run.  Printed: time per exchange, ratio mpi4py/commlib.

    mpiexec -n 4 python benchmarks/bench_halo3d.py --json halo3d.json --plot halo3d.png
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, best_of, geomean, int_in, writable_file, write_json  # noqa: E402

import commlib  # noqa: E402
from commlib.collectives import HaloExchange  # noqa: E402


class MPIHalo:
    """The same 26-neighbour exchange with MPI subarray types (the baseline)."""

    def __init__(self, cart, local, r, dtype=MPI.DOUBLE):
        self.cart = cart.mpi_comm
        shape = [n + 2 * r for n in local]
        self.msgs = []
        for off in itertools.product((-1, 0, 1), repeat=3):
            if not any(off):
                continue
            peer = cart.neighbor(off)
            if peer == MPI.PROC_NULL:
                continue
            sub, s0, r0 = [], [], []
            for o, n in zip(off, local):
                if o == 0:
                    sub.append(n); s0.append(r); r0.append(r)
                elif o < 0:
                    sub.append(r); s0.append(r); r0.append(0)
                else:
                    sub.append(r); s0.append(n); r0.append(n + r)
            st = dtype.Create_subarray(shape, sub, s0).Commit()
            rt = dtype.Create_subarray(shape, sub, r0).Commit()
            tag = sum((o + 1) * 3 ** i for i, o in enumerate(off))
            rtag = sum((-o + 1) * 3 ** i for i, o in enumerate(off))
            self.msgs.append((peer, st, rt, tag, rtag))

    def exchange(self, *fields):
        reqs = []
        for peer, st, rt, tag, rtag in self.msgs:
            for i, f in enumerate(fields):
                reqs.append(self.cart.Irecv([f, 1, rt], peer, rtag * 16 + i))
        for peer, st, rt, tag, rtag in self.msgs:
            for i, f in enumerate(fields):
                reqs.append(self.cart.Isend([f, 1, st], peer, tag * 16 + i))
        MPI.Request.Waitall(reqs)

    def free(self):
        for _, st, rt, _, _ in self.msgs:
            st.Free()
            rt.Free()


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int_in(1, 4096, "cells"), nargs="+", default=[16, 32, 64],
                   help="local cube edges, cells per rank and dimension (default: 16 32 64)")
    p.add_argument("--radius", type=int_in(1, 64, "ghost cells"), default=3,
                   help="halo width, ghost cells per side (at most the smallest edge; default 3)")
    p.add_argument("--fields", type=int_in(1, 16, "fields"), default=4,
                   help="fields exchanged together per call (default 4)")
    p.add_argument("--repeat", type=int_in(1, 100000, "trials"), default=10,
                   help="timed trials, the best kept (default 10)")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="write the rows to this JSON file")
    p.add_argument("--plot", metavar="PATH", type=writable_file, help="PNG: time and speedup against the cube edge")
    args = p.parse_args(argv)
    if min(args.sizes) < args.radius:
        p.error(f"--radius {args.radius} is wider than the cube edge {min(args.sizes)}")
    comm = commlib.init()
    cart = comm.cart_create(dims=[0, 0, 0], periods=[True, True, True])
    rows = []
    for n in args.sizes:
        local = (n, n, n)
        ours = HaloExchange(cart, local, width=args.radius, corners=True)
        base = MPIHalo(cart, local, args.radius)
        rng = np.random.default_rng(cart.rank)
        f1 = [rng.random(ours.shape) for _ in range(args.fields)]
        f2 = [f.copy() for f in f1]
        ours.exchange(*f1)
        base.exchange(*f2)
        ok = comm.mpi_comm.allreduce(all(np.array_equal(a, b) for a, b in zip(f1, f2)), MPI.LAND)
        t_ours = comm.mpi_comm.allreduce(best_of(lambda: ours.exchange(*f1), args.repeat, barrier=comm.barrier), MPI.MAX)
        t_base = comm.mpi_comm.allreduce(best_of(lambda: base.exchange(*f2), args.repeat, barrier=comm.barrier), MPI.MAX)
        halo_bytes = sum(nb.nbytes for nb in ours.neighbours) * args.fields
        rows.append({"local": n, "neighbours": len(ours.neighbours), "halo_bytes": halo_bytes,
                     "commlib_s": t_ours, "mpi4py_subarray_s": t_base, "speedup": t_base / t_ours, "equal": ok})
        ours.free()
        base.free()
    if comm.rank == 0:
        print(f"# 3-D halo, {comm.size} ranks dims {cart.dims}, radius {args.radius}, {args.fields} fields, "
              "26 neighbours (periodic)")
        print(f"{'local':>6} {'msgs':>5} {'halo KiB':>9} {'commlib ms':>11} {'MPI types ms':>13} {'speedup':>8} check")
        for r in rows:
            print(f"{r['local']:6d} {r['neighbours']:5d} {r['halo_bytes'] / 1024:9.1f} {r['commlib_s'] * 1e3:11.3f} "
                  f"{r['mpi4py_subarray_s'] * 1e3:13.3f} {r['speedup']:8.2f} {'equal' if r['equal'] else 'DIFFER'}")
        print(f"geometric mean speedup: {geomean([r['speedup'] for r in rows]):.2f}")
        write_json(args.json, {"ranks": comm.size, "radius": args.radius, "fields": args.fields, "rows": rows})
        if args.plot:
            import matplotlib  # noqa: PLC0415

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415

            fig, ax = plt.subplots(figsize=(6, 4))
            x = [r["local"] for r in rows]
            ax.plot(x, [r["commlib_s"] * 1e3 for r in rows], "o-", label="commlib HaloExchange")
            ax.plot(x, [r["mpi4py_subarray_s"] * 1e3 for r in rows], "s--", label="mpi4py + MPI subarray types")
            ax.set_xlabel("local cube edge (cells)")
            ax.set_ylabel("ms per exchange")
            ax.set_title(f"26-neighbour halo, radius {args.radius}, {args.fields} fields, {comm.size} ranks")
            ax.legend()
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
    cart.free()


if __name__ == "__main__":
    main()
