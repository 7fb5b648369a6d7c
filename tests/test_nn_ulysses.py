"""torch Ulysses and hybrid (USP) attention, the module wrapper and sequence sharding.

The oracle is float64 torch SDPA with autograd on the whole (gathered)
sequence, computed identically on every rank from the same seeded inputs;
the distributed result is gathered with ``unshard_sequence`` and compared.
Each rank's loss is ``sum(out_local * dout_local)``, so the distributed
gradients are those of ``sum(out * dout)`` over the whole sequence.  (Losses
rather than ``grad_outputs``: passing a gradient tensor to
``torch.autograd.grad`` imports sympy on first use, seconds on a busy box.)

Run serially (size-1 checks on ``COMM_SELF``) and under MPI::

    pytest tests/test_nn_ulysses.py
    mpiexec -n N python -m pytest --with-mpi -m mpi tests/test_nn_ulysses.py   # N = 1, 2, 3, 4

Tests that need ring attention (hybrid with a ring of more than one group,
the ring kinds of the module) skip while ``commlib.nn.ring`` is absent.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


from commlib.core.errors import InvalidArgument  # noqa: E402
from commlib.nn.hybrid import hybrid_attention  # noqa: E402
from commlib.nn.module import SequenceParallelAttention  # noqa: E402
from commlib.nn.shard import shard_sequence, unshard_sequence  # noqa: E402
from commlib.nn.ulysses import ulysses_attention  # noqa: E402

torch.set_num_threads(1)

LAYOUTS = ("contiguous", "striped", "zigzag")
F64 = torch.float64




# ------------------------------------------------------------------ the oracle
def make_inputs(seed, b, n, h, hk, d, dtype=F64):
    """Global q, k, v, dout, the same on every rank (seeded CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, n, h, d, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(b, n, hk, d, generator=g, dtype=F64) for _ in range(2))
    return tuple(x.to(dtype) for x in (q, k, v, do))


def doc_mask(cu, n, causal):
    """The oracle's own boolean mask: same document (and j <= i when causal)."""
    doc = torch.zeros(n, dtype=torch.int64)
    for c in cu[1:-1]:
        doc[c:] += 1
    m = doc[:, None] == doc[None, :]
    if causal:
        m &= torch.ones(n, n, dtype=torch.bool).tril()
    return m


def oracle(q, k, v, do, causal, scale=None, cu=None, dtype=F64):
    """SDPA in ``dtype`` with autograd on the whole sequence: out, dq, dk, dv."""
    q, k, v, do = (x.detach().to(dtype) for x in (q, k, v, do))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    mask = None if cu is None else doc_mask(cu, q.shape[1], causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), attn_mask=mask,
        is_causal=causal and mask is None, scale=scale).transpose(1, 2)
    grads = torch.autograd.grad((out * do).sum(), (q, k, v))
    return (out.detach(),) + grads


def run_sharded(fn, comm, layout, q, k, v, do):
    """Shard, run ``fn(q, k, v)`` with autograd, gather out and the gradients."""
    local = [shard_sequence(x, comm, layout).requires_grad_() for x in (q, k, v)]
    out = fn(*local)
    assert out.shape == local[0].shape and out.dtype == q.dtype
    grads = torch.autograd.grad((out * shard_sequence(do, comm, layout)).sum(), local)
    return [unshard_sequence(x.detach(), comm, layout, timeout=60) for x in (out,) + tuple(grads)]


def max_err(got, want):
    return (got.to(F64) - want.to(F64)).abs().max().item()


def rms_err(got, want):
    return (got.to(F64) - want.to(F64)).pow(2).mean().sqrt().item()


def assert_bf16_not_worse(got, base, want):
    """Root-mean-square error against the float64 oracle at most 1.5x
    single-process bfloat16 SDPA's (the maximum error is one bfloat16 ulp of
    the largest entry for both, too coarse to compare)."""
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), got, base, want):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), name
        assert rms_err(g, w) <= 1.5 * rms_err(b, w), f"{name}: {rms_err(g, w):.3e} vs SDPA {rms_err(b, w):.3e}"


def assert_matches(got, want, dtype):
    names = ("out", "dq", "dk", "dv")
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.isfinite(a).all(), name
        err, ref = max_err(a, b), b.abs().max().item()
        if dtype == F64:
            assert err <= 1e-10, f"{name}: float64 error {err:.3e}"
        else:
            assert err <= 1e-5 * ref, f"{name}: float32 relative error {err / ref:.3e}"


def check(comm, fn, layout, causal, dtype, h, hk, *, n=None, d=8, seed=1, scale=None, cu=None):
    n = 4 * comm.size if n is None else n
    q, k, v, do = make_inputs(seed, 2, n, h, hk, d, dtype)
    want = oracle(q, k, v, do, causal, scale, cu)
    assert_matches(run_sharded(fn, comm, layout, q, k, v, do), want, dtype)


# --------------------------------------------------------------- Ulysses (MPI)
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv", ["mha", "gqa", "mqa"])
def test_ulysses_matches_sdpa(world, kv, causal, dtype):
    p = world.size
    h = 2 * p
    hk = {"mha": h, "gqa": p, "mqa": 1}[kv]
    check(world, lambda q, k, v: ulysses_attention(q, k, v, world, causal=causal, timeout=60),
          "contiguous", causal, dtype, h, hk)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_ulysses_scale_documents_and_noncontiguous(world):
    """softmax_scale, cu_seqlens documents (causal and not), and non-contiguous views."""
    p = world.size
    n = 4 * p
    cu = [0, 1, n - 1, n]
    for causal in (False, True):
        check(world, lambda q, k, v, c=causal: ulysses_attention(q, k, v, world, c, 0.3, cu_seqlens=cu, timeout=60),
              "contiguous", causal, F64, 2 * p, p, scale=0.3, cu=cu)

    def transposed(q, k, v):  # (B, L, H, D) views of (B, H, L, D) storage
        q2, k2, v2 = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        assert not q2.is_contiguous()
        return ulysses_attention(q2, k2, v2, world, causal=True, timeout=60)

    check(world, transposed, "contiguous", True, F64, 2 * p, p)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_ulysses_gradcheck(world):
    """torch.autograd.gradcheck in float64 of the replicated function
    ``global q, k, v -> shard -> ulysses -> unshard``.  Shard's adjoint in that
    picture gathers the slices every rank's gradient covers (helper below).
    Above 2 ranks gradcheck's fast mode (random projections of the Jacobian)
    keeps the number of distributed calls small."""
    p = world.size

    class Shard(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return shard_sequence(x, world)

        @staticmethod
        def backward(ctx, g):
            return unshard_sequence(g.contiguous(), world, timeout=60)

    def f(q, k, v):
        out = ulysses_attention(Shard.apply(q), Shard.apply(k), Shard.apply(v), world, causal=True, timeout=60)
        return unshard_sequence(out, world, timeout=60)

    q, k, v, _ = make_inputs(5, 1, 2 * p, p, 1, 2)
    torch.manual_seed(0)  # fast mode's random projections: the same on every rank
    assert torch.autograd.gradcheck(f, tuple(x.requires_grad_() for x in (q, k, v)), eps=1e-6, atol=1e-8,
                                    fast_mode=p > 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_ulysses_bf16_error_not_worse_than_sdpa(world):
    """bfloat16 at this size: every error against the float64 oracle at most
    1.5x single-process bfloat16 SDPA's on the same inputs (root mean square)."""
    p = world.size
    q, k, v, do = make_inputs(11, 2, 16 * p, 2 * p, p, 16)
    want = oracle(q, k, v, do, True)
    base = oracle(q, k, v, do, True, dtype=torch.bfloat16)
    bf = [x.to(torch.bfloat16) for x in (q, k, v, do)]
    got = run_sharded(lambda a, b, c: ulysses_attention(a, b, c, world, causal=True, timeout=60), world,
                      "contiguous", *bf)
    assert_bf16_not_worse(got, base, want)


# ---------------------------------------------------------------- hybrid (MPI)
def _degrees(p):
    return [d for d in (1, 2, p) if p % d == 0 and d <= p]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", ["one", "two", "all"])
def test_hybrid_matches_sdpa(world, which, layout, causal):
    """Degree 1 (the ring), 2 (a 2-D grid at 4 ranks) and size (Ulysses, layouts put in order)."""
    p = world.size
    u = {"one": 1, "two": 2, "all": p}[which]
    if p % u:
        pytest.skip(f"ulysses_degree {u} does not divide {p} ranks")
    if u == p and which != "all":
        pytest.skip(f"degree {u} on {p} ranks is the 'all' case")
    for hk in sorted({u, 1}):  # GQA with kv heads divisible by u; MQA (replicated when u > 1)
        check(world, lambda q, k, v: hybrid_attention(q, k, v, world, u, causal, layout, timeout=60),
              layout, causal, F64, 2 * u, hk, n=8 * p, seed=hk)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_hybrid_float32_documents_bidirectional(world, layout):
    p = world.size
    u = 2 if p % 2 == 0 else p
    n = 8 * p
    cu = [0, 5, n - 3, n]
    check(world, lambda q, k, v: hybrid_attention(q, k, v, world, u, True, layout, 0.4, bidirectional=True,
                                                  cu_seqlens=cu, timeout=60),
          layout, True, torch.float32, 2 * u, u, n=n, scale=0.4, cu=cu)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_hybrid_bf16_error_not_worse_than_sdpa(world):
    p = world.size
    if p % 2:
        pytest.skip("needs an even size")
    q, k, v, do = make_inputs(13, 1, 16 * p, 4, 2, 16)
    want = oracle(q, k, v, do, True)
    base = oracle(q, k, v, do, True, dtype=torch.bfloat16)
    bf = [x.to(torch.bfloat16) for x in (q, k, v, do)]
    got = run_sharded(lambda a, b, c: hybrid_attention(a, b, c, world, 2, True, "zigzag", timeout=60), world,
                      "zigzag", *bf)
    assert_bf16_not_worse(got, base, want)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(60)
def test_hybrid_grid_is_made_once(world, monkeypatch):
    """Repeated calls reuse the cached sub-communicators (no new split)."""
    p = world.size
    if p % 2:
        pytest.skip("needs an even size")
    q, k, v, _ = make_inputs(2, 1, 4 * p, 2, 2, 4)
    ql, kl, vl = (shard_sequence(x, world, "zigzag") for x in (q, k, v))
    hybrid_attention(ql, kl, vl, world, 2, True, timeout=60)
    calls = []
    real = type(world).split
    monkeypatch.setattr(type(world), "split", lambda self, *a: calls.append(a) or real(self, *a))
    out1 = hybrid_attention(ql, kl, vl, world, 2, True, timeout=60)
    out2 = hybrid_attention(ql, kl, vl, world, 2, True, timeout=60)
    assert calls == [] and torch.equal(out1, out2)


# ---------------------------------------------------------------- module (MPI)
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["ulysses", "hybrid", "ring", "bidirectional"])
def test_module_dispatch(world, kind):
    p = world.size
    u = {"hybrid": 2 if p % 2 == 0 else 1, "ulysses": None}.get(kind)
    h = 2 * p
    for layout in ("zigzag", "contiguous"):
        attn = SequenceParallelAttention(world, kind, layout, causal=True, ulysses_degree=u, timeout=60)
        assert isinstance(attn, torch.nn.Module) and not list(attn.parameters())
        check(world, lambda q, k, v, a=attn: a(q, k, v), layout, True, F64, h, p, seed=3)
        n = 4 * p
        cu = torch.tensor([0, 2, n], dtype=torch.int32)
        check(world, lambda q, k, v, a=attn: a(q, k, v, cu_seqlens=cu), layout, True, F64, h, p, seed=4,
              cu=cu.tolist())


# ----------------------------------------------------------- sharding (MPI)
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_unshard_roundtrip(world, layout):
    from commlib.collectives.attention import sequence_positions  # noqa: PLC0415
    p = world.size
    for n, pad in ((4 * p, False), (2 * p + 1, True), (1, True)):
        x = torch.arange(3 * n * 2, dtype=torch.float32).reshape(3, n, 2)
        part = shard_sequence(x, world, layout, pad=pad)
        L = part.shape[1]
        assert part.is_contiguous() and L * p >= n
        pos = torch.as_tensor(sequence_positions(layout, world.rank, p, L))
        ok = pos < n
        assert torch.equal(part[:, ok], x[:, pos[ok]]) and not part[:, ~ok].any()
        assert torch.equal(unshard_sequence(part, world, layout, seq_len=n, timeout=30), x)
    y = torch.arange(4 * p * 5).reshape(4 * p, 5)  # another dim, int64
    assert torch.equal(unshard_sequence(shard_sequence(y, world, layout, dim=0), world, layout, dim=0), y)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unshard_gradient_conventions(world, layout):
    """Replicated loss (default: this rank's slice) and per-rank losses
    (``sum_grad``: the sum of every rank's slice), each against autograd on
    the whole tensor in one process."""
    p, r = world.size, world.rank
    n = 4 * p
    x, = make_inputs(7, 1, n, 2, 1, 3)[:1]
    weights = [make_inputs(100 + s, 1, n, 2, 1, 3)[0] for s in range(p)]
    # every rank: the same loss sum(w_0 * x**3)
    xl = shard_sequence(x, world, layout).requires_grad_()
    (unshard_sequence(xl, world, layout, timeout=30) ** 3 * weights[0]).sum().backward()
    xg = x.clone().requires_grad_()
    (xg ** 3 * weights[0]).sum().backward()
    assert max_err(xl.grad, shard_sequence(xg.grad, world, layout)) <= 1e-12
    # rank s: its own loss sum(w_s * x**3); the objective is their sum
    xl = shard_sequence(x, world, layout).requires_grad_()
    (unshard_sequence(xl, world, layout, sum_grad=True, timeout=30) ** 3 * weights[r]).sum().backward()
    xg = x.clone().requires_grad_()
    sum((xg ** 3 * w).sum() for w in weights).backward()
    assert max_err(xl.grad, shard_sequence(xg.grad, world, layout)) <= 1e-12


# ------------------------------------------------------------ bad input (MPI)
def _all_raise(comm, fn, match):
    with pytest.raises(InvalidArgument, match=match) as ei:
        fn()
    assert f"rank {comm.rank}" in str(ei.value)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_input_raises_on_every_rank(world):
    """Every rank raises InvalidArgument before any data moves (a hang would time out);
    the calls work afterwards (nothing half-sent is left behind)."""
    p, r = world.size, world.rank
    q = torch.zeros(1, 2, 2 * p, 4, dtype=F64)
    k = torch.zeros(1, 2, p, 4, dtype=F64)
    U = lambda *a, **kw: ulysses_attention(*a, timeout=30, **kw)  # noqa: E731
    _all_raise(world, lambda: U(q[0], k, k, world), "4-d")
    _all_raise(world, lambda: U(q, k.float(), k, world), "dtype")
    _all_raise(world, lambda: U(q.int(), k.int(), k.int(), world), "not supported")
    _all_raise(world, lambda: U(q, k, k.to("meta"), world), "is on")
    _all_raise(world, lambda: U(q, k, k[..., :2], world), "differs")
    _all_raise(world, lambda: U(q, k, k, world, softmax_scale=-1.0), "softmax_scale")
    _all_raise(world, lambda: U(q, k, k, world, causal=1), "causal")
    _all_raise(world, lambda: U(q, k, k, world, cu_seqlens=[0, 5, 1]), "cu_seqlens")
    _all_raise(world, lambda: U(q, k, k, world, cu_seqlens=[0.0, 2 * p]), "cu_seqlens")
    _all_raise(world, lambda: U(q.numpy(), k, k, world), "q must be a torch tensor")
    # one rank alone is wrong: every rank raises
    _all_raise(world, lambda: U(q if r else q[:, :, :, :3], k, k, world), r"rank\(s\) \[0\]" if r else "does not match")
    H = lambda *a, **kw: hybrid_attention(*a, timeout=30, **kw)  # noqa: E731
    _all_raise(world, lambda: H(q, k, k, world, 0), "ulysses_degree")
    _all_raise(world, lambda: H(q, k, k, world, p + 1), "ulysses_degree")
    _all_raise(world, lambda: H(q, k, k, world, p, layout="spiral"), "layout")
    _all_raise(world, lambda: H(q[:, :1], k[:, :1], k[:, :1], world, p, layout="zigzag"), "even")
    if p > 1:
        _all_raise(world, lambda: U(torch.zeros(1, 2, p + 1, 4), torch.zeros(1, 2, p + 1, 4),
                                    torch.zeros(1, 2, p + 1, 4), world), "divisible")
        hk = 3 if p % 3 and 3 % p else 5  # neither divides p nor is divided by it
        qq, kk = torch.zeros(1, 2, hk * p, 4), torch.zeros(1, 2, hk, 4)
        _all_raise(world, lambda: U(qq, kk, kk, world), "kv_heads")
        _all_raise(world, lambda: H(qq, kk, kk, world, p), "kv_heads")
        # ranks disagree: sequence length, dtype
        qs, ks = (x[:, :1] if r == 0 else x for x in (q, k))
        _all_raise(world, lambda: U(qs, ks, ks, world), "seq_local differs across ranks")
        qd, kd = (x.float() if r == 0 else x for x in (q, k))
        _all_raise(world, lambda: U(qd, kd, kd, world), "dtype differs across ranks")
        _all_raise(world, lambda: H(q, k, k, world, 1 if r else p), "ulysses_degree differs")
        xs = torch.zeros(2 if r else 3, 4)
        _all_raise(world, lambda: unshard_sequence(xs, world, timeout=30), "differs across ranks")
    _all_raise(world, lambda: unshard_sequence(q, world, "spiral", timeout=30), "layout")
    _all_raise(world, lambda: unshard_sequence(q, world, dim=7, timeout=30), "dim")
    _all_raise(world, lambda: unshard_sequence(q, world, seq_len=2 * p + 5, timeout=30), "seq_len")
    _all_raise(world, lambda: shard_sequence(torch.zeros(1, 2 * p + 1), world, "zigzag", pad=False), "divisible")
    # the calls still work
    qr, kr, _, _ = make_inputs(9, 1, 2 * p, 2 * p, p, 4)
    qr, kr = shard_sequence(qr, world), shard_sequence(kr, world)
    assert torch.isfinite(U(qr, kr, kr, world, causal=True)).all()


# --------------------------------------------------- serial (size 1, no mpiexec)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_serial_ulysses_and_hybrid(selfcomm, causal):
    for dtype in (F64, torch.float32):
        check(selfcomm, lambda q, k, v: ulysses_attention(q, k, v, selfcomm, causal), "contiguous", causal, dtype,
              4, 2)
        for layout in LAYOUTS:
            check(selfcomm, lambda q, k, v, lay=layout: hybrid_attention(q, k, v, selfcomm, 1, causal, lay),
                  layout, causal, dtype, 4, 1)


@pytest.mark.timeout(60)
def test_serial_gradcheck(selfcomm):
    q, k, v, _ = make_inputs(5, 1, 4, 2, 1, 3)
    assert torch.autograd.gradcheck(lambda a, b, c: ulysses_attention(a, b, c, selfcomm, True, 0.7),
                                    tuple(x.requires_grad_() for x in (q, k, v)), eps=1e-6, atol=1e-8)


@pytest.mark.timeout(30)
def test_module_refuses_bad_construction(selfcomm):
    for kw, match in ((dict(kind="spiral"), "kind"), (dict(layout="spiral"), "layout"),
                      (dict(kind="hybrid"), "ulysses_degree"), (dict(kind="hybrid", ulysses_degree=2), "divisor"),
                      (dict(kind="ulysses", ulysses_degree=2), "ulysses_degree"),
                      (dict(kind="ring", ulysses_degree=2), "ulysses_degree"), (dict(causal="yes"), "causal")):
        with pytest.raises(InvalidArgument, match=match):
            SequenceParallelAttention(selfcomm, **kw)
    m = SequenceParallelAttention(selfcomm, "ulysses", "zigzag")
    assert "ulysses" in repr(m)


@pytest.mark.timeout(30)
def test_serial_shard_pads_and_refuses_without_pad(selfcomm):
    x = torch.arange(5.0).reshape(1, 5)
    with pytest.raises(InvalidArgument, match="divisible"):
        shard_sequence(x, selfcomm, "zigzag", pad=False)
    part = shard_sequence(x, selfcomm, "zigzag")  # pads by default, as commlib.shard_sequence
    assert part.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 0.0]]
    assert torch.equal(unshard_sequence(part, selfcomm, "zigzag", seq_len=5), x)
