"""Distributed explicit heat-equation solver (the main job).

Solves ``du/dt = alpha * laplace(u)`` on the unit square or cube with zero
Dirichlet boundaries and ``u(x, 0) = prod_i sin(pi x_i)``, whose exact solution
is ``u(x, t) = exp(-d pi^2 alpha t) prod_i sin(pi x_i)``, with the explicit
forward-time centred-space (FTCS) scheme on ``N_i`` interior points per
dimension (``dx_i = 1/(N_i+1)``) and the stable time step
``dt = cfl / (2 alpha sum_i 1/dx_i^2)``.  FTCS is second order in space and
first order in time; with ``dt ~ dx^2`` the error falls as O(dx^2).

The grid is split over the ranks by :func:`commlib.compute_dims` (remainders spread
over the first ranks of each dimension); ghost cells are filled through shared memory
(:class:`commlib.collectives.NodeHalo`) where every rank is on one node, else
by :class:`commlib.collectives.HaloExchange`, whose message packing uses
commlib's own datatypes; the interior update overlaps the exchange.  Every
rank count gives the same field bit for bit as one rank (same arithmetic in
the same order per cell).

Run ``python -m commlib.apps.heat --help`` for the options, e.g.::

    mpiexec -n 4 python -m commlib.apps.heat --dims 3 --grid 64 --steps 400 --verify

The package, one thing per module:

* :mod:`.model`: the grid and its decomposition, the initial condition and
  exact solution (the oracle), the FTCS step and stencil kernels, the halo
  layout (interior and shell regions) and the device launch geometry;
  nothing communicates.
* :mod:`.timeloop`: a rank's block (its two fields, the halo, the region
  updates and the kernel it picks by timing) and the one time loop
  (:func:`.timeloop.run_steps`): message halos overlapped with the interior,
  the shared-memory halo (shell first, then the interior), temporal
  blocking, or every step in one call on a rank with no neighbour.
* :mod:`.solver`: the two drivers over that loop, :func:`solve` and the
  fault-tolerant :func:`solve_ft` (the same loop plus checkpoint, kill and
  recovery hooks); :func:`gather_field` and the single-process check.
* :mod:`.cli`: the command line (``python -m commlib.apps.heat``, see
  :mod:`.__main__`): argparse, refusals, printing, ``--json``, plots and the
  progress bar.
* :mod:`.restart`: ``--checkpoint`` / ``--resume``: the field written when
  SIGUSR1 or SIGTERM stopped the run at a step (exit status 75) and at its
  end, and continued on any rank count.

Every name is importable from here (``from commlib.apps import heat``;
``heat.solve``); ``HaloExchange`` (:class:`commlib.collectives.HaloExchange`)
loads on first use.
"""
from __future__ import annotations

from .cli import MAX_POINTS, MAX_SIDE, MAX_STEPS, build_parser, check_args, main, plot_midplane, progress_bar
from .model import (BACKENDS, CHUNK_MAX, CHUNK_MIN, DEVICE_BACKENDS, TARGET_BLOCKS, THREADS_2D, THREADS_3D,
                    block_of, cupy_slice_step, decompose, exact_solution, interior_region, launch_geometry,
                    neighbour_sides, shell_regions, time_step)
# private, but the tests use them from here (as when this package was one module)
from .model import numpy_update, region_updates  # noqa: F401
from .solver import HeatResult, gather_field, matches_one_rank, solve, solve_ft

__all__ = ["HeatResult", "decompose", "solve", "solve_ft", "main", "BACKENDS", "DEVICE_BACKENDS",
           "cupy_slice_step", "launch_geometry", "block_of", "exact_solution", "time_step", "neighbour_sides",
           "shell_regions", "interior_region", "gather_field", "matches_one_rank", "check_args",
           "build_parser", "plot_midplane", "progress_bar", "CHUNK_MIN", "CHUNK_MAX", "TARGET_BLOCKS",
           "THREADS_2D", "THREADS_3D", "MAX_SIDE", "MAX_POINTS", "MAX_STEPS"]


# The halo exchange (commlib.collectives.halo: mpi4py.MPI, numba) loads on
# first use, so the command line refuses a bad value before paying for it.
# The solvers look it up here at each call (a test may replace it).
def __getattr__(name):  # PEP 562: ``heat.HaloExchange``, ``heat.NodeHalo``
    if name in ("HaloExchange", "NodeHalo"):
        import commlib.collectives  # noqa: PLC0415

        value = getattr(commlib.collectives, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
