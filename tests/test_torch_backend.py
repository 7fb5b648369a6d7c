"""The ``"commlib"`` torch.distributed backend under mpiexec: every collective
against the float64 oracles of tests/torch_backend_checks.py, mismatched calls,
sub-groups and meshes, and torch's own DDP and FSDP2 against a single-process
run on the whole batch (float64, within 1e-10).

    mpiexec -n N python -P -m pytest --with-mpi -m mpi tests/test_torch_backend.py   # N = 1..4

(torchrun: tests/test_torch_backend_torchrun.py.)
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import torch_backend_checks as checks  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def pg():
    import commlib.nn  # noqa: PLC0415 - registers the backend

    group = commlib.nn.init_process_group()
    yield group
    dist.destroy_process_group()


@pytest.mark.parametrize("check", checks.ALL, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective(pg, seed, check):
    check(seed)


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def _reference(X, Y, steps):
    """The single-process run on the whole batch (no communication at all)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        ((m(X) - Y) ** 2).mean().backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_matches_one_process(pg, seed, wrapper):
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(6 * n, 8, generator=g, dtype=torch.float64)
    Y = torch.randn(6 * n, 4, generator=g, dtype=torch.float64)
    ref = _reference(X, Y, 10)
    m = _model()
    if wrapper == "ddp":
        # a tiny bucket: one all-reduce per parameter, issued while backward runs
        m = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=1e-4)
    else:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs, ys = X[6 * r:6 * (r + 1)], Y[6 * r:6 * (r + 1)]
    for _ in range(10):
        opt.zero_grad()
        ((m(xs) - ys) ** 2).mean().backward()
        opt.step()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in m.parameters()]
    err = max((a - b).abs().max().item() for a, b in zip(params, ref))
    assert err <= 1e-10, f"{wrapper}: parameters differ from the single-process run by {err:.3g}"
