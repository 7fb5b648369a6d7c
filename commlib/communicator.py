"""The user-facing communicator.

:func:`commlib.init` returns a :class:`Communicator` over ``MPI.COMM_WORLD``
through the MPI transport (:mod:`commlib.transports.mpi`).  Point-to-point
calls take arrays (numpy, CuPy, numba device arrays, DLPack); device arrays go
to MPI directly when it is CUDA-aware and are staged through host memory
otherwise.  :meth:`Communicator.cart_create` builds a Cartesian communicator
(MPI-4.0 §8.5) for halo exchanges.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
from mpi4py import MPI

from commlib.collective_api import CollectiveMixin
from commlib.collectives.agreement import agree_header, check_all
from commlib.collectives.barrier import barrier_dissemination
from commlib.collectives.ft import ON_FAILURE, FaultTolerance
from commlib.transports.mpi_process import IDLE_FINALIZE_BOUND, PROCESS, check_slurm_singleton, ft_mode
from commlib.core.config import config
from commlib.core.errors import CommTimeout, InvalidArgument, ProcessFailed
from commlib.core.seconds import check_timeout, timeout_problem
from commlib.core.tags import check_user_tag
from commlib.transports.base import Request, wait_all
from commlib.transports.mpi import MPIRequest, MPITransport, dims_create
from commlib.typed_p2p import MPITypes, fast_p2p, typed_irecv, typed_isend, typed_recv, typed_send, typed_sendrecv

__all__ = ["Communicator", "CartCommunicator", "init", "compute_dims", "PROC_NULL", "ANY_SOURCE", "ANY_TAG"]

#: the null rank (MPI's ``MPI_PROC_NULL``): a send to it or a receive from it completes at once
PROC_NULL = MPI.PROC_NULL
#: a receive's ``source`` that matches a message from any rank (``MPI_ANY_SOURCE``)
ANY_SOURCE = MPI.ANY_SOURCE
#: a receive's ``tag`` that matches any tag (``MPI_ANY_TAG``)
ANY_TAG = MPI.ANY_TAG


class Communicator(CollectiveMixin):
    """A group of ranks that exchange arrays.

    Args:
        comm: the mpi4py communicator to wrap (default ``MPI.COMM_WORLD``). It is
            not duplicated: use :meth:`dup` for an isolated tag space.
        cuda_aware: force CUDA-awareness on or off (None: detect, see
            :func:`commlib.core.device.cuda_aware`).

    Attributes:
        transport: the point-to-point transport collectives run on (see also
            :attr:`mpi_comm`, the underlying ``MPI.Comm``).
    """

    def __init__(self, comm: MPI.Comm | None = None, *, cuda_aware: bool | None = None,
                 transport: MPITransport | None = None):
        if transport is None:
            transport = MPITransport(MPI.COMM_WORLD if comm is None else comm, cuda_aware=cuda_aware)
        self.transport = transport
        self._coll_tp = None
        self._ft = None
        self._strategy_memo: dict = {}
        self._typed_plans: dict = {}  # typed point to point's cached host plans (commlib.typed_p2p)
        self._typed_last: tuple = ({}, {})  # its last blocking send / receive per peer (typed_p2p.fast_p2p)
        self._worker = None
        self._mpi_types = MPITypes()

    @property
    def mpi_comm(self) -> MPI.Comm:
        """The underlying ``MPI.Comm``, for interoperating with mpi4py code."""
        return self.transport.comm

    # ------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank in ``[0, size)``."""
        return self.transport.rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.transport.size

    @property
    def cuda_aware(self) -> bool:
        """True when device buffers go to MPI without host staging."""
        return self.transport.cuda_aware

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} size={self.size}>"

    # --------------------------------------------------------- point to point
    def send(self, buf, dest: int, tag: int = 0, *, datatype=None, count: int = 1,
             timeout: float | None = None) -> None:
        """Blocking send.

        Args:
            buf: array (host or device), contiguous in memory. Without
                ``datatype`` all its bytes are sent; with it, ``count`` elements
                of ``datatype`` laid over its bytes (first byte = displacement 0).
            dest: destination rank, or ``PROC_NULL``.
            tag: message tag (>= 0).
            datatype: a commlib datatype (``commlib.datatypes``) or a committed
                ``MPI.Datatype`` describing non-contiguous data; the strategy
                model picks MPI's datatype engine or commlib's pack kernels
                (on the device for device arrays), see
                :mod:`commlib.datatypes.strategy`.
            count: number of ``datatype`` elements.
            timeout: seconds the whole call may take (finite, > 0), or None:
                the communicator's :attr:`p2p_timeout` (no bound unless it is
                fault tolerant).

        Raises:
            InvalidArgument: ``dest`` out of range, negative tag, or a bad
                ``timeout``.
            BufferError: unsupported or non-contiguous buffer.
            CommTimeout: the timeout passed (the send stays posted: keep
                ``buf`` unchanged).
            DatatypeError: ``count`` elements of ``datatype`` do not fit ``buf``,
                or the datatype is unusable; nothing is sent.
        """
        if not (type(tag) is int and 0 <= tag <= self.transport.tag_ub and type(dest) is int):
            self._check_tag(tag, "send", peer=dest)  # the common case passes without a call (the typed hot path)
        if datatype is not None and timeout is None and fast_p2p(self, 0, buf, dest, datatype, count, tag):
            return  # the same typed send as the last one to dest
        if datatype is not None:  # typed_send takes p2p_timeout for None
            typed_send(self, buf, dest, datatype, count, tag,
                       timeout=None if timeout is None else self._call_timeout(timeout, "send"))
            return
        timeout = self._call_timeout(timeout, "send")
        self.transport.send(buf, dest, tag, timeout=timeout)

    def recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG, *, datatype=None, count: int = 1,
             timeout: float | None = None):
        """Blocking receive into ``buf`` (all its bytes, or ``count`` elements of
        ``datatype`` as in :meth:`send`); ``timeout`` as :meth:`send`'s (a receive
        that runs out of it is withdrawn: nothing is written into ``buf`` later).

        Returns:
            MPI.Status (without ``datatype``): source, tag and byte count.
        """
        if not (type(tag) is int and 0 <= tag <= self.transport.tag_ub and type(source) is int):
            self._check_tag(tag, "recv", anywild=True, peer=source)
        if datatype is not None and timeout is None and fast_p2p(self, 1, buf, source, datatype, count, tag):
            return None  # the same typed receive as the last one from source
        if datatype is not None:  # typed_recv takes p2p_timeout for None
            typed_recv(self, buf, source, datatype, count, tag,
                       timeout=None if timeout is None else self._call_timeout(timeout, "recv"))
            return None
        timeout = self._call_timeout(timeout, "recv")
        return self.transport.recv(buf, source, tag, timeout=timeout)

    def isend(self, buf, dest: int, tag: int = 0, *, datatype=None, count: int = 1) -> Request:
        """Non-blocking send (arguments as :meth:`send`); do not modify ``buf``
        until the request completes.

        Returns:
            Request: ``wait(timeout=None)`` / ``test()``.
        """
        self._check_tag(tag, "isend", peer=dest)
        if datatype is not None:
            req = typed_isend(self, buf, dest, datatype, count, tag)
        else:
            req = self.transport.isend(buf, dest, tag)
        return req if self._ft is None else self._bound(req)

    def irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG, *, datatype=None, count: int = 1) -> Request:
        """Non-blocking receive (arguments as :meth:`recv`); ``buf`` holds the data
        after the request completes."""
        self._check_tag(tag, "irecv", anywild=True, peer=source)
        if datatype is not None:
            req = typed_irecv(self, buf, source, datatype, count, tag)
        else:
            req = self.transport.irecv(buf, source, tag)
        return req if self._ft is None else self._bound(req)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int = ANY_SOURCE, sendtag: int = 0,
                 recvtag: int = ANY_TAG, *, sendtype=None, sendcount: int = 1, recvtype=None,
                 recvcount: int = 1, timeout: float | None = None) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source`` (no deadlock).
        ``sendtype``/``recvtype`` with their counts describe non-contiguous data as in :meth:`send`;
        ``timeout`` as :meth:`send`'s, for both halves together."""
        self._check_tag(sendtag, "sendrecv", peer=dest)
        self._check_tag(recvtag, "sendrecv", anywild=True, peer=source)
        timeout = self._call_timeout(timeout, "sendrecv")
        if sendtype is None and recvtype is None:
            self.transport.sendrecv(sendbuf, dest, recvbuf, source, sendtag, recvtag, timeout=timeout)
            return
        typed_sendrecv(self, sendbuf, dest, recvbuf, source, sendtag, recvtag, sendtype, sendcount, recvtype,
                       recvcount, timeout=timeout)

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Wait for every request; ``timeout`` in seconds for all of them together.

        ``timeout`` is None (no bound) or a finite number of seconds >= 0 (0
        tests once: a poll).

        Raises:
            InvalidArgument: ``timeout`` is NaN, infinite, negative, a bool or
                not a number (nothing is waited for; the requests stay valid).
            CommTimeout: ``timeout`` passed first.
            ProcessFailed, CommError: a request failed (classified, naming the rank).
        """
        timeout = check_timeout(timeout, op="waitall", rank=self.rank, zero=True)
        if all(isinstance(r, MPIRequest) for r in requests):
            # point to point: a fault-tolerant communicator's bound when none is given
            self.transport.waitall(requests, self.p2p_timeout if timeout is None else timeout)
        else:
            # collectives' requests among them: each request's own wait (a fault-tolerant
            # collective may take longer than the timeout when it recovers and retries;
            # this communicator's point-to-point requests carry their bound themselves)
            wait_all(requests, timeout)

    # ----------------------------------------------------------- management
    def dup(self) -> "Communicator":
        """A new communicator over the same group with its own tag space (collective).

        A fault-tolerant communicator's duplicate is fault tolerant too (same
        mode, ``on_failure`` and ``timeout``; its own failure callbacks) and is
        made with ``MPI_Comm_idup`` waited for at most the timeout, its
        collectives' transport with it.

        Raises:
            CommTimeout: fault-tolerant, and the peers did not call ``dup``
                within the timeout.  This communicator stays usable for
                point-to-point traffic; the duplication stays posted (MPI
                cannot withdraw it), and this rank's next ``dup`` (or first
                collective on a communicator derived from it) completes it
                when the peers call ``dup``, so call ``dup`` again before any
                other collective.
            ProcessFailed: fault-tolerant, and a peer died (ULFM).
        """
        if self._ft is None:
            return Communicator(transport=self.transport.dup())
        user, coll = self.transport.idup(self._ft.timeout, n=2, op="dup")
        return self._fault_tolerant_child(Communicator, user, coll, "dup")

    def split(self, color: int, key: int = 0) -> "Communicator":
        """Split into sub-communicators by ``color`` (``MPI_Comm_split``, collective).

        A fault-tolerant communicator first runs its (bounded) barrier, so a
        rank whose peers do not call ``split`` gets :class:`~commlib.CommTimeout`
        instead of waiting in ``MPI_Comm_split``; the parts are fault tolerant
        as in :meth:`dup`.
        """
        if self._ft is None:
            return Communicator(transport=self.transport.split(color, key))
        try:
            self.barrier()  # every rank is here (bounded), before the unbounded MPI_Comm_split
        except CommTimeout as exc:
            raise CommTimeout(f"the peers did not call split ({exc.detail})", rank=self.rank, op="split") from exc
        return self._fault_tolerant_child(Communicator, self.transport.split(color, key), None, "split")

    def create_group(self, ranks: Sequence[int], tag: int = 0) -> "Communicator":
        """A communicator over ``ranks`` of this one (``MPI_Comm_create_group``,
        MPI-3.0 §6.4.2), collective over those ranks only: ranks outside the
        group do not call it (what ``torch.distributed.new_group`` needs).

        Args:
            ranks: distinct ranks of this communicator, the same list on every
                member; ``ranks[i]`` becomes rank ``i`` of the new communicator.
            tag: tells apart groups created concurrently from the same
                communicator (``>= 0``).

        A fault-tolerant communicator's group is fault tolerant too, as in
        :meth:`dup`.

        Raises:
            InvalidArgument: ``ranks`` empty, repeated, out of range, or without
                this rank (raised on this rank before anything moves).
        """
        rs = [int(r) for r in ranks]
        if (not rs or len(set(rs)) != len(rs) or any(not 0 <= r < self.size for r in rs)
                or self.rank not in rs or not (type(tag) is int and tag >= 0)):
            raise InvalidArgument(f"create_group needs distinct ranks of [0, {self.size}) holding rank {self.rank} "
                                  f"and a tag >= 0, got ranks={list(ranks)} tag={tag!r}", rank=self.rank,
                                  op="create_group")
        tp = self.transport.create_group(rs, tag)
        if self._ft is None:
            return Communicator(transport=tp)
        return self._fault_tolerant_child(Communicator, tp, None, "create_group")

    def _fault_tolerant_child(self, cls, user, coll, op):
        """A fault-tolerant communicator of class ``cls`` over transport ``user``
        (made by a collective call of every rank of this fault-tolerant one),
        with ``coll`` as its collectives' transport (None: an idup of ``user`` now,
        bounded by the timeout, while every rank is in that call)."""
        ft = self._ft
        user.set_errors_return()
        user.fault_tolerant = True
        if coll is None:
            coll = user.idup(ft.timeout, op=op)[0]
        coll.fault_tolerant = True
        c = cls(transport=user)
        c._coll_tp = coll
        c._ft = FaultTolerance(ft.mode, on_failure=ft.on_failure, timeout=ft.timeout, process=ft.process)
        return c

    def free(self) -> None:
        """Free the underlying communicator (not for ``COMM_WORLD``) and the
        MPI datatypes committed for its typed sends."""
        self._mpi_types.free()
        if self._coll_tp is not None:
            self._coll_tp.close()
            self._coll_tp = None
        self.transport.close()

    def cart_create(self, dims: Sequence[int] | int | None = None, periods: Sequence[bool] | bool = False,
                    reorder: bool = False, ndims: int | None = None) -> "CartCommunicator":
        """Create a Cartesian communicator (MPI-4.0 §8.5.1); collective.

        Args:
            dims: ranks per dimension (ints >= 0); entries of 0 (or ``dims=None``
                with ``ndims``) are filled by ``MPI.Compute_dims``. The product must
                equal ``size``. An int means that many dimensions, all free.
            periods: per-dimension periodicity (one bool applies to every dimension).
            reorder: let MPI renumber ranks.
            ndims: number of dimensions when ``dims`` is None (default: the
                length of ``periods`` if it is a sequence, else 1).

        Every rank must describe the same grid: after each rank's arguments are
        checked, the ranks compare the completed dims, the periods and
        ``reorder`` (one all-gather of a fixed-size header) before
        ``MPI_Cart_create`` is called.  On a fault-tolerant communicator that
        all-gather's waits are bounded by its timeout (``CommTimeout`` when the
        peers do not call), and the grid is fault tolerant as in :meth:`dup`.

        Returns:
            CartCommunicator

        Raises:
            InvalidArgument: on every rank alike, naming the offending rank or
                the differing fields, before ``MPI_Cart_create`` runs: dims that
                are not ints >= 0, whose product is not ``size``, mismatched
                lengths, periods or reorder that are not bools, or arguments
                that differ between ranks.
        """
        op = "cart_create"
        problem, grid = None, None
        try:
            grid = self._cart_args(dims, periods, reorder, ndims)
        except InvalidArgument as exc:
            problem = exc
        values = _cart_header(*grid) if grid is not None else [0] * len(_CART_FIELDS)
        n = len(grid[0]) if grid is not None else 0
        ft = self._ft  # fault tolerant: the agreement's waits bounded (it is a barrier too)
        agree_header(self.transport if ft is None else self.collective_transport(op), values, op=op,
                     local_error=problem, names=_CART_FIELDS, describe=lambda name, v: _cart_describe(name, v, n),
                     timeout=None if ft is None else ft.timeout)
        dims, periods, reorder = grid
        if self._ft is None:
            return CartCommunicator(transport=self.transport.create_cart(dims, periods, reorder))
        return self._fault_tolerant_child(CartCommunicator, self.transport.create_cart(dims, periods, reorder),
                                          None, op)

    def _cart_args(self, dims, periods, reorder, ndims) -> tuple[list, list, bool]:
        """This rank's :meth:`cart_create` arguments as ``(dims, periods, reorder)``,
        dims completed; raises :class:`InvalidArgument` (this rank's alone)."""
        op, rank = "cart_create", self.rank

        def bad(msg):
            return InvalidArgument(msg, rank=rank, op=op)

        def listed(value, what: str, form: str) -> list:
            if not isinstance(value, (str, bytes)):
                try:
                    return list(value)
                except TypeError:
                    pass
            raise bad(f"{what} {value!r} must be {form}")

        if _is_int(dims):
            ndims, dims = int(dims), None
        if dims is None:
            if ndims is None:
                ndims = len(periods) if isinstance(periods, (list, tuple)) else 1
            if not _is_int(ndims) or ndims < 0:
                raise bad(f"ndims {ndims!r} must be an int >= 0")
            dims = [0] * int(ndims)
        dims = listed(dims, "dims", "a sequence of ints, or an int")
        if not all(_is_int(d) for d in dims):
            raise bad(f"dims {dims!r} must hold ints (>= 0; 0: free)")
        dims = [int(d) for d in dims]
        if any(d < 0 for d in dims):
            raise bad(f"dims {dims} has a negative entry")
        fixed = 1
        for d in dims:
            fixed *= d if d else 1
        if self.size % fixed:
            raise bad(f"dims {dims} cannot be completed for {self.size} ranks")
        try:
            dims = list(compute_dims(self.size, dims))
        except InvalidArgument as exc:
            raise bad(exc.detail) from None
        prod = 1
        for d in dims:
            prod *= d
        if prod != self.size:
            raise bad(f"dims {dims} multiply to {prod}, not comm size {self.size}")
        if _is_flag(periods):
            periods = [bool(periods)] * len(dims)
        else:
            periods = listed(periods, "periods", "a bool or a sequence of bools")
            if not all(_is_flag(p) for p in periods):
                raise bad(f"periods {periods!r} must hold bools")
            periods = [bool(p) for p in periods]
        if len(periods) != len(dims):
            raise bad(f"periods has {len(periods)} entries, dims {len(dims)}")
        if not _is_flag(reorder):
            raise bad(f"reorder {reorder!r} must be a bool")
        return dims, periods, bool(reorder)

    # ------------------------------------------------------ group facts
    @property
    def world_ranks(self) -> tuple[int, ...]:
        """The ``COMM_WORLD`` rank of each member, in this communicator's rank order."""
        return self.transport.world_ranks()

    def revoke(self) -> None:
        """Interrupt every pending and later operation on this communicator on
        every rank (ULFM ``MPIX_Comm_revoke``), so that ranks blocked on a dead
        peer return with :class:`~commlib.ProcessFailed` and can join recovery.
        A no-op where the MPI library has no ULFM."""
        self.transport.revoke()

    def abort(self, errorcode: int = 1) -> None:
        """End every process of the job (``MPI_Abort``) with ``errorcode``."""
        self.transport.abort(errorcode)

    @property
    def p2p_timeout(self) -> float | None:
        """Seconds a point-to-point wait of this communicator may take when the
        call gives none: a fault-tolerant communicator's ``timeout`` (no blocking
        call of one waits forever: ``send``, ``recv``, ``sendrecv``, ``waitall``
        and a request's ``wait()`` raise :class:`~commlib.CommTimeout` then, a
        receive withdrawn, a send left posted), None otherwise (MPI's
        semantics: wait as long as it takes)."""
        ft = self._ft
        return None if ft is None else ft.timeout

    def _call_timeout(self, timeout, op: str) -> float | None:
        """A blocking point-to-point call's bound: ``timeout`` checked (finite,
        > 0), else :attr:`p2p_timeout`."""
        if timeout is None:
            return self.p2p_timeout
        return check_timeout(timeout, op=op, rank=self.rank)

    def _bound(self, req: Request) -> Request:
        """``req`` with this communicator's :attr:`p2p_timeout` as its ``wait()`` bound."""
        t = self.p2p_timeout
        if t is not None and isinstance(req, MPIRequest):
            req.bound = t
        return req

    def _check_tag(self, tag: int, op: str, anywild: bool = False, peer=None) -> None:
        """A point-to-point call's ``tag`` (and that ``peer`` is not a bool: True
        would pass as rank 1); the peer's range is the transport's check."""
        if type(tag) is int and 0 <= tag <= self.transport.tag_ub and type(peer) is int:
            return  # the common case, decided in a few attribute reads (a typed send's hot path)
        problem = check_user_tag(tag, anywild=anywild, ub=self.transport.tag_ub)
        if problem:
            raise InvalidArgument(problem, rank=self.rank, op=op)
        if peer is True or peer is False:
            raise InvalidArgument(f"{'source' if anywild else 'dest'} {peer!r} is a bool, not a rank",
                                  rank=self.rank, op=op)


class CartCommunicator(Communicator):
    """A communicator whose ranks form a Cartesian grid.

    Attributes:
        dims: ranks per dimension (tuple of int).
        periods: periodicity per dimension (tuple of bool).
        coords: this rank's coordinates (tuple of int).
        ndim: number of dimensions.
    """

    def __init__(self, comm: MPI.Cartcomm | None = None, *, cuda_aware: bool | None = None,
                 transport: MPITransport | None = None):
        super().__init__(comm, cuda_aware=cuda_aware, transport=transport)
        self.dims, self.periods, self.coords = self.transport.cart_topo()
        self.ndim = len(self.dims)

    def __repr__(self) -> str:
        return f"<CartCommunicator rank={self.rank} dims={self.dims} periods={self.periods} coords={self.coords}>"

    def rank_of(self, coords: Sequence[int]) -> int:
        """Rank at ``coords``, wrapping periodic dimensions; ``PROC_NULL`` off a
        non-periodic edge."""
        op = "rank_of"
        try:
            coords = [int(x) for x in coords]
        except (TypeError, ValueError):
            raise InvalidArgument(f"coords {coords!r} must be a sequence of ints", rank=self.rank, op=op) from None
        if len(coords) != self.ndim:
            raise InvalidArgument(f"coords {tuple(coords)} has {len(coords)} entries, grid has {self.ndim}",
                                  rank=self.rank, op=op)
        c = []
        for x, n, p in zip(coords, self.dims, self.periods):
            if not 0 <= x < n:
                if not p:
                    return PROC_NULL
                x %= n
            c.append(x)
        return self.transport.cart_rank(c)

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank``.

        Raises:
            InvalidArgument: ``rank`` is not in ``[0, size)``.
        """
        self.transport.check_peer(rank, "rank", "coords_of")
        if rank == PROC_NULL:
            raise InvalidArgument("PROC_NULL has no coordinates", rank=self.rank, op="coords_of")
        return self.transport.cart_coords(int(rank))

    def neighbor(self, offset: Sequence[int]) -> int:
        """Rank at this rank's coordinates plus ``offset`` (e.g. ``(-1, 1)`` for a
        corner neighbour), or ``PROC_NULL`` off a non-periodic edge."""
        if len(offset) != self.ndim:
            raise InvalidArgument(f"offset {tuple(offset)} has {len(offset)} entries, grid has {self.ndim}",
                                  rank=self.rank, op="neighbor")
        return self.rank_of([c + o for c, o in zip(self.coords, offset)])

    def shift(self, direction: int, disp: int = 1) -> tuple[int, int]:
        """``(source, dest)`` ranks for a shift along ``direction`` (``MPI_Cart_shift``).

        Raises:
            InvalidArgument: ``direction`` is not in ``[0, ndim)`` or ``disp`` not an int.
        """
        if (isinstance(direction, bool) or not isinstance(direction, (int, np.integer))
                or not 0 <= direction < self.ndim or isinstance(disp, bool) or not isinstance(disp, (int, np.integer))):
            raise InvalidArgument(f"direction {direction!r} must be an int in [0, {self.ndim}) and disp {disp!r} "
                                  "an int", rank=self.rank, op="shift")
        return self.transport.cart_shift(int(direction), int(disp))


#: dims shown entry by entry in cart_create's argument agreement (a digest covers the rest)
_CART_SHOWN = 8
#: cart_create's agreement header: the same length on every rank, whatever its arguments
_CART_FIELDS = ("ndims",) + tuple(f"dims[{i}]" for i in range(_CART_SHOWN)) + (
    "periods", "reorder", f"dims and periods past the first {_CART_SHOWN} (CRC-32)")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_flag(x) -> bool:
    """A bool (or the ints 0 and 1, as MPI's C interface takes them)."""
    return isinstance(x, (bool, np.bool_)) or (_is_int(x) and int(x) in (0, 1))


def _cart_header(dims, periods, reorder) -> list:
    """``cart_create``'s agreement header (see :data:`_CART_FIELDS`): the number of
    dimensions, the first :data:`_CART_SHOWN` dims (-1 past the last), the first
    periods as a bit mask, reorder, and a CRC-32 of the dims and periods past the
    first :data:`_CART_SHOWN` (0 when there are none)."""
    shown = list(dims[:_CART_SHOWN]) + [-1] * (_CART_SHOWN - min(len(dims), _CART_SHOWN))
    mask = sum(1 << i for i, p in enumerate(periods[:_CART_SHOWN]) if p)
    rest = (tuple(dims[_CART_SHOWN:]), tuple(periods[_CART_SHOWN:]))
    digest = zlib.crc32(repr(rest).encode()) if rest[0] else 0
    return [len(dims)] + shown + [mask, int(reorder), digest]


def _cart_describe(name: str, value: int, ndims: int):
    if name == "periods":
        return tuple(bool(value >> i & 1) for i in range(max(1, min(ndims, _CART_SHOWN))))
    if name == "reorder":
        return bool(value)
    if name.startswith("dims[") and value == -1:
        return "(none)"
    return value


def compute_dims(nnodes: int, dims: Sequence[int] | int) -> tuple[int, ...]:
    """A balanced Cartesian grid of ``nnodes`` ranks (``MPI_Dims_create``, MPI-4.0 §8.5.2).

    Args:
        nnodes: number of ranks.
        dims: number of dimensions, or one entry per dimension (0: free).

    Returns:
        tuple of int: ranks per dimension, non-increasing over the free entries.

    Raises:
        InvalidArgument: ``nnodes`` cannot be split so.
    """
    return dims_create(nnodes, [0] * dims if isinstance(dims, int) else dims)


def init(comm: MPI.Comm | None = None, *, cuda_aware: bool | None = None, fault_tolerant: bool = False,
         on_failure: str = "shrink", timeout: float | None = None, **options) -> Communicator:
    """Initialize commlib and return a :class:`Communicator`.

    MPI itself is initialized by importing mpi4py (thread level per
    ``mpi4py.rc``), or here (``MPI_THREAD_MULTIPLE``) when
    ``mpi4py.rc.initialize = False`` left it uninitialized; commlib adds no
    global state beyond that.

    Args:
        comm: communicator to wrap (default ``MPI.COMM_WORLD``).
        cuda_aware: force CUDA-awareness (None: detect).
        fault_tolerant: survive rank failures in collectives.  Under ULFM
            (``mpiexec --with-ft ulfm``; see :func:`commlib.transports.mpi_process.ft_mode`)
            the survivors revoke, agree, shrink and retry, and the call returns
            the result over the surviving ranks (``size``/``rank`` then describe
            the shrunk group).  Without ULFM every wait is bounded and a dead
            peer raises ``ProcessFailed``/``CommTimeout`` on every survivor.
            The communicator is a duplicate of ``comm``.
        on_failure: ``"shrink"`` (default: recover and return) or ``"raise"``
            (recover the communicator, then raise ``ProcessFailed`` listing the
            failed ranks on every survivor).
        timeout: seconds, fault-tolerant mode (default, None: ``COMMLIB_TIMEOUT``,
            60); a finite number > 0 (0, NaN, infinity, negatives and bools are
            refused: a bound that never passes, or passes at once, is no bound).
            The default ``timeout`` of every collective (and attention) call
            on the communicator: the deadline of the whole call.  Under ULFM a
            watchdog thread revokes the communicator past it and every
            survivor raises ``CommTimeout`` (dead peers are reported by ULFM
            itself, long before; a retry over the survivors after a shrink
            gets the timeout afresh).  Without ULFM, or without
            ``MPI_THREAD_MULTIPLE``: every wait of the call waits what is left
            of it, and a wait that runs out counts as a failure.  Either
            way, the most a point-to-point wait given no timeout may take
            (:attr:`Communicator.p2p_timeout`): ``send``, ``recv``,
            ``sendrecv``, ``waitall`` and a request's ``wait()`` raise
            ``CommTimeout`` then.
        **options: an unknown option raises.

    ``init`` is collective over ``comm``: each rank checks its arguments and
    the ranks agree on the outcome (one all-gather of a flag), so a bad
    argument on one rank raises on every rank.

    Raises:
        InvalidArgument: on every rank alike, naming the rank: an unknown
            option, an invalid ``on_failure`` or ``timeout``.
    """
    if not MPI.Is_initialized():  # mpi4py.rc.initialize = False, and nobody has yet
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    check_slurm_singleton()  # srun without the right --mpi=: every task a world of 1 (COMMLIB_SLURM_SINGLETON)
    # Every rank checks its own arguments, then the ranks agree (one all-gather of
    # an error flag) so that a bad argument on one rank raises on every rank
    # before any communicator is duplicated: no rank is left waiting in a dup.
    problem = None
    if options:
        problem = f"unknown option(s) {sorted(options)}"
    elif fault_tolerant:
        if on_failure not in ON_FAILURE:
            problem = f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}"
        else:
            problem = timeout_problem(timeout)
    elif timeout is not None:  # unused without fault tolerance, but still a number of seconds
        problem = timeout_problem(timeout)
    base = MPITransport(MPI.COMM_WORLD if comm is None else comm, cuda_aware=cuda_aware)
    local = InvalidArgument(problem, rank=base.rank, op="init") if problem else None
    ft = None
    if local is None and fault_tolerant:
        try:
            ft = FaultTolerance(ft_mode(), on_failure=on_failure,
                                timeout=config.timeout if timeout is None else float(timeout), process=PROCESS)
        except InvalidArgument as exc:  # e.g. COMMLIB_TIMEOUT is not a valid number of seconds
            local = InvalidArgument(exc.detail, rank=base.rank, op="init")
    check_all(base, local.detail if local else None, "init")
    if not fault_tolerant:
        return Communicator(transport=base)
    PROCESS.warn_tcp_rdma()  # once, under ULFM with the TCP BTL's RDMA put on (docs/faults-and-security.md)
    # no blocking call of a fault-tolerant job waits for ever, MPI_Finalize included: a
    # rank that died after the last collective is seen by no survivor's recovery
    PROCESS.bound_finalize(IDLE_FINALIZE_BOUND)
    tp = base.dup()
    tp.set_errors_return()
    c = Communicator(transport=tp)
    c._ft = ft
    try:
        # duplicate now, while every rank is alive; the barrier is commlib's own (point to
        # point): no MPI collective on a fault-tolerant communicator (see collectives.agreement.agree)
        barrier_dissemination(c.collective_transport())
    except ProcessFailed:
        # a rank that had left the barrier died and the survivors, already in their
        # first collective, revoked the communicators: every communicator exists
        # by now, so this rank returns and its first collective joins their recovery
        pass
    # (the barrier: no rank returns, and maybe fails, while another is still
    # creating communicators; Open MPI 5.0 can crash handling a failure then)
    return c
