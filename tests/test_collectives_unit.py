"""Serial unit tests of the collective building blocks (plain pytest, one process)."""
import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import commlib  # noqa: E402
from commlib.collectives import ops  # noqa: E402
from commlib.collectives._common import chunk_bounds  # noqa: E402
from commlib.collectives.bcast_binomial import binomial_tree  # noqa: E402
from commlib.collectives.ft import FaultTolerance  # noqa: E402
from commlib.transports.mpi_process import ft_mode, ft_mode_info  # noqa: E402
from commlib.collectives.reduce_scatter_ring import ring_order  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("count,parts", [(0, 1), (0, 3), (1, 4), (10, 3), (4099, 4), (7, 7)])
def test_chunk_bounds(count, parts):
    b = chunk_bounds(count, parts)
    assert b[0] == 0 and b[-1] == count and len(b) == parts + 1
    sizes = np.diff(b)
    assert sizes.max() - sizes.min() <= 1 and (np.diff(sizes) <= 0).all()


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_order_is_a_rotation(n):
    for c in range(n):
        order = ring_order(c, n)
        assert sorted(order) == list(range(n)) and order[-1] == c


@pytest.mark.parametrize("n", range(1, 12))
@pytest.mark.parametrize("root", [0, 1, 5])
def test_binomial_tree_spans(n, root):
    root %= n
    parents = {}
    for r in range(n):
        p, kids = binomial_tree(r, n, root)
        assert (p is None) == (r == root)
        for k in kids:
            parents.setdefault(k, []).append(r)
        if p is not None:
            assert r in binomial_tree(p, n, root)[1]
    assert sorted(parents) == sorted(set(range(n)) - {root})
    assert all(len(v) == 1 for v in parents.values())


def test_ops_fit_dtypes():
    for name in ("sum", "prod", "min", "max", "avg"):
        for dt in (np.float16, BF16, np.float32, np.float64):
            ops.get_op(name).check(dt)
    for name in ("band", "bor", "bxor", "sum", "min"):
        for dt in (np.int8, np.uint16, np.int32, np.uint64):
            ops.get_op(name).check(dt)
    with pytest.raises(commlib.InvalidArgument, match="integer dtype"):
        ops.get_op("bxor").check(np.float32)
    with pytest.raises(commlib.InvalidArgument, match="floating"):
        ops.get_op("avg").check(np.int64)
    with pytest.raises(commlib.InvalidArgument, match="not supported"):
        ops.get_op("sum").check(np.complex64)
    with pytest.raises(commlib.InvalidArgument, match="unknown op"):
        ops.get_op("median")


def test_ops_reduce_and_avg():
    a = np.array([1, 2, 3], BF16)
    ops.get_op("sum").reduce(a, np.array([1, 1, 1], BF16))
    np.testing.assert_array_equal(a.astype(np.float32), [2, 3, 4])
    x = np.array([4.0, 8.0])
    ops.get_op("avg").finalize(x, 4)
    np.testing.assert_array_equal(x, [1.0, 2.0])


def test_dtype_code_stable_and_distinct():
    codes = {ops.dtype_code(d) for d in (np.float16, BF16, np.float32, np.float64, np.int8, np.uint8, np.int64)}
    assert len(codes) == 7
    assert ops.dtype_code(BF16) == ops.dtype_code(np.dtype(ml_dtypes.bfloat16))


def test_dtype_name_names_each_code_byte_order_included():
    """Mismatch messages name dtypes as written: a byte order other than this
    machine's is named too (a big-endian float32 used to show as a raw code)."""
    swapped = np.dtype(np.float32).newbyteorder()
    order = "big" if swapped.byteorder == ">" else "little"
    assert ops.dtype_name(ops.dtype_code(swapped)) == f"float32 ({order}-endian)"
    for d in (np.float32, np.int64, np.uint8, np.bool_, BF16):
        assert ops.dtype_name(ops.dtype_code(d)) == np.dtype(d).name
    assert ops.dtype_name(12345) == 12345


def test_mpi_datatypes():
    from mpi4py import MPI

    from commlib.transports.mpi import MPITransport, mpi_op

    assert MPITransport.native_dtype(np.float32) == MPI.FLOAT
    assert MPITransport.native_dtype(np.int64) == MPI.INT64_T
    assert MPITransport.native_dtype(BF16) is None and MPITransport.native_dtype(np.float16) is None
    assert mpi_op("sum") == MPI.SUM and mpi_op("avg") == MPI.SUM and mpi_op("band") == MPI.BAND
    # the MPI transport names MPI's ops for the collectives (which import no MPI themselves)
    assert ops.get_op(MPI.SUM).name == "sum" and ops.get_op(MPI.BXOR).name == "bxor"
    with pytest.raises(commlib.InvalidArgument, match="unknown op"):
        ops.get_op(MPI.LOR)  # an MPI op commlib has no operator for
    with pytest.raises(commlib.InvalidArgument, match="unknown op"):
        ops.get_op(object())


def test_next_tag_needs_an_allocator():
    """An algorithm's tags come from its transport's allocator; a stand-in without
    one is refused (it used to get tag 0, where two operations' messages could match)."""
    from commlib.collectives._common import next_tag
    from commlib.core.tags import TagAllocator

    class WithTags:
        rank = 0
        tags = TagAllocator(0, 1 << 20)

    a, b = next_tag(WithTags(), 3), next_tag(WithTags())
    assert b >= a + 3

    class NoTags:
        rank = 2

    with pytest.raises(commlib.CommError, match=r"rank 2: next_tag: NoTags has no tag allocator"):
        next_tag(NoTags())


def test_fault_tolerance_validation():
    with pytest.raises(commlib.InvalidArgument, match="on_failure"):
        FaultTolerance("ulfm", on_failure="ignore")
    with pytest.raises(commlib.InvalidArgument, match="timeout"):
        FaultTolerance("timeout", timeout=0)


def test_ft_mode(monkeypatch):
    assert ft_mode() in ("ulfm", "timeout")
    monkeypatch.setenv("COMMLIB_FT_MODE", "timeout")
    assert ft_mode() == "timeout"
    info = ft_mode_info()
    assert info["mode"] == "timeout" and "hint" in info


def test_single_rank_fault_tolerant_comm():
    comm = commlib.init(fault_tolerant=True, timeout=5)
    assert comm.fault_tolerant in ("ulfm", "timeout")
    x = np.arange(5.0)
    assert comm.allreduce(x, np.empty(5)).tolist() == x.tolist()
    assert comm.allgather(np.ones(2)).shape == (comm.size, 2)
    comm.barrier()
    assert comm.failed_ranks == ()
    seen = []
    comm.add_failure_callback(lambda failed, c: seen.append(failed))
    with pytest.raises(commlib.InvalidArgument):
        commlib.init().add_failure_callback(print)
    with pytest.raises(commlib.InvalidArgument, match="unknown option"):
        commlib.init(fault_tolerent=True)


def test_auto_allreduce_algorithm_by_size_and_ranks():
    """``"auto"``: recursive doubling up to 256 KiB on 3 or more ranks, the ring
    above; on 2 ranks the ring (the same bits there: one commutative combine per
    element); an explicit algorithm is kept; an unknown one is refused."""
    from commlib.collectives.engine import SPECS
    from commlib.core.errors import InvalidArgument

    spec = SPECS["allreduce"]
    for nranks, small, large in ((2, "ring", "ring"), (3, "recursive_doubling", "ring"),
                                 (8, "recursive_doubling", "ring"), (None, "recursive_doubling", "ring")):
        assert spec.choose("auto", 4096, nranks=nranks) == small, nranks
        assert spec.choose("auto", 256 * 1024, nranks=nranks) == small, nranks
        assert spec.choose("auto", 256 * 1024 + 1, nranks=nranks) == large, nranks
    assert spec.choose("recursive_doubling", 1 << 20, nranks=2) == "recursive_doubling"
    with pytest.raises(InvalidArgument):
        spec.choose("tree", 8, rank=0, nranks=2)
