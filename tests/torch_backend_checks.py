"""Checks of the ``"commlib"`` torch.distributed backend, shared by the MPI tests
(tests/test_torch_backend.py, under mpiexec) and the torchrun worker
(tests/torch_backend_worker.py): each ``check_*`` runs collective calls on the
initialized default group and asserts against an oracle it computes itself.

The oracle: every rank regenerates every rank's input from the seed (a CPU
generator seeded with ``(seed, rank, case)``) and reduces them in float64 (exact
integers for integer dtypes), never through commlib.  Tolerances: float64
``1e-12`` relative; a half-precision sum within ``size`` roundings of the
result's magnitude (each of the ``size - 1`` additions, and the input's own
rounding, at most half an ulp of the running sum).
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceCoalescedOptions, ReduceScatterOptions

import commlib

F64 = torch.float64
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
R = dist.ReduceOp
#: torch's names for the tensor forms (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before 2.10)
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52}


def ops_for(dtype):
    if dtype == torch.bool:
        return [R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype in FLOATS:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def make(seed, rank, case, shape, dtype, op=None):
    """Rank ``rank``'s input of a case: floats near 1 for PRODUCT, small integers."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed, rank, case)).encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in FLOATS:
        x = torch.rand(shape, generator=g, dtype=F64)
        x = 0.75 + 0.5 * x if op == R.PRODUCT else 4 * x - 2
        return x.to(dtype)
    hi = 3 if op == R.PRODUCT else (100 if dtype in (torch.int8, torch.uint8) else 1000)
    return torch.randint(0 if dtype == torch.uint8 or op == R.PRODUCT else -hi, hi, shape, generator=g).to(dtype)


def reduce_oracle(xs, op, dtype):
    """The reduction of the ranks' inputs ``xs`` in float64 / int64, cast to ``dtype``."""
    if dtype in FLOATS:
        a = torch.stack([x.to(F64) for x in xs])
        out = {R.SUM: a.sum(0), R.AVG: a.mean(0), R.PRODUCT: a.prod(0), R.MIN: a.min(0).values,
               R.MAX: a.max(0).values}[op]
        return out
    a = torch.stack([x.to(torch.int64) for x in xs])
    if op in (R.BAND, R.BOR, R.BXOR):
        out = a[0].clone()
        for x in a[1:]:
            out = {R.BAND: out & x, R.BOR: out | x, R.BXOR: out ^ x}[op]
    else:
        out = {R.SUM: a.sum(0), R.PRODUCT: a.prod(0), R.MIN: a.min(0).values, R.MAX: a.max(0).values}[op]
    return out.to(dtype)  # integer wrap-around as the dtype's own arithmetic


def assert_close(got, want, dtype, n, what):
    if dtype in FLOATS:
        tol = 1e-12 if dtype == F64 else (n + 1) * EPS[dtype]
        scale = want.abs().max().item() if want.numel() else 0.0
        err = (got.to(F64) - want).abs().max().item() if want.numel() else 0.0
        assert err <= tol * max(scale, 1e-300), f"{what}: max error {err:.3g} > {tol:.3g} x {scale:.3g}"
    else:
        assert torch.equal(got, want), f"{what}: {got.tolist()[:8]} != {want.tolist()[:8]}"


# ------------------------------------------------------------------ the checks
def check_all_reduce(seed, group=None):
    """Every dtype and op, a one-round size and a ring size, sync and async."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for count in (7, 5000):
                case = ("allreduce", str(dtype), int(op.op if hasattr(op, "op") else op), count)
                xs = [make(seed, q, case, (count,), dtype, op) for q in range(n)]
                t = xs[r].clone()
                work = dist.all_reduce(t, op=op, group=group, async_op=count > 100)
                if work is not None:
                    work.wait()
                assert_close(t, reduce_oracle(xs, op, dtype), dtype, n, f"all_reduce {dtype} {op} {count}")
    # PREMUL_SUM: each input scaled by the factor, then summed
    xs = [make(seed, q, "premul", (33,), F64) for q in range(n)]
    t = xs[r].clone()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25), group=group)
    assert_close(t, sum(0.25 * x for x in xs), F64, n, "all_reduce PREMUL_SUM")


def check_all_reduce_coalesced_and_noncontiguous(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    xs = [make(seed, q, "nc", (6, 8), F64) for q in range(n)]
    base = xs[r].clone()
    view = base.t()[::2]                    # (4, 6), neither row- nor column-contiguous in base
    assert not view.is_contiguous()
    dist.all_reduce(view)
    want = sum(x.t()[::2] for x in xs)
    assert_close(view, want, F64, n, "all_reduce of a non-contiguous view")
    untouched = base.t()[1::2]
    assert torch.equal(untouched, xs[r].t()[1::2]), "elements outside the view changed"
    ts = [make(seed, q, ("coal", i), (5 + i,), F64) for i in range(3) for q in [r]]
    pg = dist.group.WORLD
    pg.allreduce_coalesced(ts, AllreduceCoalescedOptions()).wait()
    for i in range(3):
        want = sum(make(seed, q, ("coal", i), (5 + i,), F64) for q in range(n))
        assert_close(ts[i], want, F64, n, f"allreduce_coalesced[{i}]")


def check_broadcast(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    for dtype in (F64, torch.bfloat16, torch.int64, torch.bool):
        for root in range(n):
            xs = [make(seed, q, ("bcast", str(dtype), root), (1000,), dtype) for q in range(n)]
            t = xs[r].clone()
            dist.broadcast(t, src=root)
            assert torch.equal(t, xs[root]), f"broadcast {dtype} from {root}"


def check_all_gather(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    for dtype in (F64, torch.float16, torch.bfloat16, torch.int32, torch.bool):
        xs = [make(seed, q, ("ag", str(dtype)), (3, 5), dtype) for q in range(n)]
        outs = [torch.empty(3, 5, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, xs[r])
        for q in range(n):
            assert torch.equal(outs[q], xs[q]), f"all_gather {dtype} block {q}"
        out = torch.empty(n * 3, 5, dtype=dtype)
        ALL_GATHER_SINGLE(out, xs[r])
        assert torch.equal(out, torch.cat(xs)), f"all_gather_single {dtype}"
    # the coalesced form FSDP2 uses
    ins = [make(seed, r, ("agc", i), (4 + i,), F64) for i in range(3)]
    outs = [torch.empty(n * (4 + i), dtype=F64) for i in range(3)]
    dist.group.WORLD.allgather_into_tensor_coalesced(outs, ins, AllgatherOptions()).wait()
    for i in range(3):
        assert torch.equal(outs[i], torch.cat([make(seed, q, ("agc", i), (4 + i,), F64) for q in range(n)]))


def check_reduce_scatter(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    for k, (dtype, op) in enumerate(((F64, R.SUM), (F64, R.AVG), (torch.float32, R.MAX), (torch.int64, R.SUM),
                                     (torch.bfloat16, R.SUM), (F64, dist._make_nccl_premul_sum(1 / 3)))):
        xs = [make(seed, q, ("rs", k), (n * 6,), dtype) for q in range(n)]
        out = torch.empty(6, dtype=dtype)
        REDUCE_SCATTER_SINGLE(out, xs[r].clone(), op=op)
        if getattr(op, "op", op) == R.PREMUL_SUM:
            want = sum(x / 3 for x in xs)
        else:
            want = reduce_oracle(xs, op, dtype)
        assert_close(out, want[r * 6:(r + 1) * 6], dtype, n, f"reduce_scatter_single {dtype} {op}")
        lst = [x.clone() for x in xs[r].split(6)]
        out2 = torch.empty(6, dtype=dtype)
        dist.reduce_scatter(out2, lst, op=op)
        assert torch.equal(out2, out), f"reduce_scatter (list) {dtype} {op}"
    ins = [make(seed, r, ("rsc", i), (n * (2 + i),), F64) for i in range(3)]
    outs = [torch.empty(2 + i, dtype=F64) for i in range(3)]
    dist.group.WORLD.reduce_scatter_tensor_coalesced(outs, ins, ReduceScatterOptions()).wait()
    for i in range(3):
        want = sum(make(seed, q, ("rsc", i), (n * (2 + i),), F64) for q in range(n))
        assert_close(outs[i], want[r * (2 + i):(r + 1) * (2 + i)], F64, n, f"reduce_scatter coalesced[{i}]")


def check_all_to_all(seed):
    r, n = dist.get_rank(), dist.get_world_size()

    def count(i, j):  # elements rank i sends rank j: uneven, some zero
        return (3 * i + 5 * j + seed) % 4

    def block(i, j):
        return make(seed, i, ("a2a", j), (count(i, j), 2), F64)

    inp = torch.cat([block(r, j) for j in range(n)])
    out = torch.empty(sum(count(i, r) for i in range(n)), 2, dtype=F64)
    dist.all_to_all_single(out, inp, output_split_sizes=[count(i, r) for i in range(n)],
                           input_split_sizes=[count(r, j) for j in range(n)])
    assert torch.equal(out, torch.cat([block(i, r) for i in range(n)])), "all_to_all_single uneven"
    even_in = torch.cat([make(seed, r, ("a2ae", j), (3,), torch.int32) for j in range(n)])
    even_out = torch.empty_like(even_in)
    dist.all_to_all_single(even_out, even_in)
    assert torch.equal(even_out, torch.cat([make(seed, i, ("a2ae", r), (3,), torch.int32) for i in range(n)]))
    outs = [torch.empty(count(i, r), 2, dtype=F64) for i in range(n)]
    dist.all_to_all(outs, [block(r, j) for j in range(n)])
    for i in range(n):
        assert torch.equal(outs[i], block(i, r)), f"all_to_all block from {i}"


def check_rooted(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        xs = [make(seed, q, ("red", root), (9,), F64) for q in range(n)]
        t = xs[r].clone()
        dist.reduce(t, dst=root, op=R.SUM)
        if r == root:
            assert_close(t, sum(xs), F64, n, f"reduce to {root}")
        else:
            assert torch.equal(t, xs[r]), "reduce changed a non-root's input"
        gl = [torch.empty(9, dtype=F64) for _ in range(n)] if r == root else None
        dist.gather(xs[r], gather_list=gl, dst=root)
        if r == root:
            assert all(torch.equal(gl[q], xs[q]) for q in range(n)), f"gather to {root}"
        sl = [make(seed, root, ("sc", q), (4,), torch.int64) for q in range(n)] if r == root else None
        out = torch.empty(4, dtype=torch.int64)
        dist.scatter(out, scatter_list=sl, src=root)
        assert torch.equal(out, make(seed, root, ("sc", r), (4,), torch.int64)), f"scatter from {root}"
    dist.barrier()


def check_point_to_point(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    x = make(seed, r, "p2p", (257,), F64)
    got = torch.empty(257, dtype=F64)
    ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got, make(seed, prv, "p2p", (257,), F64)), "batch_isend_irecv ring"
    if r % 2 == 0 and r + 1 < n:
        dist.send(x, r + 1, tag=7)
        y = torch.empty(3, dtype=torch.int32)
        dist.recv(y, r + 1, tag=8)
        assert torch.equal(y, make(seed, r + 1, "p2p-b", (3,), torch.int32))
    elif r % 2 == 1:
        y = torch.empty(257, dtype=F64)
        w = dist.irecv(y, r - 1, tag=7)
        w.wait()
        assert torch.equal(y, make(seed, r - 1, "p2p", (257,), F64)), "irecv"
        dist.isend(make(seed, r, "p2p-b", (3,), torch.int32), r - 1, tag=8).wait()


def check_objects(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "seed": seed, "pad": "x" * r * 100})
    assert objs == [{"rank": q, "seed": seed, "pad": "x" * q * 100} for q in range(n)]
    lst = [("root", seed, list(range(5)))] if r == n - 1 else [None]
    dist.broadcast_object_list(lst, src=n - 1)
    assert lst == [("root", seed, list(range(5)))]
    out = [None]
    dist.scatter_object_list(out, [f"to {q}" for q in range(n)] if r == 0 else None, src=0)
    assert out == [f"to {r}"]


def check_async_progress(seed):
    """An async all-reduce completes while this thread only runs Python (never waits)."""
    import time  # noqa: PLC0415

    r, n = dist.get_rank(), dist.get_world_size()
    xs = [make(seed, q, "async", (1 << 20,), torch.float32) for q in range(n)]
    t = xs[r].clone()
    work = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 120
    spins = 0
    while not work.is_completed():
        spins += sum(range(100))  # Python work, GIL taken and given back
        assert time.monotonic() < deadline, "the async all-reduce made no progress without wait()"
    assert work.wait()
    fut = work.get_future()
    assert fut.done() and fut.value()[0] is t
    assert_close(t, reduce_oracle(xs, R.SUM, torch.float32), torch.float32, n, "async all_reduce")


def check_mismatch(seed):
    """Different sizes, dtypes, ops or collectives: InvalidArgument on every rank, then a good call works."""
    r, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return
    cases = {
        "size": lambda: dist.all_reduce(torch.ones(3 + (r == n - 1))),
        "dtype": lambda: dist.all_reduce(torch.ones(4, dtype=F64 if r == 0 else torch.float32)),
        "op": lambda: dist.all_reduce(torch.ones(4), op=R.MAX if r == 0 else R.SUM),
        "collective": lambda: (dist.broadcast(torch.ones(4), src=0) if r == 0 else dist.all_reduce(torch.ones(4))),
        "gather size": lambda: ALL_GATHER_SINGLE(torch.empty(n * (2 + (r == 0))), torch.ones(2 + (r == 0))),
        # one rank's own bad arguments (found before the call): the others raise too, naming it
        "one rank's output size": lambda: ALL_GATHER_SINGLE(torch.empty(n * 2 + (r == n - 1)), torch.ones(2)),
        "one rank's AVG of integers": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64),
                                                              op=R.AVG if r == 0 else R.SUM),
        "one rank's reduce_scatter input": lambda: REDUCE_SCATTER_SINGLE(torch.empty(2), torch.ones(2 * n + (r == 0))),
        "one rank's all_to_all_single splits": lambda: dist.all_to_all_single(
            torch.empty(2 * n), torch.ones(2 * n), input_split_sizes=[2] * n if r else [1] * n),
        "one rank's broadcast dtype": lambda: dist.broadcast(torch.ones(3, dtype=torch.complex64 if r == 0
                                                                        else torch.float32), src=n - 1),
    }
    for name, call in cases.items():
        try:
            call()
        except commlib.InvalidArgument as exc:
            assert isinstance(exc, (RuntimeError, ValueError))
            assert f"rank {r}" in str(exc), f"{name}: the error does not name this rank: {exc}"
        else:
            raise AssertionError(f"mismatched {name} raised nothing on rank {r}")
        t = torch.full((4,), float(r))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((4,), float(sum(range(n))))), f"the call after the mismatched {name}"


def check_new_group(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    evens = list(range(0, n, 2))
    g = dist.new_group(evens)
    if r in evens:
        xs = [make(seed, q, "sub", (11,), F64) for q in evens]
        t = xs[evens.index(r)].clone()
        dist.all_reduce(t, group=g)
        assert_close(t, sum(xs), F64, len(evens), "all_reduce on new_group(evens)")
        assert dist.get_world_size(g) == len(evens) and dist.get_rank(g) == evens.index(r)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    dp = 2 if n % 2 == 0 else 1
    mesh = init_device_mesh("cpu", (dp, n // dp), mesh_dim_names=("dp", "cp"))
    for dim in ("dp", "cp"):
        grp = mesh.get_group(dim)
        ranks = dist.get_process_group_ranks(grp)
        t = torch.tensor([float(r)], dtype=F64)
        dist.all_reduce(t, group=grp)
        assert t.item() == float(sum(ranks)), f"mesh {dim} group {ranks}: {t.item()}"


ALL = [check_all_reduce, check_all_reduce_coalesced_and_noncontiguous, check_broadcast, check_all_gather,
       check_reduce_scatter, check_all_to_all, check_rooted, check_point_to_point, check_objects,
       check_async_progress, check_mismatch, check_new_group]
