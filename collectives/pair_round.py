"""The first round of a 2-rank call, carrying the whole vector: one message each way.

At two ranks the argument agreement (:func:`.agreement.agree`) is one
exchange of header rows, and an all-reduce of a mid-sized vector is one
exchange of the vectors (recursive doubling at 2 ranks, Thakur, Rabenseifner &
Gropp, IJHPCA 19(1), 2005, §4.4).  One after the other they cost two round
trips; here they are one message each way, as the one-round small path
(:mod:`.one_round`) already carries calls of a few hundred bytes inside the
agreement row: ``[header row | area]``, where the area holds a small call's
payload (``capacity`` bytes), the vector of a call that ships it
(``vector.nbytes`` bytes, more than ``capacity``), or ``capacity`` zero bytes.

Nothing is written before the headers are compared: the peer's message lands
in a scratch buffer.  When the two calls differ, the messages' sizes may
differ too; the transport then fails the receive at once (its first-round
messages are single frames: :data:`commlib.transports.tcp.FIRST_ROUND_TAG`)
and drops the peer's message, and both ranks exchange bare header rows to
name the difference.  Either way both ranks raise the same
:class:`~commlib.InvalidArgument` (:func:`.agreement.judge`).  A mismatched
call has then sent its vector, which the peer discards: the price of the
saved round trip.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from commlib.core.errors import InvalidArgument, MessageSizeMismatch

from ._common import next_tag, waitall
from .agreement import encode_row, judge

__all__ = ["pair_first_round", "message_bytes"]


def message_bytes(nfields: int, capacity: int, vector_nbytes: int = 0) -> int:
    """Bytes of one rank's first-round message: the header row (``8 * (1 +
    nfields)``) and an area of ``max(capacity, vector_nbytes)``."""
    return 8 * (1 + nfields) + max(capacity, vector_nbytes)


def pair_first_round(first, values: Sequence[int], *, op: str, capacity: int, sendbuf: np.ndarray,
                     recvbuf: np.ndarray, payload: np.ndarray | None = None, vector: np.ndarray | None = None,
                     timeout: float | None = None, names: Sequence[str], describe=None) -> tuple:
    """Agree on a 2-rank call's header, carrying a small payload or the whole vector.

    Args:
        first: the group's transport as the first round uses it (its ``tags``
            the first-round allocator; messages sent as single frames), 2 ranks.
        values: this rank's header ints.
        op: operation name for errors.
        capacity: bytes of the area when no vector ships (the same on both ranks).
        sendbuf, recvbuf: uint8 scratch of at least :func:`message_bytes` bytes each.
        payload: a small call's bytes (at most ``capacity``), or None.
        vector: 1-D contiguous host array of more than ``capacity`` bytes sent
            whole inside the message, or None.
        timeout: seconds each wait may take.
        names, describe: field names and value formatter for the mismatch message.

    Returns:
        tuple: both messages' areas (uint8, ``area`` bytes each) in rank order,
        views of ``sendbuf`` (or of ``vector``, sent by a gather) and ``recvbuf``
        (no copy).

    Raises:
        InvalidArgument: the headers differ (on both ranks alike).
        ProcessFailed / CommTimeout: from the transport.
    """
    r = first.rank
    peer = 1 - r
    head = 8 * (1 + len(values))
    area = max(capacity, vector.nbytes if vector is not None else 0)
    msg, other = sendbuf[:head + area], recvbuf[:head + area]
    msg[:head] = encode_row(values)
    mine = msg[head:]
    # header row and vector as one message without copying the vector: a gather send,
    # where the transport has one (TCPTransport.gather_sends, first-round tags)
    gather = vector is not None and getattr(first, "gather_sends", False)
    if vector is not None:
        if gather:
            mine = vector.reshape(-1).view(np.uint8)
        else:
            msg[head:] = vector.reshape(-1).view(np.uint8)
    else:
        n = 0 if payload is None else payload.nbytes
        if n:
            msg[head:head + n] = payload.view(np.uint8)
        msg[head + n:] = 0
    tag = next_tag(first, 1)
    rreq = first.irecv(other, peer, tag)
    sreq = first.isend((msg[:head], mine) if gather else msg, peer, tag)
    try:
        waitall(first, [rreq], timeout)
    except MessageSizeMismatch:
        # the peer's message has another size, so its call differs: bare rows name how
        waitall(first, [sreq], timeout)
        row = msg[:head].copy()
        theirs = np.empty_like(row)
        tag = next_tag(first, 1)
        rq = first.irecv(theirs, peer, tag)
        waitall(first, [rq, first.isend(row, peer, tag)], timeout)
        judge(first, np.stack([row, theirs] if r == 0 else [theirs, row]), values, op=op, names=names,
              describe=describe)
        raise InvalidArgument("the two ranks' calls differ (their first-round messages differ in size)",
                              rank=r, op=op) from None
    waitall(first, [sreq], timeout)
    if other[:head].tobytes() != msg[:head].tobytes():
        judge(first, np.stack([msg[:head], other[:head]] if r == 0 else [other[:head], msg[:head]]), values,
              op=op, names=names, describe=describe)
    return (mine, other[head:]) if r == 0 else (other[head:], mine)
