"""Torch ring attention (commlib.nn.ring) against a float64 torch oracle.

Run serially (size-1 checks on ``COMM_SELF``, gradcheck, the planner and
schedule units) and under MPI at 1-4 ranks::

    mpiexec -n N python -m pytest --with-mpi -m mpi tests/test_nn_ring.py   # N = 1, 2, 3, 4

The oracle is written here from the definition: float64 torch SDPA with
autograd on the whole (unsharded) sequence, with the boolean mask built from
positions (causal: key position <= query position; documents: same
``cu_seqlens`` segment) and K/V repeated over each query group.  Every rank
compares its own shard of ``out``, ``dq``, ``dk``, ``dv`` with the oracle's
slice at the positions it holds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402

from commlib.collectives.attention.layout import LAYOUTS, sequence_positions  # noqa: E402
from commlib.collectives.attention.schedule import RingSchedule, piece_positions, ring_work, split_halves  # noqa: E402
from commlib.core.errors import InvalidArgument  # noqa: E402
from commlib.nn import _blocks  # noqa: E402
from commlib.nn import ring as nnring  # noqa: E402
from commlib.nn.ring import ring_attention, ring_attention_bidirectional  # noqa: E402

F64 = torch.float64


# ------------------------------------------------------------------ the oracle
def visibility(n, causal, cu):
    """Bool ``(n, n)``: query i may see key j."""
    vis = torch.ones(n, n, dtype=torch.bool)
    if causal:
        vis = vis.tril()
    if cu is not None:
        doc = torch.from_numpy(np.searchsorted(np.asarray(cu), np.arange(n), side="right"))
        vis &= doc[:, None] == doc[None, :]
    return vis


def oracle(q, k, v, dout, causal, cu, scale, dtype=F64):
    """Attention of the global sequence in ``dtype`` with autograd: (out, dq, dk, dv) as float64."""
    q, k, v = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    mask = visibility(q.shape[1], causal, cu)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=g > 1).transpose(1, 2)
    out.backward(dout.to(dtype))
    return [t.detach().to(F64) for t in (out, q.grad, k.grad, v.grad)]


def make_global(seed, batch, n, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(batch, n, h, dim, generator=gen, dtype=F64)  # noqa: E731
    return mk(heads), mk(kv_heads), mk(kv_heads), mk(heads)


def run_ring(comm, glob, dtype, layout, **kw):
    """Shard the global inputs, run forward and backward; local (out, dq, dk, dv) and positions."""
    q, k, v, dout = glob
    seq_local = q.shape[1] // comm.size
    pos = torch.from_numpy(sequence_positions(layout, comm.rank, comm.size, seq_local))
    ql, kl, vl = (x[:, pos].to(dtype).requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, comm, layout=layout, timeout=60, **kw)
    assert out.dtype == dtype and out.shape == ql.shape
    out.backward(dout[:, pos].to(dtype))
    for g, x in ((ql.grad, ql), (kl.grad, kl), (vl.grad, vl)):
        assert g.dtype == dtype and g.shape == x.shape
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)], pos


def max_rel(got, want, scale):
    """Largest error of this rank's shard relative to the largest entry of the global oracle."""
    got = got.to(F64)
    assert not torch.isnan(got).any()
    return ((got - want).abs().max() / max(scale, 1e-300)).item()


def documents(n):
    """Document boundaries with an empty document and one crossing shards."""
    return np.array([0, 1, 1, n // 2 + 1, n], dtype=np.int64)


def check_config(comm, dtype, tol, layout, causal, bidirectional, cu, kv_heads, *, seq_local=6, heads=4, dim=8,
                 seed=0, scale=None):
    n = comm.size * seq_local
    glob = make_global(seed, 2, n, heads, kv_heads, dim)
    scale_ = dim ** -0.5 if scale is None else scale
    got, pos = run_ring(comm, glob, dtype, layout, causal=causal, bidirectional=bidirectional, cu_seqlens=cu,
                        softmax_scale=scale)
    want = oracle(*glob, causal, cu, scale_)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = max_rel(g, w[:, pos], w.abs().max().item())
        assert err <= tol, (f"{name}: {err:.2e} > {tol:.0e} ({dtype}, {layout}, causal={causal}, "
                            f"bidirectional={bidirectional}, cu={cu}, kv_heads={kv_heads})")


def all_configs():
    """layouts x causal x bidirectional x documents, GQA cycling through MHA, GQA and MQA."""
    i = 0
    for layout in LAYOUTS:
        for causal in (False, True):
            for bidirectional in (False, True):
                for docs in (False, True):
                    yield layout, causal, bidirectional, docs, (4, 2, 1)[i % 3]
                    i += 1


# ------------------------------------------------------------ MPI: every size
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_float64_matches_oracle(world, monkeypatch):
    """Every layout x causal x bidirectional x documents, GQA/MQA, to 1e-10;
    documents both as pieces and as one masked call per block."""
    n = world.size * 6
    for layout, causal, bidirectional, docs, kv_heads in all_configs():
        cu = documents(n) if docs else None
        check_config(world, F64, 1e-10, layout, causal, bidirectional, cu, kv_heads)
    many = np.arange(0, n + 1, 2)  # documents of 2 tokens: many pieces per block
    for layout, bidirectional, call_cost in (("contiguous", False, 0), ("zigzag", True, 0),  # pieces
                                             ("striped", True, 10 ** 9), ("zigzag", False, 10 ** 9)):  # masks
        monkeypatch.setattr(_blocks, "CALL_COST", call_cost)
        check_config(world, F64, 1e-10, layout, True, bidirectional, many, 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_float32_matches_oracle(world):
    n = world.size * 6
    for i, (layout, causal, bidirectional, docs, kv_heads) in enumerate(all_configs()):
        if i % 8 not in (0, 7):
            continue
        check_config(world, torch.float32, 1e-5, layout, causal, bidirectional, documents(n) if docs else None,
                     kv_heads, seed=1)
    check_config(world, torch.float32, 1e-5, "zigzag", True, True, None, 2, scale=0.3, seed=2)


def global_rel_error(got, want):
    """Relative Frobenius error over every rank's shard: ||got - want|| / ||want||."""
    sums = np.array([((got.to(F64) - want) ** 2).sum().item(), (want ** 2).sum().item()])
    tot = np.empty_like(sums)
    MPI.COMM_WORLD.Allreduce(sums, tot)
    return math.sqrt(tot[0] / tot[1])


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_half_precision_error_within_1_5x_of_sdpa(world):
    """bfloat16 (and float16): the ring's error against the float64 oracle is
    at most 1.5x that of single-process SDPA in the same dtype on the same
    inputs, for out, dq, dk and dv.  Metric: relative Frobenius error over the
    whole tensor (every rank's shard), ||x - x64|| / ||x64||.  (The
    maximum-element error is one rounding's worth for both and too noisy to
    compare.)"""
    seq_local = 32
    n = world.size * seq_local
    cases = [(torch.bfloat16, "zigzag", True, True, None), (torch.bfloat16, "striped", True, False, documents(n)),
             (torch.bfloat16, "contiguous", False, True, None), (torch.float16, "zigzag", True, False, None)]
    for seed, (dtype, layout, causal, bidirectional, cu) in enumerate(cases):
        glob = make_global(10 + seed, 1, n, 4, 2, 32)
        got, pos = run_ring(world, glob, dtype, layout, causal=causal, bidirectional=bidirectional, cu_seqlens=cu)
        exact = oracle(*glob, causal, cu, 32 ** -0.5)
        base = oracle(*glob, causal, cu, 32 ** -0.5, dtype=dtype)
        for name, g, e, b in zip(("out", "dq", "dk", "dv"), got, exact, base):
            err = global_rel_error(g, e[:, pos])
            ref = ((b - e).norm() / e.norm()).item()
            assert err <= 1.5 * ref, f"{dtype} {layout} {name}: ring {err:.3e} vs SDPA {ref:.3e}"


def _all_raise(comm, fn, match, op="ring_attention"):
    with pytest.raises(InvalidArgument, match=match) as ei:
        fn()
    assert f"rank {comm.rank}" in str(ei.value) and op in str(ei.value)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_arguments_raise_on_every_rank(world):
    """Each bad call raises the same InvalidArgument on every rank before any
    K/V moves (a hang would time out), and the ring works afterwards."""
    p = world.size
    q = torch.zeros(1, 4, 4, 8)
    k = torch.zeros(1, 4, 2, 8)
    ring = lambda *a, **kw: ring_attention(*a, **kw)  # noqa: E731
    _all_raise(world, lambda: ring(q, k, k.double(), world), "dtype")
    _all_raise(world, lambda: ring(q.int(), k.int(), k.int(), world), "not supported")
    _all_raise(world, lambda: ring(q, k.to("meta"), k, world), "meta")
    _all_raise(world, lambda: ring(q, torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8), world), "multiple")
    _all_raise(world, lambda: ring(q, k, torch.zeros(1, 4, 2, 4), world), "differs")
    _all_raise(world, lambda: ring(q, torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8), world), "does not match")
    _all_raise(world, lambda: ring(q[0], k, k, world), "4-d")
    _all_raise(world, lambda: ring(q.numpy(), k, k, world), "torch tensor")
    _all_raise(world, lambda: ring(q, k, k, world, layout="spiral"), "layout")
    _all_raise(world, lambda: ring(q[:, :3], k[:, :3], k[:, :3], world, layout="zigzag"), "even")
    _all_raise(world, lambda: ring(q, k, k, world, softmax_scale=0.0), "softmax_scale")
    _all_raise(world, lambda: ring(q, k, k, world, causal=None), "causal")
    _all_raise(world, lambda: ring(q, k, k, world, timeout=-1), "timeout")
    _all_raise(world, lambda: ring(q, k, k, world, cu_seqlens=[0, 4 * p - 1]), "cu_seqlens")  # not covering
    _all_raise(world, lambda: ring(q, k, k, world, cu_seqlens=[1, 4 * p]), "cu_seqlens")
    _all_raise(world, lambda: ring(q, k, k, world, cu_seqlens=[0, 3, 2, 4 * p]), "non-decreasing")
    _all_raise(world, lambda: ring(q, k, k, world, cu_seqlens=torch.tensor([0.0, 4.0 * p])), "integers")
    _all_raise(world, lambda: ring_attention_bidirectional(q, k, k[:, :, :1], world), "differs",
               op="ring_attention_bidirectional")
    # only one rank is wrong: every rank raises, the others naming it
    bad_k = torch.zeros(1, 4, 3, 8) if world.rank == p - 1 else k
    _all_raise(world, lambda: ring(q, bad_k, bad_k, world), "multiple" if world.rank == p - 1 else "invalid")
    out = ring(q + 1, k, k, world)  # the ring still works (nothing half-sent is left behind)
    assert out.shape == q.shape and not out.any()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_ranks_disagreeing_raise_everywhere(world):
    """Valid on each rank alone, different across ranks: sequence length, head
    count, dtype, options, cu_seqlens — every rank raises, nobody waits."""
    last = world.rank == world.size - 1
    n = 4 * world.size
    q = torch.zeros(1, 4, 4, 8)
    k = torch.zeros(1, 4, 2, 8)
    ql = torch.zeros(1, 6 if last else 4, 4, 8)
    kl = torch.zeros(1, 6 if last else 4, 2, 8)
    _all_raise(world, lambda: ring_attention(ql, kl, kl, world), r"disagree.*seq_local")
    qh = torch.zeros(1, 4, 8 if last else 4, 8)
    _all_raise(world, lambda: ring_attention(qh, k, k, world), r"disagree.*heads")
    _all_raise(world, lambda: ring_attention(q.double() if last else q, k.double() if last else k,
                                             k.double() if last else k, world), r"disagree.*dtype")
    _all_raise(world, lambda: ring_attention(q, k, k, world, causal=last), r"disagree.*causal")
    cu = [0, 1, n] if last else [0, 2, n]
    _all_raise(world, lambda: ring_attention(q, k, k, world, cu_seqlens=cu), r"disagree.*cu_seqlens")
    world.barrier()


class _RecordingComm:
    """Forwards point-to-point calls to a real communicator and logs them with their sizes."""

    def __init__(self, comm, log):
        self._c, self.log = comm, log
        self.rank, self.size = comm.rank, comm.size

    def isend(self, buf, dest, tag=0):
        self.log.append(("isend", buf.nbytes))
        return self._c.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self.log.append(("irecv", buf.nbytes))
        return self._c.irecv(buf, source, tag)

    def waitall(self, reqs, timeout=None):
        self.log.append(("wait", None))
        return self._c.waitall(reqs, timeout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_communication_posted_before_compute(world, monkeypatch):
    """Double buffering, forward and backward, both rings: every step's K/V
    sends for the next step are posted before that step's block is computed,
    and the backward's travelling dk/dv receive for the next step too."""
    p = world.size
    for name in ("block_forward", "block_backward"):
        real = getattr(nnring, name)

        def spy(*a, _real=real, _name=name, **kw):
            log.append((_name, None))
            return _real(*a, **kw)

        monkeypatch.setattr(nnring, name, spy)
        # the backward's pieces run through commlib.nn._blocks.PieceGrads (shared with the halo path)
        monkeypatch.setattr(_blocks, name, spy)
    B, L, Hk, D = 1, 4, 2, 8
    for bidirectional in (False, True):
        log = []
        rc = _RecordingComm(world, log)
        glob = make_global(3, B, p * L, 4, Hk, D)
        pos = torch.from_numpy(sequence_positions("contiguous", world.rank, p, L))
        ql, kl, vl = (x[:, pos].to(torch.bfloat16).requires_grad_() for x in glob[:3])
        out = ring_attention(ql, kl, vl, rc, bidirectional=bidirectional)
        log.append(("backward", None))
        out.backward(glob[3][:, pos].to(torch.bfloat16))
        mark = log.index(("backward", None))
        n_streams = 2 if bidirectional else 1
        tokens = L // n_streams
        kv_bytes = 2 * B * tokens * Hk * D * 2     # bfloat16 K and V of one piece
        dkv_bytes = 2 * B * tokens * Hk * D * 4    # its float32 dk and dv
        for kernel in ("block_forward", "block_backward"):
            calls = [i for i, e in enumerate(log) if e[0] == kernel]
            lo, hi = (0, mark) if kernel == "block_forward" else (mark, len(log))
            sends = [i for i, e in enumerate(log) if e == ("isend", kv_bytes) and lo < i < hi]
            # not causal, contiguous: one block per stream and step (step 0: the own shard whole)
            assert len(calls) == 1 + n_streams * (p - 1), (kernel, len(calls))
            steps = [calls[0]] + calls[1::n_streams]
            assert len(sends) == n_streams * (p - 1)
            for step in range(p - 1):
                prev = steps[step - 1] if step else -1
                posted = [i for i in sends if prev < i < steps[step]]
                assert len(posted) == n_streams, f"{kernel} step {step}: K/V of the next step not posted first"
            if kernel == "block_backward":
                recvs = [i for i, e in enumerate(log) if e == ("irecv", dkv_bytes) and i > mark]
                assert len(recvs) == n_streams * p
                for step in range(p):
                    assert sum(i < steps[step] for i in recvs) >= n_streams * (step + 1)


# --------------------------------------------------- serial (size 1, no mpiexec)
@pytest.mark.timeout(60)
def test_serial_matches_oracle(selfcomm):
    for i, (layout, causal, bidirectional, docs, kv_heads) in enumerate(all_configs()):
        cu = documents(6) if docs else None
        check_config(selfcomm, F64, 1e-10, layout, causal, bidirectional, cu, kv_heads, seed=i)
        if i % 4 == 0:
            check_config(selfcomm, torch.float32, 1e-5, layout, causal, bidirectional, cu, kv_heads, seed=i)


@pytest.mark.timeout(60)
def test_gradcheck_float64(selfcomm, monkeypatch):
    """torch.autograd.gradcheck on tiny shapes: fused path, pieces, masked call, GQA."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 4, 4, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(1, 6, 2, 4, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(1, 6, 2, 4, generator=gen, dtype=F64, requires_grad=True)
    for causal, cu, cost in ((True, None, None), (False, [0, 2, 6], 0), (True, [0, 1, 3, 4, 6], 10 ** 9)):
        if cost is not None:
            monkeypatch.setattr(_blocks, "CALL_COST", cost)
        fn = lambda a, b, c: ring_attention(a, b, c, selfcomm, causal=causal, cu_seqlens=cu)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, fast_mode=True)


@pytest.mark.timeout(30)
def test_one_rank_is_one_fused_call(selfcomm, monkeypatch):
    """On one rank without documents, forward and backward are one kernel call each."""
    calls = []
    for name in ("block_forward", "block_backward"):
        real = getattr(nnring, name)
        monkeypatch.setattr(nnring, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    q, k, v, do = make_global(1, 1, 8, 4, 2, 8)
    for causal in (False, True):
        calls.clear()
        qq = q.clone().requires_grad_()
        ring_attention(qq, k, v, selfcomm, causal=causal, bidirectional=True).backward(do)
        assert calls == ["block_forward", "block_backward"]


@pytest.mark.timeout(30)
def test_non_contiguous_inputs(selfcomm):
    """Transposed views are accepted and give the contiguous inputs' results."""
    q, k, v, do = make_global(2, 1, 8, 4, 4, 8)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    qc = q.clone().requires_grad_()
    assert not qt.is_contiguous()
    a = ring_attention(qt, k, v, selfcomm, causal=True)
    b = ring_attention(qc, k, v, selfcomm, causal=True)
    a.backward(do)
    b.backward(do)
    assert torch.equal(a, b) and torch.equal(qt.grad, qc.grad)


@pytest.mark.timeout(30)
def test_plan_block_covers_each_visible_pair_once():
    """The planner's pieces (full, causal, masked) cover exactly the visible
    (query, key) pairs of every block of every ring, each once."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        p, seq_local = int(rng.integers(1, 5)), 2 * int(rng.integers(1, 6))
        n = p * seq_local
        layout = LAYOUTS[trial % 3]
        causal = bool(trial % 2)
        cu = None
        if trial % 4 >= 2:
            cu = np.concatenate([[0], np.sort(rng.integers(0, n + 1, int(rng.integers(1, 5)))), [n]])
        for r in range(p):
            qpos = piece_positions(layout, r, p, seq_local)
            sched = RingSchedule(p, r, bidirectional=trial % 3 == 1)
            for st in sched.steps():
                for stream in sched.streams:
                    half = stream.half if st.step else None
                    kpos = piece_positions(layout, sched.owner(stream, st.step), p, seq_local, half)
                    vis = np.ones((len(qpos), len(kpos)), bool)
                    if causal:
                        vis &= kpos[None, :] <= qpos[:, None]
                    if cu is not None:
                        dq, dk = np.searchsorted(cu, qpos, "right"), np.searchsorted(cu, kpos, "right")
                        vis &= dq[:, None] == dk[None, :]
                    for cost in (0, 10 ** 9):
                        cover = np.zeros(vis.shape, int)
                        for pc in _blocks.plan_block(qpos, kpos, causal, cu, call_cost=cost):
                            sub = np.ones((pc.q1 - pc.q0, pc.k1 - pc.k0), bool)
                            if pc.kind == "causal":
                                assert pc.q1 - pc.q0 == pc.k1 - pc.k0
                                sub = np.tril(sub)
                            if pc.mask is not None:
                                sub &= pc.mask
                            cover[pc.q0:pc.q1, pc.k0:pc.k1] += sub
                        assert np.array_equal(cover, vis), (layout, causal, cu, r, st)
                    if not st.step:
                        break
    # without documents every block is at most two kernel calls, none masked
    for layout in LAYOUTS:
        for r in range(4):
            for o in range(4):
                pcs = _blocks.plan_block(sequence_positions(layout, r, 4, 8), sequence_positions(layout, o, 4, 8),
                                         True)
                assert len(pcs) <= 2 and all(pc.mask is None for pc in pcs)


@pytest.mark.timeout(30)
def test_schedule_every_piece_once_and_balance():
    """Each rank holds every shard's pieces exactly once; the bidirectional
    ring's causal critical path equals the unidirectional one."""
    for p in (1, 2, 3, 5):
        for bidirectional in (False, True):
            for r in range(p):
                sched = RingSchedule(p, r, bidirectional)
                for stream in sched.streams:
                    owners = [sched.owner(stream, s) for s in range(p)]
                    assert sorted(owners) == list(range(p))
                    # the piece this rank holds at step s came from recv_from at step s - 1
                    for s in range(1, p):
                        assert sched.holder(stream, owners[s], s - 1) == sched.recv_from(stream)
                    # its travelling dk/dv is home after p hops
                    assert sched.holder(stream, r, p) == r
    for layout in LAYOUTS:
        assert np.array_equal(np.sort(np.concatenate(split_halves(layout, 10))), np.arange(10))
        for p in (2, 4):
            uni = ring_work(p, 16, layout, True, False)
            bi = ring_work(p, 16, layout, True, True)
            assert uni.sum() == bi.sum() == (p * 16) * (p * 16 + 1) // 2
            assert bi.max(axis=0).sum() == uni.max(axis=0).sum()


@pytest.mark.timeout(30)
def test_block_kernels_against_explicit():
    """The fused CPU kernels (with and without a mask, GQA) agree with the
    explicit fallback, rows without a visible key give out 0 and lse -inf, and
    merge() of two halves of the keys equals the whole."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 5, 8, generator=gen, dtype=F64)
    k = torch.randn(2, 2, 7, 8, generator=gen, dtype=F64)
    v = torch.randn(2, 2, 7, 8, generator=gen, dtype=F64)
    mask = torch.rand(5, 7, generator=gen) > 0.5
    mask[1] = False
    mask[0, 0] = True
    for kind, m in (("full", None), ("full", mask)):
        o1, l1 = _blocks.block_forward(q, k, v, 0.4, kind, m)
        o2, l2 = _blocks.explicit_forward(q, k, v, 0.4, kind, m)
        assert (o1 - o2).abs().max() < 1e-12
        assert torch.equal(torch.isneginf(l1), torch.isneginf(l2))
        fin = torch.isfinite(l2)
        assert (l1[fin] - l2[fin]).abs().max() < 1e-12
        if m is not None:
            assert not o1[:, :, 1].any() and torch.isneginf(l1[:, :, 1]).all()
        do = torch.randn_like(o1)
        lse = l2.masked_fill(torch.isneginf(l2), 0.0)  # as a global lse: finite
        g1 = _blocks.block_backward(do, q, k, v, o1, lse, 0.4, kind, m)
        g2 = _blocks.explicit_backward(do, q, k, v, o1, lse, 0.4, kind, m)
        for a, b in zip(g1, g2):
            assert (a - b).abs().max() < 1e-12
    qs = q[:, :, :5]
    ks, vs = k[:, :, :5], v[:, :, :5]
    o1, l1 = _blocks.block_forward(qs, ks, vs, 0.4, "causal")
    o2, l2 = _blocks.explicit_forward(qs, ks, vs, 0.4, "causal")
    assert (o1 - o2).abs().max() < 1e-12 and (l1 - l2).abs().max() < 1e-12
    whole_o, whole_l = _blocks.block_forward(q, k, v, 0.4)
    acc_o = torch.zeros_like(whole_o)
    acc_l = torch.full_like(whole_l, -math.inf)
    for sl in (slice(0, 3), slice(3, 7)):
        _blocks.merge(acc_o, acc_l, *_blocks.block_forward(q, k[:, :, sl], v[:, :, sl], 0.4))
    assert (acc_o - whole_o).abs().max() < 1e-12 and (acc_l - whole_l).abs().max() < 1e-12
