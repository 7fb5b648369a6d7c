"""Non-contiguous point-to-point (datatype=, count=) and the send-strategy model.

Oracle: the same exchange done by mpi4py with the MPI datatype itself."""
import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib import datatypes as dts
from commlib.datatypes.strategy import Model, block_length
from commlib.core.errors import DatatypeError


def types_under_test():
    col = dts.Resized(dts.Vector(6, 1, 8, np.float64), 0, 8)  # one column of a 6x8 matrix
    return [
        ("vector", dts.Vector(6, 3, 8, np.float64), 1, (6, 8)),
        ("column-resized", col, 3, (6, 8)),
        ("subarray", dts.Subarray((6, 8), (3, 4), (2, 1), np.float64), 1, (6, 8)),
        ("subarray-F", dts.Subarray((6, 8), (3, 4), (1, 2), np.float64, order="F"), 1, (6, 8)),
        ("indexed", dts.Indexed([2, 1, 3], [0, 9, 20], np.float64), 2, (6, 8)),
        ("struct", dts.Struct([1, 2], [0, 16], [np.int32, np.float64]), 2, (6, 8)),
    ]


def tables(fast_pack_above=4096):
    """A model where 'pack' wins for messages above ``fast_pack_above`` bytes."""
    sizes = [64, 1024, 4096, 65536, 1 << 20]
    blocks = [1, 8, 64, 512]
    mpi = [[1e-6 * (1 + s / 1e3)] * len(blocks) for s in sizes]
    pack = [[1e-6 * (1 + s / 1e3) * (2.0 if s < fast_pack_above else 0.5)] * len(blocks) for s in sizes]
    return {"intra": {"mpi": {"bytes": sizes, "block": blocks, "seconds": mpi},
                      "pack": {"bytes": sizes, "block": blocks, "seconds": pack}}}


# ------------------------------------------------------------------ model
def test_model_choice_follows_tables(monkeypatch):
    monkeypatch.delenv("COMMLIB_DATATYPE_STRATEGY", raising=False)
    m = Model(tables())
    small = dts.Vector(4, 1, 2, np.float64)          # 32 bytes
    big = dts.Vector(4096, 1, 2, np.float64)         # 32 KiB
    assert m.choose(small, 1, device=False) == "mpi"
    assert m.choose(big, 1, device=False) == "pack"
    assert m.choose(small, 1000, device=False) == "pack"   # count scales the bytes
    # exact at table points, monotone between them
    assert m.predict("mpi", 1024, 8) == pytest.approx(1e-6 * 2.024)
    assert m.predict("mpi", 64, 8) < m.predict("mpi", 300, 8) < m.predict("mpi", 1024, 8)
    # device buffers choose among device strategies only
    dev = Model({"intra": {"staged": tables()["intra"]["mpi"], "mapped": tables()["intra"]["pack"]}})
    assert dev.choose(big, 1, device=True) == "mapped"


def test_model_forced_strategy(monkeypatch):
    m = Model(tables())
    t = dts.Vector(4, 1, 2, np.float64)
    monkeypatch.setenv("COMMLIB_DATATYPE_STRATEGY", "pack")
    assert m.choose(t, 1, device=False) == "pack"
    monkeypatch.setenv("COMMLIB_DATATYPE_STRATEGY", "device")
    with pytest.raises(DatatypeError, match="does not apply"):
        m.choose(t, 1, device=False)


def test_model_rejects_malformed_tables():
    bad = tables()
    bad["intra"]["mpi"]["seconds"] = [[1.0]]
    with pytest.raises(DatatypeError, match="seconds must be"):
        Model(bad)


def test_block_length_of_canonical_forms():
    assert block_length(dts.Vector(5, 3, 8, np.float64)) == 24
    assert block_length(dts.Contiguous(10, np.float64)) == 80
    assert block_length(dts.Indexed([1, 3], [0, 5], np.float32)) == pytest.approx(8.0)


def test_shipped_model_loads():
    from commlib.datatypes.strategy import default_model

    m = default_model()
    assert set(m.strategies("intra")) >= {"mpi", "pack"}


# --------------------------------------------------------------------- MPI
def _exchange(comm, t, count, shape, send_s, recv_s, device=False):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    src = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1000 * comm.rank
    dst = np.full(shape, -1.0)
    ref = dst.copy()
    if device:
        from numba import cuda

        d_src, d_dst = cuda.to_device(src), cuda.to_device(dst)
        r = comm.irecv(d_dst, left, 4, datatype=t, count=count) if recv_s is None else \
            _irecv(comm, d_dst, left, t, count, recv_s)
        _send(comm, d_src, right, t, count, send_s)
        r.wait(60)
        dst = d_dst.copy_to_host()
    else:
        r = _irecv(comm, dst, left, t, count, recv_s)
        _send(comm, src, right, t, count, send_s)
        r.wait(60)
    mt = t.to_mpi()
    comm.mpi_comm.Sendrecv([src, count, mt], right, 5, [ref, count, mt], left, 5)
    mt.Free()
    return dst, ref


def _irecv(comm, buf, src, t, count, strategy):
    from commlib.typed_p2p import typed_irecv

    return typed_irecv(comm, buf, src, t, count, 4, strategy=strategy)


def _send(comm, buf, dest, t, count, strategy):
    from commlib.typed_p2p import typed_isend

    typed_isend(comm, buf, dest, t, count, 4, strategy=strategy).wait(60)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("send_s,recv_s", [("mpi", "mpi"), ("pack", "pack"), ("pack", "mpi"), ("mpi", "pack"),
                                           (None, None)])
def test_typed_host_exchange_matches_mpi(send_s, recv_s):
    comm = commlib.init()
    for name, t, count, shape in types_under_test():
        dst, ref = _exchange(comm, t, count, shape, send_s, recv_s)
        assert np.array_equal(dst, ref), f"{name}: {send_s}->{recv_s}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("send_s,recv_s", [("staged", "staged"), ("mapped", "staged"), ("staged", "mapped")])
def test_typed_device_exchange_matches_mpi(send_s, recv_s):
    """Device buffers (CUDA simulator): packed on the device, unpacked on the device."""
    comm = commlib.init()
    for name, t, count, shape in types_under_test()[:3]:
        dst, ref = _exchange(comm, t, count, shape, send_s, recv_s, device=True)
        assert np.array_equal(dst, ref), f"{name}: {send_s}->{recv_s}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_typed_communicator_api_and_mpi_datatype():
    comm = commlib.init()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    mt = MPI.DOUBLE.Create_vector(4, 1, 3).Commit()      # an MPI.Datatype works directly
    src = np.arange(12.0) + comm.rank
    dst = np.zeros(12)
    comm.sendrecv(src, right, dst, left, 7, 7, sendtype=mt, recvtype=mt)
    assert np.array_equal(dst[::3], src[::3] - comm.rank + left) and not dst[1::3].any()
    mt.Free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_typed_buffer_too_small_raises_before_sending():
    comm = commlib.init()
    t = dts.Vector(4, 1, 3, np.float64)  # touches bytes [0, 80)
    with pytest.raises(DatatypeError, match=rf"rank {comm.rank}: send: .*holds 72"):
        comm.send(np.zeros(9), (comm.rank + 1) % comm.size, datatype=t)
    with pytest.raises(DatatypeError, match="irecv"):
        comm.irecv(np.zeros(10), 0, datatype=t, count=2)
    comm.barrier()  # every rank got here: nothing was left in flight


# ------------------------------------------------------------ misuse
def _pairs(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("recv_s", ["pack", "mpi"])
@pytest.mark.parametrize("mode", ["recv", "irecv", "sendrecv"])
def test_typed_short_message_writes_only_what_arrived(mode, recv_s):
    """A message shorter than the receive (fewer elements, or a partial one from
    a different type signature) writes only its bytes, as MPI's own receive with
    the same datatype does (oracle: mpi4py's Recv); the packed strategy used to
    unpack the uninitialized rest of its wire buffer over the user's data."""
    from commlib.typed_p2p import typed_irecv, typed_recv, typed_send, typed_sendrecv

    comm = commlib.init()
    right, left = _pairs(comm)
    t = dts.Vector(3, 1, 2, np.float64)  # elements 0, 2, 4 of 6 doubles; 12 doubles hold 2
    mt = t.to_mpi()
    src = np.arange(12.0) + 1 + 100 * comm.rank
    # (send type, send count): one whole element, then 2 doubles = 2/3 of one
    for k, (st, sc) in enumerate([(t, 1), (dts.Named(np.float64), 2)]):
        for trial in range(3):  # fresh wire buffers each time: garbage would show
            dst = np.full(12, -7.0)
            if mode == "sendrecv":
                typed_sendrecv(comm, src, right, dst, left, 9, 9, sendtype=st, sendcount=sc, recvtype=t,
                               recvcount=2, strategy=recv_s)
            else:
                r = typed_irecv(comm, dst, left, t, 2, 9, strategy=recv_s) if mode == "irecv" else None
                if mode == "recv":
                    req = comm.transport.isend(dts.pack(src, st, sc), right, 9)
                    typed_recv(comm, dst, left, t, 2, 9, strategy=recv_s)
                    req.wait(60)
                else:
                    typed_send(comm, src, right, st, sc, 9)
                    r.wait(60)
            ref = np.full(12, -7.0)
            smt = mt if st is t else MPI.DOUBLE
            comm.mpi_comm.Sendrecv([src, sc, smt], right, 10, [ref, 2, mt], left, 10)
            assert np.array_equal(dst, ref), (k, trial, dst, ref)
    mt.Free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("recv_s", ["pack", "mpi"])
def test_typed_recv_into_read_only_buffer_is_refused_before_posting(recv_s):
    from commlib.core.errors import BufferError
    from commlib.typed_p2p import typed_irecv

    comm = commlib.init()
    ro = np.zeros(12)
    ro.flags.writeable = False
    t = dts.Vector(3, 1, 2, np.float64)
    with pytest.raises(BufferError, match=rf"rank {comm.rank}: irecv: .*read-only.*no receive was posted"):
        typed_irecv(comm, ro, 0, t, 1, 11, strategy=recv_s)
    with pytest.raises(BufferError, match="read-only"):
        comm.recv(bytes(96), 0, 11, datatype=t)
    assert not ro.any()
    comm.barrier()  # nothing was posted: no rank waits on a message
