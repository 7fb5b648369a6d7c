"""Receives into device buffers staged through host memory (MPI not CUDA-aware):
a message shorter than the buffer writes only the bytes that arrived.

MPI-4.0 §3.2.4: a receive of a shorter message modifies only the locations of
the elements received.  With a host buffer MPI does that by itself; a device
buffer is received into a host staging buffer and copied up when the request
completes, and that copy used to send the whole uninitialized staging buffer
up, so the rest of the user's device buffer became garbage.  Oracle: mpi4py's
own ``Recv`` of the same message into a host numpy buffer with the same initial
contents (and for typed receives, with the MPI datatype itself), compared bit
for bit, the untouched tail included, on every completion path (``recv``,
``irecv`` + ``wait``/``wait(timeout)``/``test``/``waitall``, ``sendrecv``; a
fault-tolerant communicator's bounded paths too).

Device arrays are numba's (CUDA simulator, ``NUMBA_ENABLE_CUDASIM=1``)::

    mpiexec -n 2 python -P -m pytest -q --with-mpi -m mpi tests/test_device_short_recv.py
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib import datatypes as dts

SHAPE = (4, 6)  # 24 int32: 96 bytes
NBYTES = 96
# message lengths in bytes: empty, a partial trailing element, whole elements, exactly full
LENGTHS = (0, 13, 40, NBYTES)
MODES = ("recv", "irecv-wait", "irecv-wait-timeout", "irecv-test", "irecv-waitall", "waitall-mixed", "sendrecv")


def _rng(*key):
    return np.random.default_rng([20261127, *key])


def _init(order, *key):
    """The receive buffer's contents before the receive: random, so an
    uninitialized staging buffer cannot match them by chance."""
    a = _rng(1, *key).integers(-2**31, 2**31, SHAPE, dtype=np.int32)
    return np.asfortranarray(a) if order == "F" else a


def _message(n, *key):
    return _rng(2, *key).integers(0, 256, n, dtype=np.uint8)


def _churn():
    """Free a few blocks of the receive's size filled with a pattern, so an
    uninitialized staging buffer shows it rather than stale copies of the data."""
    for _ in range(4):
        junk = np.full(NBYTES, 0x5A, np.uint8)
        del junk


def _mem(a: np.ndarray) -> np.ndarray:
    """The bytes of contiguous host ``a`` in memory order (a view)."""
    v = np.ravel(a, order="K").view(np.uint8)
    assert np.shares_memory(v, a)
    return v


def _receive(comm, mode, dev, tag):
    """Receive from rank 0 into device ``dev`` by ``mode``; ``mixed`` also
    receives a host message (tag + 1) in the same waitall (status order)."""
    if mode == "recv":
        comm.recv(dev, 0, tag)
    elif mode == "sendrecv":
        comm.sendrecv(np.arange(3, dtype=np.int16), 0, dev, 0, sendtag=tag + 2, recvtag=tag)
    elif mode == "waitall-mixed":
        host = np.full(7, -3, np.int16)
        reqs = [comm.irecv(host, 0, tag + 1), comm.irecv(dev, 0, tag)]
        comm.waitall(reqs)
        return host
    else:
        req = comm.irecv(dev, 0, tag)
        if mode == "irecv-wait":
            req.wait()
        elif mode == "irecv-wait-timeout":
            req.wait(60)
        elif mode == "irecv-test":
            while not req.test():
                pass
        else:
            comm.waitall([req])
    return None


def _run(comm, mode, order):
    """Rank 0 sends each message twice (oracle, then device); rank 1 compares.
    Returns the mismatches (message bytes, elements differing), asserted by the
    caller after a barrier, so a failure leaves no rank waiting."""
    from numba import cuda

    r = comm.rank
    bad = []
    for k, n in enumerate(LENGTHS):
        tag = 10 * k + 1
        msg = _message(n, k)
        if r == 0:
            w = comm.mpi_comm
            w.Send([msg, MPI.BYTE], 1, 1000 + tag)  # the oracle's
            if mode == "waitall-mixed":
                w.Send([np.arange(5, dtype=np.int16), MPI.BYTE], 1, tag + 1)
            w.Send([msg, MPI.BYTE], 1, tag)
            if mode == "sendrecv":
                got = np.zeros(3, np.int16)
                w.Recv([got, MPI.BYTE], 1, tag + 2)
                if got.tolist() != [0, 1, 2]:
                    bad.append(("sendrecv's send", got.tolist()))
        elif r == 1:
            ref = _init(order, k)
            st = MPI.Status()
            comm.mpi_comm.Recv([_mem(ref), MPI.BYTE], 0, 1000 + tag, st)
            if st.Get_count(MPI.BYTE) != n:
                bad.append(("oracle count", st.Get_count(MPI.BYTE)))
            init = _init(order, k)  # kept alive: a staging buffer must not reuse its memory
            dev = cuda.to_device(init)
            _churn()
            host = _receive(comm, mode, dev, tag)
            got = dev.copy_to_host()
            if got.shape != ref.shape or not np.array_equal(got, ref):
                bad.append((n, int((got != ref).sum())))
            if host is not None and host.tolist() != [0, 1, 2, 3, 4, -3, -3]:
                bad.append(("host receive", host.tolist()))
    return bad


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_short_message_into_device_buffer_matches_host_receive(mode):
    """Each completion path, C-order buffers: 0 bytes, a partial element, whole
    elements and an exactly full buffer, bit for bit as mpi4py's host receive."""
    comm = commlib.init()
    assert not comm.transport.cuda_aware
    bad = _run(comm, mode, "C")
    comm.barrier()
    assert not bad, f"{mode}: (message bytes, elements differing from the host oracle): {bad}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["recv", "irecv-wait", "irecv-waitall", "sendrecv"])
def test_short_message_into_device_buffer_fault_tolerant(mode):
    """A fault-tolerant communicator's bounded waits (polling paths) as well."""
    comm = commlib.init(fault_tolerant=True, timeout=60)
    try:
        bad = _run(comm, mode, "C")
        MPI.COMM_WORLD.Barrier()
        assert not bad, f"{mode}: (message bytes, elements differing from the host oracle): {bad}"
    finally:
        comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["recv", "irecv-waitall"])
def test_fortran_order_device_buffer_receives_in_memory_order(mode):
    """A Fortran-ordered device buffer receives the message's bytes in its memory
    order, as a Fortran-ordered host buffer does (the staging copy used to lay
    them out in C order, transposing a full message)."""
    comm = commlib.init()
    bad = _run(comm, mode, "F")
    comm.barrier()
    assert not bad, f"{mode}: (message bytes, elements differing from the host oracle): {bad}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_device_receive_from_proc_null_leaves_buffer(gpu_empty_slices):
    """``MPI_PROC_NULL`` delivers nothing (MPI-4.0 §3.11): the blocking receive
    used to copy the whole staging buffer up anyway.  Also an empty device
    buffer receiving an empty message (no slice of an empty device array)."""
    from numba import cuda

    comm = commlib.init()
    init = _init("C", 99)
    dev = cuda.to_device(init)
    st = comm.recv(dev, MPI.PROC_NULL, 3)
    kept = np.array_equal(dev.copy_to_host(), init)
    if comm.rank == 0:
        comm.send(np.zeros(0, np.int32), 1, 4)
    elif comm.rank == 1:
        empty = cuda.device_array(0, np.int32)
        comm.recv(empty, 0, 4)
        assert empty.copy_to_host().shape == (0,)
    comm.barrier()
    assert st.Get_count(MPI.BYTE) == 0
    assert kept, "a receive from MPI_PROC_NULL changed the device buffer"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["device", "staged", "mapped"])
@pytest.mark.parametrize("mode", ["recv", "irecv-wait", "irecv-test", "sendrecv"])
def test_typed_short_message_into_device_buffer(mode, strategy):
    """Typed receives (``datatype=``) into device buffers, every receive strategy
    (``device``: the packed wire is a device buffer the transport stages; the
    others unpack from host memory): a message of fewer elements, a partial
    element and none write only what arrived, as mpi4py's ``Recv`` with the
    MPI datatype into a host buffer does."""
    from numba import cuda

    from commlib.typed_p2p import typed_irecv, typed_recv, typed_sendrecv

    comm = commlib.init()
    t = dts.Vector(3, 1, 2, np.float64)  # elements 0, 2, 4 of 6 doubles; 12 doubles hold 2
    mt = t.to_mpi()
    bad = []
    # (send doubles): one whole element, 2/3 of one, none, both
    for k, nd in enumerate((3, 2, 0, 6)):
        tag = 40 + k
        msg = _rng(3, k).standard_normal(nd)
        if comm.rank == 0:
            comm.mpi_comm.Send([msg, MPI.DOUBLE], 1, 1000 + tag)
            comm.mpi_comm.Send([msg, MPI.DOUBLE], 1, tag)
            if mode == "sendrecv":
                comm.mpi_comm.Recv([np.zeros(1), MPI.DOUBLE], 1, tag + 100)
        elif comm.rank == 1:
            init = _rng(4, k).standard_normal(12)
            ref = init.copy()
            comm.mpi_comm.Recv([ref, 2, mt], 0, 1000 + tag)
            dev = cuda.to_device(init)
            if mode == "recv":
                typed_recv(comm, dev, 0, t, 2, tag, strategy=strategy)
            elif mode == "sendrecv":
                typed_sendrecv(comm, np.ones(1), 0, dev, 0, tag + 100, tag, recvtype=t, recvcount=2,
                               strategy=strategy)
            else:
                req = typed_irecv(comm, dev, 0, t, 2, tag, strategy=strategy)
                if mode == "irecv-wait":
                    req.wait()
                else:
                    while not req.test():
                        pass
            got = dev.copy_to_host()
            if not np.array_equal(got.view(np.uint64), ref.view(np.uint64)):
                bad.append((nd, int((got.view(np.uint64) != ref.view(np.uint64)).sum())))
    mt.Free()
    comm.barrier()
    assert not bad, f"{mode}/{strategy}: (doubles sent, doubles differing from MPI's receive): {bad}"
