"""commlib: a CUDA-aware communication layer for Python HPC codes.

Quick start::

    import commlib
    comm = commlib.init()                 # Communicator over MPI.COMM_WORLD
    cart = comm.cart_create(dims=None, periods=(True, False))
    halo = commlib.collectives.HaloExchange(cart, (64, 64), width=1)

See ``DESIGN.md`` for the layers: ``commlib.transports`` (moving bytes),
``commlib.datatypes`` (non-contiguous layouts and pack kernels),
``commlib.collectives`` (algorithms, halo exchange, attention), ``commlib.apps``.
"""
from __future__ import annotations

import os as _os

# In a source checkout the layers are sibling folders of this one (setup.py maps
# them under ``commlib`` with package_dir when installed).  Extending __path__
# makes ``commlib.datatypes`` etc. importable from the checkout too, e.g. when
# ``python -m pytest`` puts the repository root first on sys.path.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if _os.path.isfile(_os.path.join(_root, "setup.py")) and _os.path.isfile(
    _os.path.join(_root, "transports", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    AuthenticationError,
    BufferError,
    CommError,
    CommTimeout,
    DatatypeError,
    InvalidArgument,
    ProcessFailed,
)
from .buffer import Buffer, as_buffer  # noqa: E402
from .communicator import (  # noqa: E402
    ANY_SOURCE,
    ANY_TAG,
    PROC_NULL,
    CartCommunicator,
    Communicator,
    init,
)


_ATTENTION = ("ring_attention", "ring_attention_backward", "ulysses_attention", "ulysses_attention_backward",
              "shard_sequence", "unshard_sequence")


def __getattr__(name):  # lazy layers: ``commlib.collectives`` etc. on first use
    import importlib

    if name in _ATTENTION:
        return getattr(importlib.import_module(f"{__name__}.collectives"), name)
    if name in ("collectives", "datatypes", "transports", "apps", "device", "config"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "init", "Communicator", "CartCommunicator", "PROC_NULL", "ANY_SOURCE", "ANY_TAG",
    "Buffer", "as_buffer",
    "CommError", "InvalidArgument", "ProcessFailed", "CommTimeout", "DatatypeError", "BufferError",
    "AuthenticationError",
    *_ATTENTION,
]
