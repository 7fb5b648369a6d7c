"""The transport contract: point-to-point only.

A transport moves contiguous buffers between ranks: ``send``, ``recv``,
``isend``, ``irecv``, ``sendrecv`` with a tag, plus ``rank``, ``size``, failure
detection and ``close``.  Collective algorithms (``commlib.collectives``) are
written only against this contract, so the same ring serves MPI and TCP.  An
operation a transport lacks raises ``NotImplementedError("transport 'tcp' does
not support ...")``, as torch.distributed's c10d ``Backend`` does.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Sequence

from commlib.core.errors import CommTimeout

__all__ = ["Request", "Transport", "wait_all"]


class Request(ABC):
    """Handle of a non-blocking operation."""

    @abstractmethod
    def test(self) -> bool:
        """Return True (and finish the operation) if it has completed; never blocks."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation completes.

        Args:
            timeout: seconds; None waits as long as it takes.

        Raises:
            CommTimeout: when ``timeout`` passes first.
        """
        if timeout is None:
            self._wait_forever()
            return
        self._poll(time.monotonic() + timeout, timeout)

    def _wait_forever(self) -> None:
        self._poll(float("inf"), None)

    def _poll(self, deadline: float, timeout) -> None:
        """Test with exponential back-off (1 us to 1 ms) until done or ``deadline``."""
        pause = 1e-6
        while not self.test():
            if time.monotonic() > deadline:
                raise CommTimeout(f"request not complete after {timeout:.3g} s", op=type(self).__name__ + ".wait")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class CompletedRequest(Request):
    """A request that is already done (e.g. a send to ``PROC_NULL``)."""

    def test(self) -> bool:
        return True


def wait_all(requests: Sequence[Request], timeout: float | None = None) -> None:
    """Wait for every request (see :meth:`Request.wait`)."""
    if timeout is None:
        for r in requests:
            r.wait()
        return
    deadline = time.monotonic() + timeout
    for r in requests:
        r.wait(max(0.0, deadline - time.monotonic()))


class Transport(ABC):
    """Point-to-point byte mover between the ``size`` ranks of a group.

    Buffers are :class:`commlib.core.buffer.Buffer`-compatible arrays, contiguous in
    memory; sizes in bytes must match between sender and receiver.
    """

    name = "abstract"
    #: set on the transports of fault-tolerant communicators: the MPI
    #: transport then completes ``sendrecv`` and unbounded ``waitall`` by
    #: spinning on ``MPI_Testall``, never by a blocking ``MPI_Sendrecv`` or
    #: ``MPI_Waitall`` (under Open MPI 5's ULFM those abort the whole job,
    #: "Send error after request freed", when a peer dies mid-step).
    fault_tolerant = False

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    @abstractmethod
    def isend(self, buf, dest: int, tag: int = 0) -> Request: ...

    @abstractmethod
    def irecv(self, buf, source: int, tag: int = 0) -> Request: ...

    def send(self, buf, dest: int, tag: int = 0) -> None:
        self.isend(buf, dest, tag).wait()

    def recv(self, buf, source: int, tag: int = 0) -> None:
        self.irecv(buf, source, tag).wait()

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, sendtag: int = 0, recvtag: int = 0) -> None:
        r = self.irecv(recvbuf, source, recvtag)
        s = self.isend(sendbuf, dest, sendtag)
        r.wait()
        s.wait()

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Wait for every request of one algorithm step (collectives call this).

        Args:
            requests: requests returned by this transport's ``isend``/``irecv``.
            timeout: seconds for all of them together; None waits as long as it takes.

        Raises:
            CommTimeout: when ``timeout`` passes first.
        """
        wait_all(requests, timeout)

    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks this transport knows to have failed (empty when it cannot tell)."""
        return ()

    def close(self) -> None:
        """Release the transport's resources."""

    def unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"transport '{self.name}' does not support {what}")

