"""``commlib.shard_sequence`` (numpy) and ``commlib.nn.shard_sequence`` (torch):
one behaviour.  A length the layout cannot divide is zero-padded at the
sequence's global end to ``P * seq_local`` tokens by both (``pad=False``
refuses it in both, with the same line), and ``unshard_sequence(...,
seq_len=n)`` gives the sequence back.  A torch attention call given a padded
shard that would attend to the padding (non-causal, no ``cu_seqlens``) refuses
it; causal, or with the padding a document of its own, it matches the dense
oracle on the real tokens.

Oracle, written here: the layouts' positions from their definitions (contiguous:
rank r holds ``[r L, (r + 1) L)``; striped: ``r, r + P, ...``; zigzag: chunks
``r`` and ``2P - 1 - r`` of ``2P``), over the sequence zero-padded in numpy.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import commlib
from commlib.core.errors import InvalidArgument

torch = pytest.importorskip("torch")
import commlib.nn as cnn  # noqa: E402

LAYOUTS = ("contiguous", "striped", "zigzag")


def oracle_positions(layout, rank, size, n):
    unit = 2 * size if layout == "zigzag" else size
    padded = -(-n // unit) * unit
    L = padded // size
    if layout == "contiguous":
        return np.arange(rank * L, (rank + 1) * L), padded
    if layout == "striped":
        return np.arange(rank, padded, size), padded
    h = L // 2
    return np.concatenate([np.arange(rank * h, (rank + 1) * h),
                           np.arange((2 * size - 1 - rank) * h, (2 * size - rank) * h)]), padded


def oracle_shard(x, layout, rank, size, axis=1):
    n = x.shape[axis]
    pos, padded = oracle_positions(layout, rank, size, n)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, padded - n)
    return np.take(np.pad(x, pad), pos, axis=axis), pos


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 5, 12, 13])
def test_numpy_and_torch_shard_alike_against_the_oracle(layout, size, n):
    x = np.random.default_rng(n).standard_normal((2, n, 3))
    for rank in range(size):
        comm = SimpleNamespace(rank=rank, size=size)
        want, pos = oracle_shard(x, layout, rank, size)
        got, got_pos = commlib.shard_sequence(x, comm, layout)
        assert np.array_equal(got, want) and np.array_equal(got_pos, pos), (rank, got_pos, pos)
        t = cnn.shard_sequence(torch.from_numpy(x), comm, layout)
        assert np.array_equal(t.numpy(), want), rank
        assert np.array_equal(cnn.Sharding(comm, layout).shard(torch.from_numpy(x)).numpy(), want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pad_false_refuses_in_both_with_the_same_line(layout):
    comm = SimpleNamespace(rank=1, size=3)
    x = np.zeros((1, 7, 2))
    with pytest.raises(InvalidArgument) as a:
        commlib.shard_sequence(x, comm, layout, pad=False)
    with pytest.raises(InvalidArgument) as b:
        cnn.shard_sequence(torch.zeros(1, 7, 2), comm, layout, pad=False)
    assert str(a.value) == str(b.value), (str(a.value), str(b.value))
    assert str(a.value).startswith("rank 1: shard_sequence: sequence length 7 is not divisible by ") and \
        "pad=False" in str(a.value)
    ok = np.zeros((1, 6 if layout != "zigzag" else 12, 2))  # divisible: pad=False shards it
    assert commlib.shard_sequence(ok, comm, layout, pad=False)[0].shape[1] * 3 == ok.shape[1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unshard_drops_the_padding_again(selfcomm, layout):
    x = np.arange(2 * 5 * 3, dtype=np.float64).reshape(2, 5, 3)
    part, _ = commlib.shard_sequence(x, selfcomm, layout)
    assert np.array_equal(commlib.unshard_sequence(part, selfcomm, layout, seq_len=5), x)
    t = cnn.shard_sequence(torch.from_numpy(x), selfcomm, layout)
    assert torch.equal(cnn.unshard_sequence(t, selfcomm, layout, seq_len=5), torch.from_numpy(x))


def _dense(q, k, v, causal, n):
    """float64 attention over the first ``n`` (real) tokens, (B, S, H, D)."""
    q, k, v = (a[:, :n].double() for a in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def test_attention_refuses_padding_it_would_attend_to(selfcomm):
    """zigzag at 1 rank pads 5 tokens to 6: a non-causal call refuses the padded
    k/v, naming cu_seqlens and causal; causal, or with cu_seqlens [0, 5, 6], it
    gives the dense result on the 5 real tokens."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ql, kl, vl = (cnn.shard_sequence(t, selfcomm, "zigzag") for t in (q, k, v))
    assert kl.shape[1] == 6
    for call in (lambda: cnn.ring_attention(ql, kl, vl, selfcomm, layout="zigzag"),
                 lambda: cnn.ulysses_attention(ql, kl, vl, selfcomm, layout="zigzag")):
        with pytest.raises(InvalidArgument, match=r"zero-padded to 6 tokens.*cu_seqlens=\[0, \.\.\., 5, 6\].*causal=True"):
            call()
    out = cnn.ring_attention(ql, kl, vl, selfcomm, causal=True, layout="zigzag")
    got = cnn.unshard_sequence(out, selfcomm, "zigzag", seq_len=5)
    assert torch.allclose(got, _dense(q, k, v, True, 5), atol=1e-12)
    cu = torch.tensor([0, 5, 6], dtype=torch.int32)
    out = cnn.ring_attention(ql, kl, vl, selfcomm, layout="zigzag", cu_seqlens=cu)
    got = cnn.unshard_sequence(out, selfcomm, "zigzag", seq_len=5)
    assert torch.allclose(got, _dense(q, k, v, False, 5), atol=1e-12)
