"""Halo exchange: commlib's HaloExchange against the plain mpi4py way.

The baseline is what a user writes by hand: per dimension, two ``Sendrecv``
of ``numpy.ascontiguousarray`` face slices, then copies into the ghost
cells.  Both fill the same face ghosts (``corners=False``) of the same
fields on the same Cartesian grid; both results are checked equal on every
run.  Printed: time per exchange and the ratio baseline/commlib (>1 means
commlib is faster).

    mpiexec -n 4 python benchmarks/bench_halo.py --json halo_bench.json
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, best_of, geomean, int_in, shape_arg, writable_file, write_json  # noqa: E402

import commlib  # noqa: E402
from commlib.collectives import HaloExchange  # noqa: E402


def plain_exchange(cart_mpi, f, w):
    """The mpi4py way: per dimension, Sendrecv of contiguous copies of the faces."""
    d = f.ndim
    inner = [slice(w, s - w) for s in f.shape]
    for i in range(d):
        lo_src, hi_dst = cart_mpi.Shift(i, 1)
        # send my high face to hi neighbour, receive my low ghost from lo neighbour
        for send_sl, recv_sl, dest, src in (
            (slice(f.shape[i] - 2 * w, f.shape[i] - w), slice(0, w), hi_dst, lo_src),
            (slice(w, 2 * w), slice(f.shape[i] - w, f.shape[i]), lo_src, hi_dst),
        ):
            s = list(inner)
            s[i] = send_sl
            r = list(inner)
            r[i] = recv_sl
            sendbuf = np.ascontiguousarray(f[tuple(s)])
            recvbuf = np.empty_like(sendbuf)
            cart_mpi.Sendrecv(sendbuf, dest, 10 + i, recvbuf, src, 10 + i)
            if src != MPI.PROC_NULL:
                f[tuple(r)] = recvbuf


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=shape_arg(3), default=["256x256", "1024x1024", "32x32x32", "96x96x96"],
                   help="local block shapes, NxM or NxMxK points per rank "
                        "(default: 256x256 1024x1024 32x32x32 96x96x96)")
    p.add_argument("--width", type=int_in(1, 64, "ghost cells"), default=1,
                   help="ghost cells per side (the halo width; at most the smallest block size; default 1)")
    p.add_argument("--fields", type=int_in(1, 64, "fields"), default=1,
                   help="fields exchanged together per call (default 1)")
    p.add_argument("--repeat", type=int_in(1, 100000, "trials"), default=20,
                   help="timed trials of 5 exchanges each, the best kept (default 20)")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    args.sizes = [shape_arg(3)(s) if isinstance(s, str) else s for s in args.sizes]
    small = [s for s in args.sizes if min(s) < args.width]
    if small:
        p.error(f"--width {args.width} is wider than the block {'x'.join(map(str, small[0]))}")
    comm = commlib.init()
    rows = []
    for spec in args.sizes:
        local = spec
        d = len(local)
        cart = comm.cart_create(dims=[0] * d, periods=[True] * d)
        halo = HaloExchange(cart, local, width=args.width, corners=False)
        rng = np.random.default_rng(cart.rank)
        fields = [rng.random(halo.shape) for _ in range(args.fields)]
        ref = [f.copy() for f in fields]
        halo.exchange(*fields)
        for f in ref:
            plain_exchange(cart.mpi_comm, f, args.width)
        ok = all(np.array_equal(a, b) for a, b in zip(fields, ref))

        def ours():
            halo.exchange(*fields)

        def plain():
            for f in ref:
                plain_exchange(cart.mpi_comm, f, args.width)

        t_ours = comm.mpi_comm.allreduce(best_of(ours, repeat=args.repeat, number=5, barrier=comm.barrier), MPI.MAX)
        t_plain = comm.mpi_comm.allreduce(best_of(plain, repeat=args.repeat, number=5, barrier=comm.barrier), MPI.MAX)
        ok = comm.mpi_comm.allreduce(ok, MPI.LAND)
        rows.append({"local_shape": list(local), "dims": list(cart.dims), "commlib_s": t_ours, "mpi4py_s": t_plain,
                     "speedup": t_plain / t_ours, "results_equal": ok})
        halo.free()
        cart.free()
    if comm.rank == 0:
        print(f"# halo exchange, {comm.size} ranks, width {args.width}, {args.fields} field(s), faces only, periodic")
        print(f"{'local block':<14} {'dims':<8} {'commlib us':>11} {'mpi4py us':>10} {'speedup':>8} check")
        for r in rows:
            print(f"{'x'.join(map(str, r['local_shape'])):<14} {'x'.join(map(str, r['dims'])):<8} "
                  f"{r['commlib_s'] * 1e6:11.1f} {r['mpi4py_s'] * 1e6:10.1f} {r['speedup']:8.2f} "
                  f"{'equal' if r['results_equal'] else 'DIFFER'}")
        print(f"geometric mean speedup: {geomean([r['speedup'] for r in rows]):.2f}")
        write_json(args.json, {"ranks": comm.size, "width": args.width, "fields": args.fields, "rows": rows})


if __name__ == "__main__":
    main()
