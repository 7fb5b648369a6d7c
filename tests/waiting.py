"""Ordering in tests by conditions, not by ``time.sleep``.

:func:`wait_until` polls a predicate until it holds, with a generous deadline
(a missed condition fails the test naming what it waited for, instead of a
sleep that guesses how long the other side takes on a loaded machine).  The
deadline bounds a hang; it is never an assertion about speed.
"""
import time

#: seconds a condition may take before the test fails (far above any healthy run)
DEFAULT_TIMEOUT = 30.0


def wait_until(pred, timeout: float = DEFAULT_TIMEOUT, what: str = "a condition", interval: float = 0.005):
    """Poll ``pred()`` until it returns a true value; return that value.

    Raises:
        AssertionError: ``pred`` still false after ``timeout`` seconds (naming ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)  # a poll interval, not an ordering
