"""Device arrays that only export ``__cuda_array_interface__``, and malformed ones.

A GPU user porting CuPy/numba code passes small wrapper objects that carry
nothing but the CUDA Array Interface (v3).  In numba's CUDA simulator device
memory is host memory, so a wrapper over a numpy array's address stands for
such an object.  Oracles: the numpy array behind the wrapper (the same bytes),
the same call on host numpy arrays, and numpy's own values.

    NUMBA_ENABLE_CUDASIM=1 python -P -m pytest -q tests/test_device_misuse.py
    mpiexec -n 3 python -P -m pytest -q --with-mpi -m mpi tests/test_device_misuse.py
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")
pytestmark = pytest.mark.timeout(120)

import commlib  # noqa: E402
from commlib.core.buffer import as_buffer  # noqa: E402
from commlib.core.errors import BufferError, InvalidArgument  # noqa: E402


def _simulator_on() -> bool:
    from numba import config  # noqa: PLC0415

    return bool(config.ENABLE_CUDASIM)


needs_sim = pytest.mark.skipif(not _simulator_on(), reason="the wrapper's address is host memory: simulator only")


class CAIOnly:
    """Exports only ``__cuda_array_interface__`` (over a numpy array's memory)."""

    def __init__(self, arr, readonly=False, **extra):
        self.arr, self.readonly, self.extra = arr, readonly, extra

    @property
    def __cuda_array_interface__(self):
        a = self.arr
        cai = {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, self.readonly),
               "strides": None if a.flags.c_contiguous else a.strides, "version": 3}
        cai.update(self.extra)
        return cai


DTYPES = [np.float16, np.bool_, np.complex64, np.int8, np.float64]


@needs_sim
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3)], ids=["0d", "empty", "1d", "2d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cai_only_to_host_from_host(dtype, shape):
    """to_host copies, from_host writes, the exact bytes of the memory behind the interface."""
    rng = np.random.default_rng(7)
    src = (rng.integers(0, 2, shape) if dtype is np.bool_ else rng.normal(size=shape)).astype(dtype)
    b = as_buffer(CAIOnly(src))
    assert b.is_device and b.shape == src.shape and b.dtype == src.dtype
    got = b.to_host()
    assert got.tobytes() == src.tobytes() and got.shape == src.shape
    out = np.empty(shape, dtype)
    assert b.to_host(out) is out and out.tobytes() == src.tobytes()
    new = (rng.integers(0, 2, shape) if dtype is np.bool_ else rng.normal(size=shape)).astype(dtype)
    b.from_host(new)
    assert src.tobytes() == new.tobytes()


@pytest.mark.parametrize("extra,words", [
    ({"mask": object()}, "mask"),
    ({"shape": (-1, 4)}, "negative"),
    ({"strides": (8,)}, "strides"),
    ({"data": (0, False)}, "null"),
    ({"data": (None, False)}, "null"),
], ids=["mask", "negative-shape", "strides-length", "null-pointer", "none-pointer"])
def test_malformed_cai_refused(extra, words):
    """A malformed interface is a BufferError naming the problem, never a
    buffer whose size or layout is made up."""
    with pytest.raises(BufferError, match=words):
        as_buffer(CAIOnly(np.zeros((3, 4)), **extra), op="probe")


class _GradTensorLike:
    """Exports ``__cuda_array_interface__`` as a torch CUDA tensor that requires grad
    does: the property raises RuntimeError (which ``hasattr`` does not catch)."""

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad. "
                           "If gradients aren't required, use var.detach() to get Variable that doesn't require grad.")


def test_tensor_that_requires_grad_refused_with_the_fix_named():
    with pytest.raises(BufferError, match=r"rank 3: allreduce: .*tensor\.detach\(\)"):
        as_buffer(_GradTensorLike(), op="allreduce", rank=3)
    from commlib.core.buffer import is_device_array

    assert is_device_array(_GradTensorLike())


def test_empty_cai_with_null_pointer_accepted():
    """A zero-size array may carry a null address (CuPy and numba do)."""
    b = as_buffer(CAIOnly(np.zeros((0, 4)), data=(0, False)))
    assert b.nbytes == 0 and b.shape == (0, 4)


# ------------------------------------------------------------- under MPI
@pytest.fixture(scope="module")
def comm():
    return commlib.init()


@needs_sim
@pytest.mark.mpi(min_size=2)
def test_sendrecv_cai_only_matches_host(comm):
    """A ring sendrecv of CAI-only wrappers delivers what the host sendrecv does;
    afterwards no receive is left posted (the next message goes where it is meant)."""
    r, n = comm.rank, comm.size
    dest, src = (r + 1) % n, (r - 1) % n
    payload = np.arange(6, dtype=np.float32) + 10 * r
    host_out = np.zeros(6, np.float32)
    comm.sendrecv(payload.copy(), dest, host_out, src, sendtag=5, recvtag=5)
    mem = np.zeros(6, np.float32)
    comm.sendrecv(CAIOnly(payload.copy()), dest, CAIOnly(mem), src)  # recvtag ANY_TAG
    np.testing.assert_array_equal(mem, host_out)
    np.testing.assert_array_equal(mem, np.arange(6, dtype=np.float32) + 10 * src)
    follow = np.zeros(2, np.int64)
    comm.sendrecv(np.array([r, 99]), dest, follow, src, sendtag=6, recvtag=6)
    assert follow.tolist() == [src, 99]


@needs_sim
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,op", [(np.float16, "sum"), (np.int8, "max"), (np.bool_, "bor")],
                         ids=["float16-sum", "int8-max", "bool-bor"])
def test_allreduce_cai_only_and_mixed_recv(comm, dtype, op):
    """allreduce with a CAI-only sendbuf into a host recvbuf, and a host sendbuf
    into a CAI-only recvbuf, equals the all-host call."""
    r = comm.rank
    x = ((np.arange(7) + r) % 3).astype(dtype)
    ref = comm.allreduce(x.copy(), np.zeros_like(x), op=op)
    host_recv = np.zeros_like(x)
    comm.allreduce(CAIOnly(x.copy()), host_recv, op=op)
    dev_recv = np.zeros_like(x)
    comm.allreduce(x.copy(), CAIOnly(dev_recv), op=op)
    assert host_recv.tobytes() == ref.tobytes() == dev_recv.tobytes()


@pytest.mark.mpi(min_size=2)
def test_masked_cai_on_one_rank_refused_everywhere(comm):
    """One rank passes a masked interface: every rank raises InvalidArgument
    (no rank waits), and the other ranks' buffers are untouched."""
    x = np.arange(4, dtype=np.float64) + comm.rank
    keep = x.copy()
    buf = CAIOnly(x, mask=object()) if comm.rank == 1 else x
    with pytest.raises(InvalidArgument, match="rank"):
        comm.allreduce(buf)
    np.testing.assert_array_equal(x, keep)


@needs_sim
@pytest.mark.mpi(min_size=2)
def test_forder_device_buffers_match_host(comm):
    """allgather into an F-ordered device recvbuf, and allreduce of an F-ordered
    device sendbuf into an F-ordered host recvbuf, equal the all-host calls
    (blocks laid out in memory order, as the docstrings say)."""
    from numba import cuda  # noqa: PLC0415

    r, n = comm.rank, comm.size
    src = np.arange(4, dtype=np.float64).reshape(2, 2) + 10 * r
    host_recv = np.asfortranarray(np.zeros((2, 2 * n)))
    comm.allgather(src, host_recv)
    dev_recv = cuda.to_device(np.asfortranarray(np.zeros((2, 2 * n))))
    comm.allgather(cuda.to_device(src), dev_recv)
    x = np.asfortranarray(np.arange(6.0).reshape(2, 3) * (r + 1))
    ref = np.asfortranarray(np.zeros((2, 3)))
    comm.allreduce(x.copy(order="F"), ref)
    mixed = np.asfortranarray(np.zeros((2, 3)))
    comm.allreduce(cuda.to_device(x), mixed)
    np.testing.assert_array_equal(ref, sum(np.arange(6.0).reshape(2, 3) * (i + 1) for i in range(n)))
    np.testing.assert_array_equal(dev_recv.copy_to_host(), host_recv)
    np.testing.assert_array_equal(mixed, ref)
