"""Misuse of the torch sequence-parallel attention (commlib.nn) that must fail loudly, alike on every rank.

Serial: ``pytest tests/test_nn_misuse.py``; MPI at 2-4 ranks::

    mpiexec -n N python -P -m pytest --with-mpi -m mpi tests/test_nn_misuse.py

* a timeout that is not None or a finite number > 0 is an ``InvalidArgument``
  of the call, on every rank, before any byte moves (not a ``TypeError``, a
  ``waitall`` error after the exchange started, or a desynchronized transport);
* ranks that differ in whether a gradient flows back (one rank under
  ``torch.no_grad`` or with ``requires_grad=False``) are refused in the
  forward: the backward communicates, and the other ranks would wait for ever;
* ``ring_attention``'s argument agreement is bounded by its ``timeout``;
* double backward (``create_graph=True``, a gradient penalty): the ring refuses
  it in the backward rather than drop the second-order terms silently; Ulysses
  differentiates through its all-to-alls and matches float64 torch SDPA.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402

import commlib  # noqa: E402
from commlib.collectives.attention.layout import sequence_positions  # noqa: E402
from commlib.core.errors import CommTimeout, InvalidArgument  # noqa: E402
from commlib.nn import (SequenceParallelAttention, hybrid_attention, ring_attention, ulysses_attention,  # noqa: E402
                        unshard_sequence)

F64 = torch.float64
BAD_TIMEOUTS = [0, -1.0, "3", True, math.inf, math.nan]


def _inputs(comm, seq_local=4, heads=None, kv_heads=None, dim=8, seed=0, requires_grad=True):
    p = comm.size
    heads = heads or 2 * p
    kv_heads = kv_heads or p
    gen = torch.Generator().manual_seed(seed)
    n = p * seq_local
    glob = [torch.randn(1, n, h, dim, generator=gen, dtype=F64) for h in (heads, kv_heads, kv_heads, heads)]
    pos = torch.from_numpy(sequence_positions("contiguous", comm.rank, p, seq_local))
    local = [x[:, pos].clone().requires_grad_(requires_grad and i < 3) for i, x in enumerate(glob)]
    return glob, local, pos


def _calls(comm):
    """Every public entry point, as ``f(q, k, v, **kw)``."""
    p = comm.size
    return {
        "ring_attention": lambda q, k, v, **kw: ring_attention(q, k, v, comm, causal=True, **kw),
        "ulysses_attention": lambda q, k, v, **kw: ulysses_attention(q, k, v, comm, causal=True, **kw),
        "hybrid_attention": lambda q, k, v, **kw: hybrid_attention(q, k, v, comm, 1 if p == 1 else 2 if p % 2 == 0
                                                                   else 1, causal=True, layout="contiguous", **kw),
        "unshard_sequence": lambda q, k, v, **kw: unshard_sequence(q, comm, **kw),
    }


def _refuse_bad_timeouts(comm):
    _, (q, k, v, _), _ = _inputs(comm)
    for name, call in _calls(comm).items():
        for bad in BAD_TIMEOUTS:
            with pytest.raises(InvalidArgument, match="timeout") as ei:
                call(q, k, v, timeout=bad)
            msg = str(ei.value)
            assert f"rank {comm.rank}" in msg and name in msg, msg
    for bad in BAD_TIMEOUTS:
        with pytest.raises(InvalidArgument, match="timeout"):
            SequenceParallelAttention(comm, kind="ulysses", layout="contiguous", timeout=bad)
    # nothing was left half-sent: the calls still work
    for call in _calls(comm).values():
        assert torch.isfinite(call(q, k, v, timeout=60)).all()


@pytest.mark.timeout(60)
def test_bad_timeout_refused_serial(selfcomm):
    _refuse_bad_timeouts(selfcomm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bad_timeout_refused_on_every_rank(world):
    _refuse_bad_timeouts(world)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_gradient_on_some_ranks_only_is_refused_everywhere(world):
    """One rank runs the call without a gradient (no_grad or requires_grad=False), the others
    with one: every rank raises in the forward instead of the others hanging in the backward."""
    r = world.rank
    _, (q, k, v, _), _ = _inputs(world)
    for name, call in _calls(world).items():
        grads = r != 0
        qq, kk, vv = (x.detach().requires_grad_(grads) for x in (q, k, v))
        with pytest.raises(InvalidArgument, match="requires_grad differs") as ei:
            call(qq, kk, vv, timeout=60, **({"sum_grad": True} if name == "unshard_sequence" else {}))
        assert name in str(ei.value)
        with pytest.raises(InvalidArgument, match="requires_grad differs"):
            with torch.set_grad_enabled(r == 0):
                call(q, k, v, timeout=60, **({"sum_grad": True} if name == "unshard_sequence" else {}))
    # Ulysses: each of q, k, v has its own backward all-to-all, so which ones need a gradient must agree
    with pytest.raises(InvalidArgument, match="requires_grad on q, k, v"):
        ulysses_attention(q, k, v.detach().requires_grad_(r != 0), world, timeout=60)
    # the same flags everywhere (only q) is fine, and so is no gradient anywhere
    out = ring_attention(q, k.detach(), v.detach(), world, timeout=60)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        assert not ring_attention(q, k, v, world, timeout=60).requires_grad


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_ring_agreement_is_bounded_by_timeout(world):
    """Rank 0 calls ring_attention(timeout=1) and the others never do: rank 0 gets
    CommTimeout from the argument agreement instead of waiting for ever (on a
    communicator of its own, so the unmatched messages stay there)."""
    comm = commlib.init(MPI.COMM_WORLD.Dup())
    comm.collective_transport()  # made collectively, before the ranks part ways
    _, (q, k, v, _), _ = _inputs(comm)
    if comm.rank == 0:
        with pytest.raises(CommTimeout):
            ring_attention(q, k, v, comm, timeout=1)
    world.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_ranks_may_pass_different_timeouts(world):
    """Rank 0 passes ``timeout=None``, the others a number: the argument agreement
    runs the same all-gather on every rank whatever the timeout (the native one
    for None and the point-to-point one for a number never met), so every entry
    point completes, equal to the same call with one timeout everywhere."""
    _, (q, k, v, _), _ = _inputs(world)
    for name, call in _calls(world).items():
        mixed = call(q, k, v, timeout=None if world.rank == 0 else 30)
        same = call(q, k, v, timeout=30)
        assert torch.equal(mixed, same), name


def _penalty_grads(call, q, k, v, dout):
    """d/d(q, k, v) of ``<out, dout> + |d<out, dout>/dq|^2`` (a gradient penalty: double backward)."""
    out = call(q, k, v)
    first = (out * dout).sum()
    gq, = torch.autograd.grad(first, q, create_graph=True)
    (first + gq.square().sum()).backward()
    return q.grad, k.grad, v.grad


def _double_backward(comm):
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    glob, (q, k, v, dout), pos = _inputs(comm, kv_heads=comm.size)
    cu = [0, 3, glob[0].shape[1]]
    with sdpa_kernel(SDPBackend.MATH):  # torch's CPU flash kernel has no double backward
        got = _penalty_grads(lambda a, b, c: ulysses_attention(a, b, c, comm, causal=True, cu_seqlens=cu, timeout=60),
                             q, k, v, dout)
        gq, gk, gv, gd = (x.clone().requires_grad_(i < 3) for i, x in enumerate(glob))
        n = gq.shape[1]
        doc = torch.from_numpy(np.searchsorted(np.asarray(cu), np.arange(n), side="right"))
        mask = torch.ones(n, n, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
        g = gq.shape[2] // gk.shape[2]

        def sdpa(a, b, c):
            return torch.nn.functional.scaled_dot_product_attention(
                a.transpose(1, 2), b.repeat_interleave(g, 2).transpose(1, 2), c.repeat_interleave(g, 2).transpose(1, 2),
                attn_mask=mask).transpose(1, 2)

        want = _penalty_grads(sdpa, gq, gk, gv, gd)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        err = ((a - b[:, pos]).abs().max() / b.abs().max()).item()
        assert err < 1e-10, f"{name}: {err:.2e}"
    # the ring's backward is not differentiable: refused on every rank, not silently first-order
    q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
    out = ring_attention(q2, k2, v2, comm, causal=True, timeout=60)
    with pytest.raises(InvalidArgument, match="create_graph") as ei:
        torch.autograd.grad((out * dout).sum(), q2, create_graph=True)
    assert f"rank {comm.rank}" in str(ei.value) and "ring_attention (backward)" in str(ei.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_double_backward(world):
    _double_backward(world)


@pytest.mark.timeout(60)
def test_double_backward_serial(selfcomm):
    _double_backward(selfcomm)
