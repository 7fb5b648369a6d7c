"""A small decoder-only transformer whose attention call is pluggable.

Pre-norm blocks (Radford et al. 2019, GPT-2; RMSNorm of Zhang & Sennrich 2019):
``x = x + Attn(RMSNorm(x))``, ``x = x + MLP(RMSNorm(x))``, then a final RMSNorm
and an output head tied to the token embedding (Press & Wolf 2017).  Attention
has ``heads`` query heads and ``kv_heads`` key/value heads (grouped-query
attention, Ainslie et al. 2023: query head ``h`` reads key/value head
``h // (heads // kv_heads)``); position comes from rotary embeddings (RoFormer,
Su et al. 2021) or a learned table, indexed by each token's *global* position
in its sequence, so a rank holding any subset of the tokens (a shard in any
layout) computes exactly what the whole sequence would.

The attention call is an argument of :meth:`TransformerLM.forward`:
``attn(q, k, v) -> out`` on ``(B, T, H, D)`` tensors (``k``/``v`` with
``kv_heads`` heads): sequence-parallel attention over the ranks
(``commlib.nn``), or :func:`dense_attention` for the single-process oracle.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TransformerLM", "dense_attention", "document_mask", "window_mask", "local_layers", "loss_sum"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos, sin ``(T, head_dim / 2)`` float32 for integer ``positions`` ``(T,)``."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of ``x`` ``(B, T, H, D)`` by the angles of its tokens (RoFormer)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.wq = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, d_model, bias=False)

    def forward(self, x, rope, attn):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = attn(q.contiguous(), k.contiguous(), v.contiguous())
        return self.wo(out.reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1 = RMSNorm(d_model)
        self.attn = Attention(d_model, heads, kv_heads)
        self.norm2 = RMSNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio * d_model)

    def forward(self, x, rope, attn):
        x = x + self.attn(self.norm1(x), rope, attn)
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Decoder-only transformer.

    Args:
        vocab: vocabulary size.
        d_model: width; a multiple of ``heads`` (head dimension ``d_model // heads``,
            even with rotary embeddings).
        heads, kv_heads: query and key/value heads (``heads % kv_heads == 0``).
        layers: blocks.
        max_len: positions the learned table holds (``pos="learned"``).
        pos: ``"rope"`` (rotary) or ``"learned"``.
        mlp_ratio: MLP hidden width over ``d_model``.

    Initialization (GPT-2's): normal(0, 0.02) weights, the residual projections
    scaled by ``1 / sqrt(2 layers)``; built on the CPU from torch's global
    generator, so ``torch.manual_seed(s)`` before construction gives the same
    parameters on every rank.
    """

    def __init__(self, vocab: int, d_model: int, heads: int, kv_heads: int, layers: int, max_len: int,
                 pos: str = "rope", mlp_ratio: int = 4):
        super().__init__()
        self.pos = pos
        self.head_dim = d_model // heads
        self.tok = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model) if pos == "learned" else None
        self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads, mlp_ratio) for _ in range(layers))
        self.norm = RMSNorm(d_model)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("wo.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of ``tokens`` ``(B, T)`` int64 whose global
        positions in their sequence are ``positions`` ``(T,)`` int64;
        ``attn(q, k, v)`` computes the attention of the tokens given, or
        ``attn`` is a list of one such callable per layer (local and global
        layers)."""
        x = self.tok(tokens)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)[None]
        else:
            rope = rotary_tables(positions, self.head_dim)
        attns = attn if isinstance(attn, (list, tuple)) else [attn] * len(self.blocks)
        for block, layer_attn in zip(self.blocks, attns, strict=True):
            x = block(x, rope, layer_attn)
        return F.linear(self.norm(x), self.tok.weight)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over the tokens of the cross-entropy (nats), in float32 (a scalar)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def document_mask(cu: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    """Causal mask that also stops at document boundaries: ``(B, 1, L, L)`` bool,
    True where query ``i`` of row ``b`` may attend key ``j`` (same segment of
    ``cu``, the flat boundaries of :func:`..data.cu_seqlens`, and ``j <= i``)."""
    seg = (np.searchsorted(cu, np.arange(batch * seq_len), side="right") - 1).reshape(batch, seq_len)
    same = seg[:, :, None] == seg[:, None, :]
    return (same & np.tril(np.ones((seq_len, seq_len), dtype=bool))[None])[:, None]


def local_layers(layers: int, window, every) -> list[bool]:
    """Which of ``layers`` blocks attend within a sliding window: none without
    ``window``, else layers ``0, every, 2 every, ...``."""
    return [window is not None and i % every == 0 for i in range(layers)]


def window_mask(mask, window: int, seq_len: int) -> np.ndarray:
    """``mask`` (``(B, 1, L, L)`` bool, or None for causal) cut to a sliding
    window of ``window`` tokens: query ``i`` attends keys ``i - window < j <= i``
    (Longformer/Mistral local attention; FlashAttention's ``window_size=(window - 1, 0)``).
    Returns ``(B or 1, 1, L, L)`` bool."""
    i = np.arange(seq_len)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return band[None, None] if mask is None else mask & band[None, None]


def dense_attention(q, k, v, mask=None):
    """Plain torch attention on whole sequences (the single-process oracle).

    Args:
        q: ``(B, L, H, D)``; k, v: ``(B, L, Hkv, D)``.
        mask: ``(B, 1, L, L)`` bool (True: attend), or None for causal.

    Returns:
        ``(B, L, H, D)``.
    """
    g = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2)
