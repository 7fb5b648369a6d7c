"""Halo exchange: every ghost cell checked against the global coordinates it mirrors.

Each test field holds, in every owned cell, that cell's global coordinate
along one dimension (one field per dimension, so multi-field exchange is
covered too).  After the exchange a ghost cell must hold the coordinate of the
cell it mirrors (wrapped on periodic dimensions), or keep its sentinel when it
lies beyond a non-periodic edge, or is an edge/corner ghost with
``corners=False``.
"""
import itertools

import numpy as np
import pytest

import commlib
from commlib.apps.heat import block_of
from commlib.collectives import HaloExchange
from commlib.core.errors import InvalidArgument

SENTINEL = -1.0

CASES = [
    # grid, periods, width, corners
    ((11,), (False,), 1, True),
    ((11,), (True,), 2, True),
    ((7, 5), (False, False), 1, True),
    ((7, 5), (True, False), (2, 1), True),
    ((7, 5), (True, True), 1, False),
    ((6, 5, 4), (False, True, False), 1, True),
    ((6, 5, 4), (True, True, True), (1, 2, 1), True),
    ((6, 5, 4), (True, False, True), 1, False),
]


def make_fields(cart, grid, width, like=None):
    shape, offset = block_of(grid, cart.dims, cart.coords)
    halo = HaloExchange(cart, shape, width=width, corners=True)
    fields = []
    for i in range(len(grid)):
        f = np.full(halo.shape, SENTINEL)
        coord = np.arange(offset[i], offset[i] + shape[i], dtype=np.float64)
        s = [1] * len(grid)
        s[i] = shape[i]
        f[halo.interior] = np.broadcast_to(coord.reshape(s), shape)
        fields.append(f)
    return shape, offset, fields


def expected(grid, periods, shape, offset, width, corners, i):
    """The value dimension-i field must hold at every padded index."""
    w = (width,) * len(grid) if isinstance(width, int) else width
    padded = [n + 2 * x for n, x in zip(shape, w)]
    out = np.full(padded, SENTINEL)
    for idx in itertools.product(*[range(p) for p in padded]):
        g = [o + p - x for o, p, x in zip(offset, idx, w)]
        outside = [not (x <= p < x + n) for p, x, n in zip(idx, w, shape)]
        if sum(outside) > 1 and not corners:
            continue
        ok = True
        for d in range(len(grid)):
            if not 0 <= g[d] < grid[d]:
                if periods[d]:
                    g[d] %= grid[d]
                else:
                    ok = False
        if ok:
            out[idx] = g[i]
    return out


def run_case(grid, periods, width, corners, device=False):
    comm = commlib.init()
    cart = comm.cart_create(dims=[0] * len(grid), periods=periods)
    shape, offset = block_of(grid, cart.dims, cart.coords)
    w = (width,) * len(grid) if isinstance(width, int) else tuple(width)
    # decided from every rank's block, so all ranks skip alike
    for r in range(cart.size):
        other, _ = block_of(grid, cart.dims, cart.coords_of(r))
        if any(x > n or n == 0 for x, n in zip(w, other)):
            cart.free()
            pytest.skip("halo wider than a local block at this rank count (tested separately)")
    halo = HaloExchange(cart, shape, width=width, corners=corners)
    _, _, fields = make_fields(cart, grid, width)
    if device:
        from numba import cuda

        dfields = [cuda.to_device(f) for f in fields]
        halo.exchange(*dfields)
        fields = [d.copy_to_host() for d in dfields]
    else:
        halo.exchange(*fields)
    for i, f in enumerate(fields):
        want = expected(grid, cart.periods, shape, offset, width, corners, i)
        bad = np.argwhere(f != want)
        assert bad.size == 0, f"rank {comm.rank} field {i}: ghost {tuple(bad[0])} = {f[tuple(bad[0])]}, want {want[tuple(bad[0])]}"
    halo.free()
    cart.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("grid,periods,width,corners", CASES)
def test_halo_host(grid, periods, width, corners):
    run_case(grid, periods, width, corners)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("grid,periods,width,corners", [CASES[3], CASES[6]])
def test_halo_device_simulator(grid, periods, width, corners):
    """Device fields (numba device arrays; the CUDA simulator without a GPU):
    faces packed on the device, staged through host memory when MPI is not CUDA-aware."""
    run_case(grid, periods, width, corners, device=True)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_halo_overlap_start_wait():
    """start() packs before returning: changing the interior afterwards must not
    change what the neighbours receive."""
    comm = commlib.init()
    cart = comm.cart_create(dims=[0], periods=[True])
    shape, offset = block_of((9 * comm.size,), cart.dims, cart.coords)
    halo = HaloExchange(cart, shape, width=1)
    f = np.zeros(halo.shape)
    f[1:-1] = np.arange(offset[0], offset[0] + shape[0])
    req = halo.start(f)
    f[1:-1] = -5.0  # interior work while messages fly
    req.wait(timeout=30)
    n = 9 * comm.size
    assert f[0] == (offset[0] - 1) % n
    assert f[-1] == (offset[0] + shape[0]) % n


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
def test_halo_wider_than_block_fails_everywhere():
    """Global 5 cells over 3 ranks: blocks 2, 2, 1; width 2 fits ranks 0 and 1
    only, yet every rank raises, before any halo message moves."""
    comm = commlib.init()
    sub = comm.split(0 if comm.rank < 3 else 1, comm.rank)
    if comm.rank >= 3:
        return
    cart = sub.cart_create(dims=[3], periods=[False])
    shape, _ = block_of((5,), cart.dims, cart.coords)
    with pytest.raises(InvalidArgument) as err:
        HaloExchange(cart, shape, width=2)
    msg = str(err.value)
    assert f"rank {cart.rank}" in msg and "HaloExchange" in msg
    assert ("wider than the local block" in msg) if cart.rank == 2 else ("[2]" in msg)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_halo_bad_fields_fail_everywhere():
    comm = commlib.init()
    cart = comm.cart_create(dims=[0, 0], periods=[True, True])
    halo = HaloExchange(cart, (4, 4), width=1)
    if comm.size > 4:  # some rank is not the last one's neighbour: its abort then breaks the plan
        pytest.skip("the plan survives a bad call only when every rank neighbours the offender "
                    "(tests/test_bad_input.py covers the other case)")
    good = np.zeros(halo.shape)
    # wrong shape on one rank only (the last): every rank raises
    f = np.zeros((7, 6)) if comm.rank == comm.size - 1 else good
    with pytest.raises(InvalidArgument, match="HaloExchange.exchange"):
        halo.exchange(f)
    with pytest.raises(InvalidArgument, match="dtype float32"):
        halo.exchange(np.zeros(halo.shape, np.float32))
    big = np.zeros((6, 12))
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        halo.exchange(big[:, ::2])
    halo.exchange(good)  # the plan still works afterwards


def test_halo_needs_cartesian():
    comm = commlib.init(__import__("mpi4py").MPI.COMM_SELF)
    with pytest.raises(InvalidArgument, match="Cartesian"):
        HaloExchange(comm, (4,), width=1)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["flag", "frombuffer"])
def test_halo_read_only_field_on_one_rank_fails_everywhere(how):
    """The last rank passes a read-only field (its writeable flag cleared, or a
    view of an immutable ``bytes``): every rank raises InvalidArgument in that
    same exchange (all ranks neighbour each other on this grid), no ghost cell
    is written anywhere, the read-only memory is untouched, and the plan works
    afterwards.  The old code wrote the ghost cells into the read-only array."""
    from mpi4py import MPI  # noqa: PLC0415

    comm = commlib.init()
    cart = comm.cart_create(dims=[0, 0], periods=[True, True])
    halo = HaloExchange(cart, (4, 4), width=1)
    if comm.size > 4:
        pytest.skip("every rank neighbours the offender only up to 4 ranks (2x2)")
    try:
        f = halo.allocate(fill=SENTINEL)
        f[halo.interior] = cart.rank
        before = f.copy()
        last = comm.rank == comm.size - 1
        arg, blob = f, None
        if last:
            if how == "flag":
                arg = f.copy()
                arg.flags.writeable = False
            else:
                blob = f.tobytes()
                arg = np.frombuffer(blob, dtype=f.dtype).reshape(f.shape)
        try:
            halo.exchange(arg, timeout=30)
            got = ("ok", "")
        except Exception as exc:  # noqa: BLE001
            got = (type(exc).__name__, str(exc))
        everyone = MPI.COMM_WORLD.allgather(got)
        assert [g[0] for g in everyone] == ["InvalidArgument"] * comm.size, everyone
        msg = got[1]
        if last:
            assert "read-only" in msg and msg.startswith(f"rank {cart.rank}: HaloExchange.exchange"), msg
            assert np.array_equal(arg, before)  # nothing written into the read-only memory
            if blob is not None:
                assert blob == before.tobytes()
        else:
            assert f"rank {comm.size - 1}" in msg and "read-only" in msg, msg
            assert np.array_equal(f, before), "a ghost cell was written by the refused exchange"
        halo.exchange(f, timeout=30)  # the plan still works
        assert not np.array_equal(f, before)  # ghost cells filled
    finally:
        halo.free()
        cart.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_halo_misuse_is_said_once_per_offender():
    """The last rank passes a read-only field; it neighbours every other rank in
    several directions (a periodic 2-D grid with corners: at 2 ranks, six of
    rank 0's eight messages come from it).  Every other rank's error says it
    once, one clause naming it, however many of its messages aborted."""
    comm = commlib.init()
    cart = comm.cart_create(dims=[0, 0], periods=[True, True])
    halo = HaloExchange(cart, (4, 4), width=1)
    if comm.size > 4:
        pytest.skip("every rank neighbours the offender only up to 4 ranks (2x2)")
    last = comm.size - 1
    try:
        f = halo.allocate(fill=SENTINEL)
        if comm.rank == last:
            f.flags.writeable = False
        with pytest.raises(InvalidArgument) as ei:
            halo.exchange(f, timeout=30)
        msg = str(ei.value)
        if comm.rank != last:
            assert msg.count("aborted the exchange") == 1 and msg.count(f"rank {last}") == 1, msg
            assert msg == (f"rank {cart.rank}: HaloExchange.exchange: rank {last} aborted the exchange: a field is "
                           "read-only; no ghost cell was written"), msg
            assert ei.value.offenders == (last,)
    finally:
        halo.free()
        cart.free()
