"""Misuse of the host sequence-parallel attention: inputs left untouched, bad
arguments on one rank refused on every rank before anything moves.

Run serially (``pytest tests/test_attention_misuse.py``) and under MPI::

    mpiexec -n 3 python -m pytest --with-mpi -m mpi tests/test_attention_misuse.py

The oracle is a dense float64 softmax attention of the global sequence written
here from the definition (forward and the analytic gradients).
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.core.errors import CommTimeout
from commlib.collectives import attention as A
from commlib.core.errors import InvalidArgument


def dense(q, k, v, dout, causal, scale):
    """Dense float64 ``(out, lse, dq, dk, dv)`` of q (B,S,H,D), k/v (B,S,Hkv,D)."""
    b, n, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    if causal:
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    p = np.exp(s - lse[..., None])
    out = np.einsum("bhij,bjhd->bihd", p, vr)
    dv = np.einsum("bhij,bihd->bjhd", p, dout)
    ds = p * (np.einsum("bihd,bjhd->bhij", dout, vr) - np.einsum("bihd,bihd->bhi", dout, out)[..., None])
    dq = np.einsum("bhij,bjhd->bihd", ds, kr) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    return out, lse, dq, dk.reshape(b, n, hk, g, d).sum(3), dv.reshape(b, n, hk, g, d).sum(3)


@pytest.mark.parametrize("shape", [(2, 5, 1, 4), (1, 1, 2, 4), (1, 6, 2, 4)])
def test_single_rank_kernels_leave_q_untouched(shape):
    """One head, or one token, made the heads-major copy of q a view: the
    forward then scaled the caller's q in place and the backward was wrong."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal(shape)
    k = rng.standard_normal(shape[:2] + (1, shape[3]))
    v = rng.standard_normal(k.shape)
    do = rng.standard_normal(shape)
    saved = [x.copy() for x in (q, k, v, do)]
    out, lse = A.attention_forward(q, k, v, causal=True, tile=2)
    grads = A.attention_backward(q, k, v, out, lse, do, causal=True, tile=2)
    for x, x0 in zip((q, k, v, do), saved):
        assert np.array_equal(x, x0)
    want = dense(q, k, v, do, True, shape[3] ** -0.5)
    for got, w in zip((out, lse) + grads, want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_one_token_per_rank_and_one_head_match_dense(world, algo):
    """seq_len <= ranks (shards of one token, some all padding) and a single
    head: forward and backward against the dense oracle, inputs untouched."""
    P = world.size
    fwd, bwd = ((A.ring_attention, A.ring_attention_backward) if algo == "ring"
                else (A.ulysses_attention, A.ulysses_attention_backward))
    heads = 1 if algo == "ring" else P
    rng = np.random.default_rng(7)
    for n in (P - 1, P) if P > 2 else (1, P):
        Q, K, V, DO = (rng.standard_normal((1, n, heads, 4)) for _ in range(4))
        q, k, v, do = (A.shard_sequence(x, world)[0] for x in (Q, K, V, DO))
        saved = [x.copy() for x in (q, k, v, do)]
        out, lse = fwd(q, k, v, world, True, seq_len=n, timeout=30)
        grads = bwd(q, k, v, out, lse, do, world, True, seq_len=n, timeout=30)
        for x, x0 in zip((q, k, v, do), saved):
            assert np.array_equal(x, x0), "input modified"
        want = dense(Q, K, V, DO, True, 0.5)
        got = [A.unshard_sequence(x, world, seq_len=n, axis=2 if i == 1 else 1, timeout=30)
               for i, x in enumerate((out, lse) + grads)]
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-10, err_msg=f"{algo} n={n} {name}")


_BAD_TIMEOUTS = [float("nan"), float("inf"), 0, -1.0, True, "5"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", _BAD_TIMEOUTS, ids=repr)
def test_bad_timeout_on_one_rank_refused_everywhere(world, bad):
    """A bad timeout on the last rank only: every rank raises InvalidArgument
    (the last naming timeout) before any message; no rank returns a result."""
    P, last = world.size, world.rank == world.size - 1
    rng = np.random.default_rng(world.rank)
    q = rng.standard_normal((1, 4, P, 4))
    k = v = q.copy()
    out, lse = A.ring_attention(q, k, v, world, timeout=30)
    calls = {
        "ring_attention": lambda t: A.ring_attention(q, k, v, world, timeout=t),
        "ring_attention_backward": lambda t: A.ring_attention_backward(q, k, v, out, lse, q, world, timeout=t),
        "ulysses_attention": lambda t: A.ulysses_attention(q, k, v, world, timeout=t),
        "ulysses_attention_backward": lambda t: A.ulysses_attention_backward(q, k, v, out, lse, q, world,
                                                                             timeout=t),
        "unshard_sequence": lambda t: A.unshard_sequence(q, world, timeout=t),
    }
    for op, call in calls.items():
        with pytest.raises(InvalidArgument, match=op + (": timeout" if last else ": rank")):
            call(bad if last else 30)
    world.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_unshard_disagreement_refused_everywhere(world):
    """unshard_sequence with a bad or different shard on the last rank only:
    every rank raises InvalidArgument naming the field; nothing is received into
    a buffer of another size (no uninitialised data returned)."""
    P, last = world.size, world.rank == world.size - 1
    x = np.full((1, 4, 3), float(world.rank))
    cases = [
        ("dim2 differs", dict(x_local=x[:, :, :2] if last else x)),
        ("dtype differs", dict(x_local=x.astype(np.float32) if last else x)),
        ("axis 5 out of range" if last else "rank", dict(x_local=x, axis=5 if last else 1)),
        ("seq_len differs", dict(x_local=x, seq_len=4 * P - 1 if last else None)),
        ("ndim differs", dict(x_local=x[..., None] if last else x)),
    ]
    for match, kw in cases:
        with pytest.raises(InvalidArgument, match="unshard_sequence: .*" + match):
            A.unshard_sequence(comm=world, timeout=30, **kw)
    got = A.unshard_sequence(x, world, timeout=30)
    want = np.concatenate([np.full((1, 4, 3), float(r)) for r in range(P)], axis=1)
    assert np.array_equal(got, want)
    world.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["ring_attention", "unshard_sequence"])
def test_argument_agreement_is_bounded_by_timeout(call):
    """Rank 0 calls with ``timeout=1`` and the others never do: rank 0 gets
    CommTimeout from the argument agreement instead of waiting forever (on a
    communicator of its own, so the unmatched messages stay there); and a rank
    passing ``timeout=None`` beside ranks passing a number completes."""
    comm = commlib.init(MPI.COMM_WORLD.Dup())
    comm.collective_transport()  # made collectively, before the ranks part ways
    rng = np.random.default_rng(comm.rank)
    q = rng.standard_normal((1, 4, 2, 8))
    fn = {"ring_attention": lambda t: A.ring_attention(q, q, q, comm, timeout=t),
          "unshard_sequence": lambda t: A.unshard_sequence(q, comm, axis=1, timeout=t)}[call]
    if comm.rank == 0:
        with pytest.raises(CommTimeout):
            fn(1)
    MPI.COMM_WORLD.Barrier()
    other = commlib.init(MPI.COMM_WORLD.Dup())
    got = {"ring_attention": lambda t: A.ring_attention(q, q, q, other, timeout=t)[0],
           "unshard_sequence": lambda t: A.unshard_sequence(q, other, axis=1, timeout=t)}[call](
        None if comm.rank == 0 else 30)
    assert np.all(np.isfinite(got))
