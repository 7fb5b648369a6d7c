"""The elastic peer as a group of the collective engine: the master's verdict as
its recovery policy, and the collectives beside the all-reduce as front ends of
:class:`commlib.collectives.engine.Engine`.

An elastic peer (:class:`~commlib.elastic.peer.Peer`) is a *group*: its
transport is the current epoch's :class:`~commlib.transports.tcp.TCPTransport`
and its recovery policy is :class:`MasterPolicy` (each call is reported to the
master, which commits it on every member or aborts it on every member; an
aborted call is retried over the next epoch's members).  The engine runs every
collective from its row of :data:`commlib.collectives.specs.SPECS`, with the
same algorithm modules as an MPI :class:`~commlib.Communicator`: the first
round agrees on the call (a bad or differing argument on any member raises
:class:`~commlib.InvalidArgument` on every member before any payload byte
moves; small calls travel inside it), then the algorithm runs over the TCP
transport under the call's deadline.

What each collective does when a member dies mid-call (the master aborts the
call on every member, every member's buffers hold their input again, and the
call is retried over the survivors within its ``timeout``):

- ``bcast``: completes over the survivors if the root survived; if the root
  died before the master committed the call, every survivor raises
  :class:`~commlib.PeerFailure` (nobody else holds the root's data), ``buf``
  holding its input;
- ``allgather`` / ``alltoall``: complete over the survivors; the result has one
  block per member of the epoch the call committed in (:attr:`Peer.members`
  after the call names them, in rank order): ``(size,) + sendbuf.shape`` and
  ``(size, count // size_at_call)``; an all-to-all survivor keeps the blocks it
  addressed to the survivors;
- ``reduce_scatter``: completes over the survivors: the reduction over them,
  split by the committing epoch's size, this member's block;
- ``barrier``: completes over the survivors; no member leaves before every
  member of the committing epoch entered it.

Joins happen only between calls (:meth:`Peer.update_topology`).
"""
from __future__ import annotations

import numpy as np

from commlib.collectives.agreement import NeighbourRefusal
from commlib.collectives.engine import Engine
from commlib.collectives.recovery import RecoveryPolicy
from commlib.core.errors import CommError, CommTimeout, InvalidArgument, PeerClosed, PeerFailure, ProcessFailed
from commlib.core.seconds import Deadline

from .protocol import DONE, FAIL, REFUSE, REPORT_FLOOR, WHY_MAX
from .state_sync import one_thread

__all__ = ["MasterPolicy", "ElasticGroup", "VERDICT_GRACE", "ANSWER_GRACE"]

#: seconds past the call's deadline a peer still waits for the master's verdict on a
#: report it sent (the master answers the last report within milliseconds)
VERDICT_GRACE = 0.25
#: seconds a peer that gave a call up for want of a verdict waits for the master's
#: answer: the verdict it sent before the give-up reached it (committed: the result
#: stands), or the refusal the give-up made (every member raises)
ANSWER_GRACE = 0.25


class MasterPolicy(RecoveryPolicy):
    """The elastic master's verdict as a recovery policy (PCCL's model).

    An attempt runs on the current epoch's transport under tag ``(epoch,
    seq)``; :meth:`settle` reports ``done`` or ``fail`` to the master and waits
    for its terminal message: committed on every member, or aborted on every
    member.  :meth:`recover` waits for the next epoch (the survivors, fresh
    connections) and retries, within the call's deadline and ``max_retries``.
    Argument errors found by the first round are the same on every member:
    reported ``done``, raised everywhere (so is an error the engine marks
    ``agreed``: a rooted call's lost root); one found by a ring member's
    neighbour check alone (:class:`~commlib.collectives.agreement.NeighbourRefusal`)
    is reported ``refuse``, and the master's verdict carries its message to every
    member.  Every wait is bounded by the call's deadline.

    Args:
        peer: the :class:`~commlib.elastic.peer.Peer`.
        opname: the operation, for errors.
        deadline: the call's :class:`~commlib.core.seconds.Deadline`; each
            attempt gets it as its ``timeout`` (one bound for the whole call).
        retry: retry an aborted call over the next epoch (else PeerFailure).
        max_retries: aborts tolerated before PeerFailure.
        members: the topology the call started in (its ranks: ``ids``), or None
            (the first attempt's): ``survivors`` maps the ranks of a retry's
            epoch back to them, by peer id.
    """

    def __init__(self, peer, opname: str, deadline: Deadline, retry: bool = True, max_retries: int = 16,
                 members=None):
        self.peer, self.opname, self.deadline = peer, opname, deadline
        self.timeout = deadline.timeout
        self.retry, self.max_retries = retry, max_retries
        self.members = members
        self.aborts = 0
        self.tag = None
        self.decided = False  # the group decided how the call ends (committed, refused, given up)

    def _left(self) -> float:
        return self.deadline.left()

    def start(self):
        peer = self.peer
        if peer._closed:
            raise PeerClosed("this peer was closed (close() was called)", rank=peer.rank, op=self.opname)
        topo = peer._adopt()
        if topo is None or topo.rank is None:
            raise InvalidArgument("this peer is not a member yet: call update_topology() first",
                                  rank=None, op=self.opname)
        if peer._lost is not None:
            raise CommError(peer._lost, rank=topo.rank, op=self.opname)
        self.tag = (topo.epoch, peer._seq)  # (the call's number is spent even if the wait below raises)
        tr = peer._transport(topo)
        if tr.revoked and peer._aborted_epoch == topo.epoch and peer._seq not in peer._dead_calls:
            # the master aborted an operation of this epoch (a member's failure, no death
            # known yet): its next epoch is on the way (after its abort_grace); this call
            # runs there instead of failing at once on the aborted one
            e = topo.epoch
            peer._wait(lambda: True if ((peer._latest is not None and peer._latest.epoch > e)
                                        or peer._seq in peer._dead_calls) else None,
                       self._left(), self.opname)
            topo = peer._adopt()
            tr = peer._transport(topo)
        self.tag = (topo.epoch, peer._seq)
        if peer._seq in peer._dead_calls:
            # another member gave this call up (e.g. it timed out while this peer was
            # late for it): it fails here too, before anything is sent; the epoch's
            # transport exists, so what the others sent for it is taken and dropped
            self.decided = True
            data, first = tr.operation_tags(peer._seq)
            tr.abort_tags((*data, *first))
            raise peer._dead_error(peer._seq, self.opname)
        if self.members is None:
            self.members = topo
        if topo is self.members:
            survivors = range(len(topo.ids))
        else:
            ids0 = self.members.ids
            survivors = [ids0.index(i) for i in topo.ids if i in ids0]
            if len(survivors) != len(topo.ids):  # pragma: no cover - the master admits joiners at votes only
                raise PeerFailure(f"{self.opname}: peers joined the group during the call", rank=topo.rank,
                                  op=self.opname)
        tr.begin_operation(peer._seq)  # the call's tags follow from (epoch, seq) alone
        return tr, self.deadline, survivors

    def is_failure(self, tp, exc) -> bool:
        return (isinstance(exc, (CommError, OSError)) and not isinstance(exc, InvalidArgument)
                and not getattr(exc, "agreed", False))

    def failed(self, tp, exc) -> None:
        # the attempt may have left receives posted into the caller's buffer: stop the
        # transport placing frames (the epoch's operation is aborted anyway) before
        # the runner restores the input
        tp.revoke(f"this peer's attempt failed ({type(exc).__name__})")

    def settle(self, tp, outcome) -> bool:
        peer, (e, s) = self.peer, self.tag
        if outcome.badarg:
            # the calls differ (or an argument is bad): frames of this call still on
            # their way (a member whose call chose another path) are dropped, not kept
            data, first = tp.operation_tags(s)
            tp.abort_tags((*data, *first))
        if s not in peer._dead_calls:
            agreed = outcome.error is not None and (outcome.badarg or getattr(outcome.error, "agreed", False))
            bad = outcome.failure is not None or (outcome.error is not None and not agreed)
            # the report is bounded by what is left of the call, with a floor: an attempt
            # that ran out of time still reports (the master decides for every member once
            # each has; unsent, the others would wait out their deadlines for a verdict)
            bound = max(self._left(), REPORT_FLOOR)
            if isinstance(outcome.error, NeighbourRefusal):
                # this member alone saw that the calls differ: the master makes it every member's
                peer._send({"t": REFUSE, "e": e, "s": s, "why": outcome.error.detail[:WHY_MAX]}, bound, self.opname)
            else:
                peer._send({"t": FAIL if bad else DONE, "e": e, "s": s}, bound, self.opname)
            # the verdict follows the last member's report: bounded by what is left of
            # the call, plus the master's answer to a report sent at the very end (or
            # another member gives the call up)
            try:
                ok = peer._wait(lambda: peer._terms.pop((e, s), None) if s not in peer._dead_calls else False,
                                self._left() + VERDICT_GRACE, self.opname)
            except CommTimeout:
                ok = self._give_up_for_verdict(e, s)
            if ok:
                self.decided = True
                return True
        if s in peer._dead_calls:
            # another member gave the call up: it ends on every member
            outcome.error, outcome.failure = peer._dead_error(s, self.opname), None
            self.decided = True
            return True
        why = peer._refusals.pop((e, s), None)
        if why is not None:
            # refused by a member whose call differs from its neighbour's: its message is
            # raised on every member alike (this one's own view of the difference, e.g. a
            # first-round message of another size, names less)
            outcome.error, outcome.failure = InvalidArgument(why, rank=peer.rank, op=self.opname), None
            self.decided = True
            return True
        if outcome.error is not None and not outcome.badarg:
            raise outcome.error  # this peer's own error: not a failure to retry
        return False

    def _give_up_for_verdict(self, e: int, s: int) -> bool:
        """The call's deadline passed with no verdict (a member has not reported: it
        stalls, or the master is slow): give the call up on every member and take
        the master's answer, so the call ends the same way everywhere: True when
        the master had committed it first (the result stands).

        Raises:
            CommTimeout: the call was given up (every member raises), or the master
                did not answer within :data:`ANSWER_GRACE`.
        """
        peer = self.peer
        peer._give_up(s, "timeout", f"no verdict within the call's {self.timeout:g} s timeout")
        self.decided = True
        ok = peer._wait(lambda: peer._terms.pop((e, s), None), ANSWER_GRACE, self.opname)
        peer._refusals.pop((e, s), None)
        if ok:
            return True
        raise CommTimeout(f"no committed result within the call's {self.timeout:g} s timeout (a member did not "
                          "report; the call was given up on every member)", rank=peer.rank, op=self.opname)

    def recover(self, tp, outcome) -> None:
        peer, e = self.peer, self.tag[0]
        peer._counts["aborts"] += 1
        self.aborts += 1
        cause = outcome.failure if outcome.failure is not None else outcome.error
        why = f"{type(cause).__name__}: {cause}" if cause is not None else "another member failed"
        if not self.retry or self.aborts > self.max_retries:
            raise PeerFailure(f"{self.opname} aborted in epoch {e} ({why})", rank=tp.rank, op=self.opname)
        if self._left() <= 0:
            raise CommTimeout(f"no committed result within the call's {self.timeout:g} s timeout "
                              f"({self.aborts} abort(s); last: {why}); did every member call it?",
                              rank=tp.rank, op=self.opname)
        # the next epoch (survivors, fresh connections) comes from the master; the call
        # number is kept: the retry is the same call, in the next epoch
        s = self.tag[1]
        peer._wait(lambda: True if s in peer._dead_calls or (peer._latest is not None and peer._latest.epoch > e)
                   else None, self._left(), self.opname)
        if s in peer._dead_calls:
            self.decided = True
            raise peer._dead_error(s, self.opname)
        peer._counts["retries"] += 1

    def ended(self, exc: BaseException | None) -> None:
        """The call is over (``exc``: the error leaving it): its number is spent;
        an error the group did not decide gives the call up on every member
        (:meth:`Peer._give_up`)."""
        if self.tag is None:
            return
        peer, s = self.peer, self.tag[1]
        peer._seq = max(peer._seq, s + 1)
        if exc is not None and not self.decided and s not in peer._dead_calls and not peer._closed:
            # (a peer that left gives nothing up: the others retry without it, as after a death)
            peer._give_up(s, "timeout" if isinstance(exc, CommTimeout) else "fail", f"{type(exc).__name__}: {exc}")


class _Bound:
    """What the engine reads of a fault-tolerant group: its default call ``timeout``."""

    __slots__ = ("peer",)

    def __init__(self, peer):
        self.peer = peer

    @property
    def timeout(self) -> float:
        return self.peer.timeout


class ElasticGroup:
    """The elastic peer as a group of the collective engine (a mixin of
    :class:`~commlib.elastic.peer.Peer`), and its collectives beside the
    all-reduce: ``bcast``, ``allgather``, ``reduce_scatter``, ``alltoall``,
    ``barrier`` (see the module docstring for what each does when a member dies).

    Every call takes ``timeout``: the deadline of the whole call in seconds,
    retries included (default: the peer's ``timeout``).  On every error the
    caller's buffers hold their input again before the error leaves the call.
    """

    #: the engine runs the first round of every call (the argument agreement the
    #: master's verdict relies on), whatever ``COMMLIB_CHECK_ARGS`` says
    always_agree = True
    #: the TCP transport carries first rounds on tags of its own: the engine runs a
    #: row's TCP path where it has one (the all-reduce's strategies)
    own_first_round = True
    #: ranks lost inside a call are not tracked: the next epoch has the survivors
    failed_ranks = ()
    _engine = None
    _policy = None
    _policy_opts = (True, 16)

    _bound = None

    @property
    def ft(self):
        """The bound the engine gives a call without ``timeout``: ``ft.timeout`` (the peer's)."""
        bound = self._bound
        if bound is None:
            bound = self._bound = _Bound(self)
        return bound

    def recovery_policy(self, opname: str, deadline: Deadline) -> MasterPolicy:
        """The group's recovery policy for one call (:func:`commlib.collectives.ft.policy_for`)."""
        retry, max_retries = self._policy_opts
        topo = self._topo
        self._policy = MasterPolicy(self, opname, deadline, retry, max_retries,
                                    members=topo if topo is not None and topo.rank is not None else None)
        return self._policy

    def _run(self, opname: str, sendbuf=None, op="sum", root=None, timeout=None, retry: bool = True,
             max_retries: int = 16, quantize=None):
        """One collective through the engine under :class:`MasterPolicy`.

        This member's bad argument: a row with a TCP path (the all-reduce) raises
        it here before anything moves and gives the call up on every member
        (:meth:`_refuse_call`: the others raise InvalidArgument naming it); the
        other rows carry it in their first round's error flag, which every
        member reads."""
        self._check_open(opname)
        # the call's ranks are those this peer's topology gave before the call (rank, size,
        # members as the caller read them); a newer epoch (a death since) is taken by the
        # policy's first attempt, its members mapped back to these ranks (survivors)
        topo = self._topo if self._topo is not None else self._adopt()
        if topo is None or topo.rank is None:
            raise InvalidArgument("this peer is not a member yet: call update_topology() first", op=opname)
        if self._engine is None:
            self._engine = Engine(self)
        self._policy, self._policy_opts = None, (retry, max_retries)
        try:
            out = self._engine.execute(opname, sendbuf, None, op, "auto", root, timeout=timeout, quantize=quantize)
        except BaseException as exc:
            if self._policy is not None:
                self._policy.ended(exc)
            elif isinstance(exc, InvalidArgument):  # this member's own argument, found before the call
                self._refuse_call(exc)
            if isinstance(exc, ProcessFailed) and not isinstance(exc, PeerFailure):
                raise PeerFailure(exc.detail, failed=exc.failed, rank=self.rank, op=opname) from None
            raise
        finally:
            self._policy_opts = (True, 16)
        if self._policy is not None:
            self._policy.ended(None)
        return out

    @one_thread("allreduce")
    def allreduce(self, buf: np.ndarray, op: str = "sum", quantize: str | None = None, retry: bool = True,
                  timeout: float | None = None, max_retries: int = 16) -> np.ndarray:
        """All-reduce ``buf`` in place over the current members; bit-identical on all.

        The collective engine's all-reduce row over the epoch's TCP transport
        (its strategies by size and group size: :mod:`commlib.collectives.allreduce_tcp`),
        under the master's verdict: every member reports, the master commits the
        call on every member or aborts it on every member, and an aborted call
        is retried over the next epoch's members (``retry``).  Calls that differ
        between members raise InvalidArgument on every member, naming the
        difference; a member's own bad argument raises there at once, before
        anything is sent, and the call is given up on every member (each raises
        InvalidArgument naming it).  Calls are paired by their number: a call
        one member leaves with an error the group did not decide (its timeout,
        ``retry=False`` after an abort) fails on every member, a late one
        included.  On every error ``buf`` holds its input again, bit for bit.

        Args:
            buf: writable C-contiguous numpy array (any shape) of a numeric dtype;
                the same dtype and size on every member.
            op: a name of :data:`commlib.collectives.ops.OPS` (``"sum"``, ``"avg"``,
                ``"min"``, ``"max"``, ``"prod"``, bitwise ops on integers).
            quantize: None, ``"fp16"`` or ``"int8"`` (floating dtypes only): the
                wire format of each message; every member still ends with the same bits.
            retry: on an abort, retry over the survivors (else raise PeerFailure).
            timeout: the deadline of the whole call in seconds, retries included
                (default: the peer's ``timeout``).
            max_retries: aborts tolerated before PeerFailure.

        Returns:
            ``buf``.

        Raises:
            InvalidArgument: bad buffer, op, quantize or timeout on any member, or
                calls that differ (on every member alike); not a member; another
                thread of this peer is in a call (this peer alone).
            PeerFailure: aborted and ``retry=False`` (or more than ``max_retries``
                aborts); or another member gave this call up after one.
            CommTimeout: no committed result within ``timeout`` (e.g. a member
                did not call it), here or on a member that gave the call up.
            PeerClosed: this peer was closed.
            CommError: the master is lost.
        """
        return self._run("allreduce", buf, op=op, timeout=timeout, retry=retry, max_retries=max_retries,
                         quantize=quantize)

    def _refuse_call(self, error: InvalidArgument) -> None:
        """This member's next call is invalid here (``error``, found before anything
        moved): give it up on every member, so the others raise at once instead of
        waiting for their timeout.  Nothing to tell when this peer is not a member,
        closed or without its master."""
        if self._closed or self._lost is not None:
            return
        topo = self._adopt()
        if topo is None or topo.rank is None:
            return
        s = self._seq
        self._seq = s + 1
        # the epoch's transport, so the members' sends of this call (dialled to this
        # peer) are taken and dropped, not left waiting for a connection it never serves
        self._transport(topo)
        self._give_up(s, "arg", error.detail)

    @one_thread("bcast")
    def bcast(self, buf, root: int = 0, timeout: float | None = None, retry: bool = True) -> np.ndarray:
        """Broadcast ``buf`` from member ``root`` (a rank) to every member, in place.

        Args:
            buf: C-contiguous array (numpy or a CPU array exposing the buffer
                protocol); the same dtype and size on every member; written on
                every member but the root (whose ``buf`` may be read-only).
            root: the rank whose ``buf`` is sent (the same on every member).
            timeout: the deadline of the whole call, seconds (default: the peer's).
            retry: retry over the survivors after a non-root member's death.

        Returns:
            ``buf``, holding root's data on every member (bit-identical).

        Raises:
            InvalidArgument: on every member, before any byte moves, when a
                member's arguments are bad or the members' calls differ.
            PeerFailure: the root died before the master committed the call
                (on every survivor, ``buf`` holding its input), or ``retry=False``
                after an abort.
            CommTimeout: no committed result within ``timeout``.
        """
        return self._run("bcast", buf, root=root, timeout=timeout, retry=retry)

    @one_thread("allgather")
    def allgather(self, sendbuf, timeout: float | None = None, retry: bool = True) -> np.ndarray:
        """Gather every member's ``sendbuf`` on every member.

        Returns:
            a new numpy array of shape ``(size,) + sendbuf.shape``: block ``i`` is
            rank ``i``'s ``sendbuf``, ranks of the epoch the call committed in
            (after a death mid-call, the survivors': :attr:`members` names them).

        Raises:
            InvalidArgument: on every member, before any byte moves, when a
                member's arguments are bad or the calls differ (count, dtype).
            PeerFailure: ``retry=False`` after an abort.
            CommTimeout: no committed result within ``timeout``.
        """
        return self._run("allgather", sendbuf, timeout=timeout, retry=retry)

    @one_thread("reduce_scatter")
    def reduce_scatter(self, sendbuf, op: str = "sum", timeout: float | None = None,
                       retry: bool = True) -> np.ndarray:
        """Reduce every member's ``sendbuf`` element-wise (``op``) and return this
        member's block: ``chunk_bounds(count, size)`` (the first ``count % size``
        blocks one element longer), bit-identical to the same block of an
        all-reduce's result (the ring's order), over the members of the epoch the
        call committed in.

        Raises:
            as :meth:`allgather`.
        """
        return self._run("reduce_scatter", sendbuf, op=op, timeout=timeout, retry=retry)

    @one_thread("alltoall")
    def alltoall(self, sendbuf, timeout: float | None = None, retry: bool = True) -> np.ndarray:
        """Block ``j`` of ``sendbuf`` (``size`` equal blocks of its flattened
        elements) goes to rank ``j``.

        Returns:
            a new numpy array of shape ``(size, count // size_at_call)``: row ``i``
            is what rank ``i`` addressed to this member, ranks of the epoch the
            call committed in (after a death mid-call, the survivors').

        Raises:
            InvalidArgument: as :meth:`allgather`; also a count not divisible by ``size``.
        """
        return self._run("alltoall", sendbuf, timeout=timeout, retry=retry)

    @one_thread("barrier")
    def barrier(self, timeout: float | None = None, retry: bool = True) -> None:
        """Return once every member has entered the barrier (the first round's
        all-gather, then the master's commit after every member reported).

        Raises:
            CommTimeout: a member did not enter within ``timeout``.
            PeerFailure: ``retry=False`` after an abort.
        """
        self._run("barrier", timeout=timeout, retry=retry)
