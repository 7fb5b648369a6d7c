"""The typed point-to-point plan cache (commlib.typed_p2p._host_plan) never
serves a stale plan.

Each exchange goes through the cached path (isend + recv, irecv + send,
sendrecv) and is checked bit for bit against mpi4py's own Sendrecv with the
same MPI datatype; each refused call is refused after a plan for a nearly
identical call was cached.  Ring neighbours, so it runs at any size (at 1 rank
a rank sends to itself)."""
import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib import datatypes as dts
from commlib import typed_p2p
from commlib.core.config import config
from commlib.core.errors import BufferError, CommError, DatatypeError, InvalidArgument
from commlib.datatypes import strategy as strategy_mod

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.timeout(120)]


def _ring(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


def _oracle(comm, src, dst_like, mt, count):
    """What mpi4py's own Sendrecv with ``mt`` leaves in a copy of ``dst_like``."""
    right, left = _ring(comm)
    ref = dst_like.copy()
    comm.mpi_comm.Sendrecv([src, count, mt], right, 77, [ref, count, mt], left, 77)
    return ref


def _exchange(comm, mode, src, dst, dt, count, strategy=None, tag=5):
    """One typed exchange around the ring, through the path under test."""
    right, left = _ring(comm)
    if mode == "recv":  # blocking receive (the direct path), send posted first
        req = typed_p2p.typed_isend(comm, src, right, dt, count, tag, strategy=strategy)
        typed_p2p.typed_recv(comm, dst, left, dt, count, tag, strategy=strategy)
        req.wait(60)
    elif mode == "send":  # blocking send (the direct path), receive posted first
        req = typed_p2p.typed_irecv(comm, dst, left, dt, count, tag, strategy=strategy)
        typed_p2p.typed_send(comm, src, right, dt, count, tag, strategy=strategy)
        req.wait(60)
    elif mode == "comm":  # the Communicator's own methods (a repeated send: typed_p2p.fast_p2p)
        req = comm.irecv(dst, left, tag, datatype=dt, count=count)
        comm.send(src, right, tag, datatype=dt, count=count)
        req.wait(60)
    elif mode == "comm-recv":  # the Communicator's blocking receive (a repeated one: typed_p2p.fast_p2p)
        req = comm.isend(src, right, tag, datatype=dt, count=count)
        comm.recv(dst, left, tag, datatype=dt, count=count)
        req.wait(60)
    else:
        typed_p2p.typed_sendrecv(comm, src, right, dst, left, tag, tag, sendtype=dt, sendcount=count,
                                 recvtype=dt, recvcount=count, strategy=strategy)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


MODES = ["recv", "send", "comm", "comm-recv", "sendrecv"]


@pytest.mark.parametrize("mode", MODES)
def test_mpi_type_freed_and_recreated_at_same_handle(mode):
    """An MPI datatype freed and a different one created (MPI reuses handle
    values: the test looks for a reuse) must be decoded anew, not served the
    freed type's plan."""
    comm = commlib.init()
    layouts = [(3, 1, 2), (2, 2, 3), (4, 1, 3), (3, 2, 4)]
    handles = []
    for k, (n, bl, st) in enumerate(layouts * 2):
        mt = MPI.DOUBLE.Create_vector(n, bl, st).Commit()
        handles.append(mt.handle)
        src = np.arange(16.0) + 100 * comm.rank + 1000 * k
        for _ in range(2):  # the second call is served from the plan
            dst = np.full(16, -1.0)
            _exchange(comm, mode, src, dst, mt, 1)
            assert _bits(dst) == _bits(_oracle(comm, src, np.full(16, -1.0), mt, 1)), (k, dst)
        mt.Free()
    # Open MPI hands a freed handle value to the next type: the stale case was exercised
    assert len(set(handles)) < len(handles) or MPI.Get_library_version().find("Open MPI") < 0


@pytest.mark.parametrize("mode", MODES)
def test_commlib_type_replaced(mode):
    """A commlib type dropped and a different one made (maybe at the same id)."""
    comm = commlib.init()
    for k, (n, bl, st) in enumerate([(3, 1, 2), (2, 2, 3), (3, 1, 2), (4, 1, 3)]):
        t = dts.Vector(n, bl, st, np.float64)
        mt = t.to_mpi()
        src = np.arange(16.0) + 100 * comm.rank + 1000 * k
        for _ in range(2):
            dst = np.full(16, -1.0)
            _exchange(comm, mode, src, dst, t, 1)
            assert _bits(dst) == _bits(_oracle(comm, src, np.full(16, -1.0), mt, 1)), (k, dst)
        mt.Free()
        del t


@pytest.mark.parametrize("mode", MODES)
def test_buffers_of_other_dtype_shape_and_strides(mode):
    """Same datatype, buffers of another dtype, shape, order or memory: each
    result as mpi4py's; a strided view is refused as before (no plan for it)."""
    comm = commlib.init()
    t = dts.Vector(4, 1, 2, np.float64)
    mt = t.to_mpi()
    rng = np.random.default_rng(comm.rank)
    base = rng.integers(0, 255, 128, dtype=np.uint8)
    bufs = [base[:64].view(np.float64), base[:64].view(np.int32), base[:64].copy(),
            base[:64].view(np.float64).reshape(2, 4), base[:64].view(np.float64).reshape(4, 2).T,  # F-order
            base[:72].view(np.float64), base[8:72].view(np.complex128)]
    for k, src in enumerate(bufs):
        for _ in range(2):
            dst = np.zeros_like(src)
            _exchange(comm, mode, src, dst, t, 1)
            ref = _oracle(comm, src.ravel(order="K"), np.zeros(src.size, src.dtype), mt, 1)  # memory order
            assert _bits(dst.ravel(order="K")) == _bits(ref), k
    strided = np.zeros(16)[::2]  # the key (float64, 64 bytes) of bufs[0]'s plan
    with pytest.raises(DatatypeError, match="contiguous"):
        _exchange(comm, mode, strided, strided.copy() if mode in ("recv", "sendrecv") else strided, t, 1)
    mt.Free()


def test_refusals_after_a_cached_plan():
    """With a plan cached for (type, count, float64[16]), calls that differ in
    one protected way are still refused, before anything is posted."""
    comm = commlib.init()
    right, left = _ring(comm)
    t = dts.Vector(4, 1, 2, np.float64)
    src, dst = np.arange(16.0), np.zeros(16)
    _exchange(comm, "recv", src, dst, t, 1)
    _exchange(comm, "send", src, dst, t, 1)
    ro = np.zeros(16)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="read-only"):
        typed_p2p.typed_recv(comm, ro, left, t, 1, 5)
    with pytest.raises(BufferError, match="read-only"):
        typed_p2p.typed_irecv(comm, ro, left, t, 1, 5)
    assert not ro.any()
    with pytest.raises(DatatypeError, match="touch bytes"):  # short buffer, same dtype
        typed_p2p.typed_send(comm, np.zeros(6), right, t, 1, 5)
    with pytest.raises(DatatypeError, match="touch bytes"):  # count grown past the buffer
        typed_p2p.typed_recv(comm, dst, left, t, 3, 5)
    for bad in (True, 1.0, -1):
        with pytest.raises(DatatypeError, match="count"):
            typed_p2p.typed_send(comm, src, right, t, bad, 5)
    with pytest.raises(InvalidArgument):
        typed_p2p.typed_send(comm, src, True, t, 1, 5)
    with pytest.raises(InvalidArgument):
        typed_p2p.typed_recv(comm, dst, comm.size, t, 1, 5)
    with pytest.raises(InvalidArgument):
        typed_p2p.typed_send(comm, np.zeros(16, object), right, t, 1, 5)
    freed = t.to_mpi()
    freed.Free()
    with pytest.raises(DatatypeError):
        typed_p2p.typed_send(comm, src, right, freed, 1, 5)
    # PROC_NULL: nothing moves, nothing is written
    typed_p2p.typed_send(comm, src, MPI.PROC_NULL, t, 1, 5)
    keep = np.full(16, 3.0)
    typed_p2p.typed_recv(comm, keep, MPI.PROC_NULL, t, 1, 5)
    assert (keep == 3.0).all()
    # a longer message than the receive: MPI's truncation error, from the cached path too
    req = typed_p2p.typed_isend(comm, np.arange(32.0), right, dts.Vector(8, 1, 2, np.float64), 1, 6,
                                strategy="mpi")
    with pytest.raises(CommError, match="larger than its receive buffer"):
        typed_p2p.typed_recv(comm, dst, left, t, 1, 6, strategy="mpi")
    req.wait(60)  # the truncated receive matched it
    comm.barrier()


def test_public_refusals_after_a_repeated_call():
    """After the same comm.send / comm.recv ran twice (the second from the
    last-call fast path, typed_p2p.fast_p2p), a call that differs in
    one protected way is refused as the first call would be, before anything is
    posted, and a call that differs harmlessly gives MPI's bytes."""
    comm = commlib.init()
    right, left = _ring(comm)
    t = dts.Vector(4, 1, 2, np.float64)
    mt = t.to_mpi()
    src, dst = np.arange(16.0) + 100 * comm.rank, np.zeros(16)
    for _ in range(3):
        _exchange(comm, "comm", src, dst, t, 1)
        _exchange(comm, "comm-recv", src, dst, t, 1)
    ro = np.zeros(16)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="read-only"):
        comm.recv(ro, left, 5, datatype=t)
    assert not ro.any()
    with pytest.raises(DatatypeError, match="count"):
        comm.send(src, right, 5, datatype=t, count=True)
    with pytest.raises(DatatypeError, match="count"):
        comm.recv(dst, left, 5, datatype=t, count=True)
    with pytest.raises(InvalidArgument):
        comm.send(src, True, 5, datatype=t)
    with pytest.raises(InvalidArgument):
        comm.send(src, right, -3, datatype=t)
    with pytest.raises(DatatypeError, match="touch bytes"):  # short buffer, same dtype
        comm.send(np.zeros(6), right, 5, datatype=t)
    with pytest.raises(DatatypeError, match="contiguous"):  # same dtype and size, strided
        comm.send(np.zeros(32)[::2], right, 5, datatype=t)
    # same size, another dtype: valid, MPI's bytes
    for mode in ("comm", "comm-recv"):
        s32, d32 = (np.arange(32, dtype=np.float32) + comm.rank), np.full(32, -1, np.float32)
        _exchange(comm, mode, s32, d32, t, 1)
        assert _bits(d32) == _bits(_oracle(comm, s32, np.full(32, -1, np.float32), mt, 1))
    mt.Free()
    comm.barrier()


@pytest.mark.parametrize("count", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_count_changes(mode, count):
    comm = commlib.init()
    t = dts.Vector(2, 1, 3, np.float64)  # extent 4 doubles
    mt = t.to_mpi()
    src = np.arange(16.0) + 100 * comm.rank
    for c in (1, count, 1, count):
        dst = np.full(16, -2.0)
        _exchange(comm, mode, src, dst, t, c)
        assert _bits(dst) == _bits(_oracle(comm, src, np.full(16, -2.0), mt, c)), c
    mt.Free()


@pytest.mark.parametrize("mode", ["recv", "send", "sendrecv", "comm", "comm-recv"])
def test_strategy_changes_are_followed(mode, monkeypatch):
    """The strategy argument, COMMLIB_DATATYPE_STRATEGY, config.forced_strategy
    and a new model each change the path taken (pack called or not) at once,
    with the same bytes."""
    comm = commlib.init()
    t = dts.Vector(4, 1, 2, np.float64)
    mt = t.to_mpi()
    src = np.arange(16.0) + 100 * comm.rank
    packs = []
    real_pack = typed_p2p.pack
    monkeypatch.setattr(typed_p2p, "pack", lambda *a, **k: packs.append(1) or real_pack(*a, **k))
    monkeypatch.delenv("COMMLIB_DATATYPE_STRATEGY", raising=False)
    monkeypatch.setattr(config, "forced_strategy", None)

    def run(strategy=None):
        packs.clear()
        dst = np.full(16, -3.0)
        _exchange(comm, mode, src, dst, t, 1, strategy=strategy)
        assert _bits(dst) == _bits(_oracle(comm, src, np.full(16, -3.0), mt, 1))
        return bool(packs)

    if not mode.startswith("comm"):  # the public calls take no strategy argument
        assert not run("mpi") and not run("mpi")
        assert run("pack") and run("pack")
        assert not run("mpi")
    else:  # a repeated call, from the last-call fast path, then each change below
        assert not run() and not run() and not run()
    monkeypatch.setenv("COMMLIB_DATATYPE_STRATEGY", "pack")
    assert run() and run()
    monkeypatch.setenv("COMMLIB_DATATYPE_STRATEGY", " MPI ")
    assert not run() and not run()
    monkeypatch.setenv("COMMLIB_DATATYPE_STRATEGY", "pack")
    assert run()
    monkeypatch.setattr(config, "forced_strategy", "mpi")
    assert not run() and not run()
    monkeypatch.setattr(config, "forced_strategy", None)
    monkeypatch.delenv("COMMLIB_DATATYPE_STRATEGY")
    sizes, blocks = [8, 64, 1 << 20], [1, 8, 64]
    slow, fast = [[1e-3] * 3] * 3, [[1e-6] * 3] * 3
    try:
        for mpi_s, pack_s, want_pack in ((slow, fast, True), (fast, slow, False), (slow, fast, True)):
            strategy_mod.set_model(strategy_mod.Model({"intra": {
                "mpi": {"bytes": sizes, "block": blocks, "seconds": mpi_s},
                "pack": {"bytes": sizes, "block": blocks, "seconds": pack_s}}}))
            assert run() is want_pack and run() is want_pack
    finally:
        strategy_mod.set_model(None)
    mt.Free()
