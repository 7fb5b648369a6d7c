"""The resilient step runner: a user's training or solver step that outlives a dead rank.

:class:`ResilientRunner` runs a step function on a fault-tolerant communicator
(``commlib.init(fault_tolerant=True, on_failure="raise")`` under ULFM).  When a
rank dies anywhere inside the step (commlib raises
:class:`~commlib.ProcessFailed` or :class:`~commlib.CommTimeout` on the
survivors, from a collective, a point-to-point wait, a halo exchange or an
attention call), every survivor:

1. revokes what the step used (the communicators and exchanges registered with
   :meth:`ResilientRunner.revoke_on_failure`, and the communicator itself), so
   survivors blocked on a live neighbour are released and join the recovery;
2. shrinks the communicator (:meth:`commlib.Communicator.recover`: revoke,
   agree, shrink), unless the failure was raised by a collective that already
   shrank it (``exc.recovered``);
3. puts back the state of the last completed step (``load(snapshot)``, the
   snapshot taken by ``save()`` when that step committed);
4. calls the user's ``reshard(comm)`` with the survivors' communicator (the
   same object, now smaller) to re-decompose the data;
5. runs the step again.

A step *commits* when its function returned on every rank: the runner ends
each step with a barrier on the fault-tolerant communicator, whose outcome
ULFM's agreement makes the same on every survivor (Bland et al., "Post-failure
recovery of MPI communication capability", IJHPCA 27(3), 2013).  So every
survivor redoes the same step from the same state: a step either counts
everywhere or is redone everywhere.  The design follows torchft's ``Manager``
(a quorum per step, a commit that says whether the step counts) with the
difference that the group shrinks in place and the data parallelism
re-shards over the survivors, instead of a replica group restarting.

Without ULFM (``fault_tolerant`` in ``"timeout"`` mode, e.g. MPICH) a failure
cannot be recovered: the runner re-raises it at once, every wait having been
bounded, so the application can point at its last on-disk checkpoint.

Example (a torch training loop; the ranks shard each sequence)::

    comm = commlib.init(fault_tolerant=True, on_failure="raise", timeout=30)
    model, opt = Model(), torch.optim.AdamW(...)
    shard = Shard(comm)                              # the user's re-sharding
    runner = commlib.ResilientRunner(
        comm,
        save=lambda: (clone(model.state_dict()), copy.deepcopy(opt.state_dict())),
        load=lambda s: (model.load_state_dict(s[0]), opt.load_state_dict(s[1])),
        reshard=lambda c: shard.rebuild(c))

    def train_step(step):
        opt.zero_grad()
        loss = model(shard.inputs(batch(step)))      # sequence-parallel attention inside
        loss.backward()
        comm.allreduce(grads)                        # ... then opt.step()
        opt.step()
        return float(loss)

    for step in range(steps):
        loss = runner.run(train_step, step)          # survives a dead rank
    print(runner.failures)                           # what was lost, and how long recovery took
"""
from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from .core.errors import CommError, CommTimeout, InvalidArgument, ProcessFailed

__all__ = ["Failure", "ResilientRunner", "StateLost", "recovery_line"]


class _Unseen(ProcessFailed):
    """A failure the communicator recovered (it shrank) while the step ran,
    found when the step returned: the step is redone."""

    recovered = True


class StateLost(ProcessFailed):
    """The state a failure should go back to was lost with the failed ranks
    (e.g. a block and its buddy copy both): raised by a ``load`` or
    ``reshard`` callback, it ends :meth:`ResilientRunner.run` on every
    survivor instead of being recovered."""


@dataclass
class Failure:
    """One failure survived by :class:`ResilientRunner`.

    Attributes:
        step: the 1-based index of the step that failed (and was redone).
        failed: ``COMM_WORLD`` ranks lost in it (sorted tuple; empty after a
            timeout with no process lost: the step was redone on the same ranks).
        error: the exception the survivor saw first (its ``str``).
        detected_s: ``time.monotonic()`` when this rank saw the failure.
        detected_unix: the same moment as ``time.time()`` (to compare with
            other processes' clocks on one host, e.g. the victim's death).
        recovery_s: seconds from that moment to the start of the redone step
            (revoke, shrink, state restore and re-shard included).
        lost_s: seconds of the failed attempt before the failure was seen
            (work lost, redone after the recovery).
        ranks_after: the communicator's size after the recovery.
    """

    step: int
    failed: tuple
    error: str
    detected_s: float
    detected_unix: float = float("nan")
    recovery_s: float = float("nan")
    lost_s: float = float("nan")
    ranks_after: int = 0


class ResilientRunner:
    """Run steps on a fault-tolerant communicator, redoing a step a dead rank interrupted.

    Args:
        comm: a :class:`commlib.Communicator` from
            ``commlib.init(fault_tolerant=True, on_failure="raise")``.  Under
            ULFM failures are recovered; in ``"timeout"`` mode (no ULFM) and on
            a communicator that is not fault tolerant they are re-raised.
        save: ``save() -> snapshot``: the state to go back to (parameters,
            optimizer, data position...), called once per committed step,
            before the next step starts; None when the step changes no state
            before it commits, or ``load`` rebuilds it another way.
        load: ``load(snapshot)``: restores that state after a failure, on the
            survivors' communicator (it may communicate, e.g. gather buddy
            checkpoints); None: nothing to restore.
        reshard: ``reshard(comm)``: re-decompose the work over the survivors
            (``comm`` is the shrunk communicator), called after ``load``.
        max_retries: times one step may be redone before the failure is
            re-raised (a guard against a step that fails for ever).
        commit: end each step with a fault-tolerant barrier (the commit);
            False when the step's own last call is a collective of ``comm``
            (whose outcome is already the same on every survivor).
        log: where rank 0 of the survivors says each recovery, in one line
            (:func:`recovery_line`: the lost ranks, the time, the ranks left;
            under Open MPI also what its ``NBC_Progress: an error 75 ...
            aborting the schedule`` lines printed with the failure mean): a
            file, ``"stderr"`` (the default: ``sys.stderr`` as it is when a
            recovery is said, so a later redirection is followed), a callable
            taking the line, or None
            (say nothing; :attr:`failures` holds the same).

    Attributes:
        failures: list of :class:`Failure`, in order.
        completed: steps committed so far.

    Raises:
        InvalidArgument: bad arguments (on every rank alike).
        ProcessFailed, CommTimeout: from :meth:`run`, a failure that cannot be
            recovered (no ULFM, or more than ``max_retries`` redos of one step).
    """

    def __init__(self, comm, *, save: Callable[[], Any] | None = None,
                 load: Callable[[Any], None] | None = None, reshard: Callable[[Any], None] | None = None,
                 max_retries: int = 8, commit: bool = True, log: Any = "stderr"):
        for name, fn in (("save", save), ("load", load), ("reshard", reshard)):
            if fn is not None and not callable(fn):
                raise InvalidArgument(f"{name} must be callable or None, got {type(fn).__name__}",
                                      rank=getattr(comm, "rank", None), op="ResilientRunner")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgument(f"max_retries must be an integer >= 0, got {max_retries!r}",
                                  rank=getattr(comm, "rank", None), op="ResilientRunner")
        self.comm = comm
        self.save, self.load, self.reshard = save, load, reshard
        self.max_retries = max_retries
        self.commit = commit
        stderr = isinstance(log, str) and log == "stderr"
        if log is not None and not stderr and not callable(log) and not callable(getattr(log, "write", None)):
            raise InvalidArgument(f"log must be a file, \"stderr\", a callable or None, got {type(log).__name__}",
                                  rank=getattr(comm, "rank", None), op="ResilientRunner")
        self.log = log
        self.failures: list[Failure] = []
        self.completed = 0
        self._revocable: list = []
        self._snapshot = None
        self._have_snapshot = False
        self._lost: set = set()  # COMM_WORLD ranks lost when the current attempt began
        self._attempt_start = time.monotonic()

    @property
    def recoverable(self) -> bool:
        """True when a failure is recovered (ULFM), False when it is re-raised."""
        return getattr(self.comm, "fault_tolerant", None) == "ulfm"

    def revoke_on_failure(self, obj) -> None:
        """Register ``obj`` (anything with ``revoke()``: a child communicator, a
        halo exchange) to be revoked on a failure before the shrink, so ranks
        blocked on it are released (the last registered first).  Registrations
        last until :meth:`forget_revocable` (call it when the objects are
        rebuilt in ``reshard``)."""
        self._revocable.append(obj)

    def forget_revocable(self) -> None:
        """Drop every registration of :meth:`revoke_on_failure`."""
        self._revocable.clear()

    def checkpoint(self) -> None:
        """Take the snapshot now (``save()``): the state a failure goes back to.

        :meth:`run` calls it before its first step and after each commit; call
        it yourself when the state changes between steps outside the runner."""
        if self.save is not None:
            self._snapshot = self.save()
        self._have_snapshot = True

    def run(self, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` as one step; redo it after a recovered failure.

        Returns:
            ``fn``'s return value on the attempt that committed.

        Raises:
            ProcessFailed, CommTimeout: not recoverable (see the class).
            StateLost: raised by ``load`` or ``reshard``.
            Exception: any other exception ``fn`` raises, unchanged (a bug is not a failure).
        """
        if not self._have_snapshot:
            self.checkpoint()
        retries = 0
        failure: BaseException | None = None
        while True:
            try:
                if failure is not None:  # a failure during the recovery itself is recovered in turn
                    rec = self._recover(failure)
                    failure = None
                    rec.recovery_s = time.monotonic() - rec.detected_s
                    self._say(rec)
                # the ranks lost so far (a collective that shrinks before it raises adds to them)
                self._lost = set(self.comm.failed_ranks)
                self._attempt_start = time.monotonic()
                result = fn(*args, **kwargs)
                comm = self.comm
                if self.commit and comm.size > 1:
                    comm.barrier()  # commlib's fault-tolerant barrier: the commit
                lost = set(comm.failed_ranks) - self._lost
                if lost:  # a call the step did not wait on (e.g. on a worker thread) recovered a failure
                    raise _Unseen(f"COMM_WORLD rank(s) {sorted(lost)} failed inside the step (recovered by "
                                  "a call whose error the step did not see)", failed=tuple(sorted(lost)),
                                  rank=comm.rank, op="ResilientRunner.run")
            except StateLost:
                self._bound_finalize()
                raise
            except (ProcessFailed, CommTimeout) as exc:
                if not self.recoverable or retries >= self.max_retries:
                    self._bound_finalize()
                    raise
                retries += 1
                failure = exc
                continue
            self.completed += 1
            self.checkpoint()
            return result

    def _say(self, rec: Failure) -> None:
        """Rank 0 of the survivors writes :func:`recovery_line` to :attr:`log`."""
        if self.log is None or self.comm.rank != 0:
            return
        line = recovery_line(rec, open_mpi=_open_mpi())
        if callable(self.log):
            self.log(line)
            return
        out = sys.stderr if isinstance(self.log, str) else self.log  # "stderr": the stream of now
        try:
            out.write(line + "\n")
            out.flush()
        except (OSError, ValueError):  # a closed or broken stream: the record stays in failures
            pass

    def _bound_finalize(self) -> None:
        """A failure leaves this call: bound the MPI library's finalize at exit, which
        can otherwise wait for ever for the dead ranks (fault-tolerant mode only)."""
        ft = getattr(self.comm, "ft", None)
        if ft is not None:
            ft.bound_finalize()

    # ------------------------------------------------------------ recovery
    def _recover(self, exc: BaseException) -> Failure:
        """Revoke, shrink, restore, re-shard (every survivor); returns the record."""
        t0, t0_unix = time.monotonic(), time.time()
        comm = self.comm
        for obj in reversed(self._revocable):  # the last built first, as a with-statement unwinds
            try:
                obj.revoke()
            except CommError:  # already revoked, or its peers gone
                pass
        if not getattr(exc, "recovered", False):
            comm.recover()
        failed = tuple(sorted(set(comm.failed_ranks) - self._lost))
        self._lost = set(comm.failed_ranks)  # a failure in load or reshard is a failure of its own
        rec = Failure(step=self.completed + 1, failed=failed, error=" ".join(str(exc).split()), detected_s=t0,
                      detected_unix=t0_unix, lost_s=t0 - self._attempt_start)
        self.failures.append(rec)
        if self.load is not None:
            self.load(self._snapshot)
        if self.reshard is not None:
            self.reshard(comm)
        rec.ranks_after = comm.size
        return rec


def recovery_line(rec: Failure, open_mpi: bool = False) -> str:
    """One line on a recovered failure: which ``COMM_WORLD`` ranks were lost,
    how long the recovery took and on how many ranks the interrupted step (a
    :meth:`ResilientRunner.run` call) is redone; with ``open_mpi``, also what Open MPI's ``NBC_Progress: an error 75
    ... aborting the schedule`` lines mean, which its non-blocking collectives
    print (unconditionally, whatever the verbosity) when a rank dies during one
    of them (75 is ``MPI_ERR_PROC_FAILED``)."""
    lost = ", ".join(map(str, rec.failed)) or "unknown"
    line = (f"commlib: lost COMM_WORLD rank{'s' * (len(rec.failed) != 1)} {lost}; recovered in {rec.recovery_s:.2f} s, "
            f"{rec.ranks_after} rank{'s' * (rec.ranks_after != 1)} redo{'es' * (rec.ranks_after == 1)} the interrupted "
            "step from its last saved state")
    if open_mpi:
        line += ("; Open MPI's 'NBC_Progress: an error 75 ... aborting the schedule' lines, if printed, are that "
                 "loss seen by a collective in flight (75: MPI_ERR_PROC_FAILED), not another fault")
    return line


@functools.lru_cache(maxsize=1)
def _open_mpi() -> bool:
    try:
        from mpi4py import MPI  # noqa: PLC0415

        return "Open MPI" in MPI.Get_library_version()
    except Exception:  # noqa: BLE001 - no MPI: no Open MPI line to explain
        return False
