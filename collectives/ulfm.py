"""The ULFM recovery policy: revoke, agree, shrink, retry, under the watchdog.

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
   (:mod:`commlib.collectives.watchdog`, docs/faults-and-security.md).  Without ``MPI_THREAD_MULTIPLE``
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
communicator is marked broken (later calls raise at once;
:class:`~commlib.collectives.recovery.TimeoutPolicy`).  After any failure
MPI_Finalize is bounded in time at exit (the group's ``bound_finalize`` hook), so
``mpiexec`` returns within seconds of the survivors finishing.
"""
from __future__ import annotations

import sys
import time

from commlib.core.config import config
from commlib.core.errors import CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import Deadline

from .recovery import FaultTolerance, Outcome, RecoveryPolicy
from .watchdog import Watch, watchdog

__all__ = ["UlfmPolicy", "recover"]

# agreement flag bits (ANDed across survivors by MPIX_Comm_agree)
_OK = 1          # no failure seen
_NO_BADARG = 2   # no InvalidArgument
_NO_ERROR = 4    # no other exception
_NO_TIMEOUT = 8  # no watchdog fired


def _dbg(comm, *a):
    if config.ft_debug:
        process = comm.ft.process if comm.ft is not None else None
        world = process.world_rank() if process is not None else "?"
        print(f"[ft w{world} {comm.rank}/{comm.size}]", *a, file=sys.stderr, flush=True)


def _waiting_bound(ft: FaultTolerance, timeout: float | None = None) -> float:
    """Hard bound (seconds) of a step that waits for peers (agree, shrink):
    ``T + 2G``, longer than any peer's attempt bound ``T + G`` (``T`` the
    larger of ``ft.timeout`` and the call's ``timeout``)."""
    t = ft.timeout if timeout is None else max(ft.timeout, timeout)
    return t + 2 * config.ft_grace if config.ft_grace > 0 else 0.0


def _shrink(comm, tp, wd, w, ft, timeout: float | None = None):
    """``comm.shrink(tp)`` under the watchdog's hard bound, with the failure
    callbacks run after it, outside the bound (they are the application's code
    and may take long or run collectives themselves)."""
    callbacks = ft.callbacks
    ft.callbacks = []
    try:
        if wd is not None:
            wd.step(w, "shrink", _waiting_bound(ft, timeout))
        lost_world, kept = comm.shrink(tp)
    finally:
        if wd is not None:
            wd.disarm(w)
        ft.callbacks = callbacks
    if lost_world:
        for cb in list(callbacks):
            cb(lost_world, comm)
    return lost_world, kept


class UlfmPolicy(RecoveryPolicy):
    """ULFM recovery of one call on ``comm`` (see the module docstring).

    Args:
        comm: speaks ``ft`` (a :class:`FaultTolerance` in ``"ulfm"`` mode),
            ``rank``, ``size``, ``collective_transport()`` and
            ``shrink(transport)`` (returns ``(lost_world_ranks, kept)``,
            ``kept[i]`` the old rank of new rank ``i``); the transport speaks
            ``revoke()``, ``agree(flag)`` and ``ack_failed()``.
        opname: the operation, for errors.
        on_failure: overrides ``comm.ft.on_failure`` for this call.
        deadline: the call's :class:`~commlib.core.seconds.Deadline` (None:
            ``ft.timeout`` from now).  It bounds the first attempt (the
            watchdog revokes past it; without one every wait waits what is left
            of it); a retry after processes were lost and the communicator
            shrunk gets the call's timeout afresh (recovering is not stalling).

    Raises (from :meth:`recover`):
        ProcessFailed: ``on_failure="raise"``, after shrinking (``recovered = True``).
        CommTimeout: an attempt passed ``timeout`` with no process lost (on
            every survivor, after the communicator was rebuilt).
    """

    def __init__(self, comm, opname: str, on_failure: str | None = None, deadline: Deadline | None = None):
        self.comm, self.ft, self.opname = comm, comm.ft, opname
        self.deadline = deadline if deadline is not None else Deadline(self.ft.timeout)
        self.on_failure = on_failure or self.ft.on_failure
        self.wd = watchdog(self.ft.process)
        self.w = None
        self.survivors = list(range(comm.size))
        self.t_fail = None
        self.agreed = 0

    def _failed_now(self) -> None:
        if self.t_fail is None:
            self.t_fail = time.monotonic()

    def start(self):
        try:
            tp = self.comm.collective_transport()  # made already, or a bounded MPI_Comm_idup now
        except CommTimeout as exc:  # the call's name on it
            raise CommTimeout(exc.detail, rank=self.comm.rank, op=self.opname) from exc
        wd = self.wd
        # the watchdog's soft bound: what is left of the call's deadline (a
        # moment at least: 0 would revoke before any peer could answer)
        self.w = wd.arm(tp, max(self.deadline.left(), 1e-3), self.opname, self.comm.rank) if wd is not None else None
        # unbounded steps under the watchdog, else bounded polled waits
        return tp, None if wd is not None else self.deadline, self.survivors

    def failed(self, tp, exc) -> None:
        self._failed_now()
        if self.wd is not None:
            self.wd.step(self.w, "revoke", config.ft_grace)
        tp.revoke()

    def settle(self, tp, outcome: Outcome) -> bool:
        comm, wd, w = self.comm, self.wd, self.w
        flag = _OK | _NO_BADARG | _NO_ERROR | _NO_TIMEOUT
        if outcome.failure is not None:
            flag &= ~_OK
        elif outcome.error is not None:
            flag &= ~(_NO_BADARG if outcome.badarg else _NO_ERROR)
        if wd is not None and wd.step(w, "agree", _waiting_bound(self.ft, self.deadline.timeout)):
            # past the deadline: the watchdog revoked the communicator (even
            # if this rank's part had just finished, the others may not have)
            flag &= ~(_OK | _NO_TIMEOUT)
            outcome.error = None
            self._failed_now()
        _dbg(comm, self.opname, "agree", flag)
        try:
            try:
                agreed = tp.agree(flag)
            except CommError:
                # a failure not yet acknowledged: uniform across survivors
                agreed = flag & ~_OK
                self._failed_now()
                tp.ack_failed()
        finally:
            if wd is not None:
                wd.disarm(w)
        _dbg(comm, self.opname, "agreed", agreed)
        self.agreed = agreed
        if not agreed & _OK:
            return False
        if outcome.error is None:
            if not agreed & _NO_BADARG:
                outcome.error = InvalidArgument("another rank passed invalid arguments", rank=comm.rank,
                                                op=self.opname)
            elif not agreed & _NO_ERROR:
                outcome.error = CommError("another rank raised an error in the collective", rank=comm.rank,
                                          op=self.opname)
            elif self.t_fail is not None:
                self.ft.recoveries.append((time.monotonic() - self.t_fail, self.ft.failed))
        return True

    def recover(self, tp, outcome: Outcome) -> None:
        # shrink and retry (and bound MPI_Finalize at exit, which can
        # otherwise wait forever for the dead ranks)
        comm, ft = self.comm, self.ft
        ft.bound_finalize()
        lost_world, kept = _shrink(comm, tp, self.wd, self.w, ft, self.deadline.timeout)
        self.survivors = [self.survivors[k] for k in kept]
        _dbg(comm, self.opname, "shrunk", lost_world, self.survivors)
        if not self.agreed & _NO_TIMEOUT and not lost_world:
            exc = CommTimeout(f"a rank's attempt passed the {self.deadline.timeout:g} s timeout with no process lost "
                              "(a stalled peer?); the communicator was revoked and rebuilt",
                              rank=comm.rank, op=self.opname)
            exc.recovered = True  # rebuilt already (every survivor agreed): no second comm.recover()
            raise exc
        if lost_world and self.on_failure == "raise":
            exc = ProcessFailed(f"rank(s) {list(lost_world)} of COMM_WORLD failed; communicator shrunk "
                                f"to {comm.size} ranks", failed=lost_world, rank=comm.rank, op=self.opname)
            exc.recovered = True  # already shrunk: do not call comm.recover() again
            raise exc
        if lost_world:  # the retry over the survivors: the call's timeout afresh
            self.deadline = Deadline(self.deadline.timeout)


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
        comm: an object speaking the protocol of :class:`UlfmPolicy`.

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
    wd = watchdog(ft.process)
    w = None
    if wd is not None:  # every step bounded: a wedged MPI fails this rank
        w = Watch(tp, "recover", comm.rank, time.monotonic())
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
    ft.bound_finalize()
    lost, _ = _shrink(comm, tp, wd, w, ft)
    _dbg(comm, "recover: shrunk, lost", lost)
    return lost
