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
"""
from __future__ import annotations

import functools
import itertools
from typing import Sequence

import numpy as np

from commlib.core.buffer import as_buffer
from commlib.core.errors import InvalidArgument
from commlib.validate import check_all as _agree
from commlib.transports.base import Request
from commlib.transports.mpi import MPITransport

__all__ = ["HaloExchange", "HaloRequest"]



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

    Construction is collective over ``cart`` (it validates the geometry on every
    rank together and duplicates the communicator so halo tags never collide
    with the application's messages).

    Raises:
        InvalidArgument: on every rank alike, naming the offending rank(s), when
            a halo is wider than a local block, ``local_shape`` or ``width`` has
            the wrong length or a negative entry.
    """

    def __init__(self, cart, local_shape: Sequence[int], width: int | Sequence[int] = 1,
                 corners: bool = True, dtype=np.float64):
        from mpi4py import MPI  # noqa: PLC0415

        from commlib.datatypes import Subarray  # noqa: PLC0415

        op = "HaloExchange"
        self.cart = cart
        self.rank = cart.rank
        self.dtype = np.dtype(dtype)
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
        _agree(cart, problem, op)

        self.ndim = ndim
        self.local_shape = local_shape
        self.width = width
        self.corners = bool(corners)
        self.shape = tuple(n + 2 * w for n, w in zip(local_shape, width))
        # A private communicator: halo tags cannot meet the application's.
        self._transport = MPITransport(cart.mpi_comm.Dup(), cuda_aware=cart.cuda_aware)

        self.neighbours: list[_Neighbour] = []
        for off in itertools.product((-1, 0, 1), repeat=ndim):
            if not any(off):
                continue
            if not self.corners and sum(1 for o in off if o) != 1:
                continue
            if any(o and w == 0 for o, w in zip(off, width)):
                continue
            peer = cart.neighbor(off)
            if peer == MPI.PROC_NULL:
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
            nb.send_tag = _direction_index(off)
            nb.recv_tag = _direction_index(tuple(-o for o in off))
            self.neighbours.append(nb)
        self._buffers: dict = {}
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
        if type(like).__module__.startswith("cupy"):
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

    def _plan_for(self, nfields: int, device: bool):
        """Message buffers, batched pack plans and persistent MPI requests for
        ``nfields`` fields, built on first use and reused every step.

        All messages live in one buffer, sends first, then receives: neighbour
        ``k``'s message is a slice holding its region of field 0, then field 1,
        ...  Packing is one :class:`commlib.datatypes.batch.BatchPack` call for
        every neighbour and field together (one per direction), not one per
        piece.  A neighbour that is this rank itself (a periodic dimension of
        one rank) gets no message: its ghost cells are unpacked straight from
        the packed send slice of the opposite direction.
        """
        key = (nfields, device)
        got = self._buffers.get(key)
        if got is not None:
            return got
        from commlib.datatypes.batch import BatchPack  # noqa: PLC0415

        me = self.rank
        staged = device and not self._transport.cuda_aware
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
        if device:
            from numba import cuda  # noqa: PLC0415

            wire = cuda.device_array(total, np.uint8)
        else:
            wire = np.empty(total, np.uint8)
        host = np.empty(total, np.uint8) if staged else wire
        remote = [(nb, sspan[nb.offset], r) for nb, r in zip(self.neighbours, rspans) if nb.rank != me]
        got = _Plan()
        got.packer, got.unpacker = BatchPack(spieces, soffs), BatchPack(rpieces, roffs)
        got.wire, got.host, got.send_total, got.staged = wire, host, send_total, staged
        got.sreqs = [self._transport.send_init(host[a:b], nb.rank, nb.send_tag) for nb, (a, b), _ in remote]
        got.rreqs = [self._transport.recv_init(host[a:b], nb.rank, nb.recv_tag) for nb, _, (a, b) in remote]
        self._buffers[key] = got
        return got

    # -------------------------------------------------------------- exchange
    def start(self, *fields) -> "HaloRequest":
        """Begin filling the ghost cells of ``fields``; returns a request.

        Every field's edge cells are packed before ``start`` returns, so the
        caller may update interior cells right away (overlap); the ghost cells
        are written by ``HaloRequest.wait()``.  Messages use persistent MPI
        requests (``MPI_Send_init``/``MPI_Recv_init``) set up on first use.

        Args:
            *fields: arrays of shape ``self.shape`` and dtype ``self.dtype``,
                C-contiguous, all on the host or all on the device.

        Raises:
            InvalidArgument: wrong shape, dtype, contiguity, or mixed devices.
                The first call with a given set of field shapes checks on every
                rank together, so a rank with a wrong field cannot leave the
                others waiting; later calls check locally.
        """
        op = "HaloExchange.exchange"
        sig = tuple((getattr(f, "shape", None), getattr(f, "dtype", None)) for f in fields)
        if sig not in self._validated:
            try:
                self._check_fields(fields, op)
                problem = None
            except InvalidArgument as exc:
                problem = exc.detail
            _agree(self.cart, problem, op)
            self._validated.add(sig)
        device = self._fast_check(fields, op)
        plan = self._plan_for(len(fields), device)
        if plan.rreqs:
            _MPI().Prequest.Startall(plan.rreqs)
        plan.packer.pack(fields, plan.wire)
        if plan.staged:
            n = plan.send_total
            plan.wire[:n].copy_to_host(plan.host[:n])
        if plan.sreqs:
            _MPI().Prequest.Startall(plan.sreqs)
        return HaloRequest(fields, plan)

    def _fast_check(self, fields, op) -> bool:
        """Local per-call check (cheap for numpy); returns True for device fields."""
        if all(type(f) is np.ndarray for f in fields):
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
        """The plan's private ``MPI.Comm`` (a duplicate of the Cartesian communicator)."""
        return self._transport.comm

    def revoke(self) -> None:
        """Revoke the plan's communicator (ULFM ``MPIX_Comm_revoke``), so ranks
        blocked in an exchange with a failed neighbour return with an error and
        can join the recovery.  A no-op where the MPI has no ULFM.  The plan
        cannot be used afterwards; build a new one on the shrunk communicator."""
        try:
            self._transport.comm.Revoke()
        except (NotImplementedError, Exception):  # noqa: BLE001 - no ULFM, or already revoked
            pass

    def free(self) -> None:
        """Release the persistent requests and the plan's private communicator."""
        for plan in self._buffers.values():
            for r in plan.sreqs + plan.rreqs:
                r.Free()
        self._buffers.clear()
        self._transport.close()


class _Plan:
    __slots__ = ("packer", "unpacker", "wire", "host", "send_total", "sreqs", "rreqs", "staged")


class HaloRequest(Request):
    """An exchange in flight; ``wait()`` writes the ghost cells."""

    def __init__(self, fields, plan: _Plan):
        self._fields, self._plan = fields, plan
        self._reqs = plan.rreqs + plan.sreqs
        self._done = False

    def _unpack(self):
        plan = self._plan
        if plan.staged:
            n = plan.send_total
            plan.wire[n:].copy_to_device(plan.host[n:])
        plan.unpacker.unpack(plan.wire, self._fields)
        self._done = True

    def test(self) -> bool:
        if self._done:
            return True
        if _MPI().Request.Testall(self._reqs):
            self._unpack()
            return True
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Complete the exchange; ``timeout`` in seconds (None: no limit).

        Raises:
            CommTimeout: when the neighbours' messages do not arrive in time.
        """
        if self._done:
            return
        if timeout is None:
            _MPI().Request.Waitall(self._reqs)
            self._unpack()
        else:
            Request.wait(self, timeout)


@functools.lru_cache(maxsize=None)
def _MPI():  # noqa: N802
    from mpi4py import MPI  # noqa: PLC0415

    return MPI


def _direction_index(offset) -> int:
    idx = 0
    for o in offset:
        idx = idx * 3 + (o + 1)
    return idx
