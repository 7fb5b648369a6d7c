"""The TCP transport's per-operation control: tags numbered per operation, the
abort of one operation's traffic, and the revoke of all of it.

A mixin of :class:`commlib.transports.tcp.TCPTransport` (whose lock, slots,
links and counters it works on): an elastic group's members may take
different paths through one operation (calls that differed and were refused
after a first data message), so each operation's tags follow from its number
alone, and a refused operation's late frames are dropped without ending the
transport.
"""
from __future__ import annotations

import time
from typing import Callable

from commlib.core.errors import CommError, InvalidArgument, ProcessFailed
from commlib.core.tags import TagAllocator

__all__ = ["OperationControl", "FIRST_ROUND_TAG", "OPERATION_TAGS", "QUIESCE"]

#: tags from here up carry a collective's first round (argument agreement, small
#: payloads: :attr:`TCPTransport.first_round_tags`), counted apart from the data
#: plane and sent as one frame each (never striped): a receive posted for another
#: size fails at once with :class:`MessageSizeMismatch`, the link staying up
FIRST_ROUND_TAG = 1 << 61
#: seconds a revoke waits for frames being read into posted buffers before it cuts their links
QUIESCE = 1.0
#: tags one operation numbered by :meth:`TCPTransport.begin_operation` owns (an
#: elastic all-reduce takes at most 2 data tags and 1 first-round tag)
OPERATION_TAGS = 16


class OperationControl:
    """Per-operation tags, aborts and the revoke of a :class:`~commlib.transports.tcp.TCPTransport`."""

    def begin_operation(self, seq: int) -> range:
        """Number the tags of the group's operation ``seq`` from ``seq`` alone.

        Both allocators (``tags`` and ``first_round_tags``) restart at the block of
        :data:`OPERATION_TAGS` tags that belongs to operation ``seq``, so members
        that took different paths through an earlier operation (calls that
        differed, refused by the argument agreement after some member had already
        sent a first data message) still give the next operation the same tags,
        and no late frame of one operation can meet another.

        Returns:
            the operation's data tags (:meth:`operation_tags` gives them with the
            first-round ones, what :meth:`abort_tags` drops when the operation is
            abandoned).
        """
        data, first = self.operation_tags(seq)
        if data.stop > FIRST_ROUND_TAG:
            raise InvalidArgument(f"operation {seq} is past the tag space", rank=self._rank, op="begin_operation")
        self.tags = TagAllocator(data.start, data.stop - 1)
        self.first_round_tags = TagAllocator(first.start, first.stop - 1)
        return data

    def operation_tags(self, seq: int) -> tuple[range, range]:
        """Operation ``seq``'s tags (:meth:`begin_operation`): its data tags and its
        first-round tags, what :meth:`abort_tags` drops when the operation is refused."""
        base = seq * OPERATION_TAGS
        return range(base, base + OPERATION_TAGS), range(FIRST_ROUND_TAG + base,
                                                         FIRST_ROUND_TAG + base + OPERATION_TAGS)

    def _abort_error(self, tag: int) -> CommError:
        error = self._aborted.get(tag)
        return error(tag) if error is not None else CommError(f"operation tag {tag} aborted", rank=self._rank,
                                                              op="irecv")

    def abort_tag(self, tag: int) -> None:
        """:meth:`abort_tags` of one tag."""
        self.abort_tags((tag,))

    def abort_tags(self, tags, error: Callable[[int], CommError] | None = None,
                   wait: float = QUIESCE) -> None:
        """Drop every later frame of the operations ``tags``, and unpost their receives.

        Each posted receive of those tags fails (if not complete) with
        ``error(tag)`` (default: :class:`CommError` "operation tag aborted"), frames
        buffered for them are freed, their sends still held for a link not yet
        attached fail likewise, no frame of theirs is placed in a buffer any
        more, and, before this returns, no receiver thread is still reading one into
        a posted buffer (it waits at most ``wait`` seconds for reads in flight, then
        revokes the transport, which cuts those links): a caller may restore
        the buffers those receives were posted into.  A receive of those tags
        posted later fails at once with the same error.  Other tags' traffic goes
        on (the transport stays usable, unlike :meth:`revoke`)."""
        tags = set(tags)
        with self._lock:
            for t in tags:
                self._aborted[t] = error
            for key in [k for k in self._slots if k[1] in tags]:
                for slot in self._slots.pop(key):
                    for data in slot.frames.values():
                        self._release_locked(key[0], len(data))
                    slot.frames.clear()
                    if slot.req is not None:
                        slot.req._fail(self._abort_error(key[1]))
            for link in self._links.values():
                # sends held for an inbound link that is not attached yet (the lower
                # rank dials; it may never, e.g. a member that gave the call up)
                if link.early:
                    held, link.early = link.early, []
                    for item in held:
                        if item[0]._tag in tags:
                            item[0]._fail(self._abort_error(item[0]._tag))
                        else:
                            link.early.append(item)
            self._posted.notify_all()
            deadline = time.monotonic() + wait
            while any(t in tags for t in self._inflight):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._posted.wait(left)
            else:
                return
        self.revoke("a frame of an aborted operation was still being read")

    def _quiesce_locked(self, seconds: float) -> bool:
        """Place no more frames into posted buffers, and wait (the lock released) until
        no receiver thread is reading one into them; False when ``seconds`` passed first."""
        self._stopping = True
        self._posted.notify_all()
        deadline = time.monotonic() + seconds
        while self._inflight:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._posted.wait(left)
        return True

    def revoke(self, reason: str = "operation aborted") -> None:
        """Fail every pending and later request (an abort from the master).

        Before any request fails, no receiver thread writes into a posted buffer any
        more (frames arriving later are dropped, frames being read finish first, for
        at most :data:`QUIESCE` seconds, after which their links are cut): a caller
        woken by the failure may restore its buffers, and no late byte of this
        transport lands in them."""
        with self._lock:
            if self._failure is None:
                if not self._quiesce_locked(QUIESCE):
                    for link in self._links.values():
                        for c in link.conns:
                            if c is not None:
                                c.close()  # lock-free: aborts the reads in flight
                    self._quiesce_locked(QUIESCE)
                self._failure = ProcessFailed(f"{reason} (epoch {self.epoch})", failed=sorted(self._failed),
                                              rank=self._rank, op="tcp")
            for dq in self._slots.values():
                for slot in dq:
                    if slot.req is not None:
                        slot.req._fail(self._failure)
            self._posted.notify_all()
