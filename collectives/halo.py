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
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from commlib.core import devmem
from commlib.core.buffer import as_buffer
from commlib.core.errors import CommError, InvalidArgument, ProcessFailed
from commlib.datatypes import Subarray
from commlib.datatypes.batch import BatchPack
from commlib.transports.base import Request

from .agreement import check_all

__all__ = ["HaloExchange", "HaloRequest"]

_EXCHANGE = "HaloExchange.exchange"


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
        # one tag per direction of travel (3**ndim offsets), reserved once
        tag0 = self._transport.tags.slot(3 ** ndim)

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
        self._validated: set = set()

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
        spieces, soffs, sspan = [], [], {}
        pos = 0
        for k, nb in enumerate(self.neighbours):
            sspan[nb.offset] = (pos, pos + nb.nbytes * nfields)
            for i in range(nfields):
                spieces.append((i, nb.send_type))
                soffs.append(pos)
                pos += nb.nbytes
        send_total = pos
        rpieces, roffs, rspans = [], [], []
        for nb in self.neighbours:
            if nb.rank == me:  # read the packed message for the opposite direction
                base = sspan[tuple(-o for o in nb.offset)][0]
                rspans.append(None)
            else:
                base = pos
                rspans.append((pos, pos + nb.nbytes * nfields))
                pos += nb.nbytes * nfields
            for i in range(nfields):
                rpieces.append((i, nb.recv_type))
                roffs.append(base + i * nb.nbytes)
        total = max(pos, 1)
        wire = devmem.device_empty(total, like=like) if device else np.empty(total, np.uint8)
        host = devmem.pinned_empty(total) if staged else wire
        remote = [(nb, sspan[nb.offset], r) for nb, r in zip(self.neighbours, rspans) if nb.rank != me]
        got = _Plan()
        got.packer, got.unpacker = BatchPack(spieces, soffs), BatchPack(rpieces, roffs)
        got.wire, got.host, got.send_total, got.staged = wire, host, send_total, staged
        got.sync = device and not staged  # the wire itself is device memory MPI reads
        got.transport = tp
        got.mark = devmem.StreamMark() if staged else None
        got.idle = not remote and not spieces  # no neighbour at all: nothing to do
        got.sreqs = [tp.send_init(host[a:b], nb.rank, nb.send_tag) for nb, (a, b), _ in remote]
        got.rreqs = [tp.recv_init(host[a:b], nb.rank, nb.recv_tag) for nb, _, (a, b) in remote]
        got.reqs = got.rreqs + got.sreqs
        self._buffers[key] = got
        return got

    # -------------------------------------------------------------- exchange
    def start(self, *fields) -> "HaloRequest":
        """Begin filling the ghost cells of ``fields``; returns a request.

        Every field's edge cells are packed before ``start`` returns, so the
        caller may update interior cells right away (overlap); the ghost cells
        are written by ``HaloRequest.wait()``.  Messages are the private
        transport's persistent requests (``MPI_Send_init``/``MPI_Recv_init``),
        set up on first use.

        Args:
            *fields: arrays of shape ``self.shape`` and dtype ``self.dtype``,
                C-contiguous, all on the host or all on the device.

        Raises:
            InvalidArgument: wrong shape, dtype, contiguity, or mixed devices.
                Until a call with this many fields has succeeded, the check is
                made on every rank together, so a rank with a wrong field
                cannot leave the others waiting; later calls check locally.
            CommError: the transport failed to start the messages
                (:class:`~commlib.ProcessFailed` when a peer is gone).
        """
        op = _EXCHANGE
        nfields = len(fields)
        first = nfields not in self._validated
        problem = None
        try:
            device = self._fast_check(fields, op)
        except InvalidArgument as exc:
            if not first:
                raise
            problem = exc.detail
        if first:
            check_all(self._transport, problem, op)
            self._validated.add(nfields)
        plan = self._plan_for(nfields, device, fields[0])
        if plan.idle:
            return HaloRequest(fields, plan)
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
        return HaloRequest(fields, plan)

    def _fast_check(self, fields, op) -> bool:
        """Local per-call check (cheap for numpy); returns True for device fields."""
        if fields and all(type(f) is np.ndarray for f in fields):
            for i, f in enumerate(fields):
                if f.shape != self.shape or f.dtype != self.dtype or not f.flags.c_contiguous:
                    self._check_fields(fields, op)  # raises with the precise message
            return False
        return self._check_fields(fields, op)[1]

    def exchange(self, *fields, timeout: float | None = None) -> None:
        """Fill the ghost cells of ``fields`` (``start(*fields).wait(timeout)``)."""
        self.start(*fields).wait(timeout)

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
        (idempotent)."""
        if self._freed:
            return
        self._freed = True
        for plan in self._buffers.values():
            self._transport.free_requests(plan.reqs)
        self._buffers.clear()
        self._transport.close()


class _Plan:
    __slots__ = ("packer", "unpacker", "wire", "host", "send_total", "sreqs", "rreqs", "reqs", "staged", "sync",
                 "transport", "mark", "idle")


class HaloRequest(Request):
    """An exchange in flight; ``wait()`` writes the ghost cells."""

    def __init__(self, fields, plan: _Plan):
        self._fields, self._plan = fields, plan
        self._done = False

    def _unpack(self):
        plan = self._plan
        if plan.idle:
            self._done = True
            return
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
        """Complete the exchange; ``timeout`` in seconds (None: no limit).

        Raises:
            CommTimeout: when the neighbours' messages do not arrive in time.
            ProcessFailed: a neighbour failed (or the plan was revoked).
            CommError: any other failure of the transport.
        """
        if self._done:
            return
        self._plan.transport.waitall(self._plan.reqs, timeout, op=_EXCHANGE)
        self._unpack()
        if self._callbacks:
            self._fire()


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
