"""Argument agreement: the data side of "fail on every rank alike".

A collective call is correct only if every rank passed the same operation,
count, dtype, reduction op, root and algorithm, and no rank's arguments were
invalid.  Each rank encodes its call as a *header* of ints (plus an error flag);
the ranks gather one ``[err, v...]`` row each (the collectives layer does
that, in :mod:`commlib.collectives.agreement`, with room for a small payload),
and :func:`from_rows` and :func:`raise_if_bad` turn what came back into one
identical decision on every rank: go on, or raise the same
:class:`~commlib.InvalidArgument` everywhere before any payload byte moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .errors import CommError, InvalidArgument

__all__ = ["FIELDS", "Verdict", "from_rows", "raise_if_bad"]

#: the header fields of a collective call, in wire order
FIELDS = ("operation", "count", "dtype", "op", "root", "algorithm")


@dataclass(frozen=True)
class Verdict:
    """What the ranks' headers say, identical on every rank.

    Attributes:
        bad_ranks: the ranks whose arguments were invalid (empty when none).
        lo, hi: per field, the smallest and largest value any rank passed.
    """

    bad_ranks: tuple
    lo: tuple
    hi: tuple

    @property
    def ok(self) -> bool:
        return not self.bad_ranks and self.lo == self.hi


def from_rows(rows: np.ndarray) -> Verdict:
    """Read gathered ``[err, v...]`` rows (int64, shape ``(size, 1 + n)``)."""
    err = np.flatnonzero(rows[:, 0])
    if err.size:
        n = rows.shape[1] - 1
        return Verdict(tuple(int(r) for r in err), (0,) * n, (0,) * n)
    return Verdict((), tuple(rows[:, 1:].min(axis=0).tolist()), tuple(rows[:, 1:].max(axis=0).tolist()))


def raise_if_bad(verdict: Verdict, values: Sequence[int], *, rank: int, op: str,
                 local_error: CommError | None = None, names: Sequence[str] = FIELDS,
                 describe: Callable[[str, int], object] | None = None, exc_type=InvalidArgument) -> None:
    """Raise on every rank alike when the verdict is not ok.

    Args:
        verdict: from :func:`from_rows`.
        values: this rank's header fields (for the message).
        rank, op: for the error message.
        local_error: this rank's own argument error, re-raised as is.
        names: field names, in header order.
        describe: ``describe(name, value)`` gives a value as the user wrote it
            (an op's or dtype's name rather than its code).
        exc_type: the error class for the other ranks.

    Raises:
        CommError: ``local_error`` on the rank that had one; ``exc_type``
            naming the erring rank, or every field that differs, elsewhere.
    """
    if verdict.bad_ranks:
        if local_error is not None:
            raise local_error
        raise exc_type(f"rank(s) {list(verdict.bad_ranks)} passed invalid arguments and rejected the call "
                       "(see their error); nothing was sent", rank=rank, op=op)
    if local_error is not None:  # pragma: no cover - the verdict already named a bad rank
        raise local_error
    if verdict.lo == verdict.hi:
        return
    d = describe or (lambda _name, v: v)
    bad = [f"{name} differs across ranks (at least {d(name, lo)} and {d(name, hi)}; this rank {d(name, mine)})"
           for name, lo, hi, mine in zip(names, verdict.lo, verdict.hi, values) if lo != hi]
    raise exc_type("; ".join(bad), rank=rank, op=op)
