"""Halo (ghost-cell) exchange on Cartesian grids.

A field on a rank of a ``d``-dimensional Cartesian communicator holds its
``local_shape`` block of the global grid surrounded by ``width[i]`` ghost cells
on each side of dimension ``i``: its shape is ``local_shape[i] + 2*width[i]``.
:class:`HaloExchange` fills the ghost cells from the neighbouring ranks' edge
cells.

Each of the up to ``3**d - 1`` neighbour regions (faces, and with
``corners=True`` also edges and corners, i.e. the box-stencil neighbourhood)
is described once by a commlib ``Subarray`` datatype (MPI-4.0 §5.1.3), packed
into a contiguous message with :func:`commlib.datatypes.pack` (on the device,
by numba.cuda kernels, for device arrays), sent with non-blocking
point-to-point calls and unpacked into the ghost region.  All messages are in
flight at once, as in TEMPI's 26-neighbour exchange (Pearson et al., HPDC'22),
rather than the dimension-by-dimension scheme that serializes ``d`` rounds.

The plan (neighbours, datatypes, message buffers) is built once and reused.
Every message goes through the transport contract
(:mod:`commlib.transports.base`): the plan owns a private duplicate of the
Cartesian communicator's transport, its messages are persistent requests of
that transport (``send_init``/``recv_init``, ``startall``, ``waitall``) with
tags from its :class:`~commlib.core.tags.TagAllocator`, so any failure of an
exchange reaches the caller as a classified :class:`~commlib.CommError`
(:class:`~commlib.ProcessFailed`, :class:`~commlib.CommTimeout`, ...) naming
the rank and ``HaloExchange.exchange``.

Validation that cannot split.  Every message starts with a fixed
:data:`HEADER_BYTES`-byte header (int64 words: status, sender rank, field
count, dtype code, payload bytes, reason, origin rank), written once when the
message buffers are built, so a good exchange pays nothing for it; a receiver
reads the headers of its messages before unpacking.  A rank whose own fields do
not match the plan (shape, dtype, order, a read-only field, mixed devices),
or whose ``timeout`` is not a valid number of seconds, does not pack: it
sends each neighbour an *abort* header in place of its data, receives (and
drops) the neighbours' messages so none of their sends is left pending, and
raises :class:`~commlib.InvalidArgument`.  A neighbour that receives an abort
header, or a header whose field count, dtype or size differ from its own
message, raises :class:`~commlib.InvalidArgument` naming the offending rank and
writes no ghost cell.  Ranks that are not neighbours of the offender get a
small notice from it on a tag of their own, found by one ``MPI_Iprobe`` when
their next exchange starts, and raise the same way then.  The notice carries
the number of the aborted exchange: a rank that is behind the offender (which
may lead by its distance on the grid) keeps it and runs the exchanges before
that one normally, since its neighbours do.  Fields that are right on every
rank but differ between neighbours (another number of fields) show as a header
that does not match, or a message too large for its receive: the ranks that
see it raise and send the same notice to the ranks that are not their
neighbours, so every rank raises.  No collective check
runs per call; every wait of the abort path is bounded (``timeout``, else
``COMMLIB_TIMEOUT``).  On the device the headers travel in the pinned host
staging buffer (and, with CUDA-aware MPI, are read back from the device with
one small copy per neighbour).
"""
from __future__ import annotations

import itertools
import time
import zlib
from typing import Sequence

import numpy as np

from commlib.core import devmem
from commlib.core.buffer import as_buffer
from commlib.core.config import config
from commlib.core.errors import CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import check_timeout, timeout_problem
from commlib.datatypes import Subarray
from commlib.datatypes.batch import BatchPack
from commlib.transports.base import Request

from .agreement import check_all

__all__ = ["HaloExchange", "HaloRequest", "HEADER_BYTES"]

_EXCHANGE = "HaloExchange.exchange"

#: bytes of the header in front of every halo message (a multiple of 64, so
#: the packed pieces after it stay aligned for the device kernels)
HEADER_BYTES = 64
_H = HEADER_BYTES
_OK = 0x48414C4F4F4B2121    # status words ("HALOOK!!", "HALOABRT"): garbage cannot pass for them
_ABORT = 0x48414C4F41425254
# header words
_STATUS, _SENDER, _NFIELDS, _DTYPE, _NBYTES, _REASON, _ORIGIN, _FAR = range(8)
_REASONS = {1: "a field's shape differs from the plan's", 2: "a field's dtype differs from the plan's",
            3: "a field is not C-contiguous", 4: "its fields are invalid (see its error)",
            5: "its fields and a neighbour's differ in number, dtype or size",
            6: "a neighbour's message was larger than its plan's (another number of fields?)",
            7: "a field is read-only", 8: "its timeout is invalid",
}
_MISMATCH, _TOO_BIG = 5, 6  # notices from a rank that found its neighbours' fields inconsistent


def _dtype_code(dtype) -> int:
    return zlib.crc32(np.dtype(dtype).str.encode())


def _reason_of(detail: str) -> int:
    if "has shape" in detail:
        return 1
    if "has dtype" in detail:
        return 2
    if "C-contiguous" in detail:
        return 3
    if "read-only" in detail:
        return 7
    if detail.startswith("timeout"):
        return 8
    return 4


class _Neighbour:
    __slots__ = ("offset", "rank", "send_type", "recv_type", "nbytes", "send_tag", "recv_tag")


class HaloExchange:
    """A reusable ghost-cell exchange plan for fields on a Cartesian communicator.

    Args:
        cart: a :class:`commlib.CartCommunicator` (from ``comm.cart_create``).
        local_shape: interior cells this rank owns, one int per grid dimension.
        width: ghost-cell width, an int or one int per dimension (0 allowed:
            no exchange along that dimension).
        corners: True fills face, edge and corner ghosts (box stencil); False
            fills faces only (star stencil).
        dtype: element dtype of the fields.

    Construction is collective over ``cart``: it validates the geometry on
    every rank together and duplicates the communicator's transport
    (``cart.transport.dup()``), so halo tags never meet the application's
    messages; the tags themselves come from that private transport's
    allocator.

    Raises:
        InvalidArgument: on every rank alike, naming the offending rank(s), when
            a halo is wider than a local block, ``local_shape`` or ``width`` has
            the wrong length or a negative entry.
    """

    def __init__(self, cart, local_shape: Sequence[int], width: int | Sequence[int] = 1,
                 corners: bool = True, dtype=np.float64):
        op = "HaloExchange"
        self.cart = cart
        self.rank = cart.rank
        self.dtype = np.dtype(dtype)
        self._buffers: dict = {}
        self._freed = False
        ndim = getattr(cart, "ndim", None)
        problem = None
        if ndim is None:
            raise InvalidArgument("needs a Cartesian communicator (comm.cart_create)", rank=cart.rank, op=op)
        local_shape = tuple(int(n) for n in np.atleast_1d(local_shape))
        if isinstance(width, (int, np.integer)):
            width = (int(width),) * ndim
        width = tuple(int(w) for w in width)
        if len(local_shape) != ndim:
            problem = f"local_shape {local_shape} has {len(local_shape)} dimensions, the grid {ndim}"
        elif len(width) != ndim:
            problem = f"width {width} has {len(width)} entries, the grid {ndim} dimensions"
        elif any(n < 1 for n in local_shape):
            problem = f"local_shape {local_shape} has an empty dimension"
        elif any(w < 0 for w in width):
            problem = f"width {width} is negative"
        elif self.dtype.hasobject:
            problem = (f"dtype {self.dtype} holds Python object pointers (references) that cannot be sent; "
                       "use a numeric dtype")
        else:
            for i, (n, w) in enumerate(zip(local_shape, width)):
                if w > n:
                    problem = (f"halo width {w} in dimension {i} is wider than the local block "
                               f"({n} cells); use fewer ranks along it or a narrower halo")
                    break
        # A private transport (a duplicate communicator): halo tags cannot meet
        # the application's, and the agreement below runs off the user's comm.
        self._transport = cart.transport.dup()
        try:
            check_all(self._transport, problem, op)
        except CommError:
            self._transport.close()
            raise

        self.ndim = ndim
        self.local_shape = local_shape
        self.width = width
        self.corners = bool(corners)
        self.shape = tuple(n + 2 * w for n, w in zip(local_shape, width))
        # one tag per direction of travel (3**ndim offsets), and one for the
        # abort notice to non-neighbours, reserved once
        tag0 = self._transport.tags.slot(3 ** ndim + 1)
        self._notice_tag = tag0 + 3 ** ndim

        self.neighbours: list[_Neighbour] = []
        for off in itertools.product((-1, 0, 1), repeat=ndim):
            if not any(off):
                continue
            if not self.corners and sum(1 for o in off if o) != 1:
                continue
            if any(o and w == 0 for o, w in zip(off, width)):
                continue
            peer = cart.neighbor(off)
            if not 0 <= peer < cart.size:  # PROC_NULL: off a non-periodic edge
                continue
            nb = _Neighbour()
            nb.offset = off
            nb.rank = peer
            sub, s_start, r_start = [], [], []
            for o, n, w in zip(off, local_shape, width):
                if o == 0:
                    sub.append(n); s_start.append(w); r_start.append(w)
                elif o < 0:
                    sub.append(w); s_start.append(w); r_start.append(0)
                else:
                    sub.append(w); s_start.append(n); r_start.append(n + w)
            nb.send_type = Subarray(self.shape, sub, s_start, self.dtype)
            nb.recv_type = Subarray(self.shape, sub, r_start, self.dtype)
            nb.nbytes = int(np.prod(sub)) * self.dtype.itemsize
            # The tag names the direction of travel from the sender.
            nb.send_tag = tag0 + _direction_index(off)
            nb.recv_tag = tag0 + _direction_index(tuple(-o for o in off))
            self.neighbours.append(nb)
        near = {nb.rank for nb in self.neighbours} | {self.rank}
        self._far = [r for r in range(cart.size) if r not in near]  # get a notice when this rank aborts
        self._dcode = _dtype_code(self.dtype)
        self._broken = None  # why the plan cannot be used any more (an abort reached non-neighbours)
        self._tainted = False  # an abort happened: messages may still be unmatched (see free)
        self._calls = 0  # exchanges started (the same count on every rank: they run in lockstep)
        # abort notices for an exchange this rank has not started yet: the offender may be ahead by
        # up to its distance on the grid (each step waits only for the neighbours' messages)
        self._ahead: list = []

    # ---------------------------------------------------------------- helpers
    @property
    def interior(self) -> tuple[slice, ...]:
        """Index of the owned (non-ghost) cells in a field."""
        return tuple(slice(w, w + n) for n, w in zip(self.local_shape, self.width))

    def allocate(self, like=None, fill=0):
        """A zero (or ``fill``) field of the right shape and dtype; a device
        array when ``like`` is one (numba device array or CuPy)."""
        host = np.full(self.shape, fill, dtype=self.dtype)
        if like is None or not as_buffer(like).is_device:
            return host
        # the GPU modules are imported only when device fields are in use
        if as_buffer(like).kind in ("cupy", "cai"):
            import cupy  # noqa: PLC0415

            return cupy.asarray(host)
        from numba import cuda  # noqa: PLC0415

        return cuda.to_device(host)

    def _check_fields(self, fields, op):
        if not fields:
            raise InvalidArgument("no fields given", rank=self.rank, op=op)
        bufs, device = [], None
        for i, f in enumerate(fields):
            b = as_buffer(f, op=op, rank=self.rank)
            what = f"field {i}"
            if tuple(b.shape) != self.shape:
                raise InvalidArgument(f"{what} has shape {tuple(b.shape)}, expected {self.shape} "
                                      f"(local_shape {self.local_shape} + 2*width {self.width})",
                                      rank=self.rank, op=op)
            if b.dtype != self.dtype:
                raise InvalidArgument(f"{what} has dtype {b.dtype}, expected {self.dtype}", rank=self.rank, op=op)
            if not b.contiguous:
                raise InvalidArgument(f"{what} is not C-contiguous; pass numpy.ascontiguousarray(field)",
                                      rank=self.rank, op=op)
            if b.readonly:  # its ghost cells would be written into memory the caller marked read-only
                raise InvalidArgument(f"{what} is read-only (its ghost cells cannot be written); pass a "
                                      "writable array, e.g. numpy.array(field)", rank=self.rank, op=op)
            if device is None:
                device = b.is_device
            elif device != b.is_device:
                raise InvalidArgument("fields mix host and device arrays", rank=self.rank, op=op)
            bufs.append(b)
        return bufs, device

    def _plan_for(self, nfields: int, device: bool, like=None):
        """Message buffers, batched pack plans and persistent requests for
        ``nfields`` fields, built on first use and reused every step.

        All messages live in one buffer, sends first, then receives: neighbour
        ``k``'s message is a slice holding its region of field 0, then field 1,
        ...  Packing is one :class:`commlib.datatypes.batch.BatchPack` call for
        every neighbour and field together (one per direction), not one per
        piece.  A neighbour that is this rank itself (a periodic dimension of
        one rank) gets no message: its ghost cells are unpacked straight from
        the packed send slice of the opposite direction.  The requests are the
        private transport's persistent ones (``send_init``/``recv_init``) on
        that buffer: in device memory when MPI is CUDA-aware, else on a host
        copy it is staged through.
        """
        key = (nfields, device)
        got = self._buffers.get(key)
        if got is not None:
            return got
        me = self.rank
        tp = self._transport
        staged = device and not tp.cuda_aware
        # a message to or from another rank is [header][field 0's piece][field 1's]...;
        # a message to this rank itself has no header (it never goes on the wire)
        spieces, soffs, sspan = [], [], {}
        pos = 0
        for k, nb in enumerate(self.neighbours):
            start = pos
            if nb.rank != me:
                pos += _H
            sspan[nb.offset] = (start, pos + nb.nbytes * nfields)
            for i in range(nfields):
                spieces.append((i, nb.send_type))
                soffs.append(pos)
                pos += nb.nbytes
        send_total = pos
        rpieces, roffs, rspans = [], [], []
        for nb in self.neighbours:
            if nb.rank == me:  # read the packed message for the opposite direction
                a, b = sspan[tuple(-o for o in nb.offset)]
                base = b - nb.nbytes * nfields  # past that message's header, if it has one
                rspans.append(None)
            else:
                rspans.append((pos, pos + _H + nb.nbytes * nfields))
                base = pos + _H
                pos += _H + nb.nbytes * nfields
            for i in range(nfields):
                rpieces.append((i, nb.recv_type))
                roffs.append(base + i * nb.nbytes)
        total = max(pos, 1)
        wire = devmem.device_empty(total, like=like) if device else np.empty(total, np.uint8)
        host = devmem.pinned_empty(total) if staged else wire
        remote = [(nb, sspan[nb.offset], r) for nb, r in zip(self.neighbours, rspans) if nb.rank != me]
        # headers are written and read in host memory: the staging buffer, or
        # (CUDA-aware MPI on device memory) a pinned mirror of the wire
        hdr = devmem.pinned_empty(total) if device and not staged and remote else host
        # the headers of the messages this rank sends: the same every step
        for nb, (a, _), _ in remote:
            hdr[a:a + _H].view(np.int64)[:] = self._header(_OK, nfields, nb.nbytes * nfields)
        if device and remote:  # the device copy of the send area carries them too
            devmem.to_device_async(hdr, wire, 0, send_total)
            devmem.stream_synchronize()
        got = _Plan()
        got.packer, got.unpacker = BatchPack(spieces, soffs), BatchPack(rpieces, roffs)
        got.wire, got.host, got.send_total, got.staged = wire, host, send_total, staged
        got.halo = self
        got.sync = device and not staged  # the wire itself is device memory MPI reads
        got.transport = tp
        got.mark = devmem.StreamMark() if staged else None
        got.idle = not remote and not spieces  # no neighbour at all: nothing to do
        got.nfields = nfields
        # (neighbour, receive span): the headers read on arrival
        got.checks = [(nb, r) for nb, _, r in remote]
        got.readback = device and not staged  # CUDA-aware: headers arrive in device memory
        got.hdr = hdr
        got.sreqs = [tp.send_init(host[a:b], nb.rank, nb.send_tag) for nb, (a, b), _ in remote]
        got.rreqs = [tp.recv_init(host[a:b], nb.rank, nb.recv_tag) for nb, _, (a, b) in remote]
        got.reqs = got.rreqs + got.sreqs
        self._buffers[key] = got
        return got

    # -------------------------------------------------------------- exchange
    def _header(self, status: int, nfields: int, nbytes: int, reason: int = 0, origin: int | None = None):
        h = np.zeros(_H // 8, np.int64)
        h[:7] = (status, self.rank, nfields, self._dcode, nbytes, reason, self.rank if origin is None else origin)
        return h

    def start(self, *fields, timeout: float | None = None) -> "HaloRequest":
        """Begin filling the ghost cells of ``fields``; returns a request.

        Every field's edge cells are packed before ``start`` returns, so the
        caller may update interior cells right away (overlap); the ghost cells
        are written by ``HaloRequest.wait()``.  Messages are the private
        transport's persistent requests (``MPI_Send_init``/``MPI_Recv_init``),
        set up on first use.

        Args:
            *fields: arrays of shape ``self.shape`` and dtype ``self.dtype``,
                C-contiguous, all on the host or all on the device.

            timeout: seconds the abort path may wait (sending abort headers
                and draining the neighbours' messages) when this rank's fields
                are wrong (None: ``COMMLIB_TIMEOUT``); a finite number > 0.

        Raises:
            InvalidArgument: wrong shape, dtype, contiguity, a read-only field,
                mixed devices, or a ``timeout`` that is not None or a finite
                number of seconds > 0 (NaN, infinity, 0, negatives and bools
                are refused).
                The check is local; a rank that fails it sends its neighbours
                an abort header in place of its data (they raise in ``wait``,
                naming it) and a notice to every other rank (they raise when
                their next exchange starts), so no rank is left waiting.
                Also raised here when such a notice has arrived.
            CommError: the transport failed to start the messages
                (:class:`~commlib.ProcessFailed` when a peer is gone).
        """
        op = _EXCHANGE
        nfields = len(fields)
        if self._broken is not None:
            raise InvalidArgument(self._broken, rank=self.rank, op=op)
        step = self._calls
        self._calls += 1
        try:
            bad_timeout = timeout_problem(timeout)
            if bad_timeout is not None:
                timeout = None  # the abort path below waits COMMLIB_TIMEOUT instead
                raise InvalidArgument(bad_timeout, rank=self.rank, op=op)
            device = self._fast_check(fields, op)
        except InvalidArgument as exc:
            self._abort(nfields, _reason_of(exc.detail), self.rank, step, timeout)
            raise
        if self._far:
            notice = self._next_notice(step)
            if notice is not None:
                h = notice.view(np.int64)
                if int(h[_NBYTES]) == step:  # the offender's own exchange: the neighbours wait for this one
                    self._abort(nfields, int(h[_REASON]), int(h[_ORIGIN]), step, timeout, notify=False)
                # (an exchange after it: the neighbours stopped or get the notice too; post nothing)
                raise self._notice_error(notice)
        plan = self._plan_for(nfields, device, fields[0])
        if plan.idle:
            return HaloRequest(fields, plan, step)
        tp = plan.transport
        try:
            if plan.staged:
                plan.mark.wait()  # the last step's host-to-device copy has read the receive area
            tp.startall(plan.rreqs)
            plan.packer.pack(fields, plan.wire)
            if plan.staged:  # device -> pinned host on the current stream, then MPI
                devmem.to_host_async(plan.wire, plan.host, 0, plan.send_total)
                devmem.stream_synchronize()
            elif plan.sync:  # the pack kernels must finish before MPI reads the wire
                tp.synchronize(plan.wire)
            tp.startall(plan.sreqs)
        except CommError as exc:
            raise _as_raised_by(exc, op, self.rank) from exc
        return HaloRequest(fields, plan, step)

    def _next_notice(self, step: int):
        """An abort notice that concerns exchange ``step`` or an earlier one, or
        None.  A notice for a later exchange (its offender is ahead of this
        rank) is kept until that exchange: this one's neighbours still run it
        normally, so this rank must too, or they would wait for its messages."""
        ahead = self._ahead
        while (notice := self._transport.poll(self._notice_tag, _H)) is not None:
            ahead.append(notice)
            ahead.sort(key=lambda m: int(m.view(np.int64)[_NBYTES]))
        if ahead and int(ahead[0].view(np.int64)[_NBYTES]) <= step:
            return ahead.pop(0)
        return None

    def _fast_check(self, fields, op) -> bool:
        """Local per-call check (cheap for numpy); returns True for device fields."""
        if fields and all(type(f) is np.ndarray for f in fields):
            for i, f in enumerate(fields):
                if (f.shape != self.shape or f.dtype != self.dtype or not f.flags.c_contiguous
                        or not f.flags.writeable):
                    self._check_fields(fields, op)  # raises with the precise message
            return False
        return self._check_fields(fields, op)[1]

    def _notice_error(self, notice) -> InvalidArgument:
        self._taint(True)
        h = notice.view(np.int64)
        origin, sender, reason = int(h[_ORIGIN]), int(h[_SENDER]), int(h[_REASON])
        if reason == _MISMATCH:
            err = InvalidArgument(f"ranks {min(origin, sender)} and {max(origin, sender)} passed different fields "
                                  "to a halo exchange (number, dtype or size; seen by rank "
                                  f"{sender}); no ghost cell was written", rank=self.rank, op=_EXCHANGE)
            err.offenders = tuple(sorted({origin, sender}))
            return err
        if reason == _TOO_BIG:
            err = InvalidArgument(f"rank {origin} got a halo message larger than its plan's from a neighbour "
                                  "(another number of fields there?); no ghost cell was written",
                                  rank=self.rank, op=_EXCHANGE)
            err.offenders = (origin,)
            return err
        why = _REASONS.get(reason, "its fields were invalid")
        err = InvalidArgument(f"rank {origin} aborted a halo exchange ({why}); no ghost cell was written",
                              rank=self.rank, op=_EXCHANGE)
        err.offenders = (origin,)
        return err

    def _notify_far(self, step: int, reason: int, origin: int) -> None:
        """This rank found exchange ``step`` inconsistent although its own fields
        are fine (its neighbours' messages disagree with its plan): tell every
        rank that is not its neighbour, as an aborting rank does, so they raise
        too (at their next exchange, or in the wait of this one).  The plan is
        then unusable on every rank (see :meth:`_taint`).  Eager 64-byte sends;
        their wait is bounded by ``COMMLIB_TIMEOUT``."""
        self._taint(True)
        if not self._far:
            return
        head = self._header(_ABORT, 0, step, reason, origin)
        head[_FAR] = 1
        tp = self._transport
        try:
            tp.waitall([tp.isend(head, r, self._notice_tag) for r in self._far], config.timeout, op=_EXCHANGE)
        except CommError:
            self._broken = ("an earlier exchange was inconsistent and a notice could not be sent; "
                            "build a new HaloExchange")

    def _taint(self, far: bool) -> None:
        """An abort happened.  When it reached ranks that are not the offender's
        neighbours (``far``), ranks no longer agree on which exchange is which,
        so the plan refuses later calls; either way :meth:`free` keeps the
        private communicator (a message still in flight must not meet a new
        communicator that MPI gives the same context)."""
        self._tainted = True
        if far:
            self._broken = ("an earlier exchange was aborted by a rank that is not every rank's neighbour, so "
                            "the ranks no longer agree on which exchange is which; build a new HaloExchange")

    def _abort(self, nfields: int, reason: int, origin: int, step: int, timeout: float | None,
               notify: bool = True) -> None:
        """This rank will not exchange: send every neighbour an abort header in
        place of its message (and, when ``notify``, every other rank a notice
        carrying ``step``, the number of this exchange), receive and drop the
        neighbours' messages so their sends complete, all within ``timeout``
        seconds.  When that time passes first, the plan is marked unusable (a
        receive may still be posted)."""
        tp = self._transport
        remote = [nb for nb in self.neighbours if nb.rank != self.rank]
        self._taint(bool(self._far) or not notify)
        if not remote and not (notify and self._far):
            return
        head = self._header(_ABORT, nfields, step, reason, origin)  # an abort's byte count: the exchange number
        head[_FAR] = 1 if (self._far or not notify) else 0
        reqs, keep = [], [head]
        try:
            for nb in remote:  # large enough for a message of this many fields
                buf = np.empty(_H + nb.nbytes * max(nfields, 1), np.uint8)
                keep.append(buf)
                reqs.append(tp.irecv(buf, nb.rank, nb.recv_tag))
            for nb in remote:
                reqs.append(tp.isend(head, nb.rank, nb.send_tag))
            for r in (self._far if notify else ()):
                reqs.append(tp.isend(head, r, self._notice_tag))
            limit = config.timeout if timeout is None else timeout
            tp.waitall(reqs, limit, op=_EXCHANGE)
        except CommTimeout:
            self._broken = ("an earlier exchange was aborted and a neighbour never answered; "
                            "build a new HaloExchange")
        except CommError:  # a neighbour's larger message (MPI_ERR_TRUNCATE), a failed peer: still raise the abort
            pass

    def exchange(self, *fields, timeout: float | None = None) -> None:
        """Fill the ghost cells of ``fields`` (``start(*fields).wait(timeout)``).

        ``timeout`` is None (no limit) or a finite number of seconds > 0; any
        other value is refused by :meth:`start` as an invalid argument, on
        every rank (the abort path), with no ghost cell written."""
        self.start(*fields, timeout=timeout).wait(timeout)

    @property
    def mpi_comm(self):
        """The plan's private ``MPI.Comm`` (a duplicate of the Cartesian communicator),
        for interoperating with mpi4py code."""
        return self._transport.comm

    def revoke(self) -> None:
        """Revoke the plan's communicator (ULFM ``MPIX_Comm_revoke``), so ranks
        blocked in an exchange with a failed neighbour return with an error and
        can join the recovery.  A no-op where the MPI has no ULFM.  The plan
        cannot be used afterwards; build a new one on the shrunk communicator."""
        self._transport.revoke()

    def free(self) -> None:
        """Release the persistent requests and the plan's private communicator
        (idempotent).  After an aborted exchange both are kept until MPI is
        finalized instead: a message still in flight (an abort notice, a
        neighbour's data nobody received) must not be matched by a new
        communicator to which MPI hands the same context."""
        if self._freed:
            return
        self._freed = True
        if self._tainted:
            _KEPT.append((self._transport, self._buffers))
            self._buffers = {}
            return
        for plan in self._buffers.values():
            self._transport.free_requests(plan.reqs)
        self._buffers.clear()
        self._transport.close()


class _Plan:
    __slots__ = ("packer", "unpacker", "wire", "host", "send_total", "sreqs", "rreqs", "reqs", "staged", "sync",
                 "transport", "mark", "idle", "nfields", "checks", "readback", "halo", "hdr")

    def check_headers(self, step: int) -> None:
        """Read the header of every message received; raise naming the sender
        when one aborted or its message does not match this plan's (then every
        rank that is not this one's neighbour gets a notice for ``step``)."""
        host = self.hdr
        if self.readback:  # CUDA-aware: the headers are in device memory
            for _, (a, _b) in self.checks:
                devmem.to_host_async(self.wire, host, a, a + _H)
            devmem.stream_synchronize()
        # one clause per offender and reason, however many of its messages (directions) said it
        aborted, heard, unmatched, mismatch = {}, set(), {}, None  # (origin, why) -> relaying ranks; rank -> clauses
        for nb, (a, b) in self.checks:
            h = host[a:a + _H].view(np.int64)
            want = (_OK, nb.rank, self.nfields, self.halo._dcode, b - a - _H)
            got = tuple(int(x) for x in h[:5])
            if got == want:
                continue
            if got[_STATUS] == _ABORT:
                self.halo._taint(bool(h[_FAR]))
                origin = int(h[_ORIGIN])
                why = _REASONS.get(int(h[_REASON]), "its fields were invalid")
                relays = aborted.setdefault((origin, why), set())
                if origin != nb.rank:
                    relays.add(nb.rank)
                else:
                    heard.add(origin)
            else:
                if got[_STATUS] == _OK:
                    what = ", ".join(f"{name} {g} (here {w})" for name, g, w in
                                     zip(("sender", "fields", "dtype code", "bytes"), got[1:], want[1:]) if g != w)
                else:
                    what = "no valid header"
                unmatched.setdefault(nb.rank, {})[what] = None
                mismatch = nb.rank if mismatch is None else mismatch
            h[_STATUS] = 0  # a later short message cannot pass for this one
        # "told by": the offender is not this rank's neighbour, its abort came relayed
        bad = [(origin, f"rank {origin} aborted the exchange: {why}"
                + (f" (told by {_ranks(relays)})" if relays and origin not in heard else ""))
               for (origin, why), relays in aborted.items()]
        bad += [(r, f"rank {r}'s message does not match this plan: " + "; ".join(clauses))
                for r, clauses in unmatched.items()]
        if bad:
            err = InvalidArgument("; ".join(m for _, m in bad) + "; no ghost cell was written",
                                  rank=self.halo.rank, op=_EXCHANGE)
            err.offenders = tuple(sorted({r for r, _ in bad}))
            if mismatch is not None:
                self.halo._notify_far(step, _MISMATCH, mismatch)
            raise err


class HaloRequest(Request):
    """An exchange in flight; ``wait()`` writes the ghost cells."""

    def __init__(self, fields, plan: _Plan, step: int):
        self._fields, self._plan, self._step = fields, plan, step
        self._done = False

    def _unpack(self):
        plan = self._plan
        if plan.idle:
            self._done = True
            return
        if plan.checks:
            try:
                plan.check_headers(self._step)
            except InvalidArgument:
                self._done = True
                raise
        if plan.staged:  # pinned host -> device on the current stream, then the unpack kernel
            devmem.to_device_async(plan.host, plan.wire, plan.send_total, plan.host.shape[0])
            plan.mark.record()
        plan.unpacker.unpack(plan.wire, self._fields)
        self._done = True

    def test(self) -> bool:
        """True (and the ghost cells written) once every message has completed.

        Raises:
            CommError: a message failed (:class:`~commlib.ProcessFailed` when a
                peer is gone), naming the rank and ``HaloExchange.exchange``.
        """
        if self._done:
            return True
        try:
            if not all(r.test() for r in self._plan.reqs):
                return False
        except CommError as exc:
            raise _as_raised_by(exc, _EXCHANGE, self._plan.transport.rank) from exc
        self._unpack()
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Complete the exchange; ``timeout`` in seconds (None: no limit; 0:
        poll once, as :meth:`Request.wait`).

        Raises:
            InvalidArgument: ``timeout`` is NaN, infinite, negative, a bool or
                not a number (nothing is waited for; the exchange stays in
                flight and a later ``wait`` completes it).
            CommTimeout: when the neighbours' messages do not arrive in time.
            ProcessFailed: a neighbour failed (or the plan was revoked).
            CommError: any other failure of the transport.
        """
        if self._done:
            return
        plan = self._plan
        timeout = check_timeout(timeout, op=_EXCHANGE, rank=plan.halo.rank, zero=True)
        try:
            if plan.halo._far:
                self._wait_watching(timeout)
            else:
                plan.transport.waitall(plan.reqs, timeout, op=_EXCHANGE)
        except (ProcessFailed, CommTimeout):
            raise
        except CommError as exc:
            if "MPI_ERR_TRUNCATE" not in str(exc):
                raise
            self._done = True
            halo = self._plan.halo
            halo._notify_far(self._step, _TOO_BIG, halo.rank)
            raise InvalidArgument("a neighbour's message is larger than this plan's (does it pass another "
                                  "number of fields?); no ghost cell was written", rank=halo.rank,
                                  op=_EXCHANGE) from exc
        self._unpack()
        if self._callbacks:
            self._fire()


    def _wait_watching(self, timeout: float | None) -> None:
        """Wait in slices; while a neighbour is late, look for an abort notice
        from a rank that is not a neighbour (it may have stopped the
        neighbours this rank waits for)."""
        plan = self._plan
        tp, halo = plan.transport, plan.halo
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            step = _SLICE if left is None else max(0.0, min(_SLICE, left))
            try:
                tp.waitall(plan.reqs, step, op=_EXCHANGE)
                return
            except CommTimeout:
                notice = halo._next_notice(self._step)  # (one for a later exchange is kept for it)
                if notice is not None:
                    self._done = True
                    raise halo._notice_error(notice) from None
                if left is not None and left <= _SLICE:
                    raise CommTimeout(f"{len(plan.reqs)} request(s) not complete after {timeout:.3g} s "
                                      "(peer dead or stalled?)", rank=halo.rank, op=_EXCHANGE) from None


_KEPT: list = []  # the transports and plans of aborted exchanges (see HaloExchange.free)
_SLICE = 0.05  # seconds a wait runs before looking for an abort notice


def _ranks(ranks) -> str:
    """``"rank 3"``, ``"ranks 1, 3"``."""
    rs = sorted(ranks)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _as_raised_by(exc: CommError, op: str, rank: int) -> CommError:
    """``exc`` (from a transport step such as ``startall``) as an error of the
    call ``op``, keeping its class (and a :class:`ProcessFailed`'s ranks)."""
    if exc.op == op:
        return exc
    msg = f"{exc.op}: {exc.detail}" if exc.op else exc.detail
    rank = exc.rank if exc.rank is not None else rank
    try:
        if isinstance(exc, ProcessFailed):
            return type(exc)(msg, failed=exc.failed, rank=rank, op=op)
        return type(exc)(msg, rank=rank, op=op)
    except TypeError:  # a subclass with another signature
        return CommError(msg, rank=rank, op=op)


def _direction_index(offset) -> int:
    idx = 0
    for o in offset:
        idx = idx * 3 + (o + 1)
    return idx
