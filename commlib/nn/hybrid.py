"""Unified sequence parallelism: Ulysses inside groups, ring attention across them.

USP (Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long
Context Generative AI", arXiv:2405.07719) arranges the ``P`` ranks as a grid
of ``R = P / U`` ring groups by ``U = ulysses_degree`` Ulysses groups:

1. inside each Ulysses group of ``U`` ranks, an all-to-all over heads
   (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509) turns the ``U``
   sequence shards ``(B, L, H, D)`` into ``(B, U*L, H/U, D)``: the group's
   tokens for ``H/U`` heads;
2. the ``R`` ranks that hold the same heads (one per Ulysses group) run ring
   attention (:func:`commlib.nn.ring.ring_attention`) over those tokens;
3. the inverse all-to-all returns the output to sequence shards.

Layouts.  The user shards the global sequence once over all ``P`` ranks with
``commlib.nn.shard_sequence(x, comm, layout)``.  Which ranks form a Ulysses
group is chosen so that a group's tokens are exactly the shard the ring's
layout assigns to that group among ``R`` ring ranks:

* ``"contiguous"``: groups of ``U`` consecutive ranks ``gU .. gU+U-1``; they
  hold chunk ``g`` of ``R`` contiguous chunks.
* ``"zigzag"``: the same consecutive groups; rank ``gU+u`` holds chunks
  ``gU+u`` and ``2P-1-gU-u`` of ``2P``, so the group holds chunks ``g`` and
  ``2R-1-g`` of ``2R`` (each ``U`` times larger): the zigzag shard of ring
  rank ``g``.
* ``"striped"``: groups of the strided ranks ``g, g+R, g+2R, ...``; rank
  ``g+uR`` holds tokens ``t = g+uR (mod P)``, so the group holds
  ``t = g (mod R)``: the striped shard of ring rank ``g``.  (Consecutive
  groups would hold stripes ``U`` tokens wide, which no ring layout
  describes.)

The all-to-all concatenates the group's shards in group-rank order; a local
permutation (autograd-tracked) puts them in ascending position, as the ring
expects (zigzag: the first halves in group order, then the second halves in
reverse; striped: interleaved), and its inverse undoes it on the way back.
With ``U = P`` (one ring group) the same permutation gives natural order and
attention runs locally (also on one rank); with ``U = 1`` (and more than
one rank) the call is ring attention.

The two sub-communicators are made once per communicator group, degree and
group shape with the communicator's own ``split`` (collective) and cached,
keyed by the group's collectives transport: after a fault-tolerant shrink
the next call splits the survivors anew, and the old group's
sub-communicators are revoked (see :func:`grid`).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from commlib.collectives.attention.layout import layout_of
from commlib.collectives.attention.transport import transport_of
from commlib.core.errors import ProcessFailed

from .ring import ring_attention
from ._front import front
from ._failure import bound, guarded, link, link_comm
from ._check import autocast_inputs, bool_option, validate
from .ulysses import check_degree, document_mask, heads_to_seq, local_attention, seq_to_heads, spread_kv_heads
from .window import window_dense_mask

__all__ = ["hybrid_attention", "grid"]

# (ulysses_comm, ring_comm) per (degree, strided), per group: keyed by the
# communicator's collectives transport, which a shrink replaces
_GRIDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_GRIDS_BY_ID: dict = {}  # for transports that cannot be weakly referenced
_OWNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # communicator -> [its groups' transports]
_RETIRED: list = []  # sub-communicators of a group that shrank: revoked, kept (never freed)


def _coords(rank: int, size: int, degree: int, strided: bool) -> tuple[int, int]:
    """``(g, u)``: this rank's ring group and its place in the Ulysses group."""
    R = size // degree
    return (rank % R, rank // R) if strided else (rank // degree, rank % degree)


def _member(g: int, u: int, size: int, degree: int, strided: bool) -> int:
    R = size // degree
    return g + u * R if strided else g * degree + u


def grid(comm, ulysses_degree: int, strided: bool = False):
    """The ``(ulysses_comm, ring_comm)`` of ``comm`` for ``ulysses_degree`` (collective on first use).

    The pair is cached per communicator *group*: keyed by the collectives
    transport of ``comm`` (``comm`` itself for a transport), which a
    fault-tolerant shrink (``comm.recover()``, or a collective that recovered)
    replaces, so the next call on the shrunk communicator splits it anew.
    The pairs of the old group are retired then (their sub-communicators
    revoked, so no survivor stays blocked on one, and dropped): by a failure
    callback on ``comm`` after every shrink, and here on the first use of the
    new group.

    Args:
        comm: a communicator or transport with ``split(color, key)``.
        ulysses_degree: ``U``, dividing ``comm.size``.
        strided: Ulysses groups of ranks ``g, g+R, ...`` instead of ``gU .. gU+U-1``.

    Returns:
        tuple: the Ulysses group (``U`` ranks, ranked by place in the group)
        and the ring group (``P/U`` ranks, ranked by group index).

    Raises:
        ProcessFailed, CommTimeout: the split failed (fault-tolerant
            ``comm``); ``recovered = True`` when ``comm`` shrank inside it
            (it then holds the survivors already: do not recover it again).
    """
    key = (int(ulysses_degree), bool(strided))
    tp = transport_of(comm)
    cache = _cache_of(comm, tp)
    if key not in cache:
        g, u = _coords(comm.rank, comm.size, ulysses_degree, strided)
        ucomm = comm.split(g, u)
        rcomm = comm.split(u, g)
        if transport_of(comm) is not tp:
            # a fault-tolerant split whose barrier recovered from a failure
            # (on_failure="shrink"): the colours were of the old group
            _retire_pair((ucomm, rcomm))
            exc = ProcessFailed(f"the communicator shrank to {comm.size} ranks while the process grid was "
                                "split; call again", failed=getattr(comm, "failed_ranks", ()), rank=comm.rank,
                                op="hybrid_attention")
            exc.recovered = True  # already shrunk: do not recover it again
            raise exc
        cache[key] = (ucomm, rcomm)
        link_comm(comm, tp)
        for sub in (ucomm, rcomm):
            link(tp, transport_of(sub), getattr(sub, "transport", None))
    return cache[key]


def _cache_of(comm, tp) -> dict:
    """The grid cache of ``comm``'s current group (``tp``); the pairs cached for
    an earlier group of the same communicator are retired first."""
    try:
        owned = _OWNED.get(comm)
    except TypeError:  # not weakly referenceable
        owned = None
    else:
        if owned is None:
            owned = _OWNED[comm] = []
            if callable(getattr(comm, "add_failure_callback", None)) and getattr(comm, "ft", None) is not None:
                comm.add_failure_callback(_on_shrink)
    if owned is not None:
        _retire_others(owned, tp)
        if tp not in owned:
            owned.append(tp)
    try:
        return _GRIDS.setdefault(tp, {})
    except TypeError:
        return _GRIDS_BY_ID.setdefault(id(tp), {})


def _on_shrink(failed, comm) -> None:
    """Failure callback (every survivor, after ``comm`` shrank): retire the
    grids of the group that is gone."""
    owned = _OWNED.get(comm)
    if owned is not None:
        _retire_others(owned, transport_of(comm))


def _retire_others(owned: list, tp) -> None:
    """Retire the groups in ``owned`` other than ``tp`` (held strongly until
    then: a shrink drops the communicator's reference to its old transport)."""
    for old in [t for t in owned if t is not tp]:
        _retire(old)
        owned.remove(old)


def _retire(tp) -> None:
    """Revoke and drop the sub-communicators cached for group ``tp``."""
    try:
        cache = _GRIDS.pop(tp, None)
    except TypeError:
        cache = _GRIDS_BY_ID.pop(id(tp), None)
    for pair in (cache or {}).values():
        _retire_pair(pair)


def _retire_pair(pair) -> None:
    for sub in pair:
        for t in (transport_of(sub), getattr(sub, "transport", None)):
            if t is not None and getattr(sub, "ft", None) is not None:
                try:
                    t.revoke()  # a survivor still blocked on it returns; never freed (MPI may not free it now)
                except Exception:  # noqa: BLE001 - best effort
                    pass
        _RETIRED.append(sub)


def ring_order(layout, size: int, degree: int, seq_local: int, g: int, strided: bool):
    """The permutation from a group's gathered tokens to ring rank ``g``'s layout order.

    Returns:
        numpy.ndarray: int64 ``perm`` of length ``degree * seq_local``:
        ``gathered[perm]`` lists the positions ``layout.positions(g, size //
        degree, degree * seq_local)``.
    """
    layout = layout_of(layout, op="hybrid_attention")
    R = size // degree
    gathered = np.concatenate([layout.positions(_member(g, u, size, degree, strided), size, seq_local)
                               for u in range(degree)])
    perm = np.argsort(gathered, kind="stable")
    want = layout.positions(g, R, degree * seq_local)
    if not np.array_equal(gathered[perm], want):  # pragma: no cover - the layouts compose by construction
        raise AssertionError(f"layout {layout!r} does not compose over a {R}x{degree} grid")
    return perm


def hybrid_attention(q, k, v, comm=None, ulysses_degree: int | None = None, causal: bool = False,
                     layout: str | None = None, softmax_scale=None, *, bidirectional: bool = False, cu_seqlens=None,
                     window=None, qkv_format="bshd", timeout: float | None = None, attn_mask=None, dropout_p=0.0,
                     is_causal=None, scale=None, enable_gqa=None):
    """Exact attention over a 2-D grid: Ulysses inside groups, ring across them (USP).

    Args:
        q: this rank's queries ``(batch, seq_local, heads, head_dim)``, its
            ``layout`` shard of the global sequence over all ``comm.size``
            ranks (``commlib.nn.shard_sequence(x, comm, layout)``); float16,
            bfloat16, float32 or float64, CPU or CUDA; non-contiguous
            tensors are accepted.
        k, v: ``(batch, seq_local, kv_heads, head_dim)``, dtype and device of ``q``.
        comm: :class:`commlib.Communicator` (or a transport) with ``split``,
            or a :class:`commlib.nn.Sharding` (its layout is the call's).
            The communicator first works with a ``DeprecationWarning``.
        ulysses_degree: ``U``, the Ulysses group size: divides ``comm.size``
            and ``heads``; ``kv_heads`` divisible by ``U`` or dividing it
            (kv heads are then replicated, as in
            :func:`commlib.nn.ulysses.ulysses_attention`).
        causal: mask later global positions.
        layout: ``"contiguous"``, ``"striped"`` or ``"zigzag"`` (balances
            causal work across the ring); see the module notes for the grid
            each implies.  None (default): the Sharding's, else ``"zigzag"``.
        softmax_scale: score scale (default ``head_dim ** -0.5``).
        bidirectional: the ring sends K/V both ways (see ``ring_attention``).
        cu_seqlens: optional global document boundaries ``[0, ..., seq_len]``
            (same on every rank), passed to the ring (or masked locally when
            ``U = comm.size``).
        window: optional sliding window ``(left, right)`` (FlashAttention-2's
            ``window_size``, ints >= -1, -1 unbounded; Longformer/Mistral):
            query ``i`` sees keys ``i - left <= j <= i + right`` only.  The
            ring across the groups becomes the halo exchange of
            :func:`commlib.nn.ring_attention` (only the K/V rows inside the
            window move between groups); with ``U = comm.size`` it is a mask
            on the local attention.
        timeout: the deadline of the whole call, in seconds: the argument
            agreement and every exchange wait what is left of it, and past it
            the call raises ``CommTimeout`` naming the rank and the operation
            (its backward, a call of its own, gets the whole timeout again).
            None (no limit; on a fault-tolerant communicator its own
            ``timeout``) or a finite number > 0.
        qkv_format: ``"bshd"`` (default) or ``"bhsd"`` (SDPA's order), as in
            :func:`commlib.nn.ring_attention`.
        attn_mask, dropout_p, is_causal, scale, enable_gqa: SDPA's keywords,
            as in :func:`commlib.nn.ring.ring_attention`.

    Autocast: as SDPA under ``torch.autocast`` (see
    :func:`commlib.nn.ring.ring_attention`): q, k, v cast to the autocast
    dtype (float64 unchanged) before any exchange, the output in that dtype,
    the gradients in the inputs' own dtypes.

    Returns:
        torch.Tensor: ``out`` like ``q`` (under autocast: the autocast dtype),
        differentiable with respect to ``q``, ``k``, ``v``.

    Raises:
        InvalidArgument: no communicator in its slot (at once).  On every
            rank alike, before any data moves: bad tensors, dtypes, devices,
            layout (or one that contradicts the Sharding's or the shards'),
            ``qkv_format`` or scale; ``ulysses_degree`` not
            a positive divisor of ``comm.size`` or of the head counts; an
            ``attn_mask``, a ``dropout_p`` other than 0 or conflicting SDPA
            keywords (see ``ring_attention``); an odd
            ``seq_local`` with zigzag; a ``timeout`` that is not None or a
            finite number > 0; a ``window`` that is not None or a pair of
            ints >= -1; or ranks that differ in shapes, dtypes,
            options or which of q, k, v get a gradient.  From the backward
            with ``create_graph=True`` when a ring runs (``ulysses_degree <
            comm.size``): the ring's backward is not differentiable.
        CommTimeout: the call did not complete within ``timeout``.
        ProcessFailed: a peer failed (other transport failures: :class:`~commlib.CommError`).

    Failures: as :func:`commlib.nn.ring.ring_attention`; a failure on any
    rank revokes the grid's sub-communicators with the communicator, and
    after a shrink the grid is split anew over the survivors (a degree must
    then divide the new size).
    """
    op = "hybrid_attention"
    call = front(op, q, k, v, comm, layout, qkv_format, default_layout="zigzag", cu_seqlens=cu_seqlens,
                 causal=causal is True or is_causal is True)
    q, k, v, comm, layout = call.q, call.k, call.v, call.comm, call.layout
    timeout = bound(comm, timeout, op)  # the deadline of the whole call (by default a FT communicator's own)
    tp = transport_of(comm, timeout, op)
    link_comm(comm, tp)
    (q, k, v), ctx = autocast_inputs(q, k, v)  # autocast: SDPA's casts, before the dtype agreement
    with ctx, guarded(tp, comm):
        return call.out(_hybrid(q, k, v, comm, tp, op, ulysses_degree, layout, softmax_scale, bidirectional,
                                cu_seqlens, timeout,
                                call.keywords(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa), causal, window, call.fmt))


def _hybrid(q, k, v, comm, tp, op, ulysses_degree, layout, softmax_scale, bidirectional, cu_seqlens, timeout,
            sdpa, causal, window=None, fmt="bshd"):
    size, rank = tp.size, tp.rank
    U = ulysses_degree

    deg = int(U) if isinstance(U, (int, np.integer)) and not isinstance(U, bool) else -1

    def checks(spec, bad):
        if deg < 1 or size % deg:
            raise bad(f"ulysses_degree must be a positive int dividing the {size} ranks, got {U!r}")
        check_degree(spec, deg, bad, "ulysses_degree")
        if spec.option("bidirectional") < 0:
            raise bad(f"bidirectional must be a bool, got {bidirectional!r}")
        if 1 < U < size and not callable(getattr(comm, "split", None)):
            raise bad(f"comm ({type(comm).__name__}) has no split(color, key) to form the process grid")

    spec = validate(tp, q, k, v, op=op, causal=causal, softmax_scale=softmax_scale, layout=layout, qkv_format=fmt,
                    cu_seqlens=cu_seqlens, window=window, timeout=timeout, sdpa=sdpa,
                    options=(("ulysses_degree", deg), ("bidirectional", bool_option(bidirectional))), checks=checks)
    layout = spec.layout
    causal = spec.causal
    U = int(U)
    R = size // U
    if U == 1 and R > 1:
        return ring_attention(q, k, v, comm, causal=causal, layout=layout, softmax_scale=spec.scale,
                              cu_seqlens=spec.cu_seqlens, bidirectional=bool(bidirectional), timeout=timeout,
                              window=spec.window)
    strided = layout.strided_groups
    if R == 1:
        ucomm, rcomm = comm, None
    else:
        ucomm, rcomm = grid(comm, U, strided)
    utp = transport_of(ucomm, timeout, "hybrid_attention")
    g, _ = _coords(rank, size, U, strided)
    perm_np = ring_order(layout, size, U, spec.seq_local, g, strided)
    perm = torch.as_tensor(perm_np, device=q.device)
    inv = torch.as_tensor(np.argsort(perm_np), device=q.device)
    k, v = spread_kv_heads(k, U), spread_kv_heads(v, U)
    qg, kg, vg = (seq_to_heads(x, utp, timeout, op).index_select(1, perm) for x in (q, k, v))
    if R == 1:
        mask = None if spec.cu_seqlens is None else document_mask(spec.cu_seqlens, size * spec.seq_local, causal,
                                                                  q.device)
        mask = window_dense_mask(mask, size * spec.seq_local, causal, spec.window, q.device)
        out = local_attention(qg, kg, vg, causal, spec.scale, mask)
    else:
        out = ring_attention(qg, kg, vg, rcomm, causal=causal, layout=layout, softmax_scale=spec.scale,
                             cu_seqlens=spec.cu_seqlens, bidirectional=bool(bidirectional), timeout=timeout,
                             window=spec.window)
    return heads_to_seq(out.index_select(1, inv), utp, timeout, op)
