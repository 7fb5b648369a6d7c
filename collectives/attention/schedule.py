"""Ring schedules: which K/V shard (or half shard) every rank holds at every step.

Pure bookkeeping — no communication, no array math beyond numpy index
arithmetic — shared by the numpy/CuPy ring (:mod:`.ring`) and the torch ring
(``commlib.nn.ring``), so the ring loop's who-holds-what, whom-to-send-to and
whom-to-receive-from is written once.

A ring attention runs ``P`` steps (``P`` ranks).  Each rank keeps its queries
and sees every rank's K/V exactly once: at step 0 its own shard, then one
shard per step, received from a neighbour while the current one is computed.

* **Unidirectional** (Ring Attention, Liu, Zaharia, Abbeel 2023,
  arXiv:2310.01889): one *stream*, the whole shard, travelling ``r -> r + 1``.
  At step ``s`` rank ``r`` holds the shard of rank ``(r - s) mod P``.  Every
  link carries ``P - 1`` shards, all in one direction.
* **Bidirectional** (the idea of TokenRing, Wang et al. 2024,
  arXiv:2412.20501: use both directions of every link): each shard is cut in
  two halves; half 0 travels ``r -> r + 1`` and half 1 travels ``r -> r - 1``.
  At step ``s`` rank ``r`` holds half 0 of shard ``(r - s) mod P`` and half 1
  of shard ``(r + s) mod P``.  Each link then carries ``P - 1`` half shards in
  *each* direction: the same bytes as the unidirectional ring, in half the
  time on full-duplex links, with the same number of steps and the same block
  work per step.

The backward sends the K/V round again and each held piece's ``dk``/``dv``
accumulator travels with it, in the same direction: after ``P`` hops it is
back at the piece's owner (the holder at step ``P - 1`` sends it home).

Which tokens form each half (:func:`split_halves`) follows the layout, so that
the causal work per step stays balanced over the ranks: with ``"zigzag"``
each half takes the first (half 0) or second (half 1) half of *both* of the
shard's chunks, so a half holds early and late positions alike and every
off-diagonal half block is a quarter of a full block, as in the unidirectional
zigzag ring.  (Halves of one chunk each — chunk 0 one way, chunk 1 the other —
would give some ranks three quarter-blocks and others one at the same step.)
With ``"striped"`` and ``"contiguous"`` a half is the first or second half of
the local tokens: for striped the half-0 block is about 3/8 of a full block
and the half-1 block 1/8, and each rank holds one of each at every step.
:func:`ring_work` counts this.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import layout_of

__all__ = ["Stream", "RingStep", "RingSchedule", "split_halves", "piece_positions", "ring_work"]


@dataclass(frozen=True)
class Stream:
    """One travelling piece of every shard.

    Attributes:
        index: the stream's number (0 or 1), also its tag offset.
        half: ``None`` (the whole shard) or ``0`` / ``1`` (that half, :func:`split_halves`).
        direction: ``+1``: sent to ``rank + 1``, received from ``rank - 1``;
            ``-1``: the reverse.
    """

    index: int
    half: int | None
    direction: int


@dataclass(frozen=True)
class RingStep:
    """What a rank does at one step.

    Attributes:
        step: ``0 .. P - 1``.
        owners: per stream, the rank whose shard (piece) this rank holds.
        last: the final step: no K/V transfer is posted for a next step.
    """

    step: int
    owners: tuple
    last: bool


class RingSchedule:
    """The ring of ``size`` ranks as seen from ``rank``.

    Args:
        size: number of ranks ``P`` (>= 1).
        rank: this rank, in ``[0, size)``.
        bidirectional: two half-shard streams in opposite directions instead
            of one whole-shard stream.

    Attributes:
        streams: the :class:`Stream` tuple (1 or 2 entries).
    """

    def __init__(self, size: int, rank: int, bidirectional: bool = False):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"bad ring: rank {rank} of size {size}")
        self.size = int(size)
        self.rank = int(rank)
        self.bidirectional = bool(bidirectional)
        if self.bidirectional:
            self.streams = (Stream(0, 0, +1), Stream(1, 1, -1))
        else:
            self.streams = (Stream(0, None, +1),)

    def owner(self, stream: Stream, step: int) -> int:
        """The rank whose piece ``stream`` brings to this rank at ``step``."""
        return (self.rank - stream.direction * step) % self.size

    def holder(self, stream: Stream, owner: int, step: int) -> int:
        """The rank that holds ``owner``'s piece of ``stream`` at ``step``."""
        return (owner + stream.direction * step) % self.size

    def send_to(self, stream: Stream) -> int:
        """Where this rank sends the pieces of ``stream`` (K/V and the travelling dk/dv)."""
        return (self.rank + stream.direction) % self.size

    def recv_from(self, stream: Stream) -> int:
        """Where this rank receives the pieces of ``stream`` from."""
        return (self.rank - stream.direction) % self.size

    def steps(self):
        """Yield the :class:`RingStep` of every step, in order."""
        for s in range(self.size):
            yield RingStep(s, tuple(self.owner(st, s) for st in self.streams), s == self.size - 1)


def split_halves(layout, seq_local: int):
    """Local token indices of the two halves of a shard (bidirectional ring):
    :meth:`.layout.Layout.halves` of ``layout`` (a name or a :class:`.layout.Layout`).

    Returns:
        tuple: two sorted int64 numpy arrays partitioning ``range(L)``.
        contiguous / striped: ``[0, ceil(L/2))`` and the rest; zigzag (chunks
        of ``c = L/2``): ``[0, h) + [c, c + h)`` and ``[h, c) + [c + h, L)``
        with ``h = ceil(c/2)``.  Positions stay ascending inside each half.
    """
    return layout_of(layout, op="split_halves").halves(seq_local)


def piece_positions(layout, owner: int, size: int, seq_local: int, half: int | None = None) -> np.ndarray:
    """Global positions of ``owner``'s shard, or of one half of it (ascending int64)."""
    return layout_of(layout, op="piece_positions").piece_positions(owner, size, seq_local, half)


def ring_work(size: int, seq_local: int, layout: str, causal: bool, bidirectional: bool = False) -> np.ndarray:
    """Visible (query, key) pairs each rank computes at each step (per batch and head).

    The exact block work the schedule implies, from positions alone; the
    bidirectional ring's step 0 is the whole own shard, as for the
    unidirectional one.

    Returns:
        numpy.ndarray: int64 ``(size, size)``: ``[rank, step]``.  The critical
        path is ``work.max(axis=0).sum()``.
    """
    layout = layout_of(layout, op="ring_work")
    work = np.zeros((size, size), dtype=np.int64)
    for r in range(size):
        sched = RingSchedule(size, r, bidirectional)
        qpos = layout.positions(r, size, seq_local)
        for st in sched.steps():
            streams = sched.streams if st.step else (Stream(0, None, +1),)
            for stream in streams:
                kpos = layout.piece_positions(sched.owner(stream, st.step), size, seq_local, stream.half)
                if causal:
                    work[r, st.step] += int(np.searchsorted(kpos, qpos, side="right").sum())
                else:
                    work[r, st.step] += len(qpos) * len(kpos)
    return work
