"""Ping-pong of non-contiguous data: commlib's typed sends against mpi4py with
the MPI datatype, and how often the strategy model picks the fastest strategy.

For each (message size, contiguous block length) a vector type is sent from
rank 0 to rank 1 and back.  Measured in the same run: mpi4py handing the MPI
datatype to MPI (the baseline), commlib with each host strategy forced
("mpi", "pack"), and commlib letting the model choose ("auto": ``comm.send``/``comm.recv``
(datatype=), the calls a user writes).  Printed:
one-way latency, the ratio baseline/auto (>1: commlib faster), and whether the
model's pick was the measured fastest strategy (within 5%: ties count).

    mpiexec -n 2 python benchmarks/bench_typed_pingpong.py --json pingpong.json --plot pingpong.png
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, geomean, int_in, writable_file, write_json  # noqa: E402

import commlib  # noqa: E402
from commlib import datatypes as dts  # noqa: E402
from commlib.datatypes.strategy import default_model  # noqa: E402
from commlib.typed_p2p import typed_recv, typed_send  # noqa: E402


def pingpong(comm, fn_send, fn_recv, repeat):
    best = np.inf
    for _ in range(repeat):
        comm.barrier()
        t = time.perf_counter()
        if comm.rank == 0:
            fn_send(1)
            fn_recv(1)
        elif comm.rank == 1:
            fn_recv(0)
            fn_send(0)
        best = min(best, (time.perf_counter() - t) / 2)
    return comm.mpi_comm.bcast(best, root=0)


def _block(text):
    """argparse type: a block length in bytes, a multiple of 8 (whole float64s)."""
    v = int_in(8, 1 << 26, "bytes")(text)
    if v % 8:
        raise argparse.ArgumentTypeError(f"must be a multiple of 8 bytes (whole float64 elements), got {v}")
    return v


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int_in(8, 1 << 28, "bytes"), nargs="+",
                   default=[256, 4096, 65536, 1 << 20, 4 << 20],
                   help="message sizes in bytes (packed data per message), each 8..2^28 "
                        "(default 256 4096 65536 1048576 4194304)")
    p.add_argument("--blocks", type=_block, nargs="+", default=[8, 64, 512, 4096],
                   help="contiguous block lengths in bytes, multiples of 8; pairs with a block larger than the "
                        "size are skipped (default 8 64 512 4096)")
    p.add_argument("--repeat", type=int_in(1, 100000, "round trips"), default=30,
                   help="round trips per measurement, best kept (default 30)")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="write every measurement as JSON (rank 0)")
    p.add_argument("--plot", metavar="PATH", type=writable_file, help="PNG: latency vs size per block length")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (rank 0)")
    args = p.parse_args(argv)
    pairs = [(nb, bl) for nb in args.sizes for bl in args.blocks if bl <= nb]
    if not pairs:
        p.error(f"every block ({min(args.blocks)} B or more) is larger than every size "
                f"({max(args.sizes)} B or less): nothing to measure")
    comm = commlib.init()
    if comm.size < 2:
        p.error("needs 2 ranks: run with mpiexec -n 2")
    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(total=len(pairs), desc="ping-pong", unit="shape", file=sys.stderr, leave=False,
               disable=True if (args.no_progress or comm.rank != 0) else None)
    model = default_model()
    rows = []
    for nb, bl in pairs:
        t = dts.Vector(nb // bl, bl // 8, 2 * bl // 8, np.float64)
        buf = np.zeros(t.extent // 8 + 1)
        mt = t.to_mpi()

        def m_send(peer):
            comm.mpi_comm.Send([buf, 1, mt], peer, 0)

        def m_recv(peer):
            comm.mpi_comm.Recv([buf, 1, mt], peer, 0)

        times = {"mpi4py": pingpong(comm, m_send, m_recv, args.repeat)}
        for strat in ("mpi", "pack", None):
            if strat is None:  # what a user writes: the public calls, the model choosing
                def c_send(peer):
                    comm.send(buf, peer, 0, datatype=t)

                def c_recv(peer):
                    comm.recv(buf, peer, 0, datatype=t)
            else:
                def c_send(peer, s=strat):
                    typed_send(comm, buf, peer, t, 1, 0, strategy=s)

                def c_recv(peer, s=strat):
                    typed_recv(comm, buf, peer, t, 1, 0, strategy=s)

            times[strat or "auto"] = pingpong(comm, c_send, c_recv, args.repeat)
        mt.Free()
        pick = model.choose(t, 1, device=False)
        fastest = min(("mpi", "pack"), key=lambda s: times[s])
        rows.append({"bytes": nb, "block": bl, "seconds": times, "model_pick": pick, "fastest": fastest,
                     "pick_ok": times[pick] <= 1.05 * times[fastest],
                     "speedup_vs_mpi4py": times["mpi4py"] / times["auto"]})
        bar.update()
    bar.close()
    if comm.rank == 0:
        print(f"# non-contiguous ping-pong, one-way us; model: {model.source}")
        print(f"{'bytes':>9} {'block':>6} {'mpi4py':>9} {'c:mpi':>9} {'c:pack':>9} {'c:auto':>9} {'speedup':>8} pick ok")
        for r in rows:
            s = r["seconds"]
            print(f"{r['bytes']:9d} {r['block']:6d} {s['mpi4py'] * 1e6:9.1f} {s['mpi'] * 1e6:9.1f} {s['pack'] * 1e6:9.1f} "
                  f"{s['auto'] * 1e6:9.1f} {r['speedup_vs_mpi4py']:8.2f} {r['model_pick']:<5} {'yes' if r['pick_ok'] else 'NO'}")
        acc = sum(r["pick_ok"] for r in rows) / len(rows)
        print(f"geometric mean speedup (auto vs mpi4py): {geomean([r['speedup_vs_mpi4py'] for r in rows]):.2f}")
        print(f"model picked the fastest host strategy in {acc:.0%} of {len(rows)} cases")
        write_json(args.json, {"rows": rows, "model_accuracy": acc, "model": model.source})
        if args.plot:
            import matplotlib  # noqa: PLC0415

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415

            fig, ax = plt.subplots(figsize=(7, 4.5))
            for bl in args.blocks:
                rs = [r for r in rows if r["block"] == bl]
                if not rs:
                    continue
                x = [r["bytes"] for r in rs]
                ln, = ax.loglog(x, [r["seconds"]["auto"] * 1e6 for r in rs], "o-", label=f"commlib, block {bl} B")
                ax.loglog(x, [r["seconds"]["mpi4py"] * 1e6 for r in rs], "x--", color=ln.get_color(),
                          label=f"mpi4py+MPI type, block {bl} B")
            ax.set_xlabel("message bytes")
            ax.set_ylabel("one-way latency (us)")
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
