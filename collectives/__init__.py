"""Collective algorithms over the transport contract, halo exchange, attention.

One algorithm per module (``allreduce_ring``, ``allreduce_recursive_doubling``,
``reduce_scatter_ring``, ``allgather_ring``, ``bcast_binomial``,
``alltoall_pairwise``, ``barrier``), written only against the transport's
point-to-point contract; ``halo`` (Cartesian ghost-cell exchange);
``attention`` (sequence-parallel ring / striped / zigzag / Ulysses attention);
``ft`` (fault tolerance: ULFM revoke, agree, shrink, retry).
"""
from .attention import (
    LAYOUTS,
    local_seq_len,
    ring_attention,
    ring_attention_backward,
    sequence_positions,
    shard_sequence,
    ulysses_attention,
    ulysses_attention_backward,
    unshard_sequence,
)
from .allgather_ring import allgather_ring
from .allreduce_recursive_doubling import allreduce_recursive_doubling
from .allreduce_ring import allreduce_ring
from .alltoall_pairwise import alltoall_pairwise
from .barrier import barrier_dissemination
from .bcast_binomial import bcast_binomial
from .ft import FaultTolerance, bound_finalize_at_exit, ft_mode, ft_mode_info, recover
from .halo import HaloExchange, HaloRequest
from .ops import OPS, Op, get_op
from .reduce_scatter_ring import reduce_scatter_ring

__all__ = [
    "allreduce_ring",
    "allreduce_recursive_doubling",
    "reduce_scatter_ring",
    "allgather_ring",
    "bcast_binomial",
    "alltoall_pairwise",
    "barrier_dissemination",
    "OPS",
    "Op",
    "get_op",
    "HaloExchange",
    "HaloRequest",
    "LAYOUTS",
    "local_seq_len",
    "ring_attention",
    "ring_attention_backward",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_attention_backward",
    "unshard_sequence",
    "ft_mode",
    "ft_mode_info",
    "FaultTolerance",
    "recover",
    "bound_finalize_at_exit",
]

