"""The heat model: grid, initial condition, FTCS stencil kernels, halo layout.

``du/dt = alpha * laplace(u)`` on the unit square or cube (1-D for tests) with
zero Dirichlet boundaries and ``u(x, 0) = prod_i sin(pi x_i)``; its exact
solution :func:`exact_solution` is the oracle every run is measured against.
The grid has ``N_i`` interior points per dimension, ``dx_i = 1/(N_i+1)``;
:func:`time_step` gives the stable FTCS step.  A rank's block of the grid is
:func:`block_of` (remainders spread by :func:`decompose`); its field is a
float64 array padded by one ghost layer per side, ``shape_i + 2``.

The kernels update the box ``[lo, hi)`` (padded coordinates) of ``un`` from
``u``: numpy (slices), numba (``@njit``, compiled on first call) and, in
``commlib.apps._heat_cuda`` / ``commlib.apps._heat_cupy``, numba.cuda and CuPy
launches configured by :func:`launch_geometry`.  Every backend does the same
arithmetic in the same order per cell (the device ones up to FMA contraction
on a real GPU), so the way the owned cells are split into boxes
(:func:`interior_region`, :func:`shell_regions`) never changes a bit.

Nothing here communicates; :mod:`.solver` runs the time loop over ranks.
"""
from __future__ import annotations

import math

import numpy as np

from .._heat_cupy import cupy_slice_step  # noqa: F401 - public: the CuPy slice-expression baseline

#: every backend; the device ones keep both fields on the GPU
BACKENDS = ("numpy", "numba", "cuda", "cupy")
DEVICE_BACKENDS = ("cuda", "cupy")


# ----------------------------------------------------------------- geometry
def decompose(n: int, parts: int, index: int) -> tuple[int, int]:
    """Split ``n`` cells over ``parts`` blocks; block ``index`` gets ``(count, offset)``.

    The first ``n % parts`` blocks get one extra cell.  Pure integer
    arithmetic, no check: ``0 <= index < parts`` is the caller's (a block may
    be empty when ``n < parts``).
    """
    base, rem = divmod(n, parts)
    count = base + (1 if index < rem else 0)
    offset = index * base + min(index, rem)
    return count, offset


def block_of(grid, dims, coords) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the block at Cartesian ``coords``.

    Args:
        grid: global interior points per dimension (d ints).
        dims: ranks per dimension (d ints).
        coords: the block's Cartesian coordinates (d ints, ``0 <= coords_i < dims_i``).

    Returns:
        ``(shape, offset)``: two tuples of d ints, cells owned and the global
        index of the first one, per dimension (:func:`decompose`).
    """
    got = [decompose(n, p, c) for n, p, c in zip(grid, dims, coords)]
    return tuple(g[0] for g in got), tuple(g[1] for g in got)


def exact_solution(grid, offset, shape, t, alpha) -> np.ndarray:
    """Exact ``u(x, t) = exp(-d pi^2 alpha t) prod_i sin(pi x_i)`` on a block.

    Args:
        grid: global interior points per dimension (d ints).
        offset: global index of the block's first cell (d ints).
        shape: cells of the block (d ints); the point of global index ``k``
            along dimension i is ``x_i = (k + 1) / (grid_i + 1)``.
        t: model time (the unit of ``1 / alpha``; 0 gives the initial condition).
        alpha: diffusivity (> 0).

    Returns:
        float64 array of ``shape`` (unpadded).
    """
    d = len(grid)
    u = np.ones(shape, dtype=np.float64)
    for i, (n, o, m) in enumerate(zip(grid, offset, shape)):
        x = (np.arange(o, o + m, dtype=np.float64) + 1.0) / (n + 1)
        s = [1] * d
        s[i] = m
        u = u * np.sin(np.pi * x).reshape(s)
    return u * math.exp(-d * math.pi ** 2 * alpha * t)


def time_step(grid, alpha, cfl, steps, t_final=None) -> tuple[list, float, int, np.ndarray]:
    """The FTCS step for ``grid``.

    Args:
        grid: global interior points per dimension (d ints).
        alpha: diffusivity (> 0); cfl: fraction of the stability limit (0 < cfl <= 1).
        steps: time steps (used when ``t_final`` is None).
        t_final: model time to reach, or None.

    Returns:
        ``(dx, dt, steps, c)``: ``dx`` the spacing per dimension (list of d
        floats, ``1/(N_i+1)``); ``dt = cfl / (2 alpha sum_i 1/dx_i^2)`` (the
        stability limit times ``cfl``), shortened so ``steps * dt == t_final``
        with ``steps = ceil(t_final/dt)`` when ``t_final`` is given; ``steps``
        an int; ``c_i = alpha dt / dx_i^2`` (float64 array of d).  No check:
        the drivers validate ``alpha`` and ``cfl`` first.
    """
    dx = [1.0 / (n + 1) for n in grid]
    dt = cfl / (2.0 * alpha * sum(1.0 / h ** 2 for h in dx))
    if t_final is not None:
        steps = max(1, math.ceil(t_final / dt - 1e-12))
        dt = t_final / steps
    c = np.array([alpha * dt / h ** 2 for h in dx], dtype=np.float64)
    return dx, dt, int(steps), c


# ------------------------------------------------------------------ kernels
# Host kernels: update(u, un, c, lo, hi) writes the FTCS update of the box
# [lo, hi) of the padded float64 field u into un (same shape), reading one
# cell beyond the box on every side; c as from time_step.
def numpy_update(u, un, c, lo, hi):
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
    """The numba kernels of a ``d``-dimensional field (compiled on first call):

    * ``boxes(u, un, c, boxes)``: the FTCS update of every box of ``boxes``
      (int64, ``(n, 2, d)``: ``lo`` then ``hi`` per box, padded coordinates,
      ``lo >= 1`` and ``hi <= shape - 1``) from ``u`` into ``un``, in one call;
    * ``steps(a, b, c, boxes, n)``: ``n`` steps over ``boxes`` with no
      exchange between them, ``a -> b``, ``b -> a``, ...: the whole run of a
      rank with no neighbour in one call;
    * 2-D and 3-D, ``boxes4`` and ``steps4``: the same with four planes
      (rows in 2-D: the first axis) per pass over a box.  Which is faster
      depends on where the fields live: on this 2-core test machine one
      plane per pass ran at 0.83x a copy of the same arrays from the
      last-level cache and four planes at 0.67x; from DRAM (192^3) 0.61x
      and 0.76x (2-D, 2656^2: 0.75x and 0.94x).  The solver times both on
      its own fields before it starts (:meth:`.timeloop.Block.tune`; runs
      of at least ``timeloop.TUNE_CELLS`` cells per rank).
    * ``two_steps``: temporal blocking (:func:`two_step_update`).

    One loop nest per box indexes the fields directly (``u[i, j, l]``) with
    unsigned indices: numba then emits no negative-index wraparound, and the
    innermost loop vectorizes like a loop over the array's own shape (row
    views per ``(i, j)``, the former shape, ran 5-10% slower).  The arithmetic
    per cell is the numpy kernel's, in the same order.
    """
    if d in _numba_kernels:
        return _numba_kernels[d]
    import numba  # noqa: PLC0415

    def named(kernel, name):
        # A kernel another one calls is a closure variable of that one, and numba's
        # on-disk cache keys a closure by its pickled variables: a dispatcher
        # pickles with a random per-process uuid, so every process compiled the
        # callers again (~1.1 s for the 3-D box drivers).  A fixed uuid per
        # (kernel, dimension) makes the key the same in every process; it still
        # holds the callee's code, so an edited kernel is compiled again.
        try:
            kernel._set_uuid(f"commlib.apps.heat.model.{name}.{d}d")
        except (AttributeError, AssertionError):  # another numba: correct, only not cached
            pass
        return kernel

    if d == 1:
        @numba.njit(cache=True, nogil=True, inline="always")
        def box(u, un, c, lo, hi):
            one = np.uint64(1)
            c0 = c[0]
            for i in range(np.uint64(lo[0]), np.uint64(hi[0])):
                ctr = u[i]
                un[i] = ctr + c0 * (u[i - one] - 2.0 * ctr + u[i + one])
    elif d == 2:
        @numba.njit(cache=True, nogil=True, inline="always")
        def box(u, un, c, lo, hi):
            one = np.uint64(1)
            c0, c1 = c[0], c[1]
            for i in range(np.uint64(lo[0]), np.uint64(hi[0])):
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    ctr = u[i, j]
                    un[i, j] = ctr + (c0 * (u[i - one, j] - 2.0 * ctr + u[i + one, j])
                                      + c1 * (u[i, j - one] - 2.0 * ctr + u[i, j + one]))
    else:
        @numba.njit(cache=True, nogil=True, inline="always")
        def box(u, un, c, lo, hi):
            one = np.uint64(1)
            c0, c1, c2 = c[0], c[1], c[2]
            for i in range(np.uint64(lo[0]), np.uint64(hi[0])):
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    for l in range(np.uint64(lo[2]), np.uint64(hi[2])):  # noqa: E741
                        ctr = u[i, j, l]
                        un[i, j, l] = ctr + ((c0 * (u[i - one, j, l] - 2.0 * ctr + u[i + one, j, l])
                                              + c1 * (u[i, j - one, l] - 2.0 * ctr + u[i, j + one, l]))
                                             + c2 * (u[i, j, l - one] - 2.0 * ctr + u[i, j, l + one]))

    def drivers(update):
        """``(boxes, steps)`` over one box kernel (one or four planes per pass)."""
        @numba.njit(cache=True, nogil=True)
        def boxes(u, un, c, bx):
            for k in range(bx.shape[0]):
                update(u, un, c, bx[k, 0], bx[k, 1])

        @numba.njit(cache=True, nogil=True)
        def steps(a, b, c, bx, n):
            for s in range(n):
                for k in range(bx.shape[0]):
                    if s % 2 == 0:
                        update(a, b, c, bx[k, 0], bx[k, 1])
                    else:
                        update(b, a, c, bx[k, 0], bx[k, 1])

        return boxes, steps

    boxes, steps = drivers(named(box, "box"))
    got = {"boxes": boxes, "steps": steps}
    if d == 3:
        @numba.njit(cache=True, nogil=True, inline="always")
        def cell(u, un, c0, c1, c2, i, j, l):  # noqa: E741 - box's arithmetic for one cell, in its order
            one = np.uint64(1)
            ctr = u[i, j, l]
            un[i, j, l] = ctr + ((c0 * (u[i - one, j, l] - 2.0 * ctr + u[i + one, j, l])
                                  + c1 * (u[i, j - one, l] - 2.0 * ctr + u[i, j + one, l]))
                                 + c2 * (u[i, j, l - one] - 2.0 * ctr + u[i, j, l + one]))

        @numba.njit(cache=True, nogil=True, inline="always")
        def box4(u, un, c, lo, hi):
            # four planes per pass: the inner loop updates rows (i..i+3, j), so
            # each plane of u comes from memory once per pass and its rows are
            # reused from L1; one plane per pass needs three planes of u in L2
            one, two, three, four = np.uint64(1), np.uint64(2), np.uint64(3), np.uint64(4)
            c0, c1, c2 = c[0], c[1], c[2]
            i, ie = np.uint64(lo[0]), np.uint64(hi[0])
            while i + four <= ie:
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    for l in range(np.uint64(lo[2]), np.uint64(hi[2])):  # noqa: E741
                        cell(u, un, c0, c1, c2, i, j, l)
                        cell(u, un, c0, c1, c2, i + one, j, l)
                        cell(u, un, c0, c1, c2, i + two, j, l)
                        cell(u, un, c0, c1, c2, i + three, j, l)
                i += four
            while i < ie:
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    for l in range(np.uint64(lo[2]), np.uint64(hi[2])):  # noqa: E741
                        cell(u, un, c0, c1, c2, i, j, l)
                i += one
    elif d == 2:
        @numba.njit(cache=True, nogil=True, inline="always")
        def cell(u, un, c0, c1, i, j):  # box's arithmetic for one cell, in its order
            one = np.uint64(1)
            ctr = u[i, j]
            un[i, j] = ctr + (c0 * (u[i - one, j] - 2.0 * ctr + u[i + one, j])
                              + c1 * (u[i, j - one] - 2.0 * ctr + u[i, j + one]))

        @numba.njit(cache=True, nogil=True, inline="always")
        def box4(u, un, c, lo, hi):
            # four rows per pass (the 3-D kernel's planes, one dimension down)
            one, two, three, four = np.uint64(1), np.uint64(2), np.uint64(3), np.uint64(4)
            c0, c1 = c[0], c[1]
            i, ie = np.uint64(lo[0]), np.uint64(hi[0])
            while i + four <= ie:
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    cell(u, un, c0, c1, i, j)
                    cell(u, un, c0, c1, i + one, j)
                    cell(u, un, c0, c1, i + two, j)
                    cell(u, un, c0, c1, i + three, j)
                i += four
            while i < ie:
                for j in range(np.uint64(lo[1]), np.uint64(hi[1])):
                    cell(u, un, c0, c1, i, j)
                i += one
    if d in (2, 3):
        named(cell, "cell")
        got["boxes4"], got["steps4"] = drivers(named(box4, "box4"))

    if d == 1:
        @numba.njit(cache=True, nogil=True, inline="always")
        def plane(u, un, c, i, lo, hi):
            box(u, un, c, (i,), (i + 1,))
    elif d == 2:
        @numba.njit(cache=True, nogil=True, inline="always")
        def plane(u, un, c, i, lo, hi):
            box(u, un, c, (i, lo[1]), (i + 1, hi[1]))
    else:
        @numba.njit(cache=True, nogil=True, inline="always")
        def plane(u, un, c, i, lo, hi):
            box(u, un, c, (i, lo[1], lo[2]), (i + 1, hi[1], hi[2]))

    named(plane, "plane")

    @numba.njit(cache=True, nogil=True)
    def two_steps(u, un, c, ext, own, n):
        # n times two steps u -> un -> u as one wavefront along the first axis:
        # plane i of the first step (over the box ext), then plane i - 1 of the
        # second (over own), whose inputs (un's planes i - 2, i - 1, i) are then
        # in cache; u's plane i - 1 is no longer read by the first step
        lo, hi = ext[0], ext[1]
        for _ in range(n):
            for i in range(lo[0], hi[0] + 1):
                if i < hi[0]:
                    plane(u, un, c, i, lo, hi)
                if own[0, 0] <= i - 1 < own[1, 0]:
                    plane(un, u, c, i - 1, own[0], own[1])

    got["two_steps"] = two_steps
    _numba_kernels[d] = got
    return got


def _box_array(boxes) -> np.ndarray:
    """``[(lo, hi), ...]`` as the int64 ``(n, 2, d)`` array the numba kernels take."""
    return np.asarray([[lo, hi] for lo, hi in boxes], dtype=np.int64).reshape(len(boxes), 2, -1)


# -------------------------------------------------------------- halo layout
def neighbour_sides(dims, coords) -> tuple[tuple[bool, bool], ...]:
    """Per dimension, ``(has a lower neighbour, has an upper neighbour)`` of the
    block at ``coords`` on a non-periodic Cartesian layout ``dims`` (d ints
    each): the sides whose ghost cells the halo exchange fills (the others
    hold the Dirichlet boundary, zero, for the whole run)."""
    return tuple((c > 0, c < p - 1) for p, c in zip(dims, coords))


def shell_regions(shape, width, sides=None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(lo, hi)`` in padded coordinates that cover the owned cells whose
    stencil reads ghost cells filled by the exchange (the "shell"), each cell
    exactly once; the rest is ``interior_region``.

    Args:
        shape: owned cells per dimension (d ints >= 1).
        width: ghost layers per dimension (d ints; the owned cells of
            dimension i are ``[width_i, width_i + shape_i)``).
        sides: from :func:`neighbour_sides`: the sides that have a neighbour;
            None means every side.  A side without one adds no shell: its
            ghost cells are boundary values that never change.

    Returns:
        list of ``(lo, hi)`` pairs of d-int tuples, half-open, non-empty and
        disjoint (empty when no side has a neighbour).
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


def interior_region(shape, width, sides=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The owned cells whose stencil reads no ghost cell filled by the exchange,
    as one box ``(lo, hi)`` of d-int tuples in padded coordinates (half-open;
    empty, ``hi_i == lo_i`` somewhere, when the block is too thin).

    ``shape``, ``width``, ``sides`` as in :func:`shell_regions` (None: every
    side has a neighbour)."""
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
    """``(blocks, threads, chunk)`` for a device update of the box ``[lo, hi)``
    (2 or 3 ints each), or None when the box is empty.

    Threads cover the last axis (fastest thread index, coalesced) and, in 3-D,
    the middle one; each thread marches ``chunk`` cells along the first axis.
    ``chunk`` (unless given) is the largest in ``[CHUNK_MIN, CHUNK_MAX]`` that
    still gives about ``TARGET_BLOCKS`` blocks: longer marches re-read fewer
    planes (2 per chunk), more blocks fill the GPU.  ``blocks`` and
    ``threads`` are 3-tuples of ints (CUDA grid and block); ``chunk`` an int
    in ``[1, hi_0 - lo_0]``.
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
def to_backend(backend, u0):
    """The two fields ``(u, un)`` of ``backend``, both equal to ``u0``."""
    if backend == "cuda":
        from numba import cuda  # noqa: PLC0415 - numba.cuda only when asked for

        return cuda.to_device(u0), cuda.to_device(u0)
    if backend == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.asarray(u0), cupy.asarray(u0)
    return u0, u0.copy()


def field_to_host(backend, u):
    if backend == "cuda":
        return u.copy_to_host()
    if backend == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.asnumpy(u)
    return u


def synchronizer(backend):
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


def region_updates(backend, fields, c, shape, width, sides, chunk=None, planes=1):
    """Three callables of the step parity ``p`` (each updates from
    ``fields[p]`` into ``fields[1 - p]``), built once per solve:

    * ``run_all(p, n=1)``: every owned cell, ``n`` steps in a row with no
      exchange between them (step ``k`` reads ``fields[(p + k) & 1]``; the
      numba backend takes all of them in one call, a device backend one
      launch each);
    * ``run_inner(p)``: the cells whose stencil reads no exchanged ghost cell
      (one call or launch; a no-op when that box is empty);
    * ``run_shell(p)``: the other owned cells (device: ONE launch over the
      owned box that skips the interior; numba: one call for every face).

    Device launches are configured here (kernel specialized and bound to its
    grid, arguments for both parities prepared), and the numba backend's boxes
    are built once, so a step allocates nothing.  ``planes``: 1, or 4 for the
    numba backend's four-planes-per-pass kernels (2-D, 3-D) in ``run_all`` and
    ``run_inner`` (the shell's faces are one plane thick either way); the
    field is the same bit for bit.
    """
    full_lo = tuple(width)
    full_hi = tuple(w + n for n, w in zip(shape, width))
    inner_lo, inner_hi = interior_region(shape, width, sides)
    if backend in DEVICE_BACKENDS:
        if backend == "cuda":
            from .. import _heat_cuda as kernels  # noqa: PLC0415 - numba.cuda only when asked for
        else:
            from .. import _heat_cupy as kernels  # noqa: PLC0415 - CuPy only when asked for
        a, b = fields

        def region(lo, hi, skip=None):
            geo = launch_geometry(lo, hi, chunk)
            if geo is None:
                return _noop
            return kernels.Launch(a, b, c, lo, hi, skip, *geo).launch

        one_all = region(full_lo, full_hi)

        def run_all(p, n=1):
            for k in range(n):
                one_all((p + k) & 1)

        return run_all, region(inner_lo, inner_hi), region(full_lo, full_hi, (inner_lo, inner_hi))

    shell = shell_regions(shape, width, sides)
    pairs = (fields, fields[::-1])
    has_inner = all(h > l for l, h in zip(inner_lo, inner_hi))
    if backend == "numpy":
        def run_all(p, n=1):
            for k in range(n):
                numpy_update(*pairs[(p + k) & 1], c, full_lo, full_hi)

        def run_inner(p):
            if has_inner:
                numpy_update(*pairs[p], c, inner_lo, inner_hi)

        def run_shell(p):
            for lo, hi in shell:
                numpy_update(*pairs[p], c, lo, hi)

        return run_all, run_inner, run_shell

    kern = _get_numba(len(shape))
    boxes, many = (kern["boxes4"], kern["steps4"]) if planes == 4 and "boxes4" in kern else (kern["boxes"],
                                                                                           kern["steps"])
    one_plane = kern["boxes"]
    whole = _box_array([(full_lo, full_hi)])
    inner = _box_array([(inner_lo, inner_hi)]) if has_inner else None
    faces = _box_array(shell) if shell else None
    args = [(*pairs[p], c) for p in (0, 1)]

    def run_all(p, n=1):
        if n == 1:
            boxes(*args[p], whole)
        else:
            many(*args[p], whole, n)

    def run_inner(p):
        if inner is not None:
            boxes(*args[p], inner)

    def run_shell(p):
        if faces is not None:
            one_plane(*args[p], faces)

    return run_all, run_inner, run_shell


def two_step_update(fields, c, shape, width, sides):
    """Temporal blocking for the numba backend: ``run_two(p, n)`` takes ``n``
    times two steps from ``fields[p]`` (``fields[p] -> fields[1 - p] ->
    fields[p]``) as one wavefront sweep per two steps, with no exchange in
    between: the first step covers the owned box widened by one cell on every
    side with a neighbour (its ghost cells, read from ghost layers 1 and 2 and
    the corners, so the halo must be ``width >= 2`` with corners), the second
    the owned cells.  Each cell gets the same arithmetic as in a one-step
    update, so the field is bit for bit the same.  ``width``: ghost layers per
    dimension (>= 2 on the sides with a neighbour)."""
    kern = _get_numba(len(shape))["two_steps"]
    own = _box_array([(tuple(width), tuple(w + n for n, w in zip(shape, width)))])[0]
    ext = own.copy()
    for i, (low, high) in enumerate(sides):
        ext[0, i] -= 1 if low else 0
        ext[1, i] += 1 if high else 0
    args = [(fields[p], fields[1 - p], c, ext, own) for p in (0, 1)]

    def run_two(p, n=1):
        kern(*args[p], n)

    return run_two
