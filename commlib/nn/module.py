"""A torch module a model swaps in for its attention call.

``SequenceParallelAttention`` holds the communicator and the choice of
algorithm; its ``forward(q, k, v, cu_seqlens=None)`` takes this rank's
sequence shard of the projected queries, keys and values and returns this
rank's shard of the attention output, differentiable like
:func:`torch.nn.functional.scaled_dot_product_attention`::

    sp = commlib.nn.Sharding(comm, "zigzag")                  # the layout, said once
    attn = SequenceParallelAttention(sp, kind="hybrid", ulysses_degree=2)
    q_local = sp.shard(q)                                     # or shard the token ids once
    out_local = attn(q_local, k_local, v_local)
    out = sp.unshard(out_local)                               # if the global output is needed

Kinds:

* ``"ring"``: ring attention (Liu et al. 2023, arXiv:2310.01889), any layout.
* ``"bidirectional"``: the ring with K/V travelling both ways.
* ``"ulysses"``: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509);
  heads divisible by the number of ranks.  Any layout: shards in a layout
  other than ``"contiguous"`` are put in natural order after the all-to-all.
* ``"hybrid"``: USP (Fang & Zhao 2024, arXiv:2405.07719), Ulysses inside
  groups of ``ulysses_degree`` ranks and the ring across them.
"""
from __future__ import annotations

import numpy as np
import torch

from commlib.collectives.attention.layout import layout_of
from commlib.collectives.attention.spec import FORMATS
from commlib.core.errors import InvalidArgument

from ._check import timeout_of

from .hybrid import hybrid_attention
from .ring import ring_attention
from .ulysses import ulysses_attention
from .window import window_of
from .shard import Sharding
from commlib.collectives.attention.common import is_comm

__all__ = ["SequenceParallelAttention", "KINDS"]

KINDS = ("ring", "bidirectional", "ulysses", "hybrid")


class SequenceParallelAttention(torch.nn.Module):
    """Exact sequence-parallel attention as a module (no parameters).

    Args:
        comm: the :class:`commlib.Communicator` the sequence is sharded
            over, or a :class:`commlib.nn.Sharding` (the recommended path: it
            carries the layout its ``shard``/``unshard`` use).
        kind: ``"ring"``, ``"bidirectional"``, ``"ulysses"`` or ``"hybrid"``.
        layout: how the sequence is sharded (``"contiguous"``, ``"striped"``,
            ``"zigzag"``); default the Sharding's, else ``"zigzag"``; shard
            inputs in the same layout (a tensor
            ``commlib.nn.shard_sequence`` cut in another layout is refused).
        causal: mask later global positions.
        ulysses_degree: ``hybrid``: the Ulysses group size (required, a
            divisor of ``comm.size``); ``ulysses``: None or ``comm.size``;
            other kinds: None or 1.
        softmax_scale: score scale (default ``head_dim ** -0.5``).
        timeout: the deadline of each attention call (forward, and backward
            apart), in seconds (None: no limit).
        window: optional sliding window ``(left, right)`` (FlashAttention-2's
            ``window_size``, -1 unbounded; Longformer/Mistral local
            attention): kinds ``"ring"`` and ``"bidirectional"``, a halo
            exchange bounded by the window (:mod:`commlib.nn.window`);
            ``"hybrid"``, the halo across the groups; ``"ulysses"``, a mask
            on the local attention (no bytes or work saved).
        qkv_format: ``"bshd"`` (``(batch, seq, heads, head_dim)``, default)
            or ``"bhsd"`` (SDPA's ``(batch, heads, seq, head_dim)``): the
            order of the forward's q, k, v and of its output.

    Raises:
        InvalidArgument: at construction, for an unknown kind or layout, a
            non-bool ``causal``, a ``ulysses_degree`` the kind cannot use, or
            a ``timeout`` that is not None or a finite number > 0, or a
            ``window`` that is not None or a pair of ints >= -1, an unknown
            ``qkv_format``, a ``layout`` that contradicts the Sharding's, or
            a ``comm`` that is not a communicator.
    """

    def __init__(self, comm, kind: str = "ring", layout: str | None = None, causal: bool = True,
                 ulysses_degree: int | None = None, softmax_scale=None, timeout: float | None = None,
                 window=None, qkv_format: str = "bshd"):
        super().__init__()
        op = "SequenceParallelAttention"
        if isinstance(comm, Sharding):
            if layout is not None and layout != comm.layout:
                raise InvalidArgument(f"layout {layout!r} contradicts the Sharding's layout {comm.layout!r}; leave "
                                      "layout out (the Sharding carries it)", rank=comm.rank, op=op)
            comm, layout = comm.comm, comm.layout
        elif layout is None:
            layout = "zigzag"
        if not is_comm(comm):
            raise InvalidArgument(f"comm must be a commlib.Communicator or a commlib.nn.Sharding, got "
                                  f"{type(comm).__name__}", op=op)
        rank, size = int(comm.rank), int(comm.size)

        def bad(msg):
            return InvalidArgument(msg, rank=rank, op=op)

        if not isinstance(qkv_format, str) or qkv_format not in FORMATS:
            raise bad(f"qkv_format must be one of {FORMATS}, got {qkv_format!r}")

        if not isinstance(kind, str) or kind not in KINDS:
            raise bad(f"kind {kind!r} is not one of {KINDS}")
        layout = layout_of(layout, rank=rank, op=op)
        if not isinstance(causal, (bool, np.bool_)):
            raise bad(f"causal must be a bool, got {causal!r}")
        if ulysses_degree is not None and (isinstance(ulysses_degree, bool)
                                           or not isinstance(ulysses_degree, (int, np.integer))):
            raise bad(f"ulysses_degree must be an int or None, got {ulysses_degree!r}")
        if kind == "hybrid":
            if ulysses_degree is None or ulysses_degree < 1 or size % ulysses_degree:
                raise bad(f"kind 'hybrid' needs ulysses_degree, a positive divisor of the {size} ranks, "
                          f"got {ulysses_degree!r}")
        elif kind == "ulysses":
            if ulysses_degree not in (None, size):
                raise bad(f"kind 'ulysses' uses all {size} ranks; got ulysses_degree {ulysses_degree} "
                          "(use kind='hybrid')")
            ulysses_degree = size
        elif ulysses_degree not in (None, 1):
            raise bad(f"kind {kind!r} takes no ulysses_degree (got {ulysses_degree}); use kind='hybrid'")
        timeout = timeout_of(timeout, bad)
        window = window_of(window, bad)
        self.window = window
        self.comm = comm
        self.kind = kind
        self.layout = layout
        self.causal = bool(causal)
        self.ulysses_degree = None if ulysses_degree is None else int(ulysses_degree)
        self.softmax_scale = softmax_scale
        self.timeout = timeout
        self.qkv_format = qkv_format

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None, *, attn_mask=None,
                dropout_p=0.0, is_causal=None, scale=None, enable_gqa=None) -> torch.Tensor:
        """Attention of this rank's shard.

        Args:
            q: ``(batch, seq_local, heads, head_dim)`` (``qkv_format``
                ``"bhsd"``: ``(batch, heads, seq_local, head_dim)``), this
                rank's ``layout`` shard; k, v: the same with ``kv_heads``.
            cu_seqlens: optional global document boundaries ``[0, ..., seq_len]``
                (int tensor or sequence, the same on every rank).
            attn_mask, dropout_p, is_causal, scale, enable_gqa: the keywords
                of :func:`torch.nn.functional.scaled_dot_product_attention`,
                as :func:`commlib.nn.ring.ring_attention` takes them:
                ``attn_mask`` only None, ``dropout_p`` only 0;
                ``is_causal=True`` makes a module built with ``causal=False``
                causal for this call, ``is_causal=False`` on a causal module
                is refused (build it with ``causal=False``); ``scale`` only
                when the module has no ``softmax_scale``.

        Under ``torch.autocast`` the inputs are cast as SDPA's are (float32
        and float16 to the autocast dtype, float64 unchanged) and the output
        is in that dtype; gradients come back in the inputs' dtypes.

        Returns:
            torch.Tensor: ``out`` like ``q``, in ``qkv_format`` (under autocast: the autocast dtype).

        Raises:
            InvalidArgument, CommTimeout, CommError: as the function of the kind.
        """
        kw = dict(causal=self.causal, softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens, timeout=self.timeout,
                  attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                  qkv_format=self.qkv_format)
        if self.kind in ("ring", "bidirectional"):
            return ring_attention(q, k, v, self.comm, layout=self.layout, bidirectional=self.kind == "bidirectional",
                                  window=self.window, **kw)
        if self.kind == "ulysses":  # every rank of the communicator *now* (a fault-tolerant one may have shrunk)
            return ulysses_attention(q, k, v, self.comm, layout=self.layout, window=self.window, **kw)
        return hybrid_attention(q, k, v, self.comm, self.ulysses_degree, layout=self.layout, window=self.window,
                                **kw)

    def extra_repr(self) -> str:
        deg = f", ulysses_degree={self.ulysses_degree}" if self.kind == "hybrid" else ""
        win = "" if self.window is None else f", window={self.window}"
        win += "" if self.qkv_format == "bshd" else f", qkv_format={self.qkv_format!r}"
        return f"kind={self.kind!r}, layout={self.layout!r}, causal={self.causal}{deg}{win}, size={self.comm.size}"
