"""The one argument-agreement protocol: collectives, halo exchanges and attention use it.

Every rank encodes its call as a header (:mod:`commlib.core.agreement`); one
exchange over the transport makes every rank see every rank's header, and all
raise the same :class:`~commlib.InvalidArgument` before any payload moves when
a rank's arguments were invalid or the headers differ.  The exchange is MPI's
own allreduce when the transport has one and waits need no bound (under ULFM a
dead peer makes it err, it never hangs), else a recursive-doubling allreduce
over the transport with every wait bounded by ``timeout`` seconds.  Small
collectives skip this round: they carry the header inside their data message
(:mod:`commlib.collectives.engine`).
"""
from __future__ import annotations

from typing import Callable, Sequence

from commlib.core import agreement as _hdr
from commlib.core.errors import CommError, InvalidArgument

from .allreduce_recursive_doubling import allreduce_recursive_doubling

__all__ = ["agree_header", "check_all"]


def agree_header(transport, values: Sequence[int], *, op: str, local_error: CommError | None = None,
                 timeout: float | None = None, names: Sequence[str] = _hdr.FIELDS,
                 describe: Callable[[str, int], object] | None = None, exc_type=InvalidArgument) -> None:
    """Check that every rank passed the same header and none erred.

    Args:
        transport: the group's :class:`~commlib.transports.base.Transport`.
        values: this rank's header fields (ints).
        op: operation name for errors.
        local_error: this rank's own argument error, or None.
        timeout: seconds each wait may take (None: native exchange when available).
        names, describe: field names and a value formatter for the message.
        exc_type: the error class raised on the other ranks.

    Raises:
        CommError: ``local_error`` on the rank that had it and ``exc_type`` on
            every other rank; or ``exc_type`` everywhere when headers differ.
        ProcessFailed / CommTimeout: from the transport.
    """
    if transport.size == 1:
        if local_error is not None:
            raise local_error
        return
    n = len(values)
    v = _hdr.minmax_vector(values, local_error is not None, transport.rank)
    if timeout is None and transport.has_native("allreduce"):
        transport.native_allreduce(None, v, "min")
    else:
        allreduce_recursive_doubling(transport, v, "min", timeout=timeout)
    _hdr.raise_if_bad(_hdr.from_minmax(v, n), values, rank=transport.rank, op=op, local_error=local_error,
                      names=names, describe=describe, exc_type=exc_type)


def check_all(transport, problem: str | None, op: str, exc_type=InvalidArgument, timeout: float | None = None) -> None:
    """Collectively check a local condition (one int per rank on the wire).

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
    agree_header(transport, (), op=op, local_error=local, timeout=timeout, exc_type=exc_type)
