"""Collective algorithms over the transport contract, halo exchange, attention."""
from .halo import HaloExchange, HaloRequest

__all__ = ["HaloExchange", "HaloRequest"]
