"""Batched pack/unpack: many (buffer, datatype) pieces in one kernel call.

A halo exchange packs ``neighbours x fields`` pieces every step (26 x F in
3-D with corners).  Packed one call at a time, the Python-to-kernel overhead
(about a microsecond per call) rivals the copying for small faces.  A
:class:`BatchPack` lays the pieces out once — piece ``m`` is
``pieces[m] = (buffer index, datatype)`` and lands at byte ``offsets[m]`` of
one contiguous buffer — and then packs or unpacks all of them with a single
compiled call over the same strided kernels :func:`commlib.datatypes.pack`
uses (TEMPI's canonical strided blocks, Pearson et al., HPDC'21; batching is
commlib's addition).  On the host, pieces whose layout is not one strided
block and buffers of mixed dtypes or shapes fall back to one ``pack`` call per
piece, with the same bytes.  On the device every strided piece of every buffer
moves in one kernel launch (one piece per ``blockIdx.y``), prepared once per
set of buffers and reused (a few sets are kept, e.g. a solver's two fields it
swaps every step).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit

from commlib.core.buffer import as_buffer
from commlib.core.errors import DatatypeError

from . import _host
from .pack import WORD, packed_device, pack, plan_for, unpack

__all__ = ["BatchPack"]


def _batch_kernel(to_packed: bool):
    """Every piece ``m``: buffer ``bufs[which[m]]`` <-> ``packed[offs[m]:offs[m] + lens[m]]``,
    packing when ``to_packed`` (a compile-time constant, as in :mod:`._host`)."""

    @njit(cache=True, nogil=True)
    def many(bufs, packed, wit, prms, which, offs, lens):  # pragma: no cover - compiled
        for m in range(prms.shape[0]):
            o = offs[m]
            if to_packed:
                _host.pack_strided(bufs[which[m]], packed[o:o + lens[m]], wit, prms[m])
            else:
                _host.unpack_strided(bufs[which[m]], packed[o:o + lens[m]], wit, prms[m])

    return many


_pack_many = _batch_kernel(True)
_unpack_many = _batch_kernel(False)


class BatchPack:
    """Pack/unpack a fixed list of pieces into/from one contiguous byte buffer.

    Args:
        pieces: ``(buffer index, datatype)`` per piece (commlib types or
            ``MPI.Datatype``), one element (count 1) each.
        offsets: byte offset of each piece in the packed buffer (default: back
            to back in order).

    Attributes:
        nbytes: packed size in bytes (``max(offset + size)``).

    Raises:
        DatatypeError: offsets that overlap or have the wrong length.
    """

    def __init__(self, pieces: Sequence[tuple], offsets: Sequence[int] | None = None):
        self.pieces = [(int(i), t) for i, t in pieces]
        plans = [plan_for(t, 1) for _, t in self.pieces]
        sizes = [p.nbytes for p in plans]
        if offsets is None:
            offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if sizes else []
        offsets = [int(o) for o in offsets]
        if len(offsets) != len(self.pieces):
            raise DatatypeError(f"{len(offsets)} offsets for {len(self.pieces)} pieces", op="BatchPack")
        spans = sorted((o, o + n) for o, n in zip(offsets, sizes) if n)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            raise DatatypeError("pieces overlap in the packed buffer", op="BatchPack")
        self.offsets, self.sizes, self.plans = offsets, sizes, plans
        self.nbytes = max((o + n for o, n in zip(offsets, sizes)), default=0)
        self.nbufs = 1 + max((i for i, _ in self.pieces), default=-1)
        self._fused = None
        live = [(m, p) for m, p in enumerate(plans) if p.nbytes]
        if live and all(p.kind in ("strided", "contig") for _, p in live):
            word = min(min(p.word for _, p in live), 8)
            while word > 1 and any(o % word for o in offsets):
                word //= 2
            if all(o % word == 0 and n % word == 0 for o, n in zip(offsets, sizes)):
                rows = []
                for _, p in live:
                    c0, oc, os = p.words(word)
                    rows.append([p.start // word, c0, oc.shape[0], *oc, *os])
                width = max(len(r) for r in rows)
                prms = np.zeros((len(rows), width), np.int64)
                for k, r in enumerate(rows):
                    prms[k, :len(r)] = r
                which = np.array([self.pieces[m][0] for m, _ in live], np.int64)
                offs = np.array([offsets[m] for m, _ in live], np.int64)  # bytes: slices of the uint8 buffer
                lens = np.array([sizes[m] for m, _ in live], np.int64)
                self._fused = (WORD[word](0), prms, which, offs, lens)
        self._checked: set = set()
        self._dev: dict = {}  # (id(buf)..., id(out), to_packed) -> (launch, refs)
        # a piece whose type map writes some byte twice must raise on unpack
        # (per-piece unpack does): keep such batches off the fused path
        self._unpack_fused = self._fused is not None and not any(p.overlaps() for _, p in live)

    def _fusable(self, bufs) -> bool:
        if self._fused is None or not bufs:
            return False
        b0 = bufs[0]
        if type(b0) is not np.ndarray:
            return False
        key = tuple((b.shape, b.dtype, b.flags.c_contiguous) for b in bufs)
        if key in self._checked:
            return True
        ok = all(type(b) is np.ndarray and b.shape == b0.shape and b.dtype == b0.dtype and b.flags.c_contiguous
                 for b in bufs)
        if ok:  # every piece inside its buffer (the per-call pack checks this too)
            for (i, t), p in zip(self.pieces, self.plans):
                if p.nbytes and (p.lo < 0 or p.hi > bufs[i].nbytes):
                    raise DatatypeError(f"piece {t!r} touches bytes [{p.lo}, {p.hi}) of a {bufs[i].nbytes}-byte "
                                        "buffer; nothing was written", op="BatchPack")
            self._checked.add(key)
        return ok

    def _device(self, bufs, packed, to_packed, op):
        """The prepared device launch for these buffers and packed array, or
        None when ``bufs`` are host arrays."""
        key = (*map(id, bufs), id(packed), to_packed)
        got = self._dev.get(key)
        if got is not None:
            return got[0]
        if type(bufs[0]) is np.ndarray or type(packed) is np.ndarray:
            return None
        from . import _device  # noqa: PLC0415 - numba.cuda: only for device buffers

        bb = [as_buffer(b, op=op) for b in bufs]
        if not all(b.is_device and b.dense for b in bb):
            return None
        for (i, t), p in zip(self.pieces, self.plans):
            if p.nbytes and (p.lo < 0 or p.hi > bb[i].nbytes):
                raise DatatypeError(f"piece {t!r} touches bytes [{p.lo}, {p.hi}) of a {bb[i].nbytes}-byte "
                                    "buffer; nothing was written", op=op)
        if not to_packed and any(p.overlaps() for p in self.plans):
            return None  # the per-piece unpack raises the precise error
        pk = packed_device(packed)
        go = _device.prepare_batch([(p, bb[i], pk, o) for (i, _), p, o in zip(self.pieces, self.plans, self.offsets)
                                    if p.nbytes], to_packed)
        if len(self._dev) >= 8:
            self._dev.pop(next(iter(self._dev)))
        self._dev[key] = (go, (bufs, packed))  # the references keep the ids valid
        return go

    def pack(self, bufs: Sequence, out) -> None:
        """Pack every piece of ``bufs`` (a tuple of arrays) into ``out`` (uint8, >= nbytes)."""
        bufs = tuple(bufs)
        if len(bufs) < self.nbufs:
            raise DatatypeError(f"{len(bufs)} buffers given, pieces use {self.nbufs}", op="BatchPack.pack")
        if out.shape[0] < self.nbytes:
            raise DatatypeError(f"out holds {out.shape[0]} bytes, the batch needs {self.nbytes}", op="BatchPack.pack")
        if self._fusable(bufs) and type(out) is np.ndarray:
            wit, prms, which, offs, lens = self._fused
            _pack_many(bufs, out, wit, prms, which, offs, lens)
            return
        go = self._device(bufs, out, True, "BatchPack.pack") if bufs else None
        if go is not None:
            go()
            return
        for (i, t), o, n in zip(self.pieces, self.offsets, self.sizes):
            # a 0-byte piece gets ``out`` itself (checked, nothing written): a
            # slice of an empty numba device array raises on a GPU
            pack(bufs[i], t, out=out[o:o + n] if n else out)

    def unpack(self, packed, bufs: Sequence) -> None:
        """Unpack every piece from ``packed`` into ``bufs``."""
        bufs = tuple(bufs)
        if len(bufs) < self.nbufs:
            raise DatatypeError(f"{len(bufs)} buffers given, pieces use {self.nbufs}", op="BatchPack.unpack")
        if packed.shape[0] < self.nbytes:
            raise DatatypeError(f"packed holds {packed.shape[0]} bytes, the batch needs {self.nbytes}",
                                op="BatchPack.unpack")
        if self._unpack_fused and self._fusable(bufs) and type(packed) is np.ndarray:
            wit, prms, which, offs, lens = self._fused
            _unpack_many(bufs, packed, wit, prms, which, offs, lens)
            return
        go = self._device(bufs, packed, False, "BatchPack.unpack") if bufs else None
        if go is not None:
            go()
            return
        for (i, t), o, n in zip(self.pieces, self.offsets, self.sizes):
            unpack(packed[o:o + n] if n else packed, t, bufs[i])  # as pack for a 0-byte piece
