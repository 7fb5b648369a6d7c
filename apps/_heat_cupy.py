"""CuPy pieces of :mod:`commlib.apps.heat`: the FTCS update as a CUDA C
``cupy.RawKernel`` (the ``cupy`` backend) and the plain slice-expression update
a CuPy user would write (:func:`cupy_slice_step`, the benchmark's baseline).

CuPy is imported only inside the functions that need it, so this module
imports without CuPy (and :func:`cupy_slice_step` also runs on numpy arrays).

The RawKernel is the numba.cuda kernel of :mod:`commlib.apps._heat_cuda` in
CUDA C: fastest thread index on the last array axis (3-D blocks ``32 x 8`` on
the last two axes, 2-D blocks ``128`` on the last axis), each thread marching
``chunk`` cells along the first axis with ``u[i-1]``, ``u[i]``, ``u[i+1]`` in
registers, and a skip box so the overlap mode's shell is one launch.  It is
compiled with ``--fmad=false``: every operation is rounded as numpy rounds it,
in the same order, so the ``cupy`` backend equals the ``numpy`` backend bit for
bit.  Launches go to CuPy's current stream.
"""
from __future__ import annotations

import numpy as np

__all__ = ["cupy_slice_step", "require_cupy", "Launch", "SOURCE"]

SOURCE = r"""
extern "C" {

__device__ __forceinline__ void march3(const double* __restrict__ u, double* __restrict__ un,
                                       double c0, double c1, double c2,
                                       long long s0, long long s1,
                                       int i0, int i1, int j, int l)
{
    if (i0 >= i1) return;
    long long p = (long long)i0 * s0 + (long long)j * s1 + l;
    double um = u[p - s0];
    double uc = u[p];
    for (int i = i0; i < i1; ++i, p += s0) {
        double up = u[p + s0];
        un[p] = uc + ((c0 * (um - 2.0 * uc + up)
                       + c1 * (u[p - s1] - 2.0 * uc + u[p + s1]))
                      + c2 * (u[p - 1] - 2.0 * uc + u[p + 1]));
        um = uc;
        uc = up;
    }
}

/* geo: lo[0:3] hi[3:6] skip_lo[6:9] skip_hi[9:12] chunk[12]; n1, n2: padded sizes of axes 1, 2 */
__global__ void ftcs3(const double* __restrict__ u, double* __restrict__ un,
                      double c0, double c1, double c2, int n1, int n2,
                      int lo0, int lo1, int lo2, int hi0, int hi1, int hi2,
                      int slo0, int slo1, int slo2, int shi0, int shi1, int shi2, int chunk)
{
    int l = lo2 + blockIdx.x * blockDim.x + threadIdx.x;
    int j = lo1 + blockIdx.y * blockDim.y + threadIdx.y;
    if (l >= hi2 || j >= hi1) return;
    int i0 = lo0 + blockIdx.z * chunk;
    int i1 = min(i0 + chunk, hi0);
    long long s1 = n2, s0 = (long long)n1 * n2;
    if (slo1 <= j && j < shi1 && slo2 <= l && l < shi2) {
        march3(u, un, c0, c1, c2, s0, s1, i0, min(i1, slo0), j, l);
        march3(u, un, c0, c1, c2, s0, s1, max(i0, shi0), i1, j, l);
    } else {
        march3(u, un, c0, c1, c2, s0, s1, i0, i1, j, l);
    }
}

__device__ __forceinline__ void march2(const double* __restrict__ u, double* __restrict__ un,
                                       double c0, double c1, long long s0, int i0, int i1, int j)
{
    if (i0 >= i1) return;
    long long p = (long long)i0 * s0 + j;
    double um = u[p - s0];
    double uc = u[p];
    for (int i = i0; i < i1; ++i, p += s0) {
        double up = u[p + s0];
        un[p] = uc + (c0 * (um - 2.0 * uc + up) + c1 * (u[p - 1] - 2.0 * uc + u[p + 1]));
        um = uc;
        uc = up;
    }
}

__global__ void ftcs2(const double* __restrict__ u, double* __restrict__ un,
                      double c0, double c1, int n1,
                      int lo0, int lo1, int hi0, int hi1,
                      int slo0, int slo1, int shi0, int shi1, int chunk)
{
    int j = lo1 + blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= hi1) return;
    int i0 = lo0 + blockIdx.y * chunk;
    int i1 = min(i0 + chunk, hi0);
    long long s0 = n1;
    if (slo1 <= j && j < shi1) {
        march2(u, un, c0, c1, s0, i0, min(i1, slo0), j);
        march2(u, un, c0, c1, s0, max(i0, shi0), i1, j);
    } else {
        march2(u, un, c0, c1, s0, i0, i1, j);
    }
}

}
"""

_module = None


def require_cupy(rank=None, op="heat.solve"):
    """Import CuPy and check that it sees a GPU; returns the module.

    Raises:
        InvalidArgument: CuPy is not installed, or it finds no usable GPU
            (one line, naming the cause).
    """
    from commlib import InvalidArgument  # noqa: PLC0415

    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:
        raise InvalidArgument(f"the cupy backend needs CuPy (pip install cupy-cuda12x or cupy-cuda13x): {exc}",
                              rank=rank, op=op) from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, missing driver, ...
        raise InvalidArgument(f"the cupy backend found no usable GPU: {exc}", rank=rank, op=op) from None
    if n < 1:
        raise InvalidArgument("the cupy backend found no GPU", rank=rank, op=op)
    return cupy


def _kernels():
    """The compiled RawKernels ``(ftcs2, ftcs3)`` (compiled once per process)."""
    global _module
    if _module is None:
        import cupy  # noqa: PLC0415

        _module = cupy.RawModule(code=SOURCE, options=("--fmad=false",))
    return _module.get_function("ftcs2"), _module.get_function("ftcs3")


class Launch:
    """One region update ``a -> b`` and ``b -> a`` through the RawKernel,
    configured once (arguments as :class:`commlib.apps._heat_cuda.Launch`).

    ``launch(parity)`` updates from ``a`` into ``b`` (parity 0) or from ``b``
    into ``a`` (parity 1) on CuPy's current stream; nothing is allocated per
    call beyond CuPy's own argument marshalling.
    """

    def __init__(self, a, b, c, lo, hi, skip, blocks, threads, chunk):
        from commlib import InvalidArgument  # noqa: PLC0415

        d = len(lo)
        if d not in (2, 3) or a.ndim != d:
            raise InvalidArgument("the cupy backend supports 2-D and 3-D grids", op="heat")
        if skip is None or any(e <= s for s, e in zip(*skip)):
            skip = ((0,) * d, (0,) * d)  # empty: no column lies inside it
        k2, k3 = _kernels()
        i32, f64 = np.int32, np.float64
        ints = [i32(x) for x in (*lo, *hi, *skip[0], *skip[1], chunk)]
        coef = [f64(x) for x in c]
        sizes = [i32(n) for n in a.shape[1:]]
        self.kernel = k3 if d == 3 else k2
        self.grid, self.block = tuple(int(x) for x in blocks), tuple(int(x) for x in threads)
        self._args = ((a, b, *coef, *sizes, *ints), (b, a, *coef, *sizes, *ints))

    def launch(self, parity: int) -> None:
        self.kernel(self.grid, self.block, self._args[parity])


def cupy_slice_step(u, un, c):
    """One FTCS step written as a CuPy user would, with slice expressions.

    Args:
        u: the padded field at time ``t`` (CuPy or numpy array, float64, 2-D
            or 3-D, one ghost cell per side: shape ``(n_0+2, ..., n_{d-1}+2)``;
            ghost cells hold the boundary values).
        un: the field to write (same shape); its owned cells
            ``un[1:-1, ..., 1:-1]`` get ``u + sum_i c_i * second difference_i(u)``,
            its ghost cells are not touched.
        c: ``d`` coefficients ``alpha dt / dx_i^2`` (floats).

    Returns:
        ``un``.  The temporaries are the ones the expression creates (several
        full-size arrays per step), which is what makes this the baseline.
    """
    d = u.ndim
    mid = (slice(1, -1),) * d
    centre = u[mid]
    acc = None
    for i in range(d):
        lo = list(mid)
        hi = list(mid)
        lo[i] = slice(0, -2)
        hi[i] = slice(2, None)
        term = float(c[i]) * (u[tuple(lo)] - 2.0 * centre + u[tuple(hi)])
        acc = term if acc is None else acc + term
    un[mid] = centre + acc
    return un
