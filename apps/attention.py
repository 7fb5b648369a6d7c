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

Two backends:

* ``--backend numpy`` (default): :mod:`commlib.collectives.attention`, the
  numpy tile kernels, ring or Ulysses; memory by tracemalloc; checked against
  a dense float64 reference (out, lse, dq, dk, dv).
* ``--backend torch``: :mod:`commlib.nn` on ``--device cpu`` or ``cuda``
  (one GPU per rank, by local rank), ``--algo`` ring, bidirectional (half of
  K/V each way round the ring), ulysses or hybrid (Ulysses inside groups of
  ``--ulysses-degree`` ranks, ring across them); the backward is torch's
  autograd through the library's functions.  Memory is the peak growth of the
  process's RSS during one call after an untimed warm one (CPU; Linux
  ``/proc/self/clear_refs``; approximate: memory the allocator reuses is not
  seen) or ``torch.cuda.max_memory_allocated`` (CUDA); no per-step balance.
  The warm call and the memory call count as ``--warmup`` iterations.
  ``--check`` compares out, dq, dk and dv with ``torch.nn.functional.
  scaled_dot_product_attention`` in float64 with autograd on the whole
  sequence (or, above ``--check-dense-max``, on a subsample of query rows
  against all keys: out and dq).  ``--seq`` must be a multiple of P (2P for
  zigzag): the torch functions take no padding length.

Examples::

    mpiexec -n 4 python -m commlib.apps.attention --seq 8192 --heads 8 --kv-heads 2 \\
        --layout zigzag --causal --backward --check --json out.json
    mpiexec -n 2 python -m commlib.apps.attention --algo ulysses --seq 4096 --dtype bfloat16
    mpiexec -n 4 python -m commlib.apps.attention --backend torch --algo bidirectional --seq 8192 \\
        --dtype bfloat16 --causal --backward --check
    mpiexec -n 4 python -m commlib.apps.attention --backend torch --device cuda --algo hybrid \\
        --ulysses-degree 2 --seq 65536 --dtype bfloat16 --causal --backward
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
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
    layout_of,
    local_seq_len,
    ring_attention,
    ring_attention_backward,
    sequence_positions,
    ulysses_attention,
    ulysses_attention_backward,
)

from ._cli import OneLineParser, init_comm, unwritable

DTYPES = ("float16", "bfloat16", "float32", "float64")
BACKENDS = ("numpy", "torch")
DEVICES = ("cpu", "cuda")
ALGOS = ("ring", "bidirectional", "ulysses", "hybrid")
#: the algorithms only the torch backend (commlib.nn) has
TORCH_ONLY_ALGOS = ("bidirectional", "hybrid")


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
                    "zigzag layout; bidirectional with torch), DeepSpeed-Ulysses or (torch) the hybrid of both, "
                    "forward and optionally backward, on numpy or torch (CPU or CUDA). Reports tokens/s, "
                    "per-rank peak memory (grows as seq/P) and (numpy) the compute balance per ring step; "
                    "--check compares with a dense float64 reference (torch: torch SDPA in float64).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="global sequence length in tokens (numpy: any value, "
                   "padded to a multiple of P, or 2P for zigzag, and masked; torch: a multiple of P, 2P for zigzag)")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention); "
                   "must divide --heads; default: --heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--backend", choices=BACKENDS, default="numpy", help="numpy: commlib.collectives.attention "
                   "(numpy tile kernels); torch: commlib.nn (torch's fused attention kernels, autograd backward), "
                   "checked against torch SDPA in float64")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where the tensors live (cuda: --backend "
                   "torch, one GPU per rank by local rank)")
    p.add_argument("--algo", "--attention", dest="algo", choices=ALGOS, default="ring",
                   help="ring: K/V travel around the ring; bidirectional (torch): half of K/V each way round "
                   "the ring; ulysses: all-to-all over heads (heads and kv-heads divisible by P); hybrid "
                   "(torch): Ulysses inside groups of --ulysses-degree ranks, ring across the groups")
    p.add_argument("--ulysses-degree", type=int, default=None, help="--algo hybrid: ranks per Ulysses group "
                   "(divides P; heads and kv-heads divisible by it); default 2 when P is even, else 1")
    p.add_argument("--layout", choices=LAYOUTS, default=None, help="which tokens each rank holds: "
                   "contiguous blocks, striped (token t on rank t mod P) or zigzag (chunks r and 2P-1-r); "
                   "default zigzag")
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
    p.add_argument("--tile", type=int, default=128, help="numpy: query rows per tile (fully masked tiles are "
                   "skipped)")
    p.add_argument("--threads", type=int, default=None, help="torch: intra-op threads per rank "
                   "(torch.set_num_threads; default: torch's own choice)")
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
    if a.backend == "numpy":
        if a.device != "cpu":
            p.error(f"--device {a.device} needs --backend torch (the numpy backend runs on the host)")
        if a.algo in TORCH_ONLY_ALGOS:
            p.error(f"--algo {a.algo} needs --backend torch")
    if a.threads is not None and not 1 <= a.threads <= 4096:
        p.error(f"--threads must be in [1, 4096], got {a.threads}")
    if a.ulysses_degree is not None:
        if a.algo != "hybrid":
            p.error(f"--ulysses-degree is for --algo hybrid, not --algo {a.algo}")
        if not 1 <= a.ulysses_degree <= MAX_INT:
            p.error(f"--ulysses-degree must be >= 1, got {a.ulysses_degree}")
    if a.layout is None:
        a.layout = "zigzag"
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


def _timed_iters(comm, args, one, desc: str):
    """``args.iters`` timed calls of ``one()`` (whose last two results are the
    forward and backward seconds), each after a barrier, with a progress bar on
    rank 0.  Returns the per-iteration seconds of the slowest rank, forward and
    backward (float64 arrays of ``args.iters``)."""
    times_f, times_b = [], []
    bar = range(args.iters)
    if comm.rank == 0 and not args.quiet:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(bar, desc=desc, unit="it", file=sys.stderr)
    for _ in bar:
        comm.barrier()
        *_, tf, tb = one()
        times_f.append(tf)
        times_b.append(tb)
    tf_all, tb_all = np.array(times_f), np.array(times_b)
    comm.allreduce(tf_all, op="max")  # slowest rank per iteration
    comm.allreduce(tb_all, op="max")
    return tf_all, tb_all


def run(args, comm=None):
    """Run the app; returns the report dict on rank 0 (None elsewhere)."""
    comm = comm or commlib.init()
    if args.backend == "torch":
        return _run_torch(args, comm)
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
        out, lse = fwd(q, k, v, comm, stats=fstats, **kw)
        t1 = time.perf_counter()
        grads = bwd(q, k, v, out, lse, do, comm, stats=bstats, **kw) if args.backward else None
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
    tf_all, tb_all = _timed_iters(comm, args, one, f"{args.algo}/{args.layout} P={P}")

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
        app="attention", backend="numpy", device="cpu", algo=args.algo, layout=args.layout, causal=args.causal,
        dtype=args.dtype, ranks=P,
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


# ----------------------------------------------------------------- torch backend
#: commlib.nn's entry point of each --algo, and the submodule that defines it
_NN_FUNCTIONS = {"ring": ("ring_attention", "ring"), "bidirectional": ("ring_attention_bidirectional", "ring"),
                 "ulysses": ("ulysses_attention", "ulysses"), "hybrid": ("hybrid_attention", "hybrid")}


def _nn_function(algo):
    """commlib.nn's attention function for ``algo`` (from the package, else its submodule)."""
    name, module = _NN_FUNCTIONS[algo]
    nn = importlib.import_module("commlib.nn")
    fn = getattr(nn, name, None)
    if fn is None:
        fn = getattr(importlib.import_module(f"commlib.nn.{module}"), name)
    return fn


def _torch_dtype(name):
    import torch  # noqa: PLC0415

    return getattr(torch, name)


def _torch_synth(args, which, positions, heads, device):
    """:func:`synth` as a torch tensor of ``--dtype`` on ``device`` (built in
    float32, float64 for float64, then rounded: the same values on every rank
    and in the reference)."""
    import torch  # noqa: PLC0415

    base = np.float64 if args.dtype == "float64" else np.float32
    x = synth(args.seed, which, positions, args.batch, heads, args.head_dim, args.seq, base)
    return torch.from_numpy(x).to(device=device, dtype=_torch_dtype(args.dtype))


def _ulysses_degree(args, P):
    if args.ulysses_degree is not None:
        return args.ulysses_degree
    return 2 if P % 2 == 0 else 1


def _torch_problem(args, P, torch):
    """Why this rank cannot run the torch backend as asked (None: it can)."""
    multiple = layout_of(args.layout).unit(P)
    if args.seq % multiple:
        return (f"--backend torch needs --seq divisible by {multiple} ({'2P' if multiple != P else 'P'} for the "
                f"{args.layout} layout at P={P}), got {args.seq}")
    if args.algo == "hybrid":
        d = _ulysses_degree(args, P)
        if P % d:
            return f"--ulysses-degree {d} does not divide the {P} ranks"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA device on this rank"
    return None


def _local_device(args, torch):
    if args.device == "cpu":
        return torch.device("cpu")
    local = next((int(os.environ[v]) for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                                               "MV2_COMM_WORLD_LOCAL_RANK") if v in os.environ), 0)
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _cpu_peak_reset():
    """Reset this process's peak RSS (Linux ``/proc/self/clear_refs``); returns
    the current RSS in bytes, or None where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return _proc_status_bytes("VmRSS")
    except OSError:
        return None


def _proc_status_bytes(field):
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _run_torch(args, comm):
    """The torch backend (commlib.nn): forward and autograd backward, timed,
    with peak memory per rank and, with ``--check``, the error against torch
    SDPA in float64 with autograd on the whole sequence."""
    import torch  # noqa: PLC0415

    rank, P = comm.rank, comm.size
    problem = _torch_problem(args, P, torch)
    flags = np.zeros(P, dtype=np.int32)
    flags[rank] = problem is not None
    comm.allreduce(flags, op="max")
    if flags.any():  # every rank raises alike, before any attention message
        first = int(np.flatnonzero(flags)[0])
        raise commlib.InvalidArgument(problem if problem else f"rank {first} cannot run this configuration",
                                      rank=rank, op="attention app")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _local_device(args, torch)
    fn = _nn_function(args.algo)
    multiple = layout_of(args.layout).unit(P)
    L = args.seq // P
    assert args.seq % multiple == 0
    pos = sequence_positions(args.layout, rank, P, L)
    q = _torch_synth(args, 0, pos, args.heads, device).requires_grad_(args.backward)
    k = _torch_synth(args, 1, pos, args.kv_heads, device).requires_grad_(args.backward)
    v = _torch_synth(args, 2, pos, args.kv_heads, device).requires_grad_(args.backward)
    do = _torch_synth(args, 3, pos, args.heads, device) if args.backward else None
    scale = args.head_dim ** -0.5
    kw = dict(causal=args.causal, softmax_scale=scale, timeout=args.timeout, layout=args.layout)
    if args.algo == "hybrid":
        kw["ulysses_degree"] = _ulysses_degree(args, P)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one():
        for t in (q, k, v):
            t.grad = None
        sync()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(args.backward):
            out = fn(q, k, v, comm, **kw)
        sync()
        t1 = time.perf_counter()
        if args.backward:
            out.backward(do)
        sync()
        t2 = time.perf_counter()
        grads = (q.grad, k.grad, v.grad) if args.backward else None
        return out.detach(), grads, t1 - t0, t2 - t1

    one()  # warm: lazy imports, kernel selection and allocator growth stay out of the memory figure
    comm.barrier()
    inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v) + ((do,) if do is not None else ()))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out, grads, _, _ = one()
        peak, method = torch.cuda.max_memory_allocated(device) - base, "torch.cuda.max_memory_allocated"
    else:
        base = _cpu_peak_reset()
        out, grads, _, _ = one()
        hwm = _proc_status_bytes("VmHWM")
        peak, method = (hwm - base, "peak RSS growth") if base is not None and hwm is not None else (None, None)
    for _ in range(max(0, args.warmup - 2)):
        one()
    tf_all, tb_all = _timed_iters(comm, args, one, f"torch {args.algo}/{args.layout} P={P}")

    check = _check_torch(args, comm, pos, out, grads, scale) if args.check else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = dict(rank=rank, peak_bytes=None if peak is None else int(peak), inputs_bytes=int(inputs_bytes),
                max_rss_bytes=int(rss))
    gathered = _gather_objects(comm, (mine, check), root=0)
    if rank != 0:
        return None
    everyone, checks = [g[0] for g in gathered], [g[1] for g in gathered]
    med_f = float(np.median(tf_all))
    med_b = float(np.median(tb_all)) if args.backward else 0.0
    tokens = args.batch * args.seq
    peaks = [e["peak_bytes"] for e in everyone]
    known = [b for b in peaks if b is not None]
    report = dict(
        app="attention", backend="torch", device=args.device, algo=args.algo, layout=args.layout,
        causal=args.causal, dtype=args.dtype, ranks=P, seq=args.seq, seq_local=L, batch=args.batch,
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, iters=args.iters,
        threads=torch.get_num_threads(),
        fwd_time_s=med_f, bwd_time_s=med_b,
        fwd_tokens_per_s=tokens / med_f if med_f else None,
        fwd_bwd_tokens_per_s=tokens / (med_f + med_b) if args.backward else None,
        fwd_times_s=tf_all.tolist(), bwd_times_s=tb_all.tolist() if args.backward else None,
        memory=dict(
            method=method,
            peak_bytes_per_rank=peaks,
            max_peak_bytes=max(known) if known else None,
            peak_bytes_per_local_token=max(known) / (args.batch * L) if known else None,
            inputs_bytes_per_rank=everyone[0]["inputs_bytes"],
            max_rss_bytes_per_rank=[e["max_rss_bytes"] for e in everyone]),
    )
    if args.algo == "hybrid":
        report["ulysses_degree"] = kw["ulysses_degree"]
    if args.check:
        report["check"] = _merge_checks(checks, args.dtype, backend="torch")
    return report


def _sdpa_reference(q, k, v, dout, scale, mask):
    """torch SDPA in float64 with autograd: ``(out, dq, dk, dv)`` for
    ``(B, L, H, D)`` q/dout and ``(B, S, Hkv, D)`` k/v (kv heads repeated for
    grouped-query attention; dk/dv summed back over the group); ``mask``: bool
    ``(L, S)``, True where a query attends, or None."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415, N812

    g = q.shape[2] // k.shape[2]
    q, k, v = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    kr, vr = (t.repeat_interleave(g, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                         attn_mask=mask, scale=scale).transpose(1, 2)
    out.backward(dout.double().cpu())
    return out.detach(), q.grad, k.grad, v.grad


def _check_torch(args, comm, pos, out, grads, scale):
    """This rank's errors against torch SDPA in float64 (all of out, dq, dk, dv
    when the dense matrix fits ``--check-dense-max``, else a subsample of query
    rows for out and dq)."""
    import torch  # noqa: PLC0415

    cpu = torch.device("cpu")
    full = args.batch * args.heads * args.seq ** 2 <= args.check_dense_max
    allpos = np.arange(args.seq)
    k = _torch_synth(args, 1, allpos, args.kv_heads, cpu)
    v = _torch_synth(args, 2, allpos, args.kv_heads, cpu)
    npy = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    res = {}
    if full:
        q = _torch_synth(args, 0, allpos, args.heads, cpu)
        do = _torch_synth(args, 3, allpos, args.heads, cpu)
        mask = torch.ones(args.seq, args.seq, dtype=torch.bool).tril() if args.causal else None
        r_out, r_dq, r_dk, r_dv = (npy(t) for t in _sdpa_reference(q, k, v, do, scale, mask))
        res["out"] = _rel(npy(out), r_out[:, pos])
        if grads is not None:
            for name, g, r in zip(("dq", "dk", "dv"), grads, (r_dq, r_dk, r_dv)):
                res[name] = _rel(npy(g), r[:, pos])
        res["mode"] = "full"
    else:
        rng = np.random.default_rng(args.seed + comm.rank)
        rows = np.sort(rng.choice(len(pos), size=min(args.check_rows, len(pos)), replace=False))
        q = _torch_synth(args, 0, pos[rows], args.heads, cpu)
        do = _torch_synth(args, 3, pos[rows], args.heads, cpu)
        mask = torch.from_numpy(allpos[None, :] <= pos[rows][:, None]) if args.causal else None
        r_out, r_dq, _, _ = (npy(t) for t in _sdpa_reference(q, k, v, do, scale, mask))
        res["out"] = _rel(npy(out)[:, rows], r_out)
        if grads is not None:
            res["dq"] = _rel(npy(grads[0])[:, rows], r_dq)
        res["mode"] = f"{len(rows)} rows per rank"
    res["nan"] = bool(np.isnan(npy(out)).any())
    return res


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


#: largest error relative to the reference's largest magnitude that passes, per backend and dtype (torch's
#: bfloat16 kernels round P to bfloat16 before P @ V and in the backward, as FlashAttention does)
TOLERANCES = {"numpy": {"float64": 1e-10, "float32": 1e-5, "float16": 2e-2, "bfloat16": 3e-2},
              "torch": {"float64": 1e-10, "float32": 1e-5, "float16": 2e-2, "bfloat16": 3e-2}}


def _merge_checks(checks, dtype, backend="numpy"):
    tol = TOLERANCES[backend][dtype]
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
    backend = rep.get("backend", "numpy")
    extra = f" ulysses_degree={rep['ulysses_degree']}" if "ulysses_degree" in rep else ""
    print(f"attention [{backend}/{rep.get('device', 'cpu')}] {rep['algo']} layout={rep['layout']} "
          f"causal={rep['causal']} dtype={rep['dtype']} P={rep['ranks']} seq={rep['seq']} (local {rep['seq_local']}) "
          f"batch={rep['batch']} heads={rep['heads']}/{rep['kv_heads']} head_dim={rep['head_dim']}{extra}")
    print(f"  forward : {rep['fwd_time_s'] * 1e3:9.2f} ms  {rep['fwd_tokens_per_s']:12.0f} tokens/s")
    if rep["fwd_bwd_tokens_per_s"]:
        print(f"  fwd+bwd : {(rep['fwd_time_s'] + rep['bwd_time_s']) * 1e3:9.2f} ms  "
              f"{rep['fwd_bwd_tokens_per_s']:12.0f} tokens/s")
    m = rep["memory"]
    if m["peak_bytes_per_local_token"] is not None:
        print(f"  peak memory per rank ({m.get('method', 'tracemalloc')}): "
              f"{', '.join('?' if b is None else _fmt_bytes(b) for b in m['peak_bytes_per_rank'])}"
              f"  ({m['peak_bytes_per_local_token']:.0f} B per local token)")
    for phase, b in rep.get("balance", {}).items():
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
        ref = "torch SDPA float64" if backend == "torch" else "dense float64"
        print(f"  check vs {ref} ({c['mode']}): {errs}  tol {c['tolerance']:.0e}: "
              f"{'PASSED' if c['passed'] else 'FAILED'}")


def main(argv=None) -> int:
    """The command line; returns the exit status (2: a refused value, one line on stderr from rank 0; 1: --check
    failed; 130: interrupted by Ctrl-C, one line on stderr)."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a refusal (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        comm = init_comm("attention")
    except SystemExit as exc:  # the launch refused: one line from rank 0
        return exc.code
    try:
        rep = run(args, comm)
    except commlib.InvalidArgument as exc:  # raised on every rank alike: a clean exit
        if comm.rank == 0:
            print(f"attention: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; 130 as a shell reports SIGINT
        print(f"attention: interrupted (rank {comm.rank})", file=sys.stderr, flush=True)
        if comm.size > 1:  # the other ranks may be waiting on this one
            comm.abort(130)
        return 130
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
