"""Collectives on device buffers: reduced on the device, same bits as the host path.

numba device arrays run in the CUDA simulator without a GPU (keep them tiny);
the CuPy test runs only where CuPy imports (a GPU run).  Oracles: the same
call on host numpy arrays (bit for bit), mpi4py's own collective where exact
(integers), and SHA-256 of every rank's result gathered across ranks.

    for n in 1 2 3 4; do
      mpiexec --oversubscribe -n $n python -P -m pytest --with-mpi -q tests/test_collectives_device.py
    done
"""
import hashlib
import os

import numpy as np
import pytest

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.timeout(300)]

MPI = pytest.importorskip("mpi4py.MPI")
ml_dtypes = pytest.importorskip("ml_dtypes")
cuda = pytest.importorskip("numba.cuda")

import commlib  # noqa: E402
from commlib.collectives import _device_reduce as dr  # noqa: E402
from commlib.collectives import ops as ops_mod  # noqa: E402
from commlib.transports import mpi as _mpi_tp
from oracles import ring_oracle  # noqa: E402 - tests/oracles.py

BF16 = np.dtype(ml_dtypes.bfloat16)
CASES = [(np.dtype(np.float32), "sum"), (np.dtype(np.float64), "avg"), (np.dtype(np.float16), "sum"),
         (BF16, "max"), (np.dtype(np.int32), "sum"), (np.dtype(np.uint8), "bxor"), (np.dtype(np.int64), "min")]
if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
    # numba.cuda cannot copy an ml_dtypes bfloat16 array to a real GPU (no buffer
    # format for it), and CuPy has no bfloat16 dtype either: bfloat16 device
    # arrays are exercised in the simulator only
    CASES = [c for c in CASES if c[0] != BF16]
# count 0: an empty device array (the simulator gives it strides (0,)) is contiguous and reduces to nothing
COUNTS = [0, 1, 7, 13]


@pytest.fixture(scope="module")
def comm():
    return commlib.init()


@pytest.fixture(params=[None, 8], ids=["one-segment", "8-byte-segments"])
def segment(request, monkeypatch):
    """Run the staged ring in one segment per chunk, and in many (the pipeline)."""
    if request.param is not None:
        monkeypatch.setattr(dr, "SEGMENT_BYTES", request.param)
    return request.param


def _data(dtype, count, rank, seed):
    rng = np.random.default_rng(seed * 100 + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 100, count).astype(dtype)
    return rng.uniform(-1, 1, count).astype(dtype)


def _sha_identical(comm, arr):
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    digests = comm.mpi_comm.allgather(digest)
    assert len(set(digests)) == 1, f"results differ across ranks (rank {comm.rank}): {digests}"


def _mpi_ref(comm, x, op, fn="allreduce"):
    dt = _mpi_tp.MPITransport.native_dtype(x.dtype)
    if dt is None or x.dtype.kind not in "iu":
        return None
    if fn == "allreduce":
        out = np.empty_like(x)
        comm.mpi_comm.Allreduce([x, dt], [out, dt], _mpi_tp.mpi_op(ops_mod.get_op(op).name))
        return out
    n = comm.size
    out = np.empty(x.size // n, x.dtype)
    comm.mpi_comm.Reduce_scatter_block([x, dt], [out, dt], _mpi_tp.mpi_op(ops_mod.get_op(op).name))
    return out


@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d.name}-{o}" for d, o in CASES])
def test_allreduce_ring_device(comm, dtype, op, segment):
    for count in COUNTS:
        inputs = [_data(dtype, count, r, count) for r in range(comm.size)]
        x = inputs[comm.rank]
        d = cuda.to_device(x)
        comm.allreduce(d, op=op, algorithm="ring")
        got = d.copy_to_host()
        host = x.copy()
        comm.allreduce(host, op=op, algorithm="ring")
        assert got.tobytes() == host.tobytes()
        assert got.tobytes() == ring_oracle(inputs, op).tobytes()
        _sha_identical(comm, got)
        ref = _mpi_ref(comm, x, op)
        if ref is not None:
            np.testing.assert_array_equal(got, ref)
        # out of place: sendbuf untouched
        src, out = cuda.to_device(x), cuda.device_array(count, dtype) if dtype != BF16 else cuda.to_device(x * 0)
        comm.allreduce(src, out, op=op, algorithm="ring")
        assert out.copy_to_host().tobytes() == host.tobytes()
        assert src.copy_to_host().tobytes() == x.tobytes()


@pytest.mark.parametrize("algorithm", ["auto", "recursive_doubling"])
def test_allreduce_other_algorithms_staged(comm, algorithm):
    """Small one-round calls and recursive doubling stage through pinned host buffers."""
    x = _data(np.float32, 9, comm.rank, 3)
    d = cuda.to_device(x)
    comm.allreduce(d, op="sum", algorithm=algorithm)
    host = x.copy()
    comm.allreduce(host, op="sum", algorithm=algorithm)
    assert d.copy_to_host().tobytes() == host.tobytes()
    _sha_identical(comm, host)


@pytest.mark.parametrize("dtype,op", [(np.dtype(np.float32), "sum"), (np.dtype(np.int32), "sum"),
                                      (np.dtype(np.float16), "avg")], ids=["float32-sum", "int32-sum", "float16-avg"])
@pytest.mark.parametrize("per", [1, 3])
def test_reduce_scatter_ring_device(comm, dtype, op, per, segment):
    n = comm.size
    x = _data(dtype, per * n, comm.rank, per)
    host = comm.reduce_scatter(x, op=op, algorithm="ring")
    got = comm.reduce_scatter(cuda.to_device(x), op=op, algorithm="ring")
    assert got.copy_to_host().tobytes() == host.tobytes()  # a device sendbuf gives a device result
    out = cuda.device_array(per, dtype)
    assert comm.reduce_scatter(cuda.to_device(x), out, op=op, algorithm="ring") is out
    assert out.copy_to_host().tobytes() == host.tobytes()
    ref = _mpi_ref(comm, x, op, "reduce_scatter")
    if ref is not None:
        np.testing.assert_array_equal(host, ref)
    _sha_identical(comm, comm.mpi_comm.allgather(host.tobytes()))


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
def test_allgather_device(comm, algorithm):
    x = _data(np.int16, 5, comm.rank, 1)
    out = cuda.device_array(5 * comm.size, np.int16)
    comm.allgather(cuda.to_device(x), out, algorithm=algorithm)
    ref = np.empty(5 * comm.size, np.int16)
    comm.mpi_comm.Allgather(x, ref)
    np.testing.assert_array_equal(out.copy_to_host(), ref)
    _sha_identical(comm, out.copy_to_host())


@pytest.mark.parametrize("algorithm", ["binomial", "mpi", "auto"])
def test_bcast_device(comm, algorithm):
    root = comm.size - 1
    x = _data(np.float64, 6, comm.rank, 2)
    d = cuda.to_device(x)
    comm.bcast(d, root=root, algorithm=algorithm)
    ref = x.copy()
    comm.mpi_comm.Bcast(ref, root=root)
    assert d.copy_to_host().tobytes() == ref.tobytes()
    _sha_identical(comm, d.copy_to_host())


def test_staging_buffers_reused(comm):
    """Pinned staging is allocated once per (role, count, dtype) and reused."""
    d = cuda.to_device(np.ones(4, np.float32))
    comm.allreduce(d, algorithm="ring")
    cache = comm._staging()
    before = {k: id(e.host) for k, e in cache.entries.items()}
    comm.allreduce(d, algorithm="ring")
    assert {k: id(e.host) for k, e in cache.entries.items()} == before
    assert len(cache.entries) <= cache.bound


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "bxor"])
def test_reduce_into_matches_ufunc(op):
    """The kernel of one ring step equals numpy's ufunc bit for bit (no communication)."""
    rng = np.random.default_rng(7)
    dtypes = [np.int8, np.uint32, np.int64] if op == "bxor" else [np.float16, np.float32, np.float64, np.int8]
    for dt in dtypes:
        a = (rng.integers(-100, 100, 11) if np.dtype(dt).kind in "iu" else rng.uniform(-2, 2, 11)).astype(dt)
        b = (rng.integers(-100, 100, 11) if np.dtype(dt).kind in "iu" else rng.uniform(-2, 2, 11)).astype(dt)
        if np.dtype(dt).kind == "f":
            a[0], b[1] = np.nan, np.nan
        da = cuda.to_device(a)
        ops_mod.reduce_into(da, cuda.to_device(b), op)
        expect = a.copy()
        ops_mod.reduce_into(expect, b, op)
        assert da.copy_to_host().tobytes() == expect.tobytes(), (dt, op)


def test_cupy_allreduce(comm):
    """CuPy buffers: the device ring (or staging) gives the host ring's bits (GPU runs only)."""
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        pytest.skip("no CUDA device")
    for dtype, op in [(np.float32, "sum"), (np.float16, "avg"), (np.int32, "max"), (np.float64, "min")]:
        for count in (0, 5, 1 << 20):
            x = _data(dtype, count, comm.rank, count % 97)
            d = cupy.asarray(x)
            comm.allreduce(d, op=op, algorithm="ring")
            host = x.copy()
            comm.allreduce(host, op=op, algorithm="ring")
            got = cupy.asnumpy(d)
            assert got.tobytes() == host.tobytes(), (dtype, op, count)
            _sha_identical(comm, got)
            rs = comm.reduce_scatter(cupy.asarray(x[: count - count % comm.size]), op=op, algorithm="ring")
            hrs = comm.reduce_scatter(x[: count - count % comm.size], op=op, algorithm="ring")
            assert np.asarray(rs).tobytes() == hrs.tobytes()


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_zero_element_device_calls(comm, op, segment, gpu_empty_slices):
    """0 elements on every rank: each device collective returns the empty result (in
    and out of place, staged ring and one-round paths), never slicing the empty
    device vector (which raises on a GPU)."""
    n = comm.size
    for algorithm in ("ring", "auto", "recursive_doubling"):
        d = cuda.device_array(0, np.float64)
        assert comm.allreduce(d, op=op, algorithm=algorithm) is d
        out = cuda.device_array(0, np.float64)
        assert comm.allreduce(cuda.device_array(0, np.float64), out, op=op, algorithm=algorithm) is out
        assert out.copy_to_host().size == 0
    got = comm.reduce_scatter(cuda.device_array(0, np.float64), op=op, algorithm="ring")
    assert np.asarray(got.copy_to_host() if hasattr(got, "copy_to_host") else got).size == 0
    out = cuda.device_array(0, np.float64)
    comm.allgather(cuda.device_array(0, np.float64), out, algorithm="ring")
    d = cuda.device_array(0, np.float64)
    comm.bcast(d, root=n - 1)
    # the group is still in step: a real call after the empty ones gives the host result
    x = _data(np.float64, 5, comm.rank, 4)
    d = cuda.to_device(x)
    comm.allreduce(d, op=op, algorithm="ring")
    host = x.copy()
    comm.allreduce(host, op=op, algorithm="ring")
    assert d.copy_to_host().tobytes() == host.tobytes()
