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
"""
from __future__ import annotations

import math
import numbers

from .errors import InvalidArgument

__all__ = ["check_timeout", "timeout_problem", "wait_bound_ok"]


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
    if value is None:
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
    return None if value is None else float(value)
