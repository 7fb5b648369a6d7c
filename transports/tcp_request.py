"""The TCP transport's request handle (:class:`TCPRequest`), its one-lock
completion flag (:class:`Completion`) and the receive side's per-message slot
(:class:`Slot`), for :mod:`commlib.transports.tcp`."""
from __future__ import annotations

import threading

from .base import Request

__all__ = ["Completion", "Slot", "TCPRequest"]


class Slot:
    """One message of one (source, tag): a posted receive and/or frames that came first."""

    __slots__ = ("req", "view", "bounds", "frames", "arrived", "done")

    def __init__(self):
        self.req = None          # the TCPRequest once posted
        self.view = None         # memoryview of the posted buffer (bytes)
        self.bounds = None       # frame offsets once posted
        self.frames = {}         # index -> bytes received before the post
        self.arrived = set()     # frame indices seen
        self.done = 0            # frames placed in view


class Completion:
    """``threading.Event``'s ``set``/``is_set``/``wait`` for a request's one
    completion, over a single lock held until it is set (an Event is a
    Condition: its making, waiting and setting cost about 8 µs a request, this
    about 1).  Never cleared.  ``set`` may race with itself (a frame done under
    the transport's lock, a sender thread's failure outside it): the flag is
    set first, and a second release of the lock is ignored."""

    __slots__ = ("_flag", "_lock")

    def __init__(self):
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            try:
                self._lock.release()
            except RuntimeError:  # released by a racing set(): already done
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` seconds pass; True when set."""
        if self._flag:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else timeout):
            try:
                self._lock.release()  # open for every later waiter
            except RuntimeError:  # a racing set() released it meanwhile
                pass
        return self._flag


class TCPRequest(Request):
    """A send or receive on a :class:`TCPTransport` (frames outstanding → done)."""

    __slots__ = ("transport", "peer", "left", "error", "event", "kind", "on_complete", "_tag")

    def __init__(self, transport, peer: int, left: int, kind: str):
        self.transport, self.peer, self.left, self.kind = transport, peer, left, kind
        self.error: BaseException | None = None
        self.event = Completion()
        self.on_complete = None
        if left == 0:
            self.event.set()

    def _frame_done(self) -> None:  # under the transport lock
        self.left -= 1
        if self.left <= 0:
            self.event.set()

    def _fail(self, exc: BaseException) -> None:
        if not self.event.is_set():
            self.error = exc
            self.event.set()

    def test(self) -> bool:
        if not self.event.is_set():
            t = self.transport
            if t.failure is not None:
                raise t.failure
            return False
        if self.error is not None:
            raise self.error
        if self.on_complete is not None:
            fn, self.on_complete = self.on_complete, None
            fn()
        return True

    def wait(self, timeout: float | None = None):
        self.transport.waitall([self], timeout, op=f"{self.kind}.wait")
        return None
