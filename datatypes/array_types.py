"""MPI's array type constructors: ``Subarray`` and ``Darray`` (MPI-4.0 §5.1.3-§5.1.4).

Both place elements of a row- or column-major array of ``base`` and set explicit
bounds ``[0, prod(sizes) * base.extent)`` that nesting keeps (MPI's sticky
markers).  The datatype protocol they implement is in :mod:`.constructors`.
"""
from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from commlib.core.errors import DatatypeError

from . import canonical as _c
from .constructors import Datatype, as_datatype, int_arg, ints_arg

__all__ = [
    "DISTRIBUTE_BLOCK",
    "DISTRIBUTE_CYCLIC",
    "DISTRIBUTE_DFLT_DARG",
    "DISTRIBUTE_NONE",
    "Darray",
    "Subarray",
]


def _order(order, op):
    if isinstance(order, str):
        o = order.upper()
        if o in ("C", "ORDER_C"):
            return "C"
        if o in ("F", "FORTRAN", "ORDER_FORTRAN"):
            return "F"
    else:
        if order == MPI.ORDER_C:
            return "C"
        if order == MPI.ORDER_FORTRAN:
            return "F"
    raise DatatypeError(f"order must be 'C' or 'F' (or MPI.ORDER_C/ORDER_FORTRAN), got {order!r}", op=op)


def _array_type(self, sizes, base, idx_lists, order):
    """Shared by Subarray and Darray: elements at the product of per-dimension
    index lists of a ``sizes`` array of ``base``, resized to ``[0, prod(sizes)*extent)``."""
    ext = base.extent
    n = len(sizes)
    # element stride (in base extents) of each dimension
    el = [0] * n
    acc = 1
    dims = range(n - 1, -1, -1) if order == "C" else range(n)
    for d in dims:
        el[d] = acc
        acc *= sizes[d]
    total = acc
    # fastest dimension first
    fast = list(dims)
    self._fast = fast
    self._el = el
    nelem = 1
    for lst in idx_lists:
        nelem *= len(lst)
    parts = []
    if nelem:
        lo = sum(min(lst) * el[d] * ext for d, lst in enumerate(idx_lists))
        hi = sum(max(lst) * el[d] * ext for d, lst in enumerate(idx_lists))
        if ext < 0:
            lo, hi = hi, lo
        parts.append((base, lo, hi, nelem))
    self._bounds_from_copies(parts)  # size, true bounds, alignment; then the array's bounds
    self._set_bounds(self.size, 0, total * ext, self.true_lb, self.true_ub, self.alignment, True)


class Subarray(Datatype):
    """A ``subsizes`` block at ``starts`` of a ``sizes`` array of ``base``
    (``MPI_Type_create_subarray``).

    The lower bound is 0 and the extent the whole array, ``prod(sizes) *
    base.extent`` bytes (MPI-4.0 §5.1.3).

    Args:
        sizes: array shape, ints > 0.
        subsizes: block shape, ``1 <= subsizes[i] <= sizes[i]``.
        starts: block origin, ``0 <= starts[i] <= sizes[i] - subsizes[i]``.
        base: element type.
        order: ``"C"`` (row major) or ``"F"`` (column major), or the MPI constants.

    Raises:
        DatatypeError: when the block does not fit the array.
    """

    combiner = "SUBARRAY"

    def __init__(self, sizes, subsizes, starts, base, order="C"):
        super().__init__()
        op = "Subarray"
        self.base = as_datatype(base, op)
        self.sizes = ints_arg(sizes, "sizes", op)
        self.subsizes = ints_arg(subsizes, "subsizes", op)
        self.starts = ints_arg(starts, "starts", op)
        self.order = _order(order, op)
        n = len(self.sizes)
        if n == 0 or len(self.subsizes) != n or len(self.starts) != n:
            raise DatatypeError(f"sizes, subsizes and starts need one entry per dimension (>= 1), got "
                       f"{self.sizes}, {self.subsizes}, {self.starts}", op=op)
        for d in range(n):
            if self.sizes[d] < 1 or self.subsizes[d] < 1 or self.subsizes[d] > self.sizes[d]:
                raise DatatypeError(f"dimension {d}: need 1 <= subsizes <= sizes, got {self.subsizes[d]} of "
                                    f"{self.sizes[d]}", op=op)
            if self.starts[d] < 0 or self.starts[d] + self.subsizes[d] > self.sizes[d]:
                raise DatatypeError(f"dimension {d}: start {self.starts[d]} + subsize {self.subsizes[d]} "
                           f"exceeds size {self.sizes[d]}", op=op)
        idx = [range(s, s + c) for s, c in zip(self.starts, self.subsizes)]
        _array_type(self, self.sizes, self.base, idx, self.order)

    def _compute_layout(self):
        ext = self.base.extent
        start = sum(self.starts[d] * self._el[d] * ext for d in range(len(self.sizes)))
        counts = tuple(self.subsizes[d] for d in self._fast)
        strides = tuple(self._el[d] * ext for d in self._fast)
        return _c.replicate(self.base.canonical(), counts, strides).shifted(start)

    @classmethod
    def from_decoded(cls, params, kids):
        return cls(params["sizes"], params["subsizes"], params["starts"], kids[0], order=params["order"])

    def _create_mpi(self, inner):
        order = MPI.ORDER_C if self.order == "C" else MPI.ORDER_FORTRAN
        return inner.Create_subarray(list(self.sizes), list(self.subsizes), list(self.starts), order=order)

    def _repr_args(self):
        return f"{list(self.sizes)}, {list(self.subsizes)}, {list(self.starts)}, {self.base!r}, order={self.order!r}"


DISTRIBUTE_BLOCK, DISTRIBUTE_CYCLIC, DISTRIBUTE_NONE, DISTRIBUTE_DFLT_DARG = "block", "cyclic", "none", -1


def _distrib(x, op):
    if isinstance(x, str):
        v = x.lower()
        if v in ("block", "cyclic", "none"):
            return v
    else:
        m = {MPI.DISTRIBUTE_BLOCK: "block", MPI.DISTRIBUTE_CYCLIC: "cyclic", MPI.DISTRIBUTE_NONE: "none"}
        if x in m:
            return m[x]
    raise DatatypeError(f"distribution must be 'block', 'cyclic' or 'none' (or MPI.DISTRIBUTE_*), got {x!r}", op=op)


class Darray(Datatype):
    """The block of a ``gsizes`` array that process ``rank`` of a ``psizes`` grid
    owns under HPF-style distributions (``MPI_Type_create_darray``, MPI-4.0 §5.1.4).

    Processes are numbered row-major in the grid whatever ``order`` is.  Lower
    bound 0, extent ``prod(gsizes) * base.extent``.

    Args:
        size: number of processes, ``prod(psizes)``.
        rank: this process, ``0 <= rank < size``.
        gsizes: global array shape.
        distribs: per dimension ``"block"``, ``"cyclic"`` or ``"none"`` (or the
            ``MPI.DISTRIBUTE_*`` constants).
        dargs: per dimension block size, or -1 (``MPI.DISTRIBUTE_DFLT_DARG``).
        psizes: process grid shape.
        base: element type.
        order: ``"C"`` or ``"F"``.

    Raises:
        DatatypeError: on inconsistent arguments (grid size, a block distribution
            that does not cover the dimension, ``"none"`` with ``psizes[i] > 1``).
    """

    combiner = "DARRAY"

    def __init__(self, size, rank, gsizes, distribs, dargs, psizes, base, order="C"):
        super().__init__()
        op = "Darray"
        self.base = as_datatype(base, op)
        self.nprocs = int_arg(size, "size", op)
        self.rank = int_arg(rank, "rank", op)
        self.gsizes = ints_arg(gsizes, "gsizes", op)
        self.distribs = tuple(_distrib(x, op) for x in distribs)
        self.dargs = ints_arg(dargs, "dargs", op)
        self.psizes = ints_arg(psizes, "psizes", op)
        self.order = _order(order, op)
        n = len(self.gsizes)
        if not (len(self.distribs) == len(self.dargs) == len(self.psizes) == n) or n == 0:
            raise DatatypeError("gsizes, distribs, dargs and psizes need one entry per dimension", op=op)
        if math.prod(self.psizes) != self.nprocs:
            raise DatatypeError(f"prod(psizes)={math.prod(self.psizes)} != size={self.nprocs}", op=op)
        if not 0 <= self.rank < self.nprocs:
            raise DatatypeError(f"rank {self.rank} out of range for size {self.nprocs}", op=op)
        coords = []
        r = self.rank
        for p in reversed(self.psizes):  # row-major process grid
            coords.append(r % p)
            r //= p
        coords.reverse()
        idx = []
        for d in range(n):
            g, p, c, k = self.gsizes[d], self.psizes[d], coords[d], self.dargs[d]
            dist = self.distribs[d]
            if dist == "none":
                if p != 1:
                    raise DatatypeError(f"dimension {d}: DISTRIBUTE_NONE needs psizes[{d}] == 1", op=op)
                idx.append(range(g))
            elif dist == "block":
                b = -(-g // p) if k == DISTRIBUTE_DFLT_DARG else k
                if b <= 0 or b * p < g:
                    raise DatatypeError(f"dimension {d}: block size {b} x {p} processes does not cover {g}", op=op)
                idx.append(range(min(c * b, g), min((c + 1) * b, g)))
            else:
                b = 1 if k == DISTRIBUTE_DFLT_DARG else k
                if b <= 0:
                    raise DatatypeError(f"dimension {d}: cyclic block size must be > 0", op=op)
                idx.append([i for i in range(g) if (i // b) % p == c])
        self._idx = idx
        _array_type(self, self.gsizes, self.base, idx, self.order)

    def _compute_layout(self):
        ext = self.base.extent
        disp = np.zeros(1, np.int64)
        for d in reversed(self._fast):  # slowest first, so later dims end up faster
            lst = np.asarray(list(self._idx[d]), np.int64) * (self._el[d] * ext)
            disp = (disp[:, None] + lst[None, :]).ravel()
        if disp.size == 0:
            return _c.EMPTY
        return _c.replicate(self.base.canonical(), displs=disp)

    @classmethod
    def from_decoded(cls, params, kids):
        p = params
        return cls(p["size"], p["rank"], p["gsizes"], p["distribs"], p["dargs"], p["psizes"], kids[0], order=p["order"])

    def _create_mpi(self, inner):
        m = {"block": MPI.DISTRIBUTE_BLOCK, "cyclic": MPI.DISTRIBUTE_CYCLIC, "none": MPI.DISTRIBUTE_NONE}
        order = MPI.ORDER_C if self.order == "C" else MPI.ORDER_FORTRAN
        dargs = [MPI.DISTRIBUTE_DFLT_DARG if a == DISTRIBUTE_DFLT_DARG else a for a in self.dargs]
        return inner.Create_darray(self.nprocs, self.rank, list(self.gsizes), [m[x] for x in self.distribs],
                                   dargs, list(self.psizes), order=order)

    def _repr_args(self):
        return (f"{self.nprocs}, {self.rank}, {list(self.gsizes)}, {list(self.distribs)}, {list(self.dargs)}, "
                f"{list(self.psizes)}, {self.base!r}, order={self.order!r}")
