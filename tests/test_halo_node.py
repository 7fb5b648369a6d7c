"""The node-local halo exchange (shared memory) and the heat solver on it.

Every owned cell holds ``step * 1e6 + its global linear index`` (exact in
float64), so a ghost cell is checked against the cell it mirrors *and* the
step it must come from: a mailbox overwritten before its reader copied it
out (a rank two steps ahead) shows as the wrong step.  Ranks sleep at random
between their calls, so each run mixes ranks that lead and ranks that lag.
"""
import os
import random
import time

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.apps import heat
from commlib.apps.heat import block_of, numpy_update, region_updates
from commlib.apps.heat import timeloop
from commlib.collectives import NodeHalo
from commlib.core.errors import CommTimeout, InvalidArgument
from commlib.transports import shm

SENTINEL = -1.0


def _cart(comm, grid):
    return comm.cart_create(dims=commlib.compute_dims(comm.size, len(grid)), periods=[False] * len(grid))


def _layout(grid, shape, offset):
    """(lin, face): the global linear index at every padded cell that is owned
    or a face ghost inside the grid (-1 elsewhere), and the face-ghost mask."""
    d = len(grid)
    padded = [n + 2 for n in shape]
    lin = np.full(padded, -1, np.int64)
    face = np.zeros(padded, bool)
    for idx in np.ndindex(*padded):
        g = [o + i - 1 for o, i in zip(offset, idx)]
        out = [not 1 <= i <= n for i, n in zip(idx, shape)]
        if sum(out) > 1 or not all(0 <= x < n for x, n in zip(g, grid)):
            continue
        lin[idx] = np.ravel_multi_index(g, grid)
        face[idx] = any(out)
    return lin, face


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("grid", [(23,), (13, 11), (9, 8, 7)])
def test_ghosts_hold_the_neighbours_cells_of_the_right_step_under_random_delays(grid):
    comm = commlib.init()
    cart = _cart(comm, grid)
    shape, offset = block_of(grid, cart.dims, cart.coords)
    halo = NodeHalo(cart, shape)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, halo.name)), "the segment's name outlived the setup"
    lin, face = _layout(grid, shape, offset)
    owned = lin[halo.interior].astype(np.float64)
    other = (lin < 0)  # boundary ghosts, edges and corners: never written
    fields = [np.full(halo.shape, SENTINEL), np.full(halo.shape, SENTINEL)]
    rng = random.Random(7919 * comm.rank + len(grid))
    fields[0][halo.interior] = owned
    halo.push(fields[0], 0)
    for s in range(60):
        p = s & 1
        if rng.random() < 0.3:
            time.sleep(rng.random() * 2e-3)
        halo.pull(fields[p], s)
        got = fields[p][face]
        want = s * 1e6 + lin[face]
        assert np.array_equal(got, want), (f"rank {comm.rank} step {s}: ghosts of steps "
                                           f"{sorted(set(((got - lin[face]) / 1e6).round().astype(int)))}")
        assert np.all(fields[p][other] == SENTINEL), "a ghost without a neighbour was written"
        fields[1 - p][halo.interior] = (s + 1) * 1e6 + owned
        if rng.random() < 0.3:
            time.sleep(rng.random() * 2e-3)
        halo.push(fields[1 - p], s + 1)
    comm.barrier()
    halo.free()
    cart.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_neighbour_that_never_pushes_is_a_bounded_timeout_naming_it():
    comm = commlib.init()
    cart = _cart(comm, (4 * comm.size,))
    shape, _ = block_of((4 * comm.size,), cart.dims, cart.coords)
    halo = NodeHalo(cart, shape, timeout=0.3)
    f = np.full(halo.shape, SENTINEL)
    if cart.rank != 1:  # rank 1 stays silent
        halo.push(f, 0)
    if cart.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(CommTimeout, match=r"rank 1 did not publish .* step 0 within 0.3 s") as err:
            halo.pull(f, 0)
        assert 0.25 < time.monotonic() - t0 < 5
        assert err.value.rank == 0 and err.value.op == "NodeHalo.pull"
        assert f[0] == SENTINEL and f[-1] == SENTINEL, "a ghost was written by a pull that timed out"
    comm.barrier()
    halo.free()
    cart.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_rank_that_cannot_share_memory_makes_every_rank_refuse_and_solve_fall_back(monkeypatch):
    comm = commlib.init()
    last = comm.size - 1
    if comm.rank == last:
        monkeypatch.setattr(shm, "supported", lambda: "no shared memory on this test rank")
    grid = (13, 11)
    cart = _cart(comm, grid)
    shape, _ = block_of(grid, cart.dims, cart.coords)
    with pytest.raises(InvalidArgument) as err:
        NodeHalo(cart, shape)
    if comm.rank == last:
        assert "no shared memory on this test rank" in str(err.value)
    else:
        assert str(last) in str(err.value)
    cart.free()
    with pytest.raises(InvalidArgument):
        heat.solve(comm, grid, steps=5, halo="shm")
    res, local = heat.solve(comm, grid, steps=5)  # "auto": messages
    assert res.extra["halo"] == "mpi"
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, ref = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=5, backend="numpy")
        assert np.array_equal(full, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("grid", [(13, 11), (17, 9, 8)])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("halo", ["shm", "mpi"])
def test_solve_on_either_halo_equals_one_rank(halo, overlap, grid):
    comm = commlib.init()
    res, local = heat.solve(comm, grid, steps=7, halo=halo, overlap=overlap)
    assert res.extra["halo"] == halo
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, ref = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=7, backend="numpy")
        assert np.array_equal(full, ref), f"{comm.size} ranks, halo={halo}, overlap={overlap}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("planes", [1, 4])
@pytest.mark.parametrize("dims", [2, 3])
def test_solve_with_either_kernel_equals_one_rank(monkeypatch, planes, dims):
    """Whichever kernel the timing picks, the field is the one of one rank."""
    def tune(self, comm, p, overlap):
        if planes == 4 and self.backend == "numba":  # (not the numpy reference run)
            assert self._four is not None
            self.run_all, self.run_inner, self.run_shell = self._four
            self.planes = 4

    monkeypatch.setattr(timeloop.Block, "tune", tune)
    monkeypatch.setattr(timeloop, "TUNE_CELLS", 0)  # this small grid has both kernels
    comm = commlib.init()
    grid = (8 * comm.size + 3, 9, 10) if dims == 3 else (8 * comm.size + 5, 13)
    _, local = heat.solve(comm, grid, steps=6)
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, ref = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=6, backend="numpy")
        assert np.array_equal(full, ref)


# ------------------------------------------------------------ no MPI needed
@pytest.mark.parametrize("shape", [(9, 7, 6), (4, 5, 6), (13, 3, 5), (1, 4, 4), (11, 6), (3, 9)])
@pytest.mark.parametrize("mixed", [False, True])
def test_four_planes_per_pass_equals_numpy(shape, mixed):
    d = len(shape)
    sides = ((False, True), (True, False), (False, False))[:d] if mixed else ((True, True),) * d
    rng = np.random.default_rng(sum(shape))
    u = rng.random([n + 2 for n in shape])
    c = np.array([0.11, 0.13, 0.07])[:d]
    width = (1,) * d
    full_lo, full_hi = width, tuple(n + 1 for n in shape)
    ref = np.zeros_like(u)
    numpy_update(u, ref, c, full_lo, full_hi)
    for planes in (1, 4):
        fields = (u.copy(), np.zeros_like(u))
        run_all, run_inner, run_shell = region_updates("numba", fields, c, shape, width, sides, planes=planes)
        run_all(0)
        assert np.array_equal(fields[1], ref), f"run_all, {planes} plane(s) per pass"
        fields[1][...] = 0
        run_inner(0)
        run_shell(0)
        assert np.array_equal(fields[1], ref), f"interior + shell, {planes} plane(s) per pass"
        # three steps in one call: step k reads fields[k & 1]
        fields[0][...] = u
        fields[1][...] = 0
        run_all(0, 3)
        a, b = u.copy(), np.zeros_like(u)
        for _ in range(3):
            numpy_update(a, b, c, full_lo, full_hi)
            a, b = b, a
        assert np.array_equal(fields[1], a)


def test_a_segment_outlives_its_name_and_is_shared():
    name = f"commlib-test-{os.getpid()}-{random.getrandbits(32):x}"
    a = shm.Segment.create(name, 4096)
    b = shm.Segment.attach(name)
    assert b.nbytes == 4096 and not a.buf.any()
    a.buf[:3] = (1, 2, 3)
    assert list(b.buf[:3]) == [1, 2, 3]
    a.unlink()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
    b.buf[5] = 9
    assert a.buf[5] == 9
    with pytest.raises(OSError):
        shm.Segment.attach(name)
    a.close()
    b.close()
    a.close()  # idempotent


def test_a_segment_shorter_than_asked_is_refused():
    name = f"commlib-test-{os.getpid()}-{random.getrandbits(32):x}"
    a = shm.Segment.create(name, 64)
    try:
        with pytest.raises(OSError, match="64 bytes, expected 128"):
            shm.Segment.attach(name, 128)
        with pytest.raises(FileExistsError):
            shm.Segment.create(name, 64)
    finally:
        a.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


@pytest.mark.parametrize("kwargs", [dict(halo="tcp"), dict(halo="shm", time_block=2), dict(halo="shm", backend="cuda"),
                                    dict(halo=None)])
def test_solve_refuses_a_halo_it_cannot_run(kwargs):
    with pytest.raises(InvalidArgument, match="halo"):
        heat.solve(commlib.init(MPI.COMM_SELF), (9, 8), steps=2, **kwargs)


def test_supported_here():
    assert shm.supported() is None  # the test machines are x86-64 Linux


def test_a_rank_that_is_its_own_neighbour_or_a_bad_timeout_is_refused():
    comm = commlib.init(MPI.COMM_SELF)
    cart = comm.cart_create(dims=[1, 1], periods=[True, False])
    with pytest.raises(InvalidArgument, match="periodic with one rank"):
        NodeHalo(cart, (4, 4))
    cart.free()
    cart = comm.cart_create(dims=[1], periods=[False])
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(InvalidArgument, match="timeout"):
            NodeHalo(cart, (4,), timeout=bad)
    halo = NodeHalo(cart, (4,), timeout=0.5)  # no neighbour: nothing to share, nothing to wait for
    f = np.full(halo.shape, SENTINEL)
    halo.push(f, 0)
    halo.pull(f, 0)
    assert np.all(f[[0, -1]] == SENTINEL) and halo.faces == []
    halo.free()
    cart.free()
