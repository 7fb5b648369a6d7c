"""The ``"commlib"`` torch.distributed backend on CUDA tensors (a lent GPU; tests/run_gpu.sh runs
it at 2 ranks): the collectives DDP and FSDP2 use, on the device, against float64 oracles the test
computes from every rank's seeded inputs, and DDP on a CUDA model against one process.

    mpiexec -n 2 python -P -m pytest --with-mpi -m mpi tests/test_torch_backend_cuda.py
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import torch_backend_checks as checks  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
F64 = torch.float64


@pytest.fixture(scope="module")
def pg():
    import commlib.nn  # noqa: PLC0415 - registers the backend

    group = commlib.nn.init_process_group()
    yield group
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_cuda_collectives(pg, seed, dtype):
    r, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    xs = [checks.make(seed, q, ("cuda", str(dtype)), (n * 1000,), dtype) for q in range(n)]
    t = xs[r].to(dev)
    dist.all_reduce(t)
    assert t.device == dev
    checks.assert_close(t.cpu(), checks.reduce_oracle(xs, checks.R.SUM, dtype), dtype, n, "cuda all_reduce")
    out = torch.empty(n * 7, dtype=dtype, device=dev)
    checks.ALL_GATHER_SINGLE(out, xs[r][:7].to(dev))
    assert torch.equal(out.cpu(), torch.cat([x[:7] for x in xs])), "cuda all_gather_single"
    rs = torch.empty(1000, dtype=dtype, device=dev)
    checks.REDUCE_SCATTER_SINGLE(rs, xs[r].to(dev))
    want = checks.reduce_oracle(xs, checks.R.SUM, dtype)[r * 1000:(r + 1) * 1000]
    checks.assert_close(rs.cpu(), want, dtype, n, "cuda reduce_scatter_single")
    b = xs[r].to(dev)
    dist.broadcast(b, src=n - 1)
    assert torch.equal(b.cpu(), xs[n - 1]), "cuda broadcast"
    w = dist.all_reduce(t2 := xs[r].to(dev), async_op=True)
    w.wait()
    checks.assert_close(t2.cpu(), checks.reduce_oracle(xs, checks.R.SUM, dtype), dtype, n, "cuda async all_reduce")


def test_cuda_ddp_matches_one_process(pg, seed):
    r, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(seed)
    X, Y = torch.randn(6 * n, 8, generator=g, dtype=F64), torch.randn(6 * n, 4, generator=g, dtype=F64)

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()

    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        ((ref(X) - Y) ** 2).mean().backward()
        opt.step()
    m = torch.nn.parallel.DistributedDataParallel(model().to(dev), bucket_cap_mb=1e-4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs, ys = X[6 * r:6 * (r + 1)].to(dev), Y[6 * r:6 * (r + 1)].to(dev)
    for _ in range(5):
        opt.zero_grad()
        ((m(xs) - ys) ** 2).mean().backward()
        opt.step()
    err = max((a.cpu() - b).abs().max().item() for a, b in zip(m.module.parameters(), ref.parameters()))
    assert err <= 1e-10, f"DDP on CUDA differs from one process by {err:.3g}"
