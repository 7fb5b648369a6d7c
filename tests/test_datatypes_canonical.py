"""The canonical form, tested directly: equal layouts built different ways
canonicalize alike; the passes (drop count-1 dims, fold dense runs, flatten
into the parent, evenly spaced blocks -> strided) reach a fixed point."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commlib import datatypes as dts
from commlib.datatypes import canonical as C
from commlib.datatypes.testing import datatypes

pytestmark = pytest.mark.timeout(60)

F8 = np.float64
SB = dts.StridedBlock


def test_column_block_built_seven_ways():
    """4 rows x 2 doubles of a 4 x 6 double array, every constructor."""
    want = SB(0, (16, 4), (1, 48))
    ways = [
        dts.Vector(4, 2, 6, F8),
        dts.Hvector(4, 2, 48, F8),
        dts.Subarray([4, 6], [4, 2], [0, 0], F8),
        dts.Subarray([6, 4], [2, 4], [0, 0], F8, order="F"),
        dts.Hvector(4, 1, 48, dts.Contiguous(2, F8)),
        dts.IndexedBlock(2, [0, 6, 12, 18], F8),
        dts.Hindexed([2] * 4, [0, 48, 96, 144], F8),
        dts.Indexed([1, 1] * 4, [0, 1, 6, 7, 12, 13, 18, 19], F8),
        dts.Struct([2] * 4, [0, 48, 96, 144], [F8] * 4),
        dts.Struct([1, 1, 1, 1], [0, 48, 96, 144], [dts.Contiguous(2, F8)] * 4),
        dts.Contiguous(4, dts.Resized(dts.Contiguous(2, F8), 0, 48)),
        dts.Hvector(4, 1, 48, dts.Named(np.dtype([("a", F8), ("b", F8)]))),
    ]
    for t in ways:
        assert t.canonical() == want, t
        assert t.size == 64


def test_drop_count_one_and_fold_dense():
    assert dts.Contiguous(3, dts.Contiguous(4, np.float32)).canonical() == SB(0, (48,), (1,))
    assert dts.Vector(3, 2, 2, F8).canonical() == SB(0, (48,), (1,))  # stride == blocklength
    assert dts.Vector(1, 5, 100, F8).canonical() == SB(0, (40,), (1,))
    assert dts.Subarray([1, 5, 1], [1, 2, 1], [0, 1, 0], F8).canonical() == SB(8, (16,), (1,))
    # a full plane of a 3-D array folds into one run
    assert dts.Subarray([4, 5, 6], [2, 5, 6], [1, 0, 0], F8).canonical() == SB(240, (480,), (1,))
    assert C.normalize(0, (8, 1, 3, 1), (1, 99, 8, 7)) == SB(0, (24,), (1,))


def test_flatten_into_parent_when_strides_line_up():
    inner = dts.Vector(3, 1, 2, F8)              # 3 doubles, 16 bytes apart
    outer = dts.Hvector(4, 1, 48, inner)         # the next 3 continue the stride
    assert outer.canonical() == SB(0, (8, 12), (1, 16))
    # a resized column whose copies continue the column's own stride
    nested = dts.Vector(2, 1, 3, dts.Resized(dts.Vector(3, 1, 2, F8), 0, 16))
    assert nested.canonical() == SB(0, (8, 6), (1, 16))
    # ... and one whose copies do not
    nested = dts.Vector(2, 1, 5, dts.Resized(dts.Vector(3, 1, 2, F8), 0, 16))
    assert nested.canonical() == SB(0, (8, 3, 2), (1, 16, 80))


def test_more_than_three_dimensions_and_negative_strides():
    t = dts.Subarray([3, 4, 5, 6, 7], [2, 2, 2, 2, 2], [1, 1, 1, 1, 1], np.int16)
    c = t.canonical()
    assert c.ndim == 5 and c.counts == (4, 2, 2, 2, 2)
    assert c.strides == (1, 14, 84, 420, 1680)
    v = dts.Vector(5, 1, -3, F8)
    assert v.canonical() == SB(0, (8, 5), (1, -24))
    assert (v.lb, v.extent) == (-96, 104)
    assert v.canonical().bounds() == (-96, 8)


def test_irregular_layouts_stay_offsets_lengths_and_merge():
    t = dts.Indexed([2, 1, 2], [0, 2, 10], np.int32)  # first two blocks touch: merged
    c = t.canonical()
    assert isinstance(c, dts.Blocks)
    assert c.offsets.tolist() == [0, 40] and c.lengths.tolist() == [12, 8]
    # merged runs of equal length at a lattice become strided again
    assert dts.Indexed([2, 1, 3], [0, 2, 10], np.int32).canonical() == SB(0, (12, 2), (1, 40))
    # equal-length runs, but irregular spacing
    u = dts.Hindexed([1, 1, 1], [0, 16, 40], F8)
    assert isinstance(u.canonical(), dts.Blocks)
    s = dts.Struct([1, 1], [0, 8], [F8, np.int32])
    assert s.canonical() == SB(0, (12,), (1,))
    m = dts.Struct([1, 1], [0, 16], [F8, np.int32])
    assert m.canonical() == dts.Blocks([0, 16], [8, 4])


def test_evenly_spaced_indexed_blocks_in_two_levels():
    # offsets forming a 2-D lattice: rows of 3 blocks, 4 rows
    disps = [r * 100 + c * 10 for r in range(4) for c in range(3)]
    t = dts.IndexedBlock(1, disps, np.int16)
    assert t.canonical() == SB(0, (2, 3, 4), (1, 20, 200))


def test_count_plan_folds_count_into_the_layout():
    col = dts.Resized(dts.Vector(4, 1, 6, F8), 0, 8)
    # 6 columns, packed column after column
    assert dts.plan_for(col, 6).layout == SB(0, (8, 4, 6), (1, 48, 8))
    assert dts.plan_for(col, 6).kind == "strided"
    assert dts.plan_for(dts.Named(F8), 10).kind == "contig"
    irregular = dts.Struct([1, 1], [0, 16], [F8, np.int32])  # extent 24
    p = dts.plan_for(irregular, 5)
    assert p.nbytes == 60


def test_detect_lattice_and_merge_runs():
    assert C.detect_lattice(np.array([5], np.int64)) == ((), ())
    assert C.detect_lattice(np.array([0, 4, 8, 100, 104, 108], np.int64)) == ((3, 2), (4, 100))
    assert C.detect_lattice(np.array([0, 4, 8, 100, 104], np.int64)) is None
    assert C.detect_lattice(np.array([0, 4, 9], np.int64)) is None
    b = C.merge_runs(np.array([0, 4, 8, 20]), np.array([4, 4, 0, 2]))
    assert b.offsets.tolist() == [0, 20] and b.lengths.tolist() == [8, 2]


@settings(max_examples=80, deadline=None)
@given(datatypes(depth=3), st.integers(1, 3))
def test_canonical_form_is_a_fixed_point_and_matches_the_type_map(t, count):
    c = t.canonical()
    assert c.size == t.size
    if isinstance(c, dts.StridedBlock):
        assert C.normalize(c.start, c.counts, c.strides) == c
        assert all(n > 1 for n in c.counts[1:])
        assert c.strides[0] == 1
        # the enumerated runs re-canonicalize to the same strided block (unless
        # a block ends where the next one in another dimension starts: then the
        # maximal runs differ in length and the offsets/lengths form is kept)
        b = c.to_blocks()
        if C.merge_runs(b.offsets, b.lengths).nblocks == b.nblocks:
            assert C.regularize(b.offsets, b.lengths) == c
    else:
        assert C.regularize(c.offsets, c.lengths) == c
        assert (c.lengths > 0).all()
        assert not np.any(c.offsets[:-1] + c.lengths[:-1] == c.offsets[1:])
    if t.size:
        lo, hi = c.bounds()
        assert (lo, hi) == (t.true_lb, t.true_ub)
