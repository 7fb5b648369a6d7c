"""The MPI transport's request handle and its completion helpers (:mod:`commlib.transports.mpi`)."""
from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI

from commlib.core import devmem
from commlib.core.buffer import Buffer
from commlib.core.errors import CommError

from .base import Request
from .failures import raise_classified

_BYTE = MPI.BYTE
#: requests abandoned while pending (see :meth:`MPIRequest.__del__`); never freed
ABANDONED: list = []

__all__ = ["MPIRequest", "ABANDONED", "cancel_receive", "raise_completion_error", "copy_up"]


class MPIRequest(Request):
    """Wraps an ``MPI.Request``; ``on_complete(nbytes)`` runs once when it
    finishes (host→device copy of a staged receive), given the number of bytes
    that arrived (the ``MPI.Status`` count; every completion path reads it:
    ``test``, ``wait``, the transport's ``waitall``)."""

    __slots__ = ("req", "_on_complete", "_done", "_keep", "persistent", "rank", "bound")

    def __init__(self, req: MPI.Request, on_complete: Callable[[], None] | None = None, keep=None,
                 persistent: bool = False, rank: int | None = None):
        self.req = req
        self._on_complete = on_complete
        self._done = persistent  # a persistent request is inactive until started
        self._keep = keep  # staging buffers must outlive the MPI request
        self.persistent = persistent
        self.rank = rank
        #: seconds ``wait()`` without a timeout may take (a fault-tolerant
        #: communicator's user requests), None: no bound
        self.bound = None

    def _finish(self, nbytes: int | None = None) -> None:
        """The one completion point: ``on_complete(nbytes)`` (staging copy,
        unpack; ``nbytes``: the bytes received, from the request's status), then
        the ``add_done_callback`` callbacks."""
        self._done = True
        if self._on_complete is not None:
            cb = self._on_complete
            if not self.persistent:
                self._on_complete = None
                self._keep = None
            cb(nbytes)
        elif not self.persistent:
            self._keep = None
        if self._callbacks:
            self._fire()

    def then(self, fn: Callable[[int | None], None]) -> "MPIRequest":
        """Run ``fn(nbytes)`` when the operation completes successfully, after
        any staging copy and before ``wait``/``test``/``waitall`` report it done
        (e.g. unpacking a typed receive); not run if it fails.  ``nbytes``: the
        bytes a receive got (``MPI_Get_count`` with ``MPI_BYTE``; a message
        may be shorter than the buffer)."""
        first = self._on_complete
        self._on_complete = fn if first is None else (lambda n: (first(n), fn(n)))
        return self

    def test(self) -> bool:
        if self._done:
            return True
        # a status only where a callback needs the count (host requests: none)
        st = None if self._on_complete is None else MPI.Status()
        try:
            flag = self.req.Test(st)
        except MPI.Exception as exc:
            raise_completion_error(exc, () if st is None else (st,), self.rank, "test")
        if flag:
            self._finish(None if st is None else st.Get_count(_BYTE))
            return True
        return False

    def wait(self, timeout: float | None = None):
        if timeout is None:
            timeout = self.bound
        if timeout is None and not self._done:
            st = None if self._on_complete is None else MPI.Status()
            try:
                self.req.Wait(st)
            except MPI.Exception as exc:
                ABANDONED.append(self.req)
                raise_completion_error(exc, () if st is None else (st,), self.rank, "wait")
            self._finish(None if st is None else st.Get_count(_BYTE))
            return None
        return Request.wait(self, timeout)

    def __del__(self):
        # mpi4py frees an active request when its object dies; a send freed
        # that way and failing later (a peer died) makes Open MPI's ULFM abort
        # the whole job ("Send error after request freed").  Requests dropped
        # while still pending (an error left them behind) are kept instead.
        if not self._done:
            try:
                req = self.req
                if req is not None and req != MPI.REQUEST_NULL:
                    ABANDONED.append(req)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def cancel(self) -> bool:
        """Cancel a pending operation (used when recovering from a failure);
        returns False (``Future.cancel``: the request may still complete)."""
        if not self._done:
            try:
                self.req.Cancel()
            except MPI.Exception:
                pass
        return False


_TRUNCATE = int(MPI.ERR_TRUNCATE)


def cancel_receive(r) -> bool:
    """Withdraw a receive (an ``MPI.Request`` or :class:`MPIRequest`) a bounded
    wait gave up on (``MPI_Cancel``), so no late message is written into the
    user's buffer; a receive that matched meanwhile completes instead.  Best
    effort: an error leaves the request kept alive, never freed (False)."""
    if isinstance(r, MPIRequest):
        if r._done:
            return True
        r._done = True  # no staging copy or callback runs for a withdrawn receive
        r = r.req
    try:
        r.Cancel()
        r.Wait()
        return True
    except MPI.Exception:
        ABANDONED.append(r)
        return False


def raise_completion_error(exc, statuses, rank, op):
    """:func:`raise_classified`, saying so when a message was larger than its
    receive buffer (``MPI_ERR_TRUNCATE``, maybe behind ``MPI_ERR_IN_STATUS``)."""
    try:
        classes = {MPI.Get_error_class(exc.Get_error_code())}
        classes |= {MPI.Get_error_class(s.Get_error()) for s in statuses}
    except MPI.Exception:  # pragma: no cover
        classes = set()
    if _TRUNCATE in classes:
        raise CommError("a message was larger than its receive buffer (MPI_ERR_TRUNCATE): the sender's "
                        "message does not match this call", rank=rank, op=op) from exc
    raise_classified(exc, statuses, rank, op)


def copy_up(b: Buffer, host: np.ndarray) -> Callable[[int | None], None]:
    """The completion step of a receive into device ``b`` staged through
    ``host`` (1-D uint8, ``b.nbytes`` bytes): copy the ``nbytes`` bytes that
    arrived (None: all) into the same bytes of ``b``, in memory order, and
    nothing else, so the rest of ``b`` stays as it was (MPI-4.0 §3.2.4; a host
    buffer gets that from MPI itself).  A C-ordered buffer filled by the
    message takes one typed copy; any other case copies the byte prefix into
    ``b``'s byte view (a Fortran-ordered buffer thus gets the message in its
    own memory order, as a host one does)."""
    full = b.nbytes

    def done(nbytes: int | None) -> None:
        n = full if nbytes is None else min(int(nbytes), full)
        if n == full and b.contiguous and full:
            b.from_host(host.view(b.dtype).reshape(b.shape))
        elif n > 0:
            devmem.to_device_async(host, b.byte_view(), 0, n)
            devmem.stream_synchronize()

    return done
