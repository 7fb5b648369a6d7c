"""Sequence-parallel attention against a dense float64 numpy oracle.

Run serially (``pytest tests/test_attention.py``: size-1 checks on
``COMM_SELF`` and the host-only units) and under MPI at several sizes::

    mpiexec -n N python -m pytest --with-mpi tests/test_attention.py   # N = 1, 2, 3, 4

The oracle is written here from the definition, not from the code under test:
forward ``softmax(QK^T * scale + mask) V`` and the analytic backward
``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``,
``dQ = dS K * scale``, ``dK = dS^T Q * scale``, summed over each query group
for grouped-query attention.
"""
from __future__ import annotations

import numpy as np
import pytest

from commlib.collectives import attention as A
from commlib.collectives.attention import blocks, ring
from commlib.core.errors import InvalidArgument

ml_dtypes = pytest.importorskip("ml_dtypes")

LAYOUTS = ("contiguous", "striped", "zigzag")
TOL = {"float64": 1e-10, "float32": 1e-5, "float16": 2e-2, "bfloat16": 3e-2}


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# ------------------------------------------------------------------ the oracle
def dense_forward(q, k, v, causal, scale):
    """Dense float64 attention: q (B,S,H,D), k/v (B,S,Hkv,D) -> out (B,S,H,D), lse (B,H,S)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    n = q.shape[1]
    mask = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(l[..., 0]), -np.inf)
    pn = p / np.where(l > 0, l, 1.0)
    return np.einsum("bhij,bjhd->bihd", pn, vr), lse


def dense_backward(q, k, v, dout, causal, scale):
    """Analytic dense float64 gradients (dq, dk, dv) of ``sum(out * dout)``."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    b, n, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    out, lse = dense_forward(q, k, v, causal, scale)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    mask = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    p = np.where(mask, np.exp(s - lse[..., None]), 0.0)
    dv = np.einsum("bhij,bihd->bjhd", p, dout)
    dp = np.einsum("bihd,bjhd->bhij", dout, vr)
    big_d = np.einsum("bihd,bihd->bhi", dout, out)
    ds = p * (dp - big_d[..., None])
    dq = np.einsum("bhij,bjhd->bihd", ds, kr) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    return dq, dk.reshape(b, n, hk, g, d).sum(3), dv.reshape(b, n, hk, g, d).sum(3)


def assert_close(got, want, tol, what):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert not np.isnan(got).any(), f"{what}: NaN"
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin), f"{what}: -inf pattern differs"
    scale = max(np.abs(want[fin]).max(initial=0.0), 1e-300)
    err = np.abs(got[fin] - want[fin]).max(initial=0.0) / scale
    assert err <= tol, f"{what}: max relative error {err:.3e} > {tol:.1e}"


def make_inputs(seed, batch, seq, heads, kv_heads, dim, dtype):
    rng = np.random.default_rng(seed)
    dt = _dtype(dtype)
    mk = lambda h: rng.standard_normal((batch, seq, h, dim)).astype(dt)  # noqa: E731
    return mk(heads), mk(kv_heads), mk(kv_heads), mk(heads)


# ------------------------------------------------------------------ the check
def check_algorithm(comm, algo, layout, causal, dtype, heads, kv_heads, seq, *, batch=2, dim=8, tile=4,
                    backward=True):
    """Shard global inputs, run ``algo`` forward (and backward), gather, compare."""
    q, k, v, do = make_inputs(1234 + seq, batch, seq, heads, kv_heads, dim, dtype)
    scale = dim ** -0.5
    local = [A.shard_sequence(x, comm, layout)[0] for x in (q, k, v, do)]
    fwd, bwd = {"ring": (A.ring_attention, A.ring_attention_backward),
                "ulysses": (A.ulysses_attention, A.ulysses_attention_backward)}[algo]
    kw = dict(causal=causal, layout=layout, seq_len=seq, tile=tile, timeout=60)
    out, lse = fwd(*local[:3], comm, **kw)
    assert out.dtype == q.dtype and out.shape == local[0].shape
    assert lse.dtype == blocks.compute_dtype(q.dtype) and lse.shape == (batch, heads, local[0].shape[1])
    want_out, want_lse = dense_forward(q, k, v, causal, scale)
    tol = TOL[dtype]
    assert_close(A.unshard_sequence(out, comm, layout, seq, timeout=60), want_out, tol, "out")
    assert_close(A.unshard_sequence(lse, comm, layout, seq, axis=2, timeout=60), want_lse, tol, "lse")
    pos = A.sequence_positions(layout, comm.rank, comm.size, local[0].shape[1])
    pad = pos >= seq
    assert not np.asarray(out[:, pad], np.float64).any() and np.isneginf(lse[:, :, pad]).all()
    if not backward:
        return
    grads = bwd(*local[:3], out, lse, local[3], comm, **kw)
    want = dense_backward(q, k, v, do, causal, scale)
    for name, gl, gw, ref in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert gl.dtype == ref.dtype and gl.shape == A.shard_sequence(ref, comm, layout)[0].shape
        assert_close(A.unshard_sequence(gl, comm, layout, seq, timeout=60), gw, tol, name)
        assert not np.asarray(gl[:, pad], np.float64).any(), f"{name}: padding has gradient"


def _seq(size, odd):
    return 6 * size - 3 if odd else 6 * size


# ------------------------------------------------------------ MPI: every size
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("odd", [False, True], ids=["divisible", "padded"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_matches_dense(world, layout, causal, dtype, kv_heads, odd):
    if kv_heads == 1 and dtype == "float32":
        pytest.skip("MQA covered in float64")
    check_algorithm(world, "ring", layout, causal, dtype, 4, kv_heads, _seq(world.size, odd))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("odd", [False, True], ids=["divisible", "padded"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ulysses_matches_dense(world, layout, causal, dtype, odd):
    p = world.size
    check_algorithm(world, "ulysses", layout, causal, dtype, 2 * p, p, _seq(p, odd))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_accumulates_in_float32(world, algo, dtype):
    p = world.size
    check_algorithm(world, algo, "zigzag", True, dtype, 2 * p, p, _seq(p, True), dim=16)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_larger_tiles_and_default_seq_len(world, layout):
    """No seq_len (no padding), one tile per block, non-default scale."""
    p = world.size
    q, k, v, do = make_inputs(7, 1, 8 * p, 2, 1, 4, "float64")
    local = [A.shard_sequence(x, world, layout)[0] for x in (q, k, v, do)]
    out, lse = A.ring_attention(*local[:3], world, causal=True, layout=layout, softmax_scale=0.3, tile=1000)
    want_out, want_lse = dense_forward(q, k, v, True, 0.3)
    assert_close(A.unshard_sequence(out, world, layout), want_out, 1e-10, "out")
    grads = A.ring_attention_backward(*local[:3], out, lse, local[3], world, causal=True, layout=layout,
                                      softmax_scale=0.3, tile=1000)
    for gl, gw in zip(grads, dense_backward(q, k, v, do, True, 0.3)):
        assert_close(A.unshard_sequence(gl, world, layout), gw, 1e-10, "grad")


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_unshard_roundtrip(world, layout):
    p = world.size
    for n in (1, 2 * p + 1, 4 * p):
        x = np.arange(3 * n * 2, dtype=np.float32).reshape(3, n, 2)
        part, pos = A.shard_sequence(x, world, layout)
        assert part.shape[1] == A.local_seq_len(n, p, layout) and part.flags.c_contiguous
        assert np.array_equal(pos, A.sequence_positions(layout, world.rank, p, part.shape[1]))
        valid = pos < n
        assert np.array_equal(part[:, valid], x[:, pos[valid]]) and not part[:, ~valid].any()
        assert np.array_equal(A.unshard_sequence(part, world, layout, n, timeout=30), x)


def _all_raise(comm, fn, op, match):
    with pytest.raises(InvalidArgument, match=match) as ei:
        fn()
    assert f"rank {comm.rank}" in str(ei.value) and op in str(ei.value)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_arguments_raise_on_every_rank(world):
    """Every rank raises the same InvalidArgument before communicating (a hang would time out)."""
    p = world.size
    q = np.zeros((1, 4, 4, 8))
    k = np.zeros((1, 4, 2, 8))
    op = "ring_attention"
    _all_raise(world, lambda: A.ring_attention(q, k, k, world, layout="spiral"), op, "layout")
    _all_raise(world, lambda: A.ring_attention(q, np.zeros((1, 4, 3, 8)), np.zeros((1, 4, 3, 8)), world),
               op, "multiple of kv_heads")
    _all_raise(world, lambda: A.ring_attention(q, k, np.zeros((1, 4, 2, 4)), world), op, "differs")
    _all_raise(world, lambda: A.ring_attention(q, np.zeros((1, 5, 2, 8)), np.zeros((1, 5, 2, 8)), world),
               op, "does not match")
    _all_raise(world, lambda: A.ring_attention(q[:, :3], k[:, :3], k[:, :3], world, layout="zigzag"), op, "even")
    _all_raise(world, lambda: A.ring_attention(q, k, k, world, seq_len=4 * p + 5), op, "seq_len")
    _all_raise(world, lambda: A.ring_attention(q.astype(np.int32), k, k, world), op, "dtype")
    _all_raise(world, lambda: A.ring_attention(q, k.astype(np.float32), k, world), op, "dtype")
    _all_raise(world, lambda: A.ring_attention(q[0], k, k, world), op, "4-d")
    _all_raise(world, lambda: A.ring_attention(q, k, k, world, softmax_scale=-1.0), op, "softmax_scale")
    _all_raise(world, lambda: A.ring_attention(q, k, k, world, tile=0), op, "tile")
    out, lse = A.ring_attention(q, k, k, world)
    opb = "ring_attention_backward"
    _all_raise(world, lambda: A.ring_attention_backward(q, k, k, out, lse[:, :1], q, world), opb, "lse")
    _all_raise(world, lambda: A.ring_attention_backward(q, k, k, out.astype(np.float32), lse, q, world), opb, "out")
    # the ring still works after the refusals (nothing half-sent is left behind)
    out2, _ = A.ring_attention(q, k, k, world)
    assert np.array_equal(out, out2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_ulysses_head_divisibility_error(world):
    p = world.size
    q = np.zeros((1, 2, p + 1, 4))
    k = np.zeros((1, 2, p + 1, 4))
    for fn, op in ((A.ulysses_attention, "ulysses_attention"),):
        _all_raise(world, lambda: fn(q, k, k, world), op, "divisible")
    q2 = np.zeros((1, 2, 2 * p, 4))
    k2 = np.zeros((1, 2, 1, 4))  # kv_heads 1 < P: not divisible
    _all_raise(world, lambda: A.ulysses_attention(q2, k2, k2, world), "ulysses_attention", "kv_heads")
    _all_raise(world, lambda: A.ulysses_attention_backward(q2, k2, k2, q2, np.zeros((1, 2 * p, 2)), q2, world),
               "ulysses_attention_backward", "divisible")


class _RecordingComm:
    """Forwards point-to-point calls to a real communicator and logs them."""

    def __init__(self, comm, log):
        self._c, self.log = comm, log
        self.rank, self.size = comm.rank, comm.size

    def isend(self, buf, dest, tag=0):
        self.log.append(("isend", tag))
        return self._c.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self.log.append(("irecv", tag))
        return self._c.irecv(buf, source, tag)

    def waitall(self, reqs, timeout=None):
        self.log.append(("wait", None))
        return self._c.waitall(reqs, timeout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_next_block_posted_before_compute(world, monkeypatch):
    """Double buffering, forward and backward: each step's K/V isend/irecv is
    posted before that step's block is computed."""
    log = []
    for name in ("forward_block", "backward_block"):
        real = getattr(ring, name)

        def spy(*a, _real=real, _name=name, **kw):
            log.append((_name, None))
            return _real(*a, **kw)

        monkeypatch.setattr(ring, name, spy)
    p = world.size
    rc = _RecordingComm(world, log)
    q, k, v, do = make_inputs(3, 1, 4 * p, 2, 2, 4, "float64")
    local = [A.shard_sequence(x, world, "contiguous")[0] for x in (q, k, v, do)]
    out, lse = A.ring_attention(*local[:3], rc)
    A.ring_attention_backward(*local[:3], out, lse, local[3], rc)
    for kernel in ("forward_block", "backward_block"):
        idx = [i for i, e in enumerate(log) if e[0] == kernel]
        assert len(idx) == p
        posts = [i for i, e in enumerate(log) if e == ("isend", ring._TAG_KV)]
        for step in range(p - 1):
            before = [i for i in posts if i < idx[step]]
            prev_compute = idx[step - 1] if step else -1
            assert any(i > prev_compute for i in before), f"{kernel} step {step}: K/V not posted before compute"
    # the backward's travelling dk/dv: one receive per step, posted before its block is computed
    bidx = [i for i, e in enumerate(log) if e[0] == "backward_block"]
    recvs = [i for i, e in enumerate(log) if e == ("irecv", ring._TAG_DKV)]
    assert len(recvs) == p and all(r < c for r, c in zip(recvs, bidx))


# --------------------------------------------------- serial (size 1, no mpiexec)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_serial_ring_and_ulysses(selfcomm, layout, causal, dtype):
    check_algorithm(selfcomm, "ring", layout, causal, dtype, 4, 2, 9)
    check_algorithm(selfcomm, "ulysses", layout, causal, dtype, 4, 2, 9)


@pytest.mark.timeout(30)
def test_rows_without_visible_key_are_zero_not_nan():
    """A block in which some query rows see no key (striped causal off-diagonal
    blocks) and an attention where a row sees nothing at all: out 0, lse -inf."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 3, 2, 4))
    k = rng.standard_normal((1, 3, 1, 4))
    v = rng.standard_normal((1, 3, 1, 4))
    qpos = np.array([0, 4, 8])
    kpos = np.array([1, 5, 9])  # query at 0 sees nothing; 4 sees key 1; 8 sees 1 and 5
    qh = blocks.to_heads_major(q, 1, np.float64) * 0.5
    kh = blocks.to_heads_major(k, 1, np.float64)[:, :, 0]
    vh = blocks.to_heads_major(v, 1, np.float64)[:, :, 0]
    state = blocks.ForwardAccumulator(qh.shape, np.float64)
    for tile in (1, 3):
        state = blocks.ForwardAccumulator(qh.shape, np.float64)
        plan = blocks.tile_plan(qpos, kpos, 100, True, tile)
        assert plan.visible == 3
        blocks.forward_block(qh, kh, vh, plan, qpos, kpos, state)
        out, lse = state.finalize()
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        assert not out[..., 0, :].any() and np.isneginf(lse[..., 0]).all()
        assert np.allclose(out[..., 1, :], vh[:, :, None, 0, :])  # one visible key: its value
    # a whole attention whose first row sees nothing (positions as keys start after it)
    out, lse = blocks.attention_forward(q, k, v, causal=True, positions=np.array([0, 1, 2]), seq_len=0)
    assert not out.any() and np.isneginf(lse).all()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_partition_the_sequence(size, layout):
    for n in (1, 7, 2 * size * 3):
        L = A.local_seq_len(n, size, layout)
        allpos = [A.sequence_positions(layout, r, size, L) for r in range(size)]
        for p in allpos:
            assert np.all(np.diff(p) > 0)
        assert np.array_equal(np.sort(np.concatenate(allpos)), np.arange(size * L))
        assert size * L - n < (2 * size if layout == "zigzag" else size)
    if layout == "striped":
        assert list(A.sequence_positions("striped", 1, 4, 3)) == [1, 5, 9]
    if layout == "zigzag":
        assert list(A.sequence_positions("zigzag", 1, 4, 4)) == [2, 3, 12, 13]


@pytest.mark.timeout(60)
def test_plan_striped_and_zigzag_balance_causal_work():
    """Critical-path block work (tile plans): striped and zigzag beat contiguous
    by >= 1.4x at P = 4 (ideal 1.75x), and the causal total is about half."""
    for p, need in ((2, 1.3), (4, 1.4)):
        L = 512
        crit = {}
        for layout in LAYOUTS:
            w = ring.ring_plan_work(p, p * L, L, layout, True, tile=32)
            crit[layout] = w.max(axis=0).sum()
            assert w.sum() <= 0.55 * (p * L) ** 2
        for layout in ("striped", "zigzag"):
            assert crit["contiguous"] / crit[layout] >= need, (p, layout, crit)


@pytest.mark.timeout(60)
def test_single_rank_blocked_matches_dense_and_tiles_skip():
    q, k, v, do = make_inputs(5, 2, 37, 6, 3, 8, "float64")
    out, lse = A.attention_forward(q, k, v, causal=True, tile=5)
    want_out, want_lse = dense_forward(q, k, v, True, 8 ** -0.5)
    assert_close(out, want_out, 1e-10, "out")
    assert_close(lse, want_lse, 1e-10, "lse")
    for g, w in zip(A.attention_backward(q, k, v, out, lse, do, causal=True, tile=5),
                    dense_backward(q, k, v, do, True, 8 ** -0.5)):
        assert_close(g, w, 1e-10, "grad")
    pos = np.arange(64)
    assert blocks.tile_plan(pos, pos, 64, True, 8).work == sum(8 * (i + 8) for i in range(0, 64, 8))


def _gpu_available():
    try:
        import cupy  # noqa: PLC0415

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a GPU with CuPy")
@pytest.mark.timeout(120)
def test_cupy_ring_matches_numpy(selfcomm):  # pragma: no cover - needs a GPU
    import cupy  # noqa: PLC0415

    q, k, v, do = make_inputs(11, 2, 24, 4, 2, 8, "float64")
    for layout in LAYOUTS:
        out, lse = A.ring_attention(*(cupy.asarray(x) for x in (q, k, v)), selfcomm, causal=True, layout=layout)
        assert isinstance(out, cupy.ndarray)
        want_out, _ = dense_forward(q, k, v, True, 8 ** -0.5)
        assert_close(cupy.asnumpy(out), want_out, 1e-10, "out")
        grads = A.ring_attention_backward(*(cupy.asarray(x) for x in (q, k, v)), out, lse,
                                          cupy.asarray(do), selfcomm, causal=True, layout=layout)
        for g, w in zip(grads, dense_backward(q, k, v, do, True, 8 ** -0.5)):
            assert_close(cupy.asnumpy(g), w, 1e-10, "grad")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mismatched_shapes_across_ranks_fail_everywhere(world):
    """One rank with a different head_dim (or one rank alone with bad input):
    every rank raises before any K/V moves, nobody is left waiting."""
    rng = np.random.default_rng(world.rank)
    d = 8 if world.rank == world.size - 1 else 4
    q = rng.standard_normal((1, 4, 2, d))
    with pytest.raises(InvalidArgument, match=r"ring_attention: ranks disagree on the call \(head_dim"):
        A.ring_attention(q, q[:, :, :1], q[:, :, :1], world)
    k = q[:, :, :1] if world.rank else q[:, :3, :1]  # rank 0 alone: k shorter than q
    with pytest.raises(InvalidArgument, match="ring_attention"):
        A.ring_attention(q, k, q[:, :, :1], world)
    world.barrier()
