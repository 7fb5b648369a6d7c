"""Fault tolerance for the collectives: revoke, agree, shrink, retry.

The protocol follows ULFM (User-Level Failure Mitigation; Bland, Bouteiller,
Herault, Bosilca & Dongarra, "Post-failure recovery of MPI communication
capability: design and rationale", IJHPCA 27(3):244-254, 2013), as shipped in
Open MPI 5 (``mpiexec --with-ft ulfm``):

1. every wait of an attempt is bounded (``timeout`` seconds); a rank that sees
   ``MPI_ERR_PROC_FAILED``, ``MPI_ERR_REVOKED`` or a timeout **revokes** the
   communicator (``MPIX_Comm_revoke``), which interrupts the survivors still
   blocked on live-but-waiting peers;
2. every survivor then calls ``MPIX_Comm_agree`` on a success flag (bitwise AND
   over the survivors, uniform even when processes fail during it), so a rank that
   finished its part never returns while another retries;
3. on failure the survivors ``MPIX_Comm_shrink`` to a communicator of the live
   ranks, restore their input buffers from a snapshot and **retry** the whole
   collective, so the result is the reduction over the survivors' inputs,
   bit-identical on every survivor (the algorithms have a fixed reduction order).

Without ULFM (MPICH, or Open MPI launched without ``--with-ft ulfm``) a dead peer
shows as a wait that does not end: every wait is bounded and every survivor
raises :class:`~commlib.errors.ProcessFailed` or
:class:`~commlib.errors.CommTimeout` within a bounded time, after which the
communicator is marked broken (later calls raise at once) and MPI_Finalize is
skipped at exit so the process cannot hang there.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from commlib.errors import CommError, CommTimeout, InvalidArgument, ProcessFailed

__all__ = ["ft_mode", "ft_mode_info", "FaultTolerance", "skip_finalize_at_exit", "ON_FAILURE"]

ON_FAILURE = ("shrink", "raise")

# agreement flag bits (ANDed across survivors by MPIX_Comm_agree)
_OK = 1          # no failure seen
_NO_BADARG = 2   # no InvalidArgument
_NO_ERROR = 4    # no other exception


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
    forced = os.environ.get("COMMLIB_FT_MODE", "").strip().lower()
    if forced in ("ulfm", "timeout"):
        return forced
    from commlib.device import ulfm_available  # noqa: PLC0415

    if not ulfm_available():
        return "timeout"
    from mpi4py import MPI  # noqa: PLC0415

    lib = MPI.Get_library_version()
    if "Open MPI" in lib:
        return "ulfm" if _ompi_ft_enabled() else "timeout"
    # MPICH exports MPIX_Comm_shrink but its ULFM needs hydra's
    # -disable-auto-cleanup and is experimental: use bounded errors.
    return "timeout"


def ft_mode_info() -> dict:
    """Details for ``commlib info``: ``{"mode", "ulfm_symbols", "ulfm_enabled", "library", "hint"}``."""
    from mpi4py import MPI  # noqa: PLC0415

    from commlib.device import ulfm_available  # noqa: PLC0415

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


_skip_installed = False
_exit_code = [0]


def skip_finalize_at_exit() -> None:
    """Make the interpreter leave with ``os._exit`` after the other atexit
    handlers, skipping mpi4py's ``MPI_Finalize`` (which waits for a dead peer
    when the MPI has no ULFM).  Exit status: 1 after an uncaught exception, the
    ``sys.exit`` code otherwise (0)."""
    global _skip_installed
    if _skip_installed:
        return
    _skip_installed = True
    prev_hook = sys.excepthook

    def hook(tp, val, tb):
        _exit_code[0] = 1
        prev_hook(tp, val, tb)

    sys.excepthook = hook
    prev_exit = sys.exit

    def _exit(code=0):
        _exit_code[0] = code if isinstance(code, int) else (0 if code is None else 1)
        prev_exit(code)

    sys.exit = _exit

    def _leave():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(_exit_code[0])

    # registered after mpi4py's finalizer, so it runs before it (LIFO)
    atexit.register(_leave)


@dataclass
class FaultTolerance:
    """Fault-tolerance state of one :class:`~commlib.Communicator`.

    Attributes:
        mode: ``"ulfm"`` or ``"timeout"`` (see :func:`ft_mode`).
        on_failure: ``"shrink"`` (recover and return the result over the
            survivors) or ``"raise"`` (recover the communicator, then raise
            :class:`ProcessFailed` listing the failed ranks on every survivor).
        timeout: seconds each wait may take before it counts as a failure.
        callbacks: ``fn(failed, comm)`` called on every survivor after a shrink,
            with ``failed`` the lost ranks numbered as in ``COMM_WORLD``.
        failed: every ``COMM_WORLD`` rank lost so far (sorted tuple).
        broken: set in ``"timeout"`` mode once a failure was raised.
        recoveries: list of ``(seconds, failed_world_ranks)`` per recovery.
    """

    mode: str
    on_failure: str = "shrink"
    timeout: float = 60.0
    callbacks: list = field(default_factory=list)
    failed: tuple = ()
    broken: str | None = None
    recoveries: list = field(default_factory=list)

    def __post_init__(self):
        if self.on_failure not in ON_FAILURE:
            raise InvalidArgument(f"on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}", op="init")
        if not self.timeout or self.timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {self.timeout!r}", op="init")
        if self.mode not in ("ulfm", "timeout"):
            raise InvalidArgument(f"unknown fault-tolerance mode {self.mode!r}", op="init")


def _is_failure(exc: BaseException) -> bool:
    from commlib.transports.failures import is_process_failure  # noqa: PLC0415

    return is_process_failure(exc)


def run_collective(comm, opname: str, attempt: Callable, restore: Callable | None = None):
    """Run one collective on ``comm``, recovering from failures in FT mode.

    Args:
        comm: the :class:`~commlib.Communicator`.
        opname: operation name for errors (``"allreduce"``...).
        attempt: ``attempt(transport, timeout, survivors)`` runs the whole
            collective once and returns its result; ``survivors`` lists the
            ranks of the call's original communicator still alive, in the order
            of the current one (``range(size)`` before any failure).
        restore: called before each retry to restore the input buffers.

    Returns:
        whatever ``attempt`` returns.

    Raises:
        ProcessFailed: ``on_failure="raise"`` (after shrinking), or ``"timeout"`` mode.
        CommTimeout: a wait ran out of time in ``"timeout"`` mode.
        InvalidArgument: inconsistent arguments (on every rank).
    """
    ft: FaultTolerance | None = comm._ft
    if ft is None:
        return attempt(comm._coll_transport(), None, list(range(comm.size)))
    if ft.broken:
        raise ProcessFailed(f"communicator unusable after an earlier failure ({ft.broken})",
                            failed=ft.failed, rank=comm.rank, op=opname)
    if ft.mode == "timeout":
        tp = comm._coll_transport()
        try:
            return attempt(tp, ft.timeout, list(range(comm.size)))
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, InvalidArgument) or not _is_failure(exc):
                raise
            from commlib.transports.failures import mpi_failed_ranks, to_comm_error  # noqa: PLC0415

            err = to_comm_error(exc, rank=comm.rank, op=opname, failed=mpi_failed_ranks(tp.comm))
            ft.broken = str(err)
            skip_finalize_at_exit()
            raise err from (exc if err is not exc else None)

    from mpi4py import MPI  # noqa: PLC0415

    call_group = comm._coll_transport().comm.Get_group()
    survivors = list(range(comm.size))
    t_fail = None
    try:
        while True:
            tp = comm._coll_transport()
            flag = _OK | _NO_BADARG | _NO_ERROR
            result = None
            err: BaseException | None = None
            try:
                result = attempt(tp, ft.timeout, survivors)
            except InvalidArgument as exc:
                flag &= ~_NO_BADARG
                err = exc
            except Exception as exc:  # noqa: BLE001
                if _is_failure(exc):
                    flag &= ~_OK
                    if t_fail is None:
                        t_fail = time.monotonic()
                    try:
                        tp.comm.Revoke()
                    except Exception:  # noqa: BLE001
                        pass
                else:
                    flag &= ~_NO_ERROR
                    err = exc
            try:
                agreed = tp.comm.Agree(flag)
            except MPI.Exception:
                # a failure not yet acknowledged: uniform across survivors
                agreed = flag & ~_OK
                if t_fail is None:
                    t_fail = time.monotonic()
                try:
                    tp.comm.Ack_failed()
                except Exception:  # noqa: BLE001
                    pass
            if agreed & _OK:
                if err is not None:
                    raise err
                if not agreed & _NO_BADARG:
                    raise InvalidArgument("another rank passed invalid arguments", rank=comm.rank, op=opname)
                if not agreed & _NO_ERROR:
                    raise CommError("another rank raised an error in the collective", rank=comm.rank, op=opname)
                if t_fail is not None:
                    ft.recoveries.append((time.monotonic() - t_fail, ft.failed))
                return result
            # --- recover: shrink and retry
            lost_world, survivors = comm._shrink(tp, call_group)
            if restore is not None:
                restore()
            if lost_world:
                if ft.on_failure == "raise":
                    raise ProcessFailed(f"rank(s) {list(lost_world)} of COMM_WORLD failed; communicator shrunk "
                                        f"to {comm.size} ranks", failed=lost_world, rank=comm.rank, op=opname)
    finally:
        try:
            call_group.Free()
        except Exception:  # noqa: BLE001
            pass
