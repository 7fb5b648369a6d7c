"""The one argument-agreement protocol: the collective engine, halo exchanges and attention use it.

Every rank encodes its call as a header of ints plus an error flag
(:mod:`commlib.core.agreement`); one all-gather of a fixed-size row per rank
makes every rank see every header, and all raise the same
:class:`~commlib.InvalidArgument` before any payload moves when a rank's
arguments were invalid or the headers differ.  A row may carry a small
payload after the header (the engine's one-round small collectives); its size
depends only on the header length and ``capacity``, never on the arguments,
so ranks whose calls differ still make matching calls.

The all-gather is the transport's native one when it has one and waits need
no bound (under ULFM a dead peer makes it err, it never hangs), else Bruck's
all-gather over the transport (``ceil(log2 n)`` steps: a row is a few hundred
bytes, so the steps' latency is the round's cost) with every wait bounded by
``timeout`` seconds.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from commlib.core import agreement as _hdr
from commlib.core.errors import CommError, InvalidArgument, MessageSizeMismatch

from ._common import next_tag, waitall
from .allgather_bruck import allgather_bruck

__all__ = ["agree", "agree_header", "agree_call", "agree_on_own_tags", "check_all", "judge", "encode_row",
           "FirstRoundView", "NeighbourRefusal", "RingHead", "difference", "size_refusal"]


def encode_row(values: Sequence[int], *, local_error: CommError | None = None, payload: np.ndarray | None = None,
               capacity: int = 0) -> np.ndarray:
    """One rank's row of the agreement: ``[err, values...]`` as int64, then
    ``capacity`` payload bytes (``payload``'s bytes first, zeros after).

    Returns:
        np.ndarray: uint8, ``8 * (1 + len(values)) + capacity`` bytes (the same
        size on every rank whatever its arguments).
    """
    head = 8 * (1 + len(values))
    row = np.zeros(head + capacity, np.uint8)
    h = row[:head].view(np.int64)
    if local_error is not None:
        h[0] = 1
    else:
        h[1:] = values
        if payload is not None:
            row[head:head + payload.nbytes] = payload.view(np.uint8)
    return row


def agree(transport, values: Sequence[int], *, op: str, local_error: CommError | None = None,
          payload: np.ndarray | None = None, capacity: int = 0, timeout: float | None = None,
          names: Sequence[str] = _hdr.FIELDS, describe: Callable[[str, int], object] | None = None,
          exc_type=InvalidArgument, native: bool = True, gather=None) -> np.ndarray:
    """Check that every rank passed the same header and none erred; carry a small payload.

    Args:
        transport: the group's :class:`~commlib.transports.base.Transport`.
        values: this rank's header fields (ints; the same count on every rank).
        op: operation name for errors.
        local_error: this rank's own argument error, or None.
        payload: 1-D host array of at most ``capacity`` bytes carried in the row, or None.
        capacity: payload bytes per row (the same on every rank).
        timeout: seconds each wait may take (None: native all-gather when available,
            and the transport is not fault tolerant).
        native: False: always the point-to-point all-gather, whatever ``timeout``.
            For callers whose ranks may pass different timeouts (a per-call
            argument, None on one rank and a number on another): the native and
            the point-to-point all-gathers do not meet, so the protocol must not
            depend on the timeout.
        names, describe: field names and a value formatter for the message.
        exc_type: the error class raised on the other ranks.
        gather: the group's kept all-gather of rows of this size
            (:class:`~commlib.collectives.first_round.FirstRoundRows`): the
            native all-gather when ``timeout`` is None runs there (None: a
            fresh ``native_allgather``).

    Returns:
        np.ndarray: uint8, shape ``(size, capacity)``: every rank's payload bytes.

    Raises:
        CommError: ``local_error`` on the rank that had it and ``exc_type`` on
            every other rank; or ``exc_type`` everywhere when headers differ.
        ProcessFailed / CommTimeout: from the transport.
    """
    n, head = transport.size, 8 * (1 + len(values))
    row = encode_row(values, local_error=local_error, payload=payload, capacity=capacity)
    rb = row.size
    # never an MPI collective on a fault-tolerant transport: Open MPI's own collectives
    # free their pending sends when one of their requests fails (a peer died, the
    # communicator was revoked), and a freed send that then fails aborts the process
    # ("Send error after request freed", MPI_ERRORS_ARE_FATAL whatever the handler);
    # the point-to-point all-gather keeps every request it posted until it completes
    mpi = timeout is None and native and not transport.fault_tolerant
    if n == 1:
        rows = row
    elif mpi and gather is not None:
        rows = gather(row)  # the kept all-gather gives its own copy of the rows
    else:
        rows = np.empty(n * rb, np.uint8)
        if mpi and transport.has_native("allgather"):
            transport.native_allgather(row, rows)
        else:
            allgather_bruck(transport, row, rows, timeout=timeout)
    rows = rows.reshape(n, rb)
    if local_error is None and n > 1:
        mine = bytes(row[:head])
        mv = memoryview(rows).cast("B")
        if all(mv[i * rb:i * rb + head] == mine for i in range(n)):  # the common case: every header equal
            return rows[:, head:]
    judge(transport, rows[:, :head], values, op=op, local_error=local_error, names=names, describe=describe,
          exc_type=exc_type)
    return rows[:, head:]


class FirstRoundView:
    """A transport as a first round uses it, on a transport that counts first
    rounds apart (its ``first_round_tags`` allocator: the TCP transport, whose
    first-round messages are single frames, a receive of another size failing at
    once with :class:`~commlib.core.errors.MessageSizeMismatch`).

    ``tags`` is the transport's first-round allocator, read at each use (a kept
    view never goes stale when the transport renews it per operation).
    ``mirror``: ranks seen mirrored (``(n - r) % n``), so the first step of
    Bruck's all-gather goes to rank ``r + 1`` and comes from ``r - 1``, as a
    ring's first step does: a rank whose call differs and chose a ring carrying
    its header (:class:`RingHead`) meets it."""

    def __init__(self, tr, mirror: bool = False):
        self._tr = tr
        if mirror:
            n = tr.size
            self.rank = (n - tr.rank) % n
            self.isend = lambda buf, dest, tag=0: tr.isend(buf, (n - dest) % n, tag)
            self.irecv = lambda buf, source, tag=0: tr.irecv(buf, (n - source) % n, tag)
            self.sendrecv = lambda sb, dest, rb, source, stag=0, rtag=0: tr.sendrecv(sb, (n - dest) % n, rb,
                                                                                    (n - source) % n, stag, rtag)

    @property
    def tags(self):
        return self._tr.first_round_tags

    def __getattr__(self, name):
        return getattr(self._tr, name)


def agree_on_own_tags(transport, values: Sequence[int], *, op: str, local_error: CommError | None = None,
                      payload: np.ndarray | None = None, capacity: int = 0, timeout=None,
                      names: Sequence[str] = _hdr.FIELDS, describe: Callable[[str, int], object] | None = None
                      ) -> np.ndarray:
    """:func:`agree` on a transport with first-round tags of its own
    (:class:`FirstRoundView`): over 3 or more ranks seen mirrored, the rows given
    back in rank order (2 ranks: one exchange either way).

    Returns:
        np.ndarray: uint8, shape ``(size, capacity)``, row ``i`` rank ``i``'s payload.

    Raises:
        as :func:`agree`, naming this rank's own number; NeighbourRefusal: a
            first message of another size came (a call of another form: only
            this rank knows, the caller makes it every rank's).
    """
    n = transport.size
    try:
        if n <= 2:
            return agree(FirstRoundView(transport), values, op=op, local_error=local_error, payload=payload,
                         capacity=capacity, timeout=timeout, names=names, describe=describe, native=False)
        rows = agree(FirstRoundView(transport, mirror=True), values, op=op, local_error=local_error,
                     payload=payload, capacity=capacity, timeout=timeout, names=names, describe=describe,
                     native=False)
    except MessageSizeMismatch as exc:
        # a first message of another size: the sender's call takes another form (another
        # collective's, or a strategy whose first message carries data); only this rank
        # knows, so it is a neighbour's refusal, which the group makes every rank's
        if exc.source is not None:  # the sender's header row leads its message: name what differs
            raise size_refusal(names, describe, values, transport.rank, exc.source, op, exc.head) from None
        raise NeighbourRefusal(f"the calls differ: rank {transport.rank} got a first message of another form "
                               f"({exc.detail})", rank=transport.rank, op=op) from None
    except InvalidArgument as exc:  # raised under the mirrored rank: this rank's own number on it
        if exc is local_error or n <= 2:
            raise
        raise InvalidArgument(exc.detail, rank=transport.rank, op=exc.op) from None
    return rows[[(n - r) % n for r in range(n)]]


def judge(transport, headers: np.ndarray, values: Sequence[int], *, op: str, local_error: CommError | None = None,
          names: Sequence[str] = _hdr.FIELDS, describe: Callable[[str, int], object] | None = None,
          exc_type=InvalidArgument) -> None:
    """Decide, identically on every rank, what gathered headers say.

    Args:
        headers: uint8, shape ``(size, 8 * (1 + len(values)))``: every rank's
            ``[err, header...]`` as int64s.
        values, op, local_error, names, describe, exc_type: as :func:`agree`.

    Raises:
        CommError: as :func:`agree`, when any rank erred or the headers differ.
    """
    verdict = _hdr.from_rows(np.ascontiguousarray(headers).view(np.int64))
    if not verdict.ok or local_error is not None:
        _hdr.raise_if_bad(verdict, values, rank=transport.rank, op=op, local_error=local_error, names=names,
                          describe=describe, exc_type=exc_type)


def agree_header(transport, values: Sequence[int], *, op: str, local_error: CommError | None = None,
                 timeout: float | None = None, names: Sequence[str] = _hdr.FIELDS,
                 describe: Callable[[str, int], object] | None = None, exc_type=InvalidArgument,
                 native: bool = True) -> None:
    """:func:`agree` without a payload (argument agreement only)."""
    agree(transport, values, op=op, local_error=local_error, timeout=timeout, names=names, describe=describe,
          exc_type=exc_type, native=native)


def agree_call(transport, values: Sequence[int] | None, *, op: str, names: Sequence[str],
               local_error: CommError | None = None, timeout: float | None = None,
               describe: Callable[[str, int], object] | None = None, exc_type=InvalidArgument) -> None:
    """A call's argument agreement in one round: did any rank refuse its own
    arguments, and do the headers agree.

    A rank whose local checks failed (``local_error``) has no header; it
    sends its error flag and zeros in the header's place (one row of the same
    size on every rank: :func:`encode_row`), so one all-gather decides both
    questions.  Always the point-to-point all-gather, bounded by ``timeout``
    (callers' ranks may pass different timeouts, and the native all-gather
    and the point-to-point one do not meet).  Used by the attention calls of
    both layers and the sequence (un)sharding.

    Args:
        values: this rank's header (ints, ``len(names)`` of them), or None
            when ``local_error`` is set.
        names: the header's field names (their count is the header's length
            on every rank).
        op, local_error, timeout, describe, exc_type: as :func:`agree`.

    Raises:
        CommError: ``local_error`` on the rank that had it and ``exc_type``
            naming that rank everywhere else; ``exc_type`` naming the fields
            that differ when the headers do.
        CommTimeout / ProcessFailed: from the transport.
    """
    if local_error is not None or values is None:
        values = (0,) * len(names)
    agree(transport, values, op=op, local_error=local_error, timeout=timeout, names=names, describe=describe,
          exc_type=exc_type, native=False)


class NeighbourRefusal(InvalidArgument):
    """A neighbour check (:class:`RingHead`) found this rank's header
    different from its neighbour's.  Only the ranks that compared the two headers
    know: the caller makes the refusal every rank's (the elastic master's verdict,
    :meth:`commlib.elastic.Peer.allreduce`)."""


def difference(names, describe, values, other, r: int, source: int, op: str) -> NeighbourRefusal:
    """The refusal of a rank ``r`` that found ``other`` (int64 ``[err, header...]``
    of rank ``source``) different from its ``values``: the same text on every rank
    that raises it."""
    if other[0]:
        why = f"rank {source} passed invalid arguments and rejected the call (see its error)"
    else:
        d = describe or (lambda _name, v: v)
        fields = list(zip(names, values, other[1:]))
        if fields and fields[0][0] == "operation" and fields[0][1] != fields[0][2]:
            fields = fields[:1]  # another collective: the rest of its header has another layout
        why = "the calls differ: " + "; ".join(
            f"{name} {d(name, mine)} on rank {r}, {d(name, int(theirs))} on rank {source}"
            for name, mine, theirs in fields if mine != theirs)
    return NeighbourRefusal(why, rank=r, op=op)


def size_refusal(names, describe, values, r: int, source: int, op: str,
                 head: bytes | None = None) -> NeighbourRefusal:
    """The refusal of a rank ``r`` whose first-round message from ``source`` had
    another size than its own call's: the sender's call differs.

    ``head`` (the first bytes of that message, :attr:`MessageSizeMismatch.head`)
    starts with the sender's row ``[err, header...]``: the refusal then names the
    fields that differ, as :func:`difference` does, or, when the headers agree,
    says that the message's form differs (a per-member setting of how the first
    round travels, which every member must share)."""
    hd = 8 * (1 + len(values))
    if head is not None and len(head) >= hd:
        other = np.frombuffer(head[:hd], np.int64)
        if other[0] or any(int(a) != int(b) for a, b in zip(values, other[1:])):
            return difference(names, describe, values, other, r, source, op)
        return NeighbourRefusal(f"the calls differ: rank {source}'s first message does not fit rank {r}'s call "
                                f"though their headers agree: the two ranks send the first round in different "
                                f"forms (a per-member setting, or a commlib version, that every member must share)", rank=r, op=op)
    d = describe or (lambda _name, v: v)
    mine = ", ".join(f"{name} {d(name, v)}" for name, v in zip(names, values))
    return NeighbourRefusal(f"the calls differ: rank {source}'s first message does not fit rank {r}'s call "
                            f"({mine}): its count, dtype, quantize or algorithm differs", rank=r, op=op)


class RingHead:
    """A ring's first step carrying the argument agreement: this rank's header row
    rides in front of its first chunk, and the row in front of the chunk from the
    left neighbour is compared before that chunk is combined (one message per
    rank, the check costs no message of its own).

    Around the ring, every rank finding its left neighbour's header equal to its
    own means every header is equal.  The first step then goes under the first
    tag of the first-round allocator ``first.tags``, to rank ``r + 1`` and from
    rank ``r - 1``: the tag and direction of the first step of :func:`agree`'s
    all-gather over a mirrored view of the ranks (what the elastic peer runs for
    calls that chose another algorithm), so a rank whose call differs meets this
    message, of another size, and fails its receive at once.  A link may carry
    the row on its own instead (``send_joined``/``recv_joined`` False: the
    bare :func:`agree` row under that tag, the chunk under the ring's data tag),
    decided from what both ends know alike; :meth:`check_alone` exchanges and
    checks that bare row before the ring starts.

    Args:
        first: the group's transport as the first round uses it (``tags``: the
            first-round allocator; single-frame messages, gather sends).
        values: this rank's header ints.
        op: operation name for errors.
        capacity: payload bytes of :func:`agree`'s row (zeros here).
        keep: uint8 scratch of at least :meth:`need` bytes (64-byte aligned).
        send_joined, recv_joined: row and chunk in one message to the right /
            from the left.
        names, describe: as :func:`agree`.
    """

    def __init__(self, first, values: Sequence[int], *, op: str, capacity: int, keep: np.ndarray,
                 send_joined: bool, recv_joined: bool, names: Sequence[str] = _hdr.FIELDS,
                 describe: Callable[[str, int], object] | None = None):
        self.first, self.values, self.op, self.names, self.describe = first, values, op, names, describe
        self.head = 8 * (1 + len(values))
        self.rowbytes = self.head + capacity      # agree()'s row: the bare form
        self.prefix = -(-self.rowbytes // 64) * 64  # the joined form's row, the chunk aligned after it
        self.send_joined, self.recv_joined = send_joined, recv_joined
        self.keep = keep
        self.row = keep[:self.prefix]
        self.row[:self.head] = encode_row(values)
        self.row[self.head:] = 0
        self.tag = next_tag(first)

    def renew(self) -> "RingHead":
        """This head for the group's next operation with the same header and sizes:
        the next tag of ``first``'s first-round allocator (``first.tags`` is read
        anew: the caller's wrapper must return the current operation's); the row
        stays encoded in ``keep``, which the caller must not have written since."""
        self.tag = next_tag(self.first)
        return self

    @staticmethod
    def need(nfields: int, capacity: int, chunk_nbytes: int) -> int:
        """Scratch bytes for a chunk of at most ``chunk_nbytes``: this rank's row and
        the left neighbour's message."""
        prefix = -(-(8 * (1 + nfields) + capacity) // 64) * 64
        return 2 * prefix + chunk_nbytes

    def recv_buffer(self, nbytes: int) -> np.ndarray:
        """Where the left neighbour's message lands: its row, then (joined) a chunk of ``nbytes``."""
        base = self.prefix
        return self.keep[base:base + (self.prefix + nbytes if self.recv_joined else self.rowbytes)]

    def send_parts(self, chunk: np.ndarray):
        """This rank's first-round message to the right: the row alone, or the row and ``chunk``."""
        return (self.row, chunk) if self.send_joined else self.row[:self.rowbytes]

    def check(self, got: np.ndarray, source: int) -> None:
        """Compare the left neighbour's row (the first bytes of ``got``).

        Raises:
            NeighbourRefusal: the headers differ.
        """
        if got[:self.head].tobytes() != self.row[:self.head].tobytes():
            raise difference(self.names, self.describe, self.values, got[:self.head].view(np.int64),
                             self.first.rank, source, self.op)

    def check_alone(self, source: int, dest: int, timeout: float | None) -> None:
        """The bare row alone, before the ring's first chunk moves: sent to ``dest``,
        ``source``'s received and compared (the ring then runs without this head).

        Raises:
            NeighbourRefusal: the headers differ, or ``source``'s first message
                has another size.
            ProcessFailed / CommTimeout: from the transport.
        """
        got = self.keep[self.prefix:self.prefix + self.rowbytes]
        rq = self.first.irecv(got, source, self.tag)
        sq = self.first.isend(self.row[:self.rowbytes], dest, self.tag)
        try:
            waitall(self.first, [rq], timeout)
        except MessageSizeMismatch as exc:
            self.refuse_size(source, exc)
        self.check(got, source)
        waitall(self.first, [sq], timeout)

    def refuse_size(self, source: int, exc: MessageSizeMismatch):
        """The left neighbour's first-round message has another size (``exc``): its call differs.

        Raises:
            NeighbourRefusal: always, naming the fields that differ where ``exc.head`` shows them.
        """
        raise size_refusal(self.names, self.describe, self.values, self.first.rank, source, self.op,
                           exc.head) from None


def check_all(transport, problem: str | None, op: str, exc_type=InvalidArgument, timeout: float | None = None) -> None:
    """Collectively check a local condition (one flag per rank on the wire).

    Args:
        transport: the group's transport.
        problem: this rank's problem, or None when its arguments are fine.
        op: operation name for the message.
        exc_type: the CommError subclass to raise.
        timeout: seconds each wait may take (None: unbounded, native when available).

    Raises:
        exc_type: on every rank when any rank has a problem: the rank with the
            problem reports it, the others name the rank that rejected the call.
    """
    local = exc_type(problem, rank=transport.rank, op=op) if problem else None
    agree(transport, (), op=op, local_error=local, timeout=timeout, exc_type=exc_type)
