"""The public attention calls' front: who the communicator is, which layout the call runs in, the tensors' order.

Every public attention function of :mod:`commlib.nn` (and the module) passes
its arguments through :func:`front` before anything else:

* the argument order: ``(q, k, v, comm)`` (the numpy/CuPy calls take the same
  order); ``(comm, q, k, v)`` works with a ``DeprecationWarning``
  (:func:`commlib.collectives.attention.common.comm_last`);
* the layout: a :class:`Sharding` passed as ``comm`` carries it (the layout
  said once, for sharding, attention and unsharding); an explicit
  ``layout=`` that contradicts it, or a tensor that
  :func:`commlib.nn.shard_sequence` cut in another layout, is refused;
* ``qkv_format``: ``"bshd"`` ``(batch, seq, heads, head_dim)``, commlib's
  order, or ``"bhsd"`` ``(batch, heads, seq, head_dim)``, the order of
  :func:`torch.nn.functional.scaled_dot_product_attention` (Transformer
  Engine's names); ``"bhsd"`` tensors are viewed as ``"bshd"`` for the call
  and the output is viewed back, so autograd returns the gradients in the
  caller's format.  Shapes that only fit the other format are refused with
  a hint.

What depends on one rank's tensors is not raised here: it travels as the
call's ``problem`` into the variant's argument check, which raises it on
every rank alike in its agreement round (no extra round).
"""
from __future__ import annotations

import numpy as np
import torch

from commlib.collectives.attention.common import comm_last, is_comm
from commlib.collectives.attention.layout import LAYOUTS, local_seq_len, sequence_positions
from commlib.core.errors import InvalidArgument

from .shard import SHARD_TAG, shard_sequence, unshard_sequence

__all__ = ["FORMATS", "Sharding", "Call", "front"]

#: the tensor orders the attention calls take (Transformer Engine's names)
FORMATS = ("bshd", "bhsd")

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
        comm, layout, dim: as given; ``rank`` and ``size`` are the communicator's.

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
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise InvalidArgument(f"layout {layout!r} is not one of {LAYOUTS}", rank=comm.rank, op=op)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise InvalidArgument(f"dim must be an int, got {dim!r}", rank=comm.rank, op=op)
        self.comm, self.layout, self.dim = comm, layout, int(dim)

    @property
    def rank(self) -> int:
        return int(self.comm.rank)

    @property
    def size(self) -> int:
        return int(self.comm.size)

    def shard(self, x: torch.Tensor, *, pad: bool = False) -> torch.Tensor:
        """This rank's shard of the global tensor ``x`` (the same on every
        rank), differentiable: :func:`commlib.nn.shard_sequence` in this
        layout and dimension."""
        return shard_sequence(x, self.comm, self.layout, self.dim, pad=pad)

    def unshard(self, x_local: torch.Tensor, seq_len: int | None = None, *, sum_grad: bool = False,
                timeout: float | None = None) -> torch.Tensor:
        """The global tensor from every rank's shard, on every rank
        (:func:`commlib.nn.unshard_sequence` in this layout and dimension;
        an all-gather, differentiable)."""
        return unshard_sequence(x_local, self.comm, self.layout, self.dim, seq_len, sum_grad=sum_grad,
                                timeout=timeout)

    def seq_local(self, seq_len: int) -> int:
        """Tokens per rank (padding included) for a global length ``seq_len``."""
        return local_seq_len(seq_len, self.size, self.layout)

    def positions(self, seq_local: int) -> np.ndarray:
        """int64 ``(seq_local,)``: the global positions of this rank's tokens
        (for rotary embeddings; entries ``>= seq_len`` are padding)."""
        return sequence_positions(self.layout, self.rank, self.size, int(seq_local))

    def __repr__(self) -> str:
        return f"Sharding(layout={self.layout!r}, dim={self.dim}, rank={self.rank}, size={self.size})"


class Call:
    """A public call after :func:`front`: the tensors in ``"bshd"``, the
    communicator, the layout, and what this rank found wrong (``problem``, a
    message for the variant's agreed check, or None)."""

    __slots__ = ("q", "k", "v", "comm", "layout", "fmt", "problem")

    def __init__(self, q, k, v, comm, layout, fmt, problem):
        self.q, self.k, self.v, self.comm, self.layout, self.fmt, self.problem = q, k, v, comm, layout, fmt, problem

    def keywords(self, **sdpa) -> dict:
        """SDPA's keywords of the call with the front's ``problem`` (see :func:`commlib.nn._check.call_problem`)."""
        sdpa["problem"] = self.problem
        return sdpa

    def out(self, out: torch.Tensor) -> torch.Tensor:
        """The output in the caller's format (a view)."""
        return out.transpose(1, 2) if self.fmt == "bhsd" else out


def _shape_problem(q, k, v, fmt, size, cu_seqlens):
    """Shapes that do not fit ``fmt`` but fit the other format: a message with the hint, else None."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None  # the variant's checks name it

    def fits(qs, ks):
        b, s, h, d = qs
        kb, ks_, hk, kd = ks
        return kb == b and ks_ == s and kd == d and hk >= 1 and h % hk == 0

    q_s, k_s = tuple(q.shape), tuple(k.shape)
    swap = (lambda s: (s[0], s[2], s[1], s[3]))
    other = "bhsd" if fmt == "bshd" else "bshd"
    # as the call reads them (after the view to bshd) and as the other format would read them
    if not fits(q_s, k_s) and fits(swap(q_s), swap(k_s)):
        return (f"q {q_s} and k {k_s} (as (batch, seq, heads, head_dim) after qkv_format={fmt!r}) do not fit "
                f"together, but they do as qkv_format={other!r}; pass qkv_format={other!r} "
                "(SDPA's (batch, heads, seq, head_dim) is 'bhsd')")
    if cu_seqlens is not None:
        try:
            last = int(cu_seqlens[-1])
        except Exception:  # noqa: BLE001 - the variant's check names a bad cu_seqlens
            return None
        if last != size * q_s[1] and last == size * q_s[2]:
            return (f"cu_seqlens ends at {last} = {size} ranks x {q_s[2]}, the size of q's heads dimension "
                    f"under qkv_format={fmt!r}; the tensors look like qkv_format={other!r}")
    return None


def front(op: str, q, k, v, comm, layout, qkv_format, *, default_layout: str = "contiguous",
          cu_seqlens=None) -> Call:
    """Resolve a public call's communicator, layout and tensor format (see the module notes).

    Args:
        op: the call's name.
        q, k, v, comm: the first four positional arguments as received.
        layout: the call's ``layout`` (None: the :class:`Sharding`'s, else
            ``default_layout``).
        qkv_format: ``"bshd"`` or ``"bhsd"``.
        cu_seqlens: the call's ``cu_seqlens`` (only for a format hint).

    Returns:
        Call: the tensors viewed as ``"bshd"`` and the rest of the call.

    Raises:
        InvalidArgument: no communicator (nothing to agree over: raised
            here, the same on every rank).  Everything else travels as
            ``Call.problem``.
    """
    (q, k, v), comm = comm_last(op, (q, k, v), comm, stacklevel=4)
    problem = None
    sharding = comm if isinstance(comm, Sharding) else None
    if sharding is not None:
        comm = sharding.comm
        if layout is not None and layout != sharding.layout:
            problem = (f"layout {layout!r} contradicts the Sharding's layout {sharding.layout!r}; leave layout out "
                       "(the Sharding carries it)")
        layout = sharding.layout
        if sharding.dim not in (1, 2) and problem is None:
            problem = f"the Sharding's sequence dim is {sharding.dim}; attention takes dim 1 ('bshd') or 2 ('bhsd')"
    if layout is None:
        layout = default_layout
    size = int(comm.size)
    fmt = qkv_format
    if not isinstance(fmt, str) or fmt not in FORMATS:
        problem = problem or f"qkv_format must be one of {FORMATS}, got {qkv_format!r}"
        fmt = "bshd"
    elif sharding is not None and problem is None and sharding.dim != (1 if fmt == "bshd" else 2):
        problem = (f"the Sharding shards dim {sharding.dim} but qkv_format={fmt!r} has the sequence on dim "
                   f"{1 if fmt == 'bshd' else 2}")
    if problem is None and size > 1:
        for name, t in (("q", q), ("k", k), ("v", v)):
            tag = getattr(t, SHARD_TAG, None) if isinstance(t, torch.Tensor) else None
            if tag is not None and tag[1] == size and tag[0] != layout:
                problem = (f"{name} was sharded in layout {tag[0]!r} (commlib.nn.shard_sequence) but this call "
                           f"runs in layout {layout!r}: pass layout={tag[0]!r}, or shard and call through one "
                           f"commlib.nn.Sharding(comm, {tag[0]!r}), which carries the layout")
                break
    if fmt == "bhsd":
        q, k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in (q, k, v))
    if problem is None:
        problem = _shape_problem(q, k, v, fmt, size, cu_seqlens)
    return Call(q, k, v, comm, layout, fmt, problem)
