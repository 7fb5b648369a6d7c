"""Fault tolerance for the collectives: revoke, agree, shrink, retry.

The protocol follows ULFM (User-Level Failure Mitigation; Bland, Bouteiller,
Herault, Bosilca & Dongarra, "Post-failure recovery of MPI communication
capability: design and rationale", IJHPCA 27(3):244-254, 2013), as shipped in
Open MPI 5 (``mpiexec --with-ft ulfm``):

1. an attempt runs without per-step deadlines (its steps spin on
   ``MPI_Testall``), as ULFM reports a dead peer as ``MPI_ERR_PROC_FAILED`` or
   ``MPI_ERR_REVOKED`` instead of hanging; a rank that sees one **revokes** the
   communicator
   (``MPIX_Comm_revoke``), which interrupts the survivors still blocked on
   live-but-waiting peers.  A watchdog thread (NCCL's idea, on ULFM's revoke)
   bounds the attempt to ``timeout`` seconds: past it, it revokes the
   communicator, and the survivors raise :class:`~commlib.core.errors.CommTimeout`
   (a stalled, live peer).  Every other blocking step (revoke, agree, shrink)
   is bounded too, and a rank whose MPI library stops making progress (Open
   MPI 5.0's TCP transport can wedge inside ``MPI_Testall``, its revoke
   then blocking too) fails itself with one line on stderr and
   ``os._exit(70)``, which the survivors recover from as from any failure
   (:class:`_Watchdog`, docs/FAULTS.md).  Without ``MPI_THREAD_MULTIPLE``
   every wait is polled and bounded instead;
2. every survivor then calls ``MPIX_Comm_agree`` on a success flag (bitwise AND
   over the survivors, uniform even when processes fail during it), so a rank that
   finished its part never returns while another retries;
3. on failure the survivors ``MPIX_Comm_shrink`` to a communicator of the live
   ranks, restore their input buffers from a snapshot and **retry** the whole
   collective, so the result is the reduction over the survivors' inputs,
   bit-identical on every survivor (the algorithms have a fixed reduction order).

Without ULFM (MPICH, or Open MPI launched without ``--with-ft ulfm``) a dead peer
shows as a wait that does not end: every wait is bounded and every survivor
raises :class:`~commlib.core.errors.ProcessFailed` or
:class:`~commlib.core.errors.CommTimeout` within a bounded time, after which the
communicator is marked broken (later calls raise at once).  After any failure
MPI_Finalize is bounded in time at exit (:func:`bound_finalize_at_exit`), so
``mpiexec`` returns within seconds of the survivors finishing.
"""
from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from commlib.core.config import config
from commlib.core.device import ulfm_available
from commlib.core.errors import CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.transports.failures import is_process_failure

from .snapshot import LazySnapshot  # noqa: F401 - re-exported: the runner and algorithms take one

__all__ = ["ft_mode", "ft_mode_info", "FaultTolerance", "bound_finalize_at_exit", "run_collective", "recover",
           "ON_FAILURE", "LazySnapshot"]

ON_FAILURE = ("shrink", "raise")

# agreement flag bits (ANDed across survivors by MPIX_Comm_agree)
_OK = 1          # no failure seen
_NO_BADARG = 2   # no InvalidArgument
_NO_ERROR = 4    # no other exception
_NO_TIMEOUT = 8  # no watchdog fired


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


@dataclass
class FaultTolerance:
    """Fault-tolerance state of one :class:`~commlib.Communicator`.

    Attributes:
        mode: ``"ulfm"`` or ``"timeout"`` (see :func:`ft_mode`).
        on_failure: ``"shrink"`` (recover and return the result over the
            survivors) or ``"raise"`` (recover the communicator, then raise
            :class:`ProcessFailed` listing the failed ranks on every survivor).
        timeout: seconds one attempt of a collective may take (ULFM, enforced
            by the watchdog), or each wait (``"timeout"`` mode, or no
            ``MPI_THREAD_MULTIPLE``), before it counts as a failure.
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
    return is_process_failure(exc)


def recover(comm) -> tuple:
    """Collective recovery after the application itself saw a failure.

    For failures found outside commlib's collectives (a
    :class:`~commlib.ProcessFailed` in the application's own point-to-point or
    halo traffic): revoke the communicator, agree, shrink.  Every survivor
    must call it (or be inside a collective of ``comm``, which the revoke
    interrupts; use ``on_failure="raise"`` so such a collective raises
    :class:`ProcessFailed` with ``recovered = True`` instead of retrying).
    Revoke any other communicator the application uses (e.g. a Cartesian one)
    first, so that survivors blocked on it join.

    Args:
        comm: an object speaking the fault-tolerance protocol (see
            :func:`run_collective`): ``ft``, ``rank``, ``collective_transport()``,
            ``shrink(transport)``.

    Returns:
        tuple: ``COMM_WORLD`` ranks lost (sorted; may be empty after a false alarm).

    Raises:
        InvalidArgument: ``comm`` is not fault tolerant under ULFM.
    """
    ft: FaultTolerance | None = comm.ft
    if ft is None or ft.mode != "ulfm":
        raise InvalidArgument("recover() needs commlib.init(fault_tolerant=True) under ULFM",
                              rank=comm.rank, op="recover")
    tp = comm.collective_transport()
    wd = _watchdog()
    w = None
    if wd is not None:  # every step bounded: a wedged MPI fails this rank
        w = _Watch(tp, "recover", comm.rank, time.monotonic())
        wd.step(w, "revoke", config.ft_grace)
    try:
        tp.revoke()
        _dbg(comm, "recover: agree")
        if wd is not None:
            wd.step(w, "agree", _waiting_bound(ft))
        try:
            tp.agree(0)
        except CommError:
            tp.ack_failed()
    finally:
        if wd is not None:
            wd.disarm(w)
    bound_finalize_at_exit()
    lost, _ = _shrink(comm, tp, wd, w, ft)
    _dbg(comm, "recover: shrunk, lost", lost)
    return lost


def _dbg(comm, *a):
    if config.ft_debug:
        print(f"[ft w{MPI.COMM_WORLD.Get_rank()} {comm.rank}/{comm.size}]", *a, file=sys.stderr, flush=True)


FAILSTOP_EXIT_STATUS = 70
"""Exit status of a rank the watchdog ends because MPI stopped making progress
(``EX_SOFTWARE`` of sysexits.h); see :class:`_Watchdog` and docs/FAULTS.md."""


class _Watch:
    """One armed fault-tolerant call: the thread running it, its current
    blocking step and that step's deadlines (``time.monotonic()`` seconds).

    ``soft``: revoke (an attempt only; None once fired); ``hard``: the step's
    bound, past which a thread that used no CPU since the last check is stuck
    inside a blocking call; ``cap``: the bound even for a thread that still
    spins (waiting for a peer the watchdog of which will fail it first);
    ``check``: when the watchdog next samples the thread's CPU time;
    ``pcheck``: when it next samples the whole process's CPU time (the steps
    that wait for peers only: see :meth:`_Watchdog._process_check`), and
    ``psamples`` those samples, ``(time, process CPU seconds)``.
    """

    __slots__ = ("tp", "op", "rank", "step", "start", "step_start", "soft", "hard", "cap", "check",
                 "clock", "mark", "fired", "grace", "revoking", "pcheck", "psamples")

    def __init__(self, tp, op, rank, now):
        self.tp, self.op, self.rank = tp, op, rank
        self.start = self.step_start = now
        self.step = "attempt"
        self.soft = self.hard = self.cap = self.check = self.mark = None
        self.clock = _thread_clock()
        self.fired = False
        self.grace = config.ft_grace
        self.revoking = None  # monotonic time the watchdog's revoke started, while it has not returned
        self.pcheck = self.psamples = None

    def bound(self, now, hard, grace):
        """Set the step's hard bound ``hard`` seconds from ``now`` (None: none)."""
        self.mark = None
        self.pcheck = self.psamples = None
        if hard is None or hard <= 0 or grace <= 0:
            self.hard = self.cap = self.check = None
            return
        self.hard = now + hard
        self.cap = self.hard + grace
        self.check = max(now, self.hard - grace)  # first CPU sample, a grace before the bound

    def due(self):
        d = self.soft
        for c in (self.check, self.pcheck):
            if c is not None and (d is None or c < d):
                d = c
        return d


_CLOCKS: dict = {}
_IDLE_CPU_S = 0.01  # CPU seconds over a grace below which a thread counts as blocked
# The shrink fails a process whose threads together used under _IDLE_CPU_S of
# CPU over this fraction of a grace: it follows an agreement every live rank
# has joined (no peer is still in its attempt), and a live process waiting in
# MPIX_Comm_shrink polls (measured, docs/FAULTS.md); one using none is blocked
# in the kernel (the TCP transport's self-deadlock on its mutex).  Not the
# agreement: there a healthy rank waiting for a peer still in its attempt was
# seen using no CPU for over a second (tests/test_ft_kill.py, docs/FAULTS.md).
_PROCESS_IDLE_WINDOW = 0.5
_WAITING_STEPS = ("shrink",)


def _thread_clock():
    """The calling thread's CPU-time clock id (None where there is none)."""
    ident = threading.get_ident()
    c = _CLOCKS.get(ident, False)
    if c is False:
        try:
            c = time.pthread_getcpuclockid(ident)
        except (AttributeError, OSError):
            c = None
        if len(_CLOCKS) > 256:
            _CLOCKS.clear()
        _CLOCKS[ident] = c
    return c


def _cpu(clock):
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:
        return None


class _Watchdog:
    """Bounds every blocking step of the fault-tolerant calls of this process.

    One daemon thread per process watches every armed call (:class:`_Watch`;
    several threads may run fault-tolerant calls at once, e.g. a non-blocking
    collective's worker).  With ``T`` = ``timeout`` and ``G`` =
    ``COMMLIB_FT_GRACE``:

    - **soft deadline**, ``T`` into an attempt: revoke the call's communicator
      (``MPIX_Comm_revoke``, from a short-lived helper thread, so that a revoke
      that blocks cannot stall the watchdog); the survivors' pending
      operations fail and the attempt ends in ``CommTimeout`` or a retry
      (NCCL's watchdog idea, on ULFM's revoke);
    - **hard bound** of each step: an attempt ``T + G``, a revoke ``G``, an
      agreement or a shrink ``T + 2G`` (they wait for peers, which either
      join or fail themselves within their own attempt's bound).  A thread
      still in the step there that used no CPU over the last ``G`` seconds
      is blocked in the kernel inside a call that should poll (Open MPI
      busy-polls in every wait), and a rank whose revoke (issued at the soft
      deadline) has not returned within ``G`` has a wedged MPI library (a
      revoke waits for no peer): MPI stopped making progress, as when Open MPI
      5.0's TCP transport deadlocks on its own mutex, or spins forever in
      ``mca_btl_tcp_send``, inside one ``MPI_Testall``, and the revoke then
      blocks behind it (docs/FAULTS.md); or commlib's own code stalled.
      Either way the rank fails.  In the shrink (which follows an agreement
      every live rank joined) a process that used no CPU at all, all threads
      together, for ``G/2`` fails at once (:meth:`_process_check`).
      A thread that still spins is waiting for a peer (a rank with a pending rendezvous to a
      wedged peer stays in ``MPI_Testall`` after a revoke until that peer is
      gone) and gets up to ``G`` more, the **cap**, so that the stuck rank,
      not its healthy neighbours, is the one that exits;
    - **fail-stop**: one line on stderr naming the rank, the call, the step
      and the elapsed time, then ``os._exit(FAILSTOP_EXIT_STATUS)``.  The hang
      becomes one more process failure, which the survivors' ULFM recovery
      handles as any other (they shrink and retry without this rank).

    The watchdog is a Python thread: it needs the GIL, and every MPI call the
    fault-tolerant path makes releases it (mpi4py calls MPI ``with nogil``;
    checked for ``Testall``, ``Waitall``, ``Agree``, ``Shrink``, ``Revoke``,
    ``Dup``, ``Barrier``, ``Allgather`` with a PMPI shim that blocks inside
    each: docs/FAULTS.md), so a rank stuck inside MPI still runs it.  Arming
    and disarming cost a lock round trip each and no thread switch (the thread
    sleeps towards the earliest deadline and is woken only when a new one is
    earlier).  Revoking needs ``MPI_THREAD_MULTIPLE``.

    Args:
        exit: called with the message instead of writing it and calling
            ``os._exit`` (tests).
    """

    def __init__(self, exit: Callable[[str], None] | None = None):
        self._cv = threading.Condition()
        self._watches: set[_Watch] = set()
        self._wake: float | None = None  # when the thread wakes next
        self._idle = 60.0  # seconds the thread sleeps while nothing is armed
        self._thread: threading.Thread | None = None
        self._exit = exit
        self.failstops = 0

    def _start_or_notify(self, due) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="commlib-ft-watchdog", daemon=True)
            self._thread.start()
        elif due is not None and (self._wake is None or self._wake > due):
            self._cv.notify()

    def arm(self, tp, timeout: float, op: str = "collective", rank=None,
            grace: float | None = None) -> _Watch:
        """Watch an attempt on transport ``tp`` by the calling thread: revoke
        after ``timeout`` seconds, hard bound ``timeout + grace``."""
        now = time.monotonic()
        w = _Watch(tp, op, rank, now)
        w.grace = config.ft_grace if grace is None else grace
        w.soft = now + timeout
        w.bound(now, timeout + w.grace, w.grace)
        with self._cv:
            self._idle = timeout
            self._watches.add(w)
            self._start_or_notify(w.soft)
        return w

    def step(self, w: _Watch, step: str, hard: float | None, tp=None) -> bool:
        """Move ``w`` to a new blocking step with only a hard bound of ``hard``
        seconds from now (None or 0: unbounded); re-adds a disarmed watch.
        The shrink also gets the process-idle test (:meth:`_process_check`)
        from its start.
        Returns True when the attempt's soft deadline had passed (the
        communicator was revoked)."""
        now = time.monotonic()
        with self._cv:
            w.step, w.step_start, w.soft = step, now, None
            if tp is not None:
                w.tp = tp
            w.bound(now, hard, w.grace)
            if step in _WAITING_STEPS and w.hard is not None:
                w.psamples = [(now, time.process_time())]
                w.pcheck = now + w.grace * _PROCESS_IDLE_WINDOW / 2
            self._watches.add(w)
            self._start_or_notify(w.due())
            return w.fired

    def disarm(self, w: _Watch) -> bool:
        """Stop watching ``w``; True when its attempt's soft deadline passed
        (its communicator was revoked)."""
        with self._cv:
            self._watches.discard(w)
            fired, w.fired = w.fired, False
            return fired

    def _loop(self) -> None:
        with self._cv:
            while True:
                now = time.monotonic()
                due = None
                for w in self._watches:
                    d = w.due()
                    if d is not None and (due is None or d < due):
                        due = d
                if due is None:
                    # idle: sleep a timeout's length, not "until notified", so
                    # that the next arm (deadline = now + timeout, later than
                    # this wake) needs no notify and no thread switch
                    self._wake = now + self._idle
                    self._cv.wait(self._idle)
                    continue
                if now < due:
                    self._wake = due
                    self._cv.wait(due - now)
                    continue
                for w in list(self._watches):
                    if w.soft is not None and now >= w.soft:
                        w.soft = None
                        w.fired = True
                        # revoke from a helper: it may block (a wedged MPI)
                        # and the hard bound must still be enforced
                        w.revoking = now
                        threading.Thread(target=_revoke_quietly, args=(w.tp, w),
                                         name="commlib-ft-revoke", daemon=True).start()
                    if w.check is not None and now >= w.check:
                        self._check(w, now)
                    if w.pcheck is not None and now >= w.pcheck and w in self._watches:
                        self._process_check(w, now)

    def _check(self, w: _Watch, now: float) -> None:
        cpu = _cpu(w.clock)
        revoking = w.revoking
        if now >= w.cap:
            self._failstop(w, now, "still waiting")
        elif now >= w.hard and revoking is not None and now - revoking >= w.grace:
            # a revoke needs no peer: one that does not return is a wedged
            # MPI (a thread can also spin forever inside one MPI_Testall)
            self._failstop(w, now, f"its revoke has not returned in {now - revoking:.1f} s")
        elif now >= w.hard and (cpu is None or (w.mark is not None and cpu - w.mark[1] < _IDLE_CPU_S)):
            idle = now - w.mark[0] if w.mark is not None else now - w.step_start
            self._failstop(w, now, f"no CPU time in the last {idle:.1f} s: blocked inside a call")
        else:  # before the bound, or still spinning: sample again a grace later
            w.mark = (now, cpu)
            w.check = min(max(w.hard, now + w.grace), w.cap)

    def _process_check(self, w: _Watch, now: float) -> None:
        """The process-idle test of the shrink: sampled every
        half window (window ``W`` = ``G`` x :data:`_PROCESS_IDLE_WINDOW`), it
        fails the rank when all its threads together used under
        :data:`_IDLE_CPU_S` seconds of CPU over the last ``W`` seconds.  The
        shrink follows an agreement that every live rank joined, so no peer is
        still in its attempt, and a live process waiting in ``MPIX_Comm_shrink``
        polls (a core's worth of CPU, measured); one that uses none is blocked in the
        kernel, as a survivor of Open MPI's TCP self-deadlock is when the
        failure of another rank reaches it in the shrink.  Without this test
        such a rank fails only at the step's hard bound, ``T + 2G`` into the
        step, after a first fail-stop at ``T + G``: a call of about ``2T + 3G``
        (docs/FAULTS.md).  The whole process, not the thread, because in
        ``MPI_THREAD_MULTIPLE`` one thread may poll for another that waits on a
        condition variable."""
        cpu = time.process_time()
        window = w.grace * _PROCESS_IDLE_WINDOW
        samples = w.psamples
        samples.append((now, cpu))
        # the newest sample at least a window old, and nothing older
        while len(samples) > 2 and now - samples[1][0] >= window:
            samples.pop(0)
        t0, c0 = samples[0]
        if now - t0 >= window and cpu - c0 < _IDLE_CPU_S:
            self._failstop(w, now, f"the whole process used {cpu - c0:.3f} s of CPU in the last {now - t0:.1f} s: "
                                   "blocked inside MPI, which polls in every wait")
            return
        w.pcheck = now + window / 2

    def _failstop(self, w: _Watch, now: float, why: str) -> None:
        self._watches.discard(w)
        w.check = w.soft = w.pcheck = None
        world = "?" if _WORLD_RANK is None else _WORLD_RANK
        rank = "?" if w.rank is None else w.rank
        msg = (f"commlib: rank {rank} (COMM_WORLD rank {world}, pid {os.getpid()}) fail-stop: {w.op} stuck in "
               f"{w.step} for {now - w.step_start:.1f} s, {now - w.start:.1f} s into the call ({why}); exiting "
               f"with status {FAILSTOP_EXIT_STATUS} so that the survivors recover without this rank "
               f"(docs/FAULTS.md)")
        self.failstops += 1
        if self._exit is not None:
            self._exit(msg)
            return
        try:
            os.write(2, (msg + "\n").encode())
            if config.ft_debug:
                import faulthandler  # noqa: PLC0415
                faulthandler.dump_traceback(all_threads=True)
        finally:
            os._exit(FAILSTOP_EXIT_STATUS)


def _revoke_quietly(tp, w=None) -> None:
    try:
        tp.revoke()  # the transport's ULFM revoke; never raises
    except Exception:  # noqa: BLE001
        pass
    if w is not None:
        w.revoking = None


_WORLD_RANK = None  # COMM_WORLD rank, cached: the fail-stop path makes no MPI call


def _world_rank():
    global _WORLD_RANK
    if _WORLD_RANK is None:
        try:
            _WORLD_RANK = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else None
        except Exception:  # noqa: BLE001
            pass
    return "?" if _WORLD_RANK is None else _WORLD_RANK


_WATCHDOG: _Watchdog | None = None


def _watchdog() -> _Watchdog | None:
    """The process's watchdog, or None without ``MPI_THREAD_MULTIPLE`` or with
    ``COMMLIB_FT_WATCHDOG=0`` (then every wait is polled and bounded)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE or not config.ft_watchdog:
            return None
        _world_rank()
        _WATCHDOG = _Watchdog()
    return _WATCHDOG


def _waiting_bound(ft: "FaultTolerance") -> float:
    """Hard bound (seconds) of a step that waits for peers (agree, shrink):
    ``T + 2G``, longer than any peer's attempt bound ``T + G``."""
    return ft.timeout + 2 * config.ft_grace if config.ft_grace > 0 else 0.0


def _shrink(comm, tp, wd, w, ft):
    """``comm.shrink(tp)`` under the watchdog's hard bound, with the failure
    callbacks run after it, outside the bound (they are the application's code
    and may take long or run collectives themselves)."""
    callbacks = ft.callbacks
    ft.callbacks = []
    try:
        if wd is not None:
            wd.step(w, "shrink", _waiting_bound(ft))
        lost_world, kept = comm.shrink(tp)
    finally:
        if wd is not None:
            wd.disarm(w)
        ft.callbacks = callbacks
    if lost_world:
        for cb in list(callbacks):
            cb(lost_world, comm)
    return lost_world, kept


def run_collective(comm, opname: str, attempt: Callable, restore: Callable | None = None,
                   on_failure: str | None = None):
    """Run one collective on ``comm``, recovering from failures in FT mode.

    ``comm`` speaks a small protocol (``commlib.Communicator`` implements it):
    ``ft`` (a :class:`FaultTolerance` or None), ``rank``, ``size``,
    ``collective_transport()`` (the transport commlib's collectives run on) and
    ``shrink(transport)`` (ULFM recovery: returns ``(lost_world_ranks,
    kept)``, ``kept[i]`` the old rank of new rank ``i``).

    Args:
        comm: the communicator.
        opname: operation name for errors (``"allreduce"``...).
        attempt: ``attempt(transport, timeout, survivors)`` runs the whole
            collective once and returns its result; ``survivors`` lists the
            ranks of the call's original communicator still alive, in the order
            of the current one (``range(size)`` before any failure).
        restore: called before each retry to restore the input buffers.
        on_failure: override the communicator's ``on_failure`` for this call.

    Returns:
        whatever ``attempt`` returns.

    Raises:
        ProcessFailed: ``on_failure="raise"`` (after shrinking), or ``"timeout"`` mode.
        CommTimeout: a wait ran out of time in ``"timeout"`` mode; or, under
            ULFM, an attempt passed ``timeout`` with no process lost (on every
            survivor, after the communicator was rebuilt).
        InvalidArgument: inconsistent arguments (on every rank).
    """
    ft: FaultTolerance | None = comm.ft
    if ft is None:
        return attempt(comm.collective_transport(), None, range(comm.size))
    if ft.broken:
        raise ProcessFailed(f"communicator unusable after an earlier failure ({ft.broken})",
                            failed=ft.failed, rank=comm.rank, op=opname)
    if ft.mode == "timeout":
        tp = comm.collective_transport()
        try:
            return attempt(tp, ft.timeout, list(range(comm.size)))
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, InvalidArgument) or not _is_failure(exc):
                raise
            err = exc if isinstance(exc, CommError) else CommError(str(exc), rank=comm.rank, op=opname)
            if isinstance(err, CommTimeout):
                err = CommTimeout(f"{err.detail} in {err.op or 'wait'}; a peer probably died (no ULFM to tell)",
                                  rank=comm.rank, op=opname)
            elif isinstance(err, ProcessFailed) and err.op != opname:
                err = ProcessFailed(err.detail, failed=err.failed or tp.failed_ranks(), rank=comm.rank, op=opname)
            ft.broken = str(err)
            bound_finalize_at_exit()
            raise err from (exc if err is not exc else None)

    survivors = list(range(comm.size))
    t_fail = None
    wd = _watchdog()
    grace = config.ft_grace
    while True:
        tp = comm.collective_transport()
        flag = _OK | _NO_BADARG | _NO_ERROR | _NO_TIMEOUT
        result = None
        err: BaseException | None = None
        w = wd.arm(tp, ft.timeout, opname, comm.rank) if wd is not None else None
        try:
            # unbounded steps under the watchdog, else bounded polled waits
            result = attempt(tp, None if wd is not None else ft.timeout, survivors)
        except InvalidArgument as exc:
            flag &= ~_NO_BADARG
            err = exc
        except Exception as exc:  # noqa: BLE001
            if _is_failure(exc):
                flag &= ~_OK
                if t_fail is None:
                    t_fail = time.monotonic()
                if wd is not None:
                    wd.step(w, "revoke", grace)
                tp.revoke()
            else:
                flag &= ~_NO_ERROR
                err = exc
        if wd is not None and wd.step(w, "agree", _waiting_bound(ft)):
            # past the deadline: the watchdog revoked the communicator (even
            # if this rank's part had just finished, the others may not have)
            flag &= ~(_OK | _NO_TIMEOUT)
            err = None
            if t_fail is None:
                t_fail = time.monotonic()
        _dbg(comm, opname, "agree", flag)
        try:
            try:
                agreed = tp.agree(flag)
            except CommError:
                # a failure not yet acknowledged: uniform across survivors
                agreed = flag & ~_OK
                if t_fail is None:
                    t_fail = time.monotonic()
                tp.ack_failed()
        finally:
            if wd is not None:
                wd.disarm(w)
        _dbg(comm, opname, "agreed", agreed)
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
        # --- recover: shrink and retry (and bound MPI_Finalize at exit, which
        # can otherwise wait forever for the dead ranks)
        bound_finalize_at_exit()
        lost_world, kept = _shrink(comm, tp, wd, w, ft)
        survivors = [survivors[k] for k in kept]
        _dbg(comm, opname, "shrunk", lost_world, survivors)
        if restore is not None:
            restore()
        if not agreed & _NO_TIMEOUT and not lost_world:
            raise CommTimeout(f"a rank's attempt passed the {ft.timeout:g} s timeout with no process lost "
                              "(a stalled peer?); the communicator was revoked and rebuilt",
                              rank=comm.rank, op=opname)
        if lost_world:
            if (on_failure or ft.on_failure) == "raise":
                exc = ProcessFailed(f"rank(s) {list(lost_world)} of COMM_WORLD failed; communicator shrunk "
                                    f"to {comm.size} ranks", failed=lost_world, rank=comm.rank, op=opname)
                exc.recovered = True  # already shrunk: do not call comm.recover() again
                raise exc
