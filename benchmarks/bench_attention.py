"""Sequence-parallel attention benchmark: ratios measured side by side in one run.

Run under ``mpiexec -n P`` (P = 2 and 4 in the issue)::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_attention.py --seq 8192 --json bench_p2.json

Reports, for causal attention of the same global sequence:

1. **Striped / zigzag vs contiguous ring**: the critical-path block work
   (sum over ring steps of the max over ranks of the score entries computed;
   each step waits for its slowest rank) and the measured time (median over
   ``--iters`` of the slowest rank), as ``contiguous / layout`` ratios.  The
   Striped Attention paper (Brandon et al. 2023) reports 1.45x end to end at
   256k tokens on A100s; the ideal is about 2x for large P.  The plan-only
   critical-path ratios for P = 2, 4, 8 are printed too (no data needed).
2. **Parallel efficiency**: single-rank blocked attention of the whole
   sequence (the same tile kernels, rank 0 alone while the others sleep)
   against the distributed time: ``T1 / (P * TP)``.
3. **Memory**: peak traced bytes per rank (tracemalloc, numpy allocations
   included) for ``seq`` and ``seq / 2``, against the single-rank peak: it
   should scale as ``seq / P``.

BLAS threads are pinned to 1 (before numpy loads) so one rank uses one core
in both the single-rank and the distributed runs.  On these 2-core machines
measured times at P = 4 are oversubscribed: read the work ratios there.

``--backend torch`` runs ``bench_attention_torch.py`` instead (serially, not
under mpiexec: it launches its own jobs): ``commlib.nn`` against torch's
``scaled_dot_product_attention``, see that module.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, int_in, writable_file  # noqa: E402

import commlib  # noqa: E402
from commlib.collectives.attention import (  # noqa: E402
    LAYOUTS,
    attention_backward,
    attention_forward,
    local_seq_len,
    ring_attention,
    ring_attention_backward,
    ring_plan_work,
    ulysses_attention,
)

TIMEOUT = 600.0  # a finite timeout makes waits poll with sleeps, not spin (fair on oversubscribed cores)


def quiet_barrier(comm):
    """Barrier that sleeps instead of spinning, so waiting ranks leave the cores free."""
    req = comm.mpi_comm.Ibarrier()
    while not req.Test():
        time.sleep(5e-4)


def slowest(comm, x):
    buf = np.array([x], dtype=np.float64)
    from mpi4py import MPI  # noqa: PLC0415

    comm.mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return float(buf[0])


def local_inputs(args, L, rank, dtype):
    rng = np.random.default_rng(args.seed + rank)
    mk = lambda h: rng.standard_normal((args.batch, L, h, args.head_dim)).astype(dtype)  # noqa: E731
    return mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)


def peak_memory(comm, args, seq, fn):
    """Peak bytes traced by tracemalloc on this rank during ``fn()`` (inputs included)."""
    quiet_barrier(comm)
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn(args, seq)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", choices=("numpy", "torch"), default="numpy")
    known, _ = pre.parse_known_args(argv)
    if known.backend == "torch":  # commlib.nn against torch SDPA: its own module and options
        import bench_attention_torch  # noqa: PLC0415

        return bench_attention_torch.main(argv)
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--backend", choices=("numpy", "torch"), default="numpy",
                    help="numpy: this benchmark; torch: commlib.nn vs torch SDPA (bench_attention_torch.py, "
                         "its own options: --backend torch --help)")
    ap.add_argument("--seq", type=int_in(1, 1 << 24, "tokens"), default=8192, help="global sequence length")
    ap.add_argument("--batch", type=int_in(1, 4096, "sequences"), default=1, help="batch size")
    ap.add_argument("--heads", type=int_in(1, 1024, "heads"), default=8, help="query heads")
    ap.add_argument("--kv-heads", type=int_in(1, 1024, "heads"), default=8,
                    help="key/value heads (grouped-query attention when fewer; must divide --heads)")
    ap.add_argument("--head-dim", type=int_in(1, 4096, "features"), default=64, help="features per head")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--tile", type=int_in(1, 1 << 20, "rows"), default=128, help="query rows per tile")
    ap.add_argument("--iters", type=int_in(1, 100000, "iterations"), default=3, help="timed iterations (median kept)")
    ap.add_argument("--warmup", type=int_in(0, 100000, "iterations"), default=1, help="untimed iterations first")
    ap.add_argument("--backward", action="store_true", help="time forward + backward (default: forward)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", type=writable_file, help="write the results (rank 0)")
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads:
        ap.error(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}")
    comm = commlib.init()
    rank, P = comm.rank, comm.size
    dtype = np.dtype(args.dtype)
    res = dict(bench="attention", ranks=P, seq=args.seq, batch=args.batch, heads=args.heads,
               kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, tile=args.tile,
               iters=args.iters, backward=args.backward, causal=True)

    # 1-2. single-rank blocked attention (rank 0 alone, the others sleep), the three ring
    # layouts and Ulysses, interleaved round by round so background load hits all alike
    L = local_seq_len(args.seq, P, "zigzag")
    cases = {}
    for layout in LAYOUTS:
        Ll = local_seq_len(args.seq, P, layout)
        cases[layout] = (local_inputs(args, Ll, rank, dtype), dict(causal=True, layout=layout, seq_len=args.seq,
                                                                    tile=args.tile, timeout=TIMEOUT))
    use_ulysses = args.heads % P == 0 and args.kv_heads % P == 0
    single = local_inputs(args, args.seq, 0, dtype) if rank == 0 else None
    times = {name: [] for name in ("single", *LAYOUTS, "ulysses")}
    stats = {}

    def run_single():
        q, k, v, do = single
        out, lse = attention_forward(q, k, v, causal=True, tile=args.tile)
        if args.backward:
            attention_backward(q, k, v, out, lse, do, causal=True, tile=args.tile)

    def run_ring(layout):
        (q, k, v, do), kw = cases[layout]
        fst = stats.setdefault(layout, {})
        out, lse = ring_attention(q, k, v, comm, stats=fst, **kw)
        if args.backward:
            ring_attention_backward(q, k, v, out, lse, do, comm, **kw)

    def run_ulysses():
        (q, k, v, do), kw = cases["zigzag"]
        ulysses_attention(q, k, v, comm, **kw)

    for it in range(args.warmup + args.iters):
        quiet_barrier(comm)
        if rank == 0:
            t0 = time.perf_counter()
            run_single()
            if it >= args.warmup:
                times["single"].append(time.perf_counter() - t0)
        for name in (*LAYOUTS, "ulysses"):
            if name == "ulysses" and (not use_ulysses or args.backward):
                continue
            quiet_barrier(comm)
            t0 = time.perf_counter()
            run_ulysses() if name == "ulysses" else run_ring(name)
            t = slowest(comm, time.perf_counter() - t0)
            if it >= args.warmup:
                times[name].append(t)
    t1 = float(np.median(times["single"])) if rank == 0 else None
    layouts = {}
    for layout in LAYOUTS:
        work = comm.mpi_comm.gather([s["work"] for s in stats[layout]["steps"]], root=0)
        if rank == 0:
            w = np.array(work)  # [rank, step]
            layouts[layout] = dict(time_s=float(np.median(times[layout])), times_s=times[layout],
                                   critical_path_work=int(w.max(axis=0).sum()), total_work=int(w.sum()),
                                   work=w.tolist())
    ulysses_t = float(np.median(times["ulysses"])) if times["ulysses"] else None
    del cases, single

    # 3. memory per rank: distributed (seq and seq/2) and single rank
    def ring_call(a, seq):
        L = local_seq_len(seq, P, "zigzag")
        q, k, v, do = local_inputs(a, L, rank, dtype)
        out, lse = ring_attention(q, k, v, comm, causal=True, layout="zigzag", seq_len=seq, tile=a.tile,
                                  timeout=TIMEOUT)
        if a.backward:
            ring_attention_backward(q, k, v, out, lse, do, comm, causal=True, layout="zigzag", seq_len=seq,
                                    tile=a.tile, timeout=TIMEOUT)

    mem_full = peak_memory(comm, args, args.seq, ring_call)
    mem_half = peak_memory(comm, args, args.seq // 2, ring_call)
    mems = comm.mpi_comm.gather((mem_full, mem_half), root=0)
    single_mem = None
    if rank == 0:
        tracemalloc.start()
        q, k, v, do = local_inputs(args, args.seq, 0, dtype)
        out, lse = attention_forward(q, k, v, causal=True, tile=args.tile)
        if args.backward:
            attention_backward(q, k, v, out, lse, do, causal=True, tile=args.tile)
        single_mem = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del q, k, v, do, out, lse
    quiet_barrier(comm)
    if rank != 0:
        return 0

    cont = layouts["contiguous"]
    res["single_rank_time_s"] = t1
    res["single_rank_times_s"] = times["single"]
    res["layouts"] = layouts
    res["ulysses_time_s"] = ulysses_t
    res["ratios"] = {
        f"{lay}_vs_contiguous": dict(
            critical_path_work=cont["critical_path_work"] / layouts[lay]["critical_path_work"],
            measured_time=cont["time_s"] / layouts[lay]["time_s"])
        for lay in ("striped", "zigzag")}
    res["parallel_efficiency"] = {lay: t1 / (P * layouts[lay]["time_s"]) for lay in LAYOUTS}
    if ulysses_t:
        res["parallel_efficiency"]["ulysses"] = t1 / (P * ulysses_t)
    res["plan_critical_path_ratio"] = {}
    for p in (2, 4, 8):
        L = local_seq_len(args.seq, p, "zigzag")
        crit = {lay: ring_plan_work(p, args.seq, L, lay, True, args.tile).max(axis=0).sum() for lay in LAYOUTS}
        res["plan_critical_path_ratio"][f"P={p}"] = {
            lay: float(crit["contiguous"] / crit[lay]) for lay in ("striped", "zigzag")}
    peak = max(m[0] for m in mems)
    res["memory"] = dict(
        peak_bytes_per_rank=[m[0] for m in mems], peak_bytes_per_rank_half_seq=[m[1] for m in mems],
        single_rank_peak_bytes=single_mem,
        per_rank_vs_single=peak / single_mem, ideal_per_rank_vs_single=1.0 / P,
        full_vs_half_seq=peak / max(m[1] for m in mems), ideal_full_vs_half_seq=2.0,
        peak_bytes_per_local_token=peak / (args.batch * local_seq_len(args.seq, P, "zigzag")))
    print(f"bench_attention P={P} seq={args.seq} batch={args.batch} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim} {args.dtype} causal {'fwd+bwd' if args.backward else 'fwd'} tile={args.tile}")
    print(f"  single-rank blocked: {t1 * 1e3:.1f} ms")
    for lay in LAYOUTS:
        d = layouts[lay]
        print(f"  ring {lay:10s}: {d['time_s'] * 1e3:8.1f} ms  critical-path work {d['critical_path_work']:.3e}"
              f"  efficiency {res['parallel_efficiency'][lay]:.2f}")
    if ulysses_t:
        print(f"  ulysses (fwd)  : {ulysses_t * 1e3:8.1f} ms  efficiency {res['parallel_efficiency']['ulysses']:.2f}")
    for k, r in res["ratios"].items():
        print(f"  {k}: critical-path work {r['critical_path_work']:.2f}x, measured time {r['measured_time']:.2f}x")
    for k, r in res["plan_critical_path_ratio"].items():
        print(f"  plan {k}: striped {r['striped']:.2f}x, zigzag {r['zigzag']:.2f}x (critical-path work vs contiguous)")
    m = res["memory"]
    print(f"  memory: per-rank peak {peak / 2**20:.1f} MiB = {m['per_rank_vs_single']:.3f} of single-rank "
          f"({single_mem / 2**20:.1f} MiB; ideal 1/P = {1 / P:.3f}); seq vs seq/2: {m['full_vs_half_seq']:.2f}x "
          f"(ideal 2)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
