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

Every kernel is called ``kernel(buf, packed, wit, prm)``: ``buf`` the user's
array, ``packed`` the 1-D contiguous bytes.  Packing and unpacking walk the same
indices (``p`` in the packed words, ``q`` in the buffer's) and copy the other
way round, so each layout has one body, made by a factory whose ``to_packed``
is a closure variable: numba freezes it as a compile-time constant, the
``(dst, src)`` and ``(di, si)`` selections fold away, and the pack and the
unpack kernel each compile to plain copies, as fast as the hand-written twins
they replace.  Measured (``benchmarks/bench_pack.py`` shapes): a direction
branch inside an inlined helper, a row helper taking the block length, or one
shared ``p +=`` after the block-length branches each cost 10-45% on blocks of
1-16 words, so the short-block branches below stay spelled out per literal
length (LLVM unrolls a literal-length copy and vectorizes across blocks).
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


@njit(inline="always")
def _copy(dst, d, src, s, n):  # pragma: no cover - compiled
    """``dst[d:d+n] = src[s:s+n]`` (unsigned indices); a literal ``n`` unrolls."""
    for k in range(n):
        dst[d + k] = src[s + k]


def _strided_kernel(to_packed: bool):
    """The strided kernel, packing when ``to_packed`` else unpacking."""

    @njit(cache=True, nogil=True)
    def strided(buf, packed, wit, prm):  # pragma: no cover - compiled
        B = _words(buf, wit)
        P = _words(packed, wit)
        dst, src = (P, B) if to_packed else (B, P)
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
        # each branch advances p itself (see the module docstring)
        for _ in range(nouter):
            b2 = base
            for _i2 in range(n2):
                if c0 == 1:
                    for i1 in range(n1):
                        pu = uint64(p + i1)
                        qu = uint64(b2 + i1 * s1)
                        di, si = (pu, qu) if to_packed else (qu, pu)
                        dst[di] = src[si]
                    p += n1
                elif c0 * B.itemsize >= MEMCPY_BYTES:
                    q = b2
                    for _i1 in range(n1):
                        di, si = (p, q) if to_packed else (q, p)
                        _memcpy(dst, di, src, si, c0)
                        p += c0
                        q += s1
                elif c0 == 2:
                    for i1 in range(n1):
                        pu = uint64(p + 2 * i1)
                        qu = uint64(b2 + i1 * s1)
                        di, si = (pu, qu) if to_packed else (qu, pu)
                        _copy(dst, di, src, si, uint64(2))
                    p += 2 * n1
                elif c0 == 4:
                    for i1 in range(n1):
                        pu = uint64(p + 4 * i1)
                        qu = uint64(b2 + i1 * s1)
                        di, si = (pu, qu) if to_packed else (qu, pu)
                        _copy(dst, di, src, si, uint64(4))
                    p += 4 * n1
                elif c0 == 8:
                    for i1 in range(n1):
                        pu = uint64(p + 8 * i1)
                        qu = uint64(b2 + i1 * s1)
                        di, si = (pu, qu) if to_packed else (qu, pu)
                        _copy(dst, di, src, si, uint64(8))
                    p += 8 * n1
                elif c0 == 16:
                    for i1 in range(n1):
                        pu = uint64(p + 16 * i1)
                        qu = uint64(b2 + i1 * s1)
                        di, si = (pu, qu) if to_packed else (qu, pu)
                        _copy(dst, di, src, si, uint64(16))
                    p += 16 * n1
                else:
                    q = b2
                    for _i1 in range(n1):
                        di, si = (uint64(p), uint64(q)) if to_packed else (uint64(q), uint64(p))
                        _copy(dst, di, src, si, uint64(c0))
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

    return strided


def _blocks_kernel(to_packed: bool):
    """The offsets/lengths kernel, packing when ``to_packed`` else unpacking."""

    @njit(cache=True, nogil=True)
    def blocks(buf, packed, wit, prm):  # pragma: no cover - compiled
        B = _words(buf, wit)
        P = _words(packed, wit)
        dst, src = (P, B) if to_packed else (B, P)
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
                if n_i * B.itemsize >= MEMCPY_BYTES:
                    q = b + offs[i]
                    di, si = (p, q) if to_packed else (q, p)
                    _memcpy(dst, di, src, si, n_i)
                else:
                    # short runs: the direction as a branch around plain loops
                    # (a (di, si) selection or _copy here costs 2-3 word runs 13%,
                    # measured, unlike in the strided kernel)
                    qu = uint64(b + offs[i])
                    pu = uint64(p)
                    if to_packed:
                        for k in range(uint64(n_i)):
                            P[pu + k] = B[qu + k]
                    else:
                        for k in range(uint64(n_i)):
                            B[qu + k] = P[pu + k]
                p += n_i

    return blocks


pack_strided = _strided_kernel(True)
unpack_strided = _strided_kernel(False)
pack_blocks = _blocks_kernel(True)
unpack_blocks = _blocks_kernel(False)
