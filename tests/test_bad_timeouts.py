"""Timeouts that are not a finite number of seconds are refused (D4).

A NaN deadline never passes (the wait it bounds never ends), an infinite one
is no bound, a negative one fails at once with a misleading CommTimeout, a
bool is not a number of seconds, and ``init(timeout=0)`` used to become 60 s
silently.  Each must be an InvalidArgument naming the rank and the operation:
at ``init`` (on every rank, before any communicator is duplicated), in
``Request.wait``/``waitall`` (locally, the request staying valid; 0 there is a
documented poll), and in a halo exchange (on every rank, through its abort
path, no ghost cell written).
"""
import math
import time

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.collectives import HaloExchange
from commlib.collectives.recovery import FaultTolerance
from commlib.core.errors import CommTimeout, InvalidArgument
from commlib.core.seconds import check_timeout, timeout_problem

BAD = [float("nan"), float("inf"), -float("inf"), -1.0, -1, True, False, "5", [1.0]]
BAD_IDS = ["nan", "inf", "-inf", "-1.0", "-1", "True", "False", "str", "list"]


# ------------------------------------------------------------------ serial
@pytest.mark.parametrize("value", BAD, ids=BAD_IDS)
def test_check_timeout_refuses(value):
    with pytest.raises(InvalidArgument, match=r"rank 3: some\.op: timeout must be"):
        check_timeout(value, op="some.op", rank=3, zero=True)


def test_check_timeout_accepts_and_zero():
    assert check_timeout(None, op="x") is None
    assert check_timeout(2, op="x") == 2.0 and isinstance(check_timeout(2, op="x"), float)
    assert check_timeout(np.float32(0.5), op="x") == 0.5
    assert check_timeout(0, op="x", zero=True) == 0.0  # a poll where the call allows it
    with pytest.raises(InvalidArgument, match="> 0"):
        check_timeout(0, op="x")  # refused, never silently replaced by a default
    assert timeout_problem(1e-3) is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -2.0, True], ids=["nan", "inf", "0", "-2", "True"])
def test_fault_tolerance_settings_refuse_bad_timeout(value):
    with pytest.raises(InvalidArgument, match="timeout"):
        FaultTolerance("timeout", timeout=value)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", BAD, ids=BAD_IDS)
def test_mpi_transport_waitall_refuses_bad_timeout(value):
    """The MPI transport's own ``waitall`` (below ``Communicator.waitall``): a bool
    used to pass as 1 or 0 seconds and a str raised TypeError."""
    comm = commlib.init().dup()
    try:
        buf = np.zeros(4)
        q = comm.transport.irecv(buf, comm.rank, 7)
        with pytest.raises(InvalidArgument, match=rf"rank {comm.rank}: waitall: timeout must be"):
            comm.transport.waitall([q], timeout=value)
        comm.transport.send(np.arange(4.0), comm.rank, 7)
        comm.transport.waitall([q], timeout=30)
        assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        comm.free()


# ------------------------------------------------------------ point to point
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", BAD, ids=BAD_IDS)
def test_request_wait_refuses_bad_timeout(value):
    """A receive nobody has matched yet: ``wait``/``waitall``/``result`` with a
    bad timeout raise InvalidArgument naming the rank at once (the old code
    waited forever for NaN and raised CommTimeout for -1); the request stays
    valid and completes once its message comes."""
    comm = commlib.init().dup()
    try:
        buf = np.zeros(4)
        q = comm.irecv(buf, source=comm.rank, tag=7)
        with pytest.raises(InvalidArgument, match=rf"rank {comm.rank}: .*wait.*timeout must be"):
            q.wait(timeout=value)
        with pytest.raises(InvalidArgument, match=rf"rank {comm.rank}: waitall: timeout must be"):
            comm.waitall([q], timeout=value)
        with pytest.raises(InvalidArgument, match="timeout must be"):
            q.result(value)
        with pytest.raises(CommTimeout):  # 0: poll once
            q.wait(timeout=0)
        comm.send(np.arange(4.0), comm.rank, tag=7)
        q.wait(timeout=30)
        assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]
        done = comm.iallreduce(np.ones(2))
        with pytest.raises(InvalidArgument, match="timeout must be"):
            done.wait(timeout=value)
        assert np.array_equal(done.wait(timeout=30), np.full(2, comm.size))
    finally:
        comm.free()


# ------------------------------------------------------------------- init
def _everyone(fn):
    try:
        got = ("ok", fn())
    except Exception as exc:  # noqa: BLE001
        got = (type(exc).__name__, str(exc))
    return got, MPI.COMM_WORLD.allgather((got[0], got[1] if got[0] != "ok" else ""))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -1.0, True], ids=["nan", "inf", "0", "-1", "True"])
def test_init_bad_timeout_on_one_rank_fails_everywhere(value):
    """``init(fault_tolerant=True, timeout=v)`` with a bad ``v`` on the last rank:
    every rank raises InvalidArgument before any communicator is duplicated (the
    old code accepted NaN, then waited forever; took 0 for 60 s), and a good
    init works afterwards."""
    last = MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1
    got, everyone = _everyone(lambda: commlib.init(fault_tolerant=True, timeout=value if last else 20))
    assert [g[0] for g in everyone] == ["InvalidArgument"] * len(everyone), everyone
    me = MPI.COMM_WORLD.Get_rank()
    assert got[1].startswith(f"rank {me}: init"), got
    if last:
        assert "timeout must be" in got[1], got
    else:
        assert f"rank(s) [{len(everyone) - 1}]" in got[1], got
    # a bad timeout without fault tolerance is refused too, on every rank
    got, everyone = _everyone(lambda: commlib.init(timeout=value if last else None))
    assert [g[0] for g in everyone] == ["InvalidArgument"] * len(everyone), everyone
    c = commlib.init(fault_tolerant=True, timeout=20)
    assert c.ft.timeout == 20.0
    assert np.array_equal(c.allreduce(np.ones(3)), np.full(3, c.size))
    c.free()


# -------------------------------------------------------------------- halo
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0, True], ids=["nan", "inf", "-1", "0", "True"])
def test_halo_bad_timeout_on_one_rank_fails_everywhere(value):
    """``exchange(f, timeout=v)`` with a bad ``v`` on the last rank only: every
    rank raises InvalidArgument in that exchange (the old code: CommTimeout on
    that rank alone, the others succeeded, or for NaN a wait that never ended),
    no ghost cell is written, and the plan works afterwards."""
    comm = commlib.init()
    cart = comm.cart_create(dims=[0, 0], periods=[True, True])
    halo = HaloExchange(cart, (3, 4), width=1)
    if comm.size > 4:
        pytest.skip("every rank neighbours the offender only up to 4 ranks (2x2)")
    try:
        f = halo.allocate(fill=-1.0)
        f[halo.interior] = cart.rank
        before = f.copy()
        last = comm.rank == comm.size - 1
        got, everyone = _everyone(lambda: halo.exchange(f, timeout=value if last else 30))
        assert [g[0] for g in everyone] == ["InvalidArgument"] * comm.size, everyone
        assert got[1].startswith(f"rank {cart.rank}: HaloExchange.exchange"), got
        if last:
            assert "timeout must be" in got[1], got
        else:
            assert f"rank {comm.size - 1}" in got[1] and "timeout" in got[1], got
        assert np.array_equal(f, before), "a ghost cell was written by the refused exchange"
        # HaloRequest.wait: refused locally, the exchange stays in flight and completes
        req = halo.start(f, timeout=30)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
            with pytest.raises(InvalidArgument, match="timeout must be"):
                req.wait(timeout=value)
        req.wait(timeout=30)
        assert not np.array_equal(f, before)
        assert math.isclose(float(f[halo.interior][0, 0]), cart.rank)
    finally:
        halo.free()
        cart.free()


# ------------------------------------------- a fault-tolerant communicator's p2p
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["recv", "irecv-wait", "irecv-waitall", "sendrecv", "send"])
def test_fault_tolerant_point_to_point_waits_are_bounded(call):
    """A fault-tolerant communicator's blocking point-to-point calls against a
    live peer that never answers used to wait forever (under ULFM and in
    timeout mode alike).  Each now raises CommTimeout after the communicator's
    timeout, naming the rank.  A blocking receive that timed out is withdrawn
    (the message sent afterwards reaches the next receive, and the first buffer
    stays untouched); a request stays valid, as after ``wait(timeout=...)``, and
    completes when waited on again; a timed-out send stays posted and is taken
    by the receive posted later."""
    T = 0.5
    comm = commlib.init(fault_tolerant=True, timeout=T)
    assert comm.p2p_timeout == T
    r = comm.rank
    try:
        if r == 0:
            buf = np.full(4, -1.0)
            big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: past any eager limit
            req = comm.irecv(buf, 1, tag=5) if call.startswith("irecv") else None
            fn = {"recv": lambda: comm.recv(buf, 1, tag=5),
                  "irecv-wait": lambda: req.wait(),
                  "irecv-waitall": lambda: comm.waitall([req]),
                  "sendrecv": lambda: comm.sendrecv(np.zeros(4), 1, buf, 1, 7, 5),
                  "send": lambda: comm.send(big, 1, tag=6)}[call]
            t0 = time.monotonic()
            with pytest.raises(CommTimeout, match="rank 0: "):
                fn()
            assert time.monotonic() - t0 < T + 5
        MPI.COMM_WORLD.Barrier()  # not comm's: its barrier is bounded by T as well
        if r == 1:
            if call == "send":
                got = np.empty(1 << 18)
                comm.recv(got, 0, tag=6)
                assert np.array_equal(got, np.arange(1 << 18, dtype=np.float64))
            else:
                comm.send(np.arange(4.0), 0, tag=5)
            if call == "sendrecv":
                comm.recv(np.zeros(4), 0, tag=7)  # the timed-out exchange's send, still posted
        if r == 0 and call.startswith("irecv"):
            req.wait(timeout=30)  # still valid: it takes the message
            assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]
        elif r == 0 and call != "send":
            fresh = np.zeros(4)
            comm.recv(fresh, 1, tag=5)  # the withdrawn receive did not take it
            assert fresh.tolist() == [0.0, 1.0, 2.0, 3.0] and buf.tolist() == [-1.0] * 4
        MPI.COMM_WORLD.Barrier()  # not comm's: its barrier is bounded by T as well
    finally:
        comm.free()
