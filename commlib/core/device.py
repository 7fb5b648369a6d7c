"""Device and MPI capability detection: CUDA-awareness, ULFM, visible GPUs.

mpi4py has no CUDA-support query, so CUDA-awareness comes from, in order: the
``COMMLIB_CUDA_AWARE`` setting, ``MPIX_Query_cuda_support()`` looked up through
ctypes in the loaded MPI library (Open MPI, MPICH >= 4 export it), else False,
in which case device buffers are staged through host memory.
"""
from __future__ import annotations

import ctypes
import functools
import os

from .config import config

__all__ = ["cuda_aware", "mpi_library_path", "ulfm_available", "visible_gpus", "simulator_enabled"]


def simulator_enabled() -> bool:
    """True when numba's CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM=1``;
    :attr:`commlib.core.config.Config.cuda_simulator`, read at each call)."""
    return config.cuda_simulator


@functools.lru_cache(maxsize=None)
def mpi_library_path() -> str | None:
    """Path of the MPI shared library mpi4py loaded (from /proc/self/maps), or None."""
    from mpi4py import MPI  # noqa: F401,PLC0415 - make sure libmpi is loaded

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rsplit(None, 1)[-1]
                base = os.path.basename(path)
                if base.startswith(("libmpi.so", "libmpi_mpifh", "libmpich.so")) and os.path.isfile(path):
                    if base.startswith(("libmpi.so", "libmpich.so")):
                        return path
    except OSError:  # pragma: no cover - non-Linux
        pass
    return None


@functools.lru_cache(maxsize=None)
def _query_cuda_support() -> bool | None:
    path = mpi_library_path()
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path)
        fn = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return bool(fn())


def cuda_aware() -> bool:
    """Whether MPI may be handed device pointers directly.

    Returns:
        bool: from the ``COMMLIB_CUDA_AWARE`` setting, else the library's own
        ``MPIX_Query_cuda_support``, else False. Under the CUDA simulator it is
        always False (simulated device memory is not real device memory).
    """
    if simulator_enabled():
        return False
    if config.cuda_aware in ("1", "true", "yes", "on"):
        return True
    if config.cuda_aware in ("0", "false", "no", "off"):
        return False
    return bool(_query_cuda_support())


def cuda_support_query() -> bool | None:
    """Raw answer of ``MPIX_Query_cuda_support`` (None when not exported)."""
    return _query_cuda_support()


def ulfm_available() -> bool:
    """True when the MPI library implements ULFM (``MPIX_Comm_revoke`` etc.).

    mpi4py always defines ``Comm.Revoke``; on MPIs without ULFM it raises
    NotImplementedError, so probe the library for the symbol instead.
    """
    path = mpi_library_path()
    if not path:
        return False
    try:
        lib = ctypes.CDLL(path)
        lib.MPIX_Comm_revoke  # noqa: B018
        lib.MPIX_Comm_shrink  # noqa: B018
        return True
    except (OSError, AttributeError):
        return False


def visible_gpus() -> list[str]:
    """Names of the GPUs this process can see (empty without a GPU or driver)."""
    if simulator_enabled():
        return []
    try:
        from numba import cuda  # noqa: PLC0415

        if not cuda.is_available():
            return []
        return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in cuda.gpus]
    except Exception:
        return []
