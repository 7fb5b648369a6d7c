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
from commlib.core.errors import CommError, InvalidArgument

from .allgather_bruck import allgather_bruck

__all__ = ["agree", "agree_header", "check_all", "judge", "encode_row"]


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
          exc_type=InvalidArgument) -> np.ndarray:
    """Check that every rank passed the same header and none erred; carry a small payload.

    Args:
        transport: the group's :class:`~commlib.transports.base.Transport`.
        values: this rank's header fields (ints; the same count on every rank).
        op: operation name for errors.
        local_error: this rank's own argument error, or None.
        payload: 1-D host array of at most ``capacity`` bytes carried in the row, or None.
        capacity: payload bytes per row (the same on every rank).
        timeout: seconds each wait may take (None: native all-gather when available).
        names, describe: field names and a value formatter for the message.
        exc_type: the error class raised on the other ranks.

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
    if n == 1:
        rows = row
    else:
        rows = np.empty(n * rb, np.uint8)
        if timeout is None and transport.has_native("allgather"):
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
                 describe: Callable[[str, int], object] | None = None, exc_type=InvalidArgument) -> None:
    """:func:`agree` without a payload (argument agreement only)."""
    agree(transport, values, op=op, local_error=local_error, timeout=timeout, names=names, describe=describe,
          exc_type=exc_type)


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
