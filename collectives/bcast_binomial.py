"""Binomial-tree broadcast, pipelined in segments for large messages.

Thakur, Rabenseifner & Gropp, IJHPCA 19(1), 2005, §4.2 (binomial tree: ``ceil(log2 n)``
rounds, rank ``vr = (r - root) mod n`` receives from ``vr - 2^k`` where ``2^k`` is
``vr``'s lowest set bit, then sends to ``vr + 2^j`` for ``2^j < 2^k``).  Large
messages are cut into segments of ``segment_bytes``; a rank forwards segment
``i`` to its children as soon as it arrives, while segment ``i + 1`` is still in
flight from its parent, so the tree works as a pipeline (as Open MPI's
``coll/tuned`` segmented binomial bcast).
"""
from __future__ import annotations

import numpy as np

from commlib.core.seconds import deadline_of

from ._common import next_tag, waitall

__all__ = ["bcast_binomial", "binomial_tree", "DEFAULT_SEGMENT_BYTES"]

DEFAULT_SEGMENT_BYTES = 1 << 20
"""Segment size (bytes) above which the broadcast is pipelined."""


def binomial_tree(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """``(parent, children)`` of ``rank`` in the binomial tree rooted at ``root``
    (parent None at the root; children in the order they are sent to)."""
    vr = (rank - root) % size
    parent = None
    mask = 1
    while mask < size:
        if vr & mask:
            parent = ((vr - mask) + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if vr + mask < size:
            children.append(((vr + mask) + root) % size)
        mask >>= 1
    return parent, children


def bcast_binomial(transport, buf: np.ndarray, root: int = 0, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   timeout: float | None = None) -> None:
    """Broadcast ``buf`` from ``root`` in place.

    Args:
        transport: the point-to-point transport (n ranks).
        buf: 1-D contiguous host array, same count and dtype on every rank; the
            root's contents are copied into every other rank's.
        root: rank in ``[0, n)`` whose data is broadcast.
        segment_bytes: pipeline segment size in bytes (<= 0: no segmentation).
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            segment wait waits what is left of it.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    n, r = transport.size, transport.rank
    if n == 1 or buf.size == 0:
        return
    parent, children = binomial_tree(r, n, root)
    item = buf.dtype.itemsize
    seg = max(1, segment_bytes // item) if segment_bytes and segment_bytes > 0 else buf.size
    starts = list(range(0, buf.size, seg))
    tag = next_tag(transport)
    if timeout is None and len(starts) == 1:  # one unbounded segment: blocking calls, no request objects
        if parent is not None:
            transport.recv(buf, parent, tag)
        if len(children) == 1:
            transport.send(buf, children[0], tag)
        elif children:
            waitall(transport, [transport.isend(buf, c, tag) for c in children], None)
        return
    rreqs = []
    if parent is not None:
        rreqs = [transport.irecv(buf[s:s + seg], parent, tag) for s in starts]
    sends = []
    for i, s in enumerate(starts):
        if rreqs:
            waitall(transport, [rreqs[i]], timeout)
        for c in children:
            sends.append(transport.isend(buf[s:s + seg], c, tag))
    waitall(transport, sends, timeout)
