"""The transport contract: the only door to the wire.

A transport moves bytes between the ``size`` ranks of a group.  Everything in
commlib that communicates (the collective algorithms, the halo exchange,
attention, typed sends, fault-tolerance recovery, the apps through the user
API) goes through a :class:`Transport`; only the transport modules
(:mod:`commlib.transports.mpi`, later ``tcp``) call the wire library.  A test
greps the package for communication calls anywhere else.

The contract:

* point to point: ``isend``/``irecv`` (and blocking ``send``/``recv``/
  ``sendrecv``) of a contiguous array, or of a :class:`Wire` message: raw
  bytes, bytes packed by :mod:`commlib.datatypes` (``"packed"``), or, on the
  MPI transport only, ``count`` elements of an ``MPI.Datatype``;
* persistent requests: ``send_init``/``recv_init``, started by ``startall``;
* ``waitall(requests, timeout)``: completes them; every failure comes out as a
  classified :class:`~commlib.CommError` (:class:`~commlib.ProcessFailed`,
  :class:`~commlib.CommTimeout`, ...) naming the rank and the operation, never
  as the wire library's own exception;
* device buffers: the producing stream is synchronized (``synchronize``)
  before a send reads a device buffer;
* optional native collectives (``native_allreduce`` ...): a transport that has
  none raises :meth:`Transport.unsupported`, as torch.distributed's c10d
  ``Backend`` does;
* facts about the group (``node_peers``, ``cuda_aware``, ``tag_ub``) are
  computed once, collectively, when the transport is created, never inside a
  point-to-point call;
* tags: each transport owns a :class:`~commlib.core.tags.TagAllocator`
  (``tags``) for the operations commlib runs on it.

Requests are one handle type, :class:`Request`, which also speaks
``concurrent.futures.Future``'s interface (``done``, ``result``,
``exception``, ``add_done_callback``), as mpi4py.futures does.
"""
from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from commlib.core.errors import CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import check_timeout
from commlib.core.tags import USER_TAG_MAX, TagAllocator

__all__ = ["Request", "CompletedRequest", "FutureRequest", "Transport", "Wire", "wait_all", "check_plain_dtype",
           "register_op_names", "native_op_name"]

#: functions naming a wire library's own reduction objects, one per transport module that registered
_OP_NAMERS: list[Callable[[Any], "str | None"]] = []


def register_op_names(namer: Callable[[Any], "str | None"]) -> Callable[[Any], "str | None"]:
    """Let :func:`native_op_name` recognize a wire library's own reduction objects.

    A transport module calls this once, when it is imported, with its function
    from such an object to the name of commlib's operator
    (:mod:`commlib.collectives.ops`), e.g. :func:`commlib.transports.mpi.op_name`:
    ``MPI.SUM`` -> ``"sum"``.  The collectives thus accept ``MPI.SUM`` without
    importing MPI: the object can exist only once mpi4py is loaded, by the
    process's MPI transport.

    Args:
        namer: ``namer(obj)`` returns the operator's name, or None for an object it does not know.

    Returns:
        ``namer`` (usable as a decorator).
    """
    if namer not in _OP_NAMERS:
        _OP_NAMERS.append(namer)
    return namer


def native_op_name(op) -> str | None:
    """The name (``"sum"``...) of commlib's operator for a wire library's own
    reduction object (``MPI.SUM``), as a registered transport names it
    (:func:`register_op_names`); None when no registered transport knows ``op``."""
    for namer in _OP_NAMERS:
        name = namer(op)
        if name is not None:
            return name
    return None


def check_plain_dtype(dtype, rank, op: str, what: str = "buffer") -> None:
    """Refuse elements that are not plain bytes: the one check of what can travel.

    A dtype with references (``dtype=object``, or a structured dtype with an
    object field: ``numpy.dtype.hasobject``) holds Python object pointers; sent
    as bytes they would be dangling addresses on the receiver (which crashes
    reading them).  Every collective (through its argument agreement, so every
    rank raises), every point-to-point call (before a send or receive is
    posted) and the halo exchange call this.

    Args:
        dtype: a numpy dtype (or anything with ``.hasobject``; None passes).
        rank, op: for the message.
        what: the argument's name (``"sendbuf"``...).

    Raises:
        InvalidArgument: ``dtype`` holds references.
    """
    if dtype is not None and getattr(dtype, "hasobject", False):
        raise InvalidArgument(f"{what} has dtype {dtype}, which holds Python object pointers (references) that "
                              "cannot be sent; use a numeric dtype, or pickle the objects into a uint8 array",
                              rank=rank, op=op)


class Wire(NamedTuple):
    """A message as it goes on the wire.

    Attributes:
        obj: the memory (host or device array, contiguous).
        count: elements of ``datatype`` (bytes for ``"byte"`` / ``"packed"``).
        datatype: ``"byte"``, ``"packed"`` (bytes made by ``commlib.datatypes.pack``;
            MPI's ``MPI_PACKED``, which matches any type signature, MPI-4.0 §5.2),
            or an ``MPI.Datatype`` (MPI transport only).
    """

    obj: Any
    count: int
    datatype: Any = "byte"


class Request(ABC):
    """Handle of a non-blocking operation (point to point or collective).

    ``test()``/``wait(timeout)`` as MPI's; ``done()``, ``result(timeout)``,
    ``exception(timeout)``, ``add_done_callback(fn)``, ``cancel()`` and
    ``cancelled()`` as ``concurrent.futures.Future``'s.
    """

    @abstractmethod
    def test(self) -> bool:
        """Return True (and finish the operation) if it has completed; never blocks.

        Raises:
            CommError: the operation failed.
        """

    def wait(self, timeout: float | None = None):
        """Block until the operation completes; returns its result (None for point to point).

        Args:
            timeout: seconds (a finite number >= 0; 0 tests once: a poll);
                None waits as long as it takes.

        Raises:
            InvalidArgument: ``timeout`` is NaN, infinite, negative, a bool or
                not a number (nothing is waited for; the request stays valid).
            CommTimeout: when ``timeout`` passes first.
            CommError: the operation failed.
        """
        op = type(self).__name__ + ".wait"
        rank = getattr(self, "rank", None)
        timeout = check_timeout(timeout, op=op, rank=rank if isinstance(rank, int) else None, zero=True)
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        pause = 1e-6
        while not self.test():
            if time.monotonic() > deadline:
                raise CommTimeout(f"request not complete after {timeout:.3g} s", rank=rank if isinstance(rank, int)
                                  else None, op=op)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if self._callbacks:
            self._fire()
        return self._value()

    def _value(self):
        return None

    # ------------------------------------------ concurrent.futures.Future API
    def done(self) -> bool:
        """True when complete (successfully or not)."""
        try:
            done = self.test()
        except Exception:  # noqa: BLE001 - a failed operation is done
            done = True
        if done and self._callbacks:
            self._fire()
        return done

    def result(self, timeout: float | None = None):
        """The operation's result, waiting up to ``timeout`` seconds (``Future.result``)."""
        return self.wait(timeout)

    def exception(self, timeout: float | None = None):
        """The error the operation raised, or None (``Future.exception``)."""
        try:
            self.wait(timeout)
        except CommTimeout:
            raise
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def add_done_callback(self, fn: Callable[["Request"], None]) -> None:
        """Call ``fn(self)`` once complete: at once when already done, else from
        the ``wait``/``done``/``result`` call that sees it complete."""
        if self.done():
            fn(self)
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(fn)

    _callbacks = None

    def _fire(self) -> None:
        cbs, self._callbacks = self._callbacks, None
        for fn in cbs or ():
            fn(self)

    def cancel(self) -> bool:
        """Requests cannot be cancelled once posted (``False``), as MPI's after a match."""
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return not self.done()


class CompletedRequest(Request):
    """A request that is already done (e.g. a send to ``PROC_NULL``), with an optional result."""

    def __init__(self, value=None):
        self._result = value

    def test(self) -> bool:
        return True

    def _value(self):
        return self._result


class FutureRequest(Request):
    """A :class:`Request` over a ``concurrent.futures.Future`` (a collective
    running on a worker thread, see ``Communicator.iallreduce``)."""

    def __init__(self, future):
        self.future = future

    def test(self) -> bool:
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            raise exc
        return True

    def wait(self, timeout: float | None = None):
        timeout = check_timeout(timeout, op="wait", zero=True)
        try:
            return self.future.result(timeout)
        except FutureTimeout:
            raise CommTimeout(f"collective not complete after {timeout} s", op="wait") from None

    def add_done_callback(self, fn) -> None:
        self.future.add_done_callback(lambda _f: fn(self))


def wait_all(requests: Sequence[Request], timeout: float | None = None, *, op: str = "waitall",
             rank: int | None = None) -> None:
    """Wait for every request (see :meth:`Request.wait`); ``timeout`` in seconds for all
    (0: poll once).

    Raises:
        InvalidArgument: ``timeout`` is NaN, infinite, negative, a bool or not
            a number, naming ``op`` and ``rank`` (nothing is waited for).
    """
    timeout = check_timeout(timeout, op=op, rank=rank, zero=True)
    if timeout is None:
        for r in requests:
            r.wait()
        return
    deadline = time.monotonic() + timeout
    for r in requests:
        r.wait(max(0.0, deadline - time.monotonic()))


class Transport(ABC):
    """Point-to-point byte mover between the ``size`` ranks of a group.

    Buffers are :class:`commlib.core.buffer.Buffer`-compatible arrays,
    contiguous in memory, or :class:`Wire` messages; sizes in bytes must match
    between sender and receiver.

    Attributes:
        name: ``"mpi"``, ``"tcp"``...
        fault_tolerant: set on the transports of fault-tolerant communicators
            (the MPI transport then completes every wait by polling, see
            :mod:`commlib.transports.mpi`).
        tags: the tag allocator of operations commlib runs on this transport.
        node_peers: ranks on this rank's node (frozenset), computed at creation.
        cuda_aware: device buffers go to the wire without host staging.
    """

    name = "abstract"
    fault_tolerant = False
    cuda_aware = False
    node_peers: frozenset = frozenset()
    tag_ub: int = USER_TAG_MAX
    #: threads may call the transport concurrently (non-blocking collectives
    #: then run on a worker thread)
    thread_multiple = False

    def __init__(self):
        self.tags = TagAllocator(0, self.tag_ub)

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    # ------------------------------------------------------- point to point
    @abstractmethod
    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` (array or :class:`Wire`) to ``dest``."""

    @abstractmethod
    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        """Start receiving into ``buf`` (array or :class:`Wire`) from ``source``."""

    def send(self, buf, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Blocking send; ``timeout``: seconds the wait may take (None: the
        transport's default bound), else :class:`~commlib.CommTimeout`."""
        self.waitall([self.isend(buf, dest, tag)], timeout, op="send")

    def recv(self, buf, source: int, tag: int = 0, *, timeout: float | None = None):
        """Blocking receive; ``timeout`` as :meth:`send`."""
        self.waitall([self.irecv(buf, source, tag)], timeout, op="recv")

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, sendtag: int = 0, recvtag: int = 0, *,
                 timeout: float | None = None) -> None:
        """Send and receive at once (no deadlock); ``timeout`` as :meth:`send`."""
        self.waitall([self.irecv(recvbuf, source, recvtag), self.isend(sendbuf, dest, sendtag)], timeout,
                     op="sendrecv")

    def waitall(self, requests: Sequence[Request], timeout: float | None = None, op: str = "waitall") -> None:
        """Wait for every request of one step.

        Args:
            requests: requests returned by this transport.
            timeout: seconds for all of them together (a finite number >= 0; 0
                tests once); None waits as long as it takes.
            op: operation name for errors.

        Raises:
            InvalidArgument: ``timeout`` is NaN, infinite, negative, a bool or
                not a number (see :func:`commlib.core.seconds.check_timeout`).
            CommTimeout: when ``timeout`` passes first.
            ProcessFailed: a peer failed (or the group was revoked).
            CommError: any other failure.
        """
        wait_all(requests, timeout, op=op, rank=self.rank)

    # --------------------------------------------------- persistent requests
    def send_init(self, buf, dest: int, tag: int = 0) -> Request:
        """A persistent send of ``buf`` (started by :meth:`startall`, completed by :meth:`waitall`)."""
        raise self.unsupported("persistent requests")

    def recv_init(self, buf, source: int, tag: int = 0) -> Request:
        """A persistent receive into ``buf``; see :meth:`send_init`."""
        raise self.unsupported("persistent requests")

    def startall(self, requests: Sequence[Request]) -> None:
        """Start persistent requests."""
        raise self.unsupported("persistent requests")

    def check_peer(self, peer: int, what: str, op: str) -> None:
        """Refuse a peer rank outside ``[0, size)`` with :class:`~commlib.InvalidArgument`
        (``what``: "dest", "source", "rank"; ``op``: the call, for the message).
        A transport with wildcard or null ranks (MPI's ``ANY_SOURCE``,
        ``PROC_NULL``) accepts those too."""
        if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) or not 0 <= peer < self.size:
            raise InvalidArgument(f"{what} {peer!r} out of range [0, {self.size})", rank=self.rank, op=op)

    def check(self, buf, peer: int, op: str, receive: bool = False) -> None:
        """Validate one side of a point-to-point call (``peer`` and ``buf``, array
        or :class:`Wire`) without posting anything, raising what ``isend`` /
        ``irecv`` would raise for them; ``sendrecv``-like calls check both sides
        before either is posted.  Default: the peer only."""
        self.check_peer(peer, "source" if receive else "dest", op)

    def send_checked(self, wire: "Wire", dest: int, tag: int = 0) -> None:
        """A blocking send of a message the caller built and checked already
        (typed point to point's cached plans): a transport may skip its own
        checks and staging here.  Default: :meth:`send`."""
        self.send(wire, dest, tag)

    def recv_checked(self, wire: "Wire", source: int, tag: int = 0, *, status: bool = True):
        """:meth:`send_checked`'s receive; returns what :meth:`recv` returns
        (``status=False``: the caller needs no status, and may get None)."""
        return self.recv(wire, source, tag)

    #: a tag allocator of its own for first rounds (argument agreement), counted
    #: apart from the data tags (the TCP transport's), or None: first rounds take
    #: tags from :attr:`tags` like any other traffic
    first_round_tags = None

    #: the largest message sent as one frame, bytes (None: the transport does not
    #: cut messages into frames)
    frame_max = None

    @property
    def revoked(self) -> bool:
        """True once :meth:`revoke` ended this transport (every request fails from
        then on); False where the transport cannot tell."""
        return False

    def begin_operation(self, seq: int):
        """Number the tags of the group's operation ``seq`` from ``seq`` alone (a
        transport whose members may take different paths through one operation,
        the elastic TCP transport); see :meth:`operation_tags`."""
        raise self.unsupported("per-operation tags")

    def operation_tags(self, seq: int) -> tuple[range, range]:
        """Operation ``seq``'s ``(data tags, first-round tags)`` on a transport that
        numbers its traffic per operation (the elastic TCP transport)."""
        raise self.unsupported("per-operation tags")

    def abort_tags(self, tags, error: Callable[[int], Exception] | None = None, wait: float | None = None) -> None:
        """Drop every later message of ``tags`` and fail their posted receives
        (with ``error(tag)``), leaving other traffic going: the abort of one
        refused operation without a :meth:`revoke` of the whole group."""
        raise self.unsupported("aborting an operation's tags")

    def free_requests(self, requests: Sequence[Request]) -> None:
        """Release inactive persistent requests (``send_init``/``recv_init``); default: nothing to release."""

    def poll(self, tag: int, nbytes: int):
        """Receive a message of at most ``nbytes`` bytes with ``tag`` from any
        rank if one has arrived (never blocks): a uint8 array of ``nbytes``
        bytes, or None.  For rare notices (a halo exchange's abort notice)."""
        return None

    # ---------------------------------------------------------------- device
    def synchronize(self, buf) -> None:
        """Make the device work that produced ``buf`` complete before the wire reads it."""

    # --------------------------------------------------- native collectives
    def native_allreduce(self, sendbuf, recvbuf, op) -> None:
        """The wire library's own allreduce (``sendbuf=None``: in place)."""
        raise self.unsupported("native allreduce")

    def native_reduce_scatter_block(self, sendbuf, recvbuf, op) -> None:
        raise self.unsupported("native reduce_scatter")

    def native_allgather(self, sendbuf, recvbuf) -> None:
        raise self.unsupported("native allgather")

    def native_bcast(self, buf, root: int) -> None:
        raise self.unsupported("native bcast")

    def native_alltoall(self, sendbuf, recvbuf) -> None:
        raise self.unsupported("native alltoall")

    def native_barrier(self) -> None:
        raise self.unsupported("native barrier")

    def native_dtype(self, dtype):
        """The wire library's handle for reducing ``dtype`` natively, or None when
        its native collectives cannot take that dtype (default: None, no native
        collectives)."""
        return None

    def allgather_plan(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Callable[[], None]:
        """A reusable all-gather of two host arrays the caller keeps: each call of
        the returned function all-gathers ``sendbuf``'s bytes into ``recvbuf`` (as
        :meth:`native_allgather`).  Making it is a collective call: every member
        makes its plan at the same point of its sequence of collectives, and then
        runs it wherever every other member runs the same plan (MPI-4.0 §6.12:
        persistent collectives match only persistent collectives).  Default:
        :meth:`native_allgather` at each call."""
        return functools.partial(self.native_allgather, sendbuf, recvbuf)

    def has_native(self, what: str) -> bool:
        """True when ``native_<what>`` is implemented."""
        return getattr(type(self), f"native_{what}", None) is not getattr(Transport, f"native_{what}", None)

    # ---------------------------------------------------------- the group
    # The Group contract: a transport plus these capabilities, each optional
    # (``unsupported()`` by default, so a group without them fails with a clear
    # error where they are needed, never silently); a recovery policy
    # (commlib.collectives.recovery) runs over them.
    def is_failure(self, exc: BaseException) -> bool:
        """True when ``exc``, raised by an operation on this group, is a peer's
        failure to recover from (a dead, silent or revoked peer), not a local error."""
        return isinstance(exc, (ProcessFailed, CommTimeout))

    def dup(self) -> "Transport":
        """A transport over a duplicate of this group (collective)."""
        raise self.unsupported("dup")

    def idup(self, timeout: float, n: int = 1, op: str = "dup") -> list:
        """``n`` transports over duplicates of this group (collective), waited for
        at most ``timeout`` seconds: the bounded :meth:`dup` a fault-tolerant
        group needs (no blocking call may wait forever there).  Raises
        :class:`~commlib.CommTimeout` when the peers have not joined in time."""
        raise self.unsupported("a bounded dup")

    def set_errors_return(self) -> None:
        """Make every later error on this group come back to the caller as an
        exception rather than end the process (MPI's ``MPI_ERRORS_RETURN``);
        default: errors already come back."""

    def split(self, color: int, key: int = 0) -> "Transport":
        """A transport over the members with the same ``color``, ordered by ``key`` (collective)."""
        raise self.unsupported("split")

    def create_group(self, ranks, tag: int = 0) -> "Transport":
        """A transport over ``ranks`` of this group, in that order (collective over them only)."""
        raise self.unsupported("create_group")

    def create_cart(self, dims, periods, reorder: bool = False) -> "Transport":
        """A transport over a Cartesian grid of this group (collective)."""
        raise self.unsupported("a Cartesian topology")

    # A transport made by create_cart answers the grid queries (MPI-4.0 §8.5):
    def cart_topo(self) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[int, ...]]:
        """``(dims, periods, coords)`` of this rank in the grid."""
        raise self.unsupported("a Cartesian topology")

    def cart_rank(self, coords: Sequence[int]) -> int:
        """The rank at ``coords`` (each within its dimension's range)."""
        raise self.unsupported("a Cartesian topology")

    def cart_coords(self, rank: int) -> tuple[int, ...]:
        """The coordinates of ``rank``."""
        raise self.unsupported("a Cartesian topology")

    def cart_shift(self, direction: int, disp: int = 1) -> tuple[int, int]:
        """``(source, dest)`` of a shift by ``disp`` along ``direction`` (a null rank off a non-periodic edge)."""
        raise self.unsupported("a Cartesian topology")

    def world_ranks(self, ranks=None) -> tuple[int, ...]:
        """The job-wide ranks of ``ranks`` of this group (default: every rank)."""
        raise self.unsupported("world ranks")

    def agree(self, flag: int) -> int:
        """Fault-tolerant agreement: bitwise AND of ``flag`` over the live members."""
        raise self.unsupported("agree")

    def ack_failed(self) -> None:
        """Acknowledge the failures seen so far (after a failed :meth:`agree`)."""
        raise self.unsupported("ack_failed")

    def shrink(self):
        """``(transport over the live members, kept)``; ``kept[i]`` is new rank ``i``'s old rank."""
        raise self.unsupported("shrink")

    def abort(self, errorcode: int = 1) -> None:
        """End every process of the job."""
        raise self.unsupported("abort")

    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks this transport knows to have failed (empty when it cannot tell)."""
        return ()

    def revoke(self) -> None:
        """Interrupt every pending and future operation on the group (ULFM's revoke); no-op without."""

    def close(self) -> None:
        """Release the transport's resources."""

    def unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"transport '{self.name}' does not support {what}")
