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

import torch

from commlib.collectives.attention.common import comm_last
from commlib.collectives.attention.spec import FORMATS

from .shard import SHARD_TAG, Sharding

__all__ = ["FORMATS", "Sharding", "Call", "front"]


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


def _unmasked_padding(k, v, size: int, sdim: int):
    """The problem of a non-causal call without ``cu_seqlens`` given shards that
    :func:`~.shard.shard_sequence` zero-padded (a zero key takes softmax weight), else None."""
    for name, t in (("k", k), ("v", v)):
        tag = getattr(t, SHARD_TAG, None) if isinstance(t, torch.Tensor) else None
        if tag is not None and len(tag) > 2 and tag[2] is not None and tag[1] == size:
            n, padded = tag[2], size * int(t.shape[sdim]) if t.dim() > sdim else "its padded length"
            return (f"{name} is a shard of a {n}-token sequence that commlib.nn.shard_sequence zero-padded to "
                    f"{padded} tokens, and this non-causal call would attend to the padding: pass "
                    f"cu_seqlens=[0, ..., {n}, {padded}] (the padding a document of its own), or causal=True "
                    "(the padding follows every real token)")
    return None


def front(op: str, q, k, v, comm, layout, qkv_format, *, default_layout: str = "contiguous",
          cu_seqlens=None, causal=None) -> Call:
    """Resolve a public call's communicator, layout and tensor format (see the module notes).

    Args:
        op: the call's name.
        q, k, v, comm: the first four positional arguments as received.
        layout: the call's ``layout`` (None: the :class:`Sharding`'s, else
            ``default_layout``).
        qkv_format: ``"bshd"`` or ``"bhsd"``.
        cu_seqlens: the call's ``cu_seqlens`` (for a format hint, and whether
            the padding of a padded shard is masked).
        causal: the call's ``causal`` (``True``: a padded shard's padding,
            after every real token, is masked already).

    Returns:
        Call: the tensors viewed as ``"bshd"`` and the rest of the call.

    Raises:
        InvalidArgument: no communicator (nothing to agree over: raised
            here, the same on every rank).  Everything else travels as
            ``Call.problem``.
    """
    (q, k, v), comm = comm_last(op, (q, k, v), comm, stacklevel=4, sharding=True)
    problem = None
    sharding = comm if isinstance(comm, Sharding) else None
    sdim = None
    if sharding is not None:
        comm = sharding.comm
        sdim = sharding.dim % 4 if -4 <= sharding.dim < 4 else sharding.dim  # of a 4-d q
        if layout is not None and layout != sharding.layout:
            problem = (f"layout {layout!r} contradicts the Sharding's layout {sharding.layout!r}; leave layout out "
                       "(the Sharding carries it)")
        layout = sharding.layout
        if sdim not in (1, 2) and problem is None:
            problem = f"the Sharding's sequence dim is {sharding.dim}; attention takes dim 1 ('bshd') or 2 ('bhsd')"
    if layout is None:
        layout = default_layout
    size = int(comm.size)
    fmt = qkv_format
    if not isinstance(fmt, str) or fmt not in FORMATS:
        problem = problem or f"qkv_format must be one of {FORMATS}, got {qkv_format!r}"
        fmt = "bshd"
    elif sharding is not None and problem is None and sdim != (1 if fmt == "bshd" else 2):
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
    if problem is None and causal is not True and cu_seqlens is None:
        problem = _unmasked_padding(k, v, size, 1 if fmt == "bshd" else 2)
    if fmt == "bhsd":
        q, k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in (q, k, v))
    if problem is None:
        problem = _shape_problem(q, k, v, fmt, size, cu_seqlens)
    return Call(q, k, v, comm, layout, fmt, problem)
