"""The one retry runner of the collectives, and the recovery policies' contract.

A collective runs as *attempts* on a group's transport.  :func:`run` is the
only loop that drives them, whatever the group:

1. ``policy.start()`` gives the transport, the per-wait bound (seconds, or None
   when something else bounds the attempt) and the survivors;
2. the attempt runs; its outcome is a result, an argument error
   (:class:`~commlib.InvalidArgument`, raised alike on every rank by the
   argument agreement), a failure (``policy.is_failure``: a dead or silent
   peer, a revoked group) or another error;
3. ``policy.settle()`` makes the outcome the group's: it returns True when the
   call is decided the same way on every member (its result stands, or its
   error is raised everywhere), False when the group must recover and retry;
4. on any error leaving the call, and before each retry, ``restore()`` puts the
   caller's input back (a snapshot taken during the attempt), so the caller's
   buffer holds its input again before the error leaves the call;
5. ``policy.recover()`` rebuilds the group or raises the error that ends the call.

The policies:

- :class:`TimeoutPolicy` (no ULFM): every wait bounded; a failure is final
  (the group is marked broken and later calls raise at once);
- :class:`commlib.collectives.ulfm.UlfmPolicy`: revoke, agree, shrink, retry,
  under the watchdog (User-Level Failure Mitigation, Bland et al., IJHPCA
  27(3), 2013);
- the elastic master's verdict (``commlib.elastic``, PCCL's model, arXiv
  2505.14065): the master commits or aborts each operation; an abort is
  retried over the next epoch's members.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from commlib.core.errors import CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import Deadline, timeout_problem

__all__ = ["ON_FAILURE", "FaultTolerance", "Outcome", "RecoveryPolicy", "TimeoutPolicy", "run"]

ON_FAILURE = ("shrink", "raise")


@dataclass
class FaultTolerance:
    """Fault-tolerance state of one :class:`~commlib.Communicator`.

    Attributes:
        mode: ``"ulfm"`` or ``"timeout"`` (see
            :func:`commlib.transports.mpi_process.ft_mode`).
        on_failure: ``"shrink"`` (recover and return the result over the
            survivors) or ``"raise"`` (recover the communicator, then raise
            :class:`ProcessFailed` listing the failed ranks on every survivor).
        timeout: the default ``timeout`` of a call on the communicator: the
            deadline of the whole call in seconds (ULFM: enforced on an attempt
            by the watchdog; ``"timeout"`` mode, or no ``MPI_THREAD_MULTIPLE``:
            every wait waits what is left of it), past which it counts as a failure.
        callbacks: ``fn(failed, comm)`` called on every survivor after a shrink,
            with ``failed`` the lost ranks numbered as in ``COMM_WORLD``.
        failed: every ``COMM_WORLD`` rank lost so far (sorted tuple).
        broken: set in ``"timeout"`` mode once a failure was raised.
        recoveries: list of ``(seconds, failed_world_ranks)`` per recovery.
        process: the process hooks, or None (no watchdog, no finalize bound):
            ``thread_multiple()`` (bool), ``world_rank()`` (int or None),
            ``bound_finalize()`` (bound the library's finalize at exit, called
            after the first failure); over MPI
            :data:`commlib.transports.mpi_process.PROCESS`.
    """

    mode: str
    on_failure: str = "shrink"
    timeout: float = 60.0
    callbacks: list = field(default_factory=list)
    failed: tuple = ()
    broken: str | None = None
    recoveries: list = field(default_factory=list)
    process: object = None

    def __post_init__(self):
        if self.on_failure not in ON_FAILURE:
            raise InvalidArgument(f"on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}", op="init")
        problem = timeout_problem(self.timeout) if self.timeout is not None else "timeout must be given"
        if problem is not None:  # NaN or inf would make every bounded wait unbounded; 0 fails every wait
            raise InvalidArgument(problem, op="init")
        self.timeout = float(self.timeout)
        if self.mode not in ("ulfm", "timeout"):
            raise InvalidArgument(f"unknown fault-tolerance mode {self.mode!r}", op="init")

    def bound_finalize(self) -> None:
        if self.process is not None:
            self.process.bound_finalize()


class Outcome:
    """What one attempt did on this rank.

    Attributes:
        result: the attempt's return value (None unless it returned).
        error: the exception to raise if the call is decided as it is
            (an argument error, another error), or None.
        badarg: ``error`` is an :class:`InvalidArgument`.
        failure: the failure the attempt raised (a dead peer...), or None.
    """

    __slots__ = ("result", "error", "badarg", "failure")

    def __init__(self):
        self.result = self.error = self.failure = None
        self.badarg = False


class RecoveryPolicy:
    """How a group decides and recovers a collective call (see the module docstring).

    One policy object serves one call.  Subclasses implement :meth:`start`,
    :meth:`settle` and :meth:`recover`; :meth:`is_failure` and :meth:`failed`
    have defaults.
    """

    #: the operation, for errors
    opname = "collective"

    def start(self):
        """Begin an attempt: returns ``(transport, timeout, survivors)``."""
        raise NotImplementedError

    def is_failure(self, tp, exc: BaseException) -> bool:
        """True when ``exc`` (raised by an attempt on ``tp``) is a failure to recover from."""
        is_failure = getattr(tp, "is_failure", None)
        if is_failure is not None:
            return is_failure(exc)
        return isinstance(exc, (ProcessFailed, CommTimeout))

    def failed(self, tp, exc: BaseException) -> None:
        """The attempt on ``tp`` raised the failure ``exc`` (e.g. revoke the group)."""

    def settle(self, tp, outcome: Outcome) -> bool:
        """Make ``outcome`` the group's.  True: decided (``outcome.result`` is
        returned, or ``outcome.error`` raised, and ``settle`` may set
        ``outcome.error`` to what another rank's outcome means here); False:
        recover and retry.  An exception it raises ends the call (after the
        input is restored)."""
        raise NotImplementedError

    def recover(self, tp, outcome: Outcome) -> None:
        """After a failed attempt (the input already restored): rebuild the
        group for a retry, or raise the error that ends the call."""
        raise NotImplementedError


def run(policy: RecoveryPolicy, attempt: Callable, restore: Callable | None = None):
    """Run one collective call under ``policy``: the one retry loop.

    Args:
        policy: the group's :class:`RecoveryPolicy` for this call.
        attempt: ``attempt(transport, timeout, survivors)`` runs the whole
            collective once and returns its result; ``survivors`` lists the
            ranks of the call's original group still in it, in the order of
            the current one.
        restore: puts the caller's input buffers back (from a snapshot), or
            None when the call never writes them before it succeeds.

    Returns:
        whatever ``attempt`` returned on the attempt the group decided.

    Raises:
        what the policy decides: the attempt's own error (the same class on
        every rank for argument errors), or the policy's failure
        (:class:`~commlib.ProcessFailed`, :class:`~commlib.CommTimeout`...).
    """
    while True:
        tp, timeout, survivors = policy.start()
        out = Outcome()
        try:
            out.result = attempt(tp, timeout, survivors)
        except InvalidArgument as exc:
            out.error, out.badarg = exc, True
        except Exception as exc:  # noqa: BLE001
            if policy.is_failure(tp, exc):
                out.failure = exc
                policy.failed(tp, exc)
            else:
                out.error = exc
        try:
            decided = policy.settle(tp, out)
            if decided and out.error is not None:
                raise out.error
        except BaseException:
            if restore is not None:
                restore()
            raise
        if decided:
            return out.result
        if restore is not None:
            restore()
        policy.recover(tp, out)


class TimeoutPolicy(RecoveryPolicy):
    """No ULFM: every wait bounded by what is left of the call's deadline; a failure is final.

    The failure is raised on this rank as :class:`~commlib.ProcessFailed` or
    :class:`~commlib.CommTimeout` naming the call, and the group is marked
    broken (``ft.broken``), so later calls raise at once.

    Args:
        comm: the communicator (``ft``, ``rank``, ``size``, ``collective_transport()``).
        opname: the operation.
        deadline: the call's :class:`~commlib.core.seconds.Deadline` (None:
            ``ft.timeout`` from now).
    """

    def __init__(self, comm, opname: str, deadline: Deadline | None = None):
        self.comm, self.ft, self.opname = comm, comm.ft, opname
        self.deadline = deadline if deadline is not None else Deadline(self.ft.timeout)

    def start(self):
        try:
            tp = self.comm.collective_transport()  # made already, or a bounded MPI_Comm_idup now
        except CommTimeout as exc:  # the call's name on it; nothing moved, the group is not broken
            raise CommTimeout(exc.detail, rank=self.comm.rank, op=self.opname) from exc
        return tp, self.deadline, list(range(self.comm.size))

    def settle(self, tp, outcome: Outcome) -> bool:
        return outcome.failure is None

    def recover(self, tp, outcome: Outcome) -> None:
        exc, comm, opname = outcome.failure, self.comm, self.opname
        err = exc if isinstance(exc, CommError) else CommError(str(exc), rank=comm.rank, op=opname)
        if isinstance(err, CommTimeout):
            detail = err.detail if err.op == opname else (
                f"not complete within its timeout of {self.deadline.timeout:g} s (the deadline of the whole call; "
                f"{err.detail} in {err.op or 'wait'})")
            err = CommTimeout(f"{detail}; a peer probably died (no ULFM to tell)", rank=comm.rank, op=opname)
        elif isinstance(err, ProcessFailed) and err.op != opname:
            err = ProcessFailed(err.detail, failed=err.failed or tp.failed_ranks(), rank=comm.rank, op=opname)
        self.ft.broken = str(err)
        self.ft.bound_finalize()
        raise err from (exc if err is not exc else None)
