"""The fault-tolerant calls' watchdog: every blocking step bounded, a wedged rank fails itself.

NCCL's watchdog idea on ULFM's revoke: see :class:`Watchdog`.  Used by the
ULFM recovery policy (:mod:`commlib.collectives.ulfm`); it calls nothing but
the transport's ``revoke()``.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from commlib.core.config import config

__all__ = ["FAILSTOP_EXIT_STATUS", "watchdog"]


FAILSTOP_EXIT_STATUS = 70
"""Exit status of a rank the watchdog ends because MPI stopped making progress
(``EX_SOFTWARE`` of sysexits.h); see :class:`Watchdog` and docs/faults-and-security.md."""


class Watch:
    """One armed fault-tolerant call: the thread running it, its current
    blocking step and that step's deadlines (``time.monotonic()`` seconds).

    ``soft``: revoke (an attempt only; None once fired); ``hard``: the step's
    bound, past which a thread that used no CPU since the last check is stuck
    inside a blocking call; ``cap``: the bound even for a thread that still
    spins (waiting for a peer the watchdog of which will fail it first);
    ``check``: when the watchdog next samples the thread's CPU time;
    ``pcheck``: when it next samples the whole process's CPU time (the steps
    that wait for peers only: see :meth:`Watchdog._process_check`), and
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
# MPIX_Comm_shrink polls (measured, docs/faults-and-security.md); one using none is blocked
# in the kernel (the TCP transport's self-deadlock on its mutex).  Not the
# agreement: there a healthy rank waiting for a peer still in its attempt was
# seen using no CPU for over a second (tests/test_ft_kill.py, docs/faults-and-security.md).
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


class Watchdog:
    """Bounds every blocking step of the fault-tolerant calls of this process.

    One daemon thread per process watches every armed call (:class:`Watch`;
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
      blocks behind it (docs/faults-and-security.md); or commlib's own code stalled.
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

    The watchdog is a Python thread: it needs the GIL.  It runs while a rank is
    stuck inside an MPI call only if that call released the GIL (mpi4py's
    calls are declared ``with nogil``; this repository has no check that a given
    call does: docs/faults-and-security.md).  What the tests show is the other half: a
    caller blocked in a C call that released the GIL is ended by the watchdog.  Arming
    and disarming cost a lock round trip each and no thread switch (the thread
    sleeps towards the earliest deadline and is woken only when a new one is
    earlier).  Revoking needs ``MPI_THREAD_MULTIPLE``.

    Args:
        exit: called with the message instead of writing it and calling
            ``os._exit`` (tests).
    """

    def __init__(self, exit: Callable[[str], None] | None = None):
        self._cv = threading.Condition()
        self._watches: set[Watch] = set()
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
            grace: float | None = None) -> Watch:
        """Watch an attempt on transport ``tp`` by the calling thread: revoke
        after ``timeout`` seconds, hard bound ``timeout + grace``."""
        now = time.monotonic()
        w = Watch(tp, op, rank, now)
        w.grace = config.ft_grace if grace is None else grace
        w.soft = now + timeout
        w.bound(now, timeout + w.grace, w.grace)
        with self._cv:
            self._idle = timeout
            self._watches.add(w)
            self._start_or_notify(w.soft)
        return w

    def step(self, w: Watch, step: str, hard: float | None, tp=None) -> bool:
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

    def disarm(self, w: Watch) -> bool:
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

    def _check(self, w: Watch, now: float) -> None:
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

    def _process_check(self, w: Watch, now: float) -> None:
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
        (docs/faults-and-security.md).  The whole process, not the thread, because in
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

    def _failstop(self, w: Watch, now: float, why: str) -> None:
        self._watches.discard(w)
        w.check = w.soft = w.pcheck = None
        world = "?" if _WORLD_RANK is None else _WORLD_RANK
        rank = "?" if w.rank is None else w.rank
        msg = (f"commlib: rank {rank} (COMM_WORLD rank {world}, pid {os.getpid()}) fail-stop: {w.op} stuck in "
               f"{w.step} for {now - w.step_start:.1f} s, {now - w.start:.1f} s into the call ({why}); exiting "
               f"with status {FAILSTOP_EXIT_STATUS} so that the survivors recover without this rank "
               f"(docs/faults-and-security.md)")
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
_WATCHDOG: Watchdog | None = None


def watchdog(process) -> Watchdog | None:
    """The process's watchdog, or None without ``MPI_THREAD_MULTIPLE`` or with
    ``COMMLIB_FT_WATCHDOG=0`` (then every wait is polled and bounded).

    Args:
        process: the group's process hooks (``thread_multiple()``,
            ``world_rank()``; see :class:`~commlib.collectives.recovery.FaultTolerance`),
            or None (no watchdog).
    """
    global _WATCHDOG, _WORLD_RANK
    if _WATCHDOG is None:
        if process is None or not config.ft_watchdog or not process.thread_multiple():
            return None
        _WORLD_RANK = process.world_rank()
        _WATCHDOG = Watchdog()
    return _WATCHDOG
