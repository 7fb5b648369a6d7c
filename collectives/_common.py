"""Helpers shared by the collective algorithms (chunking, bounded waits, tags)."""
from __future__ import annotations

import numpy as np

__all__ = ["chunk_bounds", "waitall", "TAGS"]

# Tags of the collective algorithms.  They run on a communicator of their own
# (Communicator duplicates one for collectives), so these cannot meet user tags.
TAGS = {
    "header": 101,
    "rs": 111,
    "ag": 112,
    "rd_pre": 121,
    "rd": 122,
    "rd_post": 123,
    "bcast": 131,
    "a2a": 141,
    "barrier": 151,
}


def chunk_bounds(count: int, parts: int) -> np.ndarray:
    """Offsets of ``parts`` nearly equal chunks of ``count`` elements.

    The first ``count % parts`` chunks hold one element more (as
    ``numpy.array_split``).  Chunk ``i`` is ``[b[i], b[i+1])``.

    Returns:
        np.ndarray: int64, shape ``(parts + 1,)``.
    """
    base, extra = divmod(count, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    b = np.zeros(parts + 1, dtype=np.int64)
    np.cumsum(sizes, out=b[1:])
    return b


def waitall(transport, requests, timeout) -> None:
    """Wait for one step's requests through the transport (bounded when ``timeout``)."""
    w = getattr(transport, "waitall", None)
    if w is not None:
        w(requests, timeout)
    else:  # pragma: no cover - every Transport has waitall
        for r in requests:
            r.wait(timeout)
