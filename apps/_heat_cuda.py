"""numba.cuda FTCS kernels for :mod:`commlib.apps.heat` (run in the CUDA
simulator when there is no GPU).  Kept in their own module because numba's
simulator resolves ``cuda.grid`` through the kernel's module globals."""
from __future__ import annotations

from numba import cuda

from commlib import InvalidArgument


@cuda.jit
def _ftcs2(u, un, c0, c1, lo0, lo1, hi0, hi1):
    i, j = cuda.grid(2)
    i += lo0
    j += lo1
    if i < hi0 and j < hi1:
        ctr = u[i, j]
        un[i, j] = ctr + (c0 * (u[i - 1, j] - 2.0 * ctr + u[i + 1, j])
                          + c1 * (u[i, j - 1] - 2.0 * ctr + u[i, j + 1]))


@cuda.jit
def _ftcs3(u, un, c0, c1, c2, lo0, lo1, lo2, hi0, hi1, hi2):
    i, j, l = cuda.grid(3)  # noqa: E741
    i += lo0
    j += lo1
    l += lo2  # noqa: E741
    if i < hi0 and j < hi1 and l < hi2:
        ctr = u[i, j, l]
        un[i, j, l] = ctr + ((c0 * (u[i - 1, j, l] - 2.0 * ctr + u[i + 1, j, l])
                              + c1 * (u[i, j - 1, l] - 2.0 * ctr + u[i, j + 1, l]))
                             + c2 * (u[i, j, l - 1] - 2.0 * ctr + u[i, j, l + 1]))


def update(u, un, c, lo, hi):
    """``un = u + sum_i c_i * second difference_i(u)`` on the box ``[lo, hi)``
    of device arrays ``u``, ``un`` (2-D or 3-D, float64)."""
    ext = [b - a for a, b in zip(lo, hi)]
    if min(ext) <= 0:
        return
    if len(lo) == 2:
        kern, tpb = _ftcs2, (16, 16)
    elif len(lo) == 3:
        kern, tpb = _ftcs3, (4, 8, 8)
    else:
        raise InvalidArgument("the cuda backend supports 2-D and 3-D grids", op="heat")
    blocks = tuple((e + t - 1) // t for e, t in zip(ext, tpb))
    kern[blocks, tpb](u, un, *[float(x) for x in c], *[int(x) for x in lo], *[int(x) for x in hi])
