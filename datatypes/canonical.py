"""Canonical forms of a datatype's layout, and the passes that produce them.

A datatype's *layout* is the sequence of bytes its type map touches, in type-map
order (MPI-4.0 §5.1): packing copies exactly these bytes, in this order, into a
contiguous buffer.  commlib describes every layout in one of two canonical forms:

* :class:`StridedBlock` — ``{start, counts[], strides[]}`` in bytes, any number of
  dimensions, dimension 0 the fastest (TEMPI's convention, Pearson et al., HPDC'22):
  ``counts[0]`` is the length in bytes of each contiguous block and ``strides[0]``
  is 1; dimension ``d >= 1`` repeats the dimensions below it ``counts[d]`` times,
  ``strides[d]`` bytes apart (negative and zero strides allowed).
* :class:`Blocks` — the compact offsets/lengths form for layouts that are not a
  single strided block (structs of mixed types, irregular indexed types): byte
  offsets and lengths of maximal contiguous runs, in type-map order.

The passes (run to a fixed point by :func:`normalize` and :func:`regularize`):

1. *drop count-1 dimensions*;
2. *fold dense runs* — dimension ``d`` merges into ``d-1`` when
   ``strides[d] == counts[d-1] * strides[d-1]`` (this also flattens a child stream
   into its parent when the strides line up);
3. *merge adjacent runs* of the offsets/lengths form;
4. *turn evenly spaced blocks into a strided form* — equal-length runs whose
   offsets form a (multi-dimensional) arithmetic lattice become a
   :class:`StridedBlock`.

Unlike TEMPI, dimensions are never *sorted* by stride: the type-map order is the
packed byte order, and reordering dimensions would change the packed bytes.
The result is unique: two types with the same byte sequence canonicalize to the
same form, however they were built (``Vector``, ``Subarray``, ``Indexed`` with
evenly spaced blocks, ``Struct`` of one type, ``Resized`` columns, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StridedBlock", "Blocks", "normalize", "regularize", "detect_lattice", "merge_runs"]


@dataclass(frozen=True)
class StridedBlock:
    """A regular layout: ``prod(counts)`` bytes at ``start + sum(i_d * strides[d])``.

    Attributes:
        start: byte offset of the first byte, relative to the buffer origin.
        counts: tuple of ints, dimension 0 fastest; ``counts[0]`` is the contiguous
            block length in bytes. ``(0,)`` for an empty layout.
        strides: tuple of ints in bytes, same length as ``counts``;
            ``strides[0] == 1``.
    """

    start: int
    counts: tuple
    strides: tuple

    @property
    def ndim(self) -> int:
        """Number of dimensions, the contiguous byte dimension included."""
        return len(self.counts)

    @property
    def size(self) -> int:
        """Packed size in bytes."""
        n = 1
        for c in self.counts:
            n *= c
        return n

    @property
    def block(self) -> int:
        """Length in bytes of each contiguous block."""
        return self.counts[0]

    def bounds(self) -> tuple[int, int]:
        """``(lo, hi)``: lowest byte offset touched and one past the highest (bytes)."""
        if self.size == 0:
            return (0, 0)
        lo = hi = self.start
        for c, s in zip(self.counts[1:], self.strides[1:]):
            span = (c - 1) * s
            if span < 0:
                lo += span
            else:
                hi += span
        return lo, hi + self.counts[0]

    def to_blocks(self) -> "Blocks":
        """Enumerate the blocks (offsets/lengths form); size grows with the block count."""
        if self.size == 0:
            return Blocks(np.zeros(0, np.int64), np.zeros(0, np.int64))
        offs = np.array([self.start], dtype=np.int64)
        for c, s in zip(self.counts[1:], self.strides[1:]):
            # dimension d is slower than everything built so far
            offs = (np.arange(c, dtype=np.int64)[:, None] * s + offs[None, :]).ravel()
        return Blocks(offs, np.full(offs.shape, self.counts[0], dtype=np.int64))

    def shifted(self, disp: int) -> "StridedBlock":
        """The same layout moved by ``disp`` bytes."""
        return StridedBlock(self.start + int(disp), self.counts, self.strides)


class Blocks:
    """An irregular layout: contiguous runs ``lengths[i]`` bytes long at ``offsets[i]``.

    Runs are in type-map order, of non-zero length, and maximal (no run ends where
    the next begins).

    Attributes:
        offsets: int64 array of shape ``(n,)``, bytes from the buffer origin.
        lengths: int64 array of shape ``(n,)``, bytes.
    """

    __slots__ = ("offsets", "lengths")

    def __init__(self, offsets, lengths):
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)

    @property
    def size(self) -> int:
        """Packed size in bytes."""
        return int(self.lengths.sum())

    @property
    def nblocks(self) -> int:
        """Number of contiguous runs."""
        return int(self.offsets.shape[0])

    def bounds(self) -> tuple[int, int]:
        """``(lo, hi)``: lowest byte offset touched and one past the highest (bytes)."""
        if self.offsets.size == 0:
            return (0, 0)
        return int(self.offsets.min()), int((self.offsets + self.lengths).max())

    def shifted(self, disp: int) -> "Blocks":
        """The same layout moved by ``disp`` bytes."""
        return Blocks(self.offsets + int(disp), self.lengths)

    def to_blocks(self) -> "Blocks":
        return self

    def __eq__(self, other):
        return (
            isinstance(other, Blocks)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.lengths, other.lengths)
        )

    def __hash__(self):
        return hash((self.offsets.tobytes(), self.lengths.tobytes()))

    def __repr__(self):
        n = self.offsets.size
        if n <= 8:
            return f"Blocks(offsets={self.offsets.tolist()}, lengths={self.lengths.tolist()})"
        return f"Blocks(n={n}, offsets=[{self.offsets[0]}, ...], size={self.size})"


EMPTY = StridedBlock(0, (0,), (1,))


def normalize(start: int, counts, strides) -> StridedBlock:
    """Drop count-1 dimensions and fold dense ones, to a fixed point.

    Args:
        start: byte offset of the first byte.
        counts: ints, dimension 0 fastest, ``counts[0]`` bytes.
        strides: ints in bytes, ``strides[0]`` must be 1.

    Returns:
        StridedBlock: the canonical strided block (``EMPTY`` if any count is 0).
    """
    if any(c == 0 for c in counts):
        return EMPTY
    oc = [int(counts[0])]
    os_ = [1]
    for c, s in zip(counts[1:], strides[1:]):
        c = int(c)
        s = int(s)
        if c == 1:
            continue
        if s == oc[-1] * os_[-1]:
            oc[-1] *= c  # fold: dimension continues the one below densely
            continue
        oc.append(c)
        os_.append(s)
    return StridedBlock(int(start), tuple(oc), tuple(os_))


def detect_lattice(d: np.ndarray):
    """Express a displacement sequence as a multi-dimensional arithmetic lattice.

    Args:
        d: int64 array of shape ``(n,)``, ``n >= 1``.

    Returns:
        ``(counts, strides)`` tuples, fastest first, with
        ``d == d[0] + sum(i_k * strides[k])`` in lexicographic order, or ``None``
        when ``d`` is not such a lattice.
    """
    counts: list[int] = []
    strides: list[int] = []
    while d.shape[0] > 1:
        n = d.shape[0]
        step = int(d[1] - d[0])
        diffs = np.diff(d)
        bad = np.flatnonzero(diffs != step)
        run = n if bad.size == 0 else int(bad[0]) + 1
        if n % run:
            return None
        rows = d.reshape(n // run, run)
        if run < n and not np.array_equal(
            rows - rows[:, :1], np.broadcast_to(np.arange(run, dtype=np.int64) * step, rows.shape)
        ):
            return None
        counts.append(run)
        strides.append(step)
        d = rows[:, 0]
    return tuple(counts), tuple(strides)


def merge_runs(offsets: np.ndarray, lengths: np.ndarray) -> Blocks:
    """Drop empty runs and merge runs that continue one another (type-map order kept)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = lengths != 0
    if not keep.all():
        offsets = offsets[keep]
        lengths = lengths[keep]
    if offsets.shape[0] <= 1:
        return Blocks(offsets, lengths)
    cont = offsets[:-1] + lengths[:-1] == offsets[1:]
    if not cont.any():
        return Blocks(offsets, lengths)
    first = np.concatenate(([True], ~cont))
    idx = np.flatnonzero(first)
    return Blocks(offsets[idx], np.add.reduceat(lengths, idx))


def regularize(offsets, lengths):
    """Canonicalize an offsets/lengths layout.

    Runs are merged; equal-length runs at lattice offsets become a
    :class:`StridedBlock`, anything else stays :class:`Blocks`.

    Args:
        offsets: int array of shape ``(n,)``, bytes, type-map order.
        lengths: int array of shape ``(n,)``, bytes.

    Returns:
        StridedBlock | Blocks
    """
    b = merge_runs(offsets, lengths)
    n = b.offsets.shape[0]
    if n == 0:
        return EMPTY
    L = int(b.lengths[0])
    if n == 1:
        return StridedBlock(int(b.offsets[0]), (L,), (1,))
    if not (b.lengths == L).all():
        return b
    lat = detect_lattice(b.offsets)
    if lat is None:
        return b
    counts, strides = lat
    return normalize(int(b.offsets[0]), (L,) + counts, (1,) + strides)


def replicate(layout, counts=(), strides=(), displs=None):
    """Copies of ``layout`` at a lattice of displacements, or at listed ones.

    Args:
        layout: StridedBlock | Blocks of one child.
        counts, strides: lattice of copies (fastest first; strides in bytes).
        displs: int64 array of explicit displacements (bytes, in order) applied
            outside the lattice; ``None`` for the lattice alone.

    Returns:
        StridedBlock | Blocks: the canonical layout of all copies in order.
    """
    if layout.size == 0 or any(c == 0 for c in counts):
        return EMPTY
    if displs is not None:
        displs = np.asarray(displs, dtype=np.int64)
        if displs.shape[0] == 0:
            return EMPTY
        lat = detect_lattice(displs)
        if lat is not None:
            layout = replicate(layout, counts, strides).shifted(int(displs[0]))
            return replicate(layout, *lat)
        inner = replicate(layout, counts, strides).to_blocks()
        offs = (displs[:, None] + inner.offsets[None, :]).ravel()
        lens = np.broadcast_to(inner.lengths[None, :], (displs.shape[0], inner.lengths.shape[0])).ravel()
        return regularize(offs, lens)
    if isinstance(layout, StridedBlock):
        return normalize(layout.start, layout.counts + tuple(counts), layout.strides + tuple(strides))
    if not counts:
        return regularize(layout.offsets, layout.lengths)
    d = np.zeros(1, dtype=np.int64)
    for c, s in zip(counts, strides):
        d = (np.arange(c, dtype=np.int64)[:, None] * s + d[None, :]).ravel()
    offs = (d[:, None] + layout.offsets[None, :]).ravel()
    lens = np.broadcast_to(layout.lengths[None, :], (d.shape[0], layout.lengths.shape[0])).ravel()
    return regularize(offs, lens)


def concatenate(layouts):
    """The layout of several layouts one after another (type-map order)."""
    layouts = [lay for lay in layouts if lay.size]
    if not layouts:
        return EMPTY
    if len(layouts) == 1:
        lay = layouts[0]
        return lay if isinstance(lay, StridedBlock) else regularize(lay.offsets, lay.lengths)
    bl = [lay.to_blocks() for lay in layouts]
    return regularize(np.concatenate([b.offsets for b in bl]), np.concatenate([b.lengths for b in bl]))
