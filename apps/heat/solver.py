"""The heat solver's two drivers over one time loop, and their summary.

:func:`.timeloop.run_steps` is the only time loop.  It compiles and warms up every
kernel the loop uses (adding the seconds to ``timers.compile_s``), waits for
every rank (so compilation never counts as step or communication time),
then takes the steps ``[start, stop)`` on a :class:`.timeloop.Block` (this rank's
block of the grid in one decomposition: two padded fields swapped by step
parity, the halo exchange and the region updates), exchanging halos with or
without overlap, and returns the seconds the steps took.

* :func:`solve` (plain): one block, ``run_steps(0, steps)``.
* :func:`solve_ft` (fault tolerant, ULFM): the same ``run_steps`` per
  *epoch* (one decomposition over the ranks alive), started at the step of
  the last checkpoint, as the step of a :class:`commlib.ResilientRunner`:
  ``before_step`` takes the in-memory buddy checkpoints and injects the
  requested kills; a failure raised anywhere in the epoch revokes the epoch's
  communicators, shrinks ``comm``, rebuilds the checkpoint's field (the
  runner's ``load``), re-decomposes (its ``reshard``) and redoes the epoch.

Both end in :func:`_summary` (error against :func:`.model.exact_solution`,
MLUPS, communication share, compile time; one :class:`HeatResult`).
"""
from __future__ import annotations

import math
import numbers
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import commlib  # light: commlib's names load on first use
from commlib import InvalidArgument

from .model import BACKENDS, DEVICE_BACKENDS, block_of, exact_solution, time_step
from .timeloop import Block, Timers, run_steps


def load_solver():
    """Import what a run needs (the communicator: mpi4py.MPI; the halo
    exchange: the datatypes and numba) in one go, before MPI's first
    collective, as ``import commlib`` did before the command line became
    light: a rank still importing while its peer spins in a collective would
    share the cores with it (on 2 cores a 2-rank run took 0.5 s longer)."""
    import commlib.communicator  # noqa: F401, PLC0415

    _halo_exchange()


#: the ``halo`` choices of :func:`solve`
HALOS = ("auto", "shm", "mpi")


def _node_halo():
    """``commlib.apps.heat.NodeHalo`` (the shared-memory exchange), looked up at each call."""
    return getattr(sys.modules[__package__], "NodeHalo")


def _halo_exchange():
    """The halo exchange class the drivers build: the package's
    ``commlib.apps.heat.HaloExchange`` (it loads on first use), looked up at
    each call so that a test may replace it there."""
    return getattr(sys.modules[__package__], "HaloExchange")


# ------------------------------------------------------------------ result
@dataclass
class HeatResult:
    """Summary of one run (what ``--json`` writes); the same on every rank.

    Attributes:
        grid: global interior points per dimension (list of ints).
        ranks: number of MPI ranks (at the end); dims: their Cartesian layout.
        backend: the backend's name (``BACKENDS``).
        steps: time steps taken; alpha: diffusivity; dt, t_final: model time
            (the unit of ``1 / alpha`` on the unit domain), ``t_final = steps * dt``.
        l2_error: discrete L2 norm of ``u - exact`` over the unit domain.
        max_error: max abs of ``u - exact``; rel_l2_error: l2_error over the
            exact solution's L2 norm.
        mlups: million lattice-site updates per second (``grid`` points times
            ``steps`` over ``wall_s``).
        glups: the same in billions (``mlups / 1000``).
        comm_fraction: share of the wall time spent in halo exchange calls
            (not hidden behind the interior update), max over ranks.
        wall_s: seconds of the time loop, max over ranks (fault tolerant:
            from the start to the final reductions, checkpoints and
            recoveries included, kernel warm-up excluded); verified:
            bit-identical to a single-process run (None when not checked).
        extra: driver details (:func:`solve`: ``halo``, how ghost cells
            travelled: ``"shm"``, ``"mpi"`` or ``"none"`` on one rank; fault
            tolerant: ``fault_tolerant``, ``failed``, ``checkpoint_every``,
            ``recoveries``, ``recovery_s``).
        compile_s: seconds of kernel compilation and warm-up before the
            timed loop, max over ranks (summed over the epochs when fault
            tolerant; None where the driver does not report it).
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


# ------------------------------------------------------------------- setup
def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and math.isfinite(v)


#: the values every rank of a run must pass alike, agreed before any halo message
_AGREED = ("ndims", "grid[0]", "grid[1]", "grid[2]", "steps", "t_final", "alpha", "cfl")
_FLOATS = frozenset(("t_final", "alpha", "cfl"))


def _bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def _describe(name: str, v: int):
    return float(np.int64(v).view(np.float64)) if name in _FLOATS else v


def _check_local(comm, grid, backend, cfl, alpha, progress, op, steps, t_final) -> list:
    """This rank's checks of :func:`_check_args`; ``grid`` as a list of ints."""
    if backend not in BACKENDS:
        raise InvalidArgument(f"unknown backend {backend!r}; choose one of {BACKENDS}", rank=comm.rank, op=op)
    grid = list(grid)
    if not 1 <= len(grid) <= 3 or not all(_is_int(n) and n >= 1 for n in grid):
        raise InvalidArgument(f"grid {grid} must have 1 to 3 positive integer sizes", rank=comm.rank, op=op)
    grid = [int(n) for n in grid]
    if t_final is None:
        if not _is_int(steps) or steps < 1:
            raise InvalidArgument(f"steps must be a positive integer, got {steps!r}", rank=comm.rank, op=op)
    elif not _is_real(t_final) or t_final <= 0:
        raise InvalidArgument(f"t_final must be a positive, finite model time, got {t_final!r}",
                              rank=comm.rank, op=op)
    if backend in DEVICE_BACKENDS and len(grid) == 1:
        raise InvalidArgument(f"the {backend} backend needs a 2-D or 3-D grid", rank=comm.rank, op=op)
    if not (_is_real(cfl) and _is_real(alpha) and 0 < cfl <= 1 and alpha > 0):
        raise InvalidArgument(f"need 0 < cfl <= 1 and a finite alpha > 0 (got cfl={cfl!r}, alpha={alpha!r})",
                              rank=comm.rank, op=op)
    if progress is not None and progress is not False and not callable(progress):
        raise InvalidArgument(f"progress must be None or a callable progress(total, initial) returning a bar "
                              f"(commlib.apps.heat.cli.progress_bar), got {progress!r}", rank=comm.rank, op=op)
    if backend == "cupy":
        from .. import _heat_cupy  # noqa: PLC0415 - CuPy only when asked for

        _heat_cupy.require_cupy(rank=comm.rank, op=op)
    return grid


def _check_args(comm, grid, backend, cfl, alpha, progress, op, steps, t_final, local_error=None) -> list:
    """Check a run's arguments and agree on them across ``comm`` (one all-gather
    of a small header: the grid, ``steps`` or ``t_final``, ``alpha`` and ``cfl``)
    before any halo message moves; return ``grid`` as a list of ints.

    A grid size or step count that is not an integer is refused, never
    truncated; NaN, infinite and bool values are refused.  ``local_error``: a
    problem the caller found already (raised here, through the agreement).

    Raises:
        InvalidArgument: on every rank alike: this rank's own error as is, and
            elsewhere one naming the rank(s) whose arguments were bad, or each
            value that differs across ranks (a rank with more steps than the
            others used to wait forever for their halo messages; a different
            alpha gave a silently inconsistent field).
    """
    values = [0] * len(_AGREED)
    if local_error is None:
        try:
            grid = _check_local(comm, grid, backend, cfl, alpha, progress, op, steps, t_final)
        except InvalidArgument as exc:
            local_error = exc
        else:
            values = [len(grid), *(grid + [0, 0])[:3], int(steps) if t_final is None else 0,
                      _bits(t_final) if t_final is not None else 0, _bits(alpha), _bits(cfl)]
    comm.agree_arguments(values, _AGREED, op=op, local_error=local_error, describe=_describe)
    return grid


def _setup(comm, grid, op):
    """The Cartesian communicator over ``comm`` (``commlib.compute_dims``)
    and this rank's ``(cart, shape, offset)``; InvalidArgument on every rank
    when a dimension has fewer points than ranks."""
    d = len(grid)
    dims = list(commlib.compute_dims(comm.size, d))
    for i, (n, p) in enumerate(zip(grid, dims)):
        if n < p:  # same verdict on every rank: grid and dims are global
            raise InvalidArgument(f"grid {list(grid)} has {n} point(s) in dimension {i} but {p} ranks along it "
                                  f"(dims {dims}); use a larger --grid or fewer ranks", rank=comm.rank, op=op)
    cart = comm.cart_create(dims=dims, periods=[False] * d)
    shape, offset = block_of(grid, cart.dims, cart.coords)
    return cart, shape, offset


def _summary(comm, grid, blk, local, backend, steps, alpha, dt, dx, wall, timers, extra=None):
    """The HeatResult of a run that ended with ``local`` (this rank's owned
    block): two reductions over ``comm`` (every rank calls it)."""
    t = steps * dt
    ex = exact_solution(grid, blk.offset, blk.shape, t, alpha)
    err = local - ex
    sums = comm.allreduce(np.array([float(np.sum(err * err)), float(np.sum(ex * ex))]), op="sum")
    maxes = comm.allreduce(np.array([float(np.max(np.abs(err))) if err.size else 0.0, wall,
                                     timers.comm_s / wall if wall else 0.0, timers.compile_s]), op="max")
    vol = float(np.prod(dx))
    cells = int(np.prod(grid))
    return HeatResult(
        grid=grid, ranks=comm.size, dims=list(blk.cart.dims), backend=backend, steps=steps, alpha=alpha,
        dt=dt, t_final=t, l2_error=math.sqrt(sums[0] * vol), max_error=float(maxes[0]),
        rel_l2_error=math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else float("nan"),
        mlups=cells * steps / maxes[1] / 1e6 if maxes[1] > 0 else float("nan"),
        comm_fraction=float(maxes[2]), wall_s=float(maxes[1]), compile_s=float(maxes[3]), extra=extra or {},
    )


# ------------------------------------------------------------------ drivers
class _Stop(Exception):
    """:func:`solve`'s ``stop`` said yes before step ``step``."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def solve(comm, grid, steps=200, alpha=1.0, backend="numba", cfl=0.5, t_final=None,
          progress=None, overlap=True, time_block=1, start=None, stop=None, halo="auto"):
    """Run the solver on ``comm``.

    Args:
        comm: a commlib Communicator (any size).
        grid: global interior points per dimension (2 or 3 ints; 1 for tests).
        steps: time steps, a positive integer (ignored when ``t_final`` is given).
        alpha: diffusivity (unit domain, so any positive, finite float).
        backend: ``"numpy"``, ``"numba"`` (host kernels), ``"cuda"``
            (numba.cuda kernels on numba device arrays; the CUDA simulator
            without a GPU) or ``"cupy"`` (a CUDA C ``cupy.RawKernel`` on CuPy
            arrays, on CuPy's current stream; needs CuPy and a GPU).  The
            device backends update a region in one launch: thread blocks on
            the last two axes, each thread marching along the first.
        cfl: fraction of the FTCS stability limit used for ``dt`` (0 < cfl <= 1).
        t_final: model time to reach (positive, finite); ``steps = ceil(t_final/dt_max)``.
        progress: None, or ``progress(total, initial)`` returning a bar with
            ``update(n)`` and ``close()``, called on the ranks that pass it
            (the command line passes :func:`commlib.apps.heat.cli.progress_bar`'s
            tqdm bar on rank 0).
        overlap: update the interior while the halo exchange is in flight
            (then the shell).  Where a rank has no neighbour on a side, that
            side needs no exchange and no shell; a rank with no neighbour at
            all (one rank) updates its block in one call and never calls the
            halo exchange.
        time_block: 1 (one sweep over the block per step), or 2: temporal
            blocking, numba backend only: halos two cells wide (with corners)
            exchanged once per two steps, and both steps in one wavefront
            sweep over the block (the second step's plane follows the first's
            while its inputs are in cache); no overlap.  The field is the
            same bit for bit.
        start: None, or ``(step, field)``: continue a run from its field
            after ``step`` steps (a float64 array of shape ``grid``, every rank
            alike: a checkpoint); the steps ``step .. steps - 1`` are taken.
        stop: None, or ``stop(step) -> bool``, called before every step after
            the first (time_block 1), collective and alike on every rank (the
            command line's agreement on a stop signal): True ends the run
            there, the result's ``steps`` saying how many were taken.
        halo: how ghost cells travel: ``"shm"``: through shared memory
            (:class:`commlib.collectives.NodeHalo`: every rank on one x86-64
            node, host backends, time_block 1), each step pulling its ghosts,
            updating the shell and pushing the next step's edge cells before
            the interior; ``"mpi"``: messages
            (:class:`commlib.collectives.HaloExchange`, overlapped with the
            interior update); ``"auto"`` (default): ``"shm"`` where it can
            run, else ``"mpi"``.  The field is the same bit for bit.  The
            result's ``extra["halo"]`` says which ran (``"none"`` on one rank).

    Returns:
        (HeatResult, local_field): the summary (same on every rank) and this
        rank's owned block as a float64 numpy array of its local shape.

    Raises:
        InvalidArgument: unknown backend; a grid size that is not a positive
            integer; ``steps`` not a positive integer (without ``t_final``);
            ``t_final``, ``cfl`` or ``alpha`` not finite and in range; a
            ``progress`` that is not callable, or more ranks along a
            dimension than points; ``time_block`` not 1 or 2, or 2 with
            another backend than numba; raised on every rank before any halo
            message moves.  With ``time_block=2``, a block thinner than 2
            cells along a dimension with neighbours (the halo exchange's
            InvalidArgument, on every rank).  ``halo`` not one of "auto",
            "shm", "mpi", or "shm" where shared memory cannot run (a
            device backend, time_block 2, ranks on several nodes, not
            x86-64).  Also (on each rank that lacks it) the cupy backend
            without CuPy or without a GPU.
    """
    op = "heat.solve"
    problem = None
    if time_block not in (1, 2) or not _is_int(time_block):
        problem = InvalidArgument(f"time_block must be 1 or 2, got {time_block!r}", rank=comm.rank, op=op)
    elif time_block == 2 and backend != "numba":
        problem = InvalidArgument(f"time_block=2 (temporal blocking) runs the numba backend, not {backend!r}",
                                  rank=comm.rank, op=op)
    elif halo not in HALOS:
        problem = InvalidArgument(f"halo must be one of {HALOS}, got {halo!r}", rank=comm.rank, op=op)
    elif halo == "shm" and (time_block != 1 or backend in DEVICE_BACKENDS):
        problem = InvalidArgument(f"halo='shm' (shared memory) runs host backends with time_block=1, not "
                                  f"backend {backend!r} with time_block={time_block}", rank=comm.rank, op=op)
    grid = _check_args(comm, grid, backend, cfl, alpha, progress, op, steps, t_final, local_error=problem)
    dx, dt, steps, c = time_step(grid, alpha, cfl, steps, t_final)
    cart, shape, offset = _setup(comm, grid, op)
    wide = time_block == 2
    plan = None
    if halo != "mpi" and comm.size > 1 and not wide and backend not in DEVICE_BACKENDS:
        try:
            plan = _node_halo()(cart, shape, dtype=np.float64)
        except InvalidArgument:  # every rank alike: no shared memory here
            if halo == "shm":
                raise
    halo = plan or _halo_exchange()(cart, shape, width=2 if wide else 1, corners=wide, dtype=np.float64)
    first = 0 if start is None else int(start[0])
    blk = Block(cart, halo, shape, offset, grid, alpha, backend, c, start=None if start is None else start[1])
    timers = Timers()
    before = None
    if stop is not None:
        def before(s):
            if s > first and stop(s):
                raise _Stop(s)
    done, t0 = steps, time.perf_counter()
    try:
        wall = run_steps(comm, blk, first, steps, overlap, timers, before_step=before, progress=progress,
                         time_block=time_block)
    except _Stop as exc:  # every rank alike: stop() agreed
        done, wall = exc.step, time.perf_counter() - t0
    halo.free()
    local = blk.owned(done & 1)
    res = _summary(comm, grid, blk, local, backend, done, alpha, dt, dx, wall, timers,
                   extra={"halo": "shm" if plan is not None else "mpi" if comm.size > 1 else "none"})
    if first:  # the updates of this run only
        res.mlups = math.prod(grid) * (done - first) / res.wall_s / 1e6 if res.wall_s > 0 else float("nan")
        res.glups = res.mlups / 1e3
    cart.free()
    return res, local


_GATHER_TAG = 77  # user tag of gather_field's blocks


def gather_field(comm, grid, local, root=0):
    """Assemble the global field on ``root`` from every rank's block.

    Each rank's block geometry is recomputed from its Cartesian coordinates,
    so only the float64 data travels (no pickling).  The blocks move on a
    Cartesian communicator of their own (the same layout as :func:`solve`'s),
    so the gather's messages cannot match anything else in flight on ``comm``.
    Collective: every rank of ``comm`` calls it.

    Args:
        comm: the Communicator the field was solved on.
        grid: global interior points per dimension (d ints).
        local: this rank's owned block (as :func:`solve` returns it; cast to float64).
        root: the rank that receives.

    Returns:
        float64 array of shape ``grid`` on ``root``; None elsewhere.
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


def matches_one_rank(comm, grid, full, steps, alpha=1.0, backend="numba", cfl=0.5, t_final=None) -> bool:
    """Whether ``full`` (the gathered field on rank 0) equals bit for bit the
    field of a single-process run (:func:`solve` on a one-rank communicator
    split from ``comm``, on rank 0).  Collective: every rank of ``comm`` calls
    it and gets the same answer.

    Args:
        comm: the Communicator of the run.
        grid, steps, alpha, backend, cfl, t_final: as the run's (:func:`solve`;
            ``steps``: the steps it took).
        full: float64 array of shape ``grid`` on rank 0 (:func:`gather_field`);
            ignored elsewhere.
    """
    ok = None
    solo = comm.split(color=comm.rank)  # collective: a 1-rank communicator on every rank
    if comm.rank == 0:
        _, ref = solve(solo, grid, steps=steps, alpha=alpha, backend=backend, cfl=cfl, t_final=t_final)
        ok = bool(np.array_equal(full, ref))
    solo.free()
    return bool(comm.bcast(np.array([1 if ok else 0], dtype=np.int32), root=0)[0])


# --------------------------------------------------------- fault tolerance
def _kill_self():
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _buddy_checkpoint(comm, blk, step, geo, members):
    """My block at ``step`` to rank r+1, r-1's block to me; returns the
    checkpoint (committed: ``sendrecv_resilient`` returns on every rank only
    if it succeeded on every rank)."""
    n, r = comm.size, comm.rank
    mine = blk.owned(step & 1)
    left = (r - 1) % n
    theirs = np.empty(geo[left][0], dtype=np.float64)
    comm.sendrecv_resilient(mine, (r + 1) % n, theirs, left, name="heat.checkpoint")
    return {"step": step, "members": members, "geo": geo, "blocks": {members[r]: mine, members[left]: theirs}}


def solve_ft(comm, grid, steps=200, alpha=1.0, backend="numba", cfl=0.5, t_final=None,
             checkpoint_every=20, kill=(), progress=None):
    """Run the solver so that it survives rank failures (ULFM).

    The time loop is :func:`solve`'s (:func:`.timeloop.run_steps`, with overlap), run
    once per epoch, plus recovery hooks.  Every ``checkpoint_every`` steps,
    and after the last one, each rank keeps a copy of its owned block and
    sends one to its buddy, rank ``(r + 1) % size`` (in-memory buddy
    checkpointing), committed only when every survivor agreed the exchange
    succeeded.  When a rank dies (seen as :class:`commlib.ProcessFailed` or
    :class:`commlib.CommTimeout` from the halo exchange, a checkpoint, a
    barrier or the final reductions), :class:`commlib.ResilientRunner` takes
    over: the survivors revoke the halo exchange and the Cartesian
    communicator, shrink ``comm`` (:meth:`commlib.Communicator.recover`),
    rebuild the field of the last checkpoint from the owners' and buddies'
    copies (the runner's ``load``), re-decompose the grid over the remaining
    ranks (its ``reshard``) and go on from that step.  FTCS does the same arithmetic per cell whatever the decomposition,
    so the final field equals a failure-free run bit for bit.  A block is lost
    only when its owner and its buddy both die between two checkpoints.

    Args:
        comm: ``commlib.init(fault_tolerant=True, on_failure="raise")`` under
            ``mpiexec --with-ft ulfm``.
        grid, steps, alpha, backend, cfl, t_final, progress: as :func:`solve`
            (backends ``"numpy"`` and ``"numba"``; a bar per epoch).
        checkpoint_every: steps between checkpoints (K >= 1).
        kill: ``(world_rank, step)`` pairs: that rank SIGKILLs itself when it is
            about to take that step (fault injection for tests and demos).

    Returns:
        (HeatResult, local_field): as :func:`solve` (``ranks`` and ``dims``
        of the last epoch; ``wall_s`` from the start to the final reductions,
        recoveries included); ``extra`` holds ``fault_tolerant`` (True),
        ``failed`` (lost COMM_WORLD ranks), ``checkpoint_every``,
        ``recoveries`` (count) and ``recovery_s`` (seconds from detection to
        the re-decomposed block, each).

    Raises:
        InvalidArgument: as :func:`solve`, ``comm`` not fault tolerant (ULFM),
            another backend, or ``checkpoint_every < 1``.
        commlib.StateLost: (a ProcessFailed) a block and its buddy copy were
            both lost.
    """
    op = "heat.solve_ft"
    if comm.fault_tolerant != "ulfm":
        raise InvalidArgument("--fault-tolerant needs ULFM: mpiexec --with-ft ulfm --mca btl tcp,self "
                              "--mca btl_tcp_flags send,inplace,need-ack,need-csum",
                              rank=comm.rank, op=op)
    problem = None
    if backend not in ("numpy", "numba"):
        problem = InvalidArgument("fault-tolerant mode runs the numpy and numba backends", rank=comm.rank, op=op)
    elif not _is_int(checkpoint_every) or checkpoint_every < 1:
        problem = InvalidArgument(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}",
                                  rank=comm.rank, op=op)
    grid = _check_args(comm, grid, backend, cfl, alpha, progress, op, steps, t_final, local_error=problem)
    dx, dt, steps, c = time_step(grid, alpha, cfl, steps, t_final)
    world = comm.world_ranks[comm.rank]
    kills = {int(s) for r, s in kill if int(r) == world}
    timers = Timers()
    ep = _Epoch()

    def decompose(comm):  # the runner's re-shard: this epoch's decomposition over the ranks alive
        runner.forget_revocable()
        ep.cart, shape, offset = _setup(comm, grid, op)
        runner.revoke_on_failure(ep.cart)
        ep.halo = _halo_exchange()(ep.cart, shape, width=1, corners=False, dtype=np.float64)
        runner.revoke_on_failure(ep.halo)  # revoked first (last registered): blocked neighbours are released
        ep.blk = Block(ep.cart, ep.halo, shape, offset, grid, alpha, backend, c, start=ep.full)
        ep.full = None
        # geometry of every rank's block in this epoch (for the buddy copies)
        ep.geo = [block_of(grid, ep.cart.dims, ep.cart.coords_of(q)) for q in range(comm.size)]
        ep.members = [int(x) for x in comm.world_ranks]

    def restore(_snapshot):  # the runner's load: the last committed buddy checkpoint, on the survivors
        ep.full, ep.step = _restore_checkpoint(comm, grid, ep.ck, op)

    def epoch():  # from the last checkpoint to the end; a failure anywhere redoes it from there
        if ep.blk is None:
            decompose(comm)
        blk, geo, members = ep.blk, ep.geo, ep.members

        def before_step(s):  # this epoch's checkpoints and kills
            if s % checkpoint_every == 0:
                ep.ck = _buddy_checkpoint(comm, blk, s, geo, members)
            if s in kills:
                _kill_self()

        run_steps(comm, blk, ep.step, steps, True, timers, before_step=before_step, progress=progress, tune=False)
        ep.ck = _buddy_checkpoint(comm, blk, steps, geo, members)  # a failure in the reductions restarts here
        local = blk.owned(steps & 1)
        wall = time.perf_counter() - t_start - timers.compile_s
        failures = runner.failures
        extra = {"fault_tolerant": True, "failed": list(comm.failed_ranks), "checkpoint_every": checkpoint_every,
                 "recoveries": len(failures), "recovery_s": [f.recovery_s for f in failures]}
        return _summary(comm, grid, blk, local, backend, steps, alpha, dt, dx, wall, timers, extra), local

    # the recovery (revoke the epoch's halo and Cartesian communicator, shrink,
    # restore the checkpoint, re-decompose, redo) is commlib's resilient runner;
    # the epoch ends with the fault-tolerant reductions: no separate commit
    runner = commlib.ResilientRunner(comm, load=restore, reshard=decompose, commit=False)
    t_start = time.perf_counter()
    res, local = runner.run(epoch)
    try:
        ep.halo.free()
        ep.cart.free()
    except Exception:  # noqa: BLE001
        pass
    return res, local


@dataclass
class _Epoch:
    """What :func:`solve_ft` holds across epochs: the decomposition over the
    ranks alive, the committed buddy checkpoint and the field to restart from."""

    cart: object = None
    halo: object = None
    blk: object = None
    geo: list = None
    members: list = None
    ck: dict = None       # committed checkpoint
    full: object = None   # global field to restart from (after a recovery)
    step: int = 0         # the step it holds


def _restore_checkpoint(comm, grid, ck, op):
    """Rebuild the global field of the last committed checkpoint on every survivor.

    Each survivor contributes the blocks it holds (its own and its buddy copy)
    through one fault-tolerant allgather of fixed-size records; returns
    ``(field, step)`` (``(None, 0)`` without a checkpoint: start over).
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
        raise commlib.StateLost(f"checkpoint blocks of COMM_WORLD ranks {missing} lost (owner and buddy both failed)",
                            failed=comm.failed_ranks, rank=comm.rank, op=op)
    return field_, ck["step"]
