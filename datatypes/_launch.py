"""Launch geometry shared by the device pack kernels (CUDA C and numba):
row-team sizes and division by multiply-and-shift constants."""
from __future__ import annotations

__all__ = ["team_lg", "fastdiv"]


def team_lg(n0: int, threads: int) -> int:
    """log2 of the row team size for rows of ``n0`` words: a power of two not
    above ``min(n0, threads)``; or -1 for the flat mapping (one thread per
    word), used for rows narrower than a warp that are not a power of two
    words wide, where a row team would leave lanes idle."""
    n0 = max(int(n0), 1)
    if n0 < 32 and n0 & (n0 - 1):
        return -1
    return min(n0, threads).bit_length() - 1


def fastdiv(d: int) -> tuple[int, int]:
    """``(M, s)`` with ``n // d == (n * M) >> s`` for every ``0 <= n < 2**32``:
    ``l = ceil(log2 d)``, ``s = 32 + l``, ``M = ceil(2**s / d)`` (Granlund and
    Montgomery, "Division by invariant integers using multiplication",
    PLDI'94, the round-up method: ``M*d - 2**s < d <= 2**l``).  The kernels
    keep ``n < 2**31`` so that ``n * M < 2**64``."""
    d = max(int(d), 1)
    s = 32 + (d - 1).bit_length()
    return -(-(1 << s) // d), s
