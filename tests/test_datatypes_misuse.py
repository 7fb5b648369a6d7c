"""What a careless user passes to the datatype layer is refused, not acted on.

Before these checks: ``unpack`` wrote into a numpy array whose ``writeable``
flag was cleared and even into a ``bytes`` object (immutable, maybe shared by
the interpreter); ``pack`` wrote into a read-only ``out``; a float count,
origin, stride, displacement, lower bound or array size was truncated (``Vector(2.5,
...)`` built ``Vector(2, ...)``, ``pack(..., count=2.5)`` packed 2 elements);
and ``pack`` of an object array ended in numpy's ``TypeError`` (the pack
benchmarks' command lines: tests/test_bench_cli.py).  Oracles: the buffers' own
bytes before the call, and ``MPI.Datatype.Pack`` for the packed bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from commlib import datatypes as dts
from commlib.core.errors import BufferError, DatatypeError, InvalidArgument

T = dts.Vector(3, 1, 2, np.float64)  # bytes 0-8, 16-24, 32-40 of a 48-byte buffer
PACKED = np.arange(1, 25, dtype=np.uint8)


def _read_only(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("make", [
    lambda: _read_only(np.zeros(6)),
    lambda: _read_only(np.zeros(48, np.int8)),            # a dtype the kernels take as bytes
    lambda: bytes(48),
    lambda: memoryview(bytes(48)),
], ids=["numpy-f8", "numpy-i1", "bytes", "memoryview"])
def test_unpack_refuses_a_read_only_destination(make):
    buf = make()
    before = bytes(memoryview(buf).cast("B"))
    with pytest.raises(BufferError, match="read-only"):
        dts.unpack(PACKED, T, buf)
    assert bytes(memoryview(buf).cast("B")) == before


def test_packer_unpack_refuses_a_read_only_buffer():
    buf = np.zeros(6)
    pk = dts.Packer(T, buf)       # packing a read-only array is fine ...
    buf.flags.writeable = False
    pk.out[:] = PACKED
    with pytest.raises(BufferError, match="read-only"):
        pk.unpack()               # ... unpacking into it is not
    assert not buf.any()


def test_pack_refuses_a_read_only_out():
    out = _read_only(np.zeros(24, np.uint8))
    with pytest.raises(BufferError, match="out is read-only"):
        dts.pack(np.ones(6), T, out=out)
    assert not out.any()
    # the same out made writable gets MPI_Pack's bytes
    out = np.zeros(24, np.uint8)
    m = T.to_mpi()
    ref = np.zeros(24, np.uint8)
    m.Pack(np.arange(6.0)[:5], ref, 0, MPI.COMM_SELF)
    m.Free()
    assert np.array_equal(dts.pack(np.arange(6.0), T, out=out), ref)


@pytest.mark.parametrize("build", [
    lambda: dts.Vector(2.5, 1, 2, np.float64),
    lambda: dts.Vector(True, 1, 2, np.float64),
    lambda: dts.Vector(2, 1.0, 2, np.float64),
    lambda: dts.Hvector(2, 1, 12.5, np.float64),
    lambda: dts.Contiguous(3.7, np.float64),
    lambda: dts.Hindexed([1, 1], [0, 2.5], np.float64),
    lambda: dts.Indexed([1.5, 1], [0, 2], np.float64),
    lambda: dts.IndexedBlock(2, "01", np.float64),
    lambda: dts.Struct([1, 1], [0, 8.0], [np.float64, np.int32]),
    lambda: dts.Resized(np.float64, 0.5, 8),
    lambda: dts.Resized(np.float64, 0, 8.7),
    lambda: dts.Subarray([4.5], [2], [0], np.float64),
    lambda: dts.Darray(2.0, 0, [4], ["block"], [-1], [2], np.float64),
], ids=["vector-count", "vector-bool", "vector-blocklength", "hvector-stride", "contig-count",
        "hindexed-displ", "indexed-blocklength", "indexedblock-str", "struct-displ", "resized-lb",
        "resized-extent", "subarray-sizes", "darray-size"])
def test_constructors_refuse_non_integers(build):
    with pytest.raises(DatatypeError, match="must be"):
        build()


def test_constructors_take_numpy_integers():
    t = dts.Vector(np.int64(3), np.int32(1), np.int16(2), np.float64)
    assert t.same_layout(T)
    assert dts.Hindexed(np.array([1, 2]), np.array([0, 16]), np.float64).size == 24


@pytest.mark.parametrize("kw", [{"count": 1.5}, {"count": True}, {"count": "1"}, {"origin": 8.0},
                                {"origin": "8"}, {"origin": True}],
                         ids=["count-float", "count-bool", "count-str", "origin-float", "origin-str", "origin-bool"])
@pytest.mark.parametrize("fn", ["pack", "unpack", "Packer"])
def test_count_and_origin_must_be_integers(fn, kw):
    buf = np.zeros(12)
    dts.pack(buf, T, 1)  # a plan for count 1 is cached: the fast path must check too
    args = dict(count=1, origin=0) | kw
    with pytest.raises(DatatypeError, match=f"{next(iter(kw))} must be an int"):
        if fn == "pack":
            dts.pack(buf, T, args["count"], origin=args["origin"])
        elif fn == "unpack":
            dts.unpack(np.zeros(48, np.uint8), T, buf, args["count"], origin=args["origin"])
        else:
            dts.Packer(T, buf, args["count"], origin=args["origin"])
    assert not buf.any()
    # numpy integers are integers
    assert dts.pack(buf, T, np.int64(2), origin=np.int32(0)).shape == (48,)


def test_pack_of_an_object_array_is_an_invalid_argument():
    with pytest.raises(InvalidArgument, match="object"):
        dts.pack(np.array([1.0] * 6, dtype=object), T)
    with pytest.raises(InvalidArgument, match="object"):
        dts.unpack(PACKED, T, np.array([1.0] * 6, dtype=object))
