"""BatchPack: one kernel call for many pieces, byte-identical to per-piece pack
(itself checked against MPI.Datatype.Pack) and to MPI_Pack directly."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from commlib import datatypes as dts
from commlib.datatypes.batch import BatchPack
from commlib.core.errors import DatatypeError

pytestmark = pytest.mark.timeout(120)


@st.composite
def subarray_pieces(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    nbufs = draw(st.integers(1, 3))
    pieces = []
    for _ in range(draw(st.integers(1, 6))):
        sub = tuple(draw(st.integers(1, n)) for n in shape)
        start = tuple(draw(st.integers(0, n - s)) for n, s in zip(shape, sub))
        order = draw(st.sampled_from(["C", "F"]))
        pieces.append((draw(st.integers(0, nbufs - 1)), dts.Subarray(shape, sub, start, np.float64, order=order)))
    return shape, nbufs, pieces


def mpi_pack(buf, t):
    mt = t.to_mpi()
    out = np.empty(mt.Pack_size(1, MPI.COMM_SELF), np.uint8)
    pos = mt.Pack(buf, out, 0, MPI.COMM_SELF)  # buf is exactly one extent (the full array)
    mt.Free()
    return out[:pos]


@settings(max_examples=60, deadline=None)
@given(subarray_pieces(), st.integers(0, 2 ** 31))
def test_batch_equals_mpi_pack_and_unpack_roundtrips(case, seed):
    shape, nbufs, pieces = case
    rng = np.random.default_rng(seed)
    bufs = tuple(rng.random(shape) for _ in range(nbufs))
    bp = BatchPack(pieces)
    out = np.zeros(bp.nbytes, np.uint8)
    bp.pack(bufs, out)
    want = np.concatenate([mpi_pack(bufs[i], t) for i, t in pieces])
    assert np.array_equal(out, want)
    back = tuple(np.zeros(shape) for _ in range(nbufs))
    if not any(BatchPack([p])._fused is None for p in pieces):
        # overlapping targets are legal across pieces; compare with sequential unpack
        ref = tuple(np.zeros(shape) for _ in range(nbufs))
        pos = 0
        for i, t in pieces:
            dts.unpack(want[pos:pos + t.size], t, ref[i])
            pos += t.size
        bp.unpack(out, back)
        for a, b in zip(back, ref):
            assert np.array_equal(a, b)


def test_batch_fuses_strided_and_falls_back_for_irregular():
    shape = (6, 6)
    a = np.arange(36.0).reshape(shape)
    strided = BatchPack([(0, dts.Subarray(shape, (2, 3), (1, 1), np.float64))])
    assert strided._fused is not None
    irregular = BatchPack([(0, dts.Indexed([1, 2], [0, 7], np.float64)),
                           (0, dts.Struct([1, 1], [0, 16], [np.int32, np.float64]))])
    out = np.empty(irregular.nbytes, np.uint8)
    irregular.pack((a,), out)
    want = np.concatenate([dts.pack(a, t) for _, t in irregular.pieces])
    assert np.array_equal(out, want)


def test_batch_device_buffers_simulator():
    from numba import cuda

    shape = (5, 4)
    pieces = [(0, dts.Subarray(shape, (2, 2), (0, 1), np.float64)), (1, dts.Vector(5, 1, 4, np.float64))]
    host = (np.arange(20.0).reshape(shape), -np.arange(20.0).reshape(shape))
    bp = BatchPack(pieces)
    d_out = cuda.device_array(bp.nbytes, np.uint8)
    bp.pack(tuple(cuda.to_device(h) for h in host), d_out)
    want = np.concatenate([dts.pack(host[i], t) for i, t in pieces])
    assert np.array_equal(d_out.copy_to_host(), want)


def test_batch_bad_input():
    shape = (4, 4)
    t = dts.Subarray(shape, (2, 2), (0, 0), np.float64)
    with pytest.raises(DatatypeError, match="overlap"):
        BatchPack([(0, t), (0, t)], offsets=[0, 8])
    bp = BatchPack([(0, t), (1, t)])
    with pytest.raises(DatatypeError, match="1 buffers given, pieces use 2"):
        bp.pack((np.zeros(shape),), np.zeros(bp.nbytes, np.uint8))
    with pytest.raises(DatatypeError, match="out holds"):
        bp.pack((np.zeros(shape), np.zeros(shape)), np.zeros(3, np.uint8))
    small = BatchPack([(0, dts.Subarray((8, 8), (2, 2), (6, 6), np.float64))])
    with pytest.raises(DatatypeError, match="nothing was written"):
        small.pack((np.zeros((4, 4)),), np.zeros(small.nbytes, np.uint8))


def test_batch_unpack_refuses_overlapping_targets():
    """A piece that writes some byte twice raises, as per-piece unpack does."""
    twice = dts.Hvector(2, 1, 0, np.float64)  # the same 8 bytes twice (stride 0)
    bp = BatchPack([(0, twice)])
    buf = np.zeros(4)
    packed = np.zeros(bp.nbytes, np.uint8)
    bp.pack((buf,), packed)  # reading twice is fine
    with pytest.raises(DatatypeError, match="more than once"):
        bp.unpack(packed, (buf,))
