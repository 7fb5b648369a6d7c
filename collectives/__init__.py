"""Collective algorithms over the transport contract, halo exchange, attention.

One algorithm per module, written only against the transport's point-to-point
contract, each module named like its function (import the function from its
module: ``from commlib.collectives.allreduce_ring import allreduce_ring``):
``allreduce_ring``, ``allreduce_recursive_doubling``, ``reduce_scatter_ring``,
``allgather_ring``, ``bcast_binomial``, ``alltoall_pairwise``, ``barrier``
(``barrier_dissemination``).  Beside them: ``engine`` and ``specs`` (the one
engine and its table of collective specifications), ``halo`` (Cartesian
ghost-cell exchange) and ``halo_node`` (the same through shared memory
on one node), ``attention`` (sequence-parallel ring / striped / zigzag
/ Ulysses attention), ``recovery`` (the one retry runner and the recovery
policies' contract), ``ulfm`` (the ULFM policy: revoke, agree, shrink, retry)
with its ``watchdog``, and ``ft`` (a communicator's call under its policy).

The names below load on first use (module ``__getattr__``, PEP 562): importing
one light subpackage (``commlib.collectives.attention``: numpy only; the
attention app's command line takes LAYOUTS from it) does not import the others
(``halo`` loads the datatypes and numba).  No module here imports MPI.
"""
from __future__ import annotations

#: public name -> the submodule that defines it
_LAZY = {
    **dict.fromkeys(("LAYOUTS", "local_seq_len", "ring_attention", "ring_attention_backward", "sequence_positions",
                     "shard_sequence", "ulysses_attention", "ulysses_attention_backward", "unshard_sequence"),
                    ".attention"),
    "barrier_dissemination": ".barrier",
    **dict.fromkeys(("FaultTolerance", "recover"), ".ft"),
    **dict.fromkeys(("HaloExchange", "HaloRequest"), ".halo"),
    "NodeHalo": ".halo_node",
    **dict.fromkeys(("OPS", "Op", "get_op"), ".ops"),
}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "barrier_dissemination",
    "OPS",
    "Op",
    "get_op",
    "HaloExchange",
    "HaloRequest",
    "NodeHalo",
    "LAYOUTS",
    "local_seq_len",
    "ring_attention",
    "ring_attention_backward",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_attention_backward",
    "unshard_sequence",
    "FaultTolerance",
    "recover",
]
