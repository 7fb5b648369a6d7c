"""The heat solver: rank-count independence (bit for bit) and O(dx^2) convergence
against the exact solution exp(-d pi^2 alpha t) prod sin(pi x_i)."""
import itertools
import math

import sys
import time
from pathlib import Path

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
    assert heat.main(["--backend", "fortran"]) == 2


@pytest.mark.parametrize("kwargs,words", [
    (dict(steps=-1), "steps must be a positive integer, got -1"),
    (dict(steps=0), "steps must be a positive integer, got 0"),
    (dict(steps=2.5), "steps must be a positive integer, got 2.5"),
    (dict(steps=True), "steps must be a positive integer, got True"),
    (dict(t_final=-1.0), "t_final must be a positive, finite model time, got -1.0"),
    (dict(t_final=float("nan")), "t_final must be a positive, finite model time, got nan"),
    (dict(t_final=0.0), "t_final must be a positive, finite model time, got 0.0"),
    (dict(alpha=float("nan")), "alpha=nan"),
    (dict(alpha=float("inf")), "alpha=inf"),
    (dict(cfl=True), "cfl=True"),
    (dict(grid=(8.7, 8)), r"grid \[8.7, 8\] must have 1 to 3 positive integer sizes"),
    (dict(grid=(True, 8)), r"grid \[True, 8\] must have 1 to 3 positive integer sizes"),
])
def test_solve_refuses_values_it_would_truncate_or_run_into_nan(kwargs, words):
    """A step count or grid size that is not an integer is refused, never truncated
    (2.5 steps used to run 2); a negative step count or model time, or a NaN or
    infinite diffusivity, used to run and return negative MLUPS or NaN fields."""
    comm = commlib.init(MPI.COMM_SELF)
    kwargs = dict(kwargs)
    grid = kwargs.pop("grid", (8, 8))
    with pytest.raises(InvalidArgument, match=rf"rank 0: heat.solve: .*{words}"):
        heat.solve(comm, grid, backend="numpy", **kwargs)
    # numpy integers are integers: accepted, and the run is the same as with ints
    a, fa = heat.solve(comm, np.array([8, 8]), steps=np.int64(3), backend="numpy")
    b, fb = heat.solve(comm, [8, 8], steps=3, backend="numpy")
    assert a.steps == b.steps == 3 and np.array_equal(fa, fb)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("field,mine,words", [
    ("steps", 20, "steps differs across ranks (at least 10 and 20"),
    ("alpha", 2.0, "alpha differs across ranks (at least 1.0 and 2.0"),
    ("cfl", 0.25, "cfl differs across ranks (at least 0.25 and 0.5"),
    ("t_final", 0.01, "t_final differs across ranks"),
    ("grid", (16, 32), "grid[1] differs across ranks (at least 16 and 32"),
    ("bad_steps", -1, None),
])
def test_runs_that_differ_across_ranks_fail_on_every_rank(field, mine, words):
    """The last rank passes another value: every rank raises InvalidArgument
    before any halo message, naming the field and both values.  A rank with
    more steps than the others used to wait forever for their halo messages,
    and another alpha gave a silently inconsistent field; a bad value on one
    rank is that rank's own error and "passed invalid arguments" elsewhere."""
    comm = commlib.init()
    last = comm.rank == comm.size - 1
    kw = dict(steps=10, backend="numpy", alpha=1.0, cfl=0.5)
    grid = (16, 16)
    if field == "t_final":
        kw["t_final"] = 0.01 if last else 0.02
    elif field == "grid":
        grid = mine if last else grid
    elif field == "bad_steps":
        kw["steps"] = mine if last else 10
    elif last:
        kw[field] = mine
    with pytest.raises(InvalidArgument) as info:
        heat.solve(comm, grid, **kw)
    msg = str(info.value)
    assert msg.startswith(f"rank {comm.rank}: heat.solve: "), msg
    if field == "bad_steps":
        want = "steps must be a positive integer, got -1" if last else f"rank(s) [{comm.size - 1}] passed invalid"
        assert want in msg, msg
    else:
        assert words in msg, msg
    # the communicator is fine afterwards: the same run everywhere completes
    res, _ = heat.solve(comm, (16, 16), steps=10, backend="numpy")
    assert res.steps == 10


# ------------------------------------------------- the command line refuses
BAD_CLI = [
    ["--steps", "-5"], ["--steps", "0"], ["--steps", "abc"], ["--t-final", "-1"], ["--t-final", "nan"],
    ["--alpha", "nan"], ["--alpha", "inf"], ["--alpha", "0"], ["--alpha", "-2"], ["--cfl", "0"],
    ["--cfl", "1.5"], ["--cfl", "nan"], ["--grid", "0"], ["--grid", "-3"], ["--grid", "4", "4", "4", "4"],
    ["--grid", "100000000"], ["--dims", "4"], ["--kill", "0:2"], ["--fault-tolerant", "--kill", "abc"],
    ["--fault-tolerant", "--kill", "0:"], ["--fault-tolerant", "--kill", "9:1"],
    ["--fault-tolerant", "--kill", "0:-1"], ["--fault-tolerant", "--checkpoint-every", "0"],
    ["--fault-tolerant", "--steps", "10", "--kill", "0:10"], ["--fault-tolerant", "--kill", "0:1", "--kill", "0:2"],
    ["--fault-tolerant", "--kill", "0:3"], ["--dims", "3", "--grid", "4000"],
    ["--json", "/nonexistent/x.json"], ["--plot", "/nonexistent/x.png"], ["--json", "/"],
    ["--backend", "fortran"], ["--no-such-option"], ["--halo", "tcp"], ["--halo", "shm", "--time-block", "2"],
    ["--halo", "shm", "--backend", "cuda"], ["--halo", "shm", "--fault-tolerant"],
]


@pytest.mark.parametrize("argv", BAD_CLI, ids=lambda a: " ".join(a))
def test_cli_refuses_bad_values_before_the_solve(argv, capsys, monkeypatch):
    """One line on stderr, exit status 2, no traceback, and nothing solved."""
    monkeypatch.setattr(heat, "solve", lambda *a, **k: pytest.fail("solved despite a bad value"))
    monkeypatch.setattr(heat, "solve_ft", lambda *a, **k: pytest.fail("solved despite a bad value"))
    assert heat.main(argv + ["--no-progress"]) == 2  # (no speed check: the patched entry point proves nothing ran)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("heat: error: "), err


def test_cli_refuses_unwritable_json_before_the_solve(tmp_path, capsys):
    # a "directory" that is a regular file: unwritable for every user, root included
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert heat.main(["--json", str(blocker / "x.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("heat: error: --json") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [["--steps", "-5"], ["--alpha", "nan"], ["--kill", "0:2"],
                                  ["--fault-tolerant", "--kill", "abc"], ["--json", "/nonexistent/x.json"]],
                         ids=lambda a: " ".join(a))
def test_cli_process_exits_2_with_one_line(argv):
    """The real command line: exit status 2, one line on stderr, nothing on stdout, quickly."""
    import subprocess  # noqa: PLC0415

    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-P", "-m", "commlib.apps.heat", *argv, "--no-progress"],
                       capture_output=True, text=True, timeout=60, cwd=str(Path(__file__).resolve().parents[1]))
    took = time.perf_counter() - t0
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("heat: error: "), p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    print(f"{' '.join(argv)}: exit 2 in {took:.2f} s")
    assert took < 30  # the target (< 2 s) is measured on a quiet machine; shared CI cores vary


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_cli_refusal_on_every_rank_one_line(capsys):
    comm = commlib.init()
    assert heat.main(["--steps", "-5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == (1 if comm.rank == 0 else 0), err
    comm.barrier()  # nobody was left waiting


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
    assert rec["verified"] is None and rec["grid"] == [12, 12]  # 1 rank: nothing to compare
    assert png.stat().st_size > 1000


def test_cli_verify_at_one_rank_says_nothing_compared(capsys):
    """At 1 rank ``--verify`` would compare the run with itself: the summary says it compared nothing."""
    rc = heat.main(["--dims", "2", "--grid", "12", "--steps", "5", "--backend", "numpy", "--verify", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "single-process check: nothing compared (1 rank" in out, out
    assert "bit-identical" not in out, out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_smaller_than_ranks_fails_on_every_rank():
    comm = commlib.init()
    with pytest.raises(InvalidArgument, match=rf"rank {comm.rank}: heat.solve: grid \[1, 1\] has 1 point"):
        heat.solve(comm, (1, 1), steps=1, backend="numpy")
    assert heat.main(["--dims", "2", "--grid", "1", "--steps", "1", "--no-progress"]) == 2
    comm.barrier()  # every rank got here: nobody was left waiting


# ------------------------------------------------------------ device backends
# The cuda backend runs in numba's CUDA simulator here (tests/conftest.py), so
# grids stay tiny; on a GPU the same tests run on the device, where the FMA
# contraction the compiler may apply allows a last-bit difference from numpy.
def _cupy_or_skip():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy sees no GPU")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"CuPy sees no GPU: {exc}")
    return cupy


def _all_sides(d):
    return list(itertools.product([(False, False), (True, False), (False, True), (True, True)], repeat=d))


def test_regions_with_sides_cover_each_cell_once():
    for shape in [(1,), (2,), (5,), (1, 1), (2, 3), (5, 4), (1, 3, 2), (4, 5, 3)]:
        width = (1,) * len(shape)
        for sides in _all_sides(len(shape)):
            count = np.zeros([n + 2 for n in shape], int)
            lo, hi = heat.interior_region(shape, width, sides)
            count[tuple(slice(a, b) for a, b in zip(lo, hi))] += 1
            shell = heat.shell_regions(shape, width, sides)
            for a, b in shell:
                count[tuple(slice(x, y) for x, y in zip(a, b))] += 1
            inner = tuple(slice(1, 1 + n) for n in shape)
            assert (count[inner] == 1).all(), (shape, sides)
            assert count.sum() == np.prod(shape)
            if not any(lo_ or hi_ for lo_, hi_ in sides):
                assert shell == [], "no neighbour: no shell"
    # default: every side has a neighbour (the old behaviour)
    assert heat.shell_regions((4, 5), (1, 1)) == heat.shell_regions((4, 5), (1, 1), ((True, True),) * 2)
    assert heat.neighbour_sides([2, 1], [0, 0]) == ((False, True), (False, False))
    assert heat.neighbour_sides([3], [1]) == ((True, True),)


@pytest.mark.parametrize("lo,hi,chunk", [((1, 1), (6, 131), None), ((1, 1, 1), (5, 10, 34), 3),
                                         ((1, 1, 1), (385, 385, 385), None), ((2, 1), (3, 2), None),
                                         ((1, 1, 1), (1, 5, 5), None)])
def test_launch_geometry_covers_the_box(lo, hi, chunk):
    geo = heat.launch_geometry(lo, hi, chunk)
    ext = [b - a for a, b in zip(lo, hi)]
    if min(ext) <= 0:
        assert geo is None
        return
    blocks, threads, k = geo
    assert threads[0] == 32 * (threads[0] // 32), "whole warps along the last axis"
    assert blocks[0] * threads[0] >= ext[-1] > (blocks[0] - 1) * threads[0]
    z = blocks[2] if len(ext) == 3 else blocks[1]
    assert z * k >= ext[0] > (z - 1) * k
    if len(ext) == 3:
        assert blocks[1] * threads[1] >= ext[1] > (blocks[1] - 1) * threads[1]
    if chunk is None and ext[0] >= heat.CHUNK_MIN:
        assert heat.CHUNK_MIN <= k <= heat.CHUNK_MAX


def _random_field(shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random([n + 2 for n in shape]), np.array([0.11, 0.07, 0.13][:len(shape)])


def _numpy_steps(u, c, shape, nsteps):
    a, b = u.copy(), u.copy()
    lo, hi = (1,) * len(shape), tuple(n + 1 for n in shape)
    for _ in range(nsteps):
        heat.numpy_update(a, b, c, lo, hi)
        a, b = b, a
    return a


def _check_region_updates(backend, to_dev, to_host, shape, chunk, sides_list, exact):
    """Interior + shell launches, and the whole-box launch, over two parities,
    against the numpy update, on a random field with random ghost cells."""
    u, c = _random_field(shape)
    ref = _numpy_steps(u, c, shape, 2)
    width = (1,) * len(shape)
    for sides in sides_list:
        for split in (True, False):
            f = (to_dev(u), to_dev(u))
            run_all, run_inner, run_shell = heat.region_updates(backend, f, c, shape, width, sides, chunk=chunk)
            for p in (0, 1):
                if split:
                    run_inner(p)
                    run_shell(p)
                else:
                    run_all(p)
            got = to_host(f[0])
            if exact:
                assert np.array_equal(got, ref), (shape, sides, split)
            else:
                np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)


def _on_simulator():
    from numba import config  # noqa: PLC0415

    return bool(config.ENABLE_CUDASIM)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape,chunk", [
    ((5, 130), 2),       # 2 blocks of 128 along the last axis, 3 chunks along the first
    ((4, 9, 33), 3),     # 2 x 2 blocks of 32 x 8, 2 chunks; no size a multiple of the block
    ((3, 2, 1), None),   # a block wider than the box everywhere
])
def test_cuda_region_launches_match_numpy(shape, chunk):
    from numba import cuda  # noqa: PLC0415

    d = len(shape)
    sides_list = [((True, True),) * d, ((False, False),) * d, ((False, True),) + ((True, False),) * (d - 1)]
    _check_region_updates("cuda", cuda.to_device, lambda x: x.copy_to_host(), shape, chunk, sides_list,
                          exact=_on_simulator())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("grid,overlap", [((7, 5), True), ((7, 5), False), ((5, 4, 3), True), ((5, 4, 3), False)])
def test_cuda_backend_matches_numpy_one_rank(grid, overlap):
    comm = commlib.init(MPI.COMM_SELF)
    res, got = heat.solve(comm, grid, steps=3, backend="cuda", overlap=overlap)
    _, ref = heat.solve(comm, grid, steps=3, backend="numpy", overlap=overlap)
    if _on_simulator():
        assert np.array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)
    assert res.glups == pytest.approx(res.mlups / 1e3)
    assert res.comm_fraction == 0.0, "one rank: no halo exchange at all"


class _NoHalo(heat.HaloExchange):
    def start(self, *fields):
        raise AssertionError("halo.start called on a rank without neighbours")

    def exchange(self, *fields, timeout=None):
        raise AssertionError("halo.exchange called on a rank without neighbours")


@pytest.mark.parametrize("overlap", [True, False])
def test_one_rank_never_calls_the_halo(monkeypatch, overlap):
    monkeypatch.setattr(heat, "HaloExchange", _NoHalo)
    comm = commlib.init(MPI.COMM_SELF)
    res, _ = heat.solve(comm, (9, 8), steps=4, backend="numpy", overlap=overlap)
    assert res.comm_fraction == 0.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,grid,overlap", [
    ("cuda", (6, 5), False),
    ("cuda", (5, 4, 3), True),
    ("cuda", (5, 4, 3), False),
    ("numpy", (9, 7, 8), False),
    ("numba", (13, 11), False),
])
def test_mpi_backend_matches_one_rank_numpy(backend, grid, overlap):
    comm = commlib.init()
    _, local = heat.solve(comm, grid, steps=3, backend=backend, overlap=overlap)
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, same = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=3, backend=backend)
        assert np.array_equal(full, same), f"{comm.size} ranks differ from 1 rank"
        _, host = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=3, backend="numpy")
        if backend != "cuda" or _on_simulator():
            assert np.array_equal(full, host)
        else:
            np.testing.assert_allclose(full, host, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------- cupy
def test_cupy_slice_step_matches_numpy_update():
    for shape in [(6, 7), (4, 5, 3)]:
        u, c = _random_field(shape, seed=1)
        un = u.copy()
        out = heat.cupy_slice_step(u, un, c)
        assert out is un
        assert np.array_equal(un, _numpy_steps(u, c, shape, 1))


_SHIM = r"""
#include <algorithm>
struct dim3_ { unsigned x, y, z; };
static dim3_ blockIdx, blockDim, threadIdx;
using std::min; using std::max;
#define __global__
#define __device__
#define __forceinline__ inline
"""
_HARNESS = r"""
extern "C" void run3(void** a, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by) {
  const int* g = (const int*)a[6];
  blockDim = {bx, by, 1};
  for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x)
    for (unsigned ty = 0; ty < by; ++ty) for (unsigned tx = 0; tx < bx; ++tx) {
      blockIdx = {x, y, z}; threadIdx = {tx, ty, 0};
      ftcs3((const double*)a[0], (double*)a[1], *(double*)a[2], *(double*)a[3], *(double*)a[4],
            *(int*)a[5], *((int*)a[5] + 1), g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9],
            g[10], g[11], g[12]);
    }
}
extern "C" void run2(void** a, unsigned gx, unsigned gy, unsigned bx) {
  const int* g = (const int*)a[5];
  blockDim = {bx, 1, 1};
  for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) for (unsigned tx = 0; tx < bx; ++tx) {
    blockIdx = {x, y, 0}; threadIdx = {tx, 0, 0};
    ftcs2((const double*)a[0], (double*)a[1], *(double*)a[2], *(double*)a[3], *(int*)a[4],
          g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8]);
  }
}
"""


class _HostRawKernel:
    """Stands in for a cupy.RawKernel: runs the CUDA C source compiled for the
    host (every block and thread in turn) on the arguments Launch passes."""

    def __init__(self, lib, d):
        self.lib, self.d = lib, d

    def __call__(self, grid, block, args):
        import ctypes  # noqa: PLC0415

        d = self.d
        a, b = args[0], args[1]
        assert isinstance(a, np.ndarray) and a.flags.c_contiguous and a.dtype == np.float64
        coef, rest = args[2:2 + d], args[2 + d:]
        sizes, ints = rest[:d - 1], rest[d - 1:]
        assert all(type(x) is np.float64 for x in coef) and all(type(x) is np.int32 for x in rest)
        assert len(ints) == 4 * d + 1 and list(sizes) == list(a.shape[1:])
        keep = [np.array(coef, np.float64), np.array(sizes, np.int32), np.array(ints, np.int32)]
        ptrs = [a.ctypes.data, b.ctypes.data, keep[0][0:].ctypes.data, keep[0][1:].ctypes.data]
        if d == 3:
            ptrs += [keep[0][2:].ctypes.data, keep[1].ctypes.data, keep[2].ctypes.data]
            arr = (ctypes.c_void_p * 7)(*ptrs)
            self.lib.run3(arr, *[ctypes.c_uint(x) for x in (*grid, block[0], block[1])])
        else:
            ptrs += [keep[1].ctypes.data, keep[2].ctypes.data]
            arr = (ctypes.c_void_p * 6)(*ptrs)
            self.lib.run2(arr, *[ctypes.c_uint(x) for x in (grid[0], grid[1], block[0])])


@pytest.fixture(scope="module")
def host_raw_kernels(tmp_path_factory):
    import ctypes  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    from commlib.apps import _heat_cupy  # noqa: PLC0415

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to run the CUDA C source on the host")
    d = tmp_path_factory.mktemp("rawkernel")
    src, so = d / "k.cpp", d / "k.so"
    src.write_text(_SHIM + _heat_cupy.SOURCE + _HARNESS)
    # no contraction: what --fmad=false asks of NVRTC
    subprocess.run([cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    lib = ctypes.CDLL(str(so))
    return _HostRawKernel(lib, 2), _HostRawKernel(lib, 3)


@pytest.mark.parametrize("shape,chunk", [((5, 130), 2), ((4, 9, 33), 3), ((3, 2, 1), None), ((17, 6, 40), None)])
def test_cupy_kernel_source_on_the_host_matches_numpy(monkeypatch, host_raw_kernels, shape, chunk):
    """The RawKernel's CUDA C, compiled for the host and run block by block
    through the cupy backend's own Launch (CuPy cannot run without a GPU)."""
    from commlib.apps import _heat_cupy  # noqa: PLC0415

    monkeypatch.setattr(_heat_cupy, "_kernels", lambda: host_raw_kernels)
    d = len(shape)
    _check_region_updates("cupy", np.copy, np.asarray, shape, chunk, _all_sides(d) if d == 2 else
                          [((True, True),) * 3, ((False, False),) * 3, ((False, True), (True, False), (True, True))],
                          exact=True)


def test_cupy_backend_without_cupy_is_one_line_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy absent, also where it is installed
    comm = commlib.init(MPI.COMM_SELF)
    with pytest.raises(InvalidArgument, match="cupy backend"):
        heat.solve(comm, (8, 8), backend="cupy")
    assert heat.main(["--dims", "2", "--grid", "8", "--steps", "1", "--backend", "cupy", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("heat: error:") and "cupy" in err[0]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("grid,overlap", [((7, 5), True), ((33, 130), False), ((5, 4, 3), True),
                                          ((9, 17, 70), False)])
def test_cupy_backend_matches_numpy(grid, overlap):
    cupy = _cupy_or_skip()
    comm = commlib.init(MPI.COMM_SELF)
    res, got = heat.solve(comm, grid, steps=5, backend="cupy", overlap=overlap)
    _, ref = heat.solve(comm, grid, steps=5, backend="numpy", overlap=overlap)
    assert np.array_equal(got, ref), "the RawKernel is compiled with --fmad=false: numpy's bits"
    assert res.glups > 0
    u, c = _random_field(grid, seed=2)
    du, dn = cupy.asarray(u), cupy.asarray(u)
    heat.cupy_slice_step(du, dn, c)
    assert np.array_equal(cupy.asnumpy(dn), _numpy_steps(u, c, grid, 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("grid,overlap", [((9, 7), True), ((6, 5, 4), True), ((6, 5, 4), False)])
def test_mpi_cupy_backend_matches_one_rank_numpy(grid, overlap):
    _cupy_or_skip()
    comm = commlib.init()
    _, local = heat.solve(comm, grid, steps=3, backend="cupy", overlap=overlap)
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, host = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=3, backend="numpy")
        assert np.array_equal(full, host)


# ------------------------------------------------------- temporal blocking
@pytest.mark.parametrize("grid,steps", [((13, 11), 7), ((13, 11), 8), ((9, 7, 8), 5), ((9, 7, 8), 6), ((12,), 9)])
def test_time_block_two_matches_numpy_one_rank(grid, steps):
    comm = commlib.init(MPI.COMM_SELF)
    res, got = heat.solve(comm, grid, steps=steps, backend="numba", time_block=2)
    _, ref = heat.solve(comm, grid, steps=steps, backend="numpy")
    assert res.steps == steps
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_two_step_sweep_is_two_box_updates(d):
    """The temporal-blocking sweep against its oracle, two plain box updates
    (the first over the owned box widened by one cell on every side with a
    neighbour, the second over the owned box), on random fields whose ghost and
    boundary cells are random too: the same bits everywhere in both fields after
    1-3 pairs, for 12 random layouts (block shape, halo width 2-3, which sides have
    a neighbour)."""
    from commlib.apps.heat import model  # noqa: PLC0415

    rng = np.random.default_rng(4700 + d)
    kernels = model._get_numba(d)
    for trial in range(12):
        shape = tuple(int(x) for x in rng.integers(3, 11, d))
        width = tuple(int(x) for x in rng.integers(2, 4, d))
        sides = tuple((bool(rng.integers(2)), bool(rng.integers(2))) for _ in range(d))
        padded = tuple(n + 2 * w for n, w in zip(shape, width))
        fields = [rng.standard_normal(padded) for _ in range(2)]
        ref = [f.copy() for f in fields]
        c = rng.uniform(0.05, 0.15, d)
        pairs = int(rng.integers(1, 4))
        model.two_step_update(fields, c, shape, width, sides)(0, pairs)
        own = [(tuple(width), tuple(w + n for n, w in zip(shape, width)))]
        ext = [(tuple(w - low for w, (low, _) in zip(width, sides)),
                tuple(w + n + high for n, w, (_, high) in zip(shape, width, sides)))]
        for _ in range(pairs):
            kernels["boxes"](ref[0], ref[1], c, model._box_array(ext))
            kernels["boxes"](ref[1], ref[0], c, model._box_array(own))
        assert np.array_equal(fields[0], ref[0]), (trial, shape, width, sides, pairs)
        assert np.array_equal(fields[1], ref[1]), (trial, shape, width, sides, pairs)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("grid,steps", [((14, 11), 7), ((9, 8, 7), 6), ((9, 8, 7), 5)])
def test_mpi_time_block_two_matches_one_rank_numpy(grid, steps):
    comm = commlib.init()
    _, local = heat.solve(comm, grid, steps=steps, backend="numba", time_block=2)
    full = heat.gather_field(comm, list(grid), local)
    if comm.rank == 0:
        _, ref = heat.solve(commlib.init(MPI.COMM_SELF), grid, steps=steps, backend="numpy")
        assert np.array_equal(full, ref), f"{comm.size} ranks with time_block=2 differ from 1 rank"


@pytest.mark.parametrize("kwargs,words", [
    ({"time_block": 3}, "time_block must be 1 or 2"),
    ({"time_block": 2.0}, "time_block must be 1 or 2"),
    ({"time_block": 2, "backend": "numpy"}, "runs the numba backend"),
])
def test_time_block_refusals(kwargs, words):
    comm = commlib.init(MPI.COMM_SELF)
    with pytest.raises(InvalidArgument, match=words):
        heat.solve(comm, (9, 8), steps=4, **{"backend": "numba", **kwargs})
