"""commlib.nn under torch.autocast, and SDPA's keywords, against torch's own SDPA.

A user drops the attention functions into a training step written for
:func:`torch.nn.functional.scaled_dot_product_attention` (SDPA).  Oracles:

* dtypes: SDPA itself under the same ``torch.autocast`` on the whole
  sequence (it is on autocast's lower-precision list: float32 inputs are cast
  to bfloat16, the output is bfloat16, the gradients come back in the inputs'
  dtypes);
* values: float64 SDPA with autograd on the whole sequence, on the inputs
  rounded to bfloat16 (what autocast computes on), within bfloat16 tolerance;
* wire bytes: the same call on inputs cast to bfloat16 by hand (autocast casts
  before anything moves);
* SDPA's keywords (``scale``, ``is_causal``, ``enable_gqa``, ``dropout_p=0``,
  ``attn_mask=None``): float64 SDPA given the same keywords; unsupported
  values raise InvalidArgument naming the rank and the call, on every rank.

Run serially (size-1 checks on ``COMM_SELF``) and under MPI::

    pytest tests/test_nn_autocast.py
    mpiexec -n 2 python -m pytest --with-mpi -m mpi tests/test_nn_autocast.py
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


from commlib.core.errors import InvalidArgument  # noqa: E402
from commlib.nn import (SequenceParallelAttention, hybrid_attention, ring_attention,  # noqa: E402
                        ring_attention_bidirectional, ulysses_attention)

torch.set_num_threads(1)

F = torch.nn.functional
F64, BF16 = torch.float64, torch.bfloat16
SEQ_LOCAL, HEAD_DIM = 4, 8

KINDS = {
    "ring": lambda q, k, v, comm, **kw: ring_attention(q, k, v, comm, **kw),
    "bidirectional": lambda q, k, v, comm, **kw: ring_attention_bidirectional(q, k, v, comm, **kw),
    "ulysses": lambda q, k, v, comm, **kw: ulysses_attention(q, k, v, comm, **kw),
    # ulysses_degree 1: the ring across all ranks (on one rank: attention locally)
    "hybrid": lambda q, k, v, comm, **kw: hybrid_attention(q, k, v, comm, 1, layout="contiguous", **kw),
    "module": lambda q, k, v, comm, **kw: SequenceParallelAttention(comm, kind="ring", layout="contiguous",
                                                                    causal=False)(q, k, v, **kw),
}
OPS = {"ring": "ring_attention", "bidirectional": "ring_attention_bidirectional", "ulysses": "ulysses_attention",
       "hybrid": "hybrid_attention", "module": "ring_attention"}


def make_inputs(size, seed=7, kv_heads=None):
    """Global float32 q, k, v, dout ``(1, size * SEQ_LOCAL, heads, HEAD_DIM)``, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    n, h = size * SEQ_LOCAL, 2 * size
    hk = size if kv_heads is None else kv_heads
    q, do = (torch.randn(1, n, h, HEAD_DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(1, n, hk, HEAD_DIM, generator=g) for _ in range(2))
    return q, k, v, do


def sdpa(q, k, v, **kw):
    """SDPA on ``(B, N, H, D)`` tensors (K/V heads repeated for GQA)."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          **kw).transpose(1, 2)


def run_with_grads(fn, q, k, v, do):
    """``out`` and the gradients of ``sum(out * do)`` with respect to the leaves q, k, v."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    (out.to(do.dtype) * do).sum().backward()
    return out, q.grad, k.grad, v.grad


def local(x, rank):
    return x[:, rank * SEQ_LOCAL:(rank + 1) * SEQ_LOCAL].contiguous()


def check_autocast(kind, comm):
    P, r = comm.size, comm.rank
    q, k, v, do = make_inputs(P)
    with torch.autocast("cpu", dtype=BF16):
        want = run_with_grads(sdpa, q, k, v, do)
    # values: float64 SDPA on the inputs autocast computes on (rounded to bf16)
    exact = run_with_grads(sdpa, *(x.to(BF16).to(F64) for x in (q, k, v, do)))
    with torch.autocast("cpu", dtype=BF16):
        got = run_with_grads(lambda a, b, c: KINDS[kind](a, b, c, comm), *(local(x, r) for x in (q, k, v, do)))
    names = ("out", "dq", "dk", "dv")
    assert [t.dtype for t in got] == [t.dtype for t in want] == [BF16, torch.float32, torch.float32, torch.float32], \
        dict(zip(names, [t.dtype for t in got]))
    for name, g, e in zip(names, got, exact):
        torch.testing.assert_close(g.to(F64), local(e, r), atol=4e-2, rtol=4e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_autocast_follows_sdpa_serial(selfcomm, kind):
    check_autocast(kind, selfcomm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_autocast_follows_sdpa(world, kind):
    check_autocast(kind, world)


class _Counting:
    """A point-to-point wrapper of a transport that counts the bytes this rank sends."""

    def __init__(self, tp):
        self.tp, self.rank, self.size, self.sent = tp, tp.rank, tp.size, 0

    def isend(self, buf, dest, tag=0):
        self.sent += memoryview(buf).nbytes
        return self.tp.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        return self.tp.irecv(buf, source, tag)

    def waitall(self, requests, timeout=None):
        return self.tp.waitall(requests, timeout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ring", "bidirectional", "ulysses"])
def test_autocast_casts_before_anything_moves(world, kind):
    """Under autocast the call sends what it sends for bf16 inputs cast by hand (not float32 bytes)."""
    q, k, v, do = (local(x, world.rank) for x in make_inputs(world.size))
    sent = []
    for cast in (False, True):
        wire = _Counting(world.collective_transport())
        if cast:
            with torch.autocast("cpu", dtype=BF16):
                out = run_with_grads(lambda a, b, c: KINDS[kind](a, b, c, wire), q, k, v, do)[0]
        else:
            out = run_with_grads(lambda a, b, c: KINDS[kind](a, b, c, wire), *(x.to(BF16) for x in (q, k, v)), do)[0]
        assert out.dtype == BF16
        sent.append(wire.sent)
    assert sent[1] == sent[0], f"bytes sent under autocast {sent[1]}, for bf16 inputs {sent[0]}"


# ------------------------------------------------------------------ SDPA's keywords
def check_keywords(kind, comm):
    P, r = comm.size, comm.rank
    q, k, v, do = (x.to(F64) for x in make_inputs(P, seed=3))
    kw = dict(scale=0.3, is_causal=True, enable_gqa=True, dropout_p=0.0, attn_mask=None)
    want = run_with_grads(lambda a, b, c: sdpa(a, b, c, scale=0.3, is_causal=True), q, k, v, do)
    got = run_with_grads(lambda a, b, c: KINDS[kind](a, b, c, comm, **kw), *(local(x, r) for x in (q, k, v, do)))
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, local(e, r), atol=1e-10, rtol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sdpa_keywords_serial(selfcomm, kind):
    check_keywords(kind, selfcomm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sdpa_keywords(world, kind):
    check_keywords(kind, world)


REFUSED = {
    "attn_mask": (dict(attn_mask="mask"), "cu_seqlens"),
    "dropout_p": (dict(dropout_p=0.1), "dropout_p=0.0"),
    "enable_gqa": (dict(enable_gqa=False), "enable_gqa=True"),
    "is_causal": (dict(causal=True, is_causal=False), "pass one"),
    "scale": (dict(softmax_scale=0.5, scale=0.5), "not both"),
}


def check_refused(kind, comm, what, only_rank=None):
    q, k, v, _ = (local(x, comm.rank) for x in make_inputs(comm.size, kv_heads=1))
    kw, hint = REFUSED[what]
    kw = dict(kw)
    if kw.get("attn_mask") == "mask":
        kw["attn_mask"] = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool)
    if kind == "module":  # the module's own causal / softmax_scale are constructor arguments
        causal, softmax_scale = kw.pop("causal", False), kw.pop("softmax_scale", None)
        fn = SequenceParallelAttention(comm, kind="ring", layout="contiguous", causal=causal,
                                       softmax_scale=softmax_scale)
    else:
        fn = lambda a, b, c, **x: KINDS[kind](a, b, c, comm, **x)  # noqa: E731
    if only_rank is not None and comm.rank != only_rank:
        kw = {}
    with pytest.raises(InvalidArgument) as info:
        fn(q, k, v, **kw)
    msg = str(info.value)
    assert OPS[kind] in msg
    if only_rank is None or comm.rank == only_rank:
        assert f"rank {comm.rank}" in msg and hint in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", sorted(REFUSED))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unsupported_sdpa_keywords_refused_serial(selfcomm, kind, what):
    check_refused(kind, selfcomm, what)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ring", "ulysses", "hybrid", "module"])
def test_unsupported_keyword_on_one_rank_refused_everywhere(world, kind):
    """Only rank 0 passes dropout_p=0.1: every rank raises InvalidArgument, none is left waiting."""
    check_refused(kind, world, "dropout_p", only_rank=0)
