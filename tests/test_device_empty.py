"""Zero elements on the device: every public path, with the simulator made to raise as a GPU does.

On a GPU, numba-cuda raises ``RuntimeError: non-empty slice into empty slice``
on a slice of a 0-element device array (its allocation is NULL); the CUDA
simulator does not, so each test here takes ``gpu_empty_slices``
(tests/conftest.py), which makes it.  A 0-element call that is valid must
complete on every rank with the empty result and leave the group in step
(checked by a real call after it, against the host path); one that is not
must raise commlib's own error (``InvalidArgument``, ``DatatypeError``) on
every rank, never numba's.  Oracles: the host (numpy) path of the same call,
and numpy itself for the pack tests.

    NUMBA_ENABLE_CUDASIM=1 python -P -m pytest -q tests/test_device_empty.py
    NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2 python -P -m pytest --with-mpi -q tests/test_device_empty.py
"""
from __future__ import annotations

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")
cuda = pytest.importorskip("numba.cuda")

import commlib  # noqa: E402
from commlib import datatypes as dts  # noqa: E402
from commlib.collectives import _device_reduce as dr  # noqa: E402
from commlib.collectives import ops  # noqa: E402
from commlib.collectives.specs import SPECS  # noqa: E402
from commlib.core.errors import BufferError, DatatypeError, InvalidArgument  # noqa: E402
from commlib.datatypes.batch import BatchPack  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not cuda.is_available(), reason="no GPU and the CUDA simulator is not enabled"),
]

F64 = np.float64
VEC = dts.Vector(2, 1, 2, F64)        # 16 bytes of a 24-byte span
EMPTY_T = dts.Contiguous(0, F64)      # a datatype of size 0


def E(*shape, dtype=F64):
    """A 0-element (or ``shape``) device array."""
    return cuda.device_array(shape or (0,), dtype)


def _host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


@pytest.fixture(scope="module", params=[False, True], ids=["staged", "cuda-aware"])
def comm(request):
    """The default staged communicator, and one that hands device memory to
    MPI (under the simulator, device memory is host memory, so MPI reads it)."""
    return commlib.init(cuda_aware=request.param)


def _in_step(comm):
    """A real ring allreduce after the empty calls equals the host path's."""
    x = np.arange(5, dtype=F64) * (comm.rank + 1)
    d = cuda.to_device(x)
    comm.allreduce(d, op="avg", algorithm="ring")
    h = x.copy()
    comm.allreduce(h, op="avg", algorithm="ring")
    assert _host(d).tobytes() == h.tobytes()


# --------------------------------------------------------------- device ring
@pytest.mark.mpi(min_size=1)
def test_device_ring_of_zero_elements(comm, gpu_empty_slices):
    """The device ring itself (the layer that slices) takes 0 elements: staged
    and not, in place and from a separate source, every op step (``avg``
    divides): nothing moves, nothing is sliced."""
    tp = comm.transport
    for staged in (True, False):
        for name in ("sum", "avg"):
            op = ops.get_op(name)
            for src in (None, E()):
                entry = dr.StagingCache().get("ring", "numba", 0, F64) if staged else None
                work = E()
                dr.allreduce_ring_device(tp, work, op, kind="numba", src=src, entry=entry)
                dr.reduce_scatter_ring_device(tp, work, op, [0] * (tp.size + 1), kind="numba", src=src,
                                              entry=entry)
                assert work.size == 0
    _in_step(comm)


# ---------------------------------------------------------------- collectives
def _algorithms(name):
    return SPECS[name].algorithms


@pytest.mark.mpi(min_size=1)
def test_zero_element_collectives_every_algorithm(comm, gpu_empty_slices):
    """Every algorithm name of every data collective, 0 elements on every rank
    (1-D and 2-D empty shapes), ``recvbuf`` given and not: each returns the
    empty result, ``recvbuf`` itself when given."""
    n = comm.size
    for algo in _algorithms("allreduce"):
        for shape in ((0,), (0, 3)):
            d = E(*shape)
            assert comm.allreduce(d, op="avg", algorithm=algo) is d
            out = E(*shape)
            assert comm.allreduce(E(*shape), out, op="max", algorithm=algo) is out
    for algo in _algorithms("reduce_scatter"):
        assert _host(comm.reduce_scatter(E(), op="avg", algorithm=algo)).size == 0
        out = E()
        assert comm.reduce_scatter(E(), out, algorithm=algo) is out
    for algo in _algorithms("allgather"):
        assert _host(comm.allgather(E(), algorithm=algo)).size == 0
        for rshape in ((n, 0), (0,)):
            out = E(*rshape)
            assert comm.allgather(E(), out, algorithm=algo) is out
    for algo in _algorithms("bcast"):
        for shape in ((0,), (3, 0)):
            d = E(*shape)
            assert comm.bcast(d, root=n - 1, algorithm=algo) is d
    for algo in _algorithms("alltoall"):
        assert _host(comm.alltoall(E(), algorithm=algo)).size == 0
        out = E(n, 0)
        assert comm.alltoall(E(n, 0), out, algorithm=algo) is out
    # the non-blocking forms (a worker thread where MPI allows it)
    for req in (comm.iallreduce(E()), comm.ireduce_scatter(E(), E()), comm.iallgather(E(), E()),
                comm.ibcast(E()), comm.ialltoall(E(), E())):
        req.wait()
    _in_step(comm)


@pytest.mark.mpi(min_size=2)
def test_zero_elements_on_one_rank_only_is_invalid_everywhere(comm, gpu_empty_slices):
    """0 elements on rank 0, 3 elsewhere (or an empty ``recvbuf`` for a
    non-empty ``sendbuf``): InvalidArgument on every rank, before any byte
    moves, never numba's slice error; the group stays in step."""
    def mine():
        return E() if comm.rank == 0 else cuda.to_device(np.ones(3))

    calls = [lambda a=a: comm.allreduce(mine(), op="avg", algorithm=a) for a in _algorithms("allreduce")]
    calls += [lambda a=a: comm.allreduce(cuda.to_device(np.ones(3)), E(), algorithm=a)
              for a in _algorithms("allreduce")]
    calls += [lambda a=a: comm.allgather(mine(), algorithm=a) for a in _algorithms("allgather")]
    calls += [lambda a=a: comm.bcast(mine(), algorithm=a) for a in _algorithms("bcast")]
    calls += [lambda a=a: comm.reduce_scatter(cuda.to_device(np.ones(2 * comm.size)), E(), algorithm=a)
              for a in _algorithms("reduce_scatter")]
    calls += [lambda a=a: comm.alltoall(E(), cuda.to_device(np.ones(2 * comm.size)), algorithm=a)
              for a in _algorithms("alltoall")]
    for call in calls:
        with pytest.raises(InvalidArgument):
            call()
    _in_step(comm)


# ------------------------------------------------------------ point to point
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("strategy", ["device", "staged", "mapped", "mpi"])
def test_typed_p2p_zero_elements(comm, strategy, gpu_empty_slices, monkeypatch):
    """Typed isend/irecv, sendrecv and send/recv of 0 elements (count 0, and a
    datatype of size 0) from and into device buffers, empty and not, under
    each strategy: every call completes and writes nothing."""
    if strategy in ("mpi", "device") and not comm.cuda_aware:
        pytest.skip(f"strategy {strategy!r} needs CUDA-aware MPI for device buffers")
    monkeypatch.setenv("COMMLIB_DATATYPE_STRATEGY", strategy)
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    keep = np.arange(4, dtype=F64) + 10 * r
    changed = []  # checked after every call, so a failure leaves no rank waiting
    for t, count in ((VEC, 0), (EMPTY_T, 3)):
        for buf in (E(), cuda.to_device(keep)):
            rq = comm.irecv(buf, left, tag=5, datatype=t, count=count)
            sq = comm.isend(E(), right, tag=5, datatype=t, count=count)
            comm.waitall([rq, sq])
            comm.sendrecv(E(), right, buf, left, sendtag=6, recvtag=6, sendtype=t, sendcount=count,
                          recvtype=t, recvcount=count)
            comm.sendrecv(E(), right, buf, left, sendtag=7, recvtag=7, sendtype=t, sendcount=count)
            if n > 1 and r < 2:
                if r == 0:
                    comm.send(E(), 1, tag=8, datatype=t, count=count)
                else:
                    comm.recv(buf, 0, tag=8, datatype=t, count=count)
            if buf.size and _host(buf).tobytes() != keep.tobytes():
                changed.append((t, count, _host(buf).tolist()))
    comm.mpi_comm.Barrier()
    assert not changed, f"rank {r}: a 0-element receive wrote the buffer: {changed}"


# ------------------------------------------------------------------ packing
def test_pack_zero_elements_device(gpu_empty_slices):
    """pack/unpack/Packer/BatchPack with count 0, or a datatype of size 0, on
    empty and non-empty device buffers, ``out`` given (empty or larger) and
    not: an empty device result, nothing written; a count that does not fit
    an empty buffer is commlib's DatatypeError, and host buffers batched into
    an empty device array commlib's BufferError."""
    full = np.arange(4, dtype=F64)
    bufs = (E(), E(0, 3), cuda.to_device(full))
    for buf in bufs:
        for t, count in ((VEC, 0), (EMPTY_T, 5), (F64, 0)):
            for out in (None, E(dtype=np.uint8), cuda.device_array(8, np.uint8)):
                got = dts.pack(buf, t, count, out=out)
                assert hasattr(got, "copy_to_host") and got.shape == (0,)
            dts.unpack(E(dtype=np.uint8), t, buf, count)
            dts.unpack(cuda.device_array(8, np.uint8), t, buf, count)
            for out in (None, E(dtype=np.uint8)):
                p = dts.Packer(t, buf, count, out=out)
                assert p.pack().shape == (0,) and p.nbytes == 0
                p.unpack()
                p.unpack(E(dtype=np.uint8))
        if buf.size:
            assert _host(buf).tobytes() == full.tobytes()
    with pytest.raises(DatatypeError):
        dts.pack(E(), VEC, 1)
    with pytest.raises(DatatypeError):
        dts.unpack(E(dtype=np.uint8), VEC, cuda.to_device(full), 1)
    b = BatchPack([(0, EMPTY_T), (1, EMPTY_T)])
    b.pack((E(), E()), E(dtype=np.uint8))
    b.unpack(E(dtype=np.uint8), (E(), E()))
    # host buffers with an empty device out/packed (a mix-up): commlib's BufferError
    with pytest.raises(BufferError, match="host buffer"):
        b.pack((np.zeros(4), np.zeros(4)), E(dtype=np.uint8))
    with pytest.raises(BufferError, match="host buffer"):
        b.unpack(E(dtype=np.uint8), (np.zeros(4), np.zeros(4)))


# ------------------------------------------------------------ halo and heat
@pytest.mark.mpi(min_size=1)
def test_halo_device_zero_width(comm, gpu_empty_slices):
    """A device halo exchange with no ghost cells along a dimension (or any):
    the ghosts equal the host exchange's; a local block with no cells is
    refused on every rank."""
    from commlib.collectives.halo import HaloExchange  # noqa: PLC0415

    cart = comm.cart_create([comm.size, 1], periods=[True, False])
    try:
        for width in ((0, 0), (1, 0), (0, 1)):
            h = HaloExchange(cart, (2, 1), width=width)
            host = np.arange(np.prod(h.shape), dtype=F64).reshape(h.shape) + 100 * cart.rank
            dev = cuda.to_device(host)
            h.exchange(host)
            h.exchange(dev)
            assert _host(dev).tobytes() == host.tobytes()
            h.free()
        with pytest.raises(InvalidArgument, match="empty dimension"):
            HaloExchange(cart, (0, 1), width=0)
    finally:
        cart.free()


@pytest.mark.mpi(min_size=1)
def test_heat_cuda_backend_one_cell_per_rank(comm, gpu_empty_slices):
    """The heat solver's device backend on the smallest grid a rank count
    allows (one cell per rank) equals the numpy backend's field."""
    from commlib.apps import heat  # noqa: PLC0415

    grid = tuple(commlib.compute_dims(comm.size, 2))  # the solver's own 2-D split: one cell per rank
    _, dev = heat.solve(comm, grid, steps=2, backend="cuda")
    _, ref = heat.solve(comm, grid, steps=2, backend="numpy")
    np.testing.assert_allclose(_host(dev), ref, rtol=1e-12, atol=0)
