"""Device pack/unpack kernels (numba.cuda): one thread per word, grid-stride.

The strided kernel maps packed word ``i`` to its buffer word by peeling the
multi-index off ``i`` with the outer counts (any number of dimensions; TEMPI,
Pearson et al., HPDC'22, §4, generalized beyond 3-D).  The offsets/lengths
kernel finds a word's run by binary search in the prefix sums of the run
lengths.  Words are the widest unsigned type the plan's alignment allows.

Runs on a real GPU and, without one, in numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, set before numba.cuda is imported), where the
launch is kept small because every simulated thread is a Python thread.
"""
from __future__ import annotations

import numpy as np
from numba import config, cuda

from commlib.core.errors import BufferError, DatatypeError

__all__ = ["pack", "unpack"]

_WORD = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}
_SIM = bool(config.ENABLE_CUDASIM)


@cuda.jit
def _k_strided(src, dst, start, c0, oc, os, total, to_packed):  # pragma: no cover - device code
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    nd = oc.shape[0]
    while i < total:
        r = i // c0
        off = start + (i - r * c0)
        for d in range(nd):
            c = oc[d]
            q = r // c
            off += (r - q * c) * os[d]
            r = q
        if to_packed:
            dst[i] = src[off]
        else:
            dst[off] = src[i]
        i += step


@cuda.jit
def _k_blocks(src, dst, start, offs, cum, per, extent, total, to_packed):  # pragma: no cover - device code
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    n = offs.shape[0]
    while i < total:
        e = i // per
        k = i - e * per
        lo = 0
        hi = n - 1
        while lo < hi:  # last run with cum[run] <= k
            mid = (lo + hi + 1) // 2
            if cum[mid] <= k:
                lo = mid
            else:
                hi = mid - 1
        off = start + e * extent + offs[lo] + (k - cum[lo])
        if to_packed:
            dst[i] = src[off]
        else:
            dst[off] = src[i]
        i += step


def _launch(total):
    if _SIM:
        return 1, 32
    threads = 256
    blocks = min((total + threads - 1) // threads, 65535)
    return max(blocks, 1), threads


def _wview(u8, w):
    if w == 1:
        return u8
    n = u8.shape[0]
    if n % w:
        u8 = u8[: n - n % w]
    return u8.view(_WORD[w])


def _args(p, w):
    """Device copies of the plan's word-scaled arrays (cached on the plan)."""
    a = p._dev.get(w)
    if a is None:
        if p.kind == "strided":
            c0, oc, os = p.words(w)
            a = (c0, cuda.to_device(oc), cuda.to_device(os))
        else:
            offs, lens, ext = p.words(w)
            cum = np.zeros(lens.shape[0], np.int64)
            np.cumsum(lens[:-1], out=cum[1:])
            a = (cuda.to_device(offs), cuda.to_device(cum), int(lens.sum()), ext)
        p._dev[w] = a
    return a


def _eff_word(p, origin):
    w = min(p.word, 8)
    while w > 1 and origin % w:
        w //= 2
    return w


def _check_out(out, nb):
    """A device uint8 array of at least ``nb`` bytes: the caller's ``out`` (a numba
    device array, mapped/pinned host memory from ``cuda.mapped_array`` included,
    or anything with ``__cuda_array_interface__``) or a new one."""
    if out is None:
        return cuda.device_array(nb, dtype=np.uint8)
    arr = out
    if not hasattr(arr, "copy_to_host"):
        if not hasattr(arr, "__cuda_array_interface__"):
            raise BufferError("out must be a 1-D uint8 device array for a device buffer", op="pack")
        arr = cuda.as_cuda_array(arr)
    if np.dtype(arr.dtype) != np.uint8 or len(arr.shape) != 1 or (
            arr.shape[0] > 1 and tuple(arr.strides) != (1,)):
        raise BufferError("out must be a contiguous 1-D uint8 device array for a device buffer", op="pack")
    if arr.shape[0] < nb:
        raise DatatypeError(f"out holds {arr.shape[0]} bytes, the packed data needs {nb}", op="pack")
    return arr


def pack(u8, p, out, origin):
    """Pack on the device from the byte view ``u8``; returns a device uint8 array."""
    nb = p.nbytes
    out = _check_out(out, nb)
    dst = out[:nb] if out.shape[0] != nb else out
    _move(u8, dst, p, origin, True)
    return dst


def unpack(src, p, u8, origin):
    """Unpack on the device from the packed byte view ``src`` into ``u8``."""
    nb = p.nbytes
    _move(u8, src[:nb] if src.shape[0] != nb else src, p, origin, False)


def _move(buf, packed, p, origin, to_packed):
    """Pack (``to_packed``) the plan's bytes of ``buf`` into ``packed``, or unpack
    them back: one contiguous copy, or a kernel launch over words."""
    if p.nbytes == 0:
        return
    if p.kind == "contig":
        s = p.start + origin
        run = buf[s:s + p.nbytes]
        if to_packed:
            packed.copy_to_device(run)
        else:
            run.copy_to_device(packed)
        return
    w = _eff_word(p, origin)
    total = p.nbytes // w
    bw = _wview(buf, w)
    pw = _wview(packed, w)
    src, dst = (bw, pw) if to_packed else (pw, bw)
    start = (p.start + origin) // w  # p.start is 0 for the offsets/lengths form
    blocks, threads = _launch(total)
    if p.kind == "strided":
        c0, oc, os = _args(p, w)
        _k_strided[blocks, threads](src, dst, start, c0, oc, os, total, to_packed)
    else:
        offs, cum, per, ext = _args(p, w)
        _k_blocks[blocks, threads](src, dst, start, offs, cum, per, ext, total, to_packed)
