"""Between a global torch tensor and each rank's shard of its sequence; :class:`Sharding`, the layout said once.

:func:`shard_sequence` cuts a global tensor (the same on every rank) into this
rank's shard under one of the sequence layouts of
:mod:`commlib.collectives.attention.layout` (``"contiguous"``, ``"striped"``,
``"zigzag"``), without communicating; :func:`unshard_sequence` gathers the
shards back into the global tensor on every rank (an all-gather over the
communicator's collectives transport) and is differentiable.

Gradient convention of :func:`unshard_sequence`.  After ``x = unshard(x_local)``
every rank holds the same global ``x``.  Two uses are common:

* every rank computes the *same* loss from ``x`` (the loss is replicated, as
  when the gathered output feeds an identical head on every rank): the
  gradient of that one loss with respect to rank ``r``'s shard is rank ``r``'s
  slice of ``dloss/dx``, which every rank already has.  Backward then takes
  this rank's slice and communicates nothing.  This is the default
  (``sum_grad=False``) and the convention of the attention calls' tests.
* rank ``s`` computes its *own* loss ``loss_s`` from ``x`` and the objective is
  ``sum_s loss_s`` (as in data-parallel training): the gradient of rank ``r``'s
  shard is the sum over ranks of their slices ``r``, which needs an all-to-all
  of gradient slices and a sum (``sum_grad=True``; summed in rank order
  ``0 .. P-1`` on every rank).  With a replicated loss this gives ``P`` times
  the gradient.

Global lengths.  The layouts need a length divisible by ``P`` (contiguous,
striped) or ``2P`` (zigzag).  :func:`shard_sequence` zero-pads any other
length at its global end to ``P * seq_local`` tokens, as the numpy
:func:`commlib.shard_sequence` does (``pad=False`` refuses such lengths
instead).  The padding comes after every real token, so causal attention
never lets a real token see it; non-causal attention must mask it:
``cu_seqlens`` ending in ``[..., seq_len, padded_len]`` puts it in a
document of its own.  An attention call given a padded shard of
:func:`shard_sequence` (``k``, ``v``) that is neither causal nor given
``cu_seqlens`` refuses it, naming both ways.  ``unshard_sequence(...,
seq_len=seq_len)`` drops the padding again.
"""
from __future__ import annotations

import numpy as np
import torch

from commlib.collectives.agreement import agree_call
from commlib.collectives.attention.layout import LAYOUTS, layout_of
from commlib.collectives.attention.common import is_comm
from commlib.collectives.attention.transport import transport_of
from commlib.core.errors import InvalidArgument
from commlib.core.seconds import restarted, time_left

from commlib.collectives.attention.spec import describe_grad

from ._check import agreement_timeout, device_code, grad_flags, timeout_of
from ._wire import all_to_all_tensors, irecv_tensor, isend_tensor
from ._failure import bound, guarded, link_comm

__all__ = ["Sharding", "shard_sequence", "unshard_sequence"]

#: dtypes :func:`unshard_sequence` moves (their index is the header's code)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
           torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)
_MAX_NDIM = 8


#: the attribute :func:`shard_sequence` sets on a shard: ``(layout, size)``,
#: which the attention calls check against their layout (:mod:`._front`)
SHARD_TAG = "_commlib_sharded"


def tag_shard(t: torch.Tensor, layout: str, size: int, seq_len: int | None = None) -> torch.Tensor:
    """Mark ``t`` as a sequence shard in ``layout`` over ``size`` ranks (of a
    ``seq_len``-token sequence zero-padded to ``size * seq_local``; None: no
    padding); returns ``t``."""
    try:
        setattr(t, SHARD_TAG, (layout, int(size), seq_len))
    except (AttributeError, RuntimeError):  # pragma: no cover - a tensor subclass without a __dict__
        pass
    return t


def _check_dim(x, dim, rank, op) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise InvalidArgument(f"dim must be an int, got {dim!r}", rank=rank, op=op)
    if not -x.dim() <= dim < x.dim():
        raise InvalidArgument(f"dim {dim} out of range for a {x.dim()}-d tensor", rank=rank, op=op)
    return int(dim) % x.dim()


def _resolve(comm, layout, dim, op):
    """A :class:`Sharding` passed as ``comm``: its communicator, layout and dim
    (an explicit layout or dim that contradicts it is refused); else the
    defaults ``"contiguous"`` and 1."""
    if isinstance(comm, Sharding):
        for name, given, own in (("layout", layout, comm.layout), ("dim", dim, comm.dim)):
            if given is not None and given != own:
                raise InvalidArgument(f"{name} {given!r} contradicts the Sharding's {name} {own!r}; leave it out "
                                      "(the Sharding carries it)", rank=comm.rank, op=op)
        return comm.comm, comm.layout, comm.dim
    return comm, "contiguous" if layout is None else layout, 1 if dim is None else dim


def _slice(x, layout, rank, size, L, dim):
    """Rank ``rank``'s ``L`` rows of the (padded) global ``x`` on ``dim``, contiguous."""
    start = layout.local_start(rank, size, L)
    if start is not None:
        return x.narrow(dim, start, L).contiguous()
    pos = torch.as_tensor(layout.positions(rank, size, L), device=x.device)
    return x.index_select(dim, pos).contiguous()


def shard_sequence(x: torch.Tensor, comm, layout: str | None = None, dim: int | None = None, *,
                   pad: bool = True):
    """This rank's shard of a global tensor's sequence (no communication).

    Args:
        x: the global tensor, identical on every rank, sequence on ``dim``;
            any dtype and device.  Differentiable: the gradient of the shard
            flows back into ``x`` (zeros outside this rank's positions).
        comm: a :class:`commlib.Communicator` (only ``rank`` and ``size`` are
            read), or a :class:`Sharding` (its layout and dim are the call's).
        layout: ``"contiguous"`` (default), ``"striped"`` or ``"zigzag"``.
        dim: the sequence dimension (default 1, as in ``(batch, seq, heads, head_dim)``).
        pad: a length the layout cannot divide (``P``; ``2P`` for zigzag)
            is zero-padded at the sequence's global end to ``P * seq_local``
            tokens (default, as the numpy :func:`commlib.shard_sequence`);
            mask the padding in non-causal attention (``cu_seqlens``, see the
            module notes) and drop it with ``unshard_sequence(...,
            seq_len=seq_len)``.  False refuses such lengths.

    The shard remembers its layout: an attention call of :mod:`commlib.nn`
    in another layout refuses it (a wrong result otherwise).  Saying the
    layout once with :class:`commlib.nn.Sharding` avoids the mismatch.

    Returns:
        torch.Tensor: the contiguous shard, ``seq_local`` tokens on ``dim``
        (``seq_len / P``, or ``seq_len / (2P) * 2`` for zigzag, rounded up
        with ``pad``), in ascending global position; positions via
        :func:`commlib.collectives.attention.sequence_positions`.

    Raises:
        InvalidArgument: ``x`` not a tensor, bad ``dim`` or layout (or one
            that contradicts the Sharding's), or with ``pad=False`` a
            length not divisible by ``P`` (``2P`` for zigzag).
    """
    op = "shard_sequence"
    comm, layout, dim = _resolve(comm, layout, dim, op)
    rank, size = int(comm.rank), int(comm.size)
    if not isinstance(x, torch.Tensor):
        raise InvalidArgument(f"x must be a torch.Tensor, got {type(x).__name__}", rank=rank, op=op)
    layout = layout_of(layout, rank=rank, op=op)
    dim = _check_dim(x, dim, rank, op)
    n = int(x.shape[dim])
    div = layout.unit(size)
    if n % div and not pad:
        raise InvalidArgument(
            f"sequence length {n} is not divisible by {div} ({size} ranks, layout {layout!r}) and pad=False; "
            "pad=True (the default) zero-pads it at the end (mask the padding in attention), or choose "
            "another length",
            rank=rank, op=op)
    L = layout.local_seq_len(n, size)
    if L * size > n:
        shape = list(x.shape)
        shape[dim] = L * size - n
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    part = _slice(x, layout, rank, size, L, dim)
    # an attention call in another layout refuses it, and a non-causal one without cu_seqlens its padding
    return tag_shard(part, layout, size, n if L * size > n else None)


class _Unshard(torch.autograd.Function):
    """All-gather of sequence shards; backward: this rank's slice, or the sum of every rank's."""

    @staticmethod
    def forward(ctx, x, tp, layout, dim, seq_len, sum_grad, tags, timeout, op):
        P, r = tp.size, tp.rank
        L = x.shape[dim]
        ctx.meta = (tp, layout, dim, seq_len, sum_grad, tags[1], timeout, op, L)
        mine = x.contiguous()
        parts = [None] * P
        parts[r] = mine
        reqs = []
        for i in range(1, P):
            src = (r - i) % P
            parts[src] = torch.empty_like(mine)
            reqs.append(irecv_tensor(tp, parts[src], src, tags[0]))
        for i in range(1, P):
            reqs.append(isend_tensor(tp, mine, (r + i) % P, tags[0]))
        if reqs:
            tp.waitall(reqs, time_left(timeout), op=op)
        full = torch.cat(parts, dim=dim) if P > 1 else mine.clone()
        order = layout.gather_order(P, L)
        if order is not None:  # the rank-order concatenation put in natural order
            full = full.index_select(dim, torch.as_tensor(order, device=x.device))
        if seq_len < P * L:
            full = full.narrow(dim, 0, seq_len).contiguous()
        return full

    @staticmethod
    def backward(ctx, grad):
        tp, layout, dim, seq_len, sum_grad, tag, timeout, op, L = ctx.meta
        timeout = restarted(timeout)  # the backward is a call of its own: the whole timeout again
        P, r = tp.size, tp.rank
        if seq_len < P * L:
            shape = list(grad.shape)
            shape[dim] = P * L - seq_len
            grad = torch.cat([grad, grad.new_zeros(shape)], dim=dim)

        def slice_of(s):
            return _slice(grad, layout, s, P, L, dim)

        if not sum_grad or P == 1:
            return (slice_of(r),) + (None,) * 8
        with guarded(tp):  # a failure revokes the call's transports: no survivor left waiting
            recv = all_to_all_tensors(tp, [slice_of(s) for s in range(P)], tag, timeout, op + " (backward)")
        acc = recv[0].clone()
        for s in range(1, P):  # rank order, the same on every rank
            acc += recv[s]
        return (acc,) + (None,) * 8


_UNSHARD_FIELDS = ("ndim", "dim") + tuple(f"shape[{i}]" for i in range(_MAX_NDIM)) + (
    "dtype", "device", "layout", "seq_len", "sum_grad", "requires_grad")


def _describe_unshard(name, value):
    if name == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else value
    if name == "layout":
        return repr(LAYOUTS[value]) if 0 <= value < len(LAYOUTS) else value
    if name == "device":
        return ("cpu", "cuda", "other")[value] if 0 <= value < 3 else value
    if name == "sum_grad":
        return bool(value)
    if name == "requires_grad":
        return describe_grad(value, ("x_local",))
    return value


def unshard_sequence(x_local: torch.Tensor, comm, layout: str | None = None, dim: int | None = None,
                     seq_len: int | None = None, *, sum_grad: bool = False, timeout: float | None = None):
    """Gather every rank's sequence shard into the global tensor, on every rank.

    The inverse of :func:`shard_sequence`: an all-gather (every send and
    receive posted at once, then one wait) over the ``isend``/``irecv`` of
    the communicator's collectives transport, reordered by the layout's
    positions, padding dropped.  Differentiable with respect to ``x_local``;
    see the module notes for the two gradient conventions.

    Args:
        x_local: this rank's shard, ``seq_local`` tokens on ``dim``; same
            shape, dtype and device type on every rank (at most 8-d).
        comm: the :class:`commlib.Communicator`, or a :class:`Sharding`
            (its layout and dim are the call's).
        layout: the layout the shards are in (default ``"contiguous"``).
        dim: the sequence dimension (default 1).
        seq_len: the true global length (default ``P * seq_local``); shorter
            lengths drop the padding :func:`shard_sequence` added.
        sum_grad: backward sums every rank's gradient slice for this rank
            (an all-to-all; for per-rank losses) instead of taking this rank's
            own slice (for a loss replicated on every rank).
        timeout: the deadline of the whole call, in seconds (None: no limit;
            on a fault-tolerant communicator its own ``timeout``); its backward
            gets the whole timeout again.

    Returns:
        torch.Tensor: ``seq_len`` tokens on ``dim``, dtype and device of ``x_local``.

    Raises:
        InvalidArgument: on every rank alike, before any data moves, when a
            rank passed a bad tensor, dim, layout, ``seq_len`` or ``timeout``
            (None or a finite number > 0), or the ranks' shapes, dtypes or
            options differ (with ``sum_grad``: whether ``x_local`` gets a
            gradient, since that backward communicates).
        CommTimeout: ``timeout`` passed.
        CommError: a peer failed (``ProcessFailed``) or another transport error.
    """
    op = "unshard_sequence"
    comm, layout, dim = _resolve(comm, layout, dim, op)
    timeout = bound(comm, timeout, op)  # the deadline of the whole call (by default a FT communicator's own)
    tp = transport_of(comm, timeout, op)
    link_comm(comm, tp)
    with guarded(tp, comm):
        return _unshard(x_local, tp, layout, dim, seq_len, sum_grad, timeout, op)


def _unshard(x_local, tp, layout, dim, seq_len, sum_grad, timeout, op):
    rank, size = tp.rank, tp.size
    problem, header = None, None
    try:
        if not isinstance(x_local, torch.Tensor):
            raise InvalidArgument(f"x_local must be a torch.Tensor, got {type(x_local).__name__}", rank=rank, op=op)
        layout = layout_of(layout, rank=rank, op=op)
        d = _check_dim(x_local, dim, rank, op)
        if x_local.dim() > _MAX_NDIM:
            raise InvalidArgument(f"x_local has {x_local.dim()} dims; at most {_MAX_NDIM} are supported",
                                  rank=rank, op=op)
        if x_local.dtype not in _DTYPES:
            raise InvalidArgument(f"dtype {x_local.dtype} is not supported", rank=rank, op=op)
        L = int(x_local.shape[d])
        n = size * L if seq_len is None else seq_len
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidArgument(f"seq_len must be a non-negative int, got {seq_len!r}", rank=rank, op=op)
        n = int(n)
        if layout.seq_local_problem(L):
            raise InvalidArgument(layout.seq_local_problem(L), rank=rank, op=op)
        if layout.local_seq_len(n, size) != L:
            raise InvalidArgument(f"seq_local {L} does not match seq_len {n} on {size} ranks with layout "
                                  f"{layout!r} (expected {layout.local_seq_len(n, size)})", rank=rank, op=op)
        if not isinstance(sum_grad, (bool, np.bool_)):
            raise InvalidArgument(f"sum_grad must be a bool, got {sum_grad!r}", rank=rank, op=op)
        timeout_of(timeout, lambda msg: InvalidArgument(msg, rank=rank, op=op))
        shape = list(x_local.shape) + [-1] * (_MAX_NDIM - x_local.dim())
        # with sum_grad the backward is an all-to-all: every rank must have one
        grad = grad_flags(x_local) if sum_grad else 0
        header = (x_local.dim(), d, *shape, _DTYPES.index(x_local.dtype), device_code(x_local.device),
                  layout.code, n, int(bool(sum_grad)), grad)
    except InvalidArgument as exc:
        problem = exc
    agree_call(tp, header, op=op, names=_UNSHARD_FIELDS, local_error=problem, timeout=agreement_timeout(timeout),
               describe=_describe_unshard)
    tag0 = tp.tags.slot(2)
    return _Unshard.apply(x_local, tp, layout, d, n, bool(sum_grad), (tag0, tag0 + 1), timeout, op)


class Sharding:
    """A communicator with the sequence layout stated once: shard, attend, unshard in it.

    Pass it wherever :mod:`commlib.nn` takes a communicator (the attention
    functions, :class:`~commlib.nn.SequenceParallelAttention`): the call
    runs in its layout, so the layout cannot be forgotten on one call and
    given on another (which gives a wrong result without an error)::

        sp = commlib.nn.Sharding(comm, "zigzag")
        q, k, v = (sp.shard(x) for x in (Q, K, V))          # this rank's shards
        out = commlib.nn.ring_attention(q, k, v, sp, causal=True)
        full = sp.unshard(out)                              # the global output

    Args:
        comm: the :class:`commlib.Communicator` the sequence is sharded over.
        layout: ``"contiguous"``, ``"striped"`` or ``"zigzag"``
            (:mod:`commlib.collectives.attention.layout`).
        dim: the sequence dimension of the tensors it shards and unshards
            (default 1, as in ``(batch, seq, heads, head_dim)``; 2 for SDPA's
            ``(batch, heads, seq, head_dim)``).

    Attributes:
        comm, dim: as given; layout: its :class:`~commlib.collectives.attention.layout.Layout`
            (compares equal to its name); ``rank`` and ``size`` are the communicator's.

    Raises:
        InvalidArgument: ``comm`` not a communicator, an unknown layout, or
            ``dim`` not an int.
    """

    def __init__(self, comm, layout: str, dim: int = 1):
        op = "Sharding"
        if isinstance(comm, Sharding):
            comm = comm.comm
        if not is_comm(comm):
            raise InvalidArgument(f"comm must be a commlib.Communicator, got {type(comm).__name__}", op=op)
        layout = layout_of(layout, rank=comm.rank, op=op)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise InvalidArgument(f"dim must be an int, got {dim!r}", rank=comm.rank, op=op)
        self.comm, self.layout, self.dim = comm, layout, int(dim)

    @property
    def rank(self) -> int:
        return int(self.comm.rank)

    @property
    def size(self) -> int:
        return int(self.comm.size)

    def shard(self, x: torch.Tensor, *, pad: bool = True) -> torch.Tensor:
        """This rank's shard of the global tensor ``x``.

        :func:`shard_sequence` in this layout and dimension (no
        communication; differentiable).

        Args:
            x: the global tensor, the same on every rank, the sequence on
                :attr:`dim`; any dtype and device.
            pad: zero-pad a length the layout cannot divide (default; see
                :func:`shard_sequence`); False refuses it.

        Returns:
            torch.Tensor: ``seq_local`` tokens on :attr:`dim`, ascending
            global positions (:meth:`positions`).

        Raises:
            InvalidArgument: as :func:`shard_sequence`.
        """
        return shard_sequence(x, self.comm, self.layout, self.dim, pad=pad)

    def unshard(self, x_local: torch.Tensor, seq_len: int | None = None, *, sum_grad: bool = False,
                timeout: float | None = None) -> torch.Tensor:
        """The global tensor from every rank's shard, on every rank.

        :func:`unshard_sequence` in this layout and dimension (an
        all-gather over the communicator; differentiable).

        Args:
            x_local: this rank's shard, ``seq_local`` tokens on :attr:`dim`;
                the same shape, dtype and device type on every rank.
            seq_len: the true global length (default ``size * seq_local``).
            sum_grad, timeout: as :func:`unshard_sequence`.

        Returns:
            torch.Tensor: ``seq_len`` tokens on :attr:`dim`, dtype and device of ``x_local``.

        Raises:
            InvalidArgument, CommTimeout, CommError: as :func:`unshard_sequence`.
        """
        return unshard_sequence(x_local, self.comm, self.layout, self.dim, seq_len, sum_grad=sum_grad,
                                timeout=timeout)

    def seq_local(self, seq_len: int) -> int:
        """Tokens per rank (padding included) for a global length ``seq_len``."""
        return self.layout.local_seq_len(seq_len, self.size)

    def positions(self, seq_local: int) -> np.ndarray:
        """int64 ``(seq_local,)``: the global positions of this rank's tokens
        (for rotary embeddings; entries ``>= seq_len`` are padding)."""
        return self.layout.positions(self.rank, self.size, int(seq_local))

    def __repr__(self) -> str:
        return f"Sharding(layout={self.layout!r}, dim={self.dim}, rank={self.rank}, size={self.size})"
