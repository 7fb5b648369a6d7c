"""Device pack/unpack kernels in CUDA C, compiled once with NVRTC and launched
through CuPy (the fast path on a real GPU when CuPy is installed).

Two kernels, each a template over the word type ``W`` (1, 2, 4, 8 or 16 bytes,
the widest the plan's offsets, strides, lengths and both base addresses allow)
and the direction ``P`` (1 = pack, 0 = unpack):

``rows``
    A strided plan (the canonical strided block: ``n0`` contiguous words per
    row, ``nd`` outer dimensions of counts ``cnt`` and strides ``str`` in
    words) is a set of ``nrows = prod(cnt)`` rows.  A 256-thread block is
    split into ``256 / tpr`` row teams of ``tpr`` threads (a power of two not
    above ``min(n0, 256)``); a team copies one row with consecutive threads on
    consecutive words (coalesced on both sides).  Rows narrower than a warp
    and not a power of two words wide (a 3-D z-face: 3 words) use the flat
    mapping instead, one thread per word, so no lane idles.  The only index
    arithmetic is a division per outer dimension per row (per word in the
    flat mapping), done as a multiply and a shift by precomputed constants
    (Granlund and Montgomery, PLDI'94) -- never a 64-bit division.  This is
    TEMPI's 3-D launch (Pearson et al., "TEMPI: An Interposed MPI Library with
    a Canonical Representation of CUDA-aware Datatypes", HPDC'21, section 4)
    generalized to any number of dimensions and to rows narrower than a warp.
    ``blockIdx.y`` selects the piece, so every piece of a batch (a halo
    exchange's faces of several fields) moves in one launch.
``runs``
    The offsets/lengths form: one warp per (run, element), lanes striding over
    the run's words; runs' packed offsets are precomputed prefix sums (no
    search per word).

Each launch reads its parameters from a small device array built once per
(plan, word) and cached on the plan, plus three 64-bit scalars (the two base
addresses and the parameter array's address), so the per-call host cost is one
CuPy kernel launch.  A plan of one contiguous run is a ``cudaMemcpyAsync``.
Work is issued on the caller's stream (CuPy's current stream by default); a
foreign array's producer stream from ``__cuda_array_interface__`` is ordered
before it with an event, never with a device-wide synchronize.
"""
from __future__ import annotations

import numpy as np

import cupy

from ._launch import fastdiv, team_lg

__all__ = ["prepare", "prepare_batch", "Launch", "order_after"]

SLOT = 32          # int64 words of one piece's parameters in the rows kernel
MAXDIMS = 9        # outer dimensions a rows piece may have
THREADS = 256
MAXBLOCKS = 16384  # grid-stride beyond this many row blocks

_SRC = r"""
typedef long long i64;
typedef unsigned long long u64;
struct alignas(16) w16 { u64 a, b; };
#define SLOT 32

// n / d for n < 2^31 by a multiply and a shift (Granlund-Montgomery, round-up
// variant: M = ceil(2^(32+l) / d), l = ceil(log2 d), exact for every n < 2^32;
// n < 2^31 keeps n * M below 2^64); M and 32+l are precomputed on the host.
__device__ __forceinline__ unsigned fdiv(unsigned n, u64 m, int s) { return (unsigned)(((u64)n * m) >> s); }

template <typename W, int P>
__device__ __forceinline__ i64 row_offset(unsigned r, const i64* __restrict__ q, int nd,
                                          unsigned c1, u64 m1, int h1, i64 s1,
                                          unsigned c2, u64 m2, int h2, i64 s2) {
    unsigned t = fdiv(r, m1, h1);
    i64 off = (i64)(r - t * c1) * s1;
    if (nd > 1) {
        unsigned rr = t;
        t = fdiv(rr, m2, h2);
        off += (i64)(rr - t * c2) * s2;
        rr = t;
        for (int d = 2; d < nd; ++d) {
            const unsigned c = (unsigned)q[6 + d];
            t = rr / c;
            off += (i64)(rr - t * c) * q[15 + d];
            rr = t;
        }
    }
    return off;
}

template <typename W, int P>
__global__ void rows(const u64 base_buf, const u64 base_pk, const i64* __restrict__ prm) {
    const i64* q = prm + (i64)blockIdx.y * SLOT;
    W* buf = (W*)(base_buf + (u64)q[0]);
    W* pk = (W*)(base_pk + (u64)q[1]);
    const unsigned n0 = (unsigned)q[2];
    const unsigned nrows = (unsigned)q[3];
    const int nd = (int)q[4];
    const int lg = (int)q[5];
    const unsigned c1 = (unsigned)q[6];
    const i64 s1 = q[15];
    const unsigned c2 = (unsigned)q[7];
    const i64 s2 = q[16];
    const u64 m1 = (u64)q[26], m2 = (u64)q[28];
    const int h1 = (int)q[27], h2 = (int)q[29];
    if (lg < 0) {
        // flat: one thread per word, consecutive threads on consecutive packed
        // words (rows narrower than a warp and not a power of two words wide)
        const u64 m0 = (u64)q[24];
        const int h0 = (int)q[25];
        const unsigned total = n0 * nrows;
        for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
            const unsigned r = fdiv(i, m0, h0);
            const unsigned k = i - r * n0;
            const i64 off = row_offset<W, P>(r, q, nd, c1, m1, h1, s1, c2, m2, h2, s2);
            if (P) pk[i] = buf[off + k]; else buf[off + k] = pk[i];
        }
        return;
    }
    const unsigned tpr = 1u << lg;
    const unsigned lane = threadIdx.x & (tpr - 1u);
    const unsigned rpb = blockDim.x >> lg;
    const unsigned rstep = gridDim.x * rpb;
    for (unsigned r = blockIdx.x * rpb + (threadIdx.x >> lg); r < nrows; r += rstep) {
        W* b = buf + row_offset<W, P>(r, q, nd, c1, m1, h1, s1, c2, m2, h2, s2);
        W* p = pk + (i64)r * n0;
        for (unsigned k = lane; k < n0; k += tpr) {
            if (P) p[k] = b[k]; else b[k] = p[k];
        }
    }
}

template <typename W, int P>
__global__ void runs(const u64 base_buf, const u64 base_pk, const i64* __restrict__ prm) {
    W* buf = (W*)(base_buf + (u64)prm[0]);
    W* pk = (W*)(base_pk + (u64)prm[1]);
    const unsigned count = (unsigned)prm[2];
    const i64 ext = prm[3];
    const unsigned nruns = (unsigned)prm[4];
    const i64 per = prm[5];
    const i64* offs = prm + 8;
    const i64* cum = offs + nruns;
    const i64* lens = cum + nruns;
    const unsigned lane = threadIdx.x & 31u;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 total = (u64)nruns * count;
    for (u64 g = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; g < total; g += nwarps) {
        const unsigned e = (unsigned)(g / nruns);
        const unsigned run = (unsigned)(g - (u64)e * nruns);
        W* b = buf + (i64)e * ext + offs[run];
        W* p = pk + (i64)e * per + cum[run];
        const i64 n = lens[run];
        for (i64 k = lane; k < n; k += 32) {
            if (P) p[k] = b[k]; else b[k] = p[k];
        }
    }
}
"""

_WTYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long", 16: "w16"}
_NAMES = [f"{k}<{_WTYPE[w]}, {d}>" for k in ("rows", "runs") for w in _WTYPE for d in (0, 1)]
_MOD = None
_FN: dict = {}
_COPY_DEFAULT = 4  # cudaMemcpyDefault: device, mapped or pinned memory alike (unified addressing)


def _kernel(kind: str, w: int, to_packed: bool):
    fn = _FN.get((kind, w, to_packed))
    if fn is None:
        global _MOD
        if _MOD is None:
            _MOD = cupy.RawModule(code=_SRC, options=("--std=c++17",), name_expressions=_NAMES)
        fn = _FN[(kind, w, to_packed)] = _MOD.get_function(f"{kind}<{_WTYPE[w]}, {int(to_packed)}>")
    return fn


def _lg(n0: int) -> int:
    return team_lg(n0, THREADS)


def _rows_slot(p, w: int, buf_off: int, pk_off: int, counts=None, strides=None, n0=None):
    """One piece's parameters for the rows kernel (``None`` when it has more
    than MAXDIMS outer dimensions or too many words for 31-bit indices) and
    its block count."""
    if counts is None:
        c0, oc, os = p.words(w)
    else:
        c0, oc, os = n0, np.asarray(counts, np.int64), np.asarray(strides, np.int64)
    nd = int(oc.shape[0])
    if nd > MAXDIMS:
        return None, 0
    nrows = int(np.prod(oc)) if nd else 1
    if nrows * int(c0) >= 1 << 31:
        return None, 0
    lg = _lg(int(c0))
    slot = np.zeros(SLOT, np.int64)
    slot[:6] = (buf_off, pk_off, c0, nrows, nd, lg)
    slot[6:6 + nd] = oc
    slot[6 + nd:15] = 1
    slot[15:15 + nd] = os
    slot[24:26] = fastdiv(int(c0))
    slot[26:28] = fastdiv(int(slot[6]))
    slot[28:30] = fastdiv(int(slot[7]))
    if lg < 0:
        blocks = -(-(nrows * int(c0)) // THREADS)
    else:
        blocks = -(-nrows // (THREADS >> lg))
    return slot, max(1, min(blocks, MAXBLOCKS))


def _runs_params(p, w: int):
    offs, lens, ext = p.words(w)
    n = int(offs.shape[0])
    cum = np.zeros(n, np.int64)
    np.cumsum(lens[:-1], out=cum[1:])
    head = np.array([0, 0, p.count, ext, n, int(lens.sum()), 0, 0], np.int64)
    prm = np.concatenate((head, offs.astype(np.int64), cum, lens.astype(np.int64)))
    warps = n * p.count
    return prm, max(1, min(-(-warps // (THREADS // 32)), MAXBLOCKS))


class Launch:
    """One prepared device operation: a kernel launch with fixed arguments, or
    a ``cudaMemcpyAsync``; ``launch()`` issues it on CuPy's current stream."""

    __slots__ = ("fn", "grid", "args", "copy", "keep")

    def __init__(self, fn=None, grid=None, args=None, copy=None, keep=None):
        self.fn, self.grid, self.args, self.copy, self.keep = fn, grid, args, copy, keep

    def launch(self) -> None:
        c = self.copy
        if c is not None:
            if c[2]:
                cupy.cuda.runtime.memcpyAsync(c[0], c[1], c[2], _COPY_DEFAULT, cupy.cuda.get_current_stream().ptr)
            return
        if self.fn is not None:
            self.fn(self.grid, (THREADS,), self.args)


def _word(p, *addrs) -> int:
    w = min(p.word, 16)
    acc = 0
    for a in addrs:
        acc |= int(a)
    while w > 1 and acc % w:
        w //= 2
    return w


def prepare(p, buf_addr: int, pk_addr: int, to_packed: bool) -> Launch:
    """A :class:`Launch` moving plan ``p``'s bytes between the buffer whose type
    map origin is at device address ``buf_addr`` and the packed bytes at
    ``pk_addr``; packing when ``to_packed``.  Parameters are built once per
    (plan, word) and cached on the plan."""
    if p.nbytes == 0:
        return Launch()
    if p.kind == "contig":
        src, dst = buf_addr + p.start, pk_addr
        if not to_packed:
            src, dst = dst, src
        return Launch(copy=(dst, src, p.nbytes))
    w = _word(p, buf_addr, pk_addr)
    key = ("cuda", w)
    got = p._dev.get(key)
    if got is None:
        if p.kind == "strided":
            slot, gx = _rows_slot(p, w, p.start, 0)
            if slot is None:
                return None  # too many dimensions: the caller falls back
            got = (cupy.asarray(slot), (gx, 1), "rows")
        else:
            prm, gx = _runs_params(p, w)
            got = (cupy.asarray(prm), (gx,), "runs")
        p._dev[key] = got
    prm, grid, kind = got
    args = (np.uint64(buf_addr), np.uint64(pk_addr), np.uint64(prm.data.ptr))
    return Launch(_kernel(kind, w, to_packed), grid, args, keep=prm)


def prepare_batch(pieces, to_packed: bool):
    """Launches moving every piece ``(plan, buf_addr, pk_addr)``: all strided
    and contiguous pieces in one ``rows`` launch (one piece per ``blockIdx.y``),
    the offsets/lengths pieces one launch each.  Returns a list of
    :class:`Launch` (the parameter array is built here, once per batch and set
    of addresses)."""
    rows = [(p, b, k) for p, b, k in pieces if p.nbytes and p.kind in ("strided", "contig")]
    rest = [prepare(p, b, k, to_packed) for p, b, k in pieces if p.nbytes and p.kind == "blocks"]
    if not rows:
        return rest
    w = 16
    for p, b, k in rows:
        w = min(w, _word(p, b, k))
    slots, gx = [], 1
    for p, b, k in rows:
        if p.kind == "contig":  # n words as rows of a power-of-two chunk dividing n
            n = p.nbytes // w
            chunk = min(n & -n, THREADS)
            slot, g = _rows_slot(p, w, b + p.start, k, counts=(n // chunk,), strides=(chunk,), n0=chunk)
            if slot is None:
                rest.append(prepare(p, b, k, to_packed))
                continue
        else:
            slot, g = _rows_slot(p, w, b + p.start, k)
            if slot is None:
                rest.append(prepare(p, b, k, to_packed))
                continue
        slots.append(slot)
        gx = max(gx, g)
    if slots:
        prm = cupy.asarray(np.stack(slots))
        fn = _kernel("rows", w, to_packed)
        rest.append(Launch(fn, (gx, len(slots)), (np.uint64(0), np.uint64(0), np.uint64(prm.data.ptr)), keep=prm))
    return rest


def order_after(stream_handles) -> None:
    """Make CuPy's current stream wait (with events) for each producer stream
    handle given by a ``__cuda_array_interface__`` (None, 0, 1 and 2 -- no
    stream, the legacy and per-thread default streams -- need no event)."""
    cur = None
    for h in stream_handles:
        if h in (None, 0, 1, 2):
            continue
        if cur is None:
            cur = cupy.cuda.get_current_stream()
        if h == cur.ptr:
            continue
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(cupy.cuda.ExternalStream(h))
        cur.wait_event(ev)
