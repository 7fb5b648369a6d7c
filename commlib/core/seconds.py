"""Timeouts given in seconds: the one check of what a ``timeout`` argument may be.

A blocking call's ``timeout`` is None (wait as long as it takes) or a finite
number of seconds.  NaN and infinity are refused: a deadline ``now + nan``
never passes, so the call would wait forever while claiming to be bounded
(pass None to wait without a bound).  A bool is refused (``True`` is not one
second), and so is anything that is not a real number.  Negative values are
refused.  Zero depends on the call (``zero``):

* a wait on something already under way (``Request.wait``, ``waitall``,
  ``HaloRequest.wait``) takes ``timeout=0`` as a poll: it checks once and
  raises :class:`~commlib.CommTimeout` when the operation is not complete
  (``concurrent.futures.Future.result(0)`` does the same);
* a bound on a whole call or a communicator (``init(timeout=...)``,
  ``HaloExchange.exchange``/``start``) refuses 0: every wait would fail at once.

:func:`check_timeout` is used by the communicator (``init``, ``waitall``), the
requests of :mod:`commlib.transports.base`, the fault-tolerance settings and the
halo exchange, and the elastic peer (every call's and ``connect``'s timeout: 0 refused).

A call's ``timeout`` is the deadline of the whole call: :class:`Deadline` holds
it (monotonic time), and every wait of a multi-step algorithm (ring steps,
first round, retries' waits) waits :func:`time_left` of it, not a fresh bound
per step.  The algorithms take ``timeout`` as None, a number of seconds (their
own deadline, counted from their start) or a :class:`Deadline` handed down by
their caller (:func:`deadline_of` makes one of either).
"""
from __future__ import annotations

import math
import numbers
import time

from .errors import InvalidArgument

__all__ = ["check_timeout", "timeout_problem", "wait_bound_ok", "Deadline", "deadline_of", "time_left", "call_deadline",
           "restarted"]


_INF = float("inf")


def wait_bound_ok(value) -> bool:
    """The transports' hot-path check of a wait's ``timeout`` (not None): True when
    ``0 <= value < inf``; False for NaN, infinity, a negative number, a bool or a
    value that does not compare with numbers (then :func:`timeout_problem` says
    why)."""
    if value is True or value is False:
        return False
    try:
        return 0 <= value < _INF
    except TypeError:
        return False


def timeout_problem(value, *, zero: bool = False) -> str | None:
    """Why ``value`` is not a valid timeout, or None when it is.

    Args:
        value: the timeout argument (None: no bound, valid).
        zero: True when ``0`` is valid (a poll), False when it is refused.
    """
    if value is None or type(value) is Deadline:  # a Deadline was made from a valid timeout
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"timeout must be None or a number of seconds, got {value!r}"
    seconds = float(value)
    if not math.isfinite(seconds):
        return (f"timeout must be a finite number of seconds, got {value!r} (a deadline of {value!r} never "
                "passes; pass None to wait without a bound)")
    if seconds < 0 or (seconds == 0 and not zero):
        need = ">= 0 (0: poll once)" if zero else "> 0"
        return f"timeout must be {need} seconds, got {value!r}"
    return None


def check_timeout(value, *, op: str, rank=None, zero: bool = False) -> float | None:
    """``value`` as seconds (float), or None for no bound.

    Args:
        value: the timeout argument.
        op, rank: for the error.
        zero: accept ``0`` (a poll), see the module docstring.

    Raises:
        InvalidArgument: ``value`` is a bool, not a real number, NaN, infinite,
            negative, or zero where ``zero`` is False; naming ``op`` and ``rank``.
    """
    problem = timeout_problem(value, zero=zero)
    if problem is not None:
        raise InvalidArgument(problem, rank=rank, op=op)
    if type(value) is Deadline:  # a call's deadline, handed down: kept as it is
        return value
    return None if value is None else float(value)


class Deadline:
    """The deadline of one call: ``timeout`` seconds after its start, in
    :func:`time.monotonic` time.

    Attributes:
        timeout: the call's timeout in seconds (for messages).
        at: the deadline, :func:`time.monotonic` seconds.
        op: the call, named in the :class:`~commlib.CommTimeout` of a wait
            that runs out of it (None: the wait's own name).
    """

    __slots__ = ("timeout", "at", "op")

    def __init__(self, timeout: float, start: float | None = None, op: str | None = None):
        self.op = op
        self.timeout = float(timeout)
        self.at = (time.monotonic() if start is None else start) + self.timeout

    def left(self) -> float:
        """Seconds until the deadline, 0.0 once it passed (a wait then polls once)."""
        left = self.at - time.monotonic()
        return left if left > 0.0 else 0.0

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def __repr__(self) -> str:
        return f"Deadline(timeout={self.timeout:g}, left={self.left():.3g})"


def deadline_of(timeout) -> Deadline | None:
    """``timeout`` as a :class:`Deadline`: None stays None (no bound), a
    Deadline is returned as it is (the caller's), a number of seconds starts
    one now.  ``timeout`` is assumed valid (:func:`timeout_problem`)."""
    if timeout is None or type(timeout) is Deadline:
        return timeout
    return Deadline(timeout)


def time_left(timeout) -> float | None:
    """The bound of one wait under ``timeout``: None (no bound), the seconds
    left of a :class:`Deadline`, or a number as it is."""
    if type(timeout) is Deadline:
        return timeout.left()
    return timeout


def call_deadline(timeout, op: str | None = None):
    """The ``timeout`` a call (``op``) hands down to its steps: a valid number
    of seconds becomes the call's :class:`Deadline` (from now), a Deadline
    stays (an enclosing call's), None stays None; an invalid value is returned
    as it is, for the call's validation to refuse (on every rank alike)."""
    if timeout is None or type(timeout) is Deadline or timeout_problem(timeout) is not None:
        return timeout
    return Deadline(timeout, op=op)


def restarted(timeout):
    """A new :class:`Deadline` of the same length when ``timeout`` is one (a
    backward pass is a call of its own: it gets the whole timeout again);
    anything else as it is."""
    if type(timeout) is Deadline:
        return Deadline(timeout.timeout, op=timeout.op)
    return timeout
