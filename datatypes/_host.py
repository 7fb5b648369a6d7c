"""Host pack/unpack kernels (numba ``@njit``), on word views of byte buffers.

Every kernel works in *words*: the caller views the byte buffers as the widest
unsigned integer type (8, 4, 2 or 1 bytes) that divides the block length, the
start, every stride and the extent, so a 64-byte block moves as eight ``uint64``
loads and stores.  Indices are converted to unsigned before indexing so numba
emits no negative-index wraparound check and LLVM can vectorize the inner copy.

Layout arguments (all int64, in words):

* strided: ``start``, ``c0`` (words per contiguous block), ``oc``/``os`` (counts
  and strides of the outer dimensions, fastest first, any number of them);
* blocks: ``offs``/``lens`` (runs of one element), ``count`` elements ``extent``
  words apart.
"""
from __future__ import annotations

import numpy as np
from numba import njit, uint64

__all__ = ["pack_strided", "unpack_strided", "pack_blocks", "unpack_blocks"]


@njit(cache=True, nogil=True)
def pack_strided(src, dst, start, c0, oc, os):  # pragma: no cover - compiled
    nd = oc.shape[0]
    n1 = oc[0] if nd > 0 else 1
    s1 = os[0] if nd > 0 else 0
    n2 = oc[1] if nd > 1 else 1
    s2 = os[1] if nd > 1 else 0
    nouter = 1
    for d in range(2, nd):
        nouter *= oc[d]
    idx = np.zeros(nd if nd > 2 else 2, np.int64)
    p = 0
    base = start
    for _ in range(nouter):
        b2 = base
        for _i2 in range(n2):
            if c0 == 1:
                for i1 in range(n1):
                    dst[uint64(p + i1)] = src[uint64(b2 + i1 * s1)]
                p += n1
            else:
                q = b2
                for _i1 in range(n1):
                    pu = uint64(p)
                    qu = uint64(q)
                    for k in range(uint64(c0)):
                        dst[pu + k] = src[qu + k]
                    p += c0
                    q += s1
            b2 += s2
        for d in range(2, nd):
            idx[d] += 1
            base += os[d]
            if idx[d] < oc[d]:
                break
            base -= oc[d] * os[d]
            idx[d] = 0


@njit(cache=True, nogil=True)
def unpack_strided(src, dst, start, c0, oc, os):  # pragma: no cover - compiled
    nd = oc.shape[0]
    n1 = oc[0] if nd > 0 else 1
    s1 = os[0] if nd > 0 else 0
    n2 = oc[1] if nd > 1 else 1
    s2 = os[1] if nd > 1 else 0
    nouter = 1
    for d in range(2, nd):
        nouter *= oc[d]
    idx = np.zeros(nd if nd > 2 else 2, np.int64)
    p = 0
    base = start
    for _ in range(nouter):
        b2 = base
        for _i2 in range(n2):
            if c0 == 1:
                for i1 in range(n1):
                    dst[uint64(b2 + i1 * s1)] = src[uint64(p + i1)]
                p += n1
            else:
                q = b2
                for _i1 in range(n1):
                    pu = uint64(p)
                    qu = uint64(q)
                    for k in range(uint64(c0)):
                        dst[qu + k] = src[pu + k]
                    p += c0
                    q += s1
            b2 += s2
        for d in range(2, nd):
            idx[d] += 1
            base += os[d]
            if idx[d] < oc[d]:
                break
            base -= oc[d] * os[d]
            idx[d] = 0


@njit(cache=True, nogil=True)
def pack_blocks(src, dst, start, offs, lens, count, extent):  # pragma: no cover - compiled
    p = 0
    n = offs.shape[0]
    for e in range(count):
        b = start + e * extent
        for i in range(n):
            q = uint64(b + offs[i])
            pu = uint64(p)
            for k in range(uint64(lens[i])):
                dst[pu + k] = src[q + k]
            p += lens[i]


@njit(cache=True, nogil=True)
def unpack_blocks(src, dst, start, offs, lens, count, extent):  # pragma: no cover - compiled
    p = 0
    n = offs.shape[0]
    for e in range(count):
        b = start + e * extent
        for i in range(n):
            q = uint64(b + offs[i])
            pu = uint64(p)
            for k in range(uint64(lens[i])):
                dst[q + k] = src[pu + k]
            p += lens[i]
