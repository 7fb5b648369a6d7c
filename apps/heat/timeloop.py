"""The time loop of the heat solver: a rank's block and the steps over it.

:class:`Block` is this rank's block of the grid in one decomposition (two
padded fields swapped by step parity, the halo exchange and the region
updates, the kernel :meth:`Block.tune` picks); :func:`run_steps` is the one
time loop both drivers of :mod:`.solver` run: per step with a message halo
(:class:`commlib.collectives.HaloExchange`, overlapped with the interior),
with the shared-memory one (:class:`commlib.collectives.NodeHalo`,
:func:`_node_loop`), with temporal blocking (:func:`_two_step_loop`), or
all steps in one call on a rank with no neighbour.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .model import (exact_solution, field_to_host, neighbour_sides, region_updates, synchronizer, to_backend,
                    two_step_update)

__all__ = ["Block", "Timers", "run_steps", "TUNE_CELLS"]

#: cells per rank (on average) from which a run times its two update kernels and keeps the faster
#: (:meth:`Block.tune`); smaller runs keep the one-plane kernel and compile nothing more
TUNE_CELLS = 1 << 17


class Block:
    """This rank's block of the grid in one decomposition.

    ``fields``: two padded float64 fields of ``halo.shape`` on the backend,
    both equal at the start: step ``s`` reads ``fields[s & 1]`` and writes
    the other, so the halo always sees the same two array objects.  The owned
    cells start as the exact initial condition, or as the owned box of
    ``start`` (a global field of ``grid``'s shape) when given.
    """

    def __init__(self, cart, halo, shape, offset, grid, alpha, backend, c, start=None):
        self.cart, self.halo, self.shape, self.offset, self.backend = cart, halo, shape, offset, backend
        u0 = np.zeros(halo.shape)
        if start is None:
            u0[halo.interior] = exact_solution(grid, offset, shape, 0.0, alpha)
        else:
            u0[halo.interior] = start[tuple(slice(o, o + m) for o, m in zip(offset, shape))]
        self.fields = to_backend(backend, u0)
        self.sides = neighbour_sides(cart.dims, cart.coords)
        self.exchange = any(low or high for low, high in self.sides)  # False at 1 rank: no halo call at all
        self.node = self.exchange and hasattr(halo, "push")  # a NodeHalo: shared memory, boundary first
        self.run_all, self.run_inner, self.run_shell = region_updates(backend, self.fields, c, shape, halo.width,
                                                                       self.sides)
        self.planes = 1
        self._four = None  # the numba backend's four-planes-per-pass updates, tried in tune()
        # the same verdict on every rank (tune() is collective): every block is >= 8 planes thick and
        # the blocks are large enough for the choice to matter (a small run is over before it pays)
        if (backend == "numba" and len(shape) in (2, 3) and grid[0] // cart.dims[0] >= 8
                and math.prod(grid) >= TUNE_CELLS * cart.size):
            self._four = region_updates(backend, self.fields, c, shape, halo.width, self.sides, planes=4)
        # temporal blocking (two steps per sweep and per exchange): numba, a halo of width >= 2 with corners
        self.run_two = None
        if backend == "numba" and min(halo.width) >= 2 and halo.corners:
            self.run_two = two_step_update(self.fields, c, shape, halo.width, self.sides)
        self.sync = synchronizer(backend)

    def tune(self, comm, p, overlap):
        """Keep the faster of the one- and four-planes-per-pass updates
        (:func:`.model.region_updates`), the same on every rank: each rank
        times both on its own fields (the region the loop runs most: the
        interior with overlap, else the whole block; one untimed call each,
        a barrier, then the best of three, alternating), and one all-reduce sums the
        ranks' times, so a rank whose clock was disturbed cannot leave the
        ranks with different kernels.  Collective over ``comm`` (every rank
        or none: ``_four`` is set from the global grid).  Writes only
        ``fields[1 - p]`` (the next step overwrites it).  The field is the
        same bit for bit either way; ``planes`` says which won."""
        if self._four is None:
            return
        one, four = (self.run_all, self.run_inner, self.run_shell), self._four
        which = 1 if (overlap and self.exchange) else 0
        best = np.full(2, math.inf)
        clock = time.perf_counter
        four[which](p)  # compile
        one[which](p)
        comm.barrier()  # every rank times at once: the memory traffic of the run
        for _ in range(3):
            for k, fns in enumerate((one, four)):
                t = clock()
                fns[which](p)
                best[k] = min(best[k], clock() - t)
        best = comm.allreduce(best, op="sum")
        if best[1] < best[0]:
            self.run_all, self.run_inner, self.run_shell = four
            self.planes = 4

    def owned(self, parity):
        """A new C-contiguous float64 host array of ``shape``: the owned
        cells of ``fields[parity]``."""
        return field_to_host(self.backend, self.fields[parity])[self.halo.interior].copy()


@dataclass
class Timers:
    """Seconds accumulated by :func:`run_steps` (over the epochs of a fault-tolerant run)."""

    compile_s: float = 0.0
    comm_s: float = 0.0


# --------------------------------------------------------------- time loop
def run_steps(comm, blk, start, stop, overlap, timers, before_step=None, progress=None, time_block=1, tune=True):
    """Take the steps ``[start, stop)`` on ``blk``: the one time loop of both drivers.

    First every kernel the loop uses is compiled and warmed up (numba
    compiles on first call; the halo exchange packs with kernels of its own;
    with overlap the interior and shell updates are kernels of their own):
    the updates read ``fields[start & 1]`` and write the other field, which
    step ``start`` overwrites; the exchange fills the ghost cells step
    ``start`` fills again.  Those seconds go to ``timers.compile_s``.  Then
    the ranks wait for the slowest compiler (``comm.barrier()``) before the
    clock starts, so none of it counts as step or communication time.

    A rank with no neighbour and no ``before_step`` takes all the steps in
    one call of the update (in about 100 chunks with a progress bar).
    Otherwise per step ``s`` (parity ``p = s & 1``): ``before_step(s)`` when
    given (the fault-tolerant driver's checkpoints and kills), then without a
    neighbour the whole block in one update; with overlap the exchange of
    ``fields[p]`` starts, the interior is updated, the exchange completes
    and the shell is updated; without overlap the exchange, then the whole
    block.
    Seconds inside halo calls go to ``timers.comm_s``.

    Args:
        comm: the Communicator ``blk`` was decomposed over.
        blk: a :class:`Block` whose ``fields[start & 1]`` holds step ``start``.
        start, stop: first step and the step to reach (``start <= stop``).
        overlap: update the interior while the halo exchange is in flight.
        timers: a :class:`Timers` to add to.
        before_step: None or a callable of the step index.
        progress: None or ``progress(total, initial)`` returning a bar (its
            ``update(1)`` after each step, ``close()`` at the end).
        time_block: 1, or 2 for temporal blocking (``blk.run_two`` set, no
            ``before_step``): one exchange per two steps, then both steps in
            one wavefront sweep (no overlap); an odd last step is a plain one.
        tune: with time_block 1, pick the faster update kernel first
            (:meth:`Block.tune`: one all-reduce over ``comm``, part of the
            warm-up); the fault-tolerant driver passes False (its epochs
            keep the one-plane kernel and add no collective).

    Returns:
        float: seconds of the steps (wall clock on this rank, device work
        included).  Afterwards ``fields[stop & 1]`` holds step ``stop``.

    Raises:
        whatever the halo exchange, the barrier or ``before_step`` raise
        (``ProcessFailed``, ``CommTimeout`` in fault-tolerant mode).
    """
    fields, halo, exchange = blk.fields, blk.halo, blk.exchange
    run_all, run_inner, run_shell = blk.run_all, blk.run_inner, blk.run_shell
    clock = time.perf_counter
    p0 = start & 1
    t_compile = clock()
    if exchange and not blk.node:  # the halo's pack/unpack kernels too; step start's exchange fills them again
        halo.exchange(fields[p0])
    run_all(p0)
    if time_block == 1 and tune:
        blk.tune(comm, p0, overlap)
        run_all, run_inner, run_shell = blk.run_all, blk.run_inner, blk.run_shell
    run_all(p0, 0)  # compiles the many-steps kernel (zero steps: no cell written)
    if time_block == 2:
        blk.run_two(p0, 0)
    if exchange and overlap:
        run_inner(p0)
        run_shell(p0)
    blk.sync()
    timers.compile_s += clock() - t_compile
    bar = progress(stop, start) if progress else None
    t_comm = 0.0
    try:
        comm.barrier()
        t0 = clock()
        if time_block == 2:
            t_comm = _two_step_loop(blk, start, stop, bar)
        elif blk.node:
            t_comm = _node_loop(blk, start, stop, overlap, before_step, bar)
        elif not exchange and before_step is None:  # no neighbour: the steps in one call (bar: in chunks)
            chunk = stop - start if bar is None else max(1, (stop - start) // 100)
            s = start
            while s < stop:
                n = min(chunk, stop - s)
                run_all(s & 1, n)
                s += n
                if bar is not None:
                    bar.update(n)
        else:
            for s in range(start, stop):
                p = s & 1
                if before_step is not None:
                    before_step(s)
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
        blk.sync()
        wall = clock() - t0
    finally:
        timers.comm_s += t_comm
        if bar is not None:
            bar.close()
    return wall


def _node_loop(blk, start, stop, overlap, before_step, bar):
    """:func:`run_steps`' loop over a :class:`commlib.collectives.NodeHalo`
    (shared memory); returns the seconds in halo calls.  Step ``s`` pulls its
    ghosts, updates the shell, pushes the shell's cells as step ``s + 1``'s
    ghosts, then updates the interior (without overlap: the whole block, then
    the push), so a neighbour that is behind finds its next step there."""
    fields, halo, clock = blk.fields, blk.halo, time.perf_counter
    run_all, run_inner, run_shell = blk.run_all, blk.run_inner, blk.run_shell
    a = clock()
    halo.push(fields[start & 1], start)
    t_comm = clock() - a
    for s in range(start, stop):
        p = s & 1
        if before_step is not None:
            before_step(s)
        a = clock()
        halo.pull(fields[p], s)
        t_comm += clock() - a
        if overlap:
            run_shell(p)
        else:
            run_all(p)
        if s + 1 < stop:
            a = clock()
            halo.push(fields[1 - p], s + 1)
            t_comm += clock() - a
        if overlap:
            run_inner(p)
        if bar is not None:
            bar.update(1)
    return t_comm


def _two_step_loop(blk, start, stop, bar):
    """:func:`run_steps`' loop with temporal blocking; returns the seconds in halo calls."""
    fields, halo, exchange, clock = blk.fields, blk.halo, blk.exchange, time.perf_counter
    t_comm, s = 0.0, start
    while s < stop:
        n = stop - s
        if exchange:  # one exchange per two steps
            pairs = min(1, n // 2)
        else:  # no neighbour: every pair in one call (with a bar: in about 100 chunks)
            pairs = n // 2 if bar is None else min(n // 2, max(1, (stop - start) // 200))
        if exchange:
            a = clock()
            halo.exchange(fields[s & 1])
            t_comm += clock() - a
        if pairs:
            blk.run_two(s & 1, pairs)
            s += 2 * pairs
            if bar is not None:
                bar.update(2 * pairs)
        else:  # an odd last step
            blk.run_all(s & 1)
            s += 1
            if bar is not None:
                bar.update(1)
    return t_comm
