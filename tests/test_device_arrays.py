"""CuPy arrays and torch CUDA tensors through every public API, on a real GPU.

Each test runs once per array library (``cupy``, ``torch``) and is skipped
when that library is not importable, finds no CUDA device, or when numba's
CUDA simulator is on (a real device array cannot go through simulated
kernels).  Oracles: ``MPI.Datatype.Pack``/``Unpack`` of the host copy of the
same bytes, mpi4py's ``Sendrecv`` with the MPI datatype, the same halo
exchange on numpy fields, and mpi4py's ``Allreduce`` on host arrays.

    COMMLIB_REAL_GPU=1 python -P -m pytest -q tests/test_device_arrays.py
    COMMLIB_REAL_GPU=1 mpiexec -n 2 python -P -m pytest -q --with-mpi -m mpi tests/test_device_arrays.py

(``tests/run_gpu.sh`` runs both.)
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib import datatypes as dts

LIBS = ["cupy", "torch"]
F64 = np.float64


# ----------------------------------------------------------------- arrays
def _simulator_on() -> bool:
    from numba import config  # noqa: PLC0415

    return bool(config.ENABLE_CUDASIM)


class Lib:
    """The few operations the tests need from one device-array library."""

    def __init__(self, name):
        self.name = name
        if name == "cupy":
            self.mod = pytest.importorskip("cupy")
            try:
                n = self.mod.cuda.runtime.getDeviceCount()
            except Exception as exc:  # noqa: BLE001 - no driver, no device
                pytest.skip(f"CuPy finds no CUDA device ({type(exc).__name__}: {exc})")
            if n < 1:
                pytest.skip("CuPy finds no CUDA device")
        else:
            self.mod = pytest.importorskip("torch")
            if not self.mod.cuda.is_available():
                pytest.skip("torch has no CUDA device (a CPU build or no GPU)")
        if _simulator_on():
            pytest.skip("numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM): real device arrays need the GPU")

    def to_device(self, host: np.ndarray):
        host = np.ascontiguousarray(host)
        if self.name == "cupy":
            return self.mod.asarray(host)
        return self.mod.from_numpy(host.copy()).to("cuda")

    def empty_u8(self, n: int):
        if self.name == "cupy":
            return self.mod.empty(n, dtype=self.mod.uint8)
        return self.mod.empty(n, dtype=self.mod.uint8, device="cuda")

    def is_mine(self, arr) -> bool:
        return type(arr).__module__.split(".")[0] == self.name

    def synchronize(self):
        if self.name == "cupy":
            self.mod.cuda.Device().synchronize()
        else:
            self.mod.cuda.synchronize()


def to_host(arr) -> np.ndarray:
    """A numpy copy of a host or device array of any of the libraries in play."""
    if isinstance(arr, np.ndarray):
        return arr
    if hasattr(arr, "copy_to_host"):  # numba device array
        return arr.copy_to_host()
    mod = type(arr).__module__.split(".")[0]
    if mod == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.asnumpy(arr)
    if mod == "torch":
        return arr.detach().cpu().numpy()
    from numba import cuda  # noqa: PLC0415

    return cuda.as_cuda_array(arr).copy_to_host()


@pytest.fixture(params=LIBS)
def lib(request):
    return Lib(request.param)


# ---------------------------------------------------------------- oracles
def mpi_pack(t, host: np.ndarray, count: int) -> np.ndarray:
    """``MPI_Pack`` of ``count`` elements of ``t`` from the bytes of ``host``."""
    m = t.to_mpi()
    try:
        u8 = host.reshape(-1).view(np.uint8)
        out = np.zeros(count * m.size, np.uint8)
        if out.size:
            pos = m.Pack(u8[:count * m.extent], out, 0, MPI.COMM_SELF)
            assert pos == out.size
        return out
    finally:
        m.Free()


def mpi_unpack(t, packed: np.ndarray, host: np.ndarray, count: int) -> np.ndarray:
    """``MPI_Unpack`` of ``packed`` into a copy of ``host``."""
    res = host.copy()
    m = t.to_mpi()
    try:
        if packed.size:
            m.Unpack(packed, 0, res.reshape(-1).view(np.uint8)[:count * m.extent], MPI.COMM_SELF)
        return res
    finally:
        m.Free()


def host_buffer(t, count, dtype, shape=None, seed=0):
    """Random host array of ``shape`` (or 1-D, long enough for ``count`` elements of ``t``)."""
    rng = np.random.default_rng(seed)
    if shape is None:
        p = dts.plan_for(t, count)
        nbytes = max(p.hi, count * t.extent, 1) + 16
        shape = (-(-nbytes // np.dtype(dtype).itemsize),)
    if np.dtype(dtype).kind == "f":
        return rng.random(shape).astype(dtype)
    return rng.integers(0, 100, size=shape).astype(dtype)


# (name, datatype, count, buffer dtype, buffer shape or None)
CASES = [
    # an x-face of a 3-D array: one contiguous run (this used to raise TypeError on CuPy arrays)
    ("x-face contiguous run", dts.Subarray((6, 7, 8), (3, 7, 8), (2, 0, 0), F64), 1, F64, (6, 7, 8)),
    ("x-face at origin", dts.Subarray((6, 7, 8), (2, 7, 8), (0, 0, 0), F64), 1, F64, (6, 7, 8)),
    ("y-face", dts.Subarray((6, 7, 8), (6, 3, 8), (0, 4, 0), F64), 1, F64, (6, 7, 8)),
    ("z-face", dts.Subarray((6, 7, 8), (6, 7, 3), (0, 0, 5), F64), 1, F64, (6, 7, 8)),
    ("interior box", dts.Subarray((6, 7, 8), (4, 5, 6), (1, 1, 1), F64), 1, F64, (6, 7, 8)),
    ("z-face 64^3 width 3", dts.Subarray((64, 64, 64), (64, 64, 3), (0, 0, 61), F64), 1, F64, (64, 64, 64)),
    ("column block 1024^2 x 5", dts.Subarray((1024, 1024), (1024, 5), (0, 17), F64), 1, F64, (1024, 1024)),
    ("F-order subarray", dts.Subarray((5, 6, 7), (2, 3, 4), (1, 2, 3), np.float32, order="F"), 1, np.float32,
     (7, 6, 5)),
    ("vector x2", dts.Vector(5, 2, 3, F64), 2, F64, None),
    ("column resized x3", dts.Resized(dts.Vector(4, 1, 6, F64), 0, 8), 3, F64, (4, 6)),
    ("indexed int32 x2", dts.Indexed([3, 1, 2], [7, 0, 12], np.int32), 2, np.int32, None),
    ("struct x3", dts.Struct([1, 2, 1], [0, 8, 20], [F64, np.int32, np.uint8]), 3, np.uint8, None),
]


# ------------------------------------------------------------ pack/unpack
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,t,count,dtype,shape", CASES, ids=[c[0] for c in CASES])
def test_pack_unpack_match_mpi(lib, name, t, count, dtype, shape):
    host = host_buffer(t, count, dtype, shape, seed=1)
    ref = mpi_pack(t, host, count)
    d = lib.to_device(host)

    got = dts.pack(d, t, count)
    assert to_host(got).shape == (ref.size,), name
    np.testing.assert_array_equal(to_host(got), ref, err_msg=f"{lib.name} pack {name}")

    out = lib.empty_u8(ref.size + 5)  # a larger out of the caller's own library
    got = dts.pack(d, t, count, out=out)
    lib.synchronize()
    np.testing.assert_array_equal(to_host(out)[:ref.size], ref, err_msg=f"{lib.name} pack out= {name}")
    np.testing.assert_array_equal(to_host(got)[:ref.size], ref, err_msg=f"{lib.name} pack return {name}")
    np.testing.assert_array_equal(to_host(d), host, err_msg="pack changed its source")

    if dts.plan_for(t, count).overlaps():
        return
    target = host_buffer(t, count, dtype, shape, seed=2)
    want = mpi_unpack(t, ref, target, count)
    dt = lib.to_device(target)
    back = dts.unpack(lib.to_device(ref), t, dt, count)
    assert back is dt
    lib.synchronize()
    np.testing.assert_array_equal(to_host(dt).view(np.uint8), want.view(np.uint8),
                                  err_msg=f"{lib.name} unpack {name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,t,count,dtype,shape", CASES[:7] + CASES[8:10], ids=[c[0] for c in CASES[:7] + CASES[8:10]])
def test_packer_matches_mpi(lib, name, t, count, dtype, shape):
    host = host_buffer(t, count, dtype, shape, seed=3)
    ref = mpi_pack(t, host, count)
    d = lib.to_device(host)
    p = dts.Packer(t, d, count)
    assert p.nbytes == ref.size
    np.testing.assert_array_equal(to_host(p.pack()), ref, err_msg=f"{lib.name} Packer.pack {name}")
    # the packer sees later changes of its buffer (it keeps a view, not a copy)
    host2 = host_buffer(t, count, dtype, shape, seed=4)
    d[...] = lib.to_device(host2)
    np.testing.assert_array_equal(to_host(p.pack()), mpi_pack(t, host2, count),
                                  err_msg=f"{lib.name} Packer.pack after update {name}")
    # with a caller's out, and unpack of packed bytes into the buffer
    out = lib.empty_u8(ref.size)
    q = dts.Packer(t, d, count, out=out)
    q.pack()
    lib.synchronize()
    np.testing.assert_array_equal(to_host(out), mpi_pack(t, host2, count), err_msg=f"{lib.name} Packer out= {name}")
    target = host_buffer(t, count, dtype, shape, seed=5)
    dt = lib.to_device(target)
    r = dts.Packer(t, dt, count)
    assert r.unpack(lib.to_device(ref)) is dt
    lib.synchronize()
    np.testing.assert_array_equal(to_host(dt), mpi_unpack(t, ref, target, count),
                                  err_msg=f"{lib.name} Packer.unpack {name}")


@pytest.mark.timeout(120)
def test_pack_result_stays_on_the_device(lib):
    t = dts.Subarray((6, 7, 8), (6, 7, 3), (0, 0, 5), F64)
    got = dts.pack(lib.to_device(host_buffer(t, 1, F64, (6, 7, 8))), t)
    assert not isinstance(got, np.ndarray)
    assert hasattr(got, "__cuda_array_interface__")


# ------------------------------------------------------------ typed p2p
P2P_TYPES = [
    ("z-face", dts.Subarray((6, 7, 8), (6, 7, 3), (0, 0, 5), F64), 1, (6, 7, 8)),
    ("x-face contiguous run", dts.Subarray((6, 7, 8), (2, 7, 8), (4, 0, 0), F64), 1, (6, 7, 8)),
    ("column resized x3", dts.Resized(dts.Vector(4, 1, 6, F64), 0, 8), 3, (4, 6)),
    ("vector", dts.Vector(6, 3, 8, F64), 1, (6, 8)),
]


def _strategy_pairs(comm):
    """(send, receive) strategies: those allowed for device buffers on this MPI,
    and None (the model chooses, through the public Communicator API)."""
    pairs = [("staged", "staged"), ("mapped", "staged"), ("staged", "mapped"), ("mapped", "mapped")]
    if comm.cuda_aware:
        pairs += [("device", "device"), ("device", "staged"), ("staged", "device"), ("mapped", "device")]
    return pairs + [(None, None)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_typed_device_sends_match_mpi(lib):
    from commlib.typed_p2p import typed_irecv, typed_isend  # noqa: PLC0415

    comm = commlib.init()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for send_s, recv_s in _strategy_pairs(comm):
        for name, t, count, shape in P2P_TYPES:
            src = np.arange(np.prod(shape), dtype=F64).reshape(shape) + 1000 * comm.rank
            dst = np.full(shape, -1.0)
            ref = dst.copy()
            d_src, d_dst = lib.to_device(src), lib.to_device(dst)
            if send_s is None:
                r = comm.irecv(d_dst, left, 4, datatype=t, count=count)
                s = comm.isend(d_src, right, 4, datatype=t, count=count)
            else:
                r = typed_irecv(comm, d_dst, left, t, count, 4, strategy=recv_s)
                s = typed_isend(comm, d_src, right, t, count, 4, strategy=send_s)
            s.wait(60)
            r.wait(60)
            lib.synchronize()
            mt = t.to_mpi()
            comm.mpi_comm.Sendrecv([src, count, mt], right, 5, [ref, count, mt], left, 5)
            mt.Free()
            np.testing.assert_array_equal(to_host(d_dst), ref, err_msg=f"{lib.name} {name}: {send_s}->{recv_s}")
            np.testing.assert_array_equal(to_host(d_src), src, err_msg="the send changed its buffer")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_blocking_send_recv_device_arrays(lib):
    """comm.send/comm.recv with datatype= between ranks 0 and 1, device to device
    and device to host."""
    comm = commlib.init()
    t = dts.Subarray((6, 7, 8), (6, 3, 8), (0, 2, 0), F64)
    src = np.arange(6 * 7 * 8, dtype=F64).reshape(6, 7, 8)
    mt = t.to_mpi()
    want = np.full((6, 7, 8), -1.0)
    if comm.rank == 0:
        comm.mpi_comm.Send([src, 1, mt], 1, 8)
    elif comm.rank == 1:
        comm.mpi_comm.Recv([want, 1, mt], 0, 8)
    mt.Free()
    for to_device_recv in (True, False):
        if comm.rank == 0:
            comm.send(lib.to_device(src), 1, 9, datatype=t)
        elif comm.rank == 1:
            buf = lib.to_device(np.full((6, 7, 8), -1.0)) if to_device_recv else np.full((6, 7, 8), -1.0)
            comm.recv(buf, 0, 9, datatype=t)
            lib.synchronize()
            np.testing.assert_array_equal(to_host(buf), want, err_msg=f"{lib.name} device->{'device' if to_device_recv else 'host'}")
        comm.barrier()


# ---------------------------------------------------------------- halo
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("corners", [True, False])
def test_halo_device_fields_match_numpy(lib, corners):
    from commlib.collectives import HaloExchange  # noqa: PLC0415

    comm = commlib.init()
    cart = comm.cart_create(dims=[0, 0, 0], periods=[True, False, True])
    halo = HaloExchange(cart, (6, 5, 4), width=(2, 1, 3), corners=corners)
    try:
        rng = np.random.default_rng(100 + cart.rank)
        for step in range(2):  # the second exchange reuses the plan
            hosts = [rng.random(halo.shape) for _ in range(2)]
            devs = [lib.to_device(h) for h in hosts]
            halo.exchange(*devs)
            halo.exchange(*hosts)
            lib.synchronize()
            for i, (h, d) in enumerate(zip(hosts, devs)):
                np.testing.assert_array_equal(to_host(d), h, err_msg=f"{lib.name} field {i} step {step}")
        # one field, start/wait with interior work in between
        h = rng.random(halo.shape)
        d = lib.to_device(h)
        req = halo.start(d)
        req.wait(60)
        halo.exchange(h)
        lib.synchronize()
        np.testing.assert_array_equal(to_host(d), h, err_msg=f"{lib.name} start/wait")
    finally:
        halo.free()
        cart.free()


# ------------------------------------------------------------ allreduce
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["auto", "ring", "recursive_doubling", "mpi"])
def test_allreduce_device_matches_numpy(lib, algorithm):
    comm = commlib.init()
    for dtype in (np.float32, np.float64, np.int32):
        for n in (7, 1000, 70_000):  # one round, recursive doubling, ring (auto's thresholds)
            rng = np.random.default_rng(7 * comm.rank + n)
            h = rng.integers(-50, 50, size=n).astype(dtype)  # integer values: every order sums exactly
            want = np.empty_like(h)
            comm.mpi_comm.Allreduce(h, want, op=MPI.SUM)
            what = f"{lib.name} {np.dtype(dtype).name} n={n} {algorithm}"

            d, out = lib.to_device(h), lib.to_device(np.zeros_like(h))
            res = comm.allreduce(d, out, algorithm=algorithm)
            lib.synchronize()
            assert res is out, what
            np.testing.assert_array_equal(to_host(out), want, err_msg=what)
            np.testing.assert_array_equal(to_host(d), h, err_msg=f"{what}: sendbuf changed")

            d2 = lib.to_device(h)
            comm.allreduce(d2, algorithm=algorithm)  # in place
            lib.synchronize()
            np.testing.assert_array_equal(to_host(d2), want, err_msg=f"{what} in place")

            hn = comm.allreduce(h.copy(), np.empty_like(h), algorithm=algorithm)  # the same call on numpy
            np.testing.assert_array_equal(hn, to_host(out), err_msg=f"{what}: numpy and device differ")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_allreduce_device_max_and_2d(lib):
    comm = commlib.init()
    h = (np.arange(24, dtype=np.float32).reshape(4, 6) + comm.rank) * (-1) ** comm.rank
    want = np.empty_like(h)
    comm.mpi_comm.Allreduce(h, want, op=MPI.MAX)
    out = lib.to_device(np.zeros_like(h))
    comm.allreduce(lib.to_device(h), out, op="max")
    lib.synchronize()
    np.testing.assert_array_equal(to_host(out), want)


# -------------------------------------------------------------- attention
def test_attention_on_device_arrays(lib):
    """ring and Ulysses attention (1 rank) on the library's device arrays equal
    the numpy run to float64 rounding; outputs stay on the device."""
    pytest.importorskip("cupy")  # attention computes with CuPy on the device
    import commlib as A  # noqa: PLC0415 - the attention calls are top-level

    comm = commlib.init(MPI.COMM_SELF)
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((1, 16, 2, 8)) for _ in range(4))
    for fwd, bwd in ((A.ring_attention, A.ring_attention_backward),
                     (A.ulysses_attention, A.ulysses_attention_backward)):
        want_out, want_lse = fwd(comm, q, k, v, causal=True)
        out, lse = fwd(comm, *(lib.to_device(x) for x in (q, k, v)), causal=True)
        assert not isinstance(out, np.ndarray)
        np.testing.assert_allclose(to_host(out), want_out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(to_host(lse), want_lse, rtol=1e-10, atol=1e-12)
        want = bwd(comm, q, k, v, want_out, want_lse, do, causal=True)
        got = bwd(comm, *(lib.to_device(x) for x in (q, k, v)), out, lse, lib.to_device(do), causal=True)
        for g, w in zip(got, want):
            np.testing.assert_allclose(to_host(g), w, rtol=1e-9, atol=1e-11)


def test_pack_on_library_stream(lib):
    """pack/unpack/Packer issued on the library's own non-default stream give
    MPI_Pack's bytes once that stream is synchronized."""
    from commlib.datatypes import Packer, Subarray, pack, unpack  # noqa: PLC0415

    stream = lib.mod.cuda.Stream(non_blocking=True) if lib.name == "cupy" else lib.mod.cuda.Stream()
    rng = np.random.default_rng(11)
    host = rng.standard_normal((16, 12, 10))
    t = Subarray([16, 12, 10], [16, 12, 3], [0, 0, 7], np.float64)
    ref = mpi_pack(t, host, 1)
    d = lib.to_device(host)
    lib.synchronize()
    got = pack(d, t, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(to_host(got), ref)
    pk = Packer(t, d, stream=stream)
    pk.pack()
    stream.synchronize()
    np.testing.assert_array_equal(to_host(pk.out), ref)
    z = lib.to_device(np.zeros_like(host))
    lib.synchronize()
    unpack(got, t, z, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(to_host(z)[:, :, 7:], host[:, :, 7:])
