"""Fault tolerance for the collectives: the front of the recovery policies.

:func:`run_collective` runs one call of a communicator under its group's
recovery policy with the one retry runner (:func:`commlib.collectives.recovery.run`):
the ULFM policy (:mod:`commlib.collectives.ulfm`: revoke, agree, shrink,
retry, under :mod:`commlib.collectives.watchdog`), the timeout-only policy
(:class:`~commlib.collectives.recovery.TimeoutPolicy`), or the policy the
group brings itself (the elastic peer's master verdict).  The MPI process's
lifecycle (mode detection, finalize bound) is in
:mod:`commlib.transports.mpi_process`; the collectives import no MPI.
"""
from __future__ import annotations

from typing import Callable

from commlib.core.errors import CommTimeout, ProcessFailed
from commlib.core.seconds import Deadline

from .recovery import ON_FAILURE, FaultTolerance, TimeoutPolicy, run
from .snapshot import LazySnapshot  # noqa: F401 - re-exported: the runner and algorithms take one
from .ulfm import UlfmPolicy, recover
from .watchdog import FAILSTOP_EXIT_STATUS, Watchdog  # noqa: F401 - re-exported (tests)

__all__ = ["FaultTolerance", "run_collective", "recover", "policy_for", "ON_FAILURE", "LazySnapshot"]


def policy_for(comm, opname: str, on_failure: str | None = None, deadline: Deadline | None = None):
    """The recovery policy of one call on ``comm``: ``comm.recovery_policy(opname,
    deadline)`` when the group brings its own (the elastic peer: the master's verdict), else ULFM or timeout-only by ``comm.ft.mode``
    (bounded by ``deadline``, the call's; None: ``comm.ft.timeout`` from now);
    None when ``comm`` is not fault tolerant."""
    own = getattr(comm, "recovery_policy", None)
    if own is not None:
        return own(opname, deadline)
    ft: FaultTolerance | None = comm.ft
    if ft is None:
        return None
    if ft.broken:
        raise ProcessFailed(f"communicator unusable after an earlier failure ({ft.broken})",
                            failed=ft.failed, rank=comm.rank, op=opname)
    if ft.mode == "ulfm":
        return UlfmPolicy(comm, opname, on_failure, deadline)
    return TimeoutPolicy(comm, opname, deadline)


def run_collective(comm, opname: str, attempt: Callable, restore: Callable | None = None,
                   on_failure: str | None = None, deadline: Deadline | None = None):
    """Run one collective on ``comm``, recovering from failures in FT mode.

    ``comm`` speaks a small protocol (``commlib.Communicator`` implements it):
    ``ft`` (a :class:`FaultTolerance` or None), ``rank``, ``size``,
    ``collective_transport()`` (the transport commlib's collectives run on) and
    ``shrink(transport)`` (ULFM recovery: returns ``(lost_world_ranks,
    kept)``, ``kept[i]`` the old rank of new rank ``i``); or
    ``recovery_policy(opname, deadline)`` giving its own policy.

    Args:
        comm: the communicator.
        opname: operation name for errors (``"allreduce"``...).
        attempt: ``attempt(transport, timeout, survivors)`` runs the whole
            collective once and returns its result; ``survivors`` lists the
            ranks of the call's original communicator still alive, in the order
            of the current one (``range(size)`` before any failure).
        restore: puts the input buffers back before a retry and before any
            error leaves the call.
        on_failure: override the communicator's ``on_failure`` for this call.
        deadline: the deadline of the whole call (None: a fault-tolerant
            communicator's ``ft.timeout`` from now; else no bound).  The attempt
            gets it as its ``timeout`` (every wait waits what is left of it;
            under ULFM's watchdog it bounds the attempt instead).

    Returns:
        whatever ``attempt`` returns.

    Raises:
        ProcessFailed: ``on_failure="raise"`` (after shrinking), or ``"timeout"`` mode.
        CommTimeout: a wait ran out of time in ``"timeout"`` mode; or, under
            ULFM, an attempt passed ``timeout`` with no process lost (on every
            survivor, after the communicator was rebuilt).
        InvalidArgument: inconsistent arguments (on every rank).
    """
    policy = policy_for(comm, opname, on_failure, deadline)
    if policy is None:
        if deadline is None:
            return attempt(comm.collective_transport(), None, range(comm.size))
        if getattr(comm, "bounded_first_use", False):  # a first use makes the transport within the deadline
            try:
                tp = comm.collective_transport(opname, timeout=max(deadline.left(), 1e-3))
            except CommTimeout as exc:
                raise CommTimeout(exc.detail, rank=comm.rank, op=opname) from exc
        else:
            tp = comm.collective_transport()
        return attempt(tp, deadline, range(comm.size))
    return run(policy, attempt, restore)
