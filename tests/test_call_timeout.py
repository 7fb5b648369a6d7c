"""``timeout`` is the deadline of the whole call, in seconds, whatever its number of steps.

Before, a call's ``timeout`` bounded each wait afresh: a ring of ``2 (n - 1)``
steps, a first round of ``ceil(log2 n)`` Bruck steps and two argument
agreements could wait ``timeout`` at every one of them
(``commlib.nn.ring_attention(timeout=2)`` against a stalled peer raised after
3.98 s), and ``Communicator`` collectives took no ``timeout`` at all.

* serial: the ring algorithms on a stand-in transport whose every wait costs
  0.3 s of a fake clock: with ``timeout=2`` the call raises once the call's
  2 s are spent (after 7 of the 8-rank ring's 14 steps), each wait bounded by
  what is left, where a per-step bound never fired (this is what shows the
  steps share one deadline: a peer that never enters stalls every rank at its
  first blocked wait, so the MPI tests below bound the time and check the
  error's names, and a per-step bound would pass their timing too);
* MPI (3-4 ranks): the last rank stalls (it waits for a message the others
  send only after they raised, so it never enters the call); every other rank
  raises ``CommTimeout`` naming itself and the operation within
  ``timeout + 0.5`` s: the ring allreduce of 4 MiB (with the first round, and
  without it: ``COMMLIB_CHECK_ARGS=0``, so the ring's own steps time out),
  ``commlib.nn.ring_attention`` and ``Communicator.recv`` (contiguous and with
  a datatype), ``timeout=2``.  The stalled communicator is a
  fresh duplicate, abandoned afterwards (a plain communicator whose call timed
  out keeps the call's messages posted; nothing else runs on it).

Run: ``python -P -m pytest tests/test_call_timeout.py`` and
``mpiexec -n N python -P -m pytest --with-mpi -m mpi tests/test_call_timeout.py`` (N = 3, 4).
"""
from __future__ import annotations

import time
import types

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.collectives.allgather_ring import allgather_ring
from commlib.collectives.allreduce_ring import allreduce_ring
from commlib.core import seconds
from commlib.core.config import config
from commlib.core.errors import CommTimeout, InvalidArgument
from commlib.core.tags import TagAllocator

T = 2.0      # the calls' timeout (seconds)
SLACK = 0.5  # the bound: a call raises within T + SLACK


# ------------------------------------------------------------------ serial
class _Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


class _SlowRing:
    """TEST DOUBLE: rank 0 of an ``n``-rank ring whose every wait costs
    ``step`` seconds of the fake clock; a wait bounded by less raises
    CommTimeout, as a transport's bounded wait does."""

    def __init__(self, n: int, clock: _Clock, step: float):
        self.rank, self.size, self.clock, self.step = 0, n, clock, step
        self.tags = TagAllocator(0, 1 << 20)
        self.bounds = []

    def irecv(self, buf, source, tag):
        return object()

    def isend(self, buf, dest, tag):
        return object()

    def waitall(self, requests, timeout=None, op="waitall"):
        assert timeout is not None and not isinstance(timeout, seconds.Deadline), timeout
        self.bounds.append(timeout)
        if timeout < self.step:
            self.clock.now += timeout
            raise CommTimeout(f"not complete after {timeout:.3g} s", rank=self.rank, op=op)
        self.clock.now += self.step


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(seconds, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", ["allreduce_ring", "allgather_ring"])
def test_ring_steps_share_the_calls_deadline(clock, algorithm):
    n, step = 8, 0.3
    tp = _SlowRing(n, clock, step)
    start = clock.now
    with pytest.raises(CommTimeout):
        if algorithm == "allreduce_ring":
            allreduce_ring(tp, np.ones(64 * n), "sum", timeout=T)  # 2 (n - 1) = 14 steps of 0.3 s
        else:
            allgather_ring(tp, np.ones(64), np.empty(64 * n), timeout=T)  # n - 1 = 7 steps
    spent = clock.now - start
    assert spent == pytest.approx(T), (spent, tp.bounds)
    # every wait was bounded by what was left of the call's 2 s, not 2 s afresh
    assert tp.bounds == pytest.approx([T - i * step for i in range(len(tp.bounds))]), tp.bounds
    assert len(tp.bounds) == int(T // step) + 1


@pytest.mark.timeout(30)
def test_a_deadline_handed_down_is_shared(clock):
    tp = _SlowRing(4, clock, 0.3)
    dl = seconds.Deadline(1.0)
    clock.now += 0.5  # half of it spent before the algorithm starts (e.g. in a first round)
    with pytest.raises(CommTimeout):
        allreduce_ring(tp, np.ones(64), timeout=dl)
    assert tp.bounds[0] == pytest.approx(0.5) and clock.now == pytest.approx(dl.at)


def test_call_deadline_and_restart():
    assert seconds.call_deadline(None) is None
    dl = seconds.call_deadline(2)
    assert isinstance(dl, seconds.Deadline) and dl.timeout == 2.0 and 0 < dl.left() <= 2.0
    assert seconds.call_deadline(dl) is dl  # an enclosing call's deadline is shared
    for bad in (-1, float("nan"), float("inf"), True, "2"):
        assert seconds.call_deadline(bad) is bad  # left for the call's validation to refuse
    again = seconds.restarted(dl)
    assert again is not dl and again.timeout == 2.0 and again.at >= dl.at
    assert seconds.time_left(None) is None and seconds.time_left(1.5) == 1.5
    assert seconds.check_timeout(dl, op="x") is dl and seconds.timeout_problem(dl) is None


# ------------------------------------------------------------------- MPI
def _stalled_call(call, comm):
    """The last rank of ``comm`` stalls: it waits on COMM_WORLD for the others'
    word that they raised, and never enters ``call``; every other rank runs
    ``call(comm)`` and returns ``(seconds until it raised, the error)``.  All
    ranks get every rank's outcome."""
    world = MPI.COMM_WORLD
    me, last = world.Get_rank(), world.Get_size() - 1
    got = None
    if me == last:
        for _ in range(last):
            world.recv(source=MPI.ANY_SOURCE, tag=4141)
    else:
        t0 = time.monotonic()
        try:
            call(comm)
            got = ("returned", time.monotonic() - t0, "")
        except Exception as exc:  # noqa: BLE001 - checked below, on every rank
            got = (type(exc).__name__, time.monotonic() - t0, str(exc))
        world.send(True, dest=last, tag=4141)
    return got, world.allgather(got)


def _check(everyone, op):
    took = [g[1] for g in everyone if g is not None]
    print(f"\n{op}: raised after {min(took):.3f}-{max(took):.3f} s (timeout {T:g} s) on {len(took)} ranks: {everyone[0][2]}")
    for r, g in enumerate(everyone[:-1]):
        assert g[0] == "CommTimeout", (r, g)
        assert g[2].startswith(f"rank {r}: {op}"), (r, g)  # names the rank and the operation
        assert g[1] < T + SLACK, (r, g)


@pytest.fixture
def stalled_comm():
    """A fresh duplicate of the world with its collectives' transport made (a
    first call on every rank), abandoned after the test: the stalled call's
    messages stay posted on it."""
    comm = commlib.init().dup()
    assert np.array_equal(comm.allreduce(np.ones(4)), np.full(4, comm.size))
    yield comm
    MPI.COMM_WORLD.Barrier()


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("check_args", [True, False], ids=["first-round", "ring-only"])
def test_ring_allreduce_raises_within_its_timeout(stalled_comm, check_args, monkeypatch):
    monkeypatch.setattr(config, "check_args", check_args)
    n = 1 << 19  # 4 MiB of float64: chunks far past the eager limit, 2 (size - 1) ring steps
    _, everyone = _stalled_call(lambda c: c.allreduce(np.ones(n), algorithm="ring", timeout=T), stalled_comm)
    _check(everyone, "allreduce")


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ring", "segmented-ring", "recursive_doubling"])
def test_an_in_place_allreduce_that_timed_out_holds_its_input_again(stalled_comm, algorithm, monkeypatch):
    """A plain communicator's bounded call: the ranks next to the stalled one
    have already reduced a neighbour's chunk into the buffer when they give
    up; the error must not leave them with a partial sum (the segmented ring:
    chunks exchanged in 2 KiB segments, eager, so a rank combines a whole
    chunk before the stall reaches it).  No first round: with one, the
    stalled rank stops every rank there, before any byte moves."""
    monkeypatch.setattr(config, "check_args", False)
    if algorithm == "segmented-ring":
        from commlib.collectives import reduce_scatter_ring  # noqa: PLC0415
        monkeypatch.setattr(reduce_scatter_ring, "SEGMENT_BYTES", 2 << 10)  # eager: sends finish unreceived
        algorithm = "ring"
    n = 1 << 19
    mine = np.arange(n, dtype=np.float64) * (stalled_comm.rank + 1) + 0.25
    buf = mine.copy()
    got, _ = _stalled_call(lambda c: c.allreduce(buf, algorithm=algorithm, timeout=T), stalled_comm)
    if got is not None:
        assert got[0] == "CommTimeout", got
        bad = np.flatnonzero(buf != mine)
        assert bad.size == 0, f"rank {stalled_comm.rank}: {bad.size} elements changed, first at {bad[:3]}"


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
def test_ring_attention_raises_within_its_timeout(stalled_comm):
    torch = pytest.importorskip("torch")
    from commlib.nn import ring_attention

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 256, 2, 32, generator=g, dtype=torch.float64) for _ in range(3))
    out = ring_attention(q, k, v, stalled_comm, timeout=30)  # every rank: the call works (and the transport is made)
    assert out.shape == q.shape
    _, everyone = _stalled_call(lambda c: ring_attention(q, k, v, c, timeout=T), stalled_comm)
    _check(everyone, "ring_attention")


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("typed", [False, True], ids=["contiguous", "datatype"])
def test_point_to_point_raises_within_its_timeout(stalled_comm, typed):
    """``recv(timeout=T)`` from the stalled rank raises CommTimeout naming the
    rank and the call within ``T + 0.5`` s, contiguous and with a datatype (a
    vector: every other float64), and writes nothing into ``buf``."""
    kw = {"datatype": MPI.DOUBLE.Create_vector(64, 1, 2).Commit(), "count": 1} if typed else {}
    buf = np.full(128, -1.0)
    last = stalled_comm.size - 1
    _, everyone = _stalled_call(lambda c: c.recv(buf, source=last, tag=5, timeout=T, **kw), stalled_comm)
    _check(everyone, "recv")
    assert np.all(buf == -1.0)
    if typed:
        kw["datatype"].Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_point_to_point_timeout_argument():
    """``send``/``recv``/``sendrecv`` take ``timeout=``: a bad one is refused
    before anything is posted; a good one lets the call complete as without."""
    comm = commlib.init()
    r, n = comm.rank, comm.size
    buf = np.zeros(8)
    for value in (float("nan"), -1.0, 0, True, "2"):
        with pytest.raises(InvalidArgument, match=f"rank {r}: recv"):
            comm.recv(buf, source=(r + 1) % n, tag=6, timeout=value)
        with pytest.raises(InvalidArgument, match=f"rank {r}: send"):
            comm.send(buf, dest=(r + 1) % n, tag=6, timeout=value)
    got = np.zeros(8)
    comm.sendrecv(np.full(8, float(r)), (r + 1) % n, got, (r - 1) % n, sendtag=7, recvtag=7, timeout=30)
    assert np.all(got == (r - 1) % n)
    if r == 0:
        comm.send(np.arange(8.0), dest=1, tag=8, timeout=30)
    elif r == 1:
        comm.recv(got, source=0, tag=8, timeout=30)
        assert np.array_equal(got, np.arange(8.0))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0, True, "2"],
                         ids=["nan", "inf", "-1", "0", "True", "str"])
@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "allgather", "bcast", "alltoall", "barrier"])
def test_bad_timeout_on_one_rank_fails_everywhere(name, value):
    """A bad ``timeout`` on the last rank: InvalidArgument on every rank (that
    rank names the problem, the others that rank), before any byte moves; the
    same call with a good timeout works afterwards."""
    comm = commlib.init()
    world = MPI.COMM_WORLD
    last = comm.rank == comm.size - 1
    buf = np.arange(4.0 * comm.size)
    before = buf.copy()
    calls = {"allreduce": lambda t: comm.allreduce(buf, timeout=t),
             "reduce_scatter": lambda t: comm.reduce_scatter(buf, timeout=t),
             "allgather": lambda t: comm.allgather(buf, timeout=t),
             "bcast": lambda t: comm.bcast(buf, timeout=t),
             "alltoall": lambda t: comm.alltoall(buf, timeout=t),
             "barrier": lambda t: comm.barrier(timeout=t)}
    try:
        calls[name](value if last else 30)
        got = ("ok", "")
    except Exception as exc:  # noqa: BLE001
        got = (type(exc).__name__, str(exc))
    everyone = world.allgather(got)
    assert [g[0] for g in everyone] == ["InvalidArgument"] * comm.size, everyone
    assert got[1].startswith(f"rank {comm.rank}: {name}"), got
    if last:
        assert "timeout must be" in got[1], got
    elif comm.size > 1:
        assert f"rank(s) [{comm.size - 1}]" in got[1], got
    assert np.array_equal(buf, before), "the refused call wrote the buffer"
    calls[name](30)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "auto"])
def test_collectives_with_a_timeout_match_mpi(algorithm):
    """Every collective with ``timeout=`` (bounded first round, every step
    bounded by what is left) gives MPI's own result."""
    comm = commlib.init()
    world = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(1234 + r)
    x = rng.integers(-100, 100, 3 * n * 257).astype(np.float64)
    want = np.empty_like(x)
    world.Allreduce(x, want)
    assert np.array_equal(comm.allreduce(x, np.empty_like(x), algorithm=algorithm, timeout=30), want)
    assert np.array_equal(comm.iallreduce(x, np.empty_like(x), timeout=30).wait(60), want)
    rs = comm.reduce_scatter(x, timeout=30)
    assert np.array_equal(rs, want.reshape(n, -1)[r])
    ag = comm.allgather(x[:5], timeout=30)
    assert np.array_equal(ag, np.array(world.allgather(x[:5])))
    b = x.copy()
    comm.bcast(b, root=n - 1, timeout=30)
    assert np.array_equal(b, world.bcast(x, root=n - 1))
    a2a = comm.alltoall(x, timeout=30)
    want_a2a = np.empty_like(x)
    world.Alltoall(x, want_a2a)
    assert np.array_equal(a2a.reshape(-1), want_a2a)
    comm.barrier(timeout=30)
