"""The copy-before-write snapshot an in-place collective keeps for a retry.

No MPI here: the elastic peer (TCP, no MPI runtime) and the MPI engine's
recovery policies both take their snapshots from this module.
"""
from __future__ import annotations

import numpy as np

__all__ = ["LazySnapshot"]


class LazySnapshot:
    """Copy-before-write snapshot of a buffer a collective reduces in place.

    An in-place collective destroys its input, yet in fault-tolerant mode a
    retry after a failure needs it.  Rather than copying the whole buffer up
    front (a memcpy on the critical path), the algorithm calls :meth:`save` on
    each range just before it first overwrites it, while that step's messages
    are in flight; :meth:`restore` puts back exactly the saved ranges (the
    others were never written).

    Args:
        buf: the 1-D host array the collective works on in place.
        scratch: optional reusable 1-D array of at least ``buf.nbytes`` bytes
            (any dtype) to hold the copy; allocated when None.
    """

    __slots__ = ("buf", "copy", "ranges")

    def __init__(self, buf, scratch=None):
        self.buf = buf
        if scratch is None:
            self.copy = np.empty_like(buf)
        else:
            self.copy = scratch.view(np.uint8)[:buf.nbytes].view(buf.dtype)
        self.ranges: list[tuple[int, int]] = []

    def save(self, a: int, b: int) -> None:
        """Copy elements ``[a, b)`` of the buffer (before they are overwritten)."""
        if b > a:
            self.copy[a:b] = self.buf[a:b]
            self.ranges.append((a, b))

    def save_all(self) -> None:
        """Copy the whole buffer now (algorithms that do not save lazily)."""
        self.save(0, self.buf.size)

    def restore(self) -> None:
        """Put the saved ranges back into the buffer: it holds the input again."""
        for a, b in self.ranges:
            self.buf[a:b] = self.copy[a:b]
        self.ranges.clear()
