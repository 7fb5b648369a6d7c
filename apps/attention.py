"""Distributed attention driver: ``python -m commlib.apps.attention``.

Shards a synthetic sequence over the ranks, runs sequence-parallel attention
(ring in the contiguous, striped or zigzag layout, or Ulysses) forward and
optionally backward, and reports:

* tokens per second (``batch * seq / time``, time of the slowest rank, median
  over ``--iters``);
* per-rank peak memory of one forward(+backward) call (tracemalloc, numpy
  allocations included; it grows as ``seq / P``, never ``seq``), with the
  process's max RSS for reference;
* the compute balance per ring step: score entries each rank computed at each
  step, the max over ranks against the mean, and the critical path
  (sum over steps of the max) against the ideal (total / P);
* with ``--check``, the error against a dense float64 reference (all of q, k,
  v, out, dq, dk, dv when the dense matrix fits in ``--check-dense-max``
  entries, otherwise a subsample of query rows for out, lse and dq).

Each rank synthesizes only its own tokens (a counter-based hash of the token's
global position), so inputs never exist globally and memory stays ``O(seq/P)``.

Examples::

    mpiexec -n 4 python -m commlib.apps.attention --seq 8192 --heads 8 --kv-heads 2 \\
        --layout zigzag --causal --backward --check --json out.json
    mpiexec -n 2 python -m commlib.apps.attention --algo ulysses --seq 4096 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
import tracemalloc

import numpy as np

import commlib  # light: commlib.init etc. load on first use, after the command line is checked
# the attention package itself imports numpy only (not mpi4py.MPI, numba or CuPy),
# so --layout's choices come from the library's own LAYOUTS at no cost
from commlib.collectives.attention import (
    LAYOUTS,
    local_seq_len,
    ring_attention,
    ring_attention_backward,
    sequence_positions,
    ulysses_attention,
    ulysses_attention_backward,
)

from ._cli import OneLineParser, unwritable

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes  # noqa: PLC0415

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def synth(seed: int, which: int, positions: np.ndarray, batch: int, heads: int, dim: int, seq: int, dtype):
    """Deterministic pseudo-random ``(batch, len(positions), heads, dim)`` tensor.

    Element ``(b, t, h, d)`` depends only on ``(seed, which, b, positions[t], h, d)``
    (splitmix64 of a counter), uniform with unit variance; padding positions
    (``>= seq``) are 0.  Any rank can build any token without the others.
    """
    pos = np.asarray(positions, dtype=np.uint64)
    b = np.arange(batch, dtype=np.uint64)[:, None, None, None]
    h = np.arange(heads, dtype=np.uint64)[None, None, :, None]
    d = np.arange(dim, dtype=np.uint64)[None, None, None, :]
    with np.errstate(over="ignore"):
        x = ((b * np.uint64(1 << 40)) ^ (pos[None, :, None, None] * np.uint64(heads * dim))
             ) + h * np.uint64(dim) + d
        x = x + np.uint64((seed * 8 + which) * 0x9E3779B97F4A7C15 % (1 << 64))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    out = ((2.0 * u - 1.0) * math.sqrt(3.0)).astype(dtype)
    out[:, np.asarray(positions) >= seq] = 0
    return out


#: the largest --seq, --batch, --heads, --head-dim, --iters... the command line takes
MAX_INT = 1 << 31


def parse_args(argv=None):
    """Parse and check the command line.

    Raises:
        SystemExit: 2 after one line on stderr (rank 0) for any value the run
            cannot use; 0 after ``--help``.
    """
    p = OneLineParser(
        "attention",
        prog="python -m commlib.apps.attention",
        description="Exact sequence-parallel attention over MPI ranks: ring attention (contiguous, striped or "
                    "zigzag layout) or DeepSpeed-Ulysses, forward and optionally backward. Reports tokens/s, "
                    "per-rank peak memory (grows as seq/P) and the compute balance per ring step; --check "
                    "compares with a dense float64 reference.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="global sequence length in tokens (any value; padded "
                   "to a multiple of P, or 2P for zigzag, and masked)")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention); "
                   "must divide --heads; default: --heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--algo", choices=("ring", "ulysses"), default="ring", help="ring: K/V travel around the "
                   "ring; ulysses: all-to-all over heads (heads and kv-heads divisible by P)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="which tokens each rank holds: "
                   "contiguous blocks, striped (token t on rank t mod P) or zigzag (chunks r and 2P-1-r)")
    p.add_argument("--causal", action="store_true", help="causal (autoregressive) mask")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="input dtype; float16/bfloat16/float32 "
                   "accumulate in float32, float64 in float64")
    p.add_argument("--backward", action="store_true", help="also run the backward (dq, dk, dv)")
    p.add_argument("--check", action="store_true", help="compare with a dense float64 reference")
    p.add_argument("--check-rows", type=int, default=16, help="query rows per rank checked when the dense "
                   "matrix is too large for a full check")
    p.add_argument("--check-dense-max", type=int, default=1 << 24, help="largest batch*heads*seq^2 checked "
                   "in full (dk and dv included)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations (the first measures memory)")
    p.add_argument("--tile", type=int, default=128, help="query rows per tile (fully masked tiles are skipped)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic inputs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any ring step")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report (rank 0) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no text report")
    a = p.parse_args(argv)
    if a.kv_heads is None:
        a.kv_heads = a.heads
    for name in ("seq", "batch", "heads", "kv_heads", "head_dim", "iters", "tile", "check_rows", "check_dense_max"):
        v = getattr(a, name)
        if not 1 <= v <= (MAX_INT if name != "check_dense_max" else 1 << 62):
            p.error(f"--{name.replace('_', '-')} must be >= 1" + (f" and <= {MAX_INT}" if v >= 1 else "")
                    + f", got {v}")
    if not 0 <= a.warmup <= MAX_INT:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if not 0 <= a.seed < 1 << 32:
        p.error(f"--seed must be in [0, 2**32), got {a.seed}")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        p.error(f"--timeout must be a finite number of seconds > 0, got {a.timeout}")
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    if a.json is not None:
        problem = unwritable(a.json)
        if problem:
            p.error(f"--json {a.json}: {problem}")
    return a


def _reference_rows(args, rows_pos, dtype, scale):
    """Dense float64 out, lse, dq for the query rows at ``rows_pos`` (all keys synthesized)."""
    kpos = np.arange(args.seq)
    f64 = lambda w, pos, h: synth(args.seed, w, pos, args.batch, h, args.head_dim, args.seq, dtype).astype(np.float64)  # noqa: E731
    q = f64(0, rows_pos, args.heads)
    do = f64(3, rows_pos, args.heads)
    k = f64(1, kpos, args.kv_heads)
    v = f64(2, kpos, args.kv_heads)
    g = args.heads // args.kv_heads
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    if args.causal:
        s = np.where(kpos[None, :] <= rows_pos[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    lse = (m + np.log(l))[..., 0]
    p /= l
    out = np.einsum("bhij,bjhd->bihd", p, vr)
    dp = np.einsum("bihd,bjhd->bhij", do, vr)
    big_d = np.einsum("bihd,bihd->bhi", do, out)
    dq = np.einsum("bhij,bjhd->bihd", p * (dp - big_d[..., None]), kr) * scale
    return out, lse, dq


def _reference_full(args, dtype, scale):
    """Dense float64 out, lse, dq, dk, dv of the whole sequence."""
    pos = np.arange(args.seq)
    out, lse, dq = _reference_rows(args, pos, dtype, scale)
    f64 = lambda w, h: synth(args.seed, w, pos, args.batch, h, args.head_dim, args.seq, dtype).astype(np.float64)  # noqa: E731
    q, k, v, do = f64(0, args.heads), f64(1, args.kv_heads), f64(2, args.kv_heads), f64(3, args.heads)
    g = args.heads // args.kv_heads
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    if args.causal:
        s = np.where(np.tril(np.ones((args.seq, args.seq), bool)), s, -np.inf)
    p = np.exp(s - lse[..., None])
    dv = np.einsum("bhij,bihd->bjhd", p, do)
    dp = np.einsum("bihd,bjhd->bhij", do, vr)
    ds = p * (dp - np.einsum("bihd,bihd->bhi", do, out)[..., None])
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    b, n, hk, d = k.shape
    return out, lse, dq, dk.reshape(b, n, hk, g, d).sum(3), dv.reshape(b, n, hk, g, d).sum(3)


def _rel(got, want):
    got = np.asarray(got, np.float64)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-300)
    return float(np.abs(got - want).max(initial=0.0) / scale)


def run(args, comm=None):
    """Run the app; returns the report dict on rank 0 (None elsewhere)."""
    comm = comm or commlib.init()
    rank, P = comm.rank, comm.size
    dtype = _np_dtype(args.dtype)
    L = local_seq_len(args.seq, P, args.layout)
    pos = sequence_positions(args.layout, rank, P, L)
    mk = lambda w, h: synth(args.seed, w, pos, args.batch, h, args.head_dim, args.seq, dtype)  # noqa: E731
    q, k, v = mk(0, args.heads), mk(1, args.kv_heads), mk(2, args.kv_heads)
    do = mk(3, args.heads) if args.backward else None
    scale = args.head_dim ** -0.5
    fwd, bwd = (ring_attention, ring_attention_backward) if args.algo == "ring" else \
        (ulysses_attention, ulysses_attention_backward)
    kw = dict(causal=args.causal, layout=args.layout, softmax_scale=scale, seq_len=args.seq, tile=args.tile,
              timeout=args.timeout)

    def one(fstats=None, bstats=None):
        t0 = time.perf_counter()
        out, lse = fwd(comm, q, k, v, stats=fstats, **kw)
        t1 = time.perf_counter()
        grads = bwd(comm, q, k, v, out, lse, do, stats=bstats, **kw) if args.backward else None
        t2 = time.perf_counter()
        return out, lse, grads, t1 - t0, t2 - t1

    # memory: one call under tracemalloc (numpy reports its allocations to it)
    comm.barrier()
    inputs_bytes = sum(x.nbytes for x in (q, k, v) + ((do,) if do is not None else ()))
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fstats, bstats = {}, {}
    out, lse, grads, _, _ = one(fstats, bstats)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    for _ in range(max(0, args.warmup - 1)):
        one()
    times_f, times_b = [], []
    bar = range(args.iters)
    if rank == 0 and not args.quiet:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(bar, desc=f"{args.algo}/{args.layout} P={P}", unit="it", file=sys.stderr)
    for _ in bar:
        comm.barrier()
        _, _, _, tf, tb = one()
        times_f.append(tf)
        times_b.append(tb)
    # slowest rank per iteration
    tf_all, tb_all = np.array(times_f), np.array(times_b)
    comm.allreduce(tf_all, op="max")
    comm.allreduce(tb_all, op="max")

    check = None
    if args.check:
        check = _check(args, comm, pos, q, out, lse, grads, dtype, scale)

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = dict(rank=rank, peak_bytes=int(peak), inputs_bytes=int(inputs_bytes), max_rss_bytes=int(rss),
                fwd_steps=fstats.get("steps"), bwd_steps=bstats.get("steps") if args.backward else None,
                fwd_work=fstats.get("work"), bwd_compute_s=bstats.get("compute_s"))
    gathered = _gather_objects(comm, (mine, check), root=0)
    if rank != 0:
        return None
    everyone, checks = [g[0] for g in gathered], [g[1] for g in gathered]
    med_f = float(np.median(tf_all))
    med_b = float(np.median(tb_all)) if args.backward else 0.0
    tokens = args.batch * args.seq
    report = dict(
        app="attention", algo=args.algo, layout=args.layout, causal=args.causal, dtype=args.dtype, ranks=P,
        seq=args.seq, seq_local=L, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, tile=args.tile, iters=args.iters,
        fwd_time_s=med_f, bwd_time_s=med_b,
        fwd_tokens_per_s=tokens / med_f if med_f else None,
        fwd_bwd_tokens_per_s=tokens / (med_f + med_b) if args.backward else None,
        fwd_times_s=tf_all.tolist(), bwd_times_s=tb_all.tolist() if args.backward else None,
        memory=dict(
            peak_bytes_per_rank=[e["peak_bytes"] for e in everyone],
            max_peak_bytes=max(e["peak_bytes"] for e in everyone),
            peak_bytes_per_local_token=max(e["peak_bytes"] for e in everyone) / (args.batch * L),
            inputs_bytes_per_rank=everyone[0]["inputs_bytes"],
            max_rss_bytes_per_rank=[e["max_rss_bytes"] for e in everyone]),
    )
    if args.algo == "ring":
        report["balance"] = {"forward": _balance([e["fwd_steps"] for e in everyone])}
        if args.backward:
            report["balance"]["backward"] = _balance([e["bwd_steps"] for e in everyone])
    else:
        report["balance"] = {"forward": dict(work_per_rank=[e["fwd_work"] for e in everyone])}
    if args.check:
        report["check"] = _merge_checks(checks, args.dtype)
    return report


def _gather_objects(comm, obj, root=0):
    """Gather one JSON-serializable report per rank on ``root`` (a list in rank
    order; None elsewhere): the encodings' lengths by one allgather, then the
    UTF-8 JSON, padded to the longest, by another (no pickle on the wire)."""
    text = json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else o.tolist())
    blob = np.frombuffer(text.encode(), dtype=np.uint8)
    sizes = comm.allgather(np.array([blob.size], dtype=np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), dtype=np.uint8)
    padded[:blob.size] = blob
    blobs = comm.allgather(padded)
    if comm.rank != root:
        return None
    return [json.loads(blobs[r, :int(n)].tobytes().decode()) for r, n in enumerate(sizes)]


def _balance(steps_per_rank):
    """Per ring step: work of every rank, max/mean; critical path vs ideal."""
    work = np.array([[s["work"] for s in steps] for steps in steps_per_rank], dtype=np.int64)  # [rank, step]
    comp = np.array([[s["compute_s"] for s in steps] for steps in steps_per_rank])
    mean = work.mean(axis=0)
    crit = int(work.max(axis=0).sum())
    ideal = work.sum() / work.shape[0]
    return dict(
        work=work.tolist(),
        max_over_mean_per_step=[float(m / a) if a else 1.0 for m, a in zip(work.max(axis=0), mean)],
        critical_path_work=crit,
        ideal_work=float(ideal),
        balance=float(ideal / crit) if crit else 1.0,
        compute_s=comp.tolist(),
        critical_path_compute_s=float(comp.max(axis=0).sum()),
    )


def _check(args, comm, pos, q, out, lse, grads, dtype, scale):
    valid = np.flatnonzero(pos < args.seq)
    full = args.batch * args.heads * args.seq ** 2 <= args.check_dense_max
    res = {}
    if full:
        r_out, r_lse, r_dq, r_dk, r_dv = _reference_full(args, dtype, scale)
        sel = pos[valid]
        res["out"] = _rel(out[:, valid], r_out[:, sel])
        res["lse"] = _rel(lse[:, :, valid], r_lse[:, :, sel])
        if grads is not None:
            for name, g, r in zip(("dq", "dk", "dv"), grads, (r_dq, r_dk, r_dv)):
                res[name] = _rel(g[:, valid], r[:, sel])
        res["mode"] = "full"
    else:
        rng = np.random.default_rng(args.seed + comm.rank)
        rows = np.sort(rng.choice(valid, size=min(args.check_rows, len(valid)), replace=False))
        r_out, r_lse, r_dq = _reference_rows(args, pos[rows], dtype, scale)
        res["out"] = _rel(out[:, rows], r_out)
        res["lse"] = _rel(lse[:, :, rows], r_lse)
        if grads is not None:
            res["dq"] = _rel(grads[0][:, rows], r_dq)
        res["mode"] = f"{len(rows)} rows per rank"
    res["nan"] = bool(np.isnan(np.asarray(out, np.float64)).any())
    return res


def _merge_checks(checks, dtype):
    tol = {"float64": 1e-10, "float32": 1e-5, "float16": 2e-2, "bfloat16": 3e-2}[dtype]
    keys = [k for k in checks[0] if k not in ("mode", "nan")]
    worst = {k: max(c[k] for c in checks) for k in keys}
    ok = all(v <= tol for v in worst.values()) and not any(c["nan"] for c in checks)
    return dict(mode=checks[0]["mode"], max_rel_err=worst, tolerance=tol, passed=ok)


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def print_report(rep):
    print(f"attention {rep['algo']} layout={rep['layout']} causal={rep['causal']} dtype={rep['dtype']} "
          f"P={rep['ranks']} seq={rep['seq']} (local {rep['seq_local']}) batch={rep['batch']} "
          f"heads={rep['heads']}/{rep['kv_heads']} head_dim={rep['head_dim']}")
    print(f"  forward : {rep['fwd_time_s'] * 1e3:9.2f} ms  {rep['fwd_tokens_per_s']:12.0f} tokens/s")
    if rep["fwd_bwd_tokens_per_s"]:
        print(f"  fwd+bwd : {(rep['fwd_time_s'] + rep['bwd_time_s']) * 1e3:9.2f} ms  "
              f"{rep['fwd_bwd_tokens_per_s']:12.0f} tokens/s")
    m = rep["memory"]
    print(f"  peak memory per rank (tracemalloc): {', '.join(_fmt_bytes(b) for b in m['peak_bytes_per_rank'])}"
          f"  ({m['peak_bytes_per_local_token']:.0f} B per local token)")
    for phase, b in rep["balance"].items():
        if "max_over_mean_per_step" in b:
            steps = " ".join(f"{x:.2f}" for x in b["max_over_mean_per_step"])
            print(f"  {phase} balance per ring step (max/mean work): {steps}; critical path "
                  f"{b['critical_path_work']:.3g} vs ideal {b['ideal_work']:.3g} entries "
                  f"(balance {b['balance']:.2f})")
        else:
            print(f"  {phase} work per rank: {b['work_per_rank']}")
    if "check" in rep:
        c = rep["check"]
        errs = ", ".join(f"{k} {v:.2e}" for k, v in c["max_rel_err"].items())
        print(f"  check vs dense float64 ({c['mode']}): {errs}  tol {c['tolerance']:.0e}: "
              f"{'PASSED' if c['passed'] else 'FAILED'}")


def main(argv=None) -> int:
    """The command line; returns the exit status (2: a refused value, one line on stderr from rank 0)."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a refusal (2)
        return exc.code if isinstance(exc.code, int) else 2
    comm = commlib.init()
    try:
        rep = run(args, comm)
    except commlib.InvalidArgument as exc:  # raised on every rank alike: a clean exit
        if comm.rank == 0:
            print(f"attention: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except BaseException as exc:  # one rank failing alone must not leave the others hanging
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        print(f"rank {comm.rank}: attention app: {exc!r}; aborting the job", file=sys.stderr, flush=True)
        comm.abort(3)
    if rep is not None:
        if not args.quiet:
            print_report(rep)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(rep, fh, indent=1)
        if "check" in rep and not rep["check"]["passed"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
