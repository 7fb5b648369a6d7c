"""The heat solver: rank-count independence (bit for bit) and O(dx^2) convergence
against the exact solution exp(-d pi^2 alpha t) prod sin(pi x_i)."""
import math

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.apps import heat
from commlib.core.errors import InvalidArgument


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,grid,steps", [
    ("numpy", (13, 11), 20),
    ("numba", (13, 11), 20),
    ("numba", (9, 7, 8), 10),
    ("numpy", (9, 7, 8), 10),
])
def test_any_rank_count_equals_one_rank(backend, grid, steps):
    comm = commlib.init()
    res, local = heat.solve(comm, grid, steps=steps, backend=backend)
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, ref = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=steps, backend=backend)
        assert np.array_equal(full, ref), f"{comm.size} ranks differ from 1 rank"
        assert res.rel_l2_error < 1e-2


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(600)
def test_cuda_backend_simulator_matches_one_rank():
    comm = commlib.init()
    grid, steps = (6, 5), 2
    _, local = heat.solve(comm, grid, steps=steps, backend="cuda")
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, ref = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=steps, backend="cuda")
        assert np.array_equal(full, ref)
        _, host = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=steps, backend="numpy")
        np.testing.assert_allclose(full, host, rtol=1e-13, atol=1e-15)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dims", [2, 3])
def test_error_falls_as_dx_squared(dims):
    comm = commlib.init(MPI.COMM_SELF)
    sizes = [8, 16, 32] if dims == 2 else [6, 12, 24]
    errors = []
    for n in sizes:
        res, _ = heat.solve(comm, [n] * dims, t_final=0.02, backend="numba")
        assert abs(res.t_final - 0.02) < 1e-12
        errors.append(res.l2_error)
    orders = [math.log2(errors[i] / errors[i + 1]) * 1.0 / math.log2((sizes[i + 1] + 1) / (sizes[i] + 1))
              for i in range(len(sizes) - 1)]
    for p in orders:
        assert 1.8 < p < 2.2, f"observed order {orders}, errors {errors}"


def test_shell_and_interior_cover_each_cell_once():
    for shape in [(1,), (2,), (5,), (1, 1), (2, 3), (5, 4), (1, 3, 2), (4, 5, 6)]:
        width = (1,) * len(shape)
        count = np.zeros([n + 2 for n in shape], int)
        lo, hi = heat.interior_region(shape, width)
        count[tuple(slice(a, b) for a, b in zip(lo, hi))] += 1
        for lo, hi in heat.shell_regions(shape, width):
            count[tuple(slice(a, b) for a, b in zip(lo, hi))] += 1
        inner = tuple(slice(1, 1 + n) for n in shape)
        assert (count[inner] == 1).all(), shape
        assert count.sum() == np.prod(shape)


def test_decompose_spreads_remainder():
    parts = [heat.decompose(10, 3, i) for i in range(3)]
    assert parts == [(4, 0), (3, 4), (3, 7)]


def test_bad_input():
    comm = commlib.init(MPI.COMM_SELF)
    with pytest.raises(InvalidArgument, match="unknown backend 'fortran'"):
        heat.solve(comm, (8, 8), backend="fortran")
    with pytest.raises(InvalidArgument, match="cfl"):
        heat.solve(comm, (8, 8), cfl=1.5)
    with pytest.raises(SystemExit):
        heat.main(["--backend", "fortran"])


def test_cli_json_and_plot(tmp_path):
    import json

    out = tmp_path / "heat.json"
    png = tmp_path / "mid.png"
    rc = heat.main(["--dims", "2", "--grid", "12", "--steps", "5", "--backend", "numpy", "--verify",
                    "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    rec = json.loads(out.read_text())
    for key in ("grid", "ranks", "steps", "l2_error", "max_error", "mlups", "comm_fraction", "verified"):
        assert key in rec
    assert rec["verified"] is True and rec["grid"] == [12, 12]
    assert png.stat().st_size > 1000


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_smaller_than_ranks_fails_on_every_rank():
    comm = commlib.init()
    with pytest.raises(InvalidArgument, match=rf"rank {comm.rank}: heat.solve: grid \[1, 1\] has 1 point"):
        heat.solve(comm, (1, 1), steps=1, backend="numpy")
    assert heat.main(["--dims", "2", "--grid", "1", "--steps", "1", "--no-progress"]) == 2
    comm.barrier()  # every rank got here: nobody was left waiting
