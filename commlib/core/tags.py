"""Message tags: one allocator per communicator, as gloo's ``Context::nextSlot``.

commlib's own traffic (collectives, halo exchanges, attention, argument
agreement) runs on communicators it duplicated for itself, never on the one
the user sends on, so no internal tag can meet a user's tag.  Within one such
communicator, every operation takes its tags from that communicator's
:class:`TagAllocator`: each call of :meth:`TagAllocator.slot` returns a fresh
block of tags.  Every rank issues the same sequence of operations on a
communicator (MPI's collective ordering rule, MPI-4.0 §6.12), so the same call
gets the same block on every rank, and a late message of one operation can
never be matched by the next one.
"""
from __future__ import annotations

import operator

__all__ = ["TagAllocator", "USER_TAG_MAX", "check_user_tag"]

#: the largest tag MPI guarantees on every implementation (``MPI_TAG_UB`` >= 32767)
USER_TAG_MAX = 32767


class TagAllocator:
    """Hands out blocks of tags in ``[lo, hi]``, cycling (gloo's ``nextSlot``).

    Args:
        lo: first tag of the range (>= 0).
        hi: last tag of the range (``MPI_TAG_UB`` of the communicator).

    Raises:
        ValueError: an empty range.
    """

    __slots__ = ("lo", "hi", "_next")

    def __init__(self, lo: int = 0, hi: int = USER_TAG_MAX):
        if not 0 <= lo <= hi:
            raise ValueError(f"empty tag range [{lo}, {hi}]")
        self.lo, self.hi, self._next = int(lo), int(hi), int(lo)

    def slot(self, width: int = 1) -> int:
        """The first of ``width`` consecutive tags reserved for one operation.

        Args:
            width: tags the operation needs (its distinct message kinds).

        Returns:
            int: tag ``t``; the operation owns ``t, t+1, ..., t+width-1``.
        """
        t = self._next
        if t + width - 1 > self.hi:
            t = self.lo
        self._next = t + width
        return t


def check_user_tag(tag, *, anywild: bool = False, ub: int = USER_TAG_MAX) -> str | None:
    """Why ``tag`` is not a valid user tag (None when it is).

    Args:
        tag: the tag a user passed.
        anywild: allow ``ANY_TAG`` (-1, receives only).
        ub: the largest tag of the communicator (``MPI_TAG_UB``).
    """
    if isinstance(tag, bool):
        return f"tag {tag!r} is not an int"
    if not isinstance(tag, int):
        try:
            tag = operator.index(tag)
        except TypeError:
            return f"tag {tag!r} is not an int"
    if anywild and tag == -1:
        return None
    if tag < 0:
        return f"tag {tag} is negative (tags are 0..{ub}" + (", or ANY_TAG)" if anywild else ")")
    if tag > ub:
        return f"tag {tag} is outside [0, {ub}]" + (" (or ANY_TAG)" if anywild else "")
    return None
