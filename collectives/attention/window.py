"""Sliding-window attention as a halo exchange: the window's bookkeeping and the numpy/CuPy calls.

A query at global position ``i`` sees the keys ``j`` with ``i - left <= j <=
i + right`` (FlashAttention-2's ``window_size=(left, right)``, ``-1``
unbounded; the sliding window of Longformer and Mistral), combined with
``causal`` and document boundaries.  Sharded over ranks, a window narrower
than the sequence needs only the K/V rows inside some local query's window:

* :func:`visible_ranges`: what each query sees of a set of keys (one
  contiguous range of the sorted keys: causal, documents and window are all
  intervals of positions).
* :func:`halo_rows`: from the layout's positions, the rows of every rank's
  shard that each rank needs; every rank computes every rank's needs alike,
  so the sends and receives of one exchange round match.  In the contiguous
  layout a window narrower than a shard is ``left`` rows from the previous
  rank and ``right`` from the next; wider windows reach the ranks they cover
  and no others; the zigzag layout has up to four neighbours (two chunks),
  and the striped layout spreads every window over every rank.
* :func:`window_attention` / :func:`window_attention_backward`: the
  numpy/CuPy calls (what :func:`.ring.ring_attention` runs with a window): one
  round of point-to-point messages carrying exactly those rows (the backward
  sends them again and returns their ``dk``/``dv`` partials to their owners),
  blocks computed in query tiles over the keys the tile sees.

The torch layer (``commlib.nn.window``) uses the same bookkeeping.

Papers: FlashAttention-2 (Dao 2023, arXiv:2307.08691) for ``window_size``;
Longformer (Beltagy, Peters, Cohan 2020, arXiv:2004.05150) and Mistral 7B
(Jiang et al. 2023, arXiv:2310.06825) for sliding-window attention.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from commlib.core.seconds import time_left

from .blocks import ForwardAccumulator, backward_operands, from_heads_major, to_heads_major
from .layout import layout_of

__all__ = ["window_of", "effective_window", "visible_ranges", "needed_rows", "HaloRows", "halo_rows",
           "window_tiles", "window_attention", "window_attention_backward"]


def window_of(window, bad):
    """Check a ``window`` argument: None, or a pair ``(left, right)`` of ints
    ``>= -1`` (FlashAttention-2's ``window_size``; ``-1``: unbounded).  A
    tensor or array of two ints is read by its ``tolist()``.

    Returns:
        None or ``(left, right)`` as Python ints.

    Raises:
        what ``bad(message)`` builds, for anything else.
    """
    if window is None:
        return None
    if hasattr(window, "tolist") and not isinstance(window, (list, tuple)):
        window = window.tolist()
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise bad(f"window must be None or a pair (left, right) of ints >= -1 (FlashAttention's window_size, "
                  f"-1: unbounded), got {window!r}")
    out = []
    for name, w in zip(("left", "right"), window):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise bad(f"window {name} must be an int >= -1, got {w!r}")
        if w < -1:
            raise bad(f"window {name} must be >= -1 (-1: unbounded), got {int(w)}")
        out.append(int(w))
    return tuple(out)


def effective_window(window, causal: bool, total: int):
    """The window that changes what a query sees, or None when it changes nothing.

    ``causal`` makes ``right`` 0; a side as long as the sequence (``>= total
    - 1``) is unbounded (-1); ``(-1, -1)``, and ``(-1, 0)`` with ``causal``,
    is no window.

    Args:
        window: None or a checked ``(left, right)``.
        causal: the call's causal flag.
        total: the global sequence length (tokens).
    """
    if window is None:
        return None
    left, right = window
    if causal:
        right = 0
    if left >= total - 1:
        left = -1
    if right >= total - 1:
        right = -1
    if left == -1 and (right == -1 or (causal and right == 0)):
        return None
    return left, right


def visible_ranges(qpos, kpos, causal: bool, cu_seqlens=None, window=None, seq_len=None):
    """For each query, the range ``[lo, hi)`` of keys it sees.

    Keys are sorted by position, so what one query sees is contiguous: a
    prefix (causal), everything, the keys of its own document (cut at the
    query for causal), each cut to the query's window.

    Args:
        qpos, kpos: ascending int64 global positions of the queries and keys.
        causal: keys after the query are hidden.
        cu_seqlens: None or int64 document boundaries ``[0, ..., seq_len]``.
        window: None or ``(left, right)`` (-1 unbounded): query ``i`` sees
            keys ``j`` with ``i - left <= j <= i + right`` only.
        seq_len: None, or the true length: positions ``>= seq_len`` are
            padding (no query there sees anything, no query sees a key there).

    Returns:
        tuple: int64 ``lo``, ``hi`` of ``len(qpos)`` entries (``hi <= lo``: none).
    """
    qpos = np.asarray(qpos, dtype=np.int64)
    kpos = np.asarray(kpos, dtype=np.int64)
    if cu_seqlens is None:
        lo = np.zeros(len(qpos), dtype=np.int64)
        hi = np.searchsorted(kpos, qpos, side="right") if causal else np.full(len(qpos), len(kpos), np.int64)
    else:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        doc = np.searchsorted(cu, qpos, side="right") - 1
        lo = np.searchsorted(kpos, cu[doc], side="left")
        hi = np.searchsorted(kpos, cu[np.minimum(doc + 1, len(cu) - 1)], side="left")
        if causal:
            hi = np.minimum(hi, np.searchsorted(kpos, qpos, side="right"))
    if window is not None:
        left, right = (int(w) for w in window)
        if left >= 0:
            lo = np.maximum(lo, np.searchsorted(kpos, qpos - left, side="left"))
        if right >= 0:
            hi = np.minimum(hi, np.searchsorted(kpos, qpos + right, side="right"))
    if seq_len is not None:
        hi = np.minimum(hi, np.searchsorted(kpos, seq_len, side="left"))
        hi = np.where(qpos >= seq_len, lo, hi)
    return lo.astype(np.int64), hi.astype(np.int64)


def needed_rows(qpos, kpos, causal, cu_seqlens, window, seq_len=None) -> np.ndarray:
    """Ascending indices into ``kpos`` of the keys that some query of ``qpos`` sees (int64)."""
    lo, hi = visible_ranges(qpos, kpos, causal, cu_seqlens, window, seq_len)
    seen = hi > lo
    cover = np.zeros(len(kpos) + 1, dtype=np.int64)
    np.add.at(cover, lo[seen], 1)
    np.add.at(cover, hi[seen], -1)
    return np.flatnonzero(np.cumsum(cover[:-1]) > 0)


@dataclass(frozen=True)
class HaloRows:
    """One rank's halo exchange.

    Attributes:
        recv: ``(source, idx)`` per rank this one receives from, nearest
            first: ``idx`` the int64 local indices (ascending) of the rows of
            the source's shard that this rank's queries see.
        send: ``(dest, idx)`` per rank this one sends to: the local indices of
            its own rows that the destination's queries see.
    """

    recv: tuple
    send: tuple


def halo_rows(size: int, rank: int, seq_local: int, layout: str, causal: bool, cu_seqlens, window,
              seq_len=None) -> HaloRows:
    """The rows each rank exchanges with each other one in a windowed call
    (cached per arguments: a training loop repeats one call shape).

    Args:
        size, rank: the group; seq_local: tokens per rank; layout: one of
            :data:`.layout.LAYOUTS`; causal; cu_seqlens: None or document
            boundaries; window: an :func:`effective_window`, not None;
            seq_len: None or the true length (padding beyond).
    """
    cu = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens)
    return _halo_rows(int(size), int(rank), int(seq_local), layout_of(layout, rank=rank, op="halo_rows"), bool(causal),
                      cu, tuple(window),
                      None if seq_len is None else int(seq_len))


@functools.lru_cache(maxsize=64)
def _halo_rows(P, r, L, layout, causal, cu, window, seq_len) -> HaloRows:
    cu = None if cu is None else np.asarray(cu, dtype=np.int64)
    pos = layout.all_positions(P, L)
    recv, send = [], []
    for s in sorted(range(P), key=lambda s: (min((r - s) % P, (s - r) % P), s)):
        if s == r:
            continue
        idx = needed_rows(pos[r], pos[s], causal, cu, window, seq_len)
        if len(idx):
            recv.append((s, idx))
        idx = needed_rows(pos[s], pos[r], causal, cu, window, seq_len)
        if len(idx):
            send.append((s, idx))
    return HaloRows(tuple(recv), tuple(send))


def window_tiles(qpos, kpos, causal, cu_seqlens, window, tile: int, seq_len=None):
    """Query tiles of one block: ``(i0, i1, k0, k1, lo, hi)`` per tile with a
    visible pair: rows ``[i0, i1)`` against keys ``[k0, k1)``, row ``i``
    seeing keys ``[lo[i], hi[i])`` (numpy int64, absolute indices).

    Returns:
        tuple: the tiles and the score entries they compute (per batch and head).
    """
    lo, hi = visible_ranges(qpos, kpos, causal, cu_seqlens, window, seq_len)
    tiles, work = [], 0
    for i0 in range(0, len(qpos), tile):
        i1 = min(i0 + tile, len(qpos))
        seen = hi[i0:i1] > lo[i0:i1]
        if not seen.any():
            continue
        k0 = int(lo[i0:i1][seen].min())
        k1 = int(hi[i0:i1][seen].max())
        tiles.append((i0, i1, k0, k1, lo[i0:i1], hi[i0:i1]))
        work += (i1 - i0) * (k1 - k0)
    return tiles, work


def _tile_mask(lo, hi, k0, k1, xp):
    ar = np.arange(k0, k1)
    m = (ar[None, :] >= lo[:, None]) & (ar[None, :] < hi[:, None])
    return m if xp is np else xp.asarray(m)


def _forward_tiles(qh, kh, vh, tiles, state):
    """Fold the tiles of one block into ``state`` (as :func:`.blocks.forward_block`, keys ``[k0, k1)`` masked)."""
    xp = state.xp
    bsz, hk, g, _, d = qh.shape
    for i0, i1, k0, k1, lo, hi in tiles:
        lt, nk = i1 - i0, k1 - k0
        q = qh[:, :, :, i0:i1, :].reshape(bsz, hk, g * lt, d)
        s = xp.matmul(q, kh[:, :, k0:k1, :].swapaxes(-1, -2)).reshape(bsz, hk, g, lt, nk)
        s[...] = xp.where(_tile_mask(lo, hi, k0, k1, xp), s, -np.inf)
        state.update(i0, i1, s, vh[:, :, k0:k1, :])


def _backward_tiles(qh, kh, vh, doh, lseh, dh, tiles, dqh, dkh, dvh, xp):
    """Gradients of one block's tiles (as :func:`.blocks.backward_block`)."""
    bsz, hk, g, _, d = qh.shape
    lse_safe = xp.where(xp.isneginf(lseh), np.inf, lseh)
    for i0, i1, k0, k1, lo, hi in tiles:
        lt, nk = i1 - i0, k1 - k0
        q = qh[:, :, :, i0:i1, :].reshape(bsz, hk, g * lt, d)
        do = doh[:, :, :, i0:i1, :].reshape(bsz, hk, g * lt, d)
        k = kh[:, :, k0:k1, :]
        v = vh[:, :, k0:k1, :]
        s = xp.matmul(q, k.swapaxes(-1, -2)).reshape(bsz, hk, g, lt, nk)
        s -= lse_safe[..., i0:i1, None]
        p = xp.exp(s, out=s)
        p[...] = xp.where(_tile_mask(lo, hi, k0, k1, xp), p, 0)
        p2 = p.reshape(bsz, hk, g * lt, nk)
        dvh[:, :, k0:k1, :] += xp.matmul(p2.swapaxes(-1, -2), do)
        dp = xp.matmul(do, v.swapaxes(-1, -2)).reshape(bsz, hk, g, lt, nk)
        dp -= dh[..., i0:i1, None]
        dp *= p
        ds = dp.reshape(bsz, hk, g * lt, nk)
        dqh[:, :, :, i0:i1, :] += xp.matmul(ds, k).reshape(bsz, hk, g, lt, d)
        dkh[:, :, k0:k1, :] += xp.matmul(ds.swapaxes(-1, -2), q)


def _kv(k, v, spec):
    """``(2, B, Hkv, L, D)`` K and V, input dtype, contiguous."""
    xp = spec.xp
    kv = xp.empty((2, spec.batch, spec.kv_heads, spec.seq_local, spec.head_dim), dtype=spec.array_dtype)
    kv[0] = k.transpose(0, 2, 1, 3)
    kv[1] = v.transpose(0, 2, 1, 3)
    return kv


def _exchange_kv(tp, spec, halo, kv, tag):
    """Post the halo's K/V receives and sends; returns (requests, received buffers, send buffers)."""
    xp = spec.xp
    reqs, bufs, msgs = [], [], []
    for src, idx in halo.recv:  # every receive before any send
        buf = xp.empty((2, spec.batch, spec.kv_heads, len(idx), spec.head_dim), dtype=spec.array_dtype)
        reqs.append(tp.irecv(buf, src, tag))
        bufs.append(buf)
    for dst, idx in halo.send:
        msg = xp.ascontiguousarray(kv[:, :, :, xp.asarray(idx)])
        reqs.append(tp.isend(msg, dst, tag))
        msgs.append(msg)
    return reqs, bufs, msgs


def window_attention(tp, spec, q, k, v, *, causal, layout, window, tile, tag, timeout, op, stats=None):
    """The windowed forward of a validated call (numpy/CuPy): ``(out, lse)`` as
    :func:`.ring.ring_attention` returns them.

    Args:
        tp: the call's transport; spec: its :class:`.spec.AttnSpec`;
        q, k, v: the local shards; causal, layout, tile: the call's options;
        window: the :func:`effective_window`, not None; tag: the first of
        the call's two tags; timeout: its deadline; op: its name in errors;
        stats: None or a dict, filled with ``kind``, ``work`` (score entries
        computed), ``recv_bytes``, ``sent_bytes`` and ``total_s``.

    Raises:
        CommTimeout, CommError: from the transport's waits.
    """
    t0 = time.perf_counter()
    xp, P, r, L = spec.xp, tp.size, tp.rank, spec.seq_local
    halo = halo_rows(P, r, L, layout, causal, None, window, spec.seq_len)
    qpos = layout.positions(r, P, L)
    qh = to_heads_major(q, spec.kv_heads, spec.cdtype, xp)
    qh *= spec.scale
    state = ForwardAccumulator(qh.shape, spec.cdtype, xp)
    kv = _kv(k, v, spec)
    reqs, bufs, msgs = _exchange_kv(tp, spec, halo, kv, tag) if P > 1 else ([], [], [])
    work = 0
    tiles, w = window_tiles(qpos, qpos, causal, None, window, tile, spec.seq_len)
    work += w
    _forward_tiles(qh, kv[0].astype(spec.cdtype, copy=False), kv[1].astype(spec.cdtype, copy=False), tiles, state)
    tp.waitall(reqs, time_left(timeout), op=op)
    for (src, idx), buf in zip(halo.recv, bufs):
        kpos = layout.positions(src, P, L)[idx]
        tiles, w = window_tiles(qpos, kpos, causal, None, window, tile, spec.seq_len)
        work += w
        _forward_tiles(qh, buf[0].astype(spec.cdtype, copy=False), buf[1].astype(spec.cdtype, copy=False), tiles,
                       state)
    out, lse = state.finalize()
    if stats is not None:
        stats.clear()
        stats.update(kind="forward", work=work * spec.batch * spec.heads,
                     recv_bytes=sum(int(b.nbytes) for b in bufs), sent_bytes=sum(int(m.nbytes) for m in msgs),
                     total_s=time.perf_counter() - t0)
    return from_heads_major(out, spec.array_dtype, xp), lse.reshape(spec.batch, spec.heads, L)


def window_attention_backward(tp, spec, q, k, v, out, lse, dout, *, causal, layout, window, tile, tag, timeout, op,
                              stats=None):
    """The windowed backward of a validated call: ``(dq, dk, dv)`` as
    :func:`.ring.ring_attention_backward` returns them.  The halo's K/V rows
    are sent again (tag ``tag``), their ``dk``/``dv`` partials (accumulation
    dtype) go back to their owners (tag ``tag + 1``).  Arguments as
    :func:`window_attention`."""
    t0 = time.perf_counter()
    xp, P, r, L = spec.xp, tp.size, tp.rank, spec.seq_local
    hk, cdt = spec.kv_heads, spec.cdtype
    halo = halo_rows(P, r, L, layout, causal, None, window, spec.seq_len)
    qpos = layout.positions(r, P, L)
    qh, doh, dh, lseh, dqh = backward_operands(q, out, lse, dout, hk, spec.scale, cdt, xp)
    kv = _kv(k, v, spec)
    reqs, bufs, msgs = _exchange_kv(tp, spec, halo, kv, tag) if P > 1 else ([], [], [])
    back = []
    for dst, idx in halo.send:  # our rows' partials, back from the ranks that used them
        buf = xp.empty((2, spec.batch, hk, len(idx), spec.head_dim), dtype=cdt)
        reqs.append(tp.irecv(buf, dst, tag + 1))
        back.append((idx, buf))
    dkv = xp.zeros((2, spec.batch, hk, L, spec.head_dim), dtype=cdt)
    tiles, _ = window_tiles(qpos, qpos, causal, None, window, tile, spec.seq_len)
    _backward_tiles(qh, kv[0].astype(cdt, copy=False), kv[1].astype(cdt, copy=False), doh, lseh, dh, tiles, dqh,
                    dkv[0], dkv[1], xp)
    n_kv = len(halo.recv)
    tp.waitall(reqs[:n_kv], time_left(timeout), op=op)  # the K/V rows we need
    parts = []
    for (src, idx), buf in zip(halo.recv, bufs):
        kpos = layout.positions(src, P, L)[idx]
        tiles, _ = window_tiles(qpos, kpos, causal, None, window, tile, spec.seq_len)
        part = xp.zeros((2, spec.batch, hk, len(idx), spec.head_dim), dtype=cdt)
        _backward_tiles(qh, buf[0].astype(cdt, copy=False), buf[1].astype(cdt, copy=False), doh, lseh, dh, tiles,
                        dqh, part[0], part[1], xp)
        reqs.append(tp.isend(part, src, tag + 1))
        parts.append(part)
    tp.waitall(reqs[n_kv:], time_left(timeout), op=op)
    for idx, buf in back:
        dkv[:, :, :, xp.asarray(idx)] += buf
    dqh *= spec.scale
    if stats is not None:
        stats.clear()
        stats.update(kind="backward", recv_bytes=sum(int(b.nbytes) for b in bufs) + sum(int(b.nbytes) for _, b in back),
                     sent_bytes=sum(int(m.nbytes) for m in msgs) + sum(int(p.nbytes) for p in parts),
                     total_s=time.perf_counter() - t0)
    dq = from_heads_major(dqh, spec.array_dtype, xp)
    dk = xp.ascontiguousarray(dkv[0].transpose(0, 2, 1, 3).astype(spec.array_dtype, copy=False))
    dv = xp.ascontiguousarray(dkv[1].transpose(0, 2, 1, 3).astype(spec.array_dtype, copy=False))
    return dq, dk, dv
