"""commlib: a CUDA-aware communication layer for Python HPC codes.

The user API: ``init``, the communicators, buffers, the resilient-step runner,
the error hierarchy and the numpy/CuPy sequence-parallel attention.

Quick start::

    import commlib
    comm = commlib.init()                 # Communicator over MPI.COMM_WORLD
    cart = comm.cart_create(dims=None, periods=(True, False))
    halo = commlib.collectives.HaloExchange(cart, (64, 64), width=1)

The layers (docs/architecture.md): ``commlib.transports`` (moving bytes),
``commlib.datatypes`` (non-contiguous layouts and pack kernels),
``commlib.collectives`` (algorithms, halo exchange, attention), ``commlib.apps``.
"""
from __future__ import annotations

__version__ = "0.1.0"

import importlib as _importlib
import importlib.util as _util

if _util.find_spec(f"{__name__}.transports") is None:
    # The repository's top-level folders become one package only when installed
    # (setup.py's package_dir); Python found this folder first because the
    # current directory is the checkout (``python -m`` puts it on sys.path).
    raise ImportError(
        f"commlib was imported from the source folder {__path__[0]!r}, which holds only the user-API layer; "
        "install it (`pip install .`) and run from outside the checkout, or with `python -P` "
        "(which keeps the current directory off sys.path)")

# ``import commlib`` stays light (the errors only): everything else loads on
# first use through the module ``__getattr__`` below (PEP 562), so a command
# line that refuses its arguments never pays for mpi4py.MPI (the MPI library),
# numba or CuPy.  ``commlib.init``, ``from commlib import Communicator`` etc.
# work as before.
from .core.errors import (
    AuthenticationError,
    BufferError,
    CommError,
    CommTimeout,
    DatatypeError,
    InvalidArgument,
    MessageSizeMismatch,
    ProcessFailed,
)

_ATTENTION = ("ring_attention", "ring_attention_backward", "ulysses_attention", "ulysses_attention_backward",
              "shard_sequence", "unshard_sequence")

#: public name -> the module (relative to this package) that defines it
_LAZY = {
    **dict.fromkeys(("Buffer", "as_buffer"), ".core.buffer"),
    **dict.fromkeys(("ANY_SOURCE", "ANY_TAG", "PROC_NULL", "CartCommunicator", "Communicator", "compute_dims",
                     "init"), ".communicator"),
    **dict.fromkeys(_ATTENTION, ".collectives"),
    **dict.fromkeys(("ResilientRunner", "Failure", "StateLost"), ".resilient"),
}
#: attribute -> submodule, imported on first use (``commlib.apps`` pulls in argparse, matplotlib)
_SUBMODULES = {"datatypes": ".datatypes", "transports": ".transports", "apps": ".apps",
               "collectives": ".collectives", "device": ".core.device", "config": ".core.config"}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if name in _SUBMODULES:
        return _importlib.import_module(_SUBMODULES[name], __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = [
    "init", "compute_dims", "Communicator", "CartCommunicator", "PROC_NULL", "ANY_SOURCE", "ANY_TAG",
    "Buffer", "as_buffer", "ResilientRunner", "Failure", "StateLost",
    "CommError", "InvalidArgument", "ProcessFailed", "CommTimeout", "DatatypeError", "BufferError",
    "AuthenticationError", "MessageSizeMismatch",
    *_ATTENTION,
]
