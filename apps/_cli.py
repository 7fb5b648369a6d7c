"""Command-line plumbing shared by the apps.

Light on purpose: a command line is parsed and checked before anything
imports mpi4py.MPI (loading the MPI library), numba or CuPy, so a refusal
costs only the interpreter's start.  The job's rank and size come from the
launcher's environment until MPI is up.
"""
from __future__ import annotations

import sys

from commlib.cli import RANK_VARS, SIZE_VARS, env_int, unwritable  # noqa: F401 (light: no MPI)
from commlib.cli import OneLineParser as _BaseParser

__all__ = ["OneLineParser", "world_rank", "world_size", "unwritable", "EXIT_REQUEUE", "STOP_SIGNALS", "ULFM_LAUNCH",
           "StopSignals"]

#: the exit status of a run that stopped on SIGUSR1 or SIGTERM after writing its checkpoint
#: (sysexits.h's EX_TEMPFAIL: try again later); the job scripts requeue the job on it
EXIT_REQUEUE = 75
#: the signals that ask a run with a checkpoint folder to checkpoint and stop: SIGUSR1 (``sbatch
#: --signal=B:USR1@SECONDS``, forwarded by the job script; ``scancel --signal=USR1``) and SIGTERM (what
#: Slurm sends at a preemption, a time limit or ``scancel``, and ``mpiexec`` on its own SIGTERM)
STOP_SIGNALS = ("SIGUSR1", "SIGTERM")
#: Open MPI's launch line that survives a rank's death (ULFM), the TCP BTL without RDMA put
ULFM_LAUNCH = ("mpiexec --with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum "
               "--prtemca state_base_error_non_zero_exit 0")


class OneLineParser(_BaseParser):
    """argparse, but a refusal is one line on stderr (``NAME: error: ...``),
    printed by rank 0 only (MPI's rank once MPI is up, else the launcher's),
    then ``SystemExit(2)``; every rank parses the same command line, so every
    rank exits alike, before MPI communicates.

    Args:
        name: the short name in the error line (``heat``, ``attention``).
        **kwargs: as for :class:`argparse.ArgumentParser`.
    """

    def __init__(self, name: str, **kwargs):
        super().__init__(name, **kwargs)

    def rank(self) -> int:
        return world_rank()


def _mpi_world():
    """mpi4py's COMM_WORLD when MPI is already initialized, else None (never
    imports mpi4py.MPI: that loads the MPI library)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi.COMM_WORLD
    except Exception:  # noqa: BLE001
        pass
    return None


def world_rank() -> int:
    """This process's rank in MPI's world: from MPI when it is initialized, else
    from the launcher's environment (0 without a launcher)."""
    world = _mpi_world()
    if world is not None:
        return world.Get_rank()
    rank = env_int(RANK_VARS)
    return 0 if rank is None else rank


def world_size() -> int | None:
    """The number of ranks in MPI's world: from MPI when it is initialized, else
    from the launcher's environment; None when neither tells (no launcher, a
    singleton of 1 rank, or one that names no size: check again once MPI is
    up)."""
    world = _mpi_world()
    if world is not None:
        return world.Get_size()
    return env_int(SIZE_VARS)


class StopSignals:
    """SIGUSR1 and SIGTERM (:data:`STOP_SIGNALS`) ask a run to stop at a step boundary.

    The handler only records the first signal; the run asks :meth:`agreed`
    at the end of each step, a collective, so every rank stops after the same
    step (the signal reaches the ranks at different moments), writes its
    checkpoint and exits :data:`EXIT_REQUEUE`.  Install it early (before the
    imports that take seconds): until then the signals end the process.
    """

    def __init__(self):
        self.received = 0
        self._old = {}

    def install(self) -> "StopSignals":
        import signal  # noqa: PLC0415

        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if not self.received:
            self.received = int(signum)

    def restore(self) -> None:
        """Give the signals back their handlers from before :meth:`install`."""
        import signal  # noqa: PLC0415

        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def agreed(self, comm) -> str | None:
        """The name of the signal (``"SIGUSR1"``) when any rank of ``comm`` received one, else None;
        the same on every rank (collective: one all-reduce of one number)."""
        import signal  # noqa: PLC0415

        import numpy as np  # noqa: PLC0415

        buf = np.array([self.received], dtype=np.int64)
        if comm.size > 1:
            comm.allreduce(buf, op="max")
        return signal.Signals(int(buf[0])).name if buf[0] else None


def init_comm(name: str, **kwargs):
    """``commlib.init(**kwargs)``, or ``SystemExit(2)`` after one line on stderr
    (``NAME: error: ...``, from rank 0) when it refuses the launch with
    :class:`commlib.InvalidArgument` (a task alone in a Slurm step of several
    under ``COMMLIB_SLURM_SINGLETON=error``: every task refuses alike)."""
    import commlib  # noqa: PLC0415

    try:
        return commlib.init(**kwargs)
    except commlib.InvalidArgument as exc:
        if exc.rank in (None, 0):
            print(f"{name}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        raise SystemExit(2) from None
