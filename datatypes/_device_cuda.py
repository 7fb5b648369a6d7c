"""Device pack/unpack kernels in CUDA C, compiled once with NVRTC and launched
through CuPy (the fast path on a real GPU when CuPy is installed).

Two kernels, each a template over the word type ``W`` (1, 2, 4, 8 or 16 bytes,
the widest the plan's offsets, strides, lengths and both base addresses allow)
and the direction ``P`` (1 = pack, 0 = unpack):

``rows``
    A strided plan (the canonical strided block: ``n0`` contiguous words per
    row, ``nd`` outer dimensions of counts ``cnt`` and strides ``str`` in
    words) is a set of ``nrows = prod(cnt)`` rows.  A 256-thread block is
    split into ``256 / tpr`` row teams of ``tpr`` threads (a power of two: the
    largest dividing ``n0`` for rows narrower than a warp, so no lane idles,
    else the largest not above ``min(n0, 256)``); a team copies one row with consecutive threads on consecutive
    words (coalesced on both sides), so the only index arithmetic is one 32-bit
    division per outer dimension per *row*, never per word.  This is TEMPI's
    3-D launch (Pearson et al., "TEMPI: An Interposed MPI Library with a
    Canonical Representation of CUDA-aware Datatypes", HPDC'21, section 4)
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

__all__ = ["prepare", "prepare_batch", "Launch", "order_after"]

SLOT = 24          # int64 words of one piece's parameters in the rows kernel
MAXDIMS = 9        # outer dimensions a rows piece may have
THREADS = 256
MAXBLOCKS = 16384  # grid-stride beyond this many row blocks

_SRC = r"""
typedef long long i64;
typedef unsigned long long u64;
struct alignas(16) w16 { u64 a, b; };
#define SLOT 24

template <typename W, int P>
__global__ void rows(const u64 base_buf, const u64 base_pk, const i64* __restrict__ prm) {
    const i64* q = prm + (i64)blockIdx.y * SLOT;
    W* buf = (W*)(base_buf + (u64)q[0]);
    W* pk = (W*)(base_pk + (u64)q[1]);
    const i64 n0 = q[2];
    const unsigned nrows = (unsigned)q[3];
    const int nd = (int)q[4];
    const int lg = (int)q[5];
    const unsigned tpr = 1u << lg;
    const unsigned lane = threadIdx.x & (tpr - 1u);
    const unsigned rpb = blockDim.x >> lg;
    const unsigned rstep = gridDim.x * rpb;
    const unsigned c1 = nd > 0 ? (unsigned)q[6] : 1u;
    const i64 s1 = nd > 0 ? q[15] : 0;
    const unsigned c2 = nd > 1 ? (unsigned)q[7] : 1u;
    const i64 s2 = nd > 1 ? q[16] : 0;
    for (unsigned r = blockIdx.x * rpb + (threadIdx.x >> lg); r < nrows; r += rstep) {
        unsigned rr = r;
        unsigned t = rr / c1;
        i64 off = (i64)(rr - t * c1) * s1;
        rr = t;
        if (nd > 1) {
            t = rr / c2;
            off += (i64)(rr - t * c2) * s2;
            rr = t;
            for (int d = 2; d < nd; ++d) {
                const unsigned c = (unsigned)q[6 + d];
                t = rr / c;
                off += (i64)(rr - t * c) * q[15 + d];
                rr = t;
            }
        }
        W* b = buf + off;
        W* p = pk + (i64)r * n0;
        for (i64 k = lane; k < n0; k += tpr) {
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
    """log2 of the row team size: the largest power of two dividing ``n0`` for
    rows narrower than a warp (no idle lanes: a 3-word row gets one thread
    looping over its words), else the largest power of two <= ``n0`` (at most
    256 threads)."""
    n0 = max(int(n0), 1)
    t = (n0 & -n0) if n0 < 32 else 1 << (min(n0, THREADS).bit_length() - 1)
    return min(t, THREADS).bit_length() - 1


def _rows_slot(p, w: int, buf_off: int, pk_off: int):
    """One piece's parameters for the rows kernel (``None`` when it has more
    than MAXDIMS outer dimensions) and its row-block count."""
    c0, oc, os = p.words(w)
    nd = int(oc.shape[0])
    if nd > MAXDIMS:
        return None, 0
    nrows = int(np.prod(oc)) if nd else 1
    if nrows >= 1 << 32:
        return None, 0
    lg = _lg(int(c0))
    slot = np.zeros(SLOT, np.int64)
    slot[:6] = (buf_off, pk_off, c0, nrows, nd, lg)
    slot[6:6 + nd] = oc
    slot[15:15 + nd] = os
    rpb = THREADS >> lg
    return slot, min(-(-nrows // rpb), MAXBLOCKS)


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
            slot = np.zeros(SLOT, np.int64)
            slot[:6] = (b + p.start, k, chunk, n // chunk, 1, _lg(chunk))
            slot[6], slot[15] = n // chunk, chunk
            g = min(-(-(n // chunk) // (THREADS // chunk)), MAXBLOCKS)
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
