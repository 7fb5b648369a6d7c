"""The engine's host plans (collectives/host_plans.py) and the general path meet.

A rank whose call runs from a plan (an exact, C-contiguous numpy array) and a
rank whose same call takes the general path (an ndarray subclass, a strided
view) make the same first round: one kept all-gather per group
(``FirstRoundRows``, a persistent collective on MPI, which matches only
itself).  Each case mixes the two paths across ranks, by a seeded draw, and
checks the result against an oracle computed here: the sum in the ring's
order (``tests/oracles.py``) and the root's data.
"""
import numpy as np
import pytest

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.timeout(120)]

import commlib  # noqa: E402
from commlib.core.errors import InvalidArgument  # noqa: E402
from oracles import ring_oracle  # noqa: E402 - tests/oracles.py


class _Sub(np.ndarray):
    """Not an exact ndarray: the engine's general path."""


@pytest.fixture(scope="module")
def comm():
    c = commlib.init().dup()
    yield c
    c.free()


def _general(rank: int, trial: int, seed: int) -> bool:
    """Whether ``rank`` takes the general path in ``trial`` (the same draw on every rank)."""
    return bool(np.random.default_rng([seed, trial]).integers(0, 2, 64)[rank % 64])


def _as(arr: np.ndarray, general: bool) -> np.ndarray:
    return arr.view(_Sub) if general else arr


@pytest.mark.parametrize("count", [1, 100, 128, 129, 700, 4096])  # one round (<= 1 KiB) and above it
def test_allreduce_mixed_paths(comm, seed, count):
    for trial in range(6):
        xs = [np.random.default_rng([seed, trial, r]).standard_normal(count) for r in range(comm.size)]
        x = xs[comm.rank].copy()
        # above the one round, the ring by name: "auto" picks recursive doubling on 3+
        # ranks, whose order is not the ring's
        got = comm.allreduce(_as(x, _general(comm.rank, trial, seed)), algorithm="auto" if count <= 128 else "ring")
        assert np.asarray(got).tobytes() == ring_oracle(xs, "sum").tobytes(), (trial, count)


@pytest.mark.parametrize("count", [1, 100, 128, 129, 4096])
@pytest.mark.parametrize("root_pick", [0, -1])
def test_bcast_mixed_paths(comm, seed, count, root_pick):
    root = root_pick % comm.size
    for trial in range(6):
        data = np.random.default_rng([seed, trial]).standard_normal(count)
        buf = data.copy() if comm.rank == root else np.full(count, -1.0)
        got = comm.bcast(_as(buf, _general(comm.rank, trial, seed)), root)
        assert np.asarray(got).tobytes() == data.tobytes(), (trial, count, root)
        assert buf.tobytes() == data.tobytes()


def test_barrier_against_a_general_path_call(comm, seed, monkeypatch):
    """A planned barrier on some ranks while the others make a general-path
    allreduce (an ndarray subclass): the two first rounds meet, every rank
    raises InvalidArgument; where the draw puts every rank on one side, the
    call simply works.  Either way both paths work afterwards.  (With the
    argument agreement on, whatever COMMLIB_CHECK_ARGS says: without it a
    barrier has no first round to meet the allreduce's.)"""
    from commlib.core.config import config

    monkeypatch.setattr(config, "check_args", True)
    for trial in range(6):
        mine = _general(comm.rank, trial, seed)
        mixed = len({_general(r, trial, seed) for r in range(comm.size)}) > 1
        x = np.ones(3).view(_Sub)
        if mixed:
            with pytest.raises(InvalidArgument):
                comm.allreduce(x) if mine else comm.barrier()
            assert np.asarray(x).tolist() == [1.0] * 3  # nothing written
        elif mine:
            assert np.asarray(comm.allreduce(x)).tolist() == [float(comm.size)] * 3
        else:
            comm.barrier()
        comm.barrier()
        y = np.full(3, float(comm.rank))
        assert comm.allreduce(y).tolist() == [float(sum(range(comm.size)))] * 3


@pytest.mark.mpi(min_size=2)
def test_planned_calls_that_differ_are_refused_everywhere(comm):
    """Rank 0 broadcasts while the others all-reduce, both from plans: every
    rank raises InvalidArgument, nothing is written, and the group still works."""
    x = np.arange(4, dtype=np.float64) + comm.rank
    before = x.copy()
    with pytest.raises(InvalidArgument) as err:
        if comm.rank == 0:
            comm.bcast(x, 0)
        else:
            comm.allreduce(x)
    assert err.value.rank == comm.rank
    assert x.tobytes() == before.tobytes()
    y = np.ones(4)
    assert comm.allreduce(y).tolist() == [float(comm.size)] * 4
    big = np.arange(1000, dtype=np.float64) if comm.rank == 1 else np.zeros(1000)
    assert comm.bcast(big, 1).tobytes() == np.arange(1000, dtype=np.float64).tobytes()


@pytest.mark.mpi(min_size=2)
def test_bcast_read_only_off_root_refused_everywhere(comm):
    """A read-only buffer is fine at the root (only read) and refused on every
    rank when it is another rank's (it would be written)."""
    buf = np.arange(8, dtype=np.float64)
    buf.flags.writeable = False
    got = comm.bcast(buf if comm.rank == 0 else np.arange(8, dtype=np.float64), 0)
    assert got.tolist() == list(range(8))
    with pytest.raises(InvalidArgument):
        comm.bcast(buf if comm.rank == 1 else np.arange(8, dtype=np.float64), 0)


@pytest.mark.mpi(min_size=2, max_size=2)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "avg"])
@pytest.mark.parametrize("count", [1, 5, 4097])
def test_two_rank_ring_in_one_exchange_gives_the_rings_bits(comm, seed, op, count, monkeypatch):
    """At 2 ranks the ring of a vector up to allreduce_ring.PAIR_BYTES takes one
    exchange and combines in the ring's order: the same bits as the two-step
    ring (PAIR_BYTES 0), signed zeros and NaN payloads included, in place and
    out of place."""
    from commlib.collectives import allreduce_ring as ar

    rng = np.random.default_rng([seed, comm.rank])
    x = rng.standard_normal(count)
    x[:: 3] = np.where(comm.rank, 0.0, -0.0)  # max/min of +0 and -0: order decides the sign
    if count > 4 and op in ("max", "min"):
        # NaN payloads: max/min combine in the ring's exact order; + and * at 2 ranks
        # take one call (one_round.ring_order_steps), equal to the ring's up to the
        # payload of a NaN made from two NaNs (every rank still alike)
        x[1] = np.frombuffer(np.uint64(0x7FF8000000000001 + comm.rank).tobytes(), np.float64)[0]
    tp = comm.collective_transport()
    one, out = x.copy(), np.empty_like(x)
    ar.allreduce_ring(tp, one, op)
    ar.allreduce_ring(tp, out, op, sendbuf=x)
    monkeypatch.setattr(ar, "PAIR_BYTES", 0)
    two = x.copy()
    ar.allreduce_ring(tp, two, op)
    assert one.tobytes() == two.tobytes() == out.tobytes()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["max", "min"])
def test_one_round_and_ring_agree_on_signed_zeros(comm, seed, op):
    """max/min of +0 and -0 depends on operand order (numpy returns the second
    of two equal operands): the one round and the ring (host, any size) must
    combine in the same order, the ring's (``ring_order``)."""
    count = 96  # 768 B: one round under "auto"
    rng = np.random.default_rng([seed, comm.rank])
    x = np.where(rng.integers(0, 2, count) == 1, 0.0, -0.0)
    small = comm.allreduce(x.copy(), op=op)
    ring = comm.allreduce(x.copy(), op=op, algorithm="ring")
    assert small.tobytes() == ring.tobytes()
