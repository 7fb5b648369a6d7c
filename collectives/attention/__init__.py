"""Sequence-parallel attention over a :class:`commlib.Communicator`.

Exact attention for a sequence sharded across ranks, forward and backward,
on numpy or CuPy arrays, written only against the transport contract's
point-to-point calls, on the communicator's collectives transport with tags
from its allocator (:mod:`.transport`):

* :func:`ring_attention` / :func:`ring_attention_backward`: K/V shards travel
  around a ring with double buffering (Ring Attention, Liu et al. 2023), in the
  ``"contiguous"``, ``"striped"`` (Striped Attention, Brandon et al. 2023) or
  ``"zigzag"`` (ring-flash-attention) layout.
* :func:`ulysses_attention` / :func:`ulysses_attention_backward`: all-to-all
  from sequence shards to head shards (DeepSpeed-Ulysses, Jacobs et al. 2023).
* :func:`shard_sequence` / :func:`unshard_sequence`: between a global array
  and each rank's shard, with the position ids each rank holds.
* :func:`attention_forward` / :func:`attention_backward`: the same blocked
  kernels on one rank (the single-rank baseline).

Shapes: q ``(batch, seq_local, heads, head_dim)``, k and v
``(batch, seq_local, kv_heads, head_dim)`` with ``heads % kv_heads == 0``; lse
``(batch, heads, seq_local)``.  float16 / bfloat16 / float32 accumulate in
float32, float64 in float64.
"""
from .blocks import attention_backward, attention_forward, compute_dtype, get_array_module, tile_plan
from .layout import (LAYOUTS, Layout, layout_of, local_seq_len, sequence_positions, shard_sequence,
                     unshard_sequence)
from .ring import ring_attention, ring_attention_backward, ring_plan_work
from .ulysses import alltoall_pairwise, ulysses_attention, ulysses_attention_backward

__all__ = [
    "ring_attention",
    "ring_attention_backward",
    "ulysses_attention",
    "ulysses_attention_backward",
    "shard_sequence",
    "unshard_sequence",
    "sequence_positions",
    "local_seq_len",
    "LAYOUTS",
    "Layout",
    "layout_of",
    "attention_forward",
    "attention_backward",
    "ring_plan_work",
    "tile_plan",
    "alltoall_pairwise",
    "compute_dtype",
    "get_array_module",
]
