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
from .halo import HaloExchange, HaloRequest

__all__ = [
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
]


def __getattr__(name):
    if name == "ft_mode":  # lazily: ft pulls in the ULFM machinery
        from .ft import ft_mode

        return ft_mode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
