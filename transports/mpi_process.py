"""The MPI process's lifecycle, as fault tolerance needs it.

What the recovery policies (:mod:`commlib.collectives.recovery`,
:mod:`commlib.collectives.ulfm`) must know about the MPI process but, sitting
in the collectives layer, may not ask mpi4py themselves: which fault-tolerance
mode this run gets (:func:`ft_mode`), the thread level (the watchdog needs
``MPI_THREAD_MULTIPLE`` to revoke from its own thread), this process's
``COMM_WORLD`` rank (for the fail-stop line), a bound on ``MPI_Finalize``
at exit after a failure (:func:`bound_finalize_at_exit`), and whether Open
MPI's TCP BTL does RDMA in this job (:func:`tcp_rdma_info`: under ULFM it
should not, docs/faults-and-security.md, "The Open MPI defect and its flag").  :data:`PROCESS`
hands these to a :class:`~commlib.collectives.recovery.FaultTolerance` as its
``process`` hooks (the communicator does it when it is made).
"""
from __future__ import annotations

import atexit
import ctypes
import math
import os
import signal
import sys
import warnings

from mpi4py import MPI

from commlib.core.config import config
from commlib.core.device import mpi_library_path, ulfm_available

__all__ = ["ft_mode", "ft_mode_info", "tcp_rdma_info", "tcp_flags_text", "warn_tcp_rdma", "TCP_FLAGS_WITHOUT_PUT",
           "bound_finalize_at_exit", "slurm_srun_mpi", "slurm_singleton", "check_slurm_singleton", "MPIProcess",
           "PROCESS"]

#: Open MPI's TCP BTL flags without RDMA (its default is
#: ``send,put,inplace,need-ack,need-csum,hetero-rdma``): large messages go as
#: pipelined sends and ob1 sends no FIN.  Fault-tolerant launches pass
#: ``--mca btl_tcp_flags send,inplace,need-ack,need-csum``: with RDMA put on, a
#: rank's death under ULFM cost a second, healthy rank in 10 of 30 soak runs (its
#: TCP BTL wedged in ob1's FIN path), without it in 0 of 100 (docs/faults-and-security.md,
#: "The put-less TCP BTL").
TCP_FLAGS_WITHOUT_PUT = "send,inplace,need-ack,need-csum"
_BTL_FLAG_PUT, _BTL_FLAG_GET = 0x2, 0x4  # MCA_BTL_FLAGS_PUT / _GET (ompi_info --param btl tcp --level 9)
_BTL_FLAG_NAMES = {0x1: "send", 0x2: "put", 0x4: "get", 0x8: "inplace", 0x10: "need-ack", 0x20: "need-csum",
                   0x100: "hetero-rdma", 0x200: "failover", 0x4000: "signaled", 0x8000: "atomics"}


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
    """Details for ``commlib info``: ``{"mode", "ulfm_symbols", "ulfm_enabled", "library", "hint",
    "tcp_rdma"}`` (``tcp_rdma``: :func:`tcp_rdma_info`, Open MPI only)."""
    mode = ft_mode()
    lib = MPI.Get_library_version().splitlines()[0].strip()
    info = {"mode": mode, "ulfm_symbols": ulfm_available(), "ulfm_enabled": _ompi_ft_enabled(), "library": lib}
    if "Open MPI" in lib:
        info["tcp_rdma"] = tcp_rdma_info()
    if mode == "ulfm":
        info["hint"] = "failures are survived: revoke, agree, shrink, retry"
        if info.get("tcp_rdma", {}).get("rdma"):
            info["hint"] += (f"; but the TCP BTL does RDMA put, so a death can wedge a healthy rank:"
                             f" add `--mca btl_tcp_flags {TCP_FLAGS_WITHOUT_PUT}`")
    elif ulfm_available() and "Open MPI" in lib:
        info["hint"] = ("launch with `mpiexec --with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags "
                        f"{TCP_FLAGS_WITHOUT_PUT} --prtemca state_base_error_non_zero_exit 0` to survive failures")
    else:
        info["hint"] = "no ULFM: a dead peer raises ProcessFailed/CommTimeout within the timeout"
    return info


def _tcp_flags_rdma(value) -> bool:
    """True when a ``btl_tcp_flags`` value (an integer, or a comma list of
    names and numbers, as ``--mca`` takes it) has RDMA put or get."""
    if isinstance(value, int):
        return bool(value & (_BTL_FLAG_PUT | _BTL_FLAG_GET))
    for tok in str(value).split(","):
        tok = tok.strip().lower()
        if tok in ("put", "get"):
            return True
        try:
            if int(tok, 0) & (_BTL_FLAG_PUT | _BTL_FLAG_GET):
                return True
        except ValueError:
            pass
    return False


def tcp_flags_text(value) -> str:
    """A ``btl_tcp_flags`` value as ``--mca`` would spell it (an MPI_T integer
    decoded into names; a string as given; None: Open MPI's default)."""
    if value is None:
        return "default (send,put,inplace,need-ack,need-csum,hetero-rdma)"
    if isinstance(value, int):
        names = [n for bit, n in _BTL_FLAG_NAMES.items() if value & bit]
        rest = value & ~sum(_BTL_FLAG_NAMES)
        return ",".join(names + ([hex(rest)] if rest else []))
    return str(value)


def _mpi_t_read(names) -> dict:
    """Values of Open MPI control variables ``names`` in this process, through
    MPI_T (ctypes; mpi4py has no MPI_T): an ``int`` for integer ones, ``str``
    for strings, absent when not registered here (the TCP BTL's variables exist
    only when that component was opened).  Raises OSError/AttributeError when
    MPI_T cannot be used."""
    path = mpi_library_path()
    if not path:
        raise OSError("libmpi not found")
    lib = ctypes.CDLL(path)
    provided = ctypes.c_int()
    if lib.MPI_T_init_thread(MPI.THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
        raise OSError("MPI_T_init_thread failed")
    out = {}
    try:
        for name in names:
            idx, count, handle = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
            if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(idx)) != 0:
                continue
            if lib.MPI_T_cvar_handle_alloc(idx, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
                continue
            try:
                buf = ctypes.create_string_buffer(max(64, count.value + 8))
                if lib.MPI_T_cvar_read(handle, buf) == 0:
                    if count.value == 1:  # btl_tcp_flags: an unsigned int
                        out[name] = ctypes.c_uint.from_buffer(buf).value
                    else:
                        out[name] = buf.value.decode(errors="replace")
            finally:
                lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    finally:
        lib.MPI_T_finalize()
    return out


def _tcp_btl_selected(btl) -> bool:
    """Whether a ``btl`` MCA value (None: Open MPI's default) admits the TCP BTL."""
    if btl is None or not btl.strip():
        return True
    btl = btl.strip()
    names = {t.strip() for t in btl.lstrip("^").split(",")}
    return ("tcp" not in names) if btl.startswith("^") else ("tcp" in names)


def tcp_rdma_info() -> dict:
    """Whether this job's Open MPI TCP BTL does RDMA (put or get), which it
    should not under ULFM (:data:`TCP_FLAGS_WITHOUT_PUT`).

    Read in the running process through MPI_T (``btl_tcp_flags`` as Open MPI
    holds it: the launch's ``--mca``, ``OMPI_MCA_*`` variables and parameter
    files alike), else from ``OMPI_MCA_btl_tcp_flags`` / ``OMPI_MCA_btl`` in
    the environment (what ``mpiexec --mca`` sets).

    Returns:
        dict: ``{"tcp_btl": bool, "btl_tcp_flags": value or None (Open MPI's
        default), "rdma": bool or None, "source": "MPI_T" | "environment"}``;
        ``rdma`` is None where it does not apply (not Open MPI, or no TCP BTL).
    """
    if "Open MPI" not in MPI.Get_library_version():
        return {"tcp_btl": False, "btl_tcp_flags": None, "rdma": None, "source": None}
    try:
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise OSError("MPI not initialized")
        got = _mpi_t_read(["btl_tcp_flags"])
        tcp, flags, source = "btl_tcp_flags" in got, got.get("btl_tcp_flags"), "MPI_T"
    except (OSError, AttributeError):
        flags = os.environ.get("OMPI_MCA_btl_tcp_flags")
        tcp, source = _tcp_btl_selected(os.environ.get("OMPI_MCA_btl")), "environment"
    rdma = (True if flags is None else _tcp_flags_rdma(flags)) if tcp else None
    return {"tcp_btl": tcp, "btl_tcp_flags": flags, "rdma": rdma, "source": source}


_checked_tcp_rdma = False


def warn_tcp_rdma(stacklevel: int = 2) -> str | None:
    """Warn once per process (``COMM_WORLD`` rank 0 only) when this is Open MPI
    in ULFM mode with the TCP BTL's RDMA on; returns the message (None: fine,
    or already warned).  ``commlib.init(fault_tolerant=True)`` calls it."""
    global _checked_tcp_rdma
    if _checked_tcp_rdma or ft_mode() != "ulfm" or not _ompi_ft_enabled():
        return None
    _checked_tcp_rdma = True  # once per process, warned or not
    try:
        if MPI.COMM_WORLD.Get_rank() != 0:
            return None
        info = tcp_rdma_info()
        if not info["rdma"]:
            return None
    except Exception:  # noqa: BLE001 - a check, never a reason to fail init
        return None
    flags = tcp_flags_text(info["btl_tcp_flags"])
    msg = (f"commlib: Open MPI's TCP BTL does RDMA put under ULFM (btl_tcp_flags {flags}):"
           f" a rank's death can wedge a healthy one, which the watchdog then fail-stops; launch with"
           f" `--mca btl_tcp_flags {TCP_FLAGS_WITHOUT_PUT}` (docs/faults-and-security.md)")
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)
    return msg


def slurm_srun_mpi(lib: str | None = None) -> str:
    """The ``srun --mpi=`` value that gives this MPI library (``lib``: its
    ``MPI_Get_library_version``, default this process's) one world: ``pmix`` for
    Open MPI, ``pmi2`` for MPICH and its derivatives; ``pmix or pmi2`` for others."""
    lib = MPI.Get_library_version() if lib is None else lib
    if "Open MPI" in lib:
        return "pmix"
    if any(name in lib for name in ("MPICH", "MVAPICH", "Intel(R) MPI", "Cray MPI")):
        return "pmi2"
    return "pmix or pmi2 (srun --mpi=list)"


def _env_count(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def slurm_singleton(world_size: int | None = None) -> str | None:
    """The line to say when this process is an MPI singleton inside a Slurm step of several tasks,
    else None.

    ``srun`` with the wrong ``--mpi=`` (or ``--mpi=none``) starts every task as its own MPI
    world of size 1, and each runs the whole job alone, exiting 0.  The step's task count is
    ``SLURM_STEP_NUM_TASKS`` (``SLURM_NTASKS`` inside a step that lacks it); a batch script's own
    process (no step) and a launcher that asked for one rank (``mpiexec -n 1``:
    ``OMPI_COMM_WORLD_SIZE`` or hydra's ``PMI_SIZE`` is 1) are not singletons by mistake.
    """
    size = MPI.COMM_WORLD.Get_size() if world_size is None else world_size
    if size != 1:
        return None
    tasks = _env_count("SLURM_STEP_NUM_TASKS")
    if tasks is None and os.environ.get("SLURM_STEP_ID"):
        tasks = _env_count("SLURM_NTASKS")
    if tasks is None or tasks <= 1:
        return None
    if any(_env_count(v) == 1 for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")):
        return None
    lib = MPI.Get_library_version().splitlines()[0].strip()
    return (f"commlib: MPI world size 1 in a Slurm step of {tasks} tasks: every task runs alone; "
            f"launch with srun --mpi={slurm_srun_mpi(lib)} for this MPI ({lib.split(',')[0]})")


_checked_slurm = False


def check_slurm_singleton(stacklevel: int = 2) -> str | None:
    """``COMMLIB_SLURM_SINGLETON`` (``warn``, the default: a ``RuntimeWarning`` once per process, on
    the step's task 0; ``error``: raise :class:`~commlib.InvalidArgument` with the line on every
    task, which the job scripts set; ``off``) about :func:`slurm_singleton`.  ``commlib.init`` calls
    it; returns the line (None: not a singleton in a step of several tasks, or already warned)."""
    global _checked_slurm
    mode = config.slurm_singleton
    if mode == "off" or (_checked_slurm and mode != "error"):
        return None
    _checked_slurm = True
    msg = slurm_singleton()
    if msg is None:
        return None
    if mode == "error":
        from commlib.core.errors import InvalidArgument  # noqa: PLC0415

        raise InvalidArgument(msg.removeprefix("commlib: ") + " (COMMLIB_SLURM_SINGLETON=error)",
                              rank=_env_count("SLURM_PROCID"), op="init")
    if _env_count("SLURM_PROCID") in (None, 0):
        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)
    return msg


#: the bound armed at exit, seconds (None: none registered yet); a later, shorter bound wins
_finalize_bound: float | None = None
#: the bound a fault-tolerant communicator arms at init, before any failure is seen:
#: far above a healthy MPI_Finalize (well under a second), so only a hang meets it
IDLE_FINALIZE_BOUND = 30.0


def bound_finalize_at_exit(seconds: float | None = None) -> None:
    """Bound the time ``MPI_Finalize`` may take at interpreter exit.

    After a failure Open MPI 5's ``MPI_Finalize`` can spin forever in its PMIx
    fence waiting for the dead processes (open-mpi/ompi#11404, #9434; seen here
    in about one run in three with two failures), and without ULFM the finalize
    of a broken job can hang too.  This registers (once) an atexit handler that
    flushes stdio and arms ``alarm(2)`` with the default SIGALRM action:
    mpi4py's finalizer (which runs after every atexit handler) still runs and
    usually completes at once; if it hangs, the kernel ends the process after
    the bound, so ``mpiexec`` returns.  Called again, the shorter bound wins.
    ``seconds`` (default ``COMMLIB_FINALIZE_TIMEOUT``, 3 s): ``0`` disables it
    (and a ``COMMLIB_FINALIZE_TIMEOUT`` of 0 disables every bound).  A
    fault-tolerant ``commlib.init`` arms :data:`IDLE_FINALIZE_BOUND` (a process
    that died after the last collective, unseen by the survivors, would
    otherwise hang their finalize for ever); the fault-tolerant collectives
    arm the configured bound after the first failure.
    """
    global _finalize_bound
    if seconds is None:
        seconds = config.finalize_timeout
    if seconds <= 0 or config.finalize_timeout <= 0 or not hasattr(signal, "alarm"):
        return
    first = _finalize_bound is None
    _finalize_bound = seconds if first else min(_finalize_bound, seconds)
    if not first:
        return

    def _arm():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, math.ceil(_finalize_bound)))

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

    def bound_finalize(self, seconds: float | None = None) -> None:
        """:func:`bound_finalize_at_exit` (default: the configured bound)."""
        bound_finalize_at_exit(seconds)

    def warn_tcp_rdma(self) -> str | None:
        """:func:`warn_tcp_rdma`, pointing at the caller of ``commlib.init``, which calls it."""
        return warn_tcp_rdma(stacklevel=3)


#: the hooks of this process
PROCESS = MPIProcess()
