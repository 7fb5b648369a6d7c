"""Communicator point-to-point, Cartesian topology and buffers, against mpi4py."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import commlib
from commlib.core.buffer import as_buffer
from commlib.core.errors import BufferError, InvalidArgument


# ------------------------------------------------------------------ serial
def test_buffer_numpy_views():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = as_buffer(a)
    assert (b.kind, b.is_device, b.nbytes, b.contiguous) == ("numpy", False, 48, True)
    assert np.shares_memory(b.byte_view(), a)
    f = as_buffer(np.asfortranarray(a))
    assert f.f_contiguous and not f.contiguous and f.dense
    s = as_buffer(a[:, ::2])
    assert not s.dense
    with pytest.raises(BufferError):
        s.byte_view()


def test_buffer_dlpack_and_buffer_protocol():
    class Exporter:  # a foreign host array reachable only through DLPack
        def __init__(self, arr):
            self._a = arr

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    a = np.arange(5.0)
    b = as_buffer(Exporter(a))
    assert b.kind == "dlpack" and not b.is_device and b.nbytes == 40
    assert np.shares_memory(b.array(), a)
    m = as_buffer(bytearray(b"abcd"))
    assert m.nbytes == 4 and m.dtype == np.uint8
    with pytest.raises(BufferError, match="unsupported buffer type"):
        as_buffer(object())


def test_buffer_simulator_device_array():
    from numba import cuda

    d = cuda.to_device(np.arange(6, dtype=np.int64).reshape(2, 3))
    b = as_buffer(d)
    assert b.is_device and b.kind in ("numba-sim", "numba") and b.shape == (2, 3) and b.nbytes == 48
    assert np.array_equal(b.to_host(), np.arange(6).reshape(2, 3))
    b.from_host(np.full((2, 3), 7, np.int64))
    assert (d.copy_to_host() == 7).all()


def test_init_rejects_unknown_option():
    with pytest.raises(InvalidArgument, match="unknown option"):
        commlib.init(fast=True)


def test_cart_create_bad_dims():
    comm = commlib.init(MPI.COMM_SELF)
    with pytest.raises(InvalidArgument, match="cart_create"):
        comm.cart_create(dims=[2, 1])
    with pytest.raises(InvalidArgument, match="periods"):
        comm.cart_create(dims=[1, 1], periods=[True])


# ---------------------------------------------------------------------- MPI
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64])
def test_sendrecv_ring_host(dtype):
    comm = commlib.init()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    send = (np.arange(17) + 100 * comm.rank).astype(dtype)
    recv = np.empty_like(send)
    comm.sendrecv(send, right, recv, left, sendtag=5, recvtag=5)
    assert np.array_equal(recv, (np.arange(17) + 100 * left).astype(dtype))
    r = comm.irecv(recv, left, tag=6)
    s = comm.isend(send * 2, right, tag=6)
    comm.waitall([r, s], timeout=30)
    assert np.array_equal(recv, ((np.arange(17) + 100 * left) * 2).astype(dtype))
    assert r.test() and s.test()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_blocking_send_recv_and_status():
    comm = commlib.init()
    if comm.rank == 0:
        for peer in range(1, comm.size):
            comm.send(np.full(4, peer, np.int64), peer, tag=9)
    else:
        buf = np.empty(4, np.int64)
        st = comm.recv(buf, 0, 9)
        assert (buf == comm.rank).all() and st.Get_source() == 0 and st.Get_count(MPI.BYTE) == 32


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_device_buffers_staged():
    """numba device arrays (the CUDA simulator here) travel through host staging."""
    from numba import cuda

    comm = commlib.init()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    d_send = cuda.to_device(np.arange(8.0) + comm.rank)
    d_recv = cuda.device_array(8)
    r = comm.irecv(d_recv, left, 1)
    s = comm.isend(d_send, right, 1)
    r.wait(30)
    s.wait(30)
    assert np.array_equal(d_recv.copy_to_host(), np.arange(8.0) + left)
    h = np.empty(8)
    comm.sendrecv(d_send, right, h, left, 2, 2)  # device to host across ranks
    assert np.array_equal(h, np.arange(8.0) + left)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_arguments_raise_before_sending():
    comm = commlib.init()
    with pytest.raises(InvalidArgument, match=f"rank {comm.rank}: isend: dest {comm.size} out of range"):
        comm.isend(np.zeros(2), comm.size)
    with pytest.raises(BufferError, match="not contiguous"):
        comm.send(np.zeros((4, 4))[:, 1], 0)
    with pytest.raises(InvalidArgument, match="negative"):
        comm.send(np.zeros(2), 0, tag=-3)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_cart_create_matches_mpi():
    comm = commlib.init()
    cart = comm.cart_create(ndims=3, periods=[True, False, True])
    assert list(cart.dims) == list(MPI.Compute_dims(comm.size, 3))
    ref = comm.mpi_comm.Create_cart(cart.dims, cart.periods)
    assert tuple(ref.Get_coords(ref.Get_rank())) == cart.coords
    for d in range(3):
        assert cart.shift(d, 1) == ref.Shift(d, 1)
        off = [0, 0, 0]
        off[d] = 1
        assert cart.neighbor(off) == ref.Shift(d, 1)[1]
    # a corner neighbour, wrapped only on periodic dimensions
    off = (1, -1, 1)
    want = [c + o for c, o in zip(cart.coords, off)]
    inside = 0 <= want[1] < cart.dims[1]
    expect = ref.Get_cart_rank([want[0] % cart.dims[0], want[1], want[2] % cart.dims[2]]) if inside else MPI.PROC_NULL
    assert cart.neighbor(off) == expect
    ref.Free()
    cart.free()


# ------------------------------------------------- node peers after a shrink
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.data())
def test_shrunk_node_peers_match_the_survivors_nodes(nodes, data):
    """Rank r of the old group sits on node nodes[r]; after a shrink that keeps
    the old ranks ``kept`` (in order), the new rank i is r's node peer exactly
    when nodes[kept[i]] == nodes[r]."""
    from commlib.transports.mpi import shrunk_node_peers  # noqa: PLC0415

    n = len(nodes)
    me = data.draw(st.integers(0, n - 1))
    others = data.draw(st.lists(st.sampled_from([r for r in range(n) if r != me]), unique=True)) if n > 1 else []
    kept = sorted(set(others) | {me})
    before = frozenset(r for r in range(n) if nodes[r] == nodes[me])
    after = shrunk_node_peers(before, kept)
    assert after == frozenset(i for i, r in enumerate(kept) if nodes[r] == nodes[me])
    assert kept.index(me) in after


class _NoSplitComm:
    """A real communicator whose ``Shrink`` is a ``Dup`` (the same members) and
    whose ``Split_type`` fails: the recovery path must not call it."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Shrink(self):  # noqa: N802 (mpi4py's name)
        return _NoSplitComm(self._comm.Dup())

    def Split_type(self, *args, **kwargs):  # noqa: N802
        raise AssertionError("MPI_Comm_split_type in the recovery path")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_shrink_builds_no_communicator_to_learn_node_peers():
    """MPITransport.shrink runs no MPI_Comm_split_type: the node peers of the
    shrunk group come from the old group's. (Under Open MPI 5.0 with ULFM a rank
    that dies while a communicator is being built can crash the survivors, so
    recovery builds as few communicators as it can.)"""
    from commlib.transports.mpi import MPITransport  # noqa: PLC0415

    base = MPI.COMM_WORLD.Dup()
    tp = MPITransport(base)  # learns its node peers with Split_type, once
    wrapped = MPITransport(_NoSplitComm(base), node_peers=tp.node_peers)
    new, kept = wrapped.shrink()
    try:
        assert kept == list(range(base.Get_size()))
        assert new.node_peers == tp.node_peers and new.rank in new.node_peers
    finally:
        new.comm._comm.Free()
        base.Free()


# ------------------------------------- cart_create: the ranks agree first (D3)
def _outcome(fn):
    """``("ok", result)`` or ``(error class name, message)`` of ``fn()``."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test looks at what every rank got
        return (type(exc).__name__, str(exc))


def _cart_refused_everywhere(comm, mine, match_offender=None, match_others=None):
    """Every rank calls ``comm.cart_create(**mine)``: each must raise
    InvalidArgument (none may return, hang or raise another class), within a few
    seconds, and the communicator must work afterwards."""
    import time  # noqa: PLC0415

    t0 = time.perf_counter()
    got = _outcome(lambda: comm.cart_create(**mine))
    took = time.perf_counter() - t0
    everyone = comm.mpi_comm.allgather((got[0], got[1] if got[0] != "ok" else repr(got[1])))
    assert [g[0] for g in everyone] == ["InvalidArgument"] * comm.size, everyone
    msg = got[1]
    assert msg.startswith(f"rank {comm.rank}: cart_create"), msg
    if match_offender is not None and comm.rank == comm.size - 1:
        assert match_offender in msg, msg
    if match_others is not None and comm.rank != comm.size - 1:
        assert match_others in msg, msg
    assert took < 20, took
    # still usable: a point-to-point ring and a good Cartesian communicator
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    h = np.empty(1)
    comm.sendrecv(np.array([float(comm.rank)]), right, h, left)
    assert h[0] == left
    cart = comm.cart_create(dims=[comm.size], periods=True)
    assert cart.dims == (comm.size,) and cart.periods == (True,)
    cart.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_cart_create_mismatched_dims_on_one_rank_fails_everywhere():
    """The last rank asks for a (size, 1) grid, the others for (size,): every rank
    raises InvalidArgument naming what differs, before MPI_Cart_create (the old
    code returned grids of different shapes, silently)."""
    comm = commlib.init()
    n, last = comm.size, comm.rank == comm.size - 1
    _cart_refused_everywhere(comm, dict(dims=[n, 1] if last else [n], periods=False), "ndims differs",
                             "ndims differs")
    _cart_refused_everywhere(comm, dict(dims=[n], periods=[last]), "periods differs", "periods differs")
    _cart_refused_everywhere(comm, dict(dims=[n], reorder=last), "reorder differs", "reorder differs")
    if n > 1:  # the same product, another split
        a = dict(dims=[1, n]) if last else dict(dims=[n, 1])
        _cart_refused_everywhere(comm, a, "dims[0] differs", "dims[0] differs")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["too_many", "nan", "float", "negative", "bool", "periods_len", "periods_str",
                                 "reorder"])
def test_cart_create_bad_argument_on_one_rank_fails_everywhere(bad):
    """One rank (the last) passes an invalid argument: it raises its own
    InvalidArgument, every other rank one naming it, and nobody waits in
    MPI_Cart_create (the old code left them there forever, or raised a raw
    ValueError for a NaN)."""
    comm = commlib.init()
    n = comm.size
    args = {
        "too_many": dict(dims=[n + 1]),
        "nan": dict(dims=[float("nan")]),
        "float": dict(dims=[float(n)]),
        "negative": dict(dims=[-n]),
        "bool": dict(dims=[True, n]),
        "periods_len": dict(dims=[n], periods=[True, False]),
        "periods_str": dict(dims=[n], periods="yes"),
        "reorder": dict(dims=[n], reorder="no"),
    }[bad]
    mine = args if comm.rank == n - 1 else dict(dims=[n])
    _cart_refused_everywhere(comm, mine, f"rank {n - 1}: cart_create", f"rank(s) [{n - 1}] passed invalid")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", ["same", "differ", "local_error"])
def test_agree_arguments(case):
    """``Communicator.agree_arguments``: equal values pass on every rank; a value
    that differs on the last rank raises InvalidArgument on every rank naming
    the field and both values; a local error on the last rank is raised there
    and named by every other rank; the communicator works afterwards."""
    comm = commlib.init()
    r, last = comm.rank, comm.size - 1
    values = [3, 7, 11]
    own = None
    if r == last and case == "differ":
        values = [3, 8, 11]
    if r == last and case == "local_error":
        own = InvalidArgument("my grid is empty", rank=r, op="setup")
    try:
        comm.agree_arguments(values, ("nx", "ny", "steps"), op="setup", local_error=own)
        got = ("ok", "")
    except InvalidArgument as exc:
        got = ("InvalidArgument", str(exc))
    everyone = MPI.COMM_WORLD.allgather(got)
    if case == "same" or comm.size == 1 and case == "differ":
        assert [g[0] for g in everyone] == ["ok"] * comm.size, everyone
    else:
        assert [g[0] for g in everyone] == ["InvalidArgument"] * comm.size, everyone
        assert got[1].startswith(f"rank {r}: setup"), got
        if case == "differ":
            assert "ny differs across ranks" in got[1] and "7 and 8" in got[1], got
        elif r == last:
            assert "my grid is empty" in got[1], got
        else:
            assert f"[{last}]" in got[1], got
    with pytest.raises(InvalidArgument, match="3 values but 2 names"):
        comm.agree_arguments(values, ("nx", "ny"), op="setup")
    assert np.array_equal(comm.allreduce(np.ones(3)), np.full(3, comm.size))
