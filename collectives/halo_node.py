"""Node-local halo exchange: ghost cells through shared memory, with no message.

When every rank of a Cartesian communicator runs on one node, a ghost-cell
exchange need not be a message at all.  :class:`NodeHalo` gives each rank a
shared-memory segment (:class:`commlib.transports.shm.Segment`) holding, per
face that has a neighbour, two mailboxes (one per step parity) and a step
counter.  A rank *pushes* a step: it copies its owned edge cells of the field
into each neighbour's mailbox and then raises its counter there; the
neighbour *pulls* the step: it waits until the counter says the step is
there and copies the mailbox into its ghost cells.  Each copy is one numpy
slice assignment of a face (a few µs for a 96 x 96 face), and no process
has to be inside a library call for the other to make progress: the cost of
a message exchange on a node with no spare core (rendezvous handshakes that
advance only while both ranks poll) is gone.

The schedule that makes it an overlap (the solver's time loop): at step
``s`` a rank pulls step ``s``, updates its shell (the cells that read
ghosts), pushes step ``s + 1`` (the shell's cells are its neighbours' next
ghosts) and only then updates its interior.  A neighbour that is behind
finds the step already there when it pulls.

Why two mailboxes and one counter suffice: a rank writes mailbox
``(s + 1) & 1`` at its step ``s``, after pulling step ``s``; it writes the
same mailbox again at step ``s + 2``, after pulling step ``s + 2``, which the
neighbour pushes only after its own pull of step ``s + 1`` has copied that
mailbox out.  The counter has one writer (the neighbour on that face).

The stencil is the star (faces only, no edges or corners) with one ghost
layer.  Every wait is bounded (``timeout``, else ``COMMLIB_TIMEOUT``) and
raises :class:`~commlib.CommTimeout` naming the rank, the neighbour and the
step.  Made only where :func:`commlib.transports.shm.supported` says so
(x86-64, ``/dev/shm``) on every rank and all ranks share a node; else the
constructor raises :class:`~commlib.InvalidArgument` on every rank alike,
and the caller uses :class:`commlib.collectives.HaloExchange` (messages).
"""
from __future__ import annotations

import os
import secrets
import time
from typing import Sequence

import numpy as np

from commlib.core.config import config
from commlib.core.errors import CommTimeout, InvalidArgument
from commlib.core.seconds import timeout_problem
from commlib.transports import shm

from .agreement import agree, check_all

__all__ = ["NodeHalo"]

_LINE = 64  # a counter per cache line: one writer each, no false sharing
_SPIN_S = 200e-6  # spin (yielding the core) this long, then sleep between looks


class _Face:
    __slots__ = ("peer", "own", "ghost", "out", "out_count", "inbox", "in_count")


class NodeHalo:
    """A ghost-cell exchange through shared memory between ranks of one node.

    Args:
        cart: a :class:`commlib.CartCommunicator` whose ranks are all on one node.
        local_shape: interior cells this rank owns, one int per dimension
            (fields are ``local_shape[i] + 2`` long: one ghost layer per side).
        dtype: the fields' dtype (float64 for the heat solver).
        timeout: seconds a pull may wait for a neighbour (None: ``COMMLIB_TIMEOUT``).

    Construction is collective over ``cart`` (three small agreements: every
    rank can, every segment exists, every rank has attached its neighbours').

    Attributes:
        name: this rank's segment's name (unlinked once every neighbour has
            attached it).
        shape: a field's shape (``local_shape + 2``); interior: the index of
            the owned cells; width: ghost layers per dimension (all 1);
            corners: False (faces only).

    Raises:
        InvalidArgument: on every rank alike when a rank cannot share memory
            (not x86-64, no writable ``/dev/shm``), the ranks span more than
            one node, ``local_shape`` has an empty dimension, ``timeout`` is
            not None or a finite number > 0, a periodic dimension has one
            rank along it (a rank its own neighbour:
            :class:`~commlib.collectives.HaloExchange` handles that), or a
            segment could not be created or attached (one line naming the
            rank and the reason).
    """

    corners = False

    def __init__(self, cart, local_shape: Sequence[int], dtype=np.float64, timeout: float | None = None):
        op = "NodeHalo"
        tp = cart.transport
        self.rank = cart.rank
        self.local_shape = tuple(int(n) for n in local_shape)
        self.dtype = np.dtype(dtype)
        d = len(self.local_shape)
        self.width = (1,) * d
        self.shape = tuple(n + 2 for n in self.local_shape)
        self._segments: list = []
        self.faces: list[_Face] = []
        problem = timeout_problem(timeout)
        self.timeout = config.timeout if timeout is None or problem else float(timeout)
        if problem is None and (len(self.local_shape) != cart.ndim or not self.local_shape
                                or min(self.local_shape) < 1):
            problem = f"local_shape {self.local_shape} does not fit the {cart.ndim}-D grid"
        if problem is None:
            problem = shm.supported()
        if problem is None and len(tp.node_peers) != tp.size:
            problem = f"the {tp.size} ranks span more than one node ({len(tp.node_peers)} on this one)"
        token = np.array([secrets.randbits(62) if cart.rank == 0 else 0], np.int64)
        rows = agree(tp, (), op=op, local_error=InvalidArgument(problem, rank=cart.rank, op=op) if problem else None,
                     payload=token.view(np.uint8), capacity=8)
        name = f"commlib-halo-{int(rows[0].view(np.int64)[0]):x}-{{}}"

        # this rank's segment: counters, then the mailbox offsets, then the mailbox pairs
        sides = [(i, side) for i in range(d) for side in (0, 1)]
        peers = {}
        for i, side in sides:
            off = [0] * d
            off[i] = 1 if side else -1
            peer = cart.neighbor(tuple(off))
            if peer == cart.rank and problem is None:  # a periodic dimension of one rank: its own ghosts
                problem = (f"dimension {i} is periodic with one rank along it (this rank is its own "
                           "neighbour); use HaloExchange")
            elif 0 <= peer < cart.size and peer != cart.rank:
                peers[(i, side)] = peer
        table = _LINE * len(sides)
        pos = table + _LINE * (-(-8 * len(sides) // _LINE))
        offsets = np.zeros(len(sides), np.int64)
        for k, (i, side) in enumerate(sides):
            if (i, side) in peers:
                offsets[k] = pos
                pos += 2 * _round(self._face_bytes(i))
        own = None
        self.name = name.format(cart.rank)
        try:
            if problem is not None:  # (a periodic dimension of one rank, found above)
                raise OSError(problem)
            own = shm.Segment.create(self.name, max(pos, _LINE))
            own.buf[table:table + offsets.nbytes] = offsets.view(np.uint8)
            self._segments.append(own)
        except OSError as exc:
            problem = problem or f"cannot create a shared-memory segment in {shm.SHM_DIR}: {exc}"
        self._agree(tp, problem, op)

        problem = None
        try:
            for k, (i, side) in enumerate(sides):
                if (i, side) not in peers:
                    continue
                peer = peers[(i, side)]
                theirs = shm.Segment.attach(name.format(peer), None)
                self._segments.append(theirs)
                back = 2 * i + (1 - side)  # this rank is on the neighbour's opposite side
                at = int(theirs.buf[table + 8 * back:table + 8 * back + 8].view(np.int64)[0])
                f = _Face()
                f.peer = peer
                f.own = self._plane(i, 1 if side == 0 else self.local_shape[i])
                f.ghost = self._plane(i, 0 if side == 0 else self.local_shape[i] + 1)
                f.out = self._pair(theirs, at, i)
                f.out_count = theirs.buf[_LINE * back:_LINE * back + 8].view(np.int64)
                f.inbox = self._pair(own, int(offsets[k]), i)
                f.in_count = own.buf[_LINE * k:_LINE * k + 8].view(np.int64)
                self.faces.append(f)
        except OSError as exc:
            problem = f"cannot attach a neighbour's shared-memory segment: {exc}"
        self._agree(tp, problem, op)
        own.unlink()  # every neighbour has it mapped: the memory now lives as long as a mapping

    # ---------------------------------------------------------------- layout
    def _face_bytes(self, i: int) -> int:
        return int(np.prod([n for j, n in enumerate(self.local_shape) if j != i])) * self.dtype.itemsize

    def _pair(self, seg, at: int, i: int) -> tuple:
        shape = tuple(n for j, n in enumerate(self.local_shape) if j != i)
        nb, step = self._face_bytes(i), _round(self._face_bytes(i))
        return tuple(seg.buf[at + q * step:at + q * step + nb].view(self.dtype).reshape(shape) for q in (0, 1))

    def _plane(self, i: int, index: int) -> tuple:
        return tuple(index if j == i else slice(1, n + 1) for j, n in enumerate(self.local_shape))

    def _agree(self, tp, problem, op) -> None:
        try:
            check_all(tp, problem, op)
        except InvalidArgument:
            self.free()
            raise

    @property
    def interior(self) -> tuple[slice, ...]:
        """Index of the owned (non-ghost) cells in a field."""
        return tuple(slice(1, n + 1) for n in self.local_shape)

    # --------------------------------------------------------------- exchange
    def push(self, field: np.ndarray, step: int) -> None:
        """Publish ``field``'s owned edge cells as step ``step``'s ghosts: copy
        each face into its neighbour's mailbox ``step & 1``, then raise the
        neighbour's counter to ``step + 1``.  Never waits.

        Args:
            field: this rank's field (``self.shape``, ``self.dtype``), holding
                the edge cells of step ``step``.
            step: the step these cells are the input of (>= 0; one more than
                the last push's).
        """
        q = step & 1
        for f in self.faces:
            f.out[q][...] = field[f.own]
        shm.store_fence()
        for f in self.faces:
            f.out_count[0] = step + 1

    def pull(self, field: np.ndarray, step: int) -> None:
        """Fill ``field``'s ghost cells with the neighbours' step ``step``:
        wait for each neighbour's push of that step, then copy its mailbox in.

        Raises:
            CommTimeout: a neighbour did not push step ``step`` within
                ``timeout`` seconds (no ghost cell of that face was written).
        """
        q = step & 1
        for f in self.faces:
            if f.in_count[0] <= step:
                self._wait(f, step)
            field[f.ghost] = f.inbox[q]

    def _wait(self, f: _Face, step: int) -> None:
        count = f.in_count
        clock = time.perf_counter
        t0 = clock()
        spin_until, deadline = t0 + _SPIN_S, t0 + self.timeout
        while count[0] <= step:
            now = clock()
            if now < spin_until:
                os.sched_yield()  # another rank sharing this core (more ranks than cores) runs now
            elif now < deadline:
                time.sleep(20e-6)
            else:
                raise CommTimeout(f"neighbour rank {f.peer} did not publish its edge cells for step {step} within "
                                  f"{self.timeout:g} s", rank=self.rank, op="NodeHalo.pull")

    def free(self) -> None:
        """Unmap every segment (local: a neighbour's mapping keeps its memory).  Idempotent."""
        self.faces = []
        for seg in self._segments:
            seg.close()
        self._segments = []


def _round(n: int) -> int:
    return -(-n // _LINE) * _LINE
