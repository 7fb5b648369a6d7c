"""commlib.nn on a CUDA device: the fused block kernels, and ring, bidirectional
ring, Ulysses and hybrid attention on CUDA tensors, against a float64 oracle.

Needs torch with a CUDA device; everywhere else the module is skipped (CI's
CPU torch).  Run by ``tests/run_gpu.sh``: the serial tests (marked ``gpu``) in
its gpu-marked stage, the MPI ones at 2 ranks in its mpi2-device stage, every
rank on ``cuda:(local rank % devices)``::

    python -m pytest -m gpu tests/test_nn_cuda.py
    mpiexec -n 2 python -m pytest --with-mpi -m mpi tests/test_nn_cuda.py

What is checked:

* the block kernels take torch's fused CUDA ops, never the explicit-matmul
  fallback (the fallback is made to fail): the flash op for bfloat16/float16
  without a mask, the memory-efficient op for float32 and for masked blocks
  (its lse padded to 32 rows, sliced), forward and backward, GQA, full and
  causal, odd lengths; against the float64 explicit kernels on the CPU;
* ring attention (every layout, causal and not, bidirectional, GQA, packed
  documents), Ulysses and hybrid, forward and every gradient, float32 within
  1e-4 relative of float64 SDPA on the gathered sequence (CUDA's fused
  float32 kernels round differently from the CPU's; 1e-5 is the CPU tests'
  bound), bfloat16 within 1.5x the error of single-process CUDA SDPA in
  bfloat16 on the same inputs;
* sliding-window attention (ring's halo exchange and windowed ring in every
  layout, Ulysses, hybrid; windows below and above a shard, causal, packed
  documents) against the float64 masked oracle, float32 and bfloat16;
* outputs and gradients stay on the inputs' device.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device (a CPU build or no GPU)", allow_module_level=True)

import commlib  # noqa: E402
from mpi4py import MPI  # noqa: E402

from commlib.collectives.attention.layout import LAYOUTS  # noqa: E402
from commlib.nn import _blocks  # noqa: E402
from commlib.nn.hybrid import hybrid_attention  # noqa: E402
from commlib.nn.ring import ring_attention  # noqa: E402
from commlib.nn.ulysses import ulysses_attention  # noqa: E402
from test_nn_ulysses import make_inputs, oracle, run_sharded  # noqa: E402

F64 = torch.float64
HALF = (torch.bfloat16, torch.float16)
# relative to the reference's largest entry: one forward / one backward of a block
BLOCK_TOL = {torch.bfloat16: (2e-2, 4e-2), torch.float16: (3e-3, 6e-3), torch.float32: (1e-4, 2e-4)}


def _local_rank():
    for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if v in os.environ:
            return int(os.environ[v])
    return 0


DEVICE = torch.device("cuda", _local_rank() % torch.cuda.device_count())
# the float64 oracle of the block tests (taken before no_fallback replaces the module's names)
EXPLICIT_FORWARD, EXPLICIT_BACKWARD = _blocks.explicit_forward, _blocks.explicit_backward


@pytest.fixture(scope="module")
def world():
    torch.cuda.set_device(DEVICE)
    return commlib.init()


@pytest.fixture(scope="module")
def selfcomm():
    torch.cuda.set_device(DEVICE)
    return commlib.init(MPI.COMM_SELF)


@pytest.fixture
def no_fallback(monkeypatch):
    """Make the explicit-matmul kernels fail: a test using this runs fused ops only."""
    def refuse(*a, **kw):
        raise AssertionError("the explicit-matmul fallback ran on CUDA")

    monkeypatch.setattr(_blocks, "explicit_forward", refuse)
    monkeypatch.setattr(_blocks, "explicit_backward", refuse)


def rel(got, want):
    return ((got.detach().cpu().to(F64) - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


# ------------------------------------------------------------ block kernels
@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.float32, "auto"),
                                          (torch.bfloat16, "flash"), (torch.float16, "flash")],
                         ids=["bf16", "f16", "f32", "bf16-flash", "f16-flash"])
def test_fused_block_kernels(dtype, kernel, monkeypatch, no_fallback):
    """block_forward / block_backward on CUDA (fused only) against the float64
    explicit kernels on the CPU, on the same (rounded) inputs; half precision
    without a mask takes cuDNN on compute capability 9.0+ ("auto") and the
    flash kernel when pinned, masks and float32 the memory-efficient kernel."""
    monkeypatch.setattr(_blocks, "CUDA_HALF_KERNEL", kernel)
    before = dict(_blocks.KERNELS)
    gen = torch.Generator().manual_seed(3)
    cases = [("full", None, 128, 128), ("causal", None, 128, 128), ("full", None, 100, 150),
             ("causal", None, 77, 77)]
    mask = torch.rand(96, 130, generator=gen) > 0.4
    mask[5] = False  # a row that sees no key: out 0, lse -inf
    cases.append(("full", mask, 96, 130))
    tf, tb = BLOCK_TOL[dtype]
    for kind, m, lq, lk in cases:
        q = torch.randn(2, 4, lq, 64, generator=gen).to(dtype)
        k = torch.randn(2, 2, lk, 64, generator=gen).to(dtype)
        v = torch.randn(2, 2, lk, 64, generator=gen).to(dtype)
        do = torch.randn(2, 4, lq, 64, generator=gen).to(dtype)
        q64, k64, v64, do64 = (x.to(F64) for x in (q, k, v, do))
        o_ref, l_ref = EXPLICIT_FORWARD(q64, k64, v64, 0.125, kind, m)
        mc = None if m is None else m.to(DEVICE)
        o, lse = _blocks.block_forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), 0.125, kind, mc)
        assert o.device == DEVICE and o.dtype == dtype and lse.dtype == torch.float32
        assert o.shape == (2, 4, lq, 64) and lse.shape == (2, 4, lq)
        fin = torch.isfinite(l_ref)
        lse_c = lse.cpu().to(F64)
        assert torch.equal(torch.isfinite(lse_c), fin), f"{kind}: rows without keys differ"
        assert rel(o, o_ref) <= tf, f"{dtype} {kind} {lq}x{lk} out {rel(o, o_ref):.2e}"
        assert (lse_c[fin] - l_ref[fin]).abs().max().item() <= 1e-3, f"{dtype} {kind} lse"
        g_lse = l_ref.masked_fill(~fin, 0.0)
        grads = _blocks.block_backward(do.to(DEVICE), q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                       o_ref.to(dtype).to(DEVICE), g_lse.to(torch.float32).to(DEVICE), 0.125, kind, mc)
        want = EXPLICIT_BACKWARD(do64, q64, k64, v64, o_ref.to(dtype).to(F64), g_lse, 0.125, kind, m)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            assert g.device == DEVICE and torch.isfinite(g).all(), name
            assert rel(g, w) <= tb, f"{dtype} {kind} {lq}x{lk} {name} {rel(g, w):.2e}"
    ran = {k: v - before.get(k, 0) for k, v in _blocks.KERNELS.items() if v > before.get(k, 0)}
    assert ran.get("efficient_fwd") == ran.get("efficient_bwd") >= 1, ran  # the masked case at least
    if dtype in HALF:
        hopper = torch.cuda.get_device_capability(DEVICE) >= (9, 0) and torch.backends.cudnn.is_available()
        name = "cudnn" if kernel == "auto" and hopper else "flash"
        assert ran.get(f"{name}_fwd", 0) >= 1 and ran.get(f"{name}_bwd", 0) >= 1, ran
        print(f"{dtype} {kernel}: {ran}")


# --------------------------------------------------------- whole functions
def _on_device(xs):
    return [x.to(DEVICE) for x in xs]


def _check_f32(comm, fn, layout, causal, h, hk, *, cu=None, n=None, d=32, seed=1):
    n = 16 * comm.size if n is None else n
    q, k, v, do = make_inputs(seed, 2, n, h, hk, d, F64)
    want = oracle(q, k, v, do, causal, None, cu)
    got = run_sharded(fn, comm, layout, *_on_device(x.to(torch.float32) for x in (q, k, v, do)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.device == DEVICE and g.dtype == torch.float32, name
        err = rel(g, w)
        assert err <= 1e-4, f"{name}: {err:.2e} ({layout}, causal={causal}, cu={cu})"


def _documents(n):
    return np.array([0, 1, 1, n // 2 + 1, n], dtype=np.int64)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
def test_cuda_ring_float32_matches_oracle(world, no_fallback):
    """Every layout x causal x bidirectional, GQA cycling MHA/GQA/MQA, with and
    without packed documents (documents take the masked fused op)."""
    i = 0
    n = 16 * world.size
    for layout in LAYOUTS:
        for causal in (False, True):
            for bidirectional in (False, True):
                kv = (4, 2, 1)[i % 3]
                cu = _documents(n) if i % 2 else None
                i += 1
                _check_f32(world, lambda q, k, v: ring_attention(q, k, v, world, causal, layout, cu_seqlens=cu,
                                                                 bidirectional=bidirectional, timeout=60),
                           layout, causal, 4, kv, cu=cu)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
def test_cuda_ulysses_and_hybrid_float32(world):
    for causal in (False, True):
        _check_f32(world, lambda q, k, v: ulysses_attention(q, k, v, world, causal, timeout=60), "contiguous",
                   causal, 2 * world.size, world.size)
    u = 2 if world.size % 2 == 0 else 1
    for layout in ("zigzag", "striped"):
        _check_f32(world, lambda q, k, v: hybrid_attention(q, k, v, world, u, True, layout, timeout=60,
                                                           bidirectional=True), layout, True, 4, 2)


def _sdpa_cuda(q, k, v, do, causal, dtype):
    """Single-process CUDA SDPA in ``dtype`` with autograd on the whole sequence."""
    q, k, v, do = (x.to(dtype).to(DEVICE) for x in (q, k, v, do))
    for t in (q, k, v):
        t.requires_grad_()
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal, enable_gqa=True).transpose(1, 2)
    grads = torch.autograd.grad((out * do).sum(), (q, k, v))
    return [x.detach().cpu().to(F64) for x in (out, *grads)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
def test_cuda_bf16_error_within_1_5x_of_sdpa(world, no_fallback):
    """bfloat16 on CUDA: relative Frobenius error (whole tensor, every rank's
    shard) of out, dq, dk, dv against the float64 oracle at most 1.5x that of
    CUDA SDPA in bfloat16 on the same inputs (flash kernels on both sides).
    Every rank checks the gathered tensors."""
    n = 256 * world.size
    for seed, (layout, causal, bidirectional) in enumerate((("zigzag", True, False), ("striped", True, True),
                                                            ("contiguous", False, True))):
        q, k, v, do = (x.to(torch.bfloat16).to(F64) for x in make_inputs(20 + seed, 1, n, 8, 2, 64, F64))
        exact = oracle(q, k, v, do, causal)
        base = _sdpa_cuda(q, k, v, do, causal, torch.bfloat16)
        got = run_sharded(lambda a, b, c: ring_attention(a, b, c, world, causal, layout, bidirectional=bidirectional,
                                                         timeout=60),
                          world, layout, *_on_device(x.to(torch.bfloat16) for x in (q, k, v, do)))
        for name, g, e, b in zip(("out", "dq", "dk", "dv"), got, exact, base):
            assert g.dtype == torch.bfloat16 and g.device == DEVICE and torch.isfinite(g).all(), name
            err = ((g.cpu().to(F64) - e).norm() / e.norm()).item()
            ref = ((b - e).norm() / e.norm()).item()
            assert err <= 1.5 * ref, f"{layout} {name}: ring {err:.3e} vs SDPA {ref:.3e}"


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_one_rank_ring_is_exact_in_float32(selfcomm, no_fallback):
    """One rank, CUDA: ring attention equals the float64 oracle to 1e-4, causal
    and not, with documents, and keeps everything on the device."""
    for causal in (False, True):
        for cu in (None, _documents(64)):
            _check_f32(selfcomm, lambda q, k, v: ring_attention(q, k, v, selfcomm, causal, cu_seqlens=cu,
                                                                timeout=60), "contiguous", causal, 4, 2,
                       cu=cu, n=64)


# ------------------------------------------------------------ sliding window
def _window_oracle(q, k, v, do, causal, cu, window, dtype=F64, device="cpu"):
    """SDPA with the window mask (tests/test_nn_window.py's) on the whole
    sequence, in ``dtype`` on ``device``: (out, dq, dk, dv) as float64 on the CPU."""
    from test_nn_window import window_mask  # noqa: PLC0415

    q, k, v = (x.detach().to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v))
    mask = window_mask(q.shape[1], causal, cu, window).to(device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    grads = torch.autograd.grad((out * do.to(device=device, dtype=dtype)).sum(), (q, k, v))
    return [x.detach().cpu().to(F64) for x in (out, *grads)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
def test_cuda_window_float32_and_bfloat16(world):
    """Sliding-window attention on CUDA (issue 39): ring (halo exchange and the
    windowed ring, every layout), Ulysses and hybrid, windows smaller and larger
    than a shard, left-only and two-sided, causal, packed documents; float32
    within 1e-4 of the float64 masked oracle, bfloat16's relative error at most
    1.5x that of CUDA SDPA in bfloat16 with the same mask."""
    p = world.size
    L = 16
    n = p * L
    docs = np.array([0, 5, n // 2 + 3, n], dtype=np.int64)
    cases = [("contiguous", True, None, (5, 0), "ring"), ("zigzag", True, docs, (L + 3, 0), "ring"),
             ("striped", False, None, (4, 7), "ring"), ("contiguous", False, docs, (L, L), "ulysses"),
             ("zigzag", True, None, (9, 0), "hybrid")]
    for seed, (layout, causal, cu, window, kind) in enumerate(cases):
        q, k, v, do = make_inputs(40 + seed, 1, n, 4, 2, 32, F64)
        if kind == "ring":
            fn = lambda a, b, c: ring_attention(a, b, c, world, causal, layout, cu_seqlens=cu,  # noqa: E731
                                                window=window, timeout=60)
        elif kind == "ulysses":
            fn = lambda a, b, c: ulysses_attention(a, b, c, world, causal, cu_seqlens=cu,  # noqa: E731
                                                   window=window, layout=layout, timeout=60)
        else:
            u = 2 if p % 2 == 0 else 1
            fn = lambda a, b, c: hybrid_attention(a, b, c, world, u, causal, layout, cu_seqlens=cu,  # noqa: E731
                                                  window=window, timeout=60)
        exact = _window_oracle(q, k, v, do, causal, cu, window)
        got = run_sharded(fn, world, layout, *_on_device(x.to(torch.float32) for x in (q, k, v, do)))
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, exact):
            assert g.device == DEVICE and g.dtype == torch.float32, name
            assert rel(g, w) <= 1e-4, f"{kind} {layout} {name}: {rel(g, w):.2e} (window {window})"
        qb, kb, vb, dob = (x.to(torch.bfloat16).to(F64) for x in (q, k, v, do))
        exact = _window_oracle(qb, kb, vb, dob, causal, cu, window)
        base = _window_oracle(qb, kb, vb, dob, causal, cu, window, torch.bfloat16, DEVICE)
        got = run_sharded(fn, world, layout, *_on_device(x.to(torch.bfloat16) for x in (qb, kb, vb, dob)))
        for name, g, e, b in zip(("out", "dq", "dk", "dv"), got, exact, base):
            assert g.dtype == torch.bfloat16 and g.device == DEVICE and torch.isfinite(g).all(), name
            err = ((g.cpu().to(F64) - e).norm() / e.norm()).item()
            ref = ((b - e).norm() / e.norm()).item()
            assert err <= 1.5 * ref, f"{kind} {layout} {name}: {err:.3e} vs SDPA {ref:.3e} (window {window})"
