"""Sliding-window attention on numpy (``commlib.ring_attention(..., window=...)``, the
collectives' halo exchange) against a float64 dense oracle written here.

    mpiexec -n N python -m pytest --with-mpi -m mpi tests/test_attention_window.py   # N = 1, 2, 3, 4

The oracle: dense attention over the whole sequence in float64 with the mask
built from positions (FlashAttention-2's ``window_size``: key ``j`` visible to
query ``i`` when ``i - left <= j <= i + right``, ``j <= i`` if causal, both
below ``seq_len``), and its gradients from the softmax's own formulas.
"""
from __future__ import annotations

import numpy as np
import pytest

import commlib
from commlib.collectives.attention import window as cwin
from commlib.collectives.attention.layout import LAYOUTS, local_seq_len, sequence_positions
from commlib.core.errors import InvalidArgument

SEED = 11292026


def mask_of(n, causal, window):
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    m = np.ones((n, n), dtype=bool)
    left, right = window
    if left >= 0:
        m &= j >= i - left
    if right >= 0:
        m &= j <= i + right
    if causal:
        m &= j <= i
    return m


def dense(q, k, v, dout, mask, scale):
    """out, lse, dq, dk, dv of ``(B, N, H, D)`` float64 inputs (K/V with Hkv heads, repeated per group)."""
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0, m)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):  # padding rows see nothing: lse -inf
        lse = (m + np.log(den))[..., 0]
    p = p / np.where(den > 0, den, 1)
    out = np.einsum("bhij,bjhd->bihd", p, vr)
    dp = np.einsum("bihd,bjhd->bhij", dout, vr)
    delta = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
    ds = p * (dp - delta)
    dq = np.einsum("bhij,bjhd->bihd", ds, kr) * scale
    dkr = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    dvr = np.einsum("bhij,bihd->bjhd", p, dout)
    B, N, Hk, D = k.shape
    dk = dkr.reshape(B, N, Hk, g, D).sum(3)
    dv = dvr.reshape(B, N, Hk, g, D).sum(3)
    return out, lse, dq, dk, dv


def run_case(comm, layout, causal, window, kv_heads, seq_len, tile=4):
    p, r = comm.size, comm.rank
    L = local_seq_len(seq_len, p, layout)
    n = p * L
    rng = np.random.default_rng(SEED)
    q = rng.standard_normal((2, n, 4, 8))
    k = rng.standard_normal((2, n, kv_heads, 8))
    v = rng.standard_normal((2, n, kv_heads, 8))
    do = rng.standard_normal((2, n, 4, 8))
    real = np.arange(n) < seq_len
    mask = mask_of(n, causal, window) & real[None, :] & real[:, None]
    scale = 8 ** -0.5
    want = dense(q, k, v, do, mask, scale)
    pos = sequence_positions(layout, r, p, L)
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, pos]) for x in (q, k, v, do))
    kw = dict(causal=causal, layout=layout, seq_len=seq_len, tile=tile, window=window, timeout=60)
    out, lse = commlib.ring_attention(ql, kl, vl, comm, **kw)
    dq, dk, dv = commlib.ring_attention_backward(ql, kl, vl, out, lse, dol, comm, **kw)
    rows = pos < seq_len
    for name, got, w in (("out", out, want[0][:, pos]), ("dq", dq, want[2][:, pos]), ("dk", dk, want[3][:, pos]),
                         ("dv", dv, want[4][:, pos])):
        err = np.abs(got[:, rows] - w[:, rows]).max() / np.abs(w).max()
        assert err <= 1e-10, (name, err, layout, causal, window, kv_heads, seq_len, f"rank {r}/{p}", SEED)
    lw = want[1][:, :, pos]
    assert np.allclose(lse[:, :, rows], lw[:, :, rows], rtol=1e-12, atol=1e-12)


def test_halo_rows_match_the_brute_force():
    """Every rank's receives are the rows its queries' windows reach; the
    sends mirror them; contiguous, window below a shard: neighbours only."""
    for layout in LAYOUTS:
        for P, L, causal, window in ((4, 8, True, (3, 0)), (3, 8, False, (2, 5)), (4, 6, True, (9, 0)),
                                     (2, 8, False, (-1, 2))):
            n = P * L
            m = mask_of(n, causal, window)
            pos = [sequence_positions(layout, s, P, L) for s in range(P)]
            for r in range(P):
                h = cwin.halo_rows(P, r, L, layout, causal, None, window)
                got = {s: list(idx) for s, idx in h.recv}
                want = {}
                for s in range(P):
                    if s != r:
                        need = [j for j, kp in enumerate(pos[s]) if m[pos[r], kp].any()]
                        if need:
                            want[s] = need
                assert got == want, (layout, P, r)
                for t, idx in h.send:
                    back = dict(cwin.halo_rows(P, t, L, layout, causal, None, window).recv)
                    assert list(back[r]) == list(idx)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(180)
def test_numpy_window_matches_dense_oracle():
    comm = commlib.init()
    p = comm.size
    L = 8
    for window, causal, kv in (((3, 0), True, 2), ((2, 3), False, 4), ((L, 0), True, 1), ((L, L), False, 2),
                               ((L + 5, 0), True, 2), ((-1, 2), False, 2), ((4, -1), False, 1)):
        run_case(comm, "contiguous", causal, window, kv, p * L)
    for layout in ("zigzag", "striped"):
        run_case(comm, layout, True, (5, 0), 2, p * L)
        run_case(comm, layout, False, (3, 2), 4, p * L)
    run_case(comm, "contiguous", True, (3, 0), 2, p * L - 3)   # padding at the end
    run_case(comm, "contiguous", False, (2, 2), 2, p * L - 1, tile=128)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_numpy_window_bytes_are_the_window_rows():
    """Contiguous, window below a shard: the rank receives left (+ right) K/V
    rows in the forward, whatever the shard length (16 or 32 tokens)."""
    comm = commlib.init()
    p, r = comm.size, comm.rank
    for window, causal in (((5, 0), True), ((4, 3), False)):
        got = []
        for L in (16, 32):
            rng = np.random.default_rng(SEED)
            q, k, v = (rng.standard_normal((1, L, 2, 8)) for _ in range(3))
            stats = {}
            commlib.ring_attention(q, k, v, comm, causal=causal, window=window, timeout=60, stats=stats)
            rows = (window[0] if r > 0 else 0) + (0 if causal or r == p - 1 else window[1])
            assert stats["recv_bytes"] == rows * 2 * 2 * 8 * 8, (stats, rows)
            got.append(stats["recv_bytes"])
        assert got[0] == got[1]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_numpy_bad_window_raises_everywhere():
    comm = commlib.init()
    q = np.zeros((1, 4, 2, 8))
    for bad, match in (((-3, 0), "left must be >= -1"), ((0, 2.0), "right must be an int"), (7, "pair")):
        with pytest.raises(InvalidArgument, match=match) as ei:
            commlib.ring_attention(q, q, q, comm, window=bad, timeout=30)
        assert f"rank {comm.rank}" in str(ei.value) and "ring_attention" in str(ei.value)
    if comm.size > 1:
        last = comm.rank == comm.size - 1
        with pytest.raises(InvalidArgument, match="disagree.*window"):
            commlib.ring_attention(q, q, q, comm, window=(1, 0) if last else (2, 0), timeout=30)
    comm.barrier()
