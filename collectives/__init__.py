"""Collective algorithms over the transport contract, halo exchange, attention.

One algorithm per module (``allreduce_ring``, ``allreduce_recursive_doubling``,
``reduce_scatter_ring``, ``allgather_ring``, ``bcast_binomial``,
``alltoall_pairwise``, ``barrier``), written only against the transport's
point-to-point contract; ``halo`` (Cartesian ghost-cell exchange);
``attention`` (sequence-parallel ring / striped / zigzag / Ulysses attention);
``recovery`` (the one retry runner and the recovery policies' contract),
``ulfm`` (the ULFM policy: revoke, agree, shrink, retry) with its
``watchdog``, and ``ft`` (a communicator's call under its policy).
"""
from __future__ import annotations

import sys
import types

# Every name loads on first use (module ``__getattr__``, PEP 562): importing
# one light subpackage (``commlib.collectives.attention``: numpy only; the
# attention app's command line takes LAYOUTS from it) does not import the
# others (``halo`` loads the datatypes and numba).  No module here imports
# MPI; ``ft_mode``, ``ft_mode_info`` and ``bound_finalize_at_exit`` are the MPI
# process's (commlib.transports.mpi_process), still reachable here by name for
# code written against the older layout, and load mpi4py only when used.
#: public name -> the submodule that defines it
_LAZY = {
    **dict.fromkeys(("LAYOUTS", "local_seq_len", "ring_attention", "ring_attention_backward", "sequence_positions",
                     "shard_sequence", "ulysses_attention", "ulysses_attention_backward", "unshard_sequence"),
                    ".attention"),
    "allgather_ring": ".allgather_ring",
    "allreduce_recursive_doubling": ".allreduce_recursive_doubling",
    "allreduce_ring": ".allreduce_ring",
    "alltoall_pairwise": ".alltoall_pairwise",
    "barrier_dissemination": ".barrier",
    "bcast_binomial": ".bcast_binomial",
    **dict.fromkeys(("FaultTolerance", "recover"), ".ft"),
    **dict.fromkeys(("bound_finalize_at_exit", "ft_mode", "ft_mode_info"), "commlib.transports.mpi_process"),
    **dict.fromkeys(("HaloExchange", "HaloRequest"), ".halo"),
    **dict.fromkeys(("OPS", "Op", "get_op"), ".ops"),
    "reduce_scatter_ring": ".reduce_scatter_ring",
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


class _Package(types.ModuleType):
    """Keeps ``commlib.collectives.allreduce_ring`` (and the other algorithms
    named like their module) the function, as the eager imports did: importing
    the submodule (``from .allreduce_ring import ...`` anywhere) binds the
    module object on this package, which would shadow the lazy function."""

    def __setattr__(self, name, value):
        if (_LAZY.get(name) == f".{name}" and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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

