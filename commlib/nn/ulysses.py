"""DeepSpeed-Ulysses attention on torch tensors, differentiable.

Each of the ``P`` ranks holds a contiguous shard of the sequence,
``(B, L/P, H, D)``.  An all-to-all over heads gives every rank the whole
sequence for ``H/P`` query heads (and ``Hkv/P`` key/value heads),
``(B, L, H/P, D)``; it runs torch's fused attention
(:func:`torch.nn.functional.scaled_dot_product_attention`, with autograd)
locally, and a second all-to-all returns the output to sequence shards.  Each
all-to-all is a :class:`torch.autograd.Function` whose backward is the
inverse all-to-all, so gradients flow back through the same two exchanges.
Communication per rank is ``O(L/P)`` per tensor whatever ``P``; the price is
that the head counts must divide by ``P``.

Paper: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509).

The all-to-alls run over the communicator's collectives transport with
:mod:`commlib.nn._wire` (torch tensors as bytes, no copies for the wire):
every receive and send of one exchange is posted at once, then one wait
bounded by ``timeout``.  Each all-to-all takes its tags from the transport's
allocator as it runs in the forward, reserving its backward's with them, so
every rank must make the same calls in the same order, forward and backward
(as every rank running the same model does).  The backward of an all-to-all
is itself a differentiable all-to-all, so ``create_graph=True`` (double
backward) works where the local attention kernel supports it.

Grouped-query attention: ``kv_heads`` must divide by ``P``; when it does not
but ``P`` divides by ``kv_heads`` (say 2 kv heads on 8 ranks), each kv head
is replicated ``P / kv_heads`` times before the exchange so every rank gets
the one kv head its query heads use (the gradient of the copies is summed
back); any other ``kv_heads`` is refused.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from commlib.collectives.attention.transport import transport_of
from commlib.core.seconds import restarted

from ._check import autocast_inputs, validate
from ._front import front
from ._failure import bound, guarded, link_comm
from ._wire import all_to_all_tensors
from .window import window_dense_mask

__all__ = ["ulysses_attention", "check_degree"]


# ------------------------------------------------------------------ all-to-all
def _all_to_all(x, tp, scatter_dim, gather_dim, tag, timeout, op):
    """Cut ``x`` in ``P`` equal chunks on ``scatter_dim``, send chunk ``j`` to
    rank ``j``, and concatenate what arrives, in rank order, on ``gather_dim``."""
    send = [c.contiguous() for c in x.chunk(tp.size, dim=scatter_dim)]
    recv = all_to_all_tensors(tp, send, tag, timeout, op)
    return torch.cat(recv, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """All-to-all that moves the sharded dimension; backward is the inverse all-to-all.

    ``tags``: ``(forward tag, backward tag)``; a ``None`` forward tag is taken
    from the transport's allocator when the call runs.  The backward is itself
    an ``_AllToAll``, so ``create_graph=True`` (double backward, e.g. a
    gradient penalty) differentiates through the exchange; its own backward
    takes its tag from the allocator when it runs (every rank runs the same
    backward graph in the same order)."""

    @staticmethod
    def forward(ctx, x, tp, scatter_dim, gather_dim, tags, timeout, op):
        tag = tp.tags.slot(1) if tags[0] is None else tags[0]
        ctx.meta = (tp, scatter_dim, gather_dim, tags[1], timeout, op)
        return _all_to_all(x, tp, scatter_dim, gather_dim, tag, timeout, op)

    @staticmethod
    def backward(ctx, grad):
        tp, scatter_dim, gather_dim, tag, timeout, op = ctx.meta
        timeout = restarted(timeout)  # the backward is a call of its own: the whole timeout again
        bop = op if op.endswith(" (backward)") else op + " (backward)"
        with guarded(tp):  # a failure revokes the call's transports: no survivor left waiting
            return (_AllToAll.apply(grad, tp, gather_dim, scatter_dim, (tag, None), timeout, bop),) + (None,) * 6


def seq_to_heads(x, tp, timeout, op):
    """``(B, L, H, D)`` sequence shard -> ``(B, P*L, H/P, D)``: the rank-order
    concatenation of every rank's shard, for this rank's ``H/P`` heads."""
    if tp.size == 1:
        return x
    t = tp.tags.slot(2)
    return _AllToAll.apply(x, tp, 2, 1, (t, t + 1), timeout, op)


def heads_to_seq(y, tp, timeout, op):
    """Inverse of :func:`seq_to_heads`: ``(B, P*L, h, D)`` -> ``(B, L, P*h, D)``."""
    if tp.size == 1:
        return y
    t = tp.tags.slot(2)
    return _AllToAll.apply(y, tp, 1, 2, (t, t + 1), timeout, op)


def spread_kv_heads(k, degree):
    """Replicate kv heads so that ``degree`` ranks each get whole ones (see the module notes)."""
    hk = k.shape[2]
    if hk % degree == 0:
        return k
    return k.repeat_interleave(degree // hk, dim=2)


# ------------------------------------------------------------ local attention
def document_mask(cu_seqlens, n, causal, device):
    """Boolean ``(n, n)`` mask, True where query ``i`` may see key ``j``: same
    document of ``cu_seqlens`` (and ``j <= i`` when causal)."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64, device=device)
    pos = torch.arange(n, device=device)
    doc = torch.searchsorted(cu[1:], pos, right=True)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= pos[:, None] >= pos[None, :]
    return mask


def local_attention(q, k, v, causal, scale, mask=None):
    """Attention on one rank over a whole sequence in natural order.

    Args:
        q: ``(B, N, h, D)``; k, v: ``(B, N, hk, D)`` with ``h % hk == 0``.
        mask: optional boolean ``(N, N)`` (True = visible); replaces ``causal``.

    Returns:
        torch.Tensor: ``(B, N, h, D)`` (a transposed view).
    """
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=bool(causal) and mask is None,
                                       scale=scale, enable_gqa=kh.shape[1] != qh.shape[1])
    return o.transpose(1, 2)


# ---------------------------------------------------------------- validation
def check_degree(spec, degree: int, bad, name: str = "the Ulysses degree") -> None:
    """Refuse head counts a Ulysses group of ``degree`` ranks cannot split:
    ``heads`` must divide by it, ``kv_heads`` divide by it or divide it (kv
    heads are then replicated, :func:`spread_kv_heads`)."""
    if spec.heads % degree:
        raise bad(f"heads ({spec.heads}) must be divisible by {name} ({degree})")
    if spec.kv_heads % degree and degree % spec.kv_heads:
        raise bad(f"kv_heads ({spec.kv_heads}) must be divisible by {name} ({degree}), or divide it "
                  "(kv heads are then replicated)")


# ---------------------------------------------------------------- the call
def ulysses_attention(q, k, v, comm=None, causal: bool = False, softmax_scale=None, *, cu_seqlens=None, window=None,
                      layout=None, qkv_format="bshd", timeout: float | None = None, attn_mask=None, dropout_p=0.0,
                      is_causal=None, scale=None, enable_gqa=None):
    """Exact sequence-parallel attention by all-to-all over heads (DeepSpeed-Ulysses).

    Args:
        q: this rank's queries ``(batch, seq_local, heads, head_dim)``: its
            ``layout`` shard of the global sequence (contiguous by default:
            tokens ``[rank * seq_local, (rank + 1) * seq_local)``); float16,
            bfloat16, float32 or float64, CPU or CUDA.  Non-contiguous
            tensors are accepted (copied contiguous for the wire).
        k, v: ``(batch, seq_local, kv_heads, head_dim)``, dtype and device of
            ``q``; ``heads % kv_heads == 0``.
        comm: :class:`commlib.Communicator` (its collectives transport carries
            the all-to-alls) or a transport, or a
            :class:`commlib.nn.Sharding` (its layout is the call's).  The
            communicator first works with a ``DeprecationWarning``.
        causal: mask key positions after the query's (global positions).
        softmax_scale: score scale (default ``head_dim ** -0.5``).
        cu_seqlens: optional int tensor or sequence of global document
            boundaries ``[0, ..., seq_len]`` (FlashAttention's convention,
            the same on every rank): tokens attend only within their document
            (a dense boolean mask of ``seq_len**2`` is built for the local
            attention).
        window: optional sliding window ``(left, right)`` (FlashAttention-2's
            ``window_size``, ints >= -1, -1 unbounded; Longformer/Mistral):
            query ``i`` sees keys ``i - left <= j <= i + right`` only.  Here
            it is a mask on the local whole-sequence attention: the
            all-to-alls move what they always move and the local attention
            still costs ``seq_len**2`` per head (the ring's halo exchange,
            :func:`commlib.nn.ring_attention` with ``window``, is the one
            whose bytes and work the window bounds).
        layout: the shards' layout, ``"contiguous"``, ``"striped"`` or
            ``"zigzag"`` (even ``seq_local``); None (default): the
            Sharding's, else ``"contiguous"``.  Other layouts than
            contiguous put the gathered tokens in natural order and back (an
            index_select each way).
        qkv_format: ``"bshd"`` (default) or ``"bhsd"`` (SDPA's order), as in
            :func:`commlib.nn.ring_attention`.
        timeout: the deadline of the whole call, in seconds: the argument
            agreement and every exchange wait what is left of it, and past it
            the call raises ``CommTimeout`` naming the rank and the operation
            (its backward, a call of its own, gets the whole timeout again).
            None (no limit; on a fault-tolerant communicator its own
            ``timeout``) or a finite number > 0.
        attn_mask, dropout_p, is_causal, scale, enable_gqa: SDPA's keywords,
            as in :func:`commlib.nn.ring.ring_attention` (``is_causal`` and
            ``scale`` are ``causal`` and ``softmax_scale``; ``attn_mask``
            only None, ``dropout_p`` only 0, ``enable_gqa`` None or True).

    Autocast: inside ``torch.autocast``, q, k and v are cast as SDPA's are
    (float32/float16 to the autocast dtype, float64 unchanged) before the
    all-to-alls, so the exchanges move the cast tensors; the output is in
    that dtype and the gradients in the inputs' own dtypes.

    Returns:
        torch.Tensor: ``out`` shaped and typed like ``q`` (under autocast:
        the autocast dtype) (this rank's tokens), differentiable with respect to ``q``, ``k``, ``v``; twice
        too (``create_graph=True``) wherever torch's local attention kernel
        is (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`` on the CPU).

    Raises:
        InvalidArgument: no communicator in its slot (at once, naming the
            call).  On every rank alike, before any data moves: non-4-d
            or non-tensor inputs, an unknown ``qkv_format`` or shapes that
            fit only the other one, a bad layout or one that contradicts the
            Sharding's or the shards', mixed dtypes or devices, unsupported dtype,
            ``heads`` not divisible by ``comm.size``, ``kv_heads`` neither
            divisible by nor dividing ``comm.size``, bad ``softmax_scale`` or
            ``cu_seqlens``, an ``attn_mask``, a ``dropout_p`` other than 0,
            conflicting ``causal``/``is_causal`` or ``softmax_scale``/``scale``,
            ``enable_gqa=False`` with ``heads != kv_heads``, a ``timeout`` that is not None or a finite number
            > 0, a ``window`` that is not None or a pair of ints >= -1, or
            shapes, dtypes, options, ``window`` or which of q, k, v get a
            gradient (grad mode and ``requires_grad``: each one's backward is
            an all-to-all) that differ between ranks.
        CommTimeout: the agreement or an all-to-all did not complete in ``timeout``.
        ProcessFailed: a peer failed (other transport failures: :class:`~commlib.CommError`).

    Failures: as :func:`commlib.nn.ring.ring_attention` (forward and backward).
    """
    op = "ulysses_attention"
    call = front(op, q, k, v, comm, layout, qkv_format, cu_seqlens=cu_seqlens,
                 causal=causal is True or is_causal is True)
    q, k, v, comm, layout = call.q, call.k, call.v, call.comm, call.layout
    timeout = bound(comm, timeout, op)  # the deadline of the whole call (by default a FT communicator's own)
    tp = transport_of(comm, timeout, op)
    link_comm(comm, tp)
    (q, k, v), ctx = autocast_inputs(q, k, v)  # autocast: SDPA's casts, before the dtype agreement
    with ctx, guarded(tp, comm):
        spec = validate(tp, q, k, v, op=op, causal=causal, softmax_scale=softmax_scale, layout=layout,
                        qkv_format=call.fmt, cu_seqlens=cu_seqlens, window=window, timeout=timeout,
                        sdpa=call.keywords(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                           scale=scale, enable_gqa=enable_gqa),
                        checks=lambda spec, bad: check_degree(spec, tp.size, bad))
        order = None
        perm = spec.layout.gather_order(tp.size, spec.seq_local) if tp.size > 1 else None
        if perm is not None:  # the gathered shards put in natural order, and back
            order = (torch.as_tensor(perm, device=q.device), torch.as_tensor(np.argsort(perm), device=q.device))
        return call.out(ulysses_forward(q, k, v, tp, spec, spec.causal, timeout, op, order))


def ulysses_forward(q, k, v, tp, spec, causal, timeout, op, order=None):
    """The all-to-all, local attention, inverse all-to-all of a validated call.

    Args:
        order: optional ``(perm, inv)`` int64 index tensors: ``perm`` puts the
            gathered tokens (rank-order concatenation of the shards) in
            natural order, ``inv`` undoes it (non-contiguous layouts).
    """
    P = tp.size
    N = P * spec.seq_local
    k, v = spread_kv_heads(k, P), spread_kv_heads(v, P)
    qg, kg, vg = (seq_to_heads(x, tp, timeout, op) for x in (q, k, v))
    if order is not None:
        qg, kg, vg = (x.index_select(1, order[0]) for x in (qg, kg, vg))
    mask = None if spec.cu_seqlens is None else document_mask(spec.cu_seqlens, N, causal, q.device)
    mask = window_dense_mask(mask, N, causal, spec.window, q.device)
    out = local_attention(qg, kg, vg, causal, spec.scale, mask)
    if order is not None:
        out = out.index_select(1, order[1])
    return heads_to_seq(out, tp, timeout, op)
