"""commlib: a CUDA-aware communication layer for Python HPC codes.

Quick start::

    import commlib
    comm = commlib.init()                 # Communicator over MPI.COMM_WORLD
    cart = comm.cart_create(dims=None, periods=(True, False))
    halo = commlib.collectives.HaloExchange(cart, (64, 64), width=1)

See docs/ARCHITECTURE.md for the layers: ``commlib.transports`` (moving bytes),
``commlib.datatypes`` (non-contiguous layouts and pack kernels),
``commlib.collectives`` (algorithms, halo exchange, attention), ``commlib.apps``.
"""
from __future__ import annotations

__version__ = "0.1.0"

import importlib.util as _util

if _util.find_spec(f"{__name__}.transports") is None:
    # The repository's top-level folders become one package only when installed
    # (setup.py's package_dir); Python found this folder first because the
    # current directory is the checkout (``python -m`` puts it on sys.path).
    raise ImportError(
        f"commlib was imported from the source folder {__path__[0]!r}, which holds only the user-API layer; "
        "install it (`pip install .`) and run from outside the checkout, or with `python -P` "
        "(which keeps the current directory off sys.path)")

from .core.errors import (
    AuthenticationError,
    BufferError,
    CommError,
    CommTimeout,
    DatatypeError,
    InvalidArgument,
    ProcessFailed,
)
from .core.buffer import Buffer, as_buffer
from .communicator import (
    ANY_SOURCE,
    ANY_TAG,
    PROC_NULL,
    CartCommunicator,
    Communicator,
    compute_dims,
    init,
)


from .collectives import (
    ring_attention,
    ring_attention_backward,
    shard_sequence,
    ulysses_attention,
    ulysses_attention_backward,
    unshard_sequence,
)

_ATTENTION = ("ring_attention", "ring_attention_backward", "ulysses_attention", "ulysses_attention_backward",
              "shard_sequence", "unshard_sequence")


def __getattr__(name):  # ``commlib.apps`` etc. on first use (apps pull in argparse, matplotlib)
    import importlib

    if name in ("datatypes", "transports", "apps", "collectives"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("device", "config"):
        return importlib.import_module(f"{__name__}.core.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "init", "compute_dims", "Communicator", "CartCommunicator", "PROC_NULL", "ANY_SOURCE", "ANY_TAG",
    "Buffer", "as_buffer",
    "CommError", "InvalidArgument", "ProcessFailed", "CommTimeout", "DatatypeError", "BufferError",
    "AuthenticationError",
    *_ATTENTION,
]
