"""numba.cuda FTCS kernels for :mod:`commlib.apps.heat` (run in the CUDA
simulator when there is no GPU).  Kept in their own module because numba's
simulator resolves ``cuda.blockIdx`` and friends through the kernel's module
globals.

One kernel per dimension count updates a box ``[lo, hi)`` of a padded field,
optionally skipping a box ``[slo, shi)`` inside it:

* the fastest thread index runs along the LAST array axis (coalesced loads and
  stores); 3-D blocks are ``32 x 8`` threads on the last two axes, 2-D blocks
  ``128`` threads on the last axis;
* each thread marches along the FIRST (slowest) axis over ``chunk`` cells,
  keeping ``u[i-1]``, ``u[i]``, ``u[i+1]`` of its column in registers, so each
  value of that axis is loaded once (plus 2 per chunk); the lateral
  neighbours come from L1/L2, where the block's neighbouring threads load
  them too.  Grid: ``(ceil(n_last/32), ceil(n_mid/8), ceil(n_first/chunk))``
  in 3-D, ``(ceil(n_last/128), ceil(n_first/chunk))`` in 2-D;
* a column that lies inside the skip box's last axes marches only over the
  cells of the first axis outside it.  The overlap mode's shell update is
  therefore ONE launch over the whole owned box that skips the interior
  (already updated): every shell cell is read and written once, and the
  interior columns cost one bounds test per chunk.

Geometry (box, skip box, chunk) lives in a small int64 device array and the
coefficients in a float64 device array, so a launch has 4 arguments; the
kernel is specialized for its argument types and bound to its
``[blocks, threads]`` once per solve (:class:`Launch`), so a step costs one
``launch()`` per region and allocates nothing.

The cell arithmetic is the numpy backend's, in the same order:
``u + ((c0*(u[i-1] - 2u + u[i+1]) + c1*(...)) + c2*(...))``.  On a GPU the
compiler may contract ``a*b + c`` into FMAs (numba offers no switch for that
outside ``fastmath``), so results may differ from the host backends in the
last bits; every cell goes through the same device function, so any rank
count gives the same bits.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from commlib import InvalidArgument

# geometry array layout: lo[0:3], hi[3:6], skip lo[6:9], skip hi[9:12], chunk[12]
_GEO = 13


@cuda.jit(device=True, inline=True)
def _march3(u, un, c0, c1, c2, i0, i1, j, l):  # noqa: E741
    if i0 >= i1:
        return
    um = u[i0 - 1, j, l]
    uc = u[i0, j, l]
    for i in range(i0, i1):
        up = u[i + 1, j, l]
        un[i, j, l] = uc + ((c0 * (um - 2.0 * uc + up)
                             + c1 * (u[i, j - 1, l] - 2.0 * uc + u[i, j + 1, l]))
                            + c2 * (u[i, j, l - 1] - 2.0 * uc + u[i, j, l + 1]))
        um = uc
        uc = up


@cuda.jit
def _ftcs3(u, un, c, geo):
    l = geo[2] + cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x  # noqa: E741
    j = geo[1] + cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    if l >= geo[5] or j >= geo[4]:
        return
    chunk = geo[12]
    i0 = geo[0] + cuda.blockIdx.z * chunk
    i1 = min(i0 + chunk, geo[3])
    c0 = c[0]
    c1 = c[1]
    c2 = c[2]
    if geo[7] <= j < geo[10] and geo[8] <= l < geo[11]:
        _march3(u, un, c0, c1, c2, i0, min(i1, geo[6]), j, l)
        _march3(u, un, c0, c1, c2, max(i0, geo[9]), i1, j, l)
    else:
        _march3(u, un, c0, c1, c2, i0, i1, j, l)


@cuda.jit(device=True, inline=True)
def _march2(u, un, c0, c1, i0, i1, j):
    if i0 >= i1:
        return
    um = u[i0 - 1, j]
    uc = u[i0, j]
    for i in range(i0, i1):
        up = u[i + 1, j]
        un[i, j] = uc + (c0 * (um - 2.0 * uc + up) + c1 * (u[i, j - 1] - 2.0 * uc + u[i, j + 1]))
        um = uc
        uc = up


@cuda.jit
def _ftcs2(u, un, c, geo):
    # 2-D uses the 3-D geometry layout with axis 1 unused: lo[0], lo[2], ...
    j = geo[2] + cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j >= geo[5]:
        return
    chunk = geo[12]
    i0 = geo[0] + cuda.blockIdx.y * chunk
    i1 = min(i0 + chunk, geo[3])
    c0 = c[0]
    c1 = c[1]
    if geo[8] <= j < geo[11]:
        _march2(u, un, c0, c1, i0, min(i1, geo[6]), j)
        _march2(u, un, c0, c1, max(i0, geo[9]), i1, j)
    else:
        _march2(u, un, c0, c1, i0, i1, j)


def geometry_array(lo, hi, skip, chunk):
    """The kernels' int64 geometry vector (host) for box ``[lo, hi)``, skip box
    ``skip = (slo, shi)`` or None, and ``chunk`` cells per thread along axis 0.
    2-D boxes are stored as 3-D ones with axis 1 unused."""
    lo, hi = list(lo), list(hi)
    if len(lo) == 2:
        lo, hi = [lo[0], 0, lo[1]], [hi[0], 1, hi[1]]
        if skip is not None:
            skip = ([skip[0][0], 0, skip[0][1]], [skip[1][0], 1, skip[1][1]])
    if skip is None or any(b <= a for a, b in zip(*skip)):
        skip = ([0, 0, 0], [0, 0, 0])  # empty: no column lies inside it
    return np.array([*lo, *hi, *skip[0], *skip[1], chunk], dtype=np.int64)


class Launch:
    """One region update ``a -> b`` and ``b -> a``, configured once.

    Args:
        a, b: the two padded float64 device fields (same shape, C-contiguous).
        c: the FTCS coefficients, one per dimension.
        lo, hi: the box to update (padded coordinates).
        skip: ``(slo, shi)``, a box inside it not to update, or None.
        blocks, threads, chunk: launch geometry (see
            :func:`commlib.apps.heat.launch_geometry`).

    ``launch(parity)`` updates from ``a`` into ``b`` (parity 0) or from ``b``
    into ``a`` (parity 1) on the default stream; nothing is allocated per call.
    """

    def __init__(self, a, b, c, lo, hi, skip, blocks, threads, chunk):
        d = len(lo)
        if d == 3:
            kern = _ftcs3
        elif d == 2:
            kern = _ftcs2
        else:
            raise InvalidArgument("the cuda backend supports 2-D and 3-D grids", op="heat")
        self.c = cuda.to_device(np.asarray(c, dtype=np.float64))
        self.geo = cuda.to_device(geometry_array(lo, hi, skip, chunk))
        bound = kern.specialize(a, b, self.c, self.geo)[tuple(blocks), tuple(threads)]
        self._calls = ((bound, (a, b, self.c, self.geo)), (bound, (b, a, self.c, self.geo)))

    def launch(self, parity: int) -> None:
        bound, args = self._calls[parity]
        bound(*args)
