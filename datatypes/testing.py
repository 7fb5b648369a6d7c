"""Test helpers: hypothesis strategies for datatypes and the ``MPI_Pack`` oracle.

Used by commlib's own tests and available to code built on commlib (e.g. a
halo exchange checking its face types).  Needs ``hypothesis`` (the ``test``
extra).
"""
from __future__ import annotations

import numpy as np
from hypothesis import assume
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from mpi4py import MPI

from commlib import datatypes as dts

# Real types only: Open MPI 5 mis-packs complex types at displacements that are
# an odd multiple of half their size (C_DOUBLE_COMPLEX at byte 72 is read from 64).
LEAVES = [np.uint8, np.int16, np.int32, np.int64, np.float32, np.float64]
MAX_BYTES = 1 << 15


@st.composite
def named(draw):
    return dts.Named(draw(st.sampled_from(LEAVES)))


def _small(draw, lo=0, hi=3):
    return draw(st.integers(lo, hi))


@st.composite
def vectors(draw, base=None):
    """Vector / Hvector / Contiguous of a named type (hypothesis-generated shapes)."""
    b = base if base is not None else draw(named())
    kind = draw(st.sampled_from(["vector", "hvector", "contig"]))
    count = _small(draw, 1, 6)
    bl = _small(draw, 1, 4)
    if kind == "contig":
        return dts.Contiguous(count * bl, b)
    if kind == "vector":
        stride = draw(st.integers(-8, 8))
        t = dts.Vector(count, bl, stride, b)
    else:
        t = dts.Hvector(count, bl, draw(st.integers(-64, 64)), b)
    # Open MPI 5's opal_datatype_add reads an extent of -1 as "the default
    # extent", so a (h)vector whose stride is -1 byte packs as if contiguous
    # (bytes 0, 1 instead of 0, -1): MPI is no oracle there.
    assume(not (count > 1 and t.stride_bytes == -1))
    return t


@st.composite
def subarrays(draw, base=None):
    """Subarrays of 1-4 dimensions, C or Fortran order."""
    b = base if base is not None else draw(named())
    nd = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 6)) for _ in range(nd)]
    subs = [draw(st.integers(1, s)) for s in sizes]
    starts = [draw(st.integers(0, s - c)) for s, c in zip(sizes, subs)]
    order = draw(st.sampled_from(["C", "F"]))
    return dts.Subarray(sizes, subs, starts, b, order=order)


@st.composite
def datatypes(draw, depth=3):
    """Nested types up to ``depth`` constructors deep, every combiner."""
    if depth == 0:
        return draw(named())
    kind = draw(st.sampled_from(
        ["named", "contig", "vector", "hvector", "indexed", "hindexed", "indexed_block",
         "hindexed_block", "struct", "subarray", "resized", "darray"]))
    if kind == "named":
        return draw(named())
    if kind == "struct":
        n = draw(st.integers(1, 3))
        kids = [draw(datatypes(depth=depth - 1)) for _ in range(n)]
        assume(all(k.size > 0 for k in kids))
        bls = [draw(st.integers(0, 2)) for _ in range(n)]
        disps = [draw(st.integers(-32, 96)) for _ in range(n)]
        return dts.Struct(bls, disps, kids)
    b = draw(datatypes(depth=depth - 1))
    # Empty (size-0) children: their bounds inside a parent are not pinned down
    # by the standard and Open MPI is inconsistent (contiguous(1, empty darray)
    # has extent 0, vector(1, 1, 0, same) extent 1), so nests avoid them.
    assume(b.extent > 0 and b.size > 0)
    if kind == "contig":
        return dts.Contiguous(draw(st.integers(0, 3)), b)
    if kind in ("vector", "hvector"):
        return draw(vectors(base=b))
    if kind == "subarray":
        return draw(subarrays(base=b))
    if kind == "resized":
        lb = draw(st.integers(-16, 16))
        ext = draw(st.integers(1, max(1, b.extent + 16)))
        return dts.Resized(b, lb, ext)
    if kind == "darray":
        nd = draw(st.integers(1, 3))
        gs = [draw(st.integers(1, 7)) for _ in range(nd)]
        ps = [draw(st.integers(1, 3)) for _ in range(nd)]
        dist, dargs = [], []
        for g, p in zip(gs, ps):
            d = draw(st.sampled_from(["block", "cyclic"] + (["none"] if p == 1 else [])))
            if d == "block":
                a = draw(st.sampled_from([-1, -(-g // p), -(-g // p) + 1]))
            elif d == "cyclic":
                a = draw(st.sampled_from([-1, 1, 2]))
            else:
                a = -1
            dist.append(d)
            dargs.append(a)
        size = int(np.prod(ps))
        rank = draw(st.integers(0, size - 1))
        return dts.Darray(size, rank, gs, dist, dargs, ps, b, order=draw(st.sampled_from(["C", "F"])))
    n = draw(st.integers(1, 4))
    if kind in ("indexed", "hindexed"):
        bls = [draw(st.integers(0, 3)) for _ in range(n)]
    else:
        bl = draw(st.integers(1, 3))
    if kind.startswith("h"):
        disps = [draw(st.integers(-64, 128)) for _ in range(n)]
    else:
        disps = [draw(st.integers(-4, 12)) for _ in range(n)]
    if kind == "indexed":
        return dts.Indexed(bls, disps, b)
    if kind == "hindexed":
        return dts.Hindexed(bls, disps, b)
    if kind == "indexed_block":
        return dts.IndexedBlock(bl, disps, b)
    return dts.HindexedBlock(bl, disps, b)


def layout_buffer(t, count, rng, slack=0):
    """A random byte buffer big enough for ``count`` elements of ``t`` and the
    origin (byte offset of displacement 0) that keeps every access inside it."""
    p = dts.plan_for(t, count)
    origin = max(0, -p.lo, -min(0, (count - 1) * t.extent))
    n = origin + max(p.hi, count * t.extent, 0) + slack
    if currently_in_test_context():
        assume(n <= MAX_BYTES)
    return rng.integers(0, 256, size=max(n, 1), dtype=np.uint8), origin


def mpi_pack(m, buf_u8, origin, count):
    """MPI_Pack oracle: ``count`` elements of the committed MPI type ``m`` from
    ``buf_u8[origin:]``; the input view is exactly ``count * extent`` bytes so
    mpi4py infers ``count``, and the output exactly ``count * size`` bytes."""
    out = np.zeros(count * m.size, np.uint8)
    if count == 0 or m.size == 0:
        return out
    inbuf = buf_u8[origin:origin + count * m.extent]
    pos = m.Pack(inbuf, out, 0, MPI.COMM_SELF)
    assert pos == out.size
    return out


def mpi_unpack(m, packed, buf_u8, origin, count):
    """MPI_Unpack oracle into a copy of ``buf_u8``."""
    res = buf_u8.copy()
    if count == 0 or m.size == 0:
        return res
    m.Unpack(packed, 0, res[origin:origin + count * m.extent], MPI.COMM_SELF)
    return res
