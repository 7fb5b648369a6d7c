"""The first round of a collective: every rank's header (and a small call's
payload) in one all-gather of fixed-size rows (:mod:`commlib.core.agreement`).

:func:`validate` makes a call's header, :func:`first_round` agrees on it, and
:class:`FirstRoundRows` keeps the row and rows of a group's unbounded first
rounds with their all-gather made once (a persistent collective where the
transport has one: :meth:`~commlib.transports.base.Transport.allgather_plan`),
shared by the general path (:meth:`~.engine.Engine.execute`) and the host
plans (:mod:`.host_plans`), so both make the same call on every rank.
"""
from __future__ import annotations

import numpy as np

from commlib.core.agreement import FIELDS
from commlib.core.errors import BufferError, CommError, InvalidArgument

from . import ops
from .agreement import agree, agree_on_own_tags
from .one_round import HEAD_BYTES, SMALL, small_capacity
from .specs import SPECS, Call

__all__ = ["describe_field", "first_round", "validate", "FirstRoundRows"]


def describe_field(opname: str):
    """A formatter for mismatch messages: header codes shown as the user wrote them."""
    spec = SPECS[opname]

    def describe(name: str, value: int):
        if name == "operation":
            return next((k for k, v in SPECS.items() if v.code == value), value)
        if name == "algorithm":
            if value == SMALL and spec.small:
                return "auto (one round)"
            return spec.algorithms[value - 1] if 0 < value <= len(spec.algorithms) else value
        if name == "op":
            return next((o.name for o in ops.OPS.values() if o.code == value), value)
        if name == "dtype":
            return ops.dtype_name(value)
        return value

    return describe


def first_round(transport, opname: str, values, local_error: CommError | None, payload: np.ndarray | None,
                timeout: float | None, kept: FirstRoundRows | None = None):
    """The first round of a collective: :func:`~commlib.collectives.agreement.agree`
    on the call's header, with room for :func:`~.one_round.small_capacity` payload bytes.

    Args:
        transport: the group's transport.
        opname: the operation.
        values: this rank's header (ints in :data:`commlib.core.agreement.FIELDS` order).
        local_error: this rank's argument error, or None.
        payload: 1-D host array whose bytes ride along, or None.
        timeout: the call's :class:`~commlib.core.seconds.Deadline` (every wait
            waits what is left of it), or None (unbounded; the native all-gather).
        kept: the group's :class:`FirstRoundRows` (the all-gather of an
            unbounded first round runs there), or None.

    Returns:
        np.ndarray: the gathered payloads, uint8, shape ``(size, capacity)``.

    A transport with first-round tags of its own (``first_round_tags``: the
    elastic group's TCP transport) runs it on them
    (:func:`~.agreement.agree_on_own_tags`), counted apart from the data plane.

    Raises:
        CommError: ``local_error`` on its rank, ``InvalidArgument`` on the others;
            ``InvalidArgument`` everywhere when the headers differ.
        ProcessFailed / CommTimeout: from the transport.
    """
    if getattr(transport, "first_round_tags", None) is not None:  # first rounds counted apart (the TCP transport)
        return agree_on_own_tags(transport, values, op=opname, local_error=local_error, payload=payload,
                                 capacity=small_capacity(transport.size), timeout=timeout,
                                 describe=describe_field(opname))
    return agree(transport, values, op=opname, local_error=local_error, payload=payload,
                 capacity=small_capacity(transport.size), timeout=timeout, describe=describe_field(opname),
                 gather=kept)


def validate(c: Call):
    """Step 1 for call ``c``: the row's ``prepare``, then the one-round payload
    when the call is small.

    Returns:
        ``(values, local_error)``: the header as ints in
        :data:`~commlib.core.agreement.FIELDS` order (``algorithm`` 0 for a
        small call) and this rank's argument error (an InvalidArgument; a
        BufferError becomes one), or None.  ``c.payload`` is set.
    """
    spec = c.spec
    try:
        header = spec.prepare(c)
        c.payload = spec.one_round.payload(c) if spec.one_round is not None else None
        if c.payload is not None:
            header["algorithm"] = SMALL
        return spec.values(header), None
    except InvalidArgument as exc:
        return [0] * len(FIELDS), exc
    except BufferError as exc:
        return [0] * len(FIELDS), InvalidArgument(exc.detail, rank=c.rank, op=spec.name)


class FirstRoundRows:
    """The kept row and rows of a group's unbounded first rounds (``timeout``
    None), with the all-gather between them made once.

    Every first round of an engine collective on one transport has the same
    row: ``HEAD_BYTES`` of header, then :func:`~.one_round.small_capacity`
    payload bytes.  Its all-gather is planned at the group's first unbounded
    first round, the same call on every rank (the calls of a group are
    collective and in the same order; ``timeout`` None on one rank is None on
    all, as the API asks), and that
    :meth:`~commlib.transports.base.Transport.allgather_plan` runs every later
    one, from :func:`first_round` (through :func:`~.agreement.agree`) and from
    the host plans alike: an MPI persistent collective matches only itself.

    Attributes:
        tp: the transport.  head: header bytes (``HEAD_BYTES``).  cap: payload bytes.
        row: uint8, ``head + cap`` bytes: this rank's row.
        rows: uint8, shape ``(size, head + cap)``: the gathered rows.
        heads: each rank's header in ``rows``, as memoryviews.
        gather: the all-gather of ``row`` into ``rows`` (its plan made at the first call).
        current: the host plan whose header ``row`` holds (None: another's).
    """

    __slots__ = ("tp", "head", "cap", "row", "rows", "heads", "gather", "current")

    def __init__(self, tp):
        n = tp.size
        self.tp, self.head, self.cap = tp, HEAD_BYTES, small_capacity(n)
        rb = self.head + self.cap
        self.row = np.zeros(rb, np.uint8)
        self.rows = np.zeros((n, rb), np.uint8)
        mv = memoryview(self.rows).cast("B")
        self.heads = [mv[i * rb:i * rb + self.head] for i in range(n)]
        self.gather = self._first_gather
        self.current = None

    def _first_gather(self) -> None:
        """The first all-gather: the plan is made here (a collective call), at the
        group's first first round that uses these rows, the same call on every rank
        (not when the rows are made: a rank may make them and then, with
        ``COMMLIB_CHECK_ARGS=0``, run calls without a first round)."""
        self.gather = self.tp.allgather_plan(self.row, self.rows)
        self.gather()

    def __call__(self, row: np.ndarray) -> np.ndarray:
        """:func:`~.agreement.agree`'s all-gather of ``row`` (this geometry): a
        copy of the gathered rows, shape ``(size * rowbytes,)``."""
        self.row[...] = row
        self.current = None
        self.gather()
        return self.rows.reshape(-1).copy()
