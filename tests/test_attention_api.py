"""The attention API as a new user meets it: no silently wrong result, every mistake refused clearly.

Serial: ``pytest tests/test_attention_api.py``; MPI at 1-4 ranks::

    mpiexec -n N python -P -m pytest --with-mpi -m mpi tests/test_attention_api.py

* one argument order, ``(q, k, v, comm)``, in ``commlib.nn`` and the numpy
  ``commlib.ring_attention``: the communicator first still works, with a
  ``DeprecationWarning`` and the same result; no communicator in its slot is an
  ``InvalidArgument`` naming the call (not a bare ``AttributeError``);
* ``qkv_format="bhsd"`` (SDPA's ``(batch, heads, seq, head_dim)``) on every
  ``commlib.nn`` attention call and the module: out and dq/dk/dv in that
  format, against float64 SDPA on the whole sequence; bhsd tensors passed
  as bshd are refused where the shapes tell (GQA, ``cu_seqlens``), on every
  rank alike;
* the layout said once: ``commlib.nn.Sharding`` shards, carries its layout to
  every call and the module, unshards: equal to the dense oracle for every
  layout; a shard cut in one layout given to a call in another is refused;
* ``commlib.shard_sequence`` (numpy) refuses a torch tensor, pointing to
  ``commlib.nn.shard_sequence``.

Oracles: :func:`torch.nn.functional.scaled_dot_product_attention` in float64
on the whole sequence, with autograd, built here.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
import commlib.nn as cnn  # noqa: E402
from commlib.collectives.attention.layout import LAYOUTS, sequence_positions  # noqa: E402
from commlib.core.errors import InvalidArgument  # noqa: E402

F64 = torch.float64
TOL = 1e-10  # float64 against float64 SDPA: rounding only


def _global(p, *, heads=None, kv_heads=1, dim=8, per_rank=4, seed=0, fmt="bshd"):
    """Global q, k, v, dout (float64, ``fmt`` order): ``per_rank * p`` tokens
    (divisible by ``2p``: every layout), ``heads`` a multiple of p (Ulysses)."""
    heads = heads or 2 * p
    gen = torch.Generator().manual_seed(seed)
    n = per_rank * p
    hs = (heads, kv_heads, kv_heads, heads)
    shape = (lambda h: (1, n, h, dim)) if fmt == "bshd" else (lambda h: (1, h, n, dim))
    return [torch.randn(*shape(h), generator=gen, dtype=F64) for h in hs]


def _oracle(q, k, v, dout, causal, fmt="bshd"):
    """float64 SDPA on the whole sequence: ``(out, dq, dk, dv)`` in ``fmt``."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    if fmt == "bshd":
        qh, kh, vh, dh = (x.transpose(1, 2) for x in (q, k, v, dout))
    else:
        qh, kh, vh, dh = q, k, v, dout
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
    o.backward(dh)
    out = o.transpose(1, 2) if fmt == "bshd" else o
    return out.detach(), q.grad, k.grad, v.grad


def _close(got, want, what):
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= TOL * scale, f"{what}: max error {err:.3g}"


def _kinds(p):
    """The attention calls, each as ``f(q, k, v, comm, **kw)`` (comm may be a Sharding)."""
    return {
        "ring": lambda q, k, v, c, **kw: cnn.ring_attention(q, k, v, c, **kw),
        "bidirectional": lambda q, k, v, c, **kw: cnn.ring_attention_bidirectional(q, k, v, c, **kw),
        "ulysses": lambda q, k, v, c, **kw: cnn.ulysses_attention(q, k, v, c, **kw),
        "hybrid": lambda q, k, v, c, **kw: cnn.hybrid_attention(q, k, v, c, 2 if p % 2 == 0 else 1, **kw),
    }


# ------------------------------------------------------------------ argument order
def _order(comm):
    p = comm.size
    Q, K, V, _ = _global(p, kv_heads=p)  # the numpy Ulysses needs kv_heads divisible by p
    pos = torch.from_numpy(sequence_positions("contiguous", comm.rank, p, Q.shape[1] // p))
    q, k, v = (x[:, pos] for x in (Q, K, V))
    for name, f in _kinds(p).items():
        fn = {"ring": cnn.ring_attention, "bidirectional": cnn.ring_attention_bidirectional,
              "ulysses": cnn.ulysses_attention, "hybrid": cnn.hybrid_attention}[name]
        extra = (2 if p % 2 == 0 else 1,) if name == "hybrid" else ()
        kw = {"layout": "contiguous"} if name == "hybrid" else {}
        want = fn(q, k, v, comm, *extra, causal=True, **kw)
        with pytest.warns(DeprecationWarning, match=r"\(q, k, v, comm"):
            got = fn(comm, q, k, v, *extra, causal=True, **kw)
        assert torch.equal(got, want), name
        with pytest.raises(InvalidArgument, match="must be the communicator") as ei:
            fn(q, k, v)  # no communicator
        assert name.split("_")[0] in str(ei.value) or "attention" in str(ei.value)
        with pytest.raises(InvalidArgument, match=rf"rank {comm.rank}.*argument 2"):
            fn(q, comm, k, v)  # the communicator in a wrong slot: named, with the rank
    # the numpy calls: the same order, the old one deprecated
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    for fwd, bwd in ((commlib.ring_attention, commlib.ring_attention_backward),
                     (commlib.ulysses_attention, commlib.ulysses_attention_backward)):
        out, lse = fwd(qn, kn, vn, comm, causal=True)
        grads = bwd(qn, kn, vn, out, lse, qn, comm, causal=True)
        with pytest.warns(DeprecationWarning):
            out2, lse2 = fwd(comm, qn, kn, vn, causal=True)
        with pytest.warns(DeprecationWarning):
            grads2 = bwd(comm, qn, kn, vn, out, lse, qn, causal=True)
        assert np.array_equal(out, out2) and np.array_equal(lse, lse2)
        assert all(np.array_equal(a, b) for a, b in zip(grads, grads2))
        with pytest.raises(InvalidArgument, match=f"{fwd.__name__}.*must be the communicator"):
            fwd(qn, kn, vn)
        with pytest.raises(InvalidArgument, match="commlib.nn.ring_attention|commlib.nn.ulysses_attention"):
            fwd(q, k, v, comm)  # torch tensors to the numpy call: pointed to the torch layer


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_argument_order(world):
    _order(world)


@pytest.mark.timeout(60)
def test_argument_order_serial(selfcomm):
    _order(selfcomm)


# ------------------------------------------------------------------ qkv_format
@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bhsd_matches_sdpa(world, layout):
    """SDPA's own (B, H, S, D) tensors: out and dq, dk, dv in that order, every call and the module."""
    p = world.size
    Q, K, V, DO = _global(p, fmt="bhsd", seed=1)
    oracle = _oracle(Q, K, V, DO, True, "bhsd")
    sp = cnn.Sharding(world, layout, dim=2)  # the sequence is dim 2 in bhsd
    pos = torch.from_numpy(sp.positions(Q.shape[2] // p))
    calls = dict(_kinds(p))
    calls["module"] = lambda q, k, v, c, **kw: cnn.SequenceParallelAttention(c, kind="ring", causal=True,
                                                                            qkv_format="bhsd")(q, k, v)
    for name, f in calls.items():
        leaves = [x.clone().requires_grad_(True) for x in (Q, K, V)]
        q, k, v = (sp.shard(x) for x in leaves)
        out = f(q, k, v, sp, causal=True, qkv_format="bhsd")
        assert out.shape == q.shape, (name, out.shape)
        out.backward(sp.shard(DO))
        _close(out, oracle[0][:, :, pos], f"{name} {layout} out")
        for g, x, what in zip(oracle[1:], leaves, "qkv"):
            _close(x.grad[:, :, pos], g[:, :, pos], f"{name} {layout} d{what}")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_bhsd_passed_as_bshd_refused(world):
    """The shapes tell: GQA heads, or cu_seqlens counting the heads dim; refused on every rank alike."""
    p, r = world.size, world.rank
    Q, K, V, _ = _global(p, heads=2 * p, kv_heads=1, fmt="bhsd", per_rank=4)
    sp = cnn.Sharding(world, "contiguous", dim=2)
    q, k, v = (sp.shard(x) for x in (Q, K, V))
    for name, f in _kinds(p).items():
        kw = {"layout": "contiguous"} if name == "hybrid" else {}
        with pytest.raises(InvalidArgument, match="qkv_format='bhsd'") as ei:
            f(q, k, v, world, causal=True, **kw)  # bshd by default: q's "seq" is its heads
        assert f"rank {r}" in str(ei.value), str(ei.value)
    # no GQA: cu_seqlens over the true length tells the dims apart
    Q, K, V, _ = _global(p, heads=2 * p, kv_heads=2 * p, fmt="bhsd", per_rank=3)
    q, k, v = (sp.shard(x) for x in (Q, K, V))
    n = Q.shape[2]
    with pytest.raises(InvalidArgument, match="qkv_format"):
        cnn.ring_attention(q, k, v, world, cu_seqlens=[0, n // 2, n])
    # one rank's bad format is everyone's error, before anything moves
    with pytest.raises(InvalidArgument, match="qkv_format" if r == 0 else r"rank\(s\) \[0\]"):
        cnn.ring_attention(q, k, v, world, qkv_format="sbhd" if r == 0 else "bhsd")
    out = cnn.ring_attention(q, k, v, world, qkv_format="bhsd")  # nothing left half-done
    assert out.shape == q.shape and torch.isfinite(out).all()


# ------------------------------------------------------------------ the layout, said once
@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharding_round_trip(world, layout):
    """shard -> attention -> unshard through one Sharding equals dense SDPA, for every call and the module."""
    p = world.size
    Q, K, V, DO = _global(p, seed=2)
    oracle = _oracle(Q, K, V, DO, True)
    sp = cnn.Sharding(world, layout)
    calls = dict(_kinds(p))
    for kind in ("ring", "ulysses", "hybrid"):
        deg = {"ring": None, "ulysses": None, "hybrid": 2 if p % 2 == 0 else 1}[kind]
        calls[f"module {kind}"] = (lambda kind, deg: lambda q, k, v, c, **kw: cnn.SequenceParallelAttention(
            c, kind=kind, ulysses_degree=deg, causal=True)(q, k, v))(kind, deg)
    for name, f in calls.items():
        leaves = [x.clone().requires_grad_(True) for x in (Q, K, V)]
        q, k, v = (sp.shard(x) for x in leaves)
        full = sp.unshard(f(q, k, v, sp, causal=True))
        full.backward(DO)
        _close(full, oracle[0], f"{name} {layout} out")
        pos = torch.from_numpy(sp.positions(q.shape[1]))
        for g, x, what in zip(oracle[1:], leaves, "qkv"):
            _close(x.grad[:, pos], g[:, pos], f"{name} {layout} d{what}")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_layout_mismatch_refused(world):
    """A zigzag shard given to a call without layout= (the contiguous default) is refused; so is a
    layout= that contradicts the Sharding; at one rank every layout is the same and all run."""
    p, r = world.size, world.rank
    Q, K, V, _ = _global(p, seed=3)
    q, k, v = (cnn.shard_sequence(x, world, "zigzag") for x in (Q, K, V))
    for name, f in _kinds(p).items():
        if p == 1:
            assert torch.isfinite(f(q, k, v, world, causal=True)).all()
            continue
        kw = {"layout": "contiguous"} if name == "hybrid" else {}
        with pytest.raises(InvalidArgument, match="sharded in layout 'zigzag'") as ei:
            f(q, k, v, world, causal=True, **kw)
        assert f"rank {r}" in str(ei.value)
    sp = cnn.Sharding(world, "zigzag")
    with pytest.raises(InvalidArgument, match="contradicts the Sharding"):
        cnn.ring_attention(q, k, v, sp, layout="striped")
    with pytest.raises(InvalidArgument, match="contradicts the Sharding"):
        cnn.SequenceParallelAttention(sp, layout="striped")
    out = cnn.ring_attention(q, k, v, world, layout="zigzag")  # the right layout: runs
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------ numpy shard_sequence and torch
def _numpy_refuses_torch(comm):
    x = torch.randn(1, 4 * comm.size, 2, 8, requires_grad=True)
    with pytest.raises(InvalidArgument, match=r"commlib\.nn\.shard_sequence") as ei:
        commlib.shard_sequence(x, comm, "zigzag")
    assert f"rank {comm.rank}" in str(ei.value)
    with pytest.raises(InvalidArgument, match=r"commlib\.nn\.unshard_sequence"):
        commlib.unshard_sequence(x[:, :4], comm, "contiguous")
    part = cnn.shard_sequence(x, comm, "zigzag")  # the torch twin keeps autograd
    part.sum().backward()
    assert x.grad.sum().item() == part.numel()


@pytest.mark.mpi
@pytest.mark.timeout(30)
def test_numpy_shard_refuses_torch(world):
    _numpy_refuses_torch(world)


@pytest.mark.timeout(30)
def test_numpy_shard_refuses_torch_serial(selfcomm):
    _numpy_refuses_torch(selfcomm)


def test_no_warning_in_documented_order(selfcomm):
    q = torch.randn(1, 4, 2, 8, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnn.ring_attention(q, q, q, selfcomm, causal=True)
        commlib.ring_attention(q.numpy(), q.numpy(), q.numpy(), selfcomm, causal=True)


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_bhsd_matches_sdpa(world, layout):
    """The numpy/CuPy twin takes qkv_format too: out, dq, dk, dv in SDPA's order, lse (batch, heads, seq)."""
    p = world.size
    Q, K, V, DO = _global(p, kv_heads=p, fmt="bhsd", seed=4)  # the numpy Ulysses: kv_heads divisible by p
    out_o, dq_o, dk_o, dv_o = _oracle(Q, K, V, DO, True, "bhsd")
    L = Q.shape[2] // p
    pos = sequence_positions(layout, world.rank, p, L)
    q, k, v, do = (np.ascontiguousarray(x.numpy()[:, :, pos]) for x in (Q, K, V, DO))
    for fwd, bwd in ((commlib.ring_attention, commlib.ring_attention_backward),
                     (commlib.ulysses_attention, commlib.ulysses_attention_backward)):
        kw = dict(causal=True, layout=layout, qkv_format="bhsd")
        out, lse = fwd(q, k, v, world, **kw)
        assert out.shape == q.shape and lse.shape == (1, q.shape[1], L)
        grads = bwd(q, k, v, out, lse, do, world, **kw)
        _close(torch.from_numpy(np.ascontiguousarray(out)), out_o[:, :, pos], f"{fwd.__name__} {layout} out")
        for g, want, what in zip(grads, (dq_o, dk_o, dv_o), "qkv"):
            assert g.shape == (q if what == "q" else k).shape
            _close(torch.from_numpy(np.ascontiguousarray(g)), want[:, :, pos], f"{fwd.__name__} {layout} d{what}")
    with pytest.raises(InvalidArgument, match="qkv_format"):
        commlib.ring_attention(q, k, v, world, qkv_format="BHSD")


def test_sharding_carries_layout_to_shard_functions(selfcomm):
    """A Sharding given to commlib.nn.shard_sequence / unshard_sequence as their comm is their layout
    and dim; an explicit one that contradicts it is refused (no silent default 'contiguous')."""
    sp = cnn.Sharding(selfcomm, "zigzag", dim=2)
    x = torch.randn(1, 3, 8, 4, dtype=F64)
    assert torch.equal(cnn.shard_sequence(x, sp), sp.shard(x))
    assert torch.equal(cnn.unshard_sequence(sp.shard(x), sp), x)
    with pytest.raises(InvalidArgument, match="contradicts the Sharding's layout"):
        cnn.shard_sequence(x, sp, "striped")
    with pytest.raises(InvalidArgument, match="contradicts the Sharding's dim"):
        cnn.unshard_sequence(x, sp, dim=1)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_mask_disagreement_named_alike(world):
    """Every variant agrees on one mask header (collectives.attention.spec.MaskSpec): ranks that differ in a
    mask feature get the same field named, whatever the call."""
    p, r = world.size, world.rank
    if p == 1:
        pytest.skip("needs 2+ ranks")
    Q, K, V, _ = _global(p, kv_heads=p, seed=5)
    pos = torch.from_numpy(sequence_positions("contiguous", r, p, Q.shape[1] // p))
    q, k, v = (x[:, pos] for x in (Q, K, V))
    n = Q.shape[1]
    cu = [0, n // 2, n] if r == 0 else [0, n]
    calls = {"ring_attention": lambda **kw: cnn.ring_attention(q, k, v, world, **kw),
             "ulysses_attention": lambda **kw: cnn.ulysses_attention(q, k, v, world, **kw)}
    for op, f in calls.items():
        with pytest.raises(InvalidArgument, match=rf"{op}.*causal differs"):
            f(causal=r == 0)
        with pytest.raises(InvalidArgument, match=rf"{op}.*cu_seqlens length differs"):
            f(cu_seqlens=cu)
        with pytest.raises(InvalidArgument, match=rf"{op}.*window left differs"):
            f(window=(1, 1) if r == 0 else (2, 1))
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    with pytest.raises(InvalidArgument, match="ring_attention.*window left differs"):
        commlib.ring_attention(qn, kn, vn, world, window=(1, 1) if r == 0 else (2, 1))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_qkv_format_disagreement_refused_everywhere(world):
    """qkv_format is in the agreed spec: one rank passing SDPA's (B, H, S, D) with qkv_format='bhsd' while the
    others pass (B, S, H, D) with 'bshd' (shapes that agree once read) gets InvalidArgument on every rank, in
    every variant of both layers, before any K/V moves."""
    p, r = world.size, world.rank
    if p == 1:
        pytest.skip("needs 2+ ranks")
    Q, K, V, DO = _global(p, kv_heads=p, seed=6)
    pos = torch.from_numpy(sequence_positions("contiguous", r, p, Q.shape[1] // p))
    q, k, v, do = (x[:, pos] for x in (Q, K, V, DO))
    fmt = "bhsd" if r == 0 else "bshd"
    if fmt == "bhsd":
        q, k, v, do = (x.transpose(1, 2) for x in (q, k, v, do))
    for op, f in _kinds(p).items():
        with pytest.raises(InvalidArgument, match=r"disagree.*qkv_format differs.*'bshd' and 'bhsd'") as ei:
            f(q, k, v, world, qkv_format=fmt, layout="contiguous", timeout=60)
        assert "ring_attention" in str(ei.value) if op in ("ring", "bidirectional") else op in str(ei.value)
    module = cnn.SequenceParallelAttention(world, "ring", layout="contiguous", qkv_format=fmt, timeout=60)
    with pytest.raises(InvalidArgument, match="qkv_format"):
        module(q, k, v)
    qn, kn, vn, don = (np.ascontiguousarray(x.numpy()) for x in (q, k, v, do))
    lse = np.zeros((1, Q.shape[2], Q.shape[1] // p))
    for fwd, bwd in ((commlib.ring_attention, commlib.ring_attention_backward),
                     (commlib.ulysses_attention, commlib.ulysses_attention_backward)):
        with pytest.raises(InvalidArgument, match=rf"{fwd.__name__}: ranks disagree.*qkv_format"):
            fwd(qn, kn, vn, world, qkv_format=fmt, timeout=60)
        with pytest.raises(InvalidArgument, match=rf"{bwd.__name__}: ranks disagree.*qkv_format"):
            bwd(qn, kn, vn, qn, lse, don, world, qkv_format=fmt, timeout=60)


def test_numpy_call_refuses_a_sharding(selfcomm):
    """commlib.nn.Sharding carries a layout the numpy calls would ignore: refused, pointing to layout=."""
    q = np.zeros((1, 4, 2, 8))
    sp = cnn.Sharding(selfcomm, "zigzag")
    for fn in (commlib.ring_attention, commlib.ulysses_attention):
        with pytest.raises(InvalidArgument, match=r"sharding\.comm, layout=sharding\.layout"):
            fn(q, q, q, sp)
