"""Typed and plain point-to-point mixed, the way users mix them (MPI tests, 2-3 ranks).

Before the transport contract computed node locality when a communicator is
created, the first typed send ran a hidden collective (``MPI_Comm_split_type``)
inside ``send``: rank 0's typed send against rank 1's plain receive hung for
ever.  Every wait here is bounded, so a regression fails instead of hanging.

Oracle: the bytes ``numpy`` selects with the same slicing.
"""
import time

import numpy as np
import pytest

import commlib
from commlib import datatypes as dts

pytestmark = pytest.mark.mpi
TIMEOUT = 20.0  # seconds; generous for 4 oversubscribed ranks on 2 cores


@pytest.fixture
def comm():
    return commlib.init().dup()  # a fresh communicator: no typed send has run on it yet


def _face():
    """The last-axis face (width 5) of a (10, 12, 20) float64 field, as a Subarray, and its slices."""
    shape = (10, 12, 20)
    return shape, dts.Subarray(shape, (10, 12, 5), (0, 0, 15), np.float64), (slice(None), slice(None), slice(15, 20))


def _pair(comm, strategy, monkeypatch):
    """Skip below 2 ranks; force the typed-send strategy (``"model"``: let it choose)."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    if strategy != "model":
        monkeypatch.setenv("COMMLIB_DATATYPE_STRATEGY", strategy)
    return _face()


@pytest.mark.parametrize("strategy", ["model", "mpi", "pack"])
def test_typed_send_plain_recv(comm, strategy, monkeypatch):
    shape, face, sl = _pair(comm, strategy, monkeypatch)
    if comm.rank == 0:
        a = np.random.default_rng(1).random(shape)
        req = comm.isend(a, 1, tag=3, datatype=face)
        req.wait(TIMEOUT)
    elif comm.rank == 1:
        buf = np.empty(10 * 12 * 5)
        comm.irecv(buf, 0, tag=3).wait(TIMEOUT)
        a = np.random.default_rng(1).random(shape)
        np.testing.assert_array_equal(buf, a[sl].ravel())


@pytest.mark.parametrize("strategy", ["model", "mpi", "pack"])
def test_plain_send_typed_recv(comm, strategy, monkeypatch):
    shape, face, sl = _pair(comm, strategy, monkeypatch)
    if comm.rank == 1:
        flat = np.arange(10 * 12 * 5, dtype=np.float64)
        comm.isend(flat, 0, tag=4).wait(TIMEOUT)
    elif comm.rank == 0:
        out = np.zeros(shape)
        comm.irecv(out, 1, tag=4, datatype=face).wait(TIMEOUT)
        expect = np.zeros(shape)
        expect[sl] = np.arange(10 * 12 * 5, dtype=np.float64).reshape(10, 12, 5)
        np.testing.assert_array_equal(out, expect)


def test_typed_sends_to_peers_in_any_order(comm):
    """Every rank sends a typed face to every other rank, in a rank-dependent
    order, while receiving plainly from all: no ordering may hang."""
    n = comm.size
    if n < 2:
        pytest.skip("needs 2 ranks")
    shape, face, sl = _face()
    rng = np.random.default_rng(comm.rank)
    a = np.full(shape, float(comm.rank))
    peers = [p for p in range(n) if p != comm.rank]
    rng.shuffle(peers)
    bufs = {p: np.empty(10 * 12 * 5) for p in range(n) if p != comm.rank}
    recvs = [comm.irecv(bufs[p], p, tag=5) for p in sorted(bufs, reverse=bool(comm.rank % 2))]
    sends = [comm.isend(a, p, tag=5, datatype=face) for p in peers]
    comm.waitall(recvs + sends, timeout=TIMEOUT)
    for p, b in bufs.items():
        np.testing.assert_array_equal(b, np.full(b.size, float(p)))


def test_blocking_typed_send_against_plain_recv(comm):
    """The blocking idiom of the bug report: ``send(datatype=)`` / plain ``recv``."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    shape, face, sl = _face()
    if comm.rank == 0:
        a = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
        comm.send(a, 1, tag=6, datatype=face)
    elif comm.rank == 1:
        buf = np.empty(10 * 12 * 5)
        comm.irecv(buf, 0, tag=6).wait(TIMEOUT)
        a = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
        np.testing.assert_array_equal(buf, a[sl].ravel())


def test_failed_typed_recv_is_a_commerror(comm):
    """A receive whose buffer is too small for the message raises a CommError naming the rank."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    shape, face, sl = _face()
    if comm.rank == 0:
        comm.isend(np.ones(10 * 12 * 5 + 7), 1, tag=7).wait(TIMEOUT)
    elif comm.rank == 1:
        out = np.zeros(shape)
        with pytest.raises(commlib.CommError, match="rank 1"):
            comm.irecv(out, 0, tag=7, datatype=face).wait(TIMEOUT)


def test_typed_irecv_completed_by_test_polling(comm, monkeypatch):
    """A typed receive finished by ``test()`` (no ``wait``) is unpacked into the buffer too."""
    shape, face, sl = _pair(comm, "pack", monkeypatch)
    if comm.rank == 1:
        comm.isend(np.arange(10 * 12 * 5, dtype=np.float64), 0, tag=8).wait(TIMEOUT)
    elif comm.rank == 0:
        out = np.zeros(shape)
        req = comm.irecv(out, 1, tag=8, datatype=face)
        deadline = time.monotonic() + TIMEOUT
        while not req.test():
            assert time.monotonic() < deadline, "typed irecv never completed"
            time.sleep(1e-4)
        expect = np.zeros(shape)
        expect[sl] = np.arange(10 * 12 * 5, dtype=np.float64).reshape(10, 12, 5)
        np.testing.assert_array_equal(out, expect)
