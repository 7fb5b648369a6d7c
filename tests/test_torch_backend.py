"""The ``"commlib"`` torch.distributed backend under mpiexec: every collective
against the float64 oracles of tests/torch_backend_checks.py, mismatched calls,
sub-groups and meshes, and torch's own DDP and FSDP2 against a single-process
run on the whole batch (float64, within 1e-10).

    mpiexec -n N python -P -m pytest --with-mpi -m mpi tests/test_torch_backend.py   # N = 1..4

(torchrun: tests/test_torch_backend_torchrun.py.)
"""
from __future__ import annotations

import threading

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


@pytest.fixture(scope="module")
def async_groups(pg):
    """A group of every rank for each ``COMMLIB_TORCH_ASYNC`` mode (``inline``:
    asynchronous calls inside a backward pass run in the calling thread;
    ``thread``: on the group's worker), kept for the module (FSDP2's meshes
    over equal rank lists would find a destroyed one's name)."""
    from commlib.core.config import config  # noqa: PLC0415

    groups, saved = {}, config.torch_async
    try:
        for mode in ("inline", "thread"):
            config.torch_async = mode
            groups[mode] = dist.new_group(list(range(dist.get_world_size())))
    finally:
        config.torch_async = saved
    return groups


@pytest.fixture(params=["inline", "thread"])
def async_group(request, async_groups, monkeypatch):
    """``(mode, group, threads)``: ``threads`` lists, for each asynchronous call
    made inside a backward pass, whether it ran in the main thread."""
    from commlib.nn.distributed import ProcessGroupCommlib  # noqa: PLC0415

    threads = []
    run = ProcessGroupCommlib._run

    def spy(self, fn, result, opts):
        if not getattr(opts, "asyncOp", True) or torch._C._current_graph_task_id() < 0:
            return run(self, fn, result, opts)  # synchronous, or outside backward (DDP's forward-time calls)

        def traced():
            threads.append(threading.current_thread() is threading.main_thread())
            fn()
        return run(self, traced, result, opts)

    monkeypatch.setattr(ProcessGroupCommlib, "_run", spy)
    return request.param, async_groups[request.param], threads


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_matches_one_process(async_group, seed, wrapper):
    mode, group, threads = async_group
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(6 * n, 8, generator=g, dtype=torch.float64)
    Y = torch.randn(6 * n, 4, generator=g, dtype=torch.float64)
    ref = _reference(X, Y, 10)
    m = _model()
    if wrapper == "ddp":
        # a tiny bucket: one all-reduce per parameter, issued while backward runs
        m = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=1e-4, process_group=group)
    else:
        from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        fully_shard(m, mesh=DeviceMesh.from_group(group, "cpu"))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs, ys = X[6 * r:6 * (r + 1)], Y[6 * r:6 * (r + 1)]
    for _ in range(10):
        opt.zero_grad()
        ((m(xs) - ys) ** 2).mean().backward()
        opt.step()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in m.parameters()]
    err = max((a - b).abs().max().item() for a, b in zip(params, ref))
    assert err <= 1e-10, f"{wrapper} ({mode}): parameters differ from the single-process run by {err:.3g}"
    # DDP's bucket all-reduces (one a parameter) ran where the mode says: all on the worker, or in this
    # thread (one made while the worker still runs an earlier call, such as DDP's forward-time calls,
    # waits its turn there); FSDP2 makes its calls synchronously on CPU, in this thread either way
    if wrapper == "ddp":
        assert any(threads) if mode == "inline" else threads and not any(threads), (mode, threads)


def test_bad_async_mode_refused(pg, monkeypatch):
    """A ``COMMLIB_TORCH_ASYNC`` that is not auto, inline or thread: InvalidArgument naming
    the variable and the rank, before any group is made (every rank reads the same value)."""
    import commlib  # noqa: PLC0415
    from commlib.core.config import config  # noqa: PLC0415
    from commlib.nn.distributed import ProcessGroupCommlib, communicator_of  # noqa: PLC0415

    monkeypatch.setattr(config, "torch_async", "threads")
    with pytest.raises(commlib.InvalidArgument, match=r"COMMLIB_TORCH_ASYNC='threads'") as info:
        ProcessGroupCommlib(communicator_of())
    assert f"rank {dist.get_rank()}" in str(info.value), str(info.value)


@pytest.mark.parametrize("affinity, local, threads, inline", [
    (1, 2, 1, True),    # bound to one core (mpiexec at 1-2 ranks a node): no core for the worker
    (3, 2, 2, False),   # bound to 3 cores, 2 torch threads: one core to spare, for the worker
    (2, 2, 2, True),    # bound to 2 cores, both in torch's pool
    (8, 2, 2, False),   # unbound, 8 cores shared by 2 ranks: 4 each, 2 torch threads
    (8, 2, 4, True),    # unbound, 4 cores each, all in torch's pool
    (8, 8, 1, True),    # unbound, 8 ranks on 8 cores
])
def test_auto_async_mode_follows_the_cores(pg, monkeypatch, affinity, local, threads, inline):
    """``COMMLIB_TORCH_ASYNC=auto`` runs a backward pass's asynchronous calls in the calling
    thread exactly when the rank has no core beside torch's intra-op threads (8-CPU node)."""
    from commlib.core.config import config  # noqa: PLC0415
    from commlib.nn.distributed import ProcessGroupCommlib, communicator_of  # noqa: PLC0415

    monkeypatch.setattr(config, "torch_async", "auto")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert ProcessGroupCommlib(communicator_of())._inline_backward is inline
