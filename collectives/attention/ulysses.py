"""DeepSpeed-Ulysses attention: all-to-all from sequence shards to head shards.

Each rank starts with ``seq_local`` tokens of all heads.  An all-to-all
(the collectives' pairwise exchange,
:func:`commlib.collectives.alltoall_pairwise.alltoall_pairwise_parts`, over
the communicator's collectives transport) gives it the whole sequence for ``heads / P`` query heads
and ``kv_heads / P`` key/value heads; it runs ordinary blocked attention
(:func:`.blocks.attention_forward`) locally, and a second all-to-all returns
the output to sequence shards.  Communication per rank is ``O(seq/P)`` per
tensor regardless of ``P`` on a full-bisection network; the price is that
``heads`` and ``kv_heads`` must both divide by ``P``.

Paper: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509).

Any of the layouts of :mod:`.layout` may be used for the shards: after the
all-to-all the sequence is put in natural order, so causal work is balanced
across ranks whatever the layout (every rank holds the full sequence).
"""
from __future__ import annotations

import time

import numpy as np

from commlib.core.errors import InvalidArgument
from commlib.core.seconds import call_deadline

from ..alltoall_pairwise import alltoall_pairwise_parts
from .blocks import attention_backward, attention_forward, tile_plan
from .common import as_array_api, comm_last, in_format, validate
from .transport import transport_of

__all__ = ["ulysses_attention", "ulysses_attention_backward", "alltoall_pairwise"]


def alltoall_pairwise(comm, sendparts, recvparts, *, timeout: float | None = None) -> None:
    """Pairwise all-to-all of per-rank parts over ``comm``'s collectives transport
    (:func:`commlib.collectives.alltoall_pairwise.alltoall_pairwise_parts`;
    Thakur, Rabenseifner & Gropp 2005).

    Args:
        comm: :class:`commlib.Communicator` (or a transport; see :func:`.transport.transport_of`).
        sendparts: ``P`` contiguous arrays; ``sendparts[j]`` goes to rank ``j``.
        recvparts: ``P`` contiguous arrays; ``recvparts[j]`` receives from rank ``j``.
        timeout: the deadline of the whole call, in seconds (None: no bound).

    Raises:
        CommTimeout: ``timeout`` passed.
        CommError: a peer failed (``ProcessFailed``) or another transport error.
    """
    timeout = call_deadline(timeout, "alltoall_pairwise")
    alltoall_pairwise_parts(transport_of(comm, timeout, "alltoall_pairwise"), sendparts, recvparts, timeout=timeout)


def _seq_to_heads(tp, x, xp, timeout):
    """``(B, L, H, D)`` sequence shard -> ``(B, P*L, H/P, D)`` head shard (rank order)."""
    P = tp.size
    b, n, h, d = x.shape
    hp = h // P
    send = [xp.ascontiguousarray(x[:, :, j * hp:(j + 1) * hp]) for j in range(P)]
    recv = [xp.empty((b, n, hp, d), dtype=x.dtype) for _ in range(P)]
    alltoall_pairwise_parts(tp, send, recv, timeout=timeout)
    return xp.concatenate(recv, axis=1)


def _heads_to_seq(tp, y, xp, timeout):
    """``(B, P*L, h, D)`` head shard (rank order) -> ``(B, L, P*h, D)`` sequence shard."""
    P = tp.size
    b, n, hp, d = y.shape
    L = n // P
    send = [xp.ascontiguousarray(y[:, j * L:(j + 1) * L]) for j in range(P)]
    recv = [xp.empty((b, L, hp, d), dtype=y.dtype) for _ in range(P)]
    alltoall_pairwise_parts(tp, send, recv, timeout=timeout)
    return xp.concatenate(recv, axis=2)


def _lse_to_heads(tp, lse, xp, timeout):
    """``(B, H, L)`` -> ``(B, H/P, P*L)``."""
    P = tp.size
    b, h, n = lse.shape
    hp = h // P
    send = [xp.ascontiguousarray(lse[:, j * hp:(j + 1) * hp]) for j in range(P)]
    recv = [xp.empty((b, hp, n), dtype=lse.dtype) for _ in range(P)]
    alltoall_pairwise_parts(tp, send, recv, timeout=timeout)
    return xp.concatenate(recv, axis=2)


def _lse_to_seq(tp, lse, xp, timeout):
    """``(B, h, P*L)`` -> ``(B, P*h, L)``."""
    P = tp.size
    b, hp, n = lse.shape
    L = n // P
    send = [xp.ascontiguousarray(lse[:, :, j * L:(j + 1) * L]) for j in range(P)]
    recv = [xp.empty((b, hp, L), dtype=lse.dtype) for _ in range(P)]
    alltoall_pairwise_parts(tp, send, recv, timeout=timeout)
    return xp.concatenate(recv, axis=1)


def _check_heads(tp, spec, op):
    P = tp.size
    if spec.heads % P or spec.kv_heads % P:
        raise InvalidArgument(
            f"Ulysses needs heads ({spec.heads}) and kv_heads ({spec.kv_heads}) divisible by the "
            f"number of ranks ({P}); use ring_attention instead", rank=tp.rank, op=op)


def _order(layout, P, L, xp):
    """Permutation from rank-order gathered tokens to natural order, and back (:meth:`.layout.Layout.gather_order`)."""
    perm = layout.gather_order(P, L)
    if perm is None:
        perm = np.arange(P * L, dtype=np.int64)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    return xp.asarray(perm), xp.asarray(inv)


def ulysses_attention(q, k, v, comm=None, causal: bool = False, layout: str = "contiguous", softmax_scale=None, *,
                      seq_len: int | None = None, tile: int = 128, timeout: float | None = None,
                      stats: dict | None = None, qkv_format: str = "bshd"):
    """Exact sequence-parallel attention by all-to-all over heads (DeepSpeed-Ulysses).

    Args:
        q: local queries ``(batch, seq_local, heads, head_dim)``, numpy or CuPy,
            float16 / bfloat16 / float32 / float64.
        k, v: ``(batch, seq_local, kv_heads, head_dim)``; ``heads % kv_heads == 0``.
        comm: :class:`commlib.Communicator`; the all-to-alls go over its
            collectives transport (see :func:`.transport.transport_of`).  The
            old order, ``comm`` first, works with a ``DeprecationWarning``.
        causal, layout, softmax_scale, seq_len, tile, qkv_format: as in
            :func:`commlib.collectives.attention.ring_attention`.
        timeout: the deadline of the whole call, in seconds (finite, > 0;
            None: forever): the argument agreement and every all-to-all wait
            what is left of it.
        stats: optional dict, filled with ``work`` (score entries computed),
            ``compute_s``, ``comm_s`` and ``total_s``.

    Returns:
        tuple: ``out`` like ``q`` and ``lse`` ``(batch, heads, seq_local)``
        (float32, or float64 for float64 inputs).

    Raises:
        InvalidArgument: as ``ring_attention``, and when ``heads`` or ``kv_heads``
            is not divisible by ``comm.size`` (before any communication).
        CommTimeout: the call did not complete within ``timeout`` (naming the rank and the operation).
        ProcessFailed: a peer failed (any other transport failure: :class:`~commlib.CommError`).
    """
    op = "ulysses_attention"
    (q, k, v), comm = comm_last(op, (q, k, v), comm)
    (q, k, v), fmt_problem = in_format(qkv_format, q, k, v)
    timeout = call_deadline(timeout, op)  # the deadline of the whole call: every wait gets what is left
    tp = transport_of(comm, timeout, op)
    q, k, v = as_array_api(q, k, v)
    spec = validate(tp, q, k, v, causal=causal, layout=layout, softmax_scale=softmax_scale,
                    seq_len=seq_len, tile=tile, op=op, timeout=timeout, problem=fmt_problem, qkv_format=qkv_format)
    _check_heads(tp, spec, op)
    xp, P, L = spec.xp, tp.size, spec.seq_local
    t0 = time.perf_counter()
    perm, inv = _order(spec.layout, P, L, xp)
    qg = _seq_to_heads(tp, xp.ascontiguousarray(q), xp, timeout)[:, perm]
    kg = _seq_to_heads(tp, xp.ascontiguousarray(k), xp, timeout)[:, perm]
    vg = _seq_to_heads(tp, xp.ascontiguousarray(v), xp, timeout)[:, perm]
    t1 = time.perf_counter()
    out, lse = attention_forward(qg, kg, vg, causal, spec.scale, seq_len=spec.seq_len, tile=tile,
                                 positions=np.arange(P * L, dtype=np.int64))
    t2 = time.perf_counter()
    out = _heads_to_seq(tp, xp.ascontiguousarray(out[:, inv]), xp, timeout)
    lse = _lse_to_seq(tp, xp.ascontiguousarray(lse[:, :, inv]), xp, timeout)
    t3 = time.perf_counter()
    if stats is not None:
        pos = np.arange(P * L, dtype=np.int64)
        work = tile_plan(pos, pos, spec.seq_len, causal, tile).work * spec.batch * spec.heads // P
        stats.clear()
        stats.update(kind="forward", work=work, compute_s=t2 - t1, comm_s=(t1 - t0) + (t3 - t2), total_s=t3 - t0)
    return in_format(qkv_format, out, lse)[0]


def ulysses_attention_backward(q, k, v, out, lse, dout, comm=None, causal: bool = False, layout: str = "contiguous",
                               softmax_scale=None, *, seq_len: int | None = None, tile: int = 128,
                               timeout: float | None = None, stats: dict | None = None, qkv_format: str = "bshd"):
    """Gradients of :func:`ulysses_attention`.

    Args:
        out, lse, dout: the forward's output, lse, and the output gradient, in
            sequence shards as returned by :func:`ulysses_attention`.
        Others: as in :func:`ulysses_attention`.

    Returns:
        tuple: ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``.

    Raises:
        InvalidArgument: as :func:`ulysses_attention`, or ``out``/``lse``/``dout``
            of the wrong shape or dtype.
        CommTimeout: the call did not complete within ``timeout`` (naming the rank and the operation).
        ProcessFailed: a peer failed (any other transport failure: :class:`~commlib.CommError`).
    """
    op = "ulysses_attention_backward"
    (q, k, v, out, lse, dout), comm = comm_last(op, (q, k, v, out, lse, dout), comm)
    (q, k, v, out, lse, dout), fmt_problem = in_format(qkv_format, q, k, v, out, lse, dout)
    q, k, v, out, lse, dout = as_array_api(q, k, v, out, lse, dout)
    timeout = call_deadline(timeout, op)  # the deadline of the whole call: every wait gets what is left
    tp = transport_of(comm, timeout, op)
    extra = {}
    if hasattr(q, "shape") and len(q.shape) == 4:
        qshape, qd = tuple(q.shape), np.dtype(q.dtype).name
        extra = {"out": (out, qshape, qd), "dout": (dout, qshape, qd),
                 "lse": (lse, (qshape[0], qshape[2], qshape[1]), None)}
    spec = validate(tp, q, k, v, causal=causal, layout=layout, softmax_scale=softmax_scale,
                    seq_len=seq_len, tile=tile, op=op, extra=extra, timeout=timeout, problem=fmt_problem,
                    qkv_format=qkv_format)
    _check_heads(tp, spec, op)
    xp, P, L = spec.xp, tp.size, spec.seq_local
    t0 = time.perf_counter()
    perm, inv = _order(spec.layout, P, L, xp)
    g = {}
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        g[name] = _seq_to_heads(tp, xp.ascontiguousarray(x), xp, timeout)[:, perm]
    lseg = _lse_to_heads(tp, xp.ascontiguousarray(xp.asarray(lse).astype(spec.cdtype, copy=False)), xp,
                         timeout)[:, :, perm]
    t1 = time.perf_counter()
    dq, dk, dv = attention_backward(g["q"], g["k"], g["v"], g["out"], lseg, g["dout"], causal, spec.scale,
                                    seq_len=spec.seq_len, tile=tile, positions=np.arange(P * L, dtype=np.int64))
    t2 = time.perf_counter()
    dq = _heads_to_seq(tp, xp.ascontiguousarray(dq[:, inv]), xp, timeout)
    dk = _heads_to_seq(tp, xp.ascontiguousarray(dk[:, inv]), xp, timeout)
    dv = _heads_to_seq(tp, xp.ascontiguousarray(dv[:, inv]), xp, timeout)
    t3 = time.perf_counter()
    if stats is not None:
        stats.clear()
        stats.update(kind="backward", compute_s=t2 - t1, comm_s=(t1 - t0) + (t3 - t2), total_s=t3 - t0)
    return in_format(qkv_format, dq, dk, dv)[0]
