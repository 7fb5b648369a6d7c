"""Host pack/unpack kernels (numba ``@njit``), on word views of byte buffers.

Every kernel works in *words*: it views the buffers (any dtype, C- or
F-contiguous, passed as they are so the Python side does no reshaping) as the
widest word type (16 bytes as complex128 — copied as bits, never computed
on — then uint64, uint32, uint16, uint8; ``wit`` is a zero of that type)
that divides the block length, the start, every stride and the extent, so a
64-byte block moves as eight ``uint64`` loads and stores; blocks of
``MEMCPY_BYTES`` or more go through ``llvm.memcpy``.  x86-64 and AArch64 allow
unaligned word access, so a buffer whose address is not word aligned is still
correct (only slower).  Indices are converted to unsigned before indexing so numba
emits no negative-index wraparound check and LLVM can vectorize the inner copy.

Layout arguments (int64, in words), packed into one ``prm`` array so a call
dispatches few arguments:

* strided: ``prm = [start, c0, nd, oc[0..nd), os[0..nd)]`` — ``c0`` words per
  contiguous block, ``oc``/``os`` counts and strides of the ``nd`` outer
  dimensions, fastest first, any number of them;
* blocks: ``prm = [start, count, extent, n, offs[0..n), lens[0..n)]`` — the
  ``n`` runs of one element; ``count`` elements ``extent`` words apart.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types, uint64
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

__all__ = ["pack_strided", "unpack_strided", "pack_blocks", "unpack_blocks"]

#: blocks of at least this many bytes are copied with llvm.memcpy (libc memcpy)
MEMCPY_BYTES = 256


@intrinsic
def _memcpy(typingctx, dst, doff, src, soff, n):
    """``dst[doff:doff+n] = src[soff:soff+n]`` (elements) through llvm.memcpy."""
    sig = types.void(dst, types.int64, src, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        d, do, s, so, nn = args
        da = context.make_array(signature.args[0])(context, builder, d)
        sa = context.make_array(signature.args[2])(context, builder, s)
        itemsize = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        cgutils.raw_memcpy(builder, builder.gep(da.data, [do]), builder.gep(sa.data, [so]), nn, itemsize)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _words(typingctx, arr, wit):
    """A 1-D C array of ``type(wit)`` words over ``arr``'s memory (no copy, no checks).

    ``arr`` must be C- or F-contiguous (its data pointer is then its first byte);
    trailing bytes that do not fill a word are left out.
    """
    if not isinstance(arr, types.Array) or not isinstance(wit, (types.Integer, types.Complex)):
        return None
    retty = types.Array(wit, 1, "C")
    sig = retty(arr, wit)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(retty)(context, builder)
        intp = context.get_value_type(types.intp)
        isz = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        w = context.get_abi_sizeof(context.get_data_type(wit))
        nbytes = builder.mul(a.nitems, intp(isz))
        n = builder.udiv(nbytes, intp(w))
        data = builder.bitcast(a.data, context.get_data_type(wit).as_pointer())
        context.populate_array(out, data=data, shape=[n], strides=[intp(w)], itemsize=intp(w),
                               meminfo=a.meminfo, parent=None)
        return impl_ret_borrowed(context, builder, retty, out._getvalue())

    return sig, codegen


@njit(cache=True, nogil=True)
def pack_strided(buf, out, wit, prm):  # pragma: no cover - compiled
    src = _words(buf, wit)
    dst = _words(out, wit)
    start = prm[0]
    c0 = prm[1]
    nd = prm[2]
    oc = prm[3:3 + nd]
    os = prm[3 + nd:3 + 2 * nd]
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
            elif c0 * src.itemsize >= MEMCPY_BYTES:
                q = b2
                for _i1 in range(n1):
                    _memcpy(dst, p, src, q, c0)
                    p += c0
                    q += s1
            elif c0 == 2:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 2 * i1)
                    dst[pu] = src[qu]
                    dst[pu + uint64(1)] = src[qu + uint64(1)]
                p += 2 * n1
            elif c0 == 4:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 4 * i1)
                    for k in range(uint64(4)):
                        dst[pu + k] = src[qu + k]
                p += 4 * n1
            elif c0 == 8:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 8 * i1)
                    for k in range(uint64(8)):
                        dst[pu + k] = src[qu + k]
                p += 8 * n1
            elif c0 == 16:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 16 * i1)
                    for k in range(uint64(16)):
                        dst[pu + k] = src[qu + k]
                p += 16 * n1
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
def unpack_strided(packed, buf, wit, prm):  # pragma: no cover - compiled
    src = _words(packed, wit)
    dst = _words(buf, wit)
    start = prm[0]
    c0 = prm[1]
    nd = prm[2]
    oc = prm[3:3 + nd]
    os = prm[3 + nd:3 + 2 * nd]
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
            elif c0 * src.itemsize >= MEMCPY_BYTES:
                q = b2
                for _i1 in range(n1):
                    _memcpy(dst, q, src, p, c0)
                    p += c0
                    q += s1
            elif c0 == 2:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 2 * i1)
                    dst[qu] = src[pu]
                    dst[qu + uint64(1)] = src[pu + uint64(1)]
                p += 2 * n1
            elif c0 == 4:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 4 * i1)
                    for k in range(uint64(4)):
                        dst[qu + k] = src[pu + k]
                p += 4 * n1
            elif c0 == 8:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 8 * i1)
                    for k in range(uint64(8)):
                        dst[qu + k] = src[pu + k]
                p += 8 * n1
            elif c0 == 16:
                for i1 in range(n1):
                    qu = uint64(b2 + i1 * s1)
                    pu = uint64(p + 16 * i1)
                    for k in range(uint64(16)):
                        dst[qu + k] = src[pu + k]
                p += 16 * n1
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
def pack_blocks(buf, out, wit, prm):  # pragma: no cover - compiled
    src = _words(buf, wit)
    dst = _words(out, wit)
    start = prm[0]
    count = prm[1]
    extent = prm[2]
    n = prm[3]
    offs = prm[4:4 + n]
    lens = prm[4 + n:4 + 2 * n]
    p = 0
    for e in range(count):
        b = start + e * extent
        for i in range(n):
            n_i = lens[i]
            if n_i * src.itemsize >= MEMCPY_BYTES:
                _memcpy(dst, p, src, b + offs[i], n_i)
            else:
                q = uint64(b + offs[i])
                pu = uint64(p)
                for k in range(uint64(n_i)):
                    dst[pu + k] = src[q + k]
            p += n_i


@njit(cache=True, nogil=True)
def unpack_blocks(packed, buf, wit, prm):  # pragma: no cover - compiled
    src = _words(packed, wit)
    dst = _words(buf, wit)
    start = prm[0]
    count = prm[1]
    extent = prm[2]
    n = prm[3]
    offs = prm[4:4 + n]
    lens = prm[4 + n:4 + 2 * n]
    p = 0
    for e in range(count):
        b = start + e * extent
        for i in range(n):
            n_i = lens[i]
            if n_i * src.itemsize >= MEMCPY_BYTES:
                _memcpy(dst, b + offs[i], src, p, n_i)
            else:
                q = uint64(b + offs[i])
                pu = uint64(p)
                for k in range(uint64(n_i)):
                    dst[q + k] = src[pu + k]
            p += n_i
