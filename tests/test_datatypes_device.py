"""Device pack/unpack (numba.cuda kernels) against MPI_Pack, run in the CUDA
simulator when there is no GPU (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1
before numba.cuda is first imported; set here too when run on its own)."""
from __future__ import annotations

import os
import shutil

if not os.environ.get("COMMLIB_REAL_GPU") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import cuda  # noqa: E402

from commlib import datatypes as dts  # noqa: E402
from commlib.datatypes.testing import datatypes, layout_buffer, mpi_pack, mpi_unpack  # noqa: E402
from commlib.core.errors import DatatypeError  # noqa: E402

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not cuda.is_available(), reason="no GPU and the CUDA simulator is not enabled"),
]


def check_device(t, count, seed=0):
    rng = np.random.default_rng(seed)
    buf, origin = layout_buffer(t, count, rng, slack=3)
    m = t.to_mpi()
    try:
        ref = mpi_pack(m, buf, origin, count)
        dbuf = cuda.to_device(buf)
        got = dts.pack(dbuf, t, count, origin=origin)
        assert hasattr(got, "copy_to_host") and got.shape == (count * t.size,)
        np.testing.assert_array_equal(got.copy_to_host(), ref, err_msg=repr(t))
        if count * t.size and not dts.plan_for(t, count).overlaps():
            target = rng.integers(0, 256, size=buf.size, dtype=np.uint8)
            want = mpi_unpack(m, ref, target, origin, count)
            dtarget = cuda.to_device(target)
            dts.unpack(cuda.to_device(ref), t, dtarget, count, origin=origin)
            np.testing.assert_array_equal(dtarget.copy_to_host(), want, err_msg=repr(t))
    finally:
        m.Free()


@pytest.mark.parametrize("t,count", [
    (dts.Vector(5, 2, 3, np.float64), 2),
    (dts.Vector(4, 3, -5, np.int16), 1),
    (dts.Subarray([6, 7, 8], [2, 3, 4], [1, 2, 3], np.float32), 2),
    (dts.Subarray([3, 4, 5, 6], [2, 2, 3, 2], [1, 0, 1, 2], np.uint8, order="F"), 1),
    (dts.Resized(dts.Vector(4, 1, 6, np.float64), 0, 8), 3),
    (dts.Struct([1, 2, 1], [0, 8, 20], [np.float64, np.int32, np.uint8]), 3),
    (dts.Indexed([3, 1, 2], [7, 0, 12], np.int32), 2),
    (dts.Darray(4, 3, [7, 5], ["cyclic", "block"], [2, -1], [2, 2], np.float64), 1),
])
def test_device_pack_matches_mpi(t, count):
    check_device(t, count)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.filter_too_much])
@given(datatypes(depth=3), st.integers(1, 2), st.integers(0, 2**31))
def test_device_nested_types_match_mpi(t, count, seed):
    check_device(t, count, seed)


def test_device_out_and_validation():
    a = np.arange(60, dtype=np.float64)
    d = cuda.to_device(a)
    t = dts.Vector(6, 2, 5, np.float64)
    out = cuda.device_array(t.size + 8, dtype=np.uint8)
    got = dts.pack(d, t, out=out)
    np.testing.assert_array_equal(got.copy_to_host().view(np.float64), a.reshape(12, 5)[:6, :2].ravel())
    with pytest.raises(DatatypeError, match="pack"):
        dts.pack(cuda.to_device(np.zeros(20)), t)
    with pytest.raises(DatatypeError, match="overlapping"):
        dts.unpack(cuda.to_device(np.zeros(48, np.uint8)), dts.Hvector(3, 2, 8, np.float64), d)
    np.testing.assert_array_equal(d.copy_to_host(), a)  # nothing written


def test_device_packer():
    a = np.arange(6 * 7, dtype=np.float64).reshape(6, 7)
    d = cuda.to_device(a)
    t = dts.Resized(dts.Vector(6, 1, 7, np.float64), 0, 8)
    pk = dts.Packer(t, d, count=2)
    np.testing.assert_array_equal(pk.pack().copy_to_host().view(np.float64), a[:, :2].T.ravel())
    pk.unpack(cuda.to_device(np.zeros(pk.nbytes, np.uint8)))
    assert (d.copy_to_host()[:, :2] == 0).all()


class _CAIDouble:
    """A foreign device array as the adapter sees one: nothing but
    ``__cuda_array_interface__`` (version 3).  Under the simulator device
    memory is host memory, so the address is a numpy array's; on a real GPU it
    wraps a numba device array's address."""

    def __init__(self, arr):
        self._keep = arr
        if isinstance(arr, np.ndarray):
            ptr, shape, strides, typestr = arr.ctypes.data, arr.shape, arr.strides, arr.dtype.str
        else:
            cai = arr.__cuda_array_interface__
            ptr, shape, strides, typestr = cai["data"][0], cai["shape"], cai["strides"], cai["typestr"]
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3, "stream": None}


def _foreign(host):
    """(foreign view, read-back function) over a copy of ``host`` in device memory."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        mem = host.copy()
        return _CAIDouble(mem), lambda: mem.copy()
    d = cuda.to_device(host)
    return _CAIDouble(d), d.copy_to_host


@pytest.mark.parametrize("t,count", [
    (dts.Subarray([5, 6, 7], [2, 6, 7], [0, 0, 0], np.float64), 1),   # one contiguous run (x-face)
    (dts.Subarray([5, 6, 7], [5, 6, 2], [0, 0, 5], np.float64), 1),   # z-face: many short rows
    (dts.Subarray([5, 6, 7], [5, 6, 3], [0, 0, 4], np.float64), 1),   # rows of 3 words: flat mapping
    (dts.Subarray([4, 6, 40], [4, 5, 35], [0, 1, 3], np.float32), 1),  # rows of 35 words: a 32-thread team
    (dts.Indexed([3, 1, 2], [7, 0, 12], np.int32), 2),               # offsets/lengths form
])
def test_foreign_device_array_through_adapter(t, count):
    """pack, unpack, Packer and BatchPack on an array known only by its CUDA
    Array Interface match MPI_Pack and write the same memory in place."""
    rng = np.random.default_rng(7)
    buf, origin = layout_buffer(t, count, rng, slack=0)
    m = t.to_mpi()
    try:
        ref = mpi_pack(m, buf, origin, count)
        f, read = _foreign(buf)
        got = dts.pack(f, t, count, origin=origin)
        host = got.copy_to_host() if hasattr(got, "copy_to_host") else got.get()
        np.testing.assert_array_equal(host, ref)
        pk = dts.Packer(t, f, count, origin=origin)
        out = pk.pack()
        np.testing.assert_array_equal(out.copy_to_host() if hasattr(out, "copy_to_host") else out.get(), ref)
        target = rng.integers(0, 256, size=buf.size, dtype=np.uint8)
        want = mpi_unpack(m, ref, target, origin, count)
        g, read_g = _foreign(target)
        dts.unpack(cuda.to_device(ref), t, g, count, origin=origin)
        np.testing.assert_array_equal(read_g(), want)
        if count == 1 and origin == 0:
            from commlib.datatypes.batch import BatchPack
            bp = BatchPack([(0, t), (1, t)])
            h, read_h = _foreign(target)
            two = cuda.device_array(bp.nbytes, np.uint8)
            bp.pack((f, f), two)
            np.testing.assert_array_equal(two.copy_to_host(), np.concatenate([ref, ref]))
            bp.unpack(two, (h, h))
            np.testing.assert_array_equal(read_h(), want)
        np.testing.assert_array_equal(read(), buf)  # the source is untouched
    finally:
        m.Free()


def test_fastdiv_constants_are_exact():
    """The multiply-and-shift constants the CUDA C kernels divide with give
    n // d for every divisor shape and the extreme dividends (n < 2**31)."""
    from commlib.datatypes._launch import fastdiv
    rng = np.random.default_rng(3)
    divisors = [1, 2, 3, 5, 7, 24, 255, 256, 257, 4095, 65537, 2**20 + 7, 2**31 - 1]
    divisors += [int(x) for x in rng.integers(1, 2**31, 200)]
    for d in divisors:
        m, s = fastdiv(d)
        ns = [0, 1, d - 1, d, d + 1, 2**31 - 1, 2**31 - 2] + [int(x) for x in rng.integers(0, 2**31, 200)]
        for n in ns:
            assert (n * m) >> s == n // d, (n, d)
            assert n * m < 2**64


def test_pack_on_a_given_stream():
    """pack/unpack/Packer with an explicit stream (a numba stream here; CuPy,
    torch streams and int handles on a GPU) give the same bytes."""
    t = dts.Subarray([6, 7, 8], [6, 7, 3], [0, 0, 2], np.float64)
    a = np.arange(6 * 7 * 8, dtype=np.float64).reshape(6, 7, 8)
    d = cuda.to_device(a)
    s = cuda.stream()
    got = dts.pack(d, t, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(got.copy_to_host().view(np.float64), a[:, :, 2:5].ravel())
    pk = dts.Packer(t, d, stream=s)
    pk.pack()
    s.synchronize()
    np.testing.assert_array_equal(pk.out.copy_to_host(), got.copy_to_host())
    z = cuda.to_device(np.zeros_like(a))
    dts.unpack(got, t, z, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(z.copy_to_host()[:, :, 2:5], a[:, :, 2:5])
    with pytest.raises(Exception, match="stream"):
        dts.pack(d, t, stream="nonsense")


def test_device_pack_into_larger_out_contiguous():
    """A one-run plan packed into a larger ``out`` (the numba path's copy must
    take the plan's bytes only)."""
    a = np.arange(4 * 5 * 6, dtype=np.float64).reshape(4, 5, 6)
    t = dts.Subarray([4, 5, 6], [1, 5, 6], [2, 0, 0], np.float64)
    out = cuda.device_array(t.size + 5, np.uint8)
    got = dts.pack(cuda.to_device(a), t, out=out)
    np.testing.assert_array_equal(got.copy_to_host().view(np.float64), a[2].ravel())
