"""Torch sequence-parallel attention (``commlib.nn``) against torch's own SDPA.

Run through ``bench_attention.py --backend torch`` (or this file directly),
serially, *not* under mpiexec: the driver measures section ``single`` in its
own process and launches the others as child jobs, one after the other
(never two at once), each measuring its baseline side by side::

    python -P benchmarks/bench_attention.py --backend torch --json torch.json --plot torch.png
    python -P benchmarks/bench_attention.py --backend torch --sections single --seq-lens 16384 \\
        --dtypes float32 --modes fwd

Sections (every figure is a ratio against a baseline measured in the same run;
best of ``--trials`` timed calls after ``--warmup`` untimed ones, the
implementations alternated call by call so background load hits both):

``single``
    one rank: ``commlib.nn.ring_attention`` on a size-1 communicator against
    ``torch.nn.functional.scaled_dot_product_attention`` in the same process
    with the same ``--threads``, on the same ``(B, L, H, D)`` tensors (SDPA
    takes their ``transpose(1, 2)`` views, as a model does), forward and
    forward + backward, float32 and bfloat16, causal and not, ``--seq-lens``
    tokens.  Ratio ``t_sdpa / t_ring`` (target >= 0.9).
``ranks2``
    zigzag causal ring attention on 2 ranks with 1 thread each
    (``mpiexec -n 2``, ``torch.set_num_threads(1)``; time of the slowest rank)
    against one separate process of SDPA with 2 threads on the full sequence
    (a child process launched by the driver before each ring job, ``--rounds``
    times alternately; best of all).  Ratio ``t_sdpa_2threads / t_ring_2ranks``
    (target >= 0.8).
``bidir``
    bidirectional against unidirectional ring attention at 4 ranks
    (``mpiexec -n 4``, 1 thread each; the two alternate call by call in one
    job), in the configuration where communication weighs most: not causal
    (every step a full block), contiguous layout, few tokens per rank
    (``--bidir-seq-lens``, default 512: 128 per rank) and as many K/V heads as
    query heads, so a step moves ``2 L Hkv D`` K/V elements against
    ``4 L^2 H D`` flops.  The ring gets a recording transport (a wrapper of the
    communicator's collectives transport) that counts every message's bytes
    per directed link ``(src, dst)`` and timestamps every wait, so the figures
    come from the messages the library really sent (and are checked against
    the ring's schedule): bytes per link per ring step, and the critical
    path, ``sum over steps of the max over ranks`` of the step's time (a step
    ends when this rank's wait for that step's K/V exchange returns).  Waits
    poll with 50 us sleeps (``--spin``: the transport's own spinning wait), so
    on an oversubscribed machine waiting ranks leave the cores to computing
    ones.  Two links:

    * ``loopback``: the machine's own shared memory.  A transfer is a memory
      copy by the same CPUs that compute; there is no full-duplex link to
      exploit, so no gain is expected (the bidirectional ring moves the same
      bytes per rank in twice as many messages, and computes each step as two
      half blocks).
    * ``emulated``: a full-duplex link of ``--link-gbps`` GB/s per direction
      (default 0.03) in front of every directed pair: each directed link
      carries one payload at a time, in sending order, ``bytes / bandwidth``
      seconds each; a payload's send and receive complete no earlier than
      that (the receiver learns the send time from an 8-byte stamp).  The
      default makes a unidirectional step's transfer (512 KiB, 17.5 ms) about
      4-8x the step's compute here (2-4 ms for one 128 x 128 block on a
      shared core), the regime of, e.g., H100s over 200 Gb/s InfiniBand at
      4k tokens per GPU with as many K/V heads as query heads (about 0.7 ms
      of block compute against 2.7 ms of transfer).

    Ratios ``critical_path_uni / critical_path_bidir`` (target >= 1.3 where
    communication dominates) and ``bytes_uni / bytes_bidir`` per link per step
    (target 2).

On CPUs without AVX-512 BF16 / AMX, torch's attention backward in bfloat16 or
float16 runs its GEMMs in the half type, 50-100x slower than float32 (SDPA and
the ring alike, the same kernel); ``--half-bwd-max-seq`` (default 4096) skips
those fwdbwd cases above that length.

``error``
    (not in the default sections) bfloat16 error against the rank count:
    for each ``--error-ranks`` P, one job (``mpiexec -n P``, every rank on
    ``--device``, one GPU per local rank modulo the GPUs there are) runs ring
    attention forward + backward on ``--error-seq`` tokens for each
    ``--error-layouts`` layout (default zigzag) and ``--error-causal`` mask
    (default causal), gathers
    out, dq, dk, dv and compares them on rank 0 with float64 SDPA on the whole
    sequence (same bf16-rounded inputs): relative Frobenius error
    ``||x - x64|| / ||x64||``, and that of single-process bfloat16 SDPA on the
    same device beside it.  Ratio ``err_ring / err_sdpa`` (target <= 1.5,
    flat in P: the blocks are merged in float32).

Roles ``ring2``, ``sdpa2``, ``bidir`` and ``error`` are the child jobs (``--role``);
each writes its JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _util import OneLineParser, find_mpiexec, float_in, int_in, ints_in, subset_of, writable_file  # noqa: E402

SECTIONS = ("single", "ranks2", "bidir", "error")
#: what runs without --sections
DEFAULT_SECTIONS = ("single", "ranks2", "bidir")
MODES = ("fwd", "fwdbwd")
TARGETS = {"single": 0.9, "ranks2": 0.8, "bidir": 1.3, "error": 1.5}
#: messages of at most this many bytes are argument agreement, not ring payload
SMALL_MESSAGE = 4096


# ------------------------------------------------------------------ shared
def _torch():
    import torch  # noqa: PLC0415

    return torch


def _nn(name):
    """A commlib.nn function (from the package, else from the submodule that defines it)."""
    import importlib  # noqa: PLC0415

    nn = importlib.import_module("commlib.nn")
    fn = getattr(nn, name, None)
    if fn is not None:
        return fn
    module = {"ring_attention": "ring", "ring_attention_bidirectional": "ring", "ulysses_attention": "ulysses",
              "hybrid_attention": "hybrid"}[name]
    return getattr(importlib.import_module(f"commlib.nn.{module}"), name)


def device_of(args, local_rank=0):
    """The torch device of this process (CUDA: one GPU per local rank)."""
    torch = _torch()
    if args.device == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def local_rank():
    for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK"):
        if v in os.environ:
            return int(os.environ[v])
    return 0


def sync(device):
    """Wait for the device's queued kernels (CUDA), so wall times measure them."""
    if device.type == "cuda":
        _torch().cuda.synchronize(device)


def inputs(args, L, dtype, seed, grad, device=None):
    """Random ``(B, L, H, D)`` q and dout, ``(B, L, Hkv, D)`` k and v."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(args.batch, L, h, args.head_dim, generator=g).to(device=device,  # noqa: E731
                                                                                  dtype=dtype)
    q, k, v, do = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, do


def sdpa(q, k, v, causal, scale):
    """torch SDPA on ``(B, L, H, D)`` tensors (through ``transpose(1, 2)`` views)."""
    import torch.nn.functional as F  # noqa: PLC0415, N812

    gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal, scale=scale, **gqa).transpose(1, 2)


def call(fn, q, k, v, do, mode):
    """One forward (no autograd graph) or forward + backward of ``fn(q, k, v)``."""
    torch = _torch()
    if mode == "fwd":
        with torch.no_grad():
            fn(q, k, v)
        return
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(do)


def dtype_of(name):
    return getattr(_torch(), name)


def quiet_barrier(comm):
    """A barrier whose waiting ranks sleep instead of spinning (fair on oversubscribed cores)."""
    req = comm.mpi_comm.Ibarrier()
    while not req.Test():
        time.sleep(2e-4)


def slowest(comm, x):
    from mpi4py import MPI  # noqa: PLC0415

    return comm.mpi_comm.allreduce(float(x), op=MPI.MAX)


# ------------------------------------------------------------- 1. single
def skipped(args, seq, dname, mode):
    """Half-precision backward on CPU above ``--half-bwd-max-seq`` (see the option)."""
    return (args.device == "cpu" and mode == "fwdbwd" and dname in ("bfloat16", "float16")
            and seq > args.half_bwd_max_seq)


def section_single(args, log=print):
    """ring_attention on one rank against SDPA, same process and threads."""
    torch = _torch()
    from mpi4py import MPI  # noqa: PLC0415

    from commlib import Communicator  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    comm = Communicator(MPI.COMM_SELF)
    device = device_of(args)
    ring = _nn("ring_attention")
    from commlib.nn._blocks import KERNELS as kernels  # noqa: PLC0415
    scale = args.head_dim ** -0.5
    rows = []
    for seq in args.seq_lens:
        for dname in args.dtypes:
            for causal in args.causal:
                for mode in args.modes:
                    if skipped(args, seq, dname, mode):
                        log(f"  single seq={seq:6d} {dname:8s} {mode}: skipped (--half-bwd-max-seq)")
                        continue
                    q, k, v, do = inputs(args, seq, dtype_of(dname), args.seed, mode == "fwdbwd", device)
                    fns = {
                        "sdpa": lambda q, k, v: sdpa(q, k, v, causal, scale),
                        "ring": lambda q, k, v: ring(q, k, v, comm, causal=causal, softmax_scale=scale,
                                                     timeout=args.timeout),
                    }
                    best = {n: math.inf for n in fns}
                    before = dict(kernels)
                    for it in range(args.warmup + args.trials):
                        for name in (("sdpa", "ring") if it % 2 == 0 else ("ring", "sdpa")):
                            sync(device)
                            t0 = time.perf_counter()
                            call(fns[name], q, k, v, do, mode)
                            sync(device)
                            t = time.perf_counter() - t0
                            if it >= args.warmup:
                                best[name] = min(best[name], t)
                    ran = sorted(k for k, n in kernels.items() if n > before.get(k, 0))
                    row = dict(seq=seq, dtype=dname, causal=causal, mode=mode, threads=args.threads,
                               device=str(device), kernels=ran,
                               sdpa_s=best["sdpa"], ring_s=best["ring"], ratio=best["sdpa"] / best["ring"])
                    rows.append(row)
                    log(f"  single seq={seq:6d} {dname:8s} {'causal' if causal else 'full  '} {mode:6s}: "
                        f"sdpa {row['sdpa_s'] * 1e3:9.1f} ms  ring {row['ring_s'] * 1e3:9.1f} ms  "
                        f"ratio {row['ratio']:.3f}x (target >= {TARGETS['single']}); ring's kernels: "
                        f"{','.join(ran)}")
                    del q, k, v, do
    return rows


# ------------------------------------------------------------- 2. ranks2
def role_sdpa2(args):
    """Child process: SDPA with --threads (2) on the full causal sequence."""
    torch = _torch()
    torch.set_num_threads(args.threads)
    scale = args.head_dim ** -0.5
    rows = []
    for seq in args.seq_lens:
        for dname in args.dtypes:
            for mode in args.modes:
                if skipped(args, seq, dname, mode):
                    continue
                q, k, v, do = inputs(args, seq, dtype_of(dname), args.seed, mode == "fwdbwd")
                best = math.inf
                for it in range(args.warmup + args.trials):
                    t0 = time.perf_counter()
                    call(lambda q, k, v: sdpa(q, k, v, True, scale), q, k, v, do, mode)
                    t = time.perf_counter() - t0
                    if it >= args.warmup:
                        best = min(best, t)
                rows.append(dict(seq=seq, dtype=dname, mode=mode, threads=torch.get_num_threads(), time_s=best))
    return rows


def role_ring2(args):
    """Child job (mpiexec -n 2): zigzag causal ring attention, 1 thread per rank."""
    torch = _torch()
    import commlib  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    comm = commlib.init()
    P = comm.size
    ring = _nn("ring_attention")
    scale = args.head_dim ** -0.5
    rows = []
    for seq in args.seq_lens:
        for dname in args.dtypes:
            for mode in args.modes:
                if skipped(args, seq, dname, mode):
                    continue
                q, k, v, do = inputs(args, seq // P, dtype_of(dname), args.seed + comm.rank, mode == "fwdbwd")
                fn = lambda q, k, v: ring(q, k, v, comm, causal=True, layout="zigzag",  # noqa: E731
                                          softmax_scale=scale, timeout=args.timeout)
                best = math.inf
                for it in range(args.warmup + args.trials):
                    quiet_barrier(comm)
                    t0 = time.perf_counter()
                    call(fn, q, k, v, do, mode)
                    t = slowest(comm, time.perf_counter() - t0)
                    if it >= args.warmup:
                        best = min(best, t)
                rows.append(dict(seq=seq, dtype=dname, mode=mode, ranks=P, threads=torch.get_num_threads(),
                                 time_s=best))
    return rows if comm.rank == 0 else None


def section_ranks2(args, log=print):
    """Driver: alternately one SDPA process (2 threads) and one 2-rank ring job (1 thread each)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        log("  ranks2: no mpiexec found; skipped")
        return None
    common = _child_common(args) + ["--seq-lens", ",".join(map(str, args.seq_lens_2))]
    sdpa_best, ring_best = {}, {}
    for rnd in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out_s, out_r = os.path.join(tmp, "s.json"), os.path.join(tmp, "r.json")
            _child([sys.executable, "-P", __file__, "--role", "sdpa2", "--threads", "2", "--out", out_s] + common,
                   args)
            _child([mpiexec, "--oversubscribe", "-n", "2", sys.executable, "-P", __file__, "--role", "ring2",
                    "--threads", "1", "--out", out_r] + common, args)
            for rows, best in ((json.load(open(out_s)), sdpa_best), (json.load(open(out_r)), ring_best)):
                for r in rows:
                    key = (r["seq"], r["dtype"], r["mode"])
                    best[key] = min(best.get(key, math.inf), r["time_s"])
        log(f"  ranks2 round {rnd + 1}/{args.rounds} done")
    for seq in args.seq_lens_2:
        for dname in args.dtypes:
            for mode in args.modes:
                if skipped(args, seq, dname, mode):
                    log(f"  ranks2 seq={seq:6d} {dname:8s} {mode}: skipped (--half-bwd-max-seq)")
    rows = []
    for key in sdpa_best:
        seq, dname, mode = key
        row = dict(seq=seq, dtype=dname, mode=mode, causal=True, layout="zigzag",
                   sdpa_2threads_s=sdpa_best[key], ring_2ranks_s=ring_best[key],
                   ratio=sdpa_best[key] / ring_best[key])
        rows.append(row)
        log(f"  ranks2 seq={seq:6d} {dname:8s} causal {mode:6s}: sdpa 2 threads {row['sdpa_2threads_s'] * 1e3:9.1f} ms"
            f"  ring 2x1 {row['ring_2ranks_s'] * 1e3:9.1f} ms  ratio {row['ratio']:.3f}x "
            f"(target >= {TARGETS['ranks2']})")
    return rows


# -------------------------------------------------------------- 3. bidir
def _nbytes(buf):
    n = getattr(buf, "nbytes", None)
    if n is None and hasattr(buf, "count") and hasattr(buf, "obj"):  # a Wire message
        return int(buf.count)
    if n is None and hasattr(buf, "element_size"):
        return int(buf.numel() * buf.element_size())
    return int(n or 0)


def recording_transport(inner, link_bps=None, sleepy=True, side=None):
    """A transport that forwards to ``inner``, logging every message and wait,
    optionally behind an emulated full-duplex link of ``link_bps`` bytes/s per
    direction (see the module notes).

    Link model: every directed link ``src -> dst`` carries one payload at a
    time, in the order they were sent; a payload of ``n`` bytes sent at ``t``
    occupies the link from ``max(t, link free)`` for ``n / link_bps`` seconds,
    and both its send and its receive complete no earlier than the end of
    that (and no earlier than the real transfer).  The receiver learns ``t``
    from an 8-byte time stamp the sender posts on ``side`` (an
    ``MPI.Comm``; ``time.perf_counter`` is the machine's monotonic clock,
    the same in every process of one node) with the payload's tag.

    Args:
        inner: the transport to forward to.
        link_bps: emulated bytes per second per direction (None: no emulation).
        sleepy: waits poll ``test()`` with 50 us sleeps instead of
            ``inner.waitall`` (which spins, yielding the core: with more
            ranks than cores a spinning rank still takes time slices from the
            ranks that compute).
        side: the communicator of the time stamps (needed with ``link_bps``).
    """
    import numpy as np  # noqa: PLC0415

    from commlib.transports.base import Request, Transport  # noqa: PLC0415

    class Delayed(Request):
        """A payload's request that completes when the emulated link has carried it."""

        def __init__(self, req, ready=None, stamp=None, link=None, nbytes=0):
            self.inner, self.ready = req, ready
            self._stamp, self._link, self._n = stamp, link, nbytes  # receive: (request, buffer), source

        def _resolve(self, block=False):
            if self.ready is None:
                req, buf = self._stamp
                if block:
                    req.Wait()
                elif not req.Test():
                    return False
                start = max(float(buf[0]), rec.free_in.get(self._link, 0.0))
                self.ready = rec.free_in[self._link] = start + self._n / link_bps
            return True

        def test(self):
            return self._resolve() and self.inner.test() and time.perf_counter() >= self.ready

        def wait(self, timeout=None):
            self.inner.wait(timeout)
            self._resolve(block=True)
            _sleep_until(self.ready)

    class Recording(Transport):
        name = "recording"

        def __init__(self):
            super().__init__()
            self.tags = inner.tags
            self.events = []  # (kind, peer, nbytes, t); ("wait", n_payload_recvs, n_requests, t_begin, t_end)
            self._kind = {}
            self.free_in, self.free_out = {}, {}
            self._stamps = []  # time stamps in flight: (request, buffer)

        @property
        def rank(self):
            return inner.rank

        @property
        def size(self):
            return inner.size

        def __getattr__(self, name):  # native collectives, capabilities...
            return getattr(inner, name)

        def isend(self, buf, dest, tag=0):
            n, now = _nbytes(buf), time.perf_counter()
            self.events.append(("send", dest, n, now))
            req = inner.isend(buf, dest, tag)
            if link_bps and n > SMALL_MESSAGE:
                stamp = np.array([now])
                self._stamps.append((side.Isend(stamp, dest, tag), stamp))
                start = max(now, self.free_out.get(dest, 0.0))
                self.free_out[dest] = start + n / link_bps
                req = Delayed(req, ready=self.free_out[dest])
            return req

        def irecv(self, buf, source, tag=0):
            n, now = _nbytes(buf), time.perf_counter()
            self.events.append(("recv", source, n, now))
            req = inner.irecv(buf, source, tag)
            if n > SMALL_MESSAGE:
                if link_bps:
                    stamp = np.empty(1)
                    req = Delayed(req, stamp=(side.Irecv(stamp, source, tag), stamp), link=source, nbytes=n)
                self._kind[id(req)] = req  # a payload receive (kept alive so the id stays unique)
            return req

        def waitall(self, requests, timeout=None, op="waitall"):
            t0 = time.perf_counter()
            reqs = list(requests)
            payload = sum(1 for r in reqs if id(r) in self._kind)
            if sleepy:  # test, then sleep: a waiting rank leaves the cores to the computing ones
                pending = reqs
                while pending:
                    pending = [r for r in pending if not r.test()]
                    if pending:
                        if timeout is not None and time.perf_counter() - t0 > timeout:
                            inner.waitall([getattr(r, "inner", r) for r in pending], 1e-3, op=op)  # CommTimeout
                        time.sleep(5e-5)
            else:
                inner.waitall([getattr(r, "inner", r) for r in reqs], timeout, op=op)
                for r in reqs:
                    if isinstance(r, Delayed):
                        r.wait()
            for r in reqs:
                self._kind.pop(id(r), None)
            self._stamps = [s for s in self._stamps if not s[0].Test()]
            self.events.append(("wait", payload, len(reqs), t0, time.perf_counter()))

    rec = Recording()
    return rec


def _sleep_until(t):
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 1e-3) if left > 2e-4 else 0)


def steps_of(events, t_start, t_end):
    """Per-step durations and per-step sent bytes per destination of one call on one rank.

    A ring step ends when this rank's wait for the step's K/V exchange returns:
    a wait on at least two requests of which at least one is a payload
    receive (the backward's waits for a single arriving dk/dv, or for sends
    alone, fall inside a step; its final wait for the dk/dv coming home ends
    the last step).  The step after the last such wait runs to the end of the
    call (the forward's last step computes without communicating)."""
    bounds = [t_start] + [e[4] for e in events if e[0] == "wait" and e[1] > 0 and e[2] >= 2] + [t_end]
    times = [b - a for a, b in zip(bounds, bounds[1:])]
    sent = [dict() for _ in times]
    for e in events:
        if e[0] == "send" and e[2] > SMALL_MESSAGE:
            k = max(0, min(len(times) - 1, sum(1 for b in bounds[1:-1] if b < e[3])))
            sent[k][e[1]] = sent[k].get(e[1], 0) + e[2]
    return times, sent


def role_bidir(args):
    """Child job (mpiexec -n 4): bidirectional vs unidirectional ring, alternating call by call."""
    torch = _torch()
    import commlib  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    comm = commlib.init()
    rank, P = comm.rank, comm.size
    device = device_of(args, local_rank())
    ring = _nn("ring_attention")
    base = comm.collective_transport()
    scale = args.head_dim ** -0.5
    links = [("loopback", None)] + ([("emulated", args.link_gbps * 1e9)] if args.link_gbps else [])
    side = comm.mpi_comm.Dup()  # the emulated link's time stamps
    results = []
    for seq in args.seq_lens:
        L = seq // P
        for dname in args.dtypes:
            for mode in args.modes:
                q, k, v, do = inputs(args, L, dtype_of(dname), args.seed + rank, mode == "fwdbwd", device)
                for link_name, bps in links:
                    tps = {bidi: recording_transport(base, bps, sleepy=not args.spin, side=side)
                           for bidi in (False, True)}
                    best = {}
                    for it in range(args.warmup + args.trials):
                        for bidi in ((False, True) if it % 2 == 0 else (True, False)):
                            tp = tps[bidi]
                            tp.events.clear()
                            sync(device)
                            quiet_barrier(comm)
                            t0 = time.perf_counter()
                            call(lambda q, k, v: ring(q, k, v, tp, causal=False, layout="contiguous",  # noqa: B023
                                                      softmax_scale=scale, bidirectional=bidi,
                                                      timeout=args.timeout), q, k, v, do, mode)
                            sync(device)
                            t1 = time.perf_counter()
                            if it < args.warmup:
                                continue
                            times, sent = steps_of(tp.events, t0, t1)
                            every = comm.mpi_comm.allgather((times, [{str(d): b for d, b in s.items()}
                                                                     for s in sent], t1 - t0))
                            nsteps = {len(e[0]) for e in every}
                            wall = max(e[2] for e in every)
                            if len(nsteps) == 1:
                                per_step = [max(e[0][s] for e in every) for s in range(nsteps.pop())]
                                crit = sum(per_step)
                            else:  # ranks saw different step counts: the slowest rank's total
                                per_step, crit = None, wall
                            rec = dict(critical_path_s=crit, wall_s=wall, per_step_max_s=per_step,
                                       sent=[e[1] for e in every])
                            if bidi not in best or crit < best[bidi]["critical_path_s"]:
                                best[bidi] = rec
                    if rank == 0:
                        row = dict(seq=seq, seq_local=L, dtype=dname, mode=mode, link=link_name,
                                   link_gbps=None if bps is None else bps / 1e9, causal=False, layout="contiguous",
                                   ranks=P, threads=torch.get_num_threads(),
                                   expected_kv_bytes_per_step=2 * args.batch * L * args.kv_heads * args.head_dim
                                   * dtype_of(dname).itemsize)
                        per_token = 2 * args.batch * args.kv_heads * args.head_dim * dtype_of(dname).itemsize
                        for bidi, name in ((False, "uni"), (True, "bidir")):
                            b = best[bidi]
                            sb, sl = schedule_bytes(P, L, "contiguous", bidi, per_token)
                            row[name] = dict(critical_path_s=b["critical_path_s"], wall_s=b["wall_s"],
                                             per_step_max_s=b["per_step_max_s"], schedule_kv_bytes_per_link_per_step=sb,
                                             schedule_directed_links=sl, **link_bytes(b["sent"], P))
                        row["critical_path_ratio"] = row["uni"]["critical_path_s"] / row["bidir"]["critical_path_s"]
                        row["wall_ratio"] = row["uni"]["wall_s"] / row["bidir"]["wall_s"]
                        mb, mu = row["bidir"]["max_bytes_per_link_per_step"], row["uni"]["max_bytes_per_link_per_step"]
                        row["bytes_per_link_per_step_ratio"] = mu / mb if mb else None
                        results.append(row)
    return results if rank == 0 else None


def link_bytes(sent_per_rank, P):
    """Bytes per directed link ``src -> dst`` in each step, from the messages sent.

    Args:
        sent_per_rank: for each rank, for each step, ``{dest: bytes}``.

    Returns:
        dict: ``max_bytes_per_link_per_step`` (the busiest directed link in
        the busiest step), ``bytes_per_link_per_step`` (per step, the max over
        directed links), ``directions`` (how many directed links carry data in
        a step, max over steps), ``total_bytes`` (all ranks, all steps) and
        ``comm_steps`` (steps in which any payload was sent).
    """
    nsteps = max(len(s) for s in sent_per_rank)
    per_step, directions = [], 0
    for k in range(nsteps):
        links = {}
        for src, steps in enumerate(sent_per_rank):
            if k < len(steps):
                for dst, b in steps[k].items():
                    links[(src, int(dst))] = links.get((src, int(dst)), 0) + b
        per_step.append(max(links.values(), default=0))
        directions = max(directions, len(links))
    comm_steps = sum(1 for b in per_step if b)
    total = sum(b for steps in sent_per_rank for s in steps for b in s.values())
    return dict(max_bytes_per_link_per_step=max(per_step, default=0), bytes_per_link_per_step=per_step,
                directions=directions, total_bytes=total, comm_steps=comm_steps)


def schedule_bytes(P, L, layout, bidirectional, per_token):
    """Forward K/V bytes per directed link per step, from the ring's schedule
    (:class:`commlib.collectives.attention.schedule.RingSchedule`): each
    stream's piece (the whole shard, or one half of it) goes to
    ``send_to(stream)``; ``per_token`` is the K+V bytes of one token."""
    from commlib.collectives.attention.schedule import RingSchedule, split_halves  # noqa: PLC0415

    links = {}
    for r in range(P):
        sched = RingSchedule(P, r, bidirectional and P > 1)
        halves = split_halves(layout, L) if sched.bidirectional else None
        for st in sched.streams:
            n = L if st.half is None else len(halves[st.half])
            key = (r, sched.send_to(st))
            links[key] = links.get(key, 0) + n * per_token
    return max(links.values()), len(links)


def section_bidir(args, log=print):
    mpiexec = find_mpiexec()
    if mpiexec is None:
        log("  bidir: no mpiexec found; skipped")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "b.json")
        cmd = [mpiexec, "--oversubscribe", "-n", str(args.bidir_ranks), sys.executable, "-P", __file__, "--role",
               "bidir", "--threads", "1", "--out", out, "--link-gbps", str(args.link_gbps), "--device", args.device,
               *(["--spin"] if args.spin else []),
               "--seq-lens", ",".join(map(str, args.bidir_seq_lens))] + _child_common(args, heads=False) + [
               "--heads", str(args.bidir_heads), "--kv-heads", str(args.bidir_heads),
               "--head-dim", str(args.bidir_head_dim)]
        _child(cmd, args)
        rows = json.load(open(out))
    for r in rows:
        u, b = r["uni"], r["bidir"]
        link = "loopback (shared memory)" if r["link"] == "loopback" else f"emulated {r['link_gbps']:g} GB/s/dir"
        log(f"  bidir P={r['ranks']} seq={r['seq']} (L={r['seq_local']}) {r['dtype']} {r['mode']:6s} {link}:")
        log(f"    bytes per link per step: uni {u['max_bytes_per_link_per_step']} ({u['directions']} directed links), "
            f"bidir {b['max_bytes_per_link_per_step']} ({b['directions']} directed links): "
            f"{r['bytes_per_link_per_step_ratio']:.2f}x less (target 2); schedule (forward K/V): uni "
            f"{u['schedule_kv_bytes_per_link_per_step']}, bidir {b['schedule_kv_bytes_per_link_per_step']}")
        if r["link_gbps"]:
            log(f"    emulated transfer per step (busiest link): uni "
                f"{u['max_bytes_per_link_per_step'] / (r['link_gbps'] * 1e9) * 1e3:.2f} ms, bidir "
                f"{b['max_bytes_per_link_per_step'] / (r['link_gbps'] * 1e9) * 1e3:.2f} ms")
        fmt = lambda xs: " ".join(f"{x * 1e3:.1f}" for x in xs) if xs else "n/a"  # noqa: E731
        log(f"    per-step max over ranks (ms): uni {fmt(u['per_step_max_s'])} | bidir {fmt(b['per_step_max_s'])}")
        log(f"    critical path: uni {u['critical_path_s'] * 1e3:8.2f} ms ({u['comm_steps']} comm steps), bidir "
            f"{b['critical_path_s'] * 1e3:8.2f} ms ({b['comm_steps']} comm steps): {r['critical_path_ratio']:.2f}x "
            f"(target >= {TARGETS['bidir']}); wall {r['wall_ratio']:.2f}x")
    return rows


# -------------------------------------------------------------- 4. error
def role_error(args):
    """Child job (mpiexec -n P): bf16 ring vs float64 and bf16 SDPA on rank 0, per layout and mask."""
    torch = _torch()
    import commlib  # noqa: PLC0415
    from commlib.nn import shard_sequence, unshard_sequence  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    comm = commlib.init()
    device = device_of(args, local_rank())
    ring = _nn("ring_attention")
    n, scale = args.error_seq, args.head_dim ** -0.5
    q, k, v, do = (x.detach().to(torch.bfloat16) for x in inputs(args, n, torch.float32, args.seed, False))
    rows = []
    for layout in args.error_layouts:
        for causal in args.error_causal:
            local = [shard_sequence(x.to(device), comm, layout).requires_grad_() for x in (q, k, v)]
            out = ring(*local, comm, causal=causal, layout=layout, softmax_scale=scale, timeout=args.timeout)
            grads = torch.autograd.grad((out * shard_sequence(do.to(device), comm, layout)).sum(), local)
            got = [unshard_sequence(x.detach(), comm, layout, timeout=args.timeout) for x in (out, *grads)]
            if comm.rank != 0:
                continue

            def sdpa_grads(dtype):
                xs = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
                o = sdpa(*xs, causal, scale)
                return [t.detach().to(torch.float64) for t in (o, *torch.autograd.grad((o * do.to(o)).sum(), xs))]

            exact, base = sdpa_grads(torch.float64), sdpa_grads(torch.bfloat16)
            row = dict(ranks=comm.size, seq=n, dtype="bfloat16", layout=layout, causal=causal, device=str(device))
            for name, g, e, b in zip(("out", "dq", "dk", "dv"), got, exact, base):
                err = ((g.to(torch.float64) - e).norm() / e.norm()).item()
                ref = ((b - e).norm() / e.norm()).item()
                row[name] = dict(ring=err, sdpa=ref, ratio=err / ref)
            rows.append(row)
    return rows if comm.rank == 0 else None


def section_error(args, log=print):
    """Driver: one ``--role error`` job per rank count."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        log("  error: no mpiexec found; skipped")
        return None
    rows = []
    for P in args.error_ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "e.json")
            _child([mpiexec, "--oversubscribe", "-n", str(P), sys.executable, "-P", __file__, "--role", "error",
                    "--out", out, "--device", args.device, "--error-seq", str(args.error_seq),
                    "--error-layouts", ",".join(args.error_layouts),
                    "--error-causal", ",".join(str(c).lower() for c in args.error_causal),
                    "--threads", str(args.threads)] + _child_common(args), args)
            got = json.load(open(out))
        for r in got:
            log(f"  error P={P} seq={r['seq']} bf16 {r['layout']}{' causal' if r['causal'] else ''} ({r['device']}): "
                + "  ".join(f"{name} {r[name]['ring']:.2e}/{r[name]['sdpa']:.2e}={r[name]['ratio']:.2f}x"
                            for name in ("out", "dq", "dk", "dv")) + f" (ring/SDPA, target <= {TARGETS['error']})")
        rows.extend(got)
    if rows:
        ratios = [r[name]["ratio"] for r in rows if r["ranks"] > 1 for name in ("out", "dq", "dk", "dv")]
        if ratios:
            log(f"  error ratio over P > 1, every layout and mask above: {min(ratios):.2f}-{max(ratios):.2f}x "
                f"(target <= {TARGETS['error']}: {'met' if max(ratios) <= TARGETS['error'] else 'NOT met'})")
    return rows


# ------------------------------------------------------------- driver
def _child_common(args, heads=True):
    out = ["--dtypes", ",".join(args.dtypes), "--modes", ",".join(args.modes), "--batch", str(args.batch),
           "--half-bwd-max-seq", str(args.half_bwd_max_seq),
           "--trials", str(args.trials), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--timeout", str(args.timeout)]
    if heads:
        out += ["--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)]
    return out


def _child(cmd, args):
    # no variable of an enclosing MPI job; a machine's own MCA settings (OMPI_MCA_*,
    # e.g. a launcher agent for a machine without ssh) are kept
    env = {k: v for k, v in os.environ.items()
           if k.startswith("OMPI_MCA_") or not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise RuntimeError(f"child failed ({res.returncode}): {' '.join(cmd)}")


def _bools_list(text):
    items = list(dict.fromkeys(s.strip().lower() for s in text.split(",") if s.strip()))
    if not items or any(s not in ("true", "false") for s in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of true,false, got {text!r}")
    return [s == "true" for s in items]


def _bools(text):
    try:
        return {"both": [False, True], "true": [True], "false": [False]}[text]
    except KeyError:
        raise argparse.ArgumentTypeError(f"choose from both,true,false, got {text!r}") from None


def parse_args(argv=None):
    ap = OneLineParser(prog="bench_attention.py --backend torch", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tokens = ints_in(1, 1 << 24, "tokens")
    ap.add_argument("--backend", choices=("torch",), default="torch", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: sections single, bidir and error "
                    "on GPUs (one per local rank)")
    ap.add_argument("--sections", type=subset_of(SECTIONS), default=",".join(DEFAULT_SECTIONS),
                    help="comma-separated, of: " + ", ".join(SECTIONS))
    ap.add_argument("--seq-lens", type=tokens, default="4096,8192", help="section single: tokens (4k-16k)")
    ap.add_argument("--seq-lens-2", type=tokens, default="8192,16384", help="section ranks2: global tokens")
    ap.add_argument("--bidir-seq-lens", type=tokens, default="512,2048", help="section bidir: global tokens "
                    "(512: 128 per rank, communication-bound on the emulated link; 2048: compute weighs more)")
    ap.add_argument("--bidir-ranks", type=int_in(2, 64, "ranks"), default=4)
    ap.add_argument("--error-ranks", type=ints_in(1, 64, "ranks"), default="1,2,4", help="section error: rank counts, one job each")
    ap.add_argument("--error-seq", type=int_in(1, 1 << 24, "tokens"), default=2048, help="section error: global tokens (divisible by "
                    "2 x each rank count)")
    ap.add_argument("--error-layouts", type=subset_of(("contiguous", "zigzag", "striped")), default="zigzag",
                    help="section error: sequence layouts (comma-separated)")
    ap.add_argument("--error-causal", type=_bools_list, default="true",
                    help="section error: comma-separated subset of true,false (causal masks to run)")
    ap.add_argument("--bidir-heads", type=int_in(1, 1024, "heads"), default=8, help="section bidir: heads = kv heads")
    ap.add_argument("--bidir-head-dim", type=int_in(1, 4096, "features"), default=64)
    ap.add_argument("--link-gbps", type=float_in(0, 1e4, "GB/s", lo_ok=True), default=0.03, help="section bidir: emulated link bandwidth per "
                    "direction in GB/s (the module's docstring explains the choice); 0: loopback only")
    ap.add_argument("--spin", action="store_true", help="section bidir: wait with the transport's own waitall "
                    "(spins, yielding) instead of test-and-sleep polling")
    ap.add_argument("--dtypes", type=subset_of(("float32", "bfloat16", "float16", "float64")),
                    default="float32,bfloat16")
    ap.add_argument("--causal", type=_bools, default="both", metavar="{both,true,false}",
                    help="section single")
    ap.add_argument("--modes", type=subset_of(MODES), default=",".join(MODES), help="fwd, fwdbwd (forward + backward)")
    ap.add_argument("--half-bwd-max-seq", type=int_in(0, 1 << 24, "tokens"), default=4096, help="sections single and ranks2 on CPU: skip "
                    "bfloat16/float16 fwdbwd above this many tokens (torch's CPU attention backward runs its "
                    "GEMMs in the half type: about 80x slower than float32 without AVX-512 BF16/AMX)")
    ap.add_argument("--batch", type=int_in(1, 4096, "sequences"), default=1)
    ap.add_argument("--heads", type=int_in(1, 1024, "heads"), default=8)
    ap.add_argument("--kv-heads", type=int_in(1, 1024, "heads"), default=8)
    ap.add_argument("--head-dim", type=int_in(1, 4096, "features"), default=64)
    ap.add_argument("--threads", type=int_in(1, 1024, "threads"), default=1, help="section single: torch threads for both")
    ap.add_argument("--trials", type=int_in(1, 100000, "trials"), default=3, help="timed calls per implementation (best kept)")
    ap.add_argument("--warmup", type=int_in(0, 100000, "calls"), default=1)
    ap.add_argument("--rounds", type=int_in(1, 1000, "rounds"), default=2, help="section ranks2: alternations of the two jobs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float_in(0, 86400, "seconds"), default=600.0, help="seconds per ring wait")
    ap.add_argument("--child-timeout", type=float_in(0, 86400 * 7, "seconds"), default=3600.0, help="seconds per child job")
    ap.add_argument("--json", metavar="PATH", type=writable_file, help="write the results")
    ap.add_argument("--plot", metavar="PATH", type=writable_file, help="PNG: the ratios against their targets")
    ap.add_argument("--role", choices=("ring2", "sdpa2", "bidir", "error"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads:
        ap.error(f"--kv-heads {a.kv_heads} does not divide --heads {a.heads}")
    if a.device == "cuda" and "ranks2" in a.sections and not a.role:
        ap.error("section ranks2 compares CPU threads with CPU ranks: leave it out with --device cuda "
                 "(--sections single,bidir)")
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.role:
        res = {"ring2": role_ring2, "sdpa2": role_sdpa2, "bidir": role_bidir, "error": role_error}[args.role](args)
        if res is not None:
            with open(args.out, "w", encoding="utf-8") as fh:
                json.dump(res, fh)
        return 0
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
        print("bench_attention --backend torch: run it serially (it launches its own MPI jobs)", file=sys.stderr)
        return 2
    torch = _torch()
    res = dict(bench="attention_torch", device=args.device, torch=torch.__version__, cores=os.cpu_count(),
               load_avg_start=os.getloadavg(), batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
               head_dim=args.head_dim, trials=args.trials, warmup=args.warmup, targets=TARGETS)
    print(f"bench_attention --backend torch: torch {torch.__version__}, {os.cpu_count()} cores, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, B={args.batch} H={args.heads}/{args.kv_heads} "
          f"D={args.head_dim}, best of {args.trials} after {args.warmup} warm-up")
    if "single" in args.sections:
        print(f"single rank, {args.threads} thread(s): ring_attention vs SDPA (ratio t_sdpa / t_ring)")
        res["single"] = section_single(args)
    if "ranks2" in args.sections:
        print("2 ranks x 1 thread, zigzag causal ring vs 1 process SDPA x 2 threads (ratio t_sdpa / t_ring)")
        res["ranks2"] = section_ranks2(args)
    if "bidir" in args.sections:
        print(f"{args.bidir_ranks} ranks x 1 thread (oversubscribed on {os.cpu_count()} cores), non-causal "
              f"contiguous: bidirectional vs unidirectional ring")
        res["bidir"] = section_bidir(args)
    if "error" in args.sections:
        print(f"bfloat16 error against the rank count ({args.device}): ring vs float64, beside bf16 SDPA")
        res["error"] = section_error(args)
    res["load_avg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    if args.plot:
        plot(res, args.plot)
    return 0


def plot(res, path):
    """Bar chart of every ratio with its target line."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
    bars = []  # (label, ratio, target, section)
    for r in res.get("single") or []:
        bars.append((f"1 rank x{r.get('threads', 1)}t {r['seq']} {short[r['dtype']]} "
                     f"{'causal' if r['causal'] else 'full'} {r['mode']}",
                     r["ratio"], TARGETS["single"], "single"))
    for r in res.get("ranks2") or []:
        bars.append((f"2x1 vs 1x2 {r['seq']} {short[r['dtype']]} {r['mode']}", r["ratio"], TARGETS["ranks2"],
                     "ranks2"))
    for r in res.get("bidir") or []:
        tag = "loopback" if r["link"] == "loopback" else f"{r['link_gbps']:g} GB/s"
        bars.append((f"bidir {r['seq']} {short[r['dtype']]} {r['mode']} {tag}: path", r["critical_path_ratio"],
                     TARGETS["bidir"], "bidir"))
        if r["link"] == "loopback" and r["bytes_per_link_per_step_ratio"]:
            bars.append((f"bidir {r['seq']} {short[r['dtype']]} {r['mode']}: bytes/link/step",
                         r["bytes_per_link_per_step_ratio"], 2.0, "bidir"))
    if not bars:
        return
    colors = {"single": "C0", "ranks2": "C1", "bidir": "C2"}
    fig, ax = plt.subplots(figsize=(max(8, 0.36 * len(bars) + 2), 6))
    x = range(len(bars))
    ax.bar(x, [b[1] for b in bars], color=[colors[b[3]] for b in bars])
    for i, b in enumerate(bars):
        ax.hlines(b[2], i - 0.45, i + 0.45, colors="k", linestyles="--", lw=1)
    ax.set_xticks(list(x))
    ax.set_xticklabels([b[0] for b in bars], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("ratio (higher is better; dashes: target)")
    ax.set_title(f"commlib.nn attention vs torch SDPA, CPU ({res['cores']} cores), torch {res['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
