"""Distributed explicit heat-equation solver (the main job).

Solves ``du/dt = alpha * laplace(u)`` on the unit square or cube with zero
Dirichlet boundaries and ``u(x, 0) = prod_i sin(pi x_i)``, whose exact solution
is ``u(x, t) = exp(-d pi^2 alpha t) prod_i sin(pi x_i)``, with the explicit
forward-time centred-space (FTCS) scheme on ``N_i`` interior points per
dimension (``dx_i = 1/(N_i+1)``) and the stable time step
``dt = cfl / (2 alpha sum_i 1/dx_i^2)``.  FTCS is second order in space and
first order in time; with ``dt ~ dx^2`` the error falls as O(dx^2).

The grid is split over the ranks by :func:`commlib.compute_dims` (remainders spread
over the first ranks of each dimension); ghost cells are filled by
:class:`commlib.collectives.HaloExchange`, whose message packing uses
commlib's own datatypes; the interior update overlaps the exchange.  Every
rank count gives the same field bit for bit as one rank (same arithmetic in
the same order per cell).

Run ``python -m commlib.apps.heat --help`` for the options, e.g.::

    mpiexec -n 4 python -m commlib.apps.heat --dims 3 --grid 64 --steps 400 --verify
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

import commlib  # light: commlib's names load on first use
from commlib import CommTimeout, InvalidArgument, ProcessFailed

from ._cli import OneLineParser, unwritable, world_size
from ._heat_cupy import cupy_slice_step  # noqa: F401 - public: the CuPy slice-expression baseline

__all__ = ["HeatResult", "decompose", "solve", "solve_ft", "main", "BACKENDS", "DEVICE_BACKENDS",
           "cupy_slice_step", "launch_geometry"]

BACKENDS = ("numpy", "numba", "cuda", "cupy")
DEVICE_BACKENDS = ("cuda", "cupy")


# The halo exchange (commlib.collectives.halo: mpi4py.MPI, numba) loads on
# first use, so the command line refuses a bad value before paying for it.
def __getattr__(name):  # PEP 562: ``heat.HaloExchange``
    if name == "HaloExchange":
        from commlib.collectives.halo import HaloExchange  # noqa: PLC0415

        globals()[name] = HaloExchange
        return HaloExchange
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_solver():
    """Import what a run needs (the communicator: mpi4py.MPI; the halo
    exchange: the datatypes and numba) in one go, before MPI's first
    collective, as ``import commlib`` did before the command line became
    light: a rank still importing while its peer spins in a collective would
    share the cores with it (on 2 cores a 2-rank run took 0.5 s longer)."""
    import commlib.communicator  # noqa: F401, PLC0415

    _halo_exchange()


def _halo_exchange():
    """``HaloExchange`` for the solvers: this module's (a test may replace it)."""
    return globals().get("HaloExchange") or __getattr__("HaloExchange")


# ----------------------------------------------------------------- geometry
def decompose(n: int, parts: int, index: int) -> tuple[int, int]:
    """Split ``n`` cells over ``parts`` blocks; block ``index`` gets ``(count, offset)``.

    The first ``n % parts`` blocks get one extra cell.
    """
    base, rem = divmod(n, parts)
    count = base + (1 if index < rem else 0)
    offset = index * base + min(index, rem)
    return count, offset


def block_of(grid, dims, coords):
    """Local shape and global offset of the block at Cartesian ``coords``."""
    got = [decompose(n, p, c) for n, p, c in zip(grid, dims, coords)]
    return tuple(g[0] for g in got), tuple(g[1] for g in got)


def exact_solution(grid, offset, shape, t, alpha):
    """Exact ``u(x, t)`` on the block of ``shape`` at global ``offset`` (float64)."""
    d = len(grid)
    u = np.ones(shape, dtype=np.float64)
    for i, (n, o, m) in enumerate(zip(grid, offset, shape)):
        x = (np.arange(o, o + m, dtype=np.float64) + 1.0) / (n + 1)
        s = [1] * d
        s[i] = m
        u = u * np.sin(np.pi * x).reshape(s)
    return u * math.exp(-d * math.pi ** 2 * alpha * t)


def time_step(grid, alpha, cfl, steps, t_final=None):
    """FTCS step for ``grid``: ``(dx per dimension, dt, steps, c)`` where
    ``dt = cfl / (2 alpha sum 1/dx_i^2)`` (the stability limit times ``cfl``),
    shortened so ``steps * dt == t_final`` when ``t_final`` is given, and
    ``c_i = alpha dt / dx_i^2`` (float64 array)."""
    dx = [1.0 / (n + 1) for n in grid]
    dt = cfl / (2.0 * alpha * sum(1.0 / h ** 2 for h in dx))
    if t_final is not None:
        steps = max(1, math.ceil(t_final / dt - 1e-12))
        dt = t_final / steps
    c = np.array([alpha * dt / h ** 2 for h in dx], dtype=np.float64)
    return dx, dt, int(steps), c


# ------------------------------------------------------------------ kernels
def _numpy_update(u, un, c, lo, hi):
    d = u.ndim
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    centre = u[box]
    acc = None
    for i in range(d):
        m = list(box)
        p = list(box)
        m[i] = slice(lo[i] - 1, hi[i] - 1)
        p[i] = slice(lo[i] + 1, hi[i] + 1)
        term = c[i] * (u[tuple(m)] - 2.0 * centre + u[tuple(p)])
        acc = term if acc is None else acc + term
    un[box] = centre + acc


_numba_kernels: dict = {}


def _get_numba(d):
    if d in _numba_kernels:
        return _numba_kernels[d]
    import numba  # noqa: PLC0415

    # Unsigned indices: numba emits no negative-index wraparound for them, so
    # the innermost loop over 1-D row views vectorizes (about 6x faster).
    if d == 1:
        @numba.njit(cache=True, nogil=True)
        def k(u, un, c, lo, hi):
            one = np.uint64(1)
            c0 = c[0]
            for i in range(np.uint64(lo[0]), np.uint64(hi[0])):
                ctr = u[i]
                un[i] = ctr + c0 * (u[i - one] - 2.0 * ctr + u[i + one])
    elif d == 2:
        @numba.njit(cache=True, nogil=True)
        def k(u, un, c, lo, hi):
            one = np.uint64(1)
            c0, c1 = c[0], c[1]
            for i in range(np.uint64(lo[0]), np.uint64(hi[0])):
                um, uc, up, out = u[i - one], u[i], u[i + one], un[i]
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    ctr = uc[j]
                    out[j] = ctr + (c0 * (um[j] - 2.0 * ctr + up[j])
                                    + c1 * (uc[j - one] - 2.0 * ctr + uc[j + one]))
    else:
        @numba.njit(cache=True, nogil=True)
        def k(u, un, c, lo, hi):
            one = np.uint64(1)
            c0, c1, c2 = c[0], c[1], c[2]
            for i in range(np.uint64(lo[0]), np.uint64(hi[0])):
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    um, up = u[i - one, j], u[i + one, j]
                    us, un_ = u[i, j - one], u[i, j + one]
                    uc, out = u[i, j], un[i, j]
                    for l in range(np.uint64(lo[2]), np.uint64(hi[2])):  # noqa: E741
                        ctr = uc[l]
                        out[l] = ctr + ((c0 * (um[l] - 2.0 * ctr + up[l])
                                         + c1 * (us[l] - 2.0 * ctr + un_[l]))
                                        + c2 * (uc[l - one] - 2.0 * ctr + uc[l + one]))
    _numba_kernels[d] = k
    return k


def _numba_update(u, un, c, lo, hi):
    _get_numba(u.ndim)(u, un, c, np.asarray(lo, np.int64), np.asarray(hi, np.int64))


_UPDATES = {"numpy": _numpy_update, "numba": _numba_update}  # host backends


def neighbour_sides(dims, coords):
    """Per dimension, ``(has a lower neighbour, has an upper neighbour)`` of the
    block at ``coords`` on a non-periodic Cartesian layout ``dims``: the sides
    whose ghost cells the halo exchange fills (the others hold the Dirichlet
    boundary, zero, for the whole run)."""
    return tuple((c > 0, c < p - 1) for p, c in zip(dims, coords))


def shell_regions(shape, width, sides=None):
    """Boxes ``(lo, hi)`` in padded coordinates that cover the owned cells whose
    stencil reads ghost cells filled by the exchange (the "shell"), each cell
    exactly once; the rest is ``interior_region``.

    ``sides`` (from :func:`neighbour_sides`) names the sides that have a
    neighbour; None means every side.  A side without one adds no shell: its
    ghost cells are boundary values that never change.
    """
    d = len(shape)
    if sides is None:
        sides = ((True, True),) * d
    full = [(w, w + n) for n, w in zip(shape, width)]
    inner = _inner_box(shape, width, sides)
    out = []
    for i in range(d):
        faces = set()
        if sides[i][0]:
            faces.add(full[i][0])
        if sides[i][1]:
            faces.add(full[i][1] - 1)
        for f in sorted(faces):
            lo = [inner[j][0] if j < i else full[j][0] for j in range(d)]
            hi = [inner[j][1] if j < i else full[j][1] for j in range(d)]
            lo[i], hi[i] = f, f + 1
            if all(h > l for l, h in zip(lo, hi)):
                out.append((tuple(lo), tuple(hi)))
    return out


def _inner_box(shape, width, sides):
    out = []
    for n, w, (low, high) in zip(shape, width, sides):
        a = w + (1 if low else 0)
        out.append((a, max(a, w + n - (1 if high else 0))))
    return out


def interior_region(shape, width, sides=None):
    """The owned cells whose stencil reads no ghost cell filled by the exchange
    (``sides`` as in :func:`shell_regions`; None: every side has a neighbour)."""
    if sides is None:
        sides = ((True, True),) * len(shape)
    inner = _inner_box(shape, width, sides)
    return tuple(a for a, _ in inner), tuple(b for _, b in inner)


# Launch geometry of the device kernels (cuda and cupy backends).
THREADS_3D = (32, 8, 1)     # last axis, middle axis: a warp reads 32 consecutive doubles
THREADS_2D = (128, 1, 1)    # last axis
TARGET_BLOCKS = 4096        # enough blocks for a few waves on a large GPU (H100: 132 SMs)
CHUNK_MIN, CHUNK_MAX = 16, 64  # cells per thread along the first axis


def launch_geometry(lo, hi, chunk=None):
    """``(blocks, threads, chunk)`` for a device update of the box ``[lo, hi)``,
    or None when the box is empty.

    Threads cover the last axis (fastest thread index, coalesced) and, in 3-D,
    the middle one; each thread marches ``chunk`` cells along the first axis.
    ``chunk`` (unless given) is the largest in ``[CHUNK_MIN, CHUNK_MAX]`` that
    still gives about ``TARGET_BLOCKS`` blocks: longer marches re-read fewer
    planes (2 per chunk), more blocks fill the GPU.
    """
    ext = [b - a for a, b in zip(lo, hi)]
    if min(ext) <= 0:
        return None
    threads = THREADS_3D if len(ext) == 3 else THREADS_2D
    bx = -(-ext[-1] // threads[0])
    by = -(-ext[1] // threads[1]) if len(ext) == 3 else 1
    if chunk is None:
        want = max(1, -(-TARGET_BLOCKS // (bx * by)))
        chunk = max(CHUNK_MIN, min(CHUNK_MAX, -(-ext[0] // want)))
    chunk = max(1, min(int(chunk), ext[0]))
    bz = -(-ext[0] // chunk)
    blocks = (bx, by, bz) if len(ext) == 3 else (bx, bz, 1)
    return blocks, threads, chunk


# ------------------------------------------------------------ backend glue
def _to_backend(backend, u0):
    """The two fields ``(u, un)`` of ``backend``, both equal to ``u0``."""
    if backend == "cuda":
        from numba import cuda  # noqa: PLC0415 - numba.cuda only when asked for

        return cuda.to_device(u0), cuda.to_device(u0)
    if backend == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.asarray(u0), cupy.asarray(u0)
    return u0, u0.copy()


def _to_host(backend, u):
    if backend == "cuda":
        return u.copy_to_host()
    if backend == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.asnumpy(u)
    return u


def _synchronizer(backend):
    """A callable that waits for the backend's queued device work (no-op on the host)."""
    if backend == "cuda":
        from numba import cuda  # noqa: PLC0415

        return cuda.synchronize
    if backend == "cupy":
        import cupy  # noqa: PLC0415

        return lambda: cupy.cuda.get_current_stream().synchronize()
    return lambda: None


def _noop(parity):
    return None


def _region_updates(backend, fields, c, shape, width, sides, chunk=None):
    """Three callables of the step parity ``p`` (each updates from
    ``fields[p]`` into ``fields[1 - p]``), built once per solve:

    * ``run_all``: every owned cell (one device launch);
    * ``run_inner``: the cells whose stencil reads no exchanged ghost cell
      (one launch; a no-op when that box is empty);
    * ``run_shell``: the other owned cells (device: ONE launch over the owned
      box that skips the interior; host: one call per face).

    Device launches are configured here (kernel specialized and bound to its
    grid, arguments for both parities prepared), so a step allocates nothing.
    """
    full_lo = tuple(width)
    full_hi = tuple(w + n for n, w in zip(shape, width))
    inner_lo, inner_hi = interior_region(shape, width, sides)
    if backend in DEVICE_BACKENDS:
        if backend == "cuda":
            from . import _heat_cuda as kernels  # noqa: PLC0415 - numba.cuda only when asked for
        else:
            from . import _heat_cupy as kernels  # noqa: PLC0415 - CuPy only when asked for
        a, b = fields

        def region(lo, hi, skip=None):
            geo = launch_geometry(lo, hi, chunk)
            if geo is None:
                return _noop
            return kernels.Launch(a, b, c, lo, hi, skip, *geo).launch

        return (region(full_lo, full_hi), region(inner_lo, inner_hi),
                region(full_lo, full_hi, (inner_lo, inner_hi)))

    update = _UPDATES[backend]
    shell = shell_regions(shape, width, sides)
    pairs = (fields, fields[::-1])

    def run_all(p):
        update(*pairs[p], c, full_lo, full_hi)

    def run_inner(p):
        if all(h > l for l, h in zip(inner_lo, inner_hi)):
            update(*pairs[p], c, inner_lo, inner_hi)

    def run_shell(p):
        for lo, hi in shell:
            update(*pairs[p], c, lo, hi)

    return run_all, run_inner, run_shell


# ------------------------------------------------------------------- solver
@dataclass
class HeatResult:
    """Summary of one run (what ``--json`` writes).

    Attributes:
        grid: global interior points per dimension.
        ranks: number of MPI ranks; dims: their Cartesian layout.
        steps: time steps taken; dt, t_final: seconds of model time.
        l2_error: discrete L2 norm of ``u - exact`` over the unit domain.
        max_error: max abs of ``u - exact``; rel_l2_error: l2_error over the
            exact solution's L2 norm.
        mlups: million lattice-site updates per second (wall time, max over ranks).
        glups: the same in billions (``mlups / 1000``).
        comm_fraction: share of the wall time spent in halo exchange calls
            (not hidden behind the interior update), max over ranks.
        wall_s: seconds of the time loop; verified: bit-identical to a
            single-process run (None when not checked).
        compile_s: seconds of kernel compilation and warm-up before the
            timed loop, max over ranks (None where the driver does not report it).
    """

    grid: list
    ranks: int
    dims: list
    backend: str
    steps: int
    alpha: float
    dt: float
    t_final: float
    l2_error: float
    max_error: float
    rel_l2_error: float
    mlups: float
    comm_fraction: float
    wall_s: float
    verified: bool | None = None
    extra: dict = field(default_factory=dict)
    glups: float = float("nan")
    compile_s: float | None = None

    def __post_init__(self):
        if math.isnan(self.glups):
            self.glups = self.mlups / 1e3


def _setup(comm, grid):
    d = len(grid)
    dims = list(commlib.compute_dims(comm.size, d))
    for i, (n, p) in enumerate(zip(grid, dims)):
        if n < p:  # same verdict on every rank: grid and dims are global
            raise InvalidArgument(f"grid {list(grid)} has {n} point(s) in dimension {i} but {p} ranks along it "
                                  f"(dims {dims}); use a larger --grid or fewer ranks", rank=comm.rank, op="heat.solve")
    cart = comm.cart_create(dims=dims, periods=[False] * d)
    shape, offset = block_of(grid, cart.dims, cart.coords)
    return cart, shape, offset


def solve(comm, grid, steps=200, alpha=1.0, backend="numba", cfl=0.5, t_final=None,
          progress=False, overlap=True):
    """Run the solver on ``comm``.

    Args:
        comm: a commlib Communicator (any size).
        grid: global interior points per dimension (2 or 3 ints; 1 for tests).
        steps: time steps (ignored when ``t_final`` is given).
        alpha: diffusivity (unit domain, so any positive float).
        backend: ``"numpy"``, ``"numba"`` (host kernels), ``"cuda"``
            (numba.cuda kernels on numba device arrays; the CUDA simulator
            without a GPU) or ``"cupy"`` (a CUDA C ``cupy.RawKernel`` on CuPy
            arrays, on CuPy's current stream; needs CuPy and a GPU).  The
            device backends update a region in one launch: thread blocks on
            the last two axes, each thread marching along the first.
        cfl: fraction of the FTCS stability limit used for ``dt`` (0 < cfl <= 1).
        t_final: model time to reach; ``steps = ceil(t_final/dt_max)``.
        progress: show a tqdm bar on rank 0.
        overlap: update the interior while the halo exchange is in flight
            (then the shell).  Where a rank has no neighbour on a side, that
            side needs no exchange and no shell; a rank with no neighbour at
            all (one rank) updates its block in one call and never calls the
            halo exchange.

    Returns:
        (HeatResult, local_field): the summary (same on every rank) and this
        rank's owned block as a float64 numpy array of its local shape.

    Raises:
        InvalidArgument: unknown backend, bad grid, cfl or alpha, or more ranks
            along a dimension than points; raised on every rank before any
            halo message moves.  Also (on each rank that lacks it) the cupy
            backend without CuPy or without a GPU.
    """
    op = "heat.solve"
    grid = [int(n) for n in grid]
    if backend not in BACKENDS:
        raise InvalidArgument(f"unknown backend {backend!r}; choose one of {BACKENDS}", rank=comm.rank, op=op)
    if not 1 <= len(grid) <= 3 or min(grid) < 1:
        raise InvalidArgument(f"grid {grid} must have 1 to 3 positive sizes", rank=comm.rank, op=op)
    if backend in DEVICE_BACKENDS and len(grid) == 1:
        raise InvalidArgument(f"the {backend} backend needs a 2-D or 3-D grid", rank=comm.rank, op=op)
    if not 0 < cfl <= 1 or alpha <= 0:
        raise InvalidArgument(f"need 0 < cfl <= 1 and alpha > 0 (got cfl={cfl}, alpha={alpha})",
                              rank=comm.rank, op=op)
    if backend == "cupy":
        from . import _heat_cupy  # noqa: PLC0415 - CuPy only when asked for

        _heat_cupy.require_cupy(rank=comm.rank, op=op)
    d = len(grid)
    dx, dt, steps, c = time_step(grid, alpha, cfl, steps, t_final)

    cart, shape, offset = _setup(comm, grid)
    halo = _halo_exchange()(cart, shape, width=1, corners=False, dtype=np.float64)
    width = halo.width
    u0 = np.zeros(halo.shape)
    u0[halo.interior] = exact_solution(grid, offset, shape, 0.0, alpha)
    # Two fixed fields, swapped by parity: step s reads fields[s % 2] and writes
    # the other, so the halo always sees the same two array objects.
    fields = _to_backend(backend, u0)
    sides = neighbour_sides(cart.dims, cart.coords)
    exchange = any(low or high for low, high in sides)  # False at 1 rank: no halo call at all
    run_all, run_inner, run_shell = _region_updates(backend, fields, c, shape, width, sides)
    sync = _synchronizer(backend)

    # Compile and warm up every kernel the loop uses before the clock starts
    # (numba compiles on first call; the halo exchange packs with kernels of
    # its own; with overlap the interior and shell updates are kernels of
    # their own). The updates write fields[1], which the first
    # step overwrites. The ranks then wait for the slowest compiler, so none of
    # it counts as time step or communication time.
    t_compile = time.perf_counter()
    if exchange:  # the halo's pack/unpack kernels too; step 0's exchange fills the same ghost cells again
        halo.exchange(fields[0])
    run_all(0)
    if exchange and overlap:
        run_inner(0)
        run_shell(0)
    sync()
    t_compile = time.perf_counter() - t_compile
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=steps, desc=f"heat {d}-D {backend} x{comm.size}", unit="step", leave=False,
                   mininterval=0.5)
    comm.barrier()
    t_comm = 0.0
    clock = time.perf_counter
    t0 = clock()
    for s in range(steps):
        p = s & 1
        if not exchange:
            run_all(p)
        elif overlap:
            a = clock()
            req = halo.start(fields[p])
            t_comm += clock() - a
            run_inner(p)
            a = clock()
            req.wait()
            t_comm += clock() - a
            run_shell(p)
        else:
            a = clock()
            halo.exchange(fields[p])
            t_comm += clock() - a
            run_all(p)
        if bar is not None:
            bar.update(1)
    sync()
    wall = clock() - t0
    if bar is not None:
        bar.close()
    halo.free()

    local = _to_host(backend, fields[steps % 2])[halo.interior].copy()
    t = steps * dt
    err = local - exact_solution(grid, offset, shape, t, alpha)
    ex = exact_solution(grid, offset, shape, t, alpha)
    sums = comm.allreduce(np.array([float(np.sum(err * err)), float(np.sum(ex * ex))]), op="sum")
    maxes = comm.allreduce(np.array([float(np.max(np.abs(err))) if err.size else 0.0, wall,
                                     t_comm / wall if wall else 0.0, t_compile]), op="max")
    vol = float(np.prod(dx))
    cells = int(np.prod(grid))
    res = HeatResult(
        grid=grid, ranks=comm.size, dims=list(cart.dims), backend=backend, steps=steps, alpha=alpha,
        dt=dt, t_final=t, l2_error=math.sqrt(sums[0] * vol), max_error=float(maxes[0]),
        rel_l2_error=math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else float("nan"),
        mlups=cells * steps / maxes[1] / 1e6 if maxes[1] > 0 else float("nan"),
        comm_fraction=float(maxes[2]), wall_s=float(maxes[1]), compile_s=float(maxes[3]),
    )
    cart.free()
    return res, local


_GATHER_TAG = 77  # user tag of gather_field's blocks


def gather_field(comm, grid, local, root=0):
    """Assemble the global field on ``root`` from every rank's block (None elsewhere).

    Each rank's block geometry is recomputed from its Cartesian coordinates,
    so only the float64 data travels (no pickling).  The blocks move on a
    Cartesian communicator of their own (the same layout as :func:`solve`'s),
    so the gather's messages cannot match anything else in flight on ``comm``.
    """
    d = len(grid)
    dims = commlib.compute_dims(comm.size, d)
    cart = comm.cart_create(dims=dims, periods=[False] * d)
    try:
        if cart.rank != root:
            cart.send(np.ascontiguousarray(local, dtype=np.float64), dest=root, tag=_GATHER_TAG)
            return None
        out = np.empty(grid, dtype=np.float64)
        for r in range(cart.size):
            shape, offset = block_of(grid, cart.dims, cart.coords_of(r))
            box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            if r == cart.rank:
                out[box] = local
            else:
                buf = np.empty(shape, dtype=np.float64)
                cart.recv(buf, source=r, tag=_GATHER_TAG)
                out[box] = buf
        return out
    finally:
        cart.free()


# --------------------------------------------------------- fault tolerance
def _kill_self():
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def solve_ft(comm, grid, steps=200, alpha=1.0, backend="numba", cfl=0.5, t_final=None,
             checkpoint_every=20, kill=(), progress=False):
    """Run the solver so that it survives rank failures (ULFM).

    Every ``checkpoint_every`` steps each rank keeps a copy of its owned block
    and sends one to its buddy, rank ``(r + 1) % size`` (in-memory buddy
    checkpointing), committed only when every survivor agreed the exchange
    succeeded.  When a rank dies (seen as :class:`commlib.ProcessFailed` or
    :class:`commlib.CommTimeout` from the halo exchange, a checkpoint or the
    final reductions), the survivors revoke the Cartesian communicator, shrink
    ``comm`` (:meth:`commlib.Communicator.recover`), rebuild the field of the
    last checkpoint from the owners' and buddies' copies, re-decompose the grid
    over the remaining ranks and go on from that step.  FTCS does the same
    arithmetic per cell whatever the decomposition, so the final field equals a
    failure-free run bit for bit.  A block is lost only when its owner and its
    buddy both die between two checkpoints.

    Args:
        comm: ``commlib.init(fault_tolerant=True, on_failure="raise")`` under
            ``mpiexec --with-ft ulfm``.
        grid, steps, alpha, backend, cfl, t_final, progress: as :func:`solve`
            (backends ``"numpy"`` and ``"numba"``).
        checkpoint_every: steps between checkpoints (K).
        kill: ``(world_rank, step)`` pairs: that rank SIGKILLs itself when it is
            about to take that step (fault injection for tests and demos).

    Returns:
        (HeatResult, local_field): as :func:`solve`; ``extra`` holds
        ``failed`` (lost COMM_WORLD ranks), ``recoveries`` (count) and
        ``recovery_s`` (seconds from detection to resumed stepping, each).

    Raises:
        InvalidArgument: as :func:`solve`, or ``comm`` not fault tolerant.
        ProcessFailed: a block and its buddy copy were both lost.
    """
    op = "heat.solve_ft"
    grid = [int(n) for n in grid]
    if comm.fault_tolerant != "ulfm":
        raise InvalidArgument("--fault-tolerant needs ULFM: mpiexec --with-ft ulfm --mca btl tcp,self",
                              rank=comm.rank, op=op)
    if backend not in ("numpy", "numba"):
        raise InvalidArgument("fault-tolerant mode runs the numpy and numba backends", rank=comm.rank, op=op)
    if checkpoint_every < 1:
        raise InvalidArgument("checkpoint_every must be >= 1", rank=comm.rank, op=op)
    d = len(grid)
    dx, dt, steps, c = time_step(grid, alpha, cfl, steps, t_final)
    update = _UPDATES[backend]
    world = comm.world_ranks[comm.rank]
    kills = {int(s) for r, s in kill if int(r) == world}

    full = None          # field to restart from (global, after a recovery)
    step = 0
    ck = None            # committed checkpoint
    stats = {"recoveries": 0, "recovery_s": []}
    t_start = time.perf_counter()
    t_detect = None
    while True:
        cart = halo = None
        try:
            cart = comm.cart_create(dims=[0] * d, periods=[False] * d)
            n, r = comm.size, comm.rank
            shape, offset = block_of(grid, cart.dims, cart.coords)
            if min(shape) < 1:
                raise InvalidArgument(f"{n} ranks leave an empty block on grid {grid}", rank=r, op=op)
            halo = _halo_exchange()(cart, shape, width=1, corners=False, dtype=np.float64)
            u = np.zeros(halo.shape)
            box = tuple(slice(o, o + m) for o, m in zip(offset, shape))
            u[halo.interior] = exact_solution(grid, offset, shape, 0.0, alpha) if full is None else full[box]
            full = None
            un = u.copy()
            inner_lo, inner_hi = interior_region(shape, halo.width)
            shell = shell_regions(shape, halo.width)
            # geometry of every rank's block in this epoch (for the buddy copies)
            geo = [block_of(grid, cart.dims, cart.coords_of(q)) for q in range(n)]
            members = [int(x) for x in comm.world_ranks]
            if t_detect is not None:
                stats["recovery_s"].append(time.perf_counter() - t_detect)
                t_detect = None
            last_ck = None
            while True:
                if step % checkpoint_every == 0 and last_ck != step or step == steps and last_ck != step:
                    # buddy checkpoint: my block to r+1, r-1's block to me; both kept
                    mine = np.ascontiguousarray(u[halo.interior])
                    left = (r - 1) % n
                    theirs = np.empty(geo[left][0], dtype=np.float64)
                    comm.sendrecv_resilient(mine, (r + 1) % n, theirs, left, name="heat.checkpoint")
                    ck = {"step": step, "members": members, "geo": geo,
                          "blocks": {members[r]: mine, members[left]: theirs}}
                    last_ck = step
                if step == steps:
                    break
                if step in kills:
                    _kill_self()
                req = halo.start(u)
                update(u, un, c, inner_lo, inner_hi)
                req.wait()
                for lo, hi in shell:
                    update(u, un, c, lo, hi)
                u, un = un, u
                step += 1
            local = u[halo.interior].copy()
            t = steps * dt
            ex = exact_solution(grid, offset, shape, t, alpha)
            err = local - ex
            sums = comm.allreduce(np.array([float(np.sum(err * err)), float(np.sum(ex * ex))]), op="sum")
            maxes = comm.allreduce(np.array([float(np.max(np.abs(err)))]), op="max")
            break
        except (ProcessFailed, CommTimeout) as exc:  # a peer died (or was revoked): recover collectively
            t_detect = time.perf_counter()
            # revoke what the halo traffic runs on, so survivors blocked on a
            # live neighbour are released and join the recovery
            if halo is not None:
                halo.revoke()
            if cart is not None:
                try:
                    cart.revoke()
                except commlib.CommError:  # already revoked, or its peers gone
                    pass
            if not getattr(exc, "recovered", False):
                comm.recover()
            stats["recoveries"] += 1
            full, step = _restore_checkpoint(comm, grid, ck, op)
    wall = time.perf_counter() - t_start
    vol = float(np.prod(dx))
    cells = int(np.prod(grid))
    res = HeatResult(
        grid=grid, ranks=comm.size, dims=list(cart.dims), backend=backend, steps=steps, alpha=alpha,
        dt=dt, t_final=steps * dt, l2_error=math.sqrt(sums[0] * vol), max_error=float(maxes[0]),
        rel_l2_error=math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else float("nan"),
        mlups=cells * steps / wall / 1e6, comm_fraction=float("nan"), wall_s=wall,
        extra={"fault_tolerant": True, "failed": list(comm.failed_ranks), "checkpoint_every": checkpoint_every,
               "recoveries": stats["recoveries"], "recovery_s": stats["recovery_s"]},
    )
    try:
        halo.free()
        cart.free()
    except Exception:  # noqa: BLE001
        pass
    return res, local


def _restore_checkpoint(comm, grid, ck, op):
    """Rebuild the global field of the last committed checkpoint on every survivor.

    Each survivor contributes the blocks it holds (its own and its buddy copy)
    through one fault-tolerant allgather of fixed-size records; returns
    ``(field, step)``.
    """
    if ck is None:
        return None, 0
    geo, members = ck["geo"], ck["members"]
    maxlen = max(int(np.prod(s)) for s, _ in geo)
    rec = np.full((2, 1 + maxlen), -1.0)
    for slot, (w, data) in enumerate(sorted(ck["blocks"].items())[:2]):
        rec[slot, 0] = w
        rec[slot, 1:1 + data.size] = data.reshape(-1)
    allrec = comm.allgather(rec).reshape(-1, 1 + maxlen)
    field_ = np.empty(grid, dtype=np.float64)
    have = set()
    for row in allrec:
        w = int(row[0])
        if w < 0 or w in have:
            continue
        q = members.index(w)
        shape, offset = geo[q]
        box = tuple(slice(o, o + m) for o, m in zip(offset, shape))
        field_[box] = row[1:1 + int(np.prod(shape))].reshape(shape)
        have.add(w)
    missing = sorted(set(members) - have)
    if missing:
        raise ProcessFailed(f"checkpoint blocks of COMM_WORLD ranks {missing} lost (owner and buddy both failed)",
                            failed=comm.failed_ranks, rank=comm.rank, op=op)
    return field_, ck["step"]


def plot_midplane(field_, path, title=""):
    """Save a PNG of the field's mid-plane (the middle slice of the last axis in 3-D)."""
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


# --------------------------------------------------------------------- CLI
#: limits of the command line (a grid side, all grid points, steps)
MAX_SIDE, MAX_POINTS, MAX_STEPS = 1 << 20, 1 << 36, 10 ** 9


def check_args(parser: argparse.ArgumentParser, args, size: int | None = None) -> list:
    """Refuse values the solver cannot run (``parser.error``: one line, exit 2)
    before MPI communicates; returns the grid, one size per dimension.

    ``size`` is the job's rank count (default: :func:`._cli.world_size`, from
    the launcher's environment before MPI is up; 1 when nothing tells).

    Checks: ``--grid`` sizes (1 or ``--dims`` of them, each in
    ``[1, MAX_SIDE]``, at most ``MAX_POINTS`` points, at least one point per
    rank), ``--steps`` in ``[1, MAX_STEPS]``, ``--t-final``, ``--alpha`` finite
    and > 0, ``--cfl`` finite in (0, 1], ``--checkpoint-every`` >= 1, ``--kill``
    only with ``--fault-tolerant`` and as ``RANK:STEP`` (a rank of the job, a
    step >= 0), ``--json``/``--plot`` writable (and matplotlib present for
    ``--plot``).
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
    if args.checkpoint_every < 1:
        err(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    kill = []
    if args.kill and not args.fault_tolerant:
        err("--kill needs --fault-tolerant")
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
        kill.append((rank, step))
    args.kill_list = kill
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


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        "heat",
        prog="python -m commlib.apps.heat",
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
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
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the mid-plane")
    p.add_argument("--verify", action="store_true",
                   help="gather the field and compare bit for bit with a single-process run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="survive rank failures (ULFM: mpiexec --with-ft ulfm --mca btl tcp,self): in-memory buddy "
                        "checkpoints, shrink, re-decompose, restore")
    p.add_argument("--checkpoint-every", type=int, default=20, metavar="K",
                   help="steps between buddy checkpoints in --fault-tolerant mode (default 20)")
    p.add_argument("--kill", action="append", default=[], metavar="RANK:STEP",
                   help="fault injection: COMM_WORLD rank RANK SIGKILLs itself before step STEP (repeatable)")
    return p


def main(argv=None) -> int:
    """The command line; returns the exit status (2: a refused value or
    argument error, reported in one line on stderr by rank 0)."""
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
    size = world_size()
    grid = check_args(parser, args, size or 1)
    _load_solver()
    comm = commlib.init(fault_tolerant=True, on_failure="raise") if args.fault_tolerant else commlib.init()
    if comm.size != (size or 1):  # a launcher that did not name the size: check again (every rank alike)
        grid = check_args(parser, args, comm.size)
    if args.fault_tolerant:
        kill = args.kill_list
        res, local = solve_ft(comm, grid, steps=args.steps, alpha=args.alpha, backend=args.backend, cfl=args.cfl,
                              t_final=args.t_final, checkpoint_every=args.checkpoint_every, kill=kill)
    else:
        res, local = solve(comm, grid, steps=args.steps, alpha=args.alpha, backend=args.backend, cfl=args.cfl,
                           t_final=args.t_final, progress=not args.no_progress,
                           overlap=not args.no_overlap)
    full = None
    if args.verify or args.plot:
        full = gather_field(comm, grid, local)
    if args.verify:
        ok = None
        solo = comm.split(color=comm.rank)  # collective: a 1-rank communicator on every rank
        if comm.rank == 0:
            _, ref = solve(solo, grid, steps=res.steps, alpha=args.alpha,
                           backend=args.backend, cfl=args.cfl, t_final=args.t_final)
            ok = bool(np.array_equal(full, ref))
        solo.free()
        res.verified = bool(comm.bcast(np.array([1 if ok else 0], dtype=np.int32), root=0)[0])
    if comm.rank == 0:
        print(f"heat {len(grid)}-D grid {'x'.join(map(str, grid))} on {res.ranks} rank(s) dims "
              f"{'x'.join(map(str, res.dims))}, backend {res.backend}")
        print(f"  steps {res.steps}  dt {res.dt:.3e}  t {res.t_final:.4e}")
        print(f"  error vs exact: L2 {res.l2_error:.3e} (relative {res.rel_l2_error:.3e}), max {res.max_error:.3e}")
        if res.compile_s is not None:
            print(f"  kernel compilation and warm-up (before the timed loop): {res.compile_s:.3f} s")
        print(f"  {res.mlups:.1f} MLUPS ({res.glups:.2f} GLUPS), wall {res.wall_s:.3f} s, "
              f"comm fraction {res.comm_fraction:.1%}")
        if res.verified is not None:
            print(f"  single-process check: {'bit-identical' if res.verified else 'MISMATCH'}")
        if res.extra.get("fault_tolerant"):
            print(f"  fault tolerant: lost COMM_WORLD ranks {res.extra['failed']}, {res.extra['recoveries']} "
                  f"recovery(ies), recovery times {[round(x, 3) for x in res.extra['recovery_s']]} s")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(asdict(res), fh, indent=2)
        if args.plot and full is not None:
            plot_midplane(full, args.plot, f"u at t={res.t_final:.3g} ({res.ranks} ranks)")
            print(f"  plot: {args.plot}")
    return 0 if res.verified in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
