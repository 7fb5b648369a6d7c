"""The heat solver against the solver an mpi4py user would write, and against
the copy-bandwidth roofline of the same arrays, all in one run.

Three things are timed per grid, in alternating order, ``--trials`` times:

* **commlib**: ``commlib.apps.heat.solve`` (numba backend, the command line's
  defaults: on one node the ghost cells travel through shared memory, the
  shell updated and pushed before the interior; elsewhere MPI messages
  overlapped with the interior update; ``--halo`` picks one).
* **hand-written**: the solver a user writes with mpi4py and numba alone
  (:func:`hand_solve`): ``MPI.Compute_dims``, a Cartesian communicator, each
  face copied with ``np.ascontiguousarray`` and sent with ``Sendrecv`` (one
  call per face, dimension by dimension), then one numba loop-nest kernel per
  step over the whole block; no overlap.  Its kernel does the same arithmetic
  in the same order as commlib's, so both must end with the same field, bit
  for bit: the run checks that (``same field``), so the two solve the same
  problem.
* **commlib, temporal blocking** (``--time-block``): the same solver with
  ``time_block=2`` (two steps per sweep over the block and per halo exchange),
  in a table of its own: it is not bound by the one-sweep roofline.
* **roofline**: a numba copy between two float64 arrays of each rank's padded
  block shape (the solver's ``u`` and ``un``, back and forth as the solver
  swaps them), every rank at once, in one stream and in eight interleaved
  streams, the faster counting (from DRAM one stream is bound by the misses
  it keeps in flight, not by the memory).  FTCS reads one value and writes one per
  update when the stencil's neighbours hit in the nearer caches: 16 bytes, the
  traffic of that copy, so ``copies x cells / seconds`` is the most updates
  per second this machine can do on these arrays in one sweep per step.  It
  is a limit: the best trial counts.
* **update in cache**: the other ceiling of the roofline model, the
  arithmetic's.  commlib's own update kernels (one and four planes per pass,
  the faster counting) on a block of the same row length small enough for
  both fields to stay in the nearer caches (``CEILING_BYTES``), every rank at
  once: the most updates per second the FTCS arithmetic (13 floating-point
  operations per cell, in the numpy kernel's order, so that every backend and
  run gives the same bits) does on this CPU with no memory traffic.  Where it
  is below the copy, the update is bound by arithmetic, not by memory, and
  ``commlib / min(copy, update in cache)`` says how close the solver comes to
  the lower ceiling.  The best trial counts.

Rates are MLUPS (million lattice-site updates per second, all ranks
together; seconds: the slowest rank's).  Ratios are paired per trial
(``commlib / hand-written`` of the same trial) and printed as their median
and range.  The working set of every rank on the node (``u`` + ``un``) is
printed beside the last-level cache size from ``/sys``; the JSON labels each
grid ``cache`` or ``DRAM`` by that size (a virtual machine may report its
host's cache: the copy rate says which level the arrays really live in).

    mpiexec -n 2 python -P benchmarks/bench_heat.py --json heat_p2.json --plot heat_p2.png
    mpiexec -n 1 python -P benchmarks/bench_heat.py --grids 96x96x96 --steps 200 --trials 5
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import OneLineParser, int_in, shape_arg, writable_file, write_json  # noqa: E402

DEFAULT_GRIDS = ("96x96x96", "192x192x192", "944x944", "2656x2656")
UPDATES_PER_RUN = 1.6e8  # --steps auto: about this many lattice updates per timed run


# ---------------------------------------------------------------- baseline
_KERNELS = {}


def _hand_kernel(d):
    """The user's numba kernel: one loop nest over the owned cells of the
    padded field ``u`` into ``un`` (FTCS, ``c[i] = alpha dt / dx_i^2``)."""
    if d in _KERNELS:
        return _KERNELS[d]
    import numba  # noqa: PLC0415

    if d == 2:
        @numba.njit(nogil=True)
        def step(u, un, c0, c1):
            for i in range(1, u.shape[0] - 1):
                for j in range(1, u.shape[1] - 1):
                    ctr = u[i, j]
                    un[i, j] = ctr + (c0 * (u[i - 1, j] - 2.0 * ctr + u[i + 1, j])
                                      + c1 * (u[i, j - 1] - 2.0 * ctr + u[i, j + 1]))
    else:
        @numba.njit(nogil=True)
        def step(u, un, c0, c1, c2):
            for i in range(1, u.shape[0] - 1):
                for j in range(1, u.shape[1] - 1):
                    for k in range(1, u.shape[2] - 1):
                        ctr = u[i, j, k]
                        un[i, j, k] = ctr + ((c0 * (u[i - 1, j, k] - 2.0 * ctr + u[i + 1, j, k])
                                              + c1 * (u[i, j - 1, k] - 2.0 * ctr + u[i, j + 1, k]))
                                             + c2 * (u[i, j, k - 1] - 2.0 * ctr + u[i, j, k + 1]))
    _KERNELS[d] = step
    return step


def hand_solve(comm, grid, steps, alpha=1.0, cfl=0.5):
    """The heat solver written with mpi4py and numba alone (no commlib).

    Args:
        comm: an ``mpi4py.MPI.Comm``.
        grid: global interior points per dimension (2 or 3 ints).
        steps: time steps; alpha, cfl: as ``commlib.apps.heat.solve``'s.

    Returns:
        ``(seconds, local)``: the time loop's wall time on this rank (after a
        barrier; the kernel is compiled before it) and the owned block (a
        float64 array).
    """
    from mpi4py import MPI  # noqa: PLC0415

    d = len(grid)
    dims = MPI.Compute_dims(comm.Get_size(), d)
    cart = comm.Create_cart(dims, periods=[False] * d, reorder=False)
    coords = cart.Get_coords(cart.Get_rank())
    shape, offset = [], []
    for n, p, q in zip(grid, dims, coords):
        base, rem = divmod(n, p)
        shape.append(base + (q < rem))
        offset.append(q * base + min(q, rem))
    dx = [1.0 / (n + 1) for n in grid]
    dt = cfl / (2.0 * alpha * sum(1.0 / h ** 2 for h in dx))
    c = [alpha * dt / h ** 2 for h in dx]
    u = np.zeros([m + 2 for m in shape])
    init = np.ones(shape)
    for i, (n, o, m) in enumerate(zip(grid, offset, shape)):
        s = [1] * d
        s[i] = m
        x = (np.arange(o, o + m) + 1.0) / (n + 1)  # the grid point's coordinate
        init = init * np.sin(np.pi * x).reshape(s)
    inner = tuple(slice(1, m + 1) for m in shape)
    u[inner] = init
    un = u.copy()
    kernel = _hand_kernel(d)

    def face(dim, index):  # the owned or ghost plane `index` of dimension dim, other dims owned only
        return tuple(index if k == dim else slice(1, m + 1) for k, m in enumerate(shape))

    # (send face, receive ghost, dest, source) per direction: low owned face to the lower
    # neighbour, ghost filled from the upper one; and the other way round
    moves = []
    for dim in range(d):
        low, high = cart.Shift(dim, 1)
        moves.append((face(dim, 1), face(dim, shape[dim] + 1), low, high))
        moves.append((face(dim, shape[dim]), face(dim, 0), high, low))
    recv = {dim: np.empty([m for k, m in enumerate(shape) if k != dim]) for dim in range(d)}

    def exchange(u):
        for k, (send, ghost, dest, source) in enumerate(moves):
            buf = recv[k // 2]
            cart.Sendrecv(np.ascontiguousarray(u[send]), dest=dest, recvbuf=buf, source=source)
            if source != MPI.PROC_NULL:
                u[ghost] = buf

    exchange(u)
    kernel(u, un, *c)  # compile and warm up
    un[...] = u
    cart.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        exchange(u)
        kernel(u, un, *c)
        u, un = un, u
    wall = time.perf_counter() - t0
    cart.Free()
    return wall, u[inner].copy()


# ---------------------------------------------------------------- roofline
_COPY = {}
STREAMS = (1, 8)  # the copies timed: one stream, and eight interleaved streams


def _copy_kernel(streams):
    """A numba copy ``a -> b, b -> a, ...`` of two float64 arrays, their flat
    index range cut into ``streams`` parts copied side by side in one loop."""
    if streams not in _COPY:
        import numba  # noqa: PLC0415

        @numba.njit(nogil=True)
        def copy(a, b, times):
            x, y = a.reshape(-1), b.reshape(-1)
            q = x.size // streams
            for t in range(times):
                src, dst = (x, y) if t % 2 == 0 else (y, x)
                for i in range(q):
                    for k in range(streams):
                        dst[i + k * q] = src[i + k * q]
                for i in range(streams * q, x.size):
                    dst[i] = src[i]

        _COPY[streams] = copy
    return _COPY[streams]


def copy_seconds(comm, padded, copies):
    """Seconds (this rank's) of ``copies`` numba copies between two float64
    arrays of ``padded`` shape (a -> b, b -> a, ...), every rank starting
    together after a barrier: the faster of the one-stream and the
    eight-stream copy.  One stream is not the memory's limit from DRAM: it
    is bound by the misses one stream keeps in flight (2656^2 on the 2-core
    test machine: 1466 MLUPS in one stream, 1722 in eight; the same from the
    cache), and a stencil that keeps more rows in flight beat it."""
    a = np.ones(padded)
    b = np.zeros_like(a)  # touched: no first-touch page faults in the timing
    best = None
    for streams in STREAMS:
        copy = _copy_kernel(streams)
        copy(a, b, 2)
        comm.Barrier()
        t0 = time.perf_counter()
        copy(a, b, copies)
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    return best


CEILING_BYTES = 1 << 19  # u + un of the in-cache block: about a quarter of a 2 MiB L2


def update_ceiling_seconds(comm, padded, min_seconds=0.05):
    """``(cells, steps, seconds)`` of commlib's fastest update kernel (one or four
    planes per pass) on a block of ``padded``'s row length that fits in
    ``CEILING_BYTES`` with its second field (3-D: square planes of rows;
    2-D: rows), every rank at once after a barrier; the step count makes a
    run last about ``min_seconds`` on this rank (the same on every rank: the
    largest)."""
    from commlib.apps.heat.model import _box_array, _get_numba  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    d, row = len(padded), padded[-1]
    per_field = CEILING_BYTES // 16 // row  # padded cells per field / row length: the rows that fit
    if d == 3:
        side = max(3, int(per_field ** 0.5))
        shape = (side, side, row)
    else:
        shape = (max(3, per_field), row)
    kern = _get_numba(d)
    a = np.random.default_rng(0).random(shape)
    b = a.copy()
    c = np.full(d, 0.1)
    box = _box_array([((1,) * d, tuple(n - 1 for n in shape))])
    cells = int(np.prod([n - 2 for n in shape]))
    best = None
    for name in ("steps", "steps4"):
        if name not in kern:
            continue
        run = kern[name]
        run(a, b, c, box, 2)  # compile, warm up
        t0 = time.perf_counter()
        run(a, b, c, box, 20)
        per_step = (time.perf_counter() - t0) / 20
        steps = comm.allreduce(max(2, int(min_seconds / max(per_step, 1e-9)) // 2 * 2), op=MPI.MAX)
        comm.Barrier()
        t0 = time.perf_counter()
        run(a, b, c, box, steps)
        took = time.perf_counter() - t0
        rate = cells * steps / took
        if best is None or rate > best[0]:
            best = (rate, steps, took)
    return cells, best[1], best[2]


def last_level_cache_bytes():
    """Size of the largest unified/data CPU cache from ``/sys`` (None if unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        for entry in os.listdir(base):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(base, entry, "type"), encoding="ascii") as fh:
                if fh.read().strip() == "Instruction":
                    continue
            with open(os.path.join(base, entry, "size"), encoding="ascii") as fh:
                s = fh.read().strip()
            n = int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]] if s[-1] in "KMG" else int(s)
            best = n if best is None else max(best, n)
    except (OSError, ValueError, KeyError):
        return None
    return best


# ---------------------------------------------------------------- profile
PHASES = {"shm": ("wait", "ghosts in", "shell", "push", "interior"),
          "mpi": ("start", "interior", "wait", "shell"), "none": ("update",)}


def profile_grid(comm, mpicomm, grid, steps, halo="auto"):
    """Where a step's time goes: the solver's own block and loop, each phase
    timed per step (``time.perf_counter`` around it), ``steps`` steps after a
    warm-up.  Returns ``{"halo": kind, "planes": kernel, "us_per_step":
    {phase: [per rank]}, "total_us": [per rank], "update_alone_us": [per
    rank]}`` (the last: the whole block's update with no halo, every rank at
    once)."""
    from commlib.apps import heat  # noqa: PLC0415
    from commlib.apps.heat import timeloop  # noqa: PLC0415
    import commlib  # noqa: PLC0415

    d = len(grid)
    cart = comm.cart_create(dims=commlib.compute_dims(comm.size, d), periods=[False] * d)
    shape, offset = heat.block_of(grid, cart.dims, cart.coords)
    _, _, steps, c = heat.time_step(grid, 1.0, 0.5, steps)
    plan, kind = None, "none" if comm.size == 1 else "mpi"
    if comm.size > 1 and halo != "mpi":
        try:
            plan, kind = heat.NodeHalo(cart, shape), "shm"
        except commlib.InvalidArgument:
            pass
    plan = plan or heat.HaloExchange(cart, shape, width=1, corners=False)
    blk = timeloop.Block(cart, plan, shape, offset, grid, 1.0, "numba", c)
    f, clock = blk.fields, time.perf_counter
    blk.run_all(0)
    blk.tune(comm, 0, comm.size > 1)
    blk.run_inner(0)
    blk.run_shell(0)
    acc = np.zeros(len(PHASES[kind]))
    if kind == "mpi":
        plan.exchange(f[0])
    mpicomm.Barrier()
    t0 = clock()
    if kind == "shm":
        plan.push(f[0], 0)
    for s in range(steps):
        p = s & 1
        t = [clock()]
        if kind == "shm":
            for face in plan.faces:
                while face.in_count[0] <= s:
                    pass
            t.append(clock())
            plan.pull(f[p], s)
            t.append(clock())
            blk.run_shell(p)
            t.append(clock())
            if s + 1 < steps:
                plan.push(f[1 - p], s + 1)
            t.append(clock())
            blk.run_inner(p)
        elif kind == "mpi":
            req = plan.start(f[p])
            t.append(clock())
            blk.run_inner(p)
            t.append(clock())
            req.wait()
            t.append(clock())
            blk.run_shell(p)
        else:
            blk.run_all(p)
        t.append(clock())
        acc += np.diff(t)
    total = (clock() - t0) / steps * 1e6
    mpicomm.Barrier()
    t0 = clock()
    for s in range(steps):
        blk.run_all(s & 1)
    alone = (clock() - t0) / steps * 1e6
    per = mpicomm.allgather(acc / steps * 1e6)
    out = {"halo": kind, "planes": mpicomm.allgather(blk.planes), "total_us": mpicomm.allgather(total),
           "update_alone_us": mpicomm.allgather(alone),
           "us_per_step": {ph: [float(r[k]) for r in per] for k, ph in enumerate(PHASES[kind])}}
    plan.free()
    cart.free()
    return out


def print_profile(grid, prof):
    ranks = len(prof["total_us"])
    print(f"# {'x'.join(map(str, grid))}: µs per step per rank, ghost cells: {prof['halo']}, "
          f"update kernel: {prof['planes'][0]} plane(s) per pass")
    names = list(prof["us_per_step"]) + ["step", "update alone"]
    print(f"{'rank':>6} " + " ".join(f"{n:>12}" for n in names))
    for r in range(ranks):
        vals = [prof["us_per_step"][n][r] for n in prof["us_per_step"]] + [prof["total_us"][r],
                                                                             prof["update_alone_us"][r]]
        print(f"{r:>6} " + " ".join(f"{v:12.1f}" for v in vals))


# -------------------------------------------------------------------- run
def _span(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "trials": xs}


def bench_grid(comm, mpicomm, grid, steps, trials, overlap, time_block=False, halo="auto"):
    """One grid: ``trials`` alternating timings of commlib, the hand-written
    solver and the roofline copy; returns the row (rank 0's numbers are the
    job's: every rate is over all ranks, with the slowest rank's seconds)."""
    from commlib.apps import heat  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    cells = int(np.prod(grid))
    res, local = heat.solve(comm, grid, steps=2, overlap=overlap, halo=halo)  # compile, warm up
    padded = tuple(n + 2 for n in local.shape)
    hand_solve(mpicomm, grid, 2)
    if time_block:
        heat.solve(comm, grid, steps=2, time_block=2)
    copy_seconds(mpicomm, padded, 2)
    padded_cells = mpicomm.allreduce(int(np.prod(padded)))

    def slowest(seconds):
        return mpicomm.allreduce(seconds, op=MPI.MAX)

    ours, hand, roof, blocked, ceiling, same = [], [], [], [], [], True
    names = ("commlib", "hand", "roof") + (("blocked",) if time_block else ())
    for t in range(trials):
        for what in names if t % 2 == 0 else names[::-1]:
            if what == "commlib":
                res, mine = heat.solve(comm, grid, steps=steps, overlap=overlap, halo=halo)
                ours.append(cells * steps / res.wall_s / 1e6)
            elif what == "blocked":
                res2, two = heat.solve(comm, grid, steps=steps, time_block=2)
                blocked.append(cells * steps / res2.wall_s / 1e6)
            elif what == "hand":
                wall, theirs = hand_solve(mpicomm, grid, steps)
                hand.append(cells * steps / slowest(wall) / 1e6)
            else:
                roof.append(padded_cells * steps / slowest(copy_seconds(mpicomm, padded, steps)) / 1e6)
                n, k, took = update_ceiling_seconds(mpicomm, padded)
                ceiling.append(mpicomm.allreduce(n) * k / slowest(took) / 1e6)
        same = same and bool(np.array_equal(mine, theirs)) and (not time_block or bool(np.array_equal(mine, two)))
    same = mpicomm.allreduce(same, op=MPI.LAND)
    ws = 2 * int(np.prod(padded)) * 8
    host = zlib.crc32(socket.gethostname().encode())
    pairs = mpicomm.allgather((host, ws))
    node_ws = sum(w for h, w in pairs if h == host)
    llc = last_level_cache_bytes()
    level = "unknown" if llc is None else ("cache" if node_ws <= llc else "DRAM")
    best_roof = max(roof)
    lower = min(best_roof, max(ceiling))  # the roofline model's bound: the lower of its two ceilings
    extra = {}
    if time_block:
        extra = {"time_block2_mlups": _span(blocked),
                 "time_block2_over_hand": _span([a / b for a, b in zip(blocked, hand)]),
                 "time_block2_over_roofline": _span([a / best_roof for a in blocked]),
                 # the arithmetic ceiling bounds it as well: the same operations per update
                 "time_block2_over_update_in_cache": _span([a / max(ceiling) for a in blocked])}
    return {**extra, 
        "grid": list(grid), "steps": steps, "ranks": mpicomm.Get_size(), "dims": res.dims,
        "working_set_bytes_per_node": node_ws, "last_level_cache_bytes": llc, "roofline_level": level,
        "commlib_mlups": _span(ours), "hand_mlups": _span(hand), "roofline_mlups": _span(roof),
        "commlib_over_hand": _span([a / b for a, b in zip(ours, hand)]),
        "hand_over_roofline": _span([b / best_roof for b in hand]),
        "commlib_over_roofline": _span([a / best_roof for a in ours]),
        "update_in_cache_mlups": _span(ceiling),
        "commlib_over_lower_ceiling": _span([a / lower for a in ours]),
        "commlib_comm_fraction": res.comm_fraction, "commlib_halo": res.extra.get("halo"), "same_field": same,
    }


def print_rows(rows, ranks):
    halos = sorted({str(r.get("commlib_halo")) for r in rows})
    print(f"# commlib's ghost cells: {', '.join(halos)} (shm: shared memory; mpi: messages; none: one rank)")
    print(f"# heat, numba backend, {ranks} rank(s); MLUPS of all ranks, min-max over trials; ratios paired per "
          "trial, median [min-max]; roofline: the best copy trial; in-cache: commlib's update with no memory "
          "traffic; lower: min(roofline, best in-cache); MiB: u + un of every rank on the node")

    def rng(s):
        return f"{s['min']:.0f}-{s['max']:.0f}"

    def ratio(s):
        return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

    print(f"{'grid':>12} {'steps':>5} {'MiB':>5} {'commlib':>10} {'hand':>10} {'roofline':>10} "
          f"{'commlib/hand':>18} {'commlib/roof':>18} {'hand/roof':>18} {'in-cache':>10} {'commlib/lower':>18} "
          f"{'same':>4}")
    for r in rows:
        print(f"{'x'.join(map(str, r['grid'])):>12} {r['steps']:>5} {r['working_set_bytes_per_node'] / 2 ** 20:5.0f} "
              f"{rng(r['commlib_mlups']):>10} {rng(r['hand_mlups']):>10} {rng(r['roofline_mlups']):>10} "
              f"{ratio(r['commlib_over_hand']):>18} {ratio(r['commlib_over_roofline']):>18} "
              f"{ratio(r['hand_over_roofline']):>18} {rng(r['update_in_cache_mlups']):>10} "
              f"{ratio(r['commlib_over_lower_ceiling']):>18} {'yes' if r['same_field'] else 'NO':>4}")
    if any("time_block2_mlups" in r for r in rows):
        print("# temporal blocking (time_block=2: two steps per sweep and per exchange), same trials")
        print(f"{'grid':>12} {'blocked':>10} {'blocked/hand':>18} {'blocked/roof':>18}")
        for r in rows:
            print(f"{'x'.join(map(str, r['grid'])):>12} {rng(r['time_block2_mlups']):>10} "
                  f"{ratio(r['time_block2_over_hand']):>18} {ratio(r['time_block2_over_roofline']):>18}")
    llc = rows[0]["last_level_cache_bytes"] if rows else None
    if llc:
        print(f"# last-level cache (/sys): {llc / 2 ** 20:.0f} MiB")


def plot_rows(rows, ranks, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(2.2 * len(rows) + 2.5, 4))
    bars = [("commlib_mlups", "commlib"), ("hand_mlups", "hand-written mpi4py + numba"),
            ("roofline_mlups", "copy roofline"), ("update_in_cache_mlups", "update in cache (arithmetic ceiling)")]
    bars = [b for b in bars if all(b[0] in r for r in rows)]
    width = 0.8 / len(bars)
    for k, (key, label) in enumerate(bars):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(rows))]
        med = [r[key]["median"] for r in rows]
        err = [[m - r[key]["min"] for m, r in zip(med, rows)], [r[key]["max"] - m for m, r in zip(med, rows)]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(range(len(rows)))
    # the working set, not a cache/DRAM label: a virtual machine may report its host's cache in /sys
    ax.set_xticklabels([f"{'x'.join(map(str, r['grid']))}\n({r['working_set_bytes_per_node'] / 2 ** 20:.0f} MiB)"
                        for r in rows])
    ax.set_ylabel("MLUPS (all ranks)")
    ax.set_title(f"heat solver, numba, {ranks} rank(s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser():
    p = OneLineParser(prog="bench_heat.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", nargs="+", type=shape_arg(3, 2, 1 << 16), metavar="SHAPE",
                   default=[shape_arg(3, 2, 1 << 16)(g) for g in DEFAULT_GRIDS],
                   help="global grids, 2-D or 3-D, written NxM or NxMxK (default: "
                        f"{' '.join(DEFAULT_GRIDS)}: about the points of 96^3 and 192^3 in 3-D and 2-D)")
    p.add_argument("--steps", type=int_in(1, 10 ** 7, "steps"), default=None,
                   help=f"time steps per timed run (default: about {UPDATES_PER_RUN:.2g} updates per run, "
                        "at least 10 steps)")
    p.add_argument("--trials", type=int_in(1, 1000, "trials"), default=3,
                   help="timed runs of each of the three, alternating (default 3)")
    p.add_argument("--no-overlap", action="store_true", help="run commlib's solver without overlap")
    p.add_argument("--halo", choices=("auto", "shm", "mpi"), default="auto",
                   help="how commlib's ghost cells travel: shared memory (shm), MPI messages (mpi) or the "
                        "solver's choice (auto: shm on one node; default)")
    p.add_argument("--time-block", action="store_true",
                   help="also time commlib's solver with temporal blocking (time_block=2: two steps per sweep and "
                        "per halo exchange), reported in a table of its own")
    p.add_argument("--profile", action="store_true",
                   help="also say where a step's time goes: the solver's block and loop with each phase timed "
                        "(shared-memory halo: wait, ghosts in, shell, push, interior; messages: start, interior, "
                        "wait, shell; one rank: the update), per rank, beside the update alone")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="write the rows to this JSON file")
    p.add_argument("--plot", metavar="PATH", type=writable_file, help="write a bar chart (PNG) of the rows")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.plot:
        import importlib.util  # noqa: PLC0415

        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    import commlib  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    comm = commlib.init()
    mpicomm = MPI.COMM_WORLD
    for g in args.grids:
        if int(np.prod(g)) < comm.size or min(g) < 2:
            p.error(f"--grids {'x'.join(map(str, g))}: too small for {comm.size} rank(s)")
    load_before = os.getloadavg()
    rows = []
    for g in args.grids:
        steps = args.steps or max(10, round(UPDATES_PER_RUN / int(np.prod(g))))
        rows.append(bench_grid(comm, mpicomm, list(g), steps, args.trials, not args.no_overlap, args.time_block,
                               args.halo))
        if args.profile:
            rows[-1]["profile"] = profile_grid(comm, mpicomm, list(g), steps, args.halo)
    if comm.rank == 0:
        load = (load_before[0], os.getloadavg()[0])
        print_rows(rows, comm.size)
        for r in rows:
            if "profile" in r:
                print_profile(r["grid"], r["profile"])
        print(f"# load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} CPUs "
              f"(this job's {comm.size} rank(s) included after)")
        write_json(args.json, {"ranks": comm.size, "host": socket.gethostname(), "cpus": os.cpu_count(),
                               "loadavg_before_after": load, "rows": rows})
        if args.plot:
            plot_rows(rows, comm.size, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
