"""The command line of the heat solver: ``python -m commlib.apps.heat``.

Parses and checks the arguments before anything imports mpi4py.MPI, numba or
CuPy (a refused value costs only the interpreter's start: one line on stderr
from rank 0, exit status 2), runs :func:`.solver.solve` or
:func:`.solver.solve_ft`, optionally gathers the field (``--verify``,
``--plot``), and on rank 0 prints the summary, writes ``--json`` and the
mid-plane plot.  The progress bar (tqdm, rank 0) is drawn here, through the
solver's ``progress`` hook.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict

import commlib  # light: commlib's names load on first use

from .._cli import EXIT_REQUEUE, OneLineParser, StopSignals, unwritable, world_size
from .model import BACKENDS, DEVICE_BACKENDS, time_step
from .restart import FILE, check_resume, describe, read_checkpoint, write_checkpoint
from .solver import HALOS, load_solver, gather_field, matches_one_rank

#: limits of the command line (a grid side, all grid points, steps)
MAX_SIDE, MAX_POINTS, MAX_STEPS = 1 << 20, 1 << 36, 10 ** 9


def _api():
    """The package ``commlib.apps.heat``: main runs ``solve`` / ``solve_ft``
    as found there at call time, so replacing them on the package (as the
    tests do) replaces what the command line runs; its docstring is --help's
    description."""
    return sys.modules[__package__]


def check_args(parser: argparse.ArgumentParser, args, size: int | None = None) -> list:
    """Refuse values the solver cannot run (``parser.error``: one line, exit 2)
    before MPI communicates; returns the grid, one size per dimension.

    ``size`` is the job's rank count (default: :func:`commlib.apps._cli.world_size`,
    from the launcher's environment before MPI is up; 1 when nothing tells).

    Checks: ``--grid`` sizes (1 or ``--dims`` of them, each in
    ``[1, MAX_SIDE]``, at most ``MAX_POINTS`` points, at least one point per
    rank, and a rank's share of it, at 8 bytes a point times 2 (4 with
    ``--fault-tolerant``: the checkpoints), within this machine's physical
    memory), ``--steps`` in ``[1, MAX_STEPS]``, ``--t-final``, ``--alpha`` finite
    and > 0, ``--cfl`` finite in (0, 1], ``--checkpoint-every`` >= 1, ``--kill``
    only with ``--fault-tolerant`` and as ``RANK:STEP`` (a rank of the job, each
    rank at most once, not every rank, a step of the run: ``0 <= STEP < steps``,
    the steps ``--t-final`` implies where given; parsed into ``args.kill_list``,
    a list of ``(rank, step)`` int pairs), ``--json``/``--plot`` writable (and
    matplotlib present for ``--plot``).

    Raises:
        SystemExit: 2, through ``parser.error``, at the first refused value.
    """
    err = parser.error
    if size is None:
        size = world_size() or 1
    grid = args.grid or ([512] if args.dims == 2 else [96])
    if len(grid) == 1:
        grid = grid * args.dims
    if len(grid) != args.dims:
        err(f"--grid takes 1 or {args.dims} sizes, got {len(grid)}")
    if any(not 1 <= n <= MAX_SIDE for n in grid):
        err(f"--grid sizes must be in [1, {MAX_SIDE}], got {' '.join(map(str, args.grid))}")
    if math.prod(grid) > MAX_POINTS:
        err(f"--grid {'x'.join(map(str, grid))} has {math.prod(grid)} points, more than {MAX_POINTS}")
    if math.prod(grid) < size:
        err(f"--grid {'x'.join(map(str, grid))} has fewer points than the job has ranks ({size})")
    if not 1 <= args.steps <= MAX_STEPS:
        err(f"--steps must be in [1, {MAX_STEPS}], got {args.steps}")
    for name, v in (("--alpha", args.alpha), ("--t-final", args.t_final)):
        if v is not None and not (math.isfinite(v) and v > 0):
            err(f"{name} must be a finite number > 0, got {v}")
    if not (math.isfinite(args.cfl) and 0 < args.cfl <= 1):
        err(f"--cfl must be in (0, 1] (a fraction of the FTCS stability limit), got {args.cfl}")
    if args.time_block == 2 and (args.backend != "numba" or args.fault_tolerant):
        err("--time-block 2 runs the numba backend without --fault-tolerant")
    if args.halo == "shm" and (args.backend in DEVICE_BACKENDS or args.time_block == 2 or args.fault_tolerant):
        err("--halo shm runs the numpy or numba backend with --time-block 1 and without --fault-tolerant")
    if args.checkpoint_every < 1:
        err(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    need = _bytes_per_rank(grid, size, args.fault_tolerant)
    have = _physical_memory()
    if have and need > have:
        err(f"--grid {'x'.join(map(str, grid))} needs about {need / 2 ** 30:.1f} GiB per rank over {size} "
            f"rank(s), more than this machine's {have / 2 ** 30:.1f} GiB: use a smaller grid or more ranks")
    kill = []
    if args.kill and not args.fault_tolerant:
        err("--kill needs --fault-tolerant")
    steps = time_step(grid, args.alpha, args.cfl, args.steps, args.t_final)[2]
    for k in args.kill:
        parts = k.split(":")
        try:
            rank, step = (int(x) for x in parts) if len(parts) == 2 else (None, None)
        except ValueError:
            rank = step = None
        if rank is None:
            err(f"--kill takes RANK:STEP (two integers), got {k!r}")
        if not 0 <= rank < size:
            err(f"--kill {k}: rank {rank} is not a rank of this job [0, {size})")
        if step < 0:
            err(f"--kill {k}: step {step} is negative")
        if step >= steps:
            err(f"--kill {k}: step {step} is past the run's last step ({steps - 1}): the kill would never happen")
        if any(r == rank for r, _ in kill):
            err(f"--kill {k}: rank {rank} is already killed by an earlier --kill")
        kill.append((rank, step))
    if kill and len(kill) >= size:
        err(f"--kill kills every rank of the job ({size}): none would be left to finish the run")
    args.kill_list = kill
    _check_restart(parser, args, grid, steps, time_step(grid, args.alpha, args.cfl, args.steps, args.t_final)[1])
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            problem = unwritable(path)
            if problem:
                err(f"{opt} {path}: {problem}")
    if args.plot is not None:
        import importlib.util  # noqa: PLC0415

        if importlib.util.find_spec("matplotlib") is None:
            err("--plot needs matplotlib (pip install matplotlib)")
    return grid


def _check_restart(parser, args, grid, steps, dt) -> None:
    """``--checkpoint`` (a folder, made if missing, that takes a file) and ``--resume`` (a checkpoint
    of this very run: grid, steps, alpha, cfl, dt); sets ``args.start``: None or ``(step, field, meta)``."""
    err = parser.error
    args.start = None
    if (args.checkpoint or args.resume) and (args.fault_tolerant or args.time_block == 2):
        err("--checkpoint and --resume run without --fault-tolerant and with --time-block 1")
    if args.checkpoint:
        try:
            os.makedirs(args.checkpoint, exist_ok=True)
        except OSError as exc:
            err(f"--checkpoint {args.checkpoint}: cannot create the folder ({exc.strerror or exc})")
        problem = unwritable(os.path.join(args.checkpoint, FILE))
        if problem:
            err(f"--checkpoint {args.checkpoint}: {problem}")
    if args.resume:
        try:
            meta, field_ = read_checkpoint(args.resume)
        except ValueError as exc:
            err(f"--resume {args.resume}: {exc}")
        problem = check_resume(meta, describe(grid, steps, args.alpha, args.cfl, dt))
        if problem:
            err(f"--resume {args.resume}: {problem}")
        args.start = (int(meta["step"]), field_, meta)


def _bytes_per_rank(grid, size: int, fault_tolerant: bool) -> float:
    """Bytes of host memory a rank's share of ``grid`` takes at least: the field
    and its next step (float64), and in ``--fault-tolerant`` mode its own and its
    buddy's checkpoint."""
    return math.prod(grid) / size * 8 * (4 if fault_tolerant else 2)


def _physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (a :class:`commlib.apps._cli.OneLineParser`: a
    refusal is one line on stderr from rank 0, then ``SystemExit(2)``)."""
    doc = _api().__doc__
    p = OneLineParser(
        "heat",
        prog="python -m commlib.apps.heat",
        description=doc.split("\n\n")[0] + "\n\n" + doc.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Backends: numpy and numba run on the host; cuda (numba.cuda) and cupy (cupy.RawKernel)\n"
               "keep both fields on the GPU and update each region in one coalesced kernel launch:\n"
               "the whole block where a rank has no neighbour (one rank: no halo exchange at all),\n"
               "else the interior while halos are in flight, then the shell.\n\n"
               "Example: mpiexec -n 4 python -m commlib.apps.heat --dims 3 --grid 64 --verify --json heat.json",
    )
    p.add_argument("--dims", type=int, choices=(2, 3), default=3, help="spatial dimensions (default 3)")
    p.add_argument("--grid", type=int, nargs="+", default=None, metavar="N",
                   help="global interior points: one N for every dimension or one per dimension "
                        "(default 512 in 2-D, 96 in 3-D)")
    p.add_argument("--steps", type=int, default=500, help="time steps (default 500)")
    p.add_argument("--t-final", type=float, default=None,
                   help="model time to reach instead of --steps (steps follow from the stable dt)")
    p.add_argument("--alpha", type=float, default=1.0, help="diffusivity (default 1.0)")
    p.add_argument("--cfl", type=float, default=0.5, help="fraction of the FTCS stability limit (default 0.5)")
    p.add_argument("--backend", choices=BACKENDS, default="numba",
                   help="numpy or numba: host kernels; cuda: numba.cuda kernels on numba device arrays (numba's "
                        "CUDA simulator when NUMBA_ENABLE_CUDASIM=1); cupy: a CUDA C cupy.RawKernel on CuPy arrays "
                        "(needs CuPy and a GPU; bit-identical to numpy). Device kernels: coalesced thread blocks "
                        "marching along the first axis, one launch per region (default numba)")
    p.add_argument("--no-overlap", action="store_true", help="exchange halos before updating (no overlap)")
    p.add_argument("--halo", choices=HALOS, default="auto",
                   help="how ghost cells travel: shm: through shared memory on one node (each rank copies its edge "
                        "cells into its neighbours' mailboxes and raises a step counter there; no MPI message); "
                        "mpi: MPI messages (persistent requests, packed by commlib's datatypes); auto: shm where "
                        "every rank is on one x86-64 node and the backend is numpy or numba with --time-block 1, "
                        "else mpi (default auto). The field is the same bit for bit")
    p.add_argument("--time-block", type=int, choices=(1, 2), default=1,
                   help="steps per sweep over the block and per halo exchange: 2 is temporal blocking (numba "
                        "backend: halos 2 cells wide, both steps in one wavefront sweep, no overlap; the same field "
                        "bit for bit). It pays where a rank's block fits in the last-level cache and can be slower "
                        "when the block comes from DRAM (measured figures: the documentation's performance page); "
                        "default 1")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the mid-plane")
    p.add_argument("--verify", action="store_true",
                   help="gather the field and compare bit for bit with a single-process run "
                        "(at 1 rank there is nothing to compare, and the summary says so)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="survive rank failures (ULFM: mpiexec --with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum): in-memory buddy "
                        "checkpoints, shrink, re-decompose, restore")
    p.add_argument("--checkpoint-every", type=int, default=20, metavar="K",
                   help="steps between buddy checkpoints in --fault-tolerant mode (default 20)")
    p.add_argument("--kill", action="append", default=[], metavar="RANK:STEP",
                   help="fault injection: COMM_WORLD rank RANK SIGKILLs itself before step STEP (repeatable)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help=f"on SIGUSR1 or SIGTERM (a time limit or a preemption coming) every rank finishes its step, "
                        f"the ranks agree on the step (one all-reduce per step), rank 0 writes the field into "
                        f"DIR/{FILE} and the run exits {EXIT_REQUEUE}; the field of the last step is written too. "
                        "DIR is made if missing")
    p.add_argument("--resume", metavar="DIR",
                   help=f"continue the run whose checkpoint DIR/{FILE} holds (the same --grid, --steps or --t-final, "
                        "--alpha, --cfl), on any rank count, to the field an uninterrupted run has, bit for bit (every "
                        "rank reads the whole field: a grid that fits one process)")
    return p


def progress_bar(desc: str):
    """A ``progress(total, initial)`` hook for :func:`.solver.solve`: each
    call opens a tqdm bar of ``total`` steps starting at ``initial``, named
    ``desc``, on stderr, erased when closed (tqdm is imported on the first
    call, after the kernels compiled)."""
    def bar(total, initial):
        from tqdm import tqdm  # noqa: PLC0415

        return tqdm(total=total, initial=initial, desc=desc, unit="step", leave=False, mininterval=0.5)

    return bar


def plot_midplane(field_, path, title=""):
    """Save a PNG (120 dpi) of the field's mid-plane over the unit square: the
    2-D float array itself, or in 3-D the middle slice of the last axis
    (``field_[:, :, n // 2]``).  Needs matplotlib (Agg backend)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    img = field_ if field_.ndim == 2 else field_[:, :, field_.shape[2] // 2]
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(img.T, origin="lower", extent=(0, 1, 0, 1), cmap="inferno")
    fig.colorbar(im, ax=ax, label="u")
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(res, grid) -> None:
    """Print the run's summary (a :class:`.solver.HeatResult`) on stdout;
    kernel compilation gets a line of its own when the driver reported it."""
    print(f"heat {len(grid)}-D grid {'x'.join(map(str, grid))} on {res.ranks} rank(s) dims "
          f"{'x'.join(map(str, res.dims))}, backend {res.backend}")
    print(f"  steps {res.steps}  dt {res.dt:.3e}  t {res.t_final:.4e}")
    print(f"  error vs exact: L2 {res.l2_error:.3e} (relative {res.rel_l2_error:.3e}), max {res.max_error:.3e}")
    if res.compile_s is not None:
        print(f"  kernel compilation and warm-up (before the timed loop): {res.compile_s:.3f} s")
    halo = {"shm": ", halo through shared memory", "mpi": ", halo by MPI messages"}.get(res.extra.get("halo"), "")
    print(f"  {res.mlups:.1f} MLUPS ({res.glups:.2f} GLUPS), wall {res.wall_s:.3f} s, "
          f"comm fraction {res.comm_fraction:.1%}{halo if res.ranks > 1 else ''}")
    if res.verified is not None:
        print(f"  single-process check: {'bit-identical' if res.verified else 'MISMATCH'}")
    elif res.extra.get("verify_skipped"):
        print(f"  single-process check: nothing compared ({res.extra['verify_skipped']})")
    r = res.extra.get("resumed")
    if r:
        print(f"  resumed from the checkpoint of step {r['from_step']} in {r['checkpoint']} (written on "
              f"{r['ranks_then']} rank(s)), now on {r['ranks_now']} rank(s)")
    if res.extra.get("fault_tolerant"):
        print(f"  fault tolerant: lost COMM_WORLD ranks {res.extra['failed']}, {res.extra['recoveries']} "
              f"recovery(ies), recovery times {[round(x, 3) for x in res.extra['recovery_s']]} s")


def main(argv=None) -> int:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``);
    returns the exit status: 0, 1 when ``--verify`` found a mismatch (or the
    checkpoint could not be written), 75 (``EXIT_REQUEUE``) when, with
    ``--checkpoint``, SIGUSR1 or SIGTERM stopped the run after a step and its
    checkpoint, 2 for a refused value or argument error (reported in one line on stderr by rank 0;
    also an InvalidArgument or other ``commlib.CommError`` the solver raises).
    ``--help`` prints the options and returns 0."""
    try:
        return _main(argv)
    except SystemExit as exc:  # argparse: --help (0) or a refusal (2)
        return exc.code if isinstance(exc.code, int) else 2
    except commlib.CommError as exc:
        # every rank raises the same argument error; report it once, no traceback
        if exc.rank in (None, 0):
            print(f"heat: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _main(argv=None) -> int:
    # parse and check first: nothing so far has imported mpi4py.MPI, numba or CuPy
    parser = build_parser()
    args = parser.parse_args(argv)
    # with a checkpoint folder, SIGUSR1/SIGTERM stop the run at a step boundary: caught from here on
    signals = StopSignals().install() if args.checkpoint else None
    size = world_size()
    grid = check_args(parser, args, size or 1)
    load_solver()
    comm = commlib.init(fault_tolerant=True, on_failure="raise") if args.fault_tolerant else commlib.init()
    if comm.size != (size or 1):  # a launcher that did not name the size: check again (every rank alike)
        grid = check_args(parser, args, comm.size)
    heat = _api()
    start_size = comm.size
    stop, stopped = None, []
    if signals is not None:
        if comm.rank == 0:
            print(f"heat: on SIGUSR1 or SIGTERM the run writes {os.path.join(args.checkpoint, FILE)} after its "
                  f"current step and exits {EXIT_REQUEUE}", file=sys.stderr, flush=True)

        def stop(step):
            name = signals.agreed(comm)
            if name:
                stopped.append(name)
            return bool(name)
    if args.fault_tolerant:
        kill = args.kill_list
        res, local = heat.solve_ft(comm, grid, steps=args.steps, alpha=args.alpha, backend=args.backend,
                                   cfl=args.cfl, t_final=args.t_final, checkpoint_every=args.checkpoint_every,
                                   kill=kill)
    else:
        progress = None
        if not args.no_progress and comm.rank == 0:
            progress = progress_bar(f"heat {len(grid)}-D {args.backend} x{comm.size}")
        kw = {} if args.start is None and stop is None else dict(start=args.start and args.start[:2], stop=stop)
        res, local = heat.solve(comm, grid, steps=args.steps, alpha=args.alpha, backend=args.backend,
                                cfl=args.cfl, t_final=args.t_final, progress=progress,
                                overlap=not args.no_overlap, time_block=args.time_block, halo=args.halo, **kw)
    if args.start is not None:
        res.extra["resumed"] = dict(from_step=args.start[0], checkpoint=args.resume, ranks_then=args.start[2]["ranks"],
                                    ranks_now=comm.size)
    full = None
    if args.verify or args.plot or args.checkpoint:
        full = gather_field(comm, grid, local)
    if args.checkpoint:
        status = _write(comm, args, grid, res, full)
        if status is not None:
            return status
        if stopped:
            if comm.rank == 0:
                print(f"heat: {stopped[0]}: stopped after step {res.steps} of {res.extra['steps_total']}; "
                      f"checkpoint in {os.path.join(args.checkpoint, FILE)}; exit {EXIT_REQUEUE} (continue with "
                      f"--resume {args.checkpoint}, on any rank count)", file=sys.stderr, flush=True)
            return EXIT_REQUEUE
    if args.verify and start_size == 1:
        # the run is the single-process run: a rerun would compare it with itself
        res.extra["verify_skipped"] = "1 rank: this run is the single-process run; launch 2 or more ranks to check"
    elif args.verify:
        res.verified = matches_one_rank(comm, grid, full, res.steps, alpha=args.alpha, backend=args.backend,
                                        cfl=args.cfl, t_final=args.t_final)
    if comm.rank == 0:
        print_summary(res, grid)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(asdict(res), fh, indent=2)
        if args.plot and full is not None:
            plot_midplane(full, args.plot, f"u at t={res.t_final:.3g} ({res.ranks} ranks)")
            print(f"  plot: {args.plot}")
    return 0 if res.verified in (None, True) else 1


def _write(comm, args, grid, res, full):
    """Rank 0 writes the checkpoint of ``res.steps`` steps; every rank learns the outcome
    (None, or the exit status 1 after one line on stderr)."""
    import numpy as np  # noqa: PLC0415

    steps = time_step(grid, args.alpha, args.cfl, args.steps, args.t_final)[2]
    res.extra["steps_total"] = steps
    ok = np.ones(1, dtype=np.int32)
    if comm.rank == 0:
        try:
            res.extra["checkpoint"] = write_checkpoint(args.checkpoint, res.steps, full,
                                                       describe(grid, steps, args.alpha, args.cfl, res.dt), comm.size)
        except OSError as exc:
            print(f"heat: error: cannot write the checkpoint in {args.checkpoint}: {exc.strerror or exc}",
                  file=sys.stderr, flush=True)
            ok[0] = 0
    return None if comm.bcast(ok, root=0)[0] else 1
