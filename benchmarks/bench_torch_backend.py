"""torch.distributed over commlib against gloo: all_reduce latency and bus bandwidth, a DDP step.

One job, two process groups over the same ranks: the default group on the
``"commlib"`` backend and a second one made by ``dist.new_group(backend="gloo")``.
Both run side by side, alternating, so that the ratios mean something on a
shared machine where absolute times do not.

- ``all_reduce``: ``dist.all_reduce`` of a float32 tensor, SUM, for each size of
  ``--sizes`` (bytes; default 8 B, then powers of 4 from 64 B to 64 MiB).  Per size
  each backend is checked once (every rank gives ``rank + 1``: the sum is exact),
  warmed up, then timed in ``--reps`` repetitions that alternate commlib / gloo,
  each repetition ~60 ms of untimed calls (this VM's memory bandwidth ramps up
  over ~50 ms of busy time after an idle spell, and each repetition follows the
  other backend's), a barrier on the group under test and ~20 ms of
  back-to-back timed calls (fewer repetitions at large sizes, within ~4 s a
  size).  A repetition's
  time is the slowest rank's mean per call; the latency is the median over the
  repetitions.  busbw = 2 (n - 1) / n * bytes / time (the bytes each rank moves in
  a ring all-reduce; nccl-tests' factor).  ratio = gloo time / commlib time,
  against the targets at 2 ranks: >= 10x at 8 B-64 KiB, >= 3x at 1-64 MiB.
- ``ddp``: ``DistributedDataParallel`` training steps (forward, MSE loss, backward
  with DDP's bucketed all-reduces, SGD) of an MLP of ``--ddp-layers`` float32
  Linear layers of ``--ddp-width`` (4.2 M parameters by default), one copy of the
  model on each backend from the same initial weights and batches; ``--ddp-reps``
  alternating repetitions of an untimed step and ``--ddp-steps`` timed steps; steps/s (median) and the ratio
  commlib / gloo against the target >= 1.3x.  The two copies' parameters are
  compared at the end (they saw the same data: they differ only by rounding).

Launchers, detected from the environment:

- ``mpiexec -n N python -P benchmarks/bench_torch_backend.py``: the commlib group
  from ``commlib.nn.init_process_group()`` (MPI; rank 0 serves the TCPStore the
  gloo group needs);
- ``torchrun --nproc-per-node N benchmarks/bench_torch_backend.py``:
  ``dist.init_process_group("commlib")`` with ``env://`` (commlib's TCP transport);
- neither: one process (an MPI singleton), for a smoke test only.

torch's intra-op threads are set to cores / ranks on this node (``--threads``),
the same for both backends.  ``--profile`` adds, on the default group, the
time per 8-byte call of each layer under ``dist.all_reduce`` (torch's
dispatch, the backend's ``ProcessGroup.allreduce``, the communicator's
``allreduce``, and MPI's ``Allreduce`` under mpiexec) and rank 0's cProfile of
those calls.

Run::

    mpiexec --oversubscribe -n 2 python -P benchmarks/bench_torch_backend.py --json tb2.json --plot tb2.png
    torchrun --nproc-per-node 2 benchmarks/bench_torch_backend.py --json tb2_torchrun.json
    mpiexec -n 2 python -P benchmarks/bench_torch_backend.py --quick --sizes 8
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, int_in, writable_file, write_json  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = [8] + [64 * 4 ** k for k in range(11)]  # 8 B, 64 B .. 64 MiB
QUICK_SIZES = [8, 64 * KIB, 1 * MIB]
REP_SECONDS = 0.02  # calls per repetition: about this long for each backend
#: untimed calls before each repetition, about this long: this VM's memory bandwidth ramps up over
#: ~50 ms of busy time after an idle spell (a 64 MiB numpy copy: 10 ms after a 0.1 s sleep, 4.6 ms
#: from the fifth on), and each backend's repetition follows the other's (gloo's is mostly idle
#: waiting); without them the repetition after it measured the ramp (64 MiB: 18 ms, against 12.5
#: ms back to back)
WARM_SECONDS = 0.06
SIZE_SECONDS = 4.0  # repetitions per size: fewer when they would take longer than this
#: the issue's targets at 2 ranks: (lowest bytes, highest bytes, gloo time / commlib time)
TARGETS = [(8, 64 * KIB, 10.0), (1 * MIB, 64 * MIB, 3.0)]
DDP_TARGET = 1.3


def _sizes_arg(text):
    """argparse type: comma-separated message sizes in bytes, each a multiple of 4 (float32)
    in 4..1 GiB; ``K``/``M`` suffixes (KiB, MiB) accepted."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        mult = {"k": KIB, "m": MIB}.get(item[-1].lower(), 1)
        num = item[:-1] if mult > 1 else item
        try:
            v = int(num) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated sizes in bytes (e.g. 8,64K,1M), "
                                             f"got {item!r}") from None
        if not 4 <= v <= 1 << 30 or v % 4:
            raise argparse.ArgumentTypeError(f"each size must be a multiple of 4 bytes (float32) in 4..{1 << 30}, "
                                             f"got {item}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes in bytes, got {text!r}")
    return sorted(set(out))


def _target(nbytes):
    for lo, hi, want in TARGETS:
        if lo <= nbytes <= hi:
            return want
    return None


def _launcher():
    """``torchrun``, ``mpiexec`` (any MPI launcher: mpiexec, srun) or ``none``, from the environment."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ):
        return "torchrun"
    if any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK",
                                     "HYDRA_CONTROL_FD")):
        return "mpiexec"
    return "none"


def _local_ranks(launcher):
    keys = {"torchrun": ("LOCAL_WORLD_SIZE",),
            "mpiexec": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")}.get(launcher, ())
    for k in keys:
        try:
            return max(1, int(os.environ[k]))
        except (KeyError, ValueError):
            continue
    return 1


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (None, a flag's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def main(argv=None):
    ap = OneLineParser(description=__doc__.split("\n\n")[0], epilog="targets at 2 ranks: all_reduce >= 10x gloo "
                       "at 8 B-64 KiB, >= 3x at 1-64 MiB; DDP steps/s >= 1.3x gloo",
                       formatter_class=_Help)
    ap.add_argument("--sizes", type=_sizes_arg, default=None,
                    help="comma-separated all_reduce sizes in bytes, multiples of 4 (K = KiB, M = MiB) "
                         "(default: 8 B, then powers of 4 from 64 B to 64 MiB; --quick: 8,64K,1M)")
    ap.add_argument("--reps", type=int_in(1, 10000, "repetitions"), default=15,
                    help="timed repetitions per size and backend, alternating (fewer at large sizes, "
                         f"within ~{SIZE_SECONDS:g} s a size); the median is reported")
    ap.add_argument("--ddp-steps", type=int_in(0, 100000, "steps"), default=5,
                    help="DDP training steps per repetition (0: no DDP section)")
    ap.add_argument("--ddp-reps", type=int_in(1, 10000, "repetitions"), default=9,
                    help="DDP repetitions per backend, alternating; the median steps/s is reported")
    ap.add_argument("--ddp-width", type=int_in(8, 16384, "features"), default=1024,
                    help="width of the DDP model's square Linear layers (1024 x 4 layers: 4.2 M parameters)")
    ap.add_argument("--ddp-layers", type=int_in(1, 64, "layers"), default=4, help="Linear layers of the DDP model")
    ap.add_argument("--ddp-batch", type=int_in(1, 1 << 20, "samples"), default=64,
                    help="samples per rank per DDP step")
    ap.add_argument("--threads", type=int_in(1, 4096, "threads"), default=None,
                    help="torch intra-op threads per rank (default: CPU cores / ranks on this node, at least 1)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: sizes 8,64K,1M unless --sizes, 3 repetitions, 2 DDP repetitions of 2 steps "
                         "of a 256-wide model (figures not meaningful)")
    ap.add_argument("--profile", action="store_true",
                    help="also time each layer under an 8-byte dist.all_reduce on the commlib group "
                         "(torch dispatch, ProcessGroup.allreduce, the communicator, MPI) and print rank 0's "
                         "cProfile of those calls")
    ap.add_argument("--json", type=writable_file, default=None,
                    help="write the machine, every row and the DDP figures to this JSON file")
    ap.add_argument("--plot", type=writable_file, default=None,
                    help="PNG: latency of both backends and the gloo / commlib ratio against message size")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or QUICK_SIZES
        args.reps = min(args.reps, 3)
        args.ddp_reps, args.ddp_steps = min(args.ddp_reps, 2), min(args.ddp_steps, 2)
        args.ddp_width = min(args.ddp_width, 256)
    args.sizes = args.sizes or DEFAULT_SIZES
    return run(args)


# ------------------------------------------------------------------ set-up
def _start(launcher):
    """Start torch.distributed on commlib (the default group) and a gloo group of the same
    ranks; returns (gloo group, what the commlib group runs over)."""
    import torch.distributed as dist  # noqa: PLC0415

    import commlib.nn  # noqa: PLC0415 - registers the "commlib" backend

    if launcher == "torchrun":
        dist.init_process_group("commlib", init_method="env://")
    else:
        commlib.nn.init_process_group()
    gloo = dist.new_group(backend="gloo")
    return gloo, repr(commlib.nn.communicator_of())


def _max_over_ranks(values):
    """Element-wise maximum of a list of floats over the ranks (over the gloo group: neutral)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ------------------------------------------------------------------ all_reduce
def bench_allreduce(args, gloo, rank, n):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    groups = {"commlib": None, "gloo": gloo}
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    rows = []
    if rank == 0:
        print(f"{'bytes':>10}  {'commlib us':>11}  {'gloo us':>11}  {'commlib busbw':>13}  {'gloo busbw':>11}  "
              f"{'gloo/commlib':>12}  target", flush=True)
    for nbytes in args.sizes:
        count = nbytes // 4
        bufs = {}
        for name, grp in groups.items():  # checked once: every rank gives rank + 1, the sum is exact
            x = torch.full((count,), float(rank + 1), dtype=torch.float32)
            dist.all_reduce(x, group=grp)
            want = n * (n + 1) / 2
            if not bool((x == want).all()):
                bad = x[x != want][:3].tolist()
                raise SystemExit(f"bench_torch_backend: {name} all_reduce is wrong at {nbytes} B on rank {rank}: "
                                 f"expected {want}, got {bad}")
            bufs[name] = torch.zeros(count, dtype=torch.float32)  # zeros: the sum stays zero, no reset
        est = []
        for name, grp in groups.items():  # warm-up, then an estimate of one call: sets calls per repetition
            x = bufs[name]
            dist.all_reduce(x, group=grp)
            one = []
            for _ in range(5):  # the fastest of 5: a rank descheduled once (ms) must not set it
                t = time.perf_counter()
                dist.all_reduce(x, group=grp)
                one.append(time.perf_counter() - t)
            est.append(min(one))
        est = _max_over_ranks(est)  # every rank must make the same number of calls
        iters = [max(1, min(1000, round(REP_SECONDS / max(e, 1e-7)))) for e in est]
        pair = sum(i * e for i, e in zip(iters, est))
        reps = max(min(args.reps, 3), min(args.reps, int(SIZE_SECONDS / max(pair, 1e-9))))
        warm = [max(1, min(1000, round(WARM_SECONDS / max(e, 1e-7)))) for e in est]
        times = {name: [] for name in groups}
        for _ in range(reps):
            for (name, grp), it, w in zip(groups.items(), iters, warm):
                x = bufs[name]
                for _ in range(w):
                    dist.all_reduce(x, group=grp)
                dist.barrier(group=grp)
                t = time.perf_counter()
                for _ in range(it):
                    dist.all_reduce(x, group=grp)
                times[name].append((time.perf_counter() - t) / it)
        slowest = _max_over_ranks(times["commlib"] + times["gloo"])  # per repetition: the slowest rank's
        times = {"commlib": slowest[:reps], "gloo": slowest[reps:]}
        row = {"bytes": nbytes, "count": count, "iters": dict(zip(groups, iters)), "reps": reps}
        for name in groups:
            med = statistics.median(times[name])
            row[name] = {"time_us": med * 1e6, "min_us": min(times[name]) * 1e6, "max_us": max(times[name]) * 1e6,
                         "busbw_GBps": factor * nbytes / med / 1e9}
        row["ratio"] = row["gloo"]["time_us"] / row["commlib"]["time_us"]
        want = _target(nbytes)
        row["target"], row["met"] = want, (row["ratio"] >= want) if want is not None else None
        rows.append(row)
        if rank == 0:
            verdict = "-" if want is None else f">= {want:g}x {'met' if row['met'] else 'NOT MET'}"
            print(f"{nbytes:>10}  {row['commlib']['time_us']:>11.1f}  {row['gloo']['time_us']:>11.1f}  "
                  f"{row['commlib']['busbw_GBps']:>9.3f} GB/s  {row['gloo']['busbw_GBps']:>6.3f} GB/s  "
                  f"{row['ratio']:>11.2f}x  {verdict}", flush=True)
        del bufs
    return rows


# ------------------------------------------------------------------ DDP
def bench_ddp(args, gloo, rank, n):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    d, layers, batch = args.ddp_width, args.ddp_layers, args.ddp_batch
    def mlp():
        mods = []
        for i in range(layers):
            mods += [torch.nn.Linear(d, d)] + ([torch.nn.ReLU()] if i < layers - 1 else [])
        return torch.nn.Sequential(*mods)

    torch.manual_seed(1234)
    base = mlp()
    params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the batch
    data = [(torch.randn(batch, d, generator=gen), torch.randn(batch, d, generator=gen)) for _ in range(4)]
    models, opts = {}, {}
    for name, grp in (("commlib", None), ("gloo", gloo)):
        m = mlp()
        m.load_state_dict(base.state_dict())  # the same initial weights in both copies
        models[name] = DDP(m, process_group=grp)
        opts[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)
    step_no = {"commlib": 0, "gloo": 0}

    def step(name):
        model, opt = models[name], opts[name]
        x, y = data[step_no[name] % len(data)]
        step_no[name] += 1
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # returns once DDP's bucket all-reduces are done
        opt.step()

    for name in models:  # warm-up: DDP's first iterations rebuild its buckets
        for _ in range(2):
            step(name)
    rates = {name: [] for name in models}
    for _ in range(args.ddp_reps):
        for name, grp in (("commlib", None), ("gloo", gloo)):
            step(name)  # untimed: the host's ramp after the other backend's repetition (WARM_SECONDS)
            dist.barrier(group=grp)
            t = time.perf_counter()
            for _ in range(args.ddp_steps):
                step(name)
            rates[name].append(time.perf_counter() - t)
    slowest = _max_over_ranks(rates["commlib"] + rates["gloo"])
    k = args.ddp_reps
    sps = {"commlib": [args.ddp_steps / s for s in slowest[:k]], "gloo": [args.ddp_steps / s for s in slowest[k:]]}
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(models["commlib"].parameters(),
                                                          models["gloo"].parameters()))
    scale = max(float(p.detach().abs().max()) for p in models["gloo"].parameters())
    res = {"params": params, "width": d, "layers": layers, "batch_per_rank": batch, "steps_per_rep": args.ddp_steps,
           "reps": k, "grad_bytes": params * 4,
           "commlib": {"steps_per_s": statistics.median(sps["commlib"]), "all": sps["commlib"]},
           "gloo": {"steps_per_s": statistics.median(sps["gloo"]), "all": sps["gloo"]},
           "max_param_diff": diff, "param_scale": scale}
    res["ratio"] = res["commlib"]["steps_per_s"] / res["gloo"]["steps_per_s"]
    res["target"], res["met"] = DDP_TARGET, res["ratio"] >= DDP_TARGET
    return res


# ------------------------------------------------------------------ profile
def profile_small(rank, n, launcher, calls=2000):
    """Seconds per 8-byte call at each layer under ``dist.all_reduce`` on the commlib group,
    then rank 0's cProfile of ``calls`` ``dist.all_reduce`` calls."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import commlib.nn  # noqa: PLC0415

    comm = commlib.nn.communicator_of()
    pg = dist.group.WORLD
    t = torch.zeros(2, dtype=torch.float32)
    a = t.numpy()
    sync, async_ = dist.AllreduceOptions(), dist.AllreduceOptions()
    sync.reduceOp = async_.reduceOp = dist.ReduceOp.SUM
    sync.asyncOp, async_.asyncOp = False, True  # dist.all_reduce's; DDP's (torch's default options)
    layers = {
        "async: ProcessGroup.allreduce+wait": lambda: pg.allreduce([t], async_).wait(),
        "dist.all_reduce": lambda: dist.all_reduce(t),
        "ProcessGroup.allreduce + wait": lambda: pg.allreduce([t], sync).wait(),
        "communicator allreduce (numpy)": lambda: comm.allreduce(a, op="sum"),
    }
    mpi_comm = getattr(comm, "mpi_comm", None)
    if mpi_comm is not None:
        from mpi4py import MPI  # noqa: PLC0415

        out = a.copy()
        layers["MPI Allreduce (mpi4py)"] = lambda: mpi_comm.Allreduce(a, out, MPI.SUM)
    res = {}
    for _ in range(2):  # the second round is kept: the first warms up
        for name, fn in layers.items():
            for _ in range(50):
                fn()
            best = math.inf
            for _ in range(5):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls // 5):
                    fn()
                best = min(best, (time.perf_counter() - t0) / (calls // 5))
            res[name] = best
    slowest = _max_over_ranks(list(res.values()))
    res = dict(zip(res, slowest))
    prof = cProfile.Profile() if rank == 0 else None
    dist.barrier()
    if prof is not None:
        prof.enable()
    for _ in range(calls):
        dist.all_reduce(t)
    if prof is not None:
        prof.disable()
    text = None
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        text = s.getvalue()
        names = list(res)
        print(f"\nper 8-byte call on the commlib group ({launcher}, {n} ranks; best of 5 x {calls // 5} calls, "
              "the slowest rank's):", flush=True)
        for i, k in enumerate(names):
            below = f"  (+{(res[k] - res[names[i + 1]]) * 1e6:.1f} us over the layer below)" \
                if 0 < i < len(names) - 1 else "  (asyncOp=True, as DDP calls it: the worker thread)" if i == 0 else ""
            print(f"  {k:<32} {res[k] * 1e6:8.1f} us{below}")
        print(f"\nrank 0's cProfile of {calls} dist.all_reduce calls of 8 B (by own time):")
        print(text)
    return {"seconds_per_call": res, "cprofile_top": text}


# ------------------------------------------------------------------ the run
def run(args):
    launcher = _launcher()
    local = _local_ranks(launcher)
    threads = args.threads or max(1, (os.cpu_count() or 1) // local)

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(threads)
    gloo, over = _start(launcher)
    rank, n = dist.get_rank(), dist.get_world_size()
    load_start = os.getloadavg()
    if rank == 0:
        note = "" if n == 2 else f" (the targets are set for 2 ranks; shown for reference at {n})"
        print(f"bench_torch_backend: {launcher}, {n} ranks, torch {torch.__version__}, {os.cpu_count()} CPUs, "
              f"{threads} torch thread(s) a rank, load {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}"
              f"{note}\ncommlib group over {over}", flush=True)
        if launcher == "none":
            print("(no launcher: one process; run under mpiexec or torchrun for figures)", flush=True)
    rows = bench_allreduce(args, gloo, rank, n)
    ddp = None
    if args.ddp_steps:
        ddp = bench_ddp(args, gloo, rank, n)
        if rank == 0:
            print(f"\nDDP step, MLP {ddp['layers']} x Linear({ddp['width']}, {ddp['width']}) float32, "
                  f"{ddp['params'] / 1e6:.2f} M parameters, batch {ddp['batch_per_rank']} a rank, "
                  f"{ddp['reps']} x {ddp['steps_per_rep']} steps each:\n"
                  f"  commlib {ddp['commlib']['steps_per_s']:.2f} steps/s, gloo {ddp['gloo']['steps_per_s']:.2f} "
                  f"steps/s, ratio {ddp['ratio']:.2f}x (target >= {DDP_TARGET:g}x: "
                  f"{'met' if ddp['met'] else 'NOT MET'}); parameters of the two copies differ by at most "
                  f"{ddp['max_param_diff']:.1e} (scale {ddp['param_scale']:.2g})", flush=True)
    prof = profile_small(rank, n, launcher) if args.profile else None
    load_end = os.getloadavg()
    if rank == 0:
        small = [r for r in rows if r["target"] == TARGETS[0][2]]
        large = [r for r in rows if r["target"] == TARGETS[1][2]]
        summary = {"min_ratio_8B_64KiB": min((r["ratio"] for r in small), default=None),
                   "min_ratio_1MiB_64MiB": min((r["ratio"] for r in large), default=None),
                   "all_reduce_targets_met": all(r["met"] for r in small + large) if small + large else None,
                   "ddp_ratio": ddp["ratio"] if ddp else None, "ddp_target_met": ddp["met"] if ddp else None}
        print(f"\nload average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
        mins = "; ".join(f"min ratio {k[10:].replace('_', '-')}: {v:.2f}x"
                         for k, v in summary.items() if k.startswith("min_ratio") and v is not None)
        print(f"summary ({n} ranks, {launcher}): {mins or 'no targeted size'}"
              + (f"; DDP {ddp['ratio']:.2f}x" if ddp else ""), flush=True)
        record = {"benchmark": "torch_backend", "launcher": launcher, "ranks": n, "local_ranks": local,
                  "commlib_group_over": over, "cpus": os.cpu_count(), "torch_threads": threads,
                  "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                  "node": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                  "loadavg_start": load_start, "loadavg_end": load_end, "busbw_factor": 2 * (n - 1) / n if n > 1 else 1,
                  "targets": {"all_reduce": TARGETS, "ddp": DDP_TARGET, "ranks": 2},
                  "rows": rows, "ddp": ddp, "summary": summary, "profile": prof}
        try:
            from mpi4py import MPI  # noqa: PLC0415

            if MPI.Is_initialized():
                record["mpi"] = MPI.Get_library_version().split("\n")[0].strip("\x00 ")
        except ImportError:
            pass
        write_json(args.json, record)
        if args.plot:
            plot(rows, ddp, n, launcher, args.plot)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def plot(rows, ddp, n, launcher, path):
    """Latency (us) of both backends and the gloo / commlib ratio against message size (bytes)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    x = [r["bytes"] for r in rows]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for i, k in enumerate(("commlib", "gloo")):
        a1.plot(x, [r[k]["time_us"] for r in rows], "o-", ms=3, color=f"C{i}", label=f"{k} (median)")
        a1.fill_between(x, [r[k]["min_us"] for r in rows], [r[k]["max_us"] for r in rows], color=f"C{i}", alpha=0.2)
    a2.plot(x, [r["ratio"] for r in rows], "o-", ms=3, color="C2", label="gloo time / commlib time")
    for j, (lo, hi, want) in enumerate(TARGETS):
        a2.hlines(want, lo, hi, color="black", ls="--", lw=0.9, label="targets (2 ranks)" if j == 0 else None)
    a2.axhline(1.0, color="grey", ls=":", lw=0.8)
    title = f"dist.all_reduce float32 SUM, {n} ranks, {launcher}"
    if ddp:
        title += f"\nDDP {ddp['params'] / 1e6:.1f} M params: commlib / gloo {ddp['ratio']:.2f}x steps/s"
    a1.set(xscale="log", yscale="log", ylabel="latency (us)", title=title)
    a2.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="gloo / commlib (x)")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
