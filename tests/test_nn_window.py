"""Sliding-window attention (``window=(left, right)`` on commlib.nn.ring_attention)
against a float64 torch oracle, and the bytes it moves.

Run serially (the planner against a brute-force visibility) and under MPI at
1-4 ranks::

    mpiexec -n N python -m pytest --with-mpi -m mpi tests/test_nn_window.py   # N = 1, 2, 3, 4

The oracle is written here from the definition (FlashAttention-2's
``window_size``): float64 torch SDPA with autograd on the whole sequence, with
a boolean mask built from positions: key ``j`` visible to query ``i`` when
``i - left <= j`` (``left >= 0``), ``j <= i + right`` (``right >= 0``), ``j <=
i`` (causal) and both in one ``cu_seqlens`` document.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from commlib.collectives.attention.layout import LAYOUTS, sequence_positions  # noqa: E402
from commlib.core.errors import CommError, InvalidArgument  # noqa: E402
from commlib.nn import SequenceParallelAttention, hybrid_attention, ring_attention, ulysses_attention  # noqa: E402
from commlib.nn import _blocks  # noqa: E402
from commlib.nn import window as nnwindow  # noqa: E402

F64 = torch.float64
SEED = 20261129


# ------------------------------------------------------------------ the oracle
def window_mask(n, causal, cu, window):
    """Bool ``(n, n)``: query i may see key j."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    vis = torch.ones(n, n, dtype=torch.bool)
    left, right = window
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    if causal:
        vis &= j <= i
    if cu is not None:
        doc = torch.from_numpy(np.searchsorted(np.asarray(cu), np.arange(n), side="right"))
        vis &= doc[:, None] == doc[None, :]
    return vis


def oracle(q, k, v, dout, causal, cu, window, dtype=F64):
    """SDPA with the window mask on the whole sequence, in ``dtype``: (out, dq, dk, dv) as float64."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    mask = window_mask(q.shape[1], causal, cu, window)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    out.backward(dout.to(dtype))
    return [t.detach().to(F64) for t in (out, q.grad, k.grad, v.grad)]


def make_global(seed, batch, n, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(batch, n, h, dim, generator=gen, dtype=F64)  # noqa: E731
    return mk(heads), mk(kv_heads), mk(kv_heads), mk(heads)


def check(comm, layout, causal, cu, window, kv_heads, *, seq_local=8, seed=SEED, module=False, kind="ring",
          degree=None):
    p, r = comm.size, comm.rank
    n = p * seq_local
    glob = make_global(seed, 2, n, 4, kv_heads, 8)
    pos = torch.from_numpy(sequence_positions(layout, r, p, seq_local))
    ql, kl, vl = (x[:, pos].clone().requires_grad_() for x in glob[:3])
    if module:
        attn = SequenceParallelAttention(comm, kind=kind, layout=layout, causal=causal, window=window, timeout=60,
                                         ulysses_degree=degree)
        out = attn(ql, kl, vl, cu_seqlens=cu)
    elif kind == "ulysses":
        out = ulysses_attention(ql, kl, vl, comm, causal=causal, cu_seqlens=cu, window=window, timeout=60)
    elif kind == "hybrid":
        out = hybrid_attention(ql, kl, vl, comm, degree, causal=causal, layout=layout, cu_seqlens=cu, window=window,
                               timeout=60)
    else:
        out = ring_attention(ql, kl, vl, comm, causal=causal, layout=layout, cu_seqlens=cu, window=window,
                             timeout=60)
    out.backward(glob[3][:, pos])
    want = oracle(*glob, causal, cu, window)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), want):
        assert g.dtype == F64 and not torch.isnan(g).any()
        err = ((g.detach() - w[:, pos]).abs().max() / w.abs().max()).item()
        assert err <= 1e-10, (f"{name}: {err:.2e} (rank {r}/{p}, {layout}, causal={causal}, cu={cu}, "
                              f"window={window}, kv_heads={kv_heads}, kind={kind}, degree={degree}, seed={seed})")


def windows(L):
    """Smaller than, equal to and larger than a shard of ``L``; left-only and two-sided."""
    return [(3, 0), (2, 3), (L, 0), (L, L), (L + L // 2 + 1, 0), (L + 3, 2 * L + 1), (-1, 2), (5, -1)]


# ------------------------------------------------------------ serial: the planner
def test_window_plan_covers_each_visible_pair_once():
    """plan_window_block against a brute-force visibility: random positions,
    windows, documents, causal and tile sizes; every visible pair once, nothing else."""
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    for _ in range(200):
        kpos = np.sort(rng.choice(120, int(rng.integers(1, 60)), replace=False))
        qpos = np.sort(rng.choice(120, int(rng.integers(1, 40)), replace=False))
        causal = bool(rng.integers(2))
        window = (int(rng.integers(-1, 25)), int(rng.integers(-1, 25)))
        cu = None if rng.integers(2) else np.concatenate([[0], np.sort(rng.integers(0, 120, 3)), [120]])
        want = window_mask(120, causal, cu, window).numpy()[np.ix_(qpos, kpos)].astype(int)
        got = np.zeros_like(want)
        for pc in _blocks.plan_window_block(qpos, kpos, causal, cu, window, tile=int(rng.integers(1, 9))):
            m = np.ones((pc.q1 - pc.q0, pc.k1 - pc.k0), dtype=bool)
            if pc.kind == "causal":
                m = np.tril(m)
            if pc.mask is not None:
                m &= pc.mask
            got[pc.q0:pc.q1, pc.k0:pc.k1] += m
        assert (got == want).all()


def test_window_work_is_bounded_by_the_window():
    """Score entries the pieces compute: about rows x (window + tile), not
    rows x keys; and a block wholly outside the window has no piece."""
    L, W, T = 4096, 1024, 256
    q = np.arange(L, 2 * L)
    for causal, window, span in ((True, (W - 1, 0), W), (False, (W // 2, W // 2), W + 1)):
        own = _blocks.plan_window_block(q, q, causal, None, window, tile=T)
        prev = _blocks.plan_window_block(q, np.arange(0, L), causal, None, window, tile=T)
        work = sum(p.work for p in own + prev)
        assert work <= L * (span + 2 * T), (causal, work, L * (span + 2 * T))
    assert _blocks.plan_window_block(q, np.arange(2 * L, 3 * L), True, None, (W - 1, 0), tile=T) == []
    assert _blocks.plan_window_block(np.arange(2 * L, 3 * L), np.arange(0, L), False, None, (W, W), tile=T) == []


def test_effective_window():
    ew = nnwindow.effective_window
    assert ew(None, True, 10) is None
    assert ew((-1, -1), False, 10) is None
    assert ew((-1, 7), True, 10) is None          # causal: right is 0, left unbounded: plain causal
    assert ew((3, 7), True, 10) == (3, 0)
    assert ew((9, 2), False, 10) == (-1, 2)       # as long as the sequence: unbounded
    assert ew((2, 2), False, 10) == (2, 2)


# ------------------------------------------------------------ MPI: every size
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(180)
def test_window_matches_oracle_contiguous(world, monkeypatch):
    """Contiguous layout: windows smaller than, equal to and larger than a
    shard, left-only and two-sided, causal or not, with and without packed
    documents, MHA/GQA/MQA: out, dq, dk, dv to 1e-10; tiles of 3 rows too."""
    L = 8
    n = world.size * L
    docs = np.array([0, 3, 3, n // 2 + 1, n], dtype=np.int64)
    i = 0
    for window in windows(L):
        for causal in (False, True):
            for cu in (None, docs):
                check(world, "contiguous", causal, cu, window, (4, 2, 1)[i % 3])
                i += 1
    monkeypatch.setattr(_blocks, "WINDOW_TILE", 3)
    n = world.size * 12
    docs = np.array([0, 3, 3, n // 2 + 1, n], dtype=np.int64)
    for window in ((3, 0), (2, 3), (L + 3, 0)):
        for causal in (False, True):
            check(world, "contiguous", causal, docs, window, 2, seq_local=12)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_window_matches_oracle_other_layouts(world):
    """Zigzag and striped: the halo plan follows the layout's positions."""
    L = 8
    n = world.size * L
    docs = np.array([0, 5, n // 2 + 1, n], dtype=np.int64)
    for layout in LAYOUTS[1:]:
        for window, causal, cu in (((3, 0), True, None), ((2, 3), False, docs), ((L + 1, 0), True, docs),
                                   ((L, 2), False, None)):
            check(world, layout, causal, cu, window, 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_window_both_schedules(world, monkeypatch):
    """The windowed ring (every shard travels, blocks cut to the window) and
    the halo exchange, each forced on the layouts the other would take."""
    L = 8
    n = world.size * L
    docs = np.array([0, 5, n // 2 + 1, n], dtype=np.int64)
    for schedule, layouts in (("ring", ("contiguous", "zigzag")), ("halo", ("striped",))):
        monkeypatch.setattr(nnwindow, "SCHEDULE", schedule)
        for layout in layouts:
            for window, causal, cu in (((3, 0), True, docs), ((2, 5), False, None), ((L + 2, 0), True, None)):
                check(world, layout, causal, cu, window, 2)
        check(world, layouts[0], True, docs, (4, 0), 1, module=True, kind="bidirectional")


def test_schedule_choice():
    """The halo while it brings a rank at most two shards' rows or half the
    ring's; the ring past both (the striped layout over 4 ranks)."""
    pays = nnwindow.halo_pays
    assert pays(4, 1024, "contiguous", True, None, (255, 0))
    assert pays(4, 1024, "zigzag", True, None, (255, 0))
    assert pays(16, 1024, "contiguous", True, None, (4095, 0))      # 4 shards of 15: bytes saved
    assert not pays(4, 1024, "striped", True, None, (255, 0))       # every row of every rank
    assert not pays(4, 1024, "contiguous", False, None, (-1, 3))    # unbounded: 3 shards of 3
    assert pays(2, 1024, "striped", True, None, (255, 0))           # one shard: no more than the ring


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_window_module(world):
    """SequenceParallelAttention(window=...) is the function's window."""
    check(world, "contiguous", True, None, (5, 0), 2, module=True)
    check(world, "zigzag", False, None, (3, 3), 4, module=True)
    check(world, "contiguous", False, None, (9, 2), 1, module=True, kind="bidirectional")


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_window_ulysses_and_hybrid(world):
    """Ulysses (the window a mask on the local attention) and the hybrid (the
    halo exchange across the groups, or the mask when one group holds every
    rank), functions and module."""
    p = world.size
    L = 8
    docs = np.array([0, 5, p * L // 2 + 1, p * L], dtype=np.int64)
    cases = (((3, 0), True, None), ((2, 3), False, docs), ((L + 1, 0), True, docs))
    if 4 % p == 0:  # 4 heads over the ranks
        for window, causal, cu in cases:
            check(world, "contiguous", causal, cu, window, 2, kind="ulysses")
        check(world, "zigzag", True, docs, (5, 0), 2, kind="ulysses", module=True)
    if p % 2 == 0:
        for layout in ("contiguous", "zigzag"):
            for window, causal, cu in cases:
                check(world, layout, causal, cu, window, 2, kind="hybrid", degree=2)
        check(world, "striped", True, None, (4, 0), 4, kind="hybrid", degree=2, module=True)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_window_float32_and_bfloat16(world):
    """float32 within 1e-5 (max error over the largest entry); bfloat16's
    relative Frobenius error over every rank's shard at most 1.5x that of
    single-process bfloat16 SDPA with the same mask on the same inputs."""
    from mpi4py import MPI  # noqa: PLC0415

    p, r = world.size, world.rank
    L = 16
    n = p * L
    docs = np.array([0, 7, n // 2 + 3, n], dtype=np.int64)
    for seed, (dtype, causal, cu, window) in enumerate(((torch.float32, True, docs, (11, 0)),
                                                        (torch.float32, False, None, (5, 9)),
                                                        (torch.bfloat16, True, None, (12, 0)),
                                                        (torch.bfloat16, False, docs, (9, 13)))):
        glob = make_global(SEED + seed, 1, n, 4, 2, 32)
        pos = torch.from_numpy(sequence_positions("contiguous", r, p, L))
        ql, kl, vl = (x[:, pos].to(dtype).requires_grad_() for x in glob[:3])
        out = ring_attention(ql, kl, vl, world, causal=causal, cu_seqlens=cu, window=window, timeout=60)
        assert out.dtype == dtype
        out.backward(glob[3][:, pos].to(dtype))
        got = [t.detach().to(F64) for t in (out, ql.grad, kl.grad, vl.grad)]
        exact = oracle(*glob, causal, cu, window)
        base = oracle(*glob, causal, cu, window, dtype=dtype) if dtype != torch.float32 else None
        for i, (name, g, e) in enumerate(zip(("out", "dq", "dk", "dv"), got, exact)):
            if dtype == torch.float32:
                err = ((g - e[:, pos]).abs().max() / e.abs().max()).item()
                assert err <= 1e-5, (name, err, causal, window, f"seed {SEED + seed}")
                continue
            sums = np.array([((g - e[:, pos]) ** 2).sum().item(), (e[:, pos] ** 2).sum().item()])
            tot = np.empty_like(sums)
            MPI.COMM_WORLD.Allreduce(sums, tot)
            err = (tot[0] / tot[1]) ** 0.5
            ref = ((base[i] - e).norm() / e.norm()).item()
            assert err <= 1.5 * ref, (name, err, ref, causal, window, f"seed {SEED + seed}")


class _Recording:
    """Forwards point-to-point calls to a real communicator and logs ``(what, peer, bytes)``."""

    def __init__(self, comm, log):
        self._c, self.log = comm, log
        self.rank, self.size = comm.rank, comm.size

    def isend(self, buf, dest, tag=0):
        self.log.append(("isend", dest, buf.nbytes))
        return self._c.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self.log.append(("irecv", source, buf.nbytes))
        return self._c.irecv(buf, source, tag)

    def waitall(self, reqs, timeout=None):
        return self._c.waitall(reqs, timeout)


def _traffic(world, seq_local, window, causal, monkeypatch, B=1, hk=2, D=8):
    """The messages this rank posted in the forward's and the backward's
    exchange (the argument agreement's messages, before them, left out), and
    the LINK_BYTES the call added."""
    log = []
    marks = []
    for name in ("window_forward", "window_backward"):
        real = getattr(nnwindow, name)

        def spy(*a, _real=real, **kw):
            marks.append(len(log))
            return _real(*a, **kw)

        monkeypatch.setattr(nnwindow, name, spy)
    rc = _Recording(world, log)
    p, r = world.size, world.rank
    glob = make_global(SEED, B, p * seq_local, 4, hk, D)
    pos = torch.from_numpy(sequence_positions("contiguous", r, p, seq_local))
    ql, kl, vl = (x[:, pos].float().requires_grad_() for x in glob[:3])
    nnwindow.LINK_BYTES.clear()
    out = ring_attention(ql, kl, vl, rc, causal=causal, window=window, timeout=60)
    out.backward(glob[3][:, pos].float())
    monkeypatch.undo()
    if not marks:  # the window hides nothing here (one rank, a window as long as the sequence): the plain ring
        return [], [], dict(nnwindow.LINK_BYTES)
    fwd, bwd = log[marks[0]:marks[1]], log[marks[1]:]
    return fwd, bwd, dict(nnwindow.LINK_BYTES)


def _rows_inside(p, r, L, window, causal):
    """K/V rows outside rank r's shard that some local query's window covers (contiguous layout)."""
    left, right = window
    right = 0 if causal else right
    lo = max(0, r * L - left)
    hi = min(p * L, (r + 1) * L + right)
    return (r * L - lo) + (hi - (r + 1) * L)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bytes_bounded_by_the_window(world, monkeypatch):
    """Window <= shard, contiguous: each rank receives exactly the K/V rows
    inside its queries' windows (at most 1.1x of them), from its neighbours
    only, the same for a shard of 16 and of 32 tokens (flat in the sequence
    length; the count does not depend on the rank count either); the
    backward returns only their float32 dk/dv.  LINK_BYTES agrees with the
    messages posted."""
    p, r = world.size, world.rank
    hk, D = 2, 8
    for window, causal in (((5, 0), True), ((5, 3), False), ((16, 0), True)):
        per_len = []
        for L in (16, 32):
            fwd, bwd, link = _traffic(world, L, window, causal, monkeypatch, hk=hk, D=D)
            rows = _rows_inside(p, r, L, window, causal)
            row_bytes = 2 * hk * D * 4                      # K and V of one float32 token
            got = sum(b for what, _, b in fwd if what == "irecv")
            assert rows * row_bytes <= got <= 1.1 * rows * row_bytes, (window, L, got, rows)
            assert {peer for what, peer, _ in fwd} <= {(r - 1) % p, (r + 1) % p}
            # the backward: the dk/dv of the received rows go back, float32 (2 x the K/V of float32 rows)
            back = sum(b for what, _, b in bwd if what == "isend")
            assert back == rows * row_bytes, (window, L, back)
            sent = {}
            for what, peer, b in fwd:
                if what == "isend":
                    sent[("forward", r, peer)] = sent.get(("forward", r, peer), 0) + b
            for what, peer, b in bwd:
                if what == "isend":
                    sent[("backward", r, peer)] = sent.get(("backward", r, peer), 0) + b
            assert sent == link
            per_len.append(got)
        assert per_len[0] == per_len[1], (window, per_len)   # flat in the sequence length
        if 0 < r < p - 1 or p == 1:
            lr = 0 if p == 1 else window[0] + (0 if causal else window[1])
            assert per_len[0] == lr * 2 * hk * D * 4        # flat in the rank count: left (+ right) rows


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_wider_window_reaches_only_the_ranks_it_covers(world, monkeypatch):
    """A window of 1.5 shards, causal: K/V come from the previous two ranks
    only (no message from a rank wholly outside the window)."""
    p, r = world.size, world.rank
    L = 8
    fwd, _, _ = _traffic(world, L, (L + L // 2, 0), True, monkeypatch)
    sources = {peer for what, peer, _ in fwd if what == "irecv"}
    assert sources == {s for s in (r - 1, r - 2) if s >= 0}
    got = sum(b for what, _, b in fwd if what == "irecv")
    assert got == _rows_inside(p, r, L, (L + L // 2, 0), True) * 2 * 2 * 8 * 4


def _all_raise(comm, fn, match, op="ring_attention"):
    with pytest.raises(InvalidArgument, match=match) as ei:
        fn()
    assert isinstance(ei.value, CommError)
    assert f"rank {comm.rank}" in str(ei.value) and op in str(ei.value)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_window_raises_on_every_rank(world):
    """A bad window raises the same CommError on every rank before any K/V
    moves (a hang would time out); ranks disagreeing on it too."""
    q = torch.zeros(1, 4, 4, 8)
    k = torch.zeros(1, 4, 2, 8)
    for bad, match in (((-2, 0), "left must be >= -1"), ((0, -3), "right must be >= -1"),
                       ((1.5, 0), "left must be an int"), ((True, 0), "left must be an int"),
                       (5, "pair"), ((1, 2, 3), "pair"), ("ab", "pair")):
        _all_raise(world, lambda bad=bad: ring_attention(q, k, k, world, window=bad, timeout=30), match)
    last = world.rank == world.size - 1
    if world.size > 1:
        _all_raise(world, lambda: ring_attention(q, k, k, world, window=(2, 0) if last else (3, 0), timeout=30),
                   r"disagree.*window")
    with pytest.raises(InvalidArgument, match="window") as ei:
        SequenceParallelAttention(world, kind="ring", window=(-5, 0))
    assert f"rank {world.rank}" in str(ei.value) and "SequenceParallelAttention" in str(ei.value)
    if 4 % world.size == 0:
        _all_raise(world, lambda: ulysses_attention(q, k, k, world, window=(0, -2), timeout=30),
                   "right must be >= -1", op="ulysses_attention")
        if world.size > 1:
            _all_raise(world, lambda: ulysses_attention(q, k, k, world, window=(2, 0) if last else None, timeout=30),
                       r"disagree.*window", op="ulysses_attention")
    if world.size % 2 == 0:
        _all_raise(world, lambda: hybrid_attention(q, k, k, world, 2, window=(1, "x"), timeout=30),
                   "right must be an int", op="hybrid_attention")
    # the attention works afterwards
    check(world, "contiguous", True, None, (3, 0), 2)
    world.barrier()
