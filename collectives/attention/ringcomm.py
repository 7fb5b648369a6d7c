"""The ring's traffic, one helper for the forward, the backward and both layers.

:class:`~.schedule.RingSchedule` says who holds which piece at each step;
:class:`RingComm` moves the pieces: the K/V of every stream, double-buffered
(the next step's piece is received while this step's is computed), and, in
the backward, the travelling dk/dv partials of every stream, at most one in
flight per stream (memory stays ``O(seq_local)``), back at their owner after
``P`` hops.  The numpy/CuPy ring (:mod:`.ring`) and the torch ring
(:mod:`commlib.nn.ring`) run the same calls; only the buffers differ (the
torch layer passes its wire functions for tensors).  The idea of
ring-flash-attention's ``RingComm`` (github.com/zhuzilin/ring-flash-attention).

Tags: a call takes :attr:`RingComm.WIDTH` tags from its transport's allocator;
the K/V of stream ``s`` go at ``tag + s``, its dk/dv at ``tag + 2 + s``.
"""
from __future__ import annotations

from typing import Callable

from commlib.core.seconds import time_left

from .schedule import RingSchedule

__all__ = ["RingComm"]


def _isend(tp, buf, dest: int, tag: int):
    return tp.isend(buf, dest, tag)


def _irecv(tp, buf, source: int, tag: int):
    return tp.irecv(buf, source, tag)


class RingComm:
    """The messages of one ring attention call (forward or backward).

    Args:
        tp: the call's transport (``isend``, ``irecv``, ``waitall``).
        sched: the ring's schedule (one stream, or two for the bidirectional ring).
        tag: the first of the call's :attr:`WIDTH` tags.
        timeout: the call's deadline (:class:`commlib.core.seconds.Deadline`)
            or None; every wait waits what is left of it.
        op: the call's name, for errors.
        isend, irecv: ``f(tp, buf, peer, tag) -> request``; default the
            transport's own (numpy/CuPy buffers).

    Raises (from its waits):
        CommTimeout: ``timeout`` passed.
        CommError: a peer failed or another transport error.
    """

    #: tags a call takes; offsets of stream 0's K/V and dk/dv in them (stream s: + s)
    WIDTH, KV, DKV = 4, 0, 2

    def __init__(self, tp, sched: RingSchedule, tag: int, timeout, op: str, *,
                 isend: Callable | None = None, irecv: Callable | None = None):
        self.tp, self.sched, self.timeout, self.op = tp, sched, timeout, op
        self.tag = tag
        self._isend, self._irecv = isend or _isend, irecv or _irecv
        n = len(sched.streams)
        self._arrived = [None] * n   # (request, buffer): the dk/dv this step adds to its own
        self._coming = [None] * n    # (request, buffer): the dk/dv posted for the next step
        self._sends = [[] for _ in range(n)]  # the dk/dv send in flight per stream

    def wait(self, reqs) -> None:
        """Wait for ``reqs`` within what is left of the call's timeout."""
        if reqs:
            self.tp.waitall(reqs, time_left(self.timeout), op=self.op)

    def post_kv(self, cur, nxt) -> list:
        """Receive the next step's K/V piece of every stream into ``nxt[s]``
        and send this step's ``cur[s]`` on; post before computing this step.

        Returns:
            list: the requests (wait with :meth:`wait` before swapping ``cur`` and ``nxt``).
        """
        reqs = []
        for st in self.sched.streams:
            reqs.append(self._irecv(self.tp, nxt[st.index], self.sched.recv_from(st), self.tag + self.KV + st.index))
            reqs.append(self._isend(self.tp, cur[st.index], self.sched.send_to(st), self.tag + self.KV + st.index))
        return reqs

    def expect_dkv(self, stream: int, buf) -> None:
        """Post the receive of the dk/dv that the previous holder passes on
        for the next step (at the last step: this rank's own, home)."""
        st = self.sched.streams[stream]
        req = self._irecv(self.tp, buf, self.sched.recv_from(st), self.tag + self.DKV + stream)
        self._coming[stream] = (req, buf)

    def pass_dkv(self, stream: int, local):
        """Add to ``local`` (this step's dk/dv of the piece it holds) what the
        piece's previous holders accumulated, and send the sum on to the next
        holder; the receive posted by :meth:`expect_dkv` becomes the next
        step's.  ``local`` must stay untouched until the next call (its send
        is in flight).

        Returns:
            ``local``, the sum.
        """
        if self._arrived[stream] is not None:
            req, buf = self._arrived[stream]
            self.wait([req])
            local += buf
        self.wait(self._sends[stream])  # at most one dk/dv in flight per stream
        st = self.sched.streams[stream]
        self._sends[stream] = [self._isend(self.tp, local, self.sched.send_to(st), self.tag + self.DKV + stream)]
        self._arrived[stream], self._coming[stream] = self._coming[stream], None
        return local

    def home_dkv(self, stream: int):
        """After the last step: this rank's own piece's dk/dv, back from its last holder."""
        req, buf = self._arrived[stream]
        self.wait([req] + self._sends[stream])
        self._sends[stream] = []
        return buf
