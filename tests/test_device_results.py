"""Collectives that allocate their result return the kind of array ``sendbuf`` is.

``reduce_scatter``, ``allgather`` and ``alltoall`` with ``recvbuf=None``
allocate their result: a numba device ``sendbuf`` (the CUDA simulator's
without a GPU) gives a numba device array, a numpy one gives numpy, whatever
the algorithm (the one-round small path, the device ring, the staged host
algorithms, MPI's own) and in and out of fault-tolerant mode, with the
documented shape and dtype.  ``allreduce`` and ``bcast`` return the caller's
own buffer.  Oracles: the same call on numpy inputs (bit for bit) and
mpi4py's own collective (integers).

    for n in 1 2 3; do
      NUMBA_ENABLE_CUDASIM=1 mpiexec -n $n python -P -m pytest --with-mpi -q tests/test_device_results.py
    done
"""
from __future__ import annotations

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")
cuda = pytest.importorskip("numba.cuda")

import commlib  # noqa: E402
from commlib.collectives._common import chunk_bounds  # noqa: E402
from commlib.collectives.one_round import small_capacity  # noqa: E402
from commlib.collectives.specs import SPECS  # noqa: E402
from commlib.core.buffer import is_device_array  # noqa: E402

pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.timeout(120),
    pytest.mark.skipif(not cuda.is_available(), reason="no GPU and the CUDA simulator is not enabled"),
]

ALLOCATING = ("reduce_scatter", "allgather", "alltoall")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "fault-tolerant"])
def comm(request):
    if request.param:
        return commlib.init(fault_tolerant=True, timeout=60)
    return commlib.init()


def _is_numba_device(x) -> bool:
    """A numba device array (the simulator's without a GPU), as ``cuda.device_array`` makes."""
    return is_device_array(x) and type(x) is type(cuda.device_array(1, np.uint8))


def _call(comm, name, x, algorithm):
    if name == "reduce_scatter":
        return comm.reduce_scatter(x, op="sum", algorithm=algorithm)
    return getattr(comm, name)(x, algorithm=algorithm)


def _mpi_oracle(comm, name, x):
    """mpi4py's own collective of the int32 input ``x`` (1-D)."""
    n, r = comm.size, comm.rank
    if name == "reduce_scatter":
        full = np.empty_like(x)
        comm.mpi_comm.Allreduce(x, full, op=MPI.SUM)
        b = chunk_bounds(x.size, n)
        return full[b[r]:b[r + 1]]
    out = np.empty(x.size * n if name == "allgather" else x.size, x.dtype)
    (comm.mpi_comm.Allgather if name == "allgather" else comm.mpi_comm.Alltoall)(x, out)
    return out.reshape(n, -1)


def _counts(comm, name, itemsize):
    """Element counts (multiples of size for alltoall): one-round small, odd
    (reduce_scatter's uneven blocks), and above the one-round capacity."""
    n = comm.size
    large = small_capacity(n) // itemsize + n
    counts = [n, 3 * n if name == "alltoall" else 2 * n + 1, large - large % n]
    return counts


@pytest.mark.parametrize("name", ALLOCATING)
def test_device_sendbuf_gives_device_result(comm, name):
    """Every algorithm name (``auto`` small and large, the ring on the device,
    the staged host algorithms, ``mpi``): a numba device ``sendbuf`` and no
    ``recvbuf`` give a numba device array with the host call's shape, dtype
    and bits (the host call itself checked against mpi4py's collective)."""
    n, r = comm.size, comm.rank
    for algorithm in SPECS[name].algorithms:
        for count in _counts(comm, name, 4):
            if name == "reduce_scatter" and algorithm == "mpi" and count % n:
                continue  # MPI_Reduce_scatter_block needs equal blocks (refused, tested elsewhere)
            x = (np.arange(count, dtype=np.int32) * (r + 3) - 7 * r) ** 2 % 1000
            host = _call(comm, name, x.copy(), algorithm)
            np.testing.assert_array_equal(host, _mpi_oracle(comm, name, x))
            d = cuda.to_device(x)
            got = _call(comm, name, d, algorithm)
            where = f"{name} {algorithm} count={count} rank={r}"
            assert _is_numba_device(got), f"{where}: returned {type(got).__name__}"
            assert got.shape == host.shape and got.dtype == host.dtype, where
            assert got.copy_to_host().tobytes() == host.tobytes(), where
            assert d.copy_to_host().tobytes() == x.tobytes(), f"{where}: sendbuf changed"


def test_device_result_shapes_and_float_bits(comm):
    """A 2-D float64 device ``sendbuf`` (shape ``S``): allgather gives
    ``(size, *S)``, alltoall ``(size, count // size)``, reduce_scatter this
    rank's block ``(b[r+1] - b[r],)``, as device arrays equal bit for bit to
    the numpy call's (``avg`` for reduce_scatter: the division too)."""
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(11 + r)
    x = rng.uniform(-1, 1, (n, 5))
    d = cuda.to_device(x)
    for name, algorithm in (("allgather", "ring"), ("alltoall", "pairwise"), ("reduce_scatter", "ring"),
                            ("reduce_scatter", "auto")):
        kw = {"op": "avg"} if name == "reduce_scatter" else {}
        host = getattr(comm, name)(x.copy(), algorithm=algorithm, **kw)
        got = getattr(comm, name)(d, algorithm=algorithm, **kw)
        expect = {"allgather": (n, n, 5), "alltoall": (n, 5), "reduce_scatter": (5,)}[name]
        assert host.shape == expect
        assert _is_numba_device(got) and got.shape == expect and got.dtype == np.float64, (name, algorithm)
        assert got.copy_to_host().tobytes() == host.tobytes(), (name, algorithm)


def test_zero_elements_give_empty_device_arrays(comm, gpu_empty_slices):
    """0 elements, every algorithm: an empty numba device array of the
    documented shape (slicing an empty device array raises here, as on a GPU)."""
    n = comm.size
    for name in ALLOCATING:
        expect = (0,) if name == "reduce_scatter" else (n, 0)
        for algorithm in SPECS[name].algorithms:
            got = _call(comm, name, cuda.device_array(0, np.float64), algorithm)
            assert _is_numba_device(got), (name, algorithm, type(got).__name__)
            assert got.shape == expect and got.dtype == np.float64, (name, algorithm, got.shape)


def test_host_sendbuf_gives_numpy_and_in_place_calls_return_the_buffer(comm):
    """A numpy ``sendbuf`` still gives numpy; ``allreduce`` (in place) and
    ``bcast`` return the caller's own device buffer."""
    n = comm.size
    x = np.arange(2 * n, dtype=np.int64)
    for name in ALLOCATING:
        assert type(_call(comm, name, x, "auto")) is np.ndarray, name
    d = cuda.to_device(x)
    assert comm.allreduce(d, algorithm="ring") is d
    assert comm.bcast(d, root=n - 1) is d
    np.testing.assert_array_equal(d.copy_to_host(), x * n)
