"""Sliding-window attention across ranks: time and bytes against the full causal ring, and against masked SDPA.

Two sections, picked by the rank count::

    mpiexec -n 4 python -P benchmarks/bench_window.py --seq 16384 --window 1024    # ranks
    python -P benchmarks/bench_window.py --seq 16384 --window 1024                 # single (1 rank)

* **ranks** (``P > 1``): ``commlib.nn.ring_attention(..., causal=True,
  window=(W - 1, 0))`` in the contiguous layout (a halo exchange) against the
  full causal ring (``window=None``) in the zigzag layout (the balanced
  layout: the strongest full ring) and in the contiguous layout, forward +
  backward, alternated in one run; time per call (the slowest rank, median of
  ``--repeat``) and the bytes each rank sends and receives (every message
  counted at the transport, the argument agreement's few bytes included).
* **single** (``P == 1``): the windowed call on one rank against what a
  user would write without it: :func:`torch.nn.functional.scaled_dot_product_attention`
  with the equivalent boolean ``(seq, seq)`` mask, forward + backward.

Window ``W`` tokens: a query sees itself and the ``W - 1`` tokens before it
(FlashAttention-2's ``window_size=(W - 1, 0)``; Longformer, Mistral).  Inputs:
batch 1, ``--heads`` query heads and ``--kv-heads`` K/V heads of
``--head-dim``, float32, CPU.  Ratios are the figures to read (2-core
machines: absolute times are noisy).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _util import OneLineParser, int_in, write_json  # noqa: E402


class Counting:
    """Forwards point-to-point calls to a communicator and counts the bytes sent and received."""

    def __init__(self, comm):
        self._c = comm
        self.rank, self.size = comm.rank, comm.size
        self.sent = self.received = 0

    def isend(self, buf, dest, tag=0):
        self.sent += buf.nbytes
        return self._c.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self.received += buf.nbytes
        return self._c.irecv(buf, source, tag)

    def waitall(self, reqs, timeout=None):
        return self._c.waitall(reqs, timeout)


def inputs(torch, n, heads, kv_heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, heads, dim, generator=g)
    k = torch.randn(1, n, kv_heads, dim, generator=g)
    v = torch.randn(1, n, kv_heads, dim, generator=g)
    return q, k, v


def ranks_section(args, torch, comm):
    from mpi4py import MPI  # noqa: PLC0415

    from commlib.collectives.attention.layout import sequence_positions  # noqa: PLC0415
    from commlib.nn import ring_attention  # noqa: PLC0415

    mpi = MPI.COMM_WORLD  # the benchmark's own bookkeeping (barriers, gathering the figures)

    P, r = comm.size, comm.rank
    L = args.seq // P
    q, k, v = inputs(torch, args.seq, args.heads, args.kv_heads, args.head_dim)
    cases = {
        "window": ("contiguous", (args.window - 1, 0)),
        "full_zigzag": ("zigzag", None),
        "full_contiguous": ("contiguous", None),
    }
    local = {}
    for name, (layout, _) in cases.items():
        pos = torch.from_numpy(sequence_positions(layout, r, P, L))
        local[name] = [x[:, pos].contiguous() for x in (q, k, v)]
    times = {name: [] for name in cases}
    nbytes = {}
    for rep in range(args.repeat + 1):  # the first round warms up (plans, allocator, MPI connections)
        for name, (layout, window) in cases.items():
            ql, kl, vl = (x.clone().requires_grad_() for x in local[name])
            cc = Counting(comm)
            mpi.Barrier()
            t = time.perf_counter()
            out = ring_attention(ql, kl, vl, cc, causal=True, layout=layout, window=window)
            out.backward(torch.ones_like(out))
            dt = time.perf_counter() - t
            slowest = max(mpi.allgather(dt))
            if rep:
                times[name].append(slowest)
            nbytes[name] = (cc.sent, cc.received)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    everyone = mpi.gather(nbytes, root=0)
    if r != 0:
        return None
    per_rank = {name: [e[name] for e in everyone] for name in cases}
    res = dict(section="ranks", ranks=P, seq=args.seq, window=args.window, heads=args.heads,
               kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="float32", repeat=args.repeat,
               time_s=med, bytes_sent_received_per_rank=per_rank,
               speedup_vs_full_zigzag=med["full_zigzag"] / med["window"],
               speedup_vs_full_contiguous=med["full_contiguous"] / med["window"],
               max_bytes_received_ratio_full_zigzag_over_window=max(b for _, b in per_rank["full_zigzag"])
               / max(1, max(b for _, b in per_rank["window"])))
    row_bytes = 2 * args.kv_heads * args.head_dim * 4
    print(f"bench_window ranks: {P} ranks, {args.seq} tokens ({L} per rank), window {args.window}, causal, "
          f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, float32, fwd+bwd, median of {args.repeat}")
    for name in cases:
        sr = per_rank[name]
        print(f"  {name:16s} {med[name] * 1e3:9.1f} ms   bytes sent/received per rank: "
              + ", ".join(f"{s / 2**20:.2f}/{b / 2**20:.2f} MiB" for s, b in sr))
    print(f"  window K/V rows a middle rank needs: {args.window - 1} = {(args.window - 1) * row_bytes / 2**20:.2f} MiB "
          f"forward (its dk/dv back: the same rows in float32)")
    print(f"  speedup: {res['speedup_vs_full_zigzag']:.2f}x vs the full causal ring (zigzag), "
          f"{res['speedup_vs_full_contiguous']:.2f}x vs the full causal ring (contiguous) (target >= 4x); "
          f"bytes received (busiest rank): {res['max_bytes_received_ratio_full_zigzag_over_window']:.1f}x fewer")
    return res


def single_section(args, torch, comm):
    from commlib.nn import ring_attention  # noqa: PLC0415

    q, k, v = inputs(torch, args.seq, args.heads, args.kv_heads, args.head_dim)
    i = torch.arange(args.seq)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - args.window)
    g = args.heads // args.kv_heads

    def ours():
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        out = ring_attention(ql, kl, vl, comm, causal=True, window=(args.window - 1, 0))
        out.backward(torch.ones_like(out))

    def sdpa():
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            ql.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), attn_mask=mask, enable_gqa=g > 1)
        out.backward(torch.ones_like(out))

    times = {"window": [], "sdpa_masked": []}
    for rep in range(args.repeat + 1):
        for name, fn in (("window", ours), ("sdpa_masked", sdpa)):
            t = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    res = dict(section="single", ranks=1, seq=args.seq, window=args.window, heads=args.heads, kv_heads=args.kv_heads,
               head_dim=args.head_dim, dtype="float32", repeat=args.repeat, time_s=med,
               speedup_vs_sdpa_masked=med["sdpa_masked"] / med["window"])
    print(f"bench_window single: 1 rank, {args.seq} tokens, window {args.window}, causal, heads "
          f"{args.heads}/{args.kv_heads} x {args.head_dim}, float32, fwd+bwd, median of {args.repeat}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"  window (commlib)     {med['window'] * 1e3:9.1f} ms")
    print(f"  SDPA + bool mask     {med['sdpa_masked'] * 1e3:9.1f} ms")
    print(f"  speedup: {res['speedup_vs_sdpa_masked']:.2f}x vs SDPA with the boolean mask (target >= 2x)")
    return res


def main(argv=None):
    p = OneLineParser(prog="bench_window", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int_in(2, 1 << 24, "tokens"), default=16384, help="global tokens (default 16384)")
    p.add_argument("--window", type=int_in(1, 1 << 24, "tokens"), default=1024,
                   help="window W: a query sees itself and W - 1 tokens before it (default 1024)")
    p.add_argument("--heads", type=int_in(1, 1024, "heads"), default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int_in(1, 1024, "heads"), default=8, help="K/V heads (default 8)")
    p.add_argument("--head-dim", type=int_in(1, 1024, "head_dim"), default=64, help="head dimension (default 64)")
    p.add_argument("--repeat", type=int_in(1, 1000, "repeats"), default=3, help="timed rounds (default 3)")
    p.add_argument("--threads", type=int_in(1, 4096, "threads"), default=1,
                   help="torch threads per rank (default 1)")
    p.add_argument("--json", default=None, help="write the figures here (rank 0)")
    args = p.parse_args(argv)
    import torch  # noqa: PLC0415

    import commlib  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    comm = commlib.init()
    if args.seq % comm.size or (args.seq // comm.size) % 2:
        p.error(f"--seq {args.seq} must split into even shards over {comm.size} ranks")
    res = ranks_section(args, torch, comm) if comm.size > 1 else single_section(args, torch, comm)
    if res is not None:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
