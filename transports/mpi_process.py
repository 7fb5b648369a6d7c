"""The MPI process's lifecycle, as fault tolerance needs it.

What the recovery policies (:mod:`commlib.collectives.recovery`,
:mod:`commlib.collectives.ulfm`) must know about the MPI process but, sitting
in the collectives layer, may not ask mpi4py themselves: which fault-tolerance
mode this run gets (:func:`ft_mode`), the thread level (the watchdog needs
``MPI_THREAD_MULTIPLE`` to revoke from its own thread), this process's
``COMM_WORLD`` rank (for the fail-stop line), and a bound on ``MPI_Finalize``
at exit after a failure (:func:`bound_finalize_at_exit`).  :data:`PROCESS`
hands these to a :class:`~commlib.collectives.recovery.FaultTolerance` as its
``process`` hooks (the communicator does it when it is made).
"""
from __future__ import annotations

import atexit
import math
import os
import signal
import sys

from mpi4py import MPI

from commlib.core.config import config
from commlib.core.device import ulfm_available

__all__ = ["ft_mode", "ft_mode_info", "bound_finalize_at_exit", "MPIProcess", "PROCESS"]


def _ompi_ft_enabled() -> bool:
    v = os.environ.get("OMPI_MCA_mpi_ft_enable", "")
    return v.strip().lower() in ("1", "true", "yes", "on")


def ft_mode() -> str:
    """Which fault-tolerance mode ``commlib.init(fault_tolerant=True)`` gets here.

    Returns:
        str: ``"ulfm"`` when the MPI library implements ULFM and it is switched on
        for this run (Open MPI 5 under ``mpiexec --with-ft ulfm``): failures are
        survived by revoke/agree/shrink/retry.  ``"timeout"`` otherwise: bounded
        waits, and a dead peer raises ``ProcessFailed``/``CommTimeout`` on every
        survivor.  ``COMMLIB_FT_MODE=ulfm|timeout`` overrides the detection.
    """
    forced = config.ft_mode
    if forced in ("ulfm", "timeout"):
        return forced
    if not ulfm_available():
        return "timeout"
    lib = MPI.Get_library_version()
    if "Open MPI" in lib:
        return "ulfm" if _ompi_ft_enabled() else "timeout"
    # MPICH exports MPIX_Comm_shrink but its ULFM needs hydra's
    # -disable-auto-cleanup and is experimental: use bounded errors.
    return "timeout"


def ft_mode_info() -> dict:
    """Details for ``commlib info``: ``{"mode", "ulfm_symbols", "ulfm_enabled", "library", "hint"}``."""
    mode = ft_mode()
    lib = MPI.Get_library_version().splitlines()[0].strip()
    info = {"mode": mode, "ulfm_symbols": ulfm_available(), "ulfm_enabled": _ompi_ft_enabled(), "library": lib}
    if mode == "ulfm":
        info["hint"] = "failures are survived: revoke, agree, shrink, retry"
    elif ulfm_available() and "Open MPI" in lib:
        info["hint"] = "launch with `mpiexec --with-ft ulfm --mca btl tcp,self` to survive failures"
    else:
        info["hint"] = "no ULFM: a dead peer raises ProcessFailed/CommTimeout within the timeout"
    return info


_watchdog_installed = False


def bound_finalize_at_exit(seconds: float | None = None) -> None:
    """Bound the time ``MPI_Finalize`` may take at interpreter exit.

    After a failure Open MPI 5's ``MPI_Finalize`` can spin forever in its PMIx
    fence waiting for the dead processes (open-mpi/ompi#11404, #9434; seen here
    in about one run in three with two failures), and without ULFM the finalize
    of a broken job can hang too.  This registers an atexit handler that flushes
    stdio and arms ``alarm(2)`` with the default SIGALRM action: mpi4py's
    finalizer (which runs after every atexit handler) still runs and usually
    completes at once; if it hangs, the kernel ends the process after
    ``seconds`` (default ``COMMLIB_FINALIZE_TIMEOUT``, 3 s), so ``mpiexec``
    returns within seconds.  ``seconds=0`` disables it.  Installed by the
    fault-tolerant collectives after the first failure.
    """
    global _watchdog_installed
    if seconds is None:
        seconds = config.finalize_timeout
    if _watchdog_installed or seconds <= 0 or not hasattr(signal, "alarm"):
        return
    _watchdog_installed = True

    def _arm():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, math.ceil(seconds)))

    atexit.register(_arm)


skip_finalize_at_exit = bound_finalize_at_exit  # former name


class MPIProcess:
    """The process hooks of :class:`~commlib.collectives.recovery.FaultTolerance` over MPI."""

    def thread_multiple(self) -> bool:
        """True when MPI was initialized with ``MPI_THREAD_MULTIPLE``."""
        return MPI.Query_thread() >= MPI.THREAD_MULTIPLE

    def world_rank(self):
        """This process's ``COMM_WORLD`` rank, or None outside ``MPI_Init``/``MPI_Finalize``."""
        try:
            return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else None
        except Exception:  # noqa: BLE001
            return None

    def bound_finalize(self) -> None:
        """:func:`bound_finalize_at_exit` with the configured bound."""
        bound_finalize_at_exit()


#: the hooks of this process
PROCESS = MPIProcess()
