"""The TCP transport: authenticated, framed, striped point to point for elastic peers.

This module is the wire of :mod:`commlib.elastic`.  It offers the transport
contract of :mod:`commlib.transports.base` (``isend``/``irecv``/``send``/
``recv``/``sendrecv`` of contiguous arrays or :class:`~.base.Wire` bytes,
``waitall(timeout)``, :class:`~.base.Request` handles), so the collective
algorithms of :mod:`commlib.collectives` run over it unchanged.  Beside it:
frames, connections and sockets (:mod:`.tcp_frames`), the authentication
handshake, sealing, tickets and the listener (:mod:`.tcp_auth`), re-exported
here as ``tcp.NAME``; per-operation tags, aborts and the revoke
(:mod:`.tcp_ops`); the request handle (:mod:`.tcp_request`).

Memory a peer can make this side hold: at most :data:`UNEXPECTED_MAX` bytes of
data no receive was posted for (each buffered frame counted at its payload plus
:data:`FRAME_COST`), and at most :data:`UNEXPECTED_FRAMES` such frames from one
peer; a peer over either bound has its link closed and is reported through
``on_abuse``.  Frames of another epoch or of an aborted tag are read and dropped.

Striping: a message of ``L`` bytes to a peer with ``S`` connections is cut into
``k = max(ceil(L / FRAME_MAX), min(S, ceil(L / STRIPE_MIN)), 1)`` nearly equal
frames, frame ``i`` on connection ``i % S`` (:func:`frame_bounds`, the same cut
on both sides).  Each connection has a receiver thread reading frames straight
into the posted buffer (``recv_into``) and a sender thread writing header and
payload with one ``sendmsg``; socket calls release the GIL.  A frame of at least
:data:`POST_WAIT_MIN` bytes whose receive is not posted yet stays in the
kernel's socket buffer until it is (at most :data:`POST_WAIT` seconds, or until
another receive from that peer waits behind it).  Payloads are raw bytes, never
unpickled.  docs/elastic-protocol.md has the wire format.

Counters (exact once the requests are complete): ``bytes_sent`` /
``bytes_received`` (payload), ``wire_bytes_sent`` / ``wire_bytes_received``
(headers, payloads, AES-GCM tags), ``bytes_buffered`` (early payload bytes that
took the extra copy).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from commlib.core.errors import CommError, CommTimeout, InvalidArgument, MessageSizeMismatch, ProcessFailed
from commlib.core.seconds import timeout_problem, wait_bound_ok
from commlib.core.tags import TagAllocator

from .base import Request, Transport, Wire, check_plain_dtype
from .tcp_ops import FIRST_ROUND_TAG, OPERATION_TAGS, QUIESCE, OperationControl
from .tcp_request import Completion, Slot, TCPRequest
# re-exported: the frames, sockets and authentication of this transport live in
# tcp_frames and tcp_auth; commlib.elastic and the tests reach them as tcp.NAME
from .tcp_auth import (HANDSHAKE_TIMEOUT, PREAUTH_MAX, Listener, client_handshake, dial, make_ticket, read_secret,
                       retry_delay, server_handshake, verify_ticket)
from .tcp_frames import (CTRL_MAX, FRAME_MAX, GCM_TAG, HEADER, K_BUSY, K_CHALLENGE, K_CTRL, K_DATA, K_PING, K_PROOF,
                         K_RESPONSE, MAGIC, VERSION, Connection, FrameError, connect_first, open_socket, pack_ctrl,
                         parse_address, resolve, tune_socket, unpack_ctrl)

__all__ = [
    "HEADER", "MAGIC", "VERSION", "K_CHALLENGE", "K_RESPONSE", "K_PROOF", "K_CTRL", "K_DATA", "K_PING", "K_BUSY",
    "PREAUTH_MAX", "CTRL_MAX", "FRAME_MAX", "UNEXPECTED_MAX", "UNEXPECTED_FRAMES", "FRAME_COST", "FrameError",
    "Connection", "client_handshake", "server_handshake", "make_ticket", "verify_ticket", "frame_bounds",
    "TCPTransport", "Listener", "pack_ctrl", "unpack_ctrl", "tune_socket", "parse_address", "read_secret",
    "open_socket", "resolve", "connect_first", "retry_delay", "dial", "HANDSHAKE_TIMEOUT", "FIRST_ROUND_TAG", "OPERATION_TAGS", "Overrun", "Completion",
    "TCPRequest",
]

STRIPE_MIN = 64 << 10         #: a message is striped only in pieces of at least this
UNEXPECTED_MAX = 1 << 30      #: bytes buffered for receives not yet posted, per transport (frames at FRAME_COST more)
UNEXPECTED_FRAMES = 4096      #: frames buffered for receives not yet posted, per peer
FRAME_COST = 1 << 10          #: bytes each buffered frame is counted at beyond its payload (slot, array, dict entries)
POST_WAIT = 0.5               #: seconds a receiver thread holds a frame that came before its receive was posted
POST_WAIT_MIN = 64 << 10      #: frames of at least this many bytes are held (smaller ones are buffered at once)
INLINE_MAX = 16 << 10         #: messages of at most this many bytes are written by the caller's thread when its connection is idle
#: bytes of a mismatched message's first frame kept on its :class:`MessageSizeMismatch`
#: (``head``): a first round's message starts with its sender's header row, so the
#: receiver can name the field that differs
MISMATCH_HEAD = 256


class Overrun(FrameError):
    """A peer sent more data for receives not posted than this side holds for it
    (:data:`UNEXPECTED_MAX`, :data:`UNEXPECTED_FRAMES`): its link is closed and it
    is reported (``TCPTransport(on_abuse=...)``)."""


def frame_bounds(nbytes: int, streams: int) -> list[int]:
    """Byte offsets of the frames a message of ``nbytes`` is cut into (see the module docstring)."""
    k = max(-(-nbytes // FRAME_MAX), min(streams, -(-nbytes // STRIPE_MIN)), 1)
    base, extra = divmod(nbytes, k)
    return [i * base + min(i, extra) for i in range(k + 1)]


# ------------------------------------------------------------- transport
class _Link:
    """The ``S`` connections to one peer, with a sender thread per connection."""

    def __init__(self, transport, rank: int, streams: int):
        self.t, self.rank, self.streams = transport, rank, streams
        self.conns: list[Connection | None] = [None] * streams
        self.queues = [queue.SimpleQueue() for _ in range(streams)]
        self.pending = [0] * streams  # frames queued or being written, per connection (under the transport's lock)
        self.failed: BaseException | None = None
        self.early: list = []   # sends posted before an inbound link's first connection

    def attach(self, stream: int, conn: Connection) -> None:
        if not 0 <= stream < self.streams or self.conns[stream] is not None:
            conn.close()
            return
        self.conns[stream] = conn
        conn.peer = self.rank
        threading.Thread(target=self._sender, args=(stream, conn), daemon=True, name="commlib-tcp-tx").start()
        threading.Thread(target=self.t._receiver, args=(self, stream, conn), daemon=True,
                         name="commlib-tcp-rx").start()

    def _sender(self, stream: int, conn: Connection) -> None:
        q = self.queues[stream]
        t = self.t
        while True:
            job = q.get()
            if job is None:
                return
            req, mv, idx, tag = job
            try:
                if self.failed is None and not t._dead and not t._stopping:
                    if idx < 0:  # the rest of a frame the caller's thread began (TCPTransport._try_inline_locked)
                        conn.send_raw(mv)
                        n = -idx
                    else:
                        n = conn.send_frame(K_DATA, mv, epoch=t.epoch, tag=tag, chunk=idx, stream=stream)
                    # one acquisition per frame: each one the caller's thread finds taken costs it a wake-up
                    with t._lock:
                        self.pending[stream] -= 1
                        t._count_tx(tag, n)
                        req._frame_done()
                    continue
                req._fail(self.failed or t._failure or ProcessFailed("transport closed", failed=[self.rank]))
            except Exception as exc:  # noqa: BLE001
                t._link_failed(self, exc)
                req._fail(t._peer_error(self.rank, "isend"))
            with t._lock:
                self.pending[stream] -= 1

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for c in self.conns:
            if c is not None:
                c.close()


class TCPTransport(OperationControl, Transport):
    """Point to point among the members of one elastic epoch, over TCP.

    Created by :mod:`commlib.elastic` for each membership epoch; links to peers
    are opened lazily, on the first send or receive to a peer, by the lower
    rank of the pair (``connect(rank, stream)`` returns an authenticated
    :class:`Connection` that carries the master's ticket); the higher rank's
    :meth:`attach` receives them from the listener.

    Args:
        rank, size: this peer's rank and the group size in this epoch.
        epoch: the membership epoch (every data frame carries it; others are dropped).
        connect: ``connect(rank, stream) -> Connection`` (lower rank side).
        streams: connections per peer pair this side opens (1..64), or a callable
            ``streams(rank) -> int`` giving the count per higher-ranked peer (the
            higher rank learns the count from the connections' hello).
        timeout: default seconds of a wait (None: unbounded).
        on_abuse: ``on_abuse(rank, reason)``, called (on the link's receiver thread,
            before the link is failed) when peer ``rank`` sent more unexpected data
            than it may (:class:`Overrun`).

    Attributes:
        bytes_sent, bytes_received: payload bytes of the messages posted with
            :meth:`isend` / of the DATA frames received (the application's bytes).
        wire_bytes_sent, wire_bytes_received: bytes of the frames written / read on
            the data connections: 28-byte headers, payloads, AES-GCM tags when
            sealed; received also counts PINGs and frames dropped (old epoch or
            aborted tag).  A send is counted once it is written, before its
            request completes, so the counts are exact after a ``waitall``.
        bytes_buffered: payload bytes that arrived before their receive was posted
            and were held in memory, then copied (each costs one extra copy).
        first_round_bytes_sent, first_round_bytes_received,
        first_round_wire_bytes_sent, first_round_wire_bytes_received: the same
            for messages with tags from :data:`FIRST_ROUND_TAG` up (a
            collective's first round, whose tags come from
            :attr:`first_round_tags`), which the counters above leave out.
        first_round_tags: the tag allocator of first rounds (``tags`` stays below
            :data:`FIRST_ROUND_TAG`).

    Raises:
        InvalidArgument: ``streams`` out of 1..64.
    """

    name = "tcp"
    fault_tolerant = True
    thread_multiple = True
    tag_ub = FIRST_ROUND_TAG - 1

    #: bytes of the largest single frame (a first-round message is one frame)
    frame_max = FRAME_MAX

    def __init__(self, rank: int, size: int, epoch: int, connect: Callable[[int, int], Connection], *,
                 streams: int | Callable[[int], int] = 4, timeout: float | None = 30.0,
                 on_abuse: Callable[[int, str], None] | None = None):
        super().__init__()
        self._streams_for = streams if callable(streams) else None
        if self._streams_for is None and not 1 <= streams <= 64:
            raise InvalidArgument(f"streams must be 1..64, got {streams}", op="TCPTransport")
        self._rank, self._size, self.epoch = rank, size, epoch
        self._connect, self.timeout = connect, timeout
        self.streams = None if self._streams_for is not None else streams
        self._lock = threading.Lock()
        self._posted = threading.Condition(self._lock)  # notified on every post, revoke, abort, close
        self._links: dict[int, _Link] = {}
        self._slots: dict[tuple[int, int], deque] = {}
        self._unexpected = 0          # bytes counted against UNEXPECTED_MAX (payload + FRAME_COST per frame)
        self._unexpected_by: dict[int, list] = {}  # source rank -> [counted bytes, frames]
        self._on_abuse = on_abuse
        self._failure: BaseException | None = None
        self._failed: set[int] = set()
        self._aborted: dict[int, Callable | None] = {}  # aborted tag -> its receives' error (abort_tags)
        self._dead = False
        self._stopping = False        # revoked: no frame is placed into a posted buffer any more
        self._inflight: dict[int, int] = {}  # tag -> frames being read straight into posted buffers now
        self.bytes_sent = 0           # payload bytes of the messages posted with isend
        self.bytes_received = 0       # payload bytes of DATA frames placed or buffered
        self.wire_bytes_sent = 0      # DATA frames written: header + payload (+ AES-GCM tag)
        self.wire_bytes_received = 0  # DATA and PING frames read, dropped ones too
        self.bytes_buffered = 0       # payload bytes that came before their receive was posted (one extra copy)
        self.first_round_bytes_sent = self.first_round_bytes_received = 0
        self.first_round_wire_bytes_sent = self.first_round_wire_bytes_received = 0
        self.first_round_tags = TagAllocator(FIRST_ROUND_TAG, (1 << 62))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # links ----------------------------------------------------------------
    def _link(self, peer: int) -> _Link:
        if not 0 <= peer < self._size or peer == self._rank:
            raise InvalidArgument(f"no peer {peer} in a group of {self._size}", rank=self._rank, op="tcp")
        link = self._links.get(peer)  # links are never removed: no lock once made
        if link is not None:
            return link
        with self._lock:
            link = self._links.get(peer)
            if link is not None:
                return link
            if self._rank < peer:
                ns = self.streams if self._streams_for is None else int(self._streams_for(peer))
                if not 1 <= ns <= 64:
                    raise InvalidArgument(f"streams must be 1..64, got {ns}", rank=self._rank, op="tcp")
                link = _Link(self, peer, ns)
                self._links[peer] = link
                threading.Thread(target=self._open, args=(link,), daemon=True, name="commlib-tcp-open").start()
                return link
            # the higher rank waits for the lower one's connections (attach);
            # the stripe count is known from the first connection's hello
            link = _Link(self, peer, 0)
            link.streams = None
            self._links[peer] = link
            return link

    def _open(self, link: _Link) -> None:
        def one(stream):
            try:
                conn = self._connect(link.rank, stream)
            except Exception as exc:  # noqa: BLE001
                self._link_failed(link, exc)
                return
            with self._lock:
                if self._dead:
                    conn.close()
                    return
                link.attach(stream, conn)

        threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in range(link.streams)]
        for th in threads:
            th.start()

    def attach(self, peer: int, stream: int, nstreams: int, conn: Connection) -> None:
        """Adopt an inbound connection (authenticated, its ticket checked) from
        the lower-ranked ``peer``; anything else is closed."""
        if not 0 <= peer < self._rank or not 1 <= nstreams <= 64 or not 0 <= stream < nstreams:
            conn.close()
            return
        with self._lock:
            if self._dead:
                conn.close()
                return
            link = self._links.get(peer)
            if link is None:
                link = _Link(self, peer, 0)
                link.streams = None
                self._links[peer] = link
            self._attach_locked(link, stream, nstreams, conn)

    def _attach_locked(self, link: _Link, stream: int, nstreams: int, conn: Connection) -> None:
        if link.streams is None:
            link.streams = nstreams
            link.conns = [None] * nstreams
            link.queues = [queue.SimpleQueue() for _ in range(nstreams)]
            link.pending = [0] * nstreams
            early, link.early = link.early, []
            for req, mv in early:
                self._enqueue(link, req, mv)
            for (src, _tag), dq in list(self._slots.items()):  # a mismatched post drops its slot
                if src == link.rank:
                    for slot in list(dq):
                        if slot.req is not None and slot.bounds is None:
                            self._post_locked(slot, nstreams, (src, _tag))
        if link.streams != nstreams:
            conn.close()
            return
        link.attach(stream, conn)

    def _link_failed(self, link: _Link, exc: BaseException) -> None:
        with self._lock:
            if link.failed is not None:
                return
            link.failed = exc
            self._failed.add(link.rank)
            err = self._peer_error(link.rank, "tcp")
            for (src, _tag), dq in self._slots.items():
                if src == link.rank:
                    for slot in dq:
                        if slot.req is not None:
                            slot.req._fail(err)
            self._posted.notify_all()
        for c in link.conns:
            if c is not None:
                c.close()

    def _peer_error(self, peer: int, op: str) -> ProcessFailed:
        link = self._links.get(peer)
        cause = link.failed if link is not None else None
        why = ""
        if isinstance(cause, CommError):
            why = f": {cause.detail}"
        elif cause is not None:
            why = f" ({type(cause).__name__}: {cause})"
        return ProcessFailed(f"connection to rank {peer} failed (epoch {self.epoch}){why}", failed=[peer],
                             rank=self._rank, op=op)

    # point to point --------------------------------------------------------
    @staticmethod
    def _bytes_view(buf, op: str, rank) -> memoryview:
        if isinstance(buf, Wire):
            obj = buf.obj
            if buf.datatype not in ("byte", "packed"):
                raise InvalidArgument("the TCP transport carries only byte/packed Wire messages", rank=rank, op=op)
            mv = memoryview(obj).cast("B")
            return mv[:int(buf.count)]
        arr = buf
        if not isinstance(arr, np.ndarray):
            arr = np.asarray(arr)
        check_plain_dtype(arr.dtype, rank, op)
        if not arr.flags.c_contiguous:
            raise InvalidArgument("the TCP transport needs contiguous host arrays", rank=rank, op=op)
        return memoryview(arr.reshape(-1).view(np.uint8))

    #: :meth:`isend` takes a tuple of buffers (a gather) under first-round tags
    gather_sends = True

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        """Send ``buf`` to ``dest`` under ``tag``.

        A tuple of buffers is a gather (first-round tags only: one frame, sent
        with one ``sendmsg``, no copy of the parts; the receiver posts one buffer
        of their total size).

        Raises:
            InvalidArgument: a gather under a data tag, or a buffer of another kind.
        """
        if isinstance(buf, tuple):
            if tag < FIRST_ROUND_TAG:
                raise InvalidArgument("a gather send (a tuple of buffers) needs a first-round tag",
                                      rank=self._rank, op="isend")
            parts = tuple(self._bytes_view(b, "isend", self._rank) for b in buf)
            total = sum(len(p) for p in parts)
            if total <= INLINE_MAX or total > FRAME_MAX:
                buf = np.frombuffer(b"".join(parts), np.uint8)  # small (or over a frame): one buffer
            else:
                return self._isend_gather(parts, total, dest, tag)
        mv = self._bytes_view(buf, "isend", self._rank)
        link = self._link(dest)
        req = TCPRequest(self, dest, 1, "isend")  # its frame count is set where it is cut (_enqueue)
        req._tag = tag
        with self._lock:  # one acquisition: each costs the caller a wake-up when a worker thread holds it
            if self._failure is not None:
                raise self._failure
            if tag < FIRST_ROUND_TAG:
                self.bytes_sent += len(mv)
            else:
                self.first_round_bytes_sent += len(mv)
            if link.streams is None:  # inbound link not yet attached: striped when it is
                link.early.append((req, mv))
                return req
            if not self._try_inline_locked(link, req, mv):
                self._enqueue(link, req, mv)
        return req

    def _isend_gather(self, parts: tuple, total: int, dest: int, tag: int) -> Request:
        """One frame of ``parts`` (``total`` bytes) through the sender thread of stream 0."""
        link = self._link(dest)
        req = TCPRequest(self, dest, 1, "isend")
        req._tag = tag
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self.first_round_bytes_sent += total
            if link.streams is None:  # sent when the inbound link attaches
                link.early.append((req, parts))
            else:
                self._enqueue(link, req, parts)
        return req

    def _try_inline_locked(self, link: _Link, req: TCPRequest, mv: memoryview) -> bool:
        """Write a message of one small frame from the caller's thread when nothing
        is queued on its connection: no hand-off to the sender thread, whose wake-up
        costs a loopback round trip tens of microseconds.  One non-blocking send;
        what the socket does not take at once goes to the sender thread, ahead of
        any later frame.  False when the message must be queued instead."""
        conn = link.conns[0] if link.conns else None
        if (len(mv) > INLINE_MAX or link.pending[0] or conn is None or link.failed is not None
                or self._dead or self._stopping or not conn.lock.acquire(blocking=False)):
            return False
        try:
            req.left = 1
            link.pending[0] = 1
            try:
                n, rest = conn.try_send_frame_locked(K_DATA, mv, epoch=self.epoch, tag=req._tag, chunk=0, stream=0)
            except Exception:  # noqa: BLE001 - the sender thread reports it as for a queued frame
                # the connection is closed: the sender thread fails the request and the link
                link.queues[0].put((req, mv, 0, req._tag))
                return True
            if len(rest):
                link.queues[0].put((req, rest, -n, req._tag))
            else:
                link.pending[0] = 0
                self._count_tx(req._tag, n)
                req._frame_done()
            return True
        finally:
            conn.lock.release()

    def _count_tx(self, tag: int, n: int) -> None:
        """Count ``n`` bytes written on the wire for tag ``tag`` (the lock held)."""
        if tag < FIRST_ROUND_TAG:
            self.wire_bytes_sent += n
        else:
            self.first_round_wire_bytes_sent += n

    def _enqueue(self, link: _Link, req: TCPRequest, mv) -> None:
        if isinstance(mv, tuple):  # a gather (first-round tag): one frame on stream 0
            req.left = 1
            if link.failed is not None:
                req._fail(self._peer_error(link.rank, "isend"))
                return
            link.pending[0] += 1
            link.queues[0].put((req, mv, 0, req._tag))
            return
        bounds = frame_bounds(len(mv), link.streams if req._tag < FIRST_ROUND_TAG else 1)
        req.left = len(bounds) - 1
        if link.failed is not None:
            req._fail(self._peer_error(link.rank, "isend"))
            return
        for i in range(len(bounds) - 1):
            link.pending[i % link.streams] += 1
            link.queues[i % link.streams].put((req, mv[bounds[i]:bounds[i + 1]], i, req._tag))

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        mv = self._bytes_view(buf, "irecv", self._rank)
        link = self._link(source)
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if tag in self._aborted:  # a receive of an abandoned operation, posted after its abort
                req = TCPRequest(self, source, 1, "irecv")
                req._fail(self._abort_error(tag))
                return req
            dq = self._slots.setdefault((source, tag), deque())
            slot = None
            for s in dq:
                if s.req is None:
                    slot = s
                    break
            if slot is None:
                slot = Slot()
                dq.append(slot)
            streams = link.streams if link.streams else None
            req = TCPRequest(self, source, 1, "irecv")
            slot.req, slot.view = req, mv
            if streams is None:
                # the number of stripes is known once the link is attached
                slot.bounds = None
            else:
                self._post_locked(slot, streams, (source, tag))
            if link.failed is not None:
                req._fail(self._peer_error(source, "irecv"))
        return req

    def _post_locked(self, slot: Slot, streams: int, key) -> None:
        slot.bounds = frame_bounds(len(slot.view), streams if key[1] < FIRST_ROUND_TAG else 1)
        n = len(slot.bounds) - 1
        slot.req.left = n
        if not n:
            slot.req.event.set()
        if slot.frames and any(idx >= n or len(data) != slot.bounds[idx + 1] - slot.bounds[idx]
                               for idx, data in slot.frames.items()):
            first = slot.frames.get(0)
            for d in slot.frames.values():
                self._release_locked(key[0], len(d))
            slot.frames.clear()
            self._mismatch_locked(slot, key, None if first is None else first[:MISMATCH_HEAD].tobytes())
            return
        for idx, data in list(slot.frames.items()):
            slot.view[slot.bounds[idx]:slot.bounds[idx + 1]] = data
            self._release_locked(key[0], len(data))
            slot.req._frame_done()
        slot.frames.clear()
        self._retire_locked(key)
        self._posted.notify_all()

    def _mismatch_locked(self, slot: Slot, key, head: bytes | None = None) -> None:
        """A message from ``key[0]`` does not fit the receive posted for it (its size
        differs): fail that receive with :class:`MessageSizeMismatch` (``head``: the
        first bytes of the message's first frame, when read) and drop the rest of
        the message (its tag ``key[1]`` is aborted); the link stays up."""
        exc = MessageSizeMismatch(f"a message from rank {key[0]} does not match the posted receive "
                                  f"({len(slot.view)} bytes)", rank=self._rank, op="irecv")
        exc.head, exc.source = head, key[0]
        slot.req._fail(exc)
        self._aborted.setdefault(key[1], None)
        dq = self._slots.get(key)
        if dq is not None and slot in dq:
            dq.remove(slot)
            if not dq:
                del self._slots[key]
        self._posted.notify_all()

    def _retire_locked(self, key) -> None:
        dq = self._slots.get(key)
        while dq and dq[0].req is not None and dq[0].bounds is not None and dq[0].req.event.is_set():
            dq.popleft()
        if dq is not None and not dq:
            del self._slots[key]

    def _await_post_locked(self, link: _Link, src: int, tag: int, slot: Slot) -> bool:
        """A frame of ``slot`` arrived before its receive was posted: wait (the lock
        released) for the post, so the payload goes straight from the socket into the
        posted buffer instead of through a buffer and a copy (in a ring a peer one step
        ahead sends before this side posts).  The wait ends at once when another receive
        from ``src`` is posted and not complete (the application may be waiting for bytes
        queued behind this frame on the connection: buffering it then avoids a deadlock),
        on a revoke, close, abort of ``tag`` or failure of the link, and after
        :data:`POST_WAIT` seconds in any case; the frame is then buffered as before.

        Returns:
            True when the frame must be dropped (its tag was aborted or the transport closed).
        """
        deadline = time.monotonic() + POST_WAIT
        while slot.bounds is None:
            if (self._dead or self._failure is not None or tag in self._aborted or link.failed is not None
                    or self._other_posted_locked(src, slot)):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._posted.wait(left)
        return tag in self._aborted or self._dead or self._stopping

    def _other_posted_locked(self, src: int, slot: Slot) -> bool:
        """True when a receive from ``src`` other than ``slot`` is posted and not complete."""
        for (s, _t), dq in self._slots.items():
            if s == src:
                for other in dq:
                    if other is not slot and other.req is not None and not other.req.event.is_set():
                        return True
        return False

    def _receiver(self, link: _Link, stream: int, conn: Connection) -> None:
        src = link.rank
        try:
            while True:
                kind, flags, epoch, tag, chunk, st, length = conn.read_header()
                if length > FRAME_MAX + GCM_TAG:
                    raise FrameError("frame over its cap")
                if kind == K_PING:
                    conn.discard(length)
                    with self._lock:
                        self.wire_bytes_received += HEADER.size + length
                    continue
                if kind != K_DATA:
                    raise FrameError("unexpected frame kind on a data link")
                plain = conn.plain_length(length)
                with self._lock:
                    drop = epoch != self.epoch or tag in self._aborted or self._dead or self._stopping
                    target = None
                    capture = False
                    slot = None
                    if not drop:
                        key = (src, tag)
                        dq = self._slots.setdefault(key, deque())
                        for s in dq:
                            # (a posted receive of fewer frames is not this frame's: with
                            # several streams a later message's frame may pass its slot)
                            if chunk not in s.arrived and (s.bounds is None or chunk < len(s.bounds) - 1):
                                slot = s
                                break
                        if slot is None:
                            slot = Slot()
                            dq.append(slot)
                        slot.arrived.add(chunk)
                        if slot.bounds is None and plain >= POST_WAIT_MIN:
                            # leave the bytes in the kernel until the receive is posted
                            # (recv_into the destination, no copy); see _await_post_locked
                            drop = self._await_post_locked(link, src, tag, slot)
                    if not drop:
                        if slot.bounds is not None:
                            n = len(slot.bounds) - 1
                            if chunk >= n or slot.bounds[chunk + 1] - slot.bounds[chunk] != plain:
                                # the receive fails, the link stays up; a first round's message
                                # (one frame) is read first, for its head (MessageSizeMismatch.head)
                                capture = chunk == 0 and tag >= FIRST_ROUND_TAG
                                if not capture:
                                    self._mismatch_locked(slot, key)
                                drop = True
                            else:
                                target = slot.view[slot.bounds[chunk]:slot.bounds[chunk + 1]]
                                # revoke() and abort_tags() wait for it: the caller may restore the buffer
                                self._inflight[tag] = self._inflight.get(tag, 0) + 1
                        else:
                            self._charge_locked(src, plain)
                            if tag < FIRST_ROUND_TAG:
                                self.bytes_buffered += plain
                if drop:
                    if capture:
                        data = np.empty(plain, np.uint8)
                        conn.read_payload(length, into=memoryview(data))
                    else:
                        conn.discard(length)
                    with self._lock:
                        self._count_rx(tag, 0, HEADER.size + length)
                        if capture:
                            self._mismatch_locked(slot, key, data[:MISMATCH_HEAD].tobytes())
                    continue
                if target is not None:
                    try:
                        conn.read_payload(length, into=target)
                    except BaseException:
                        with self._lock:
                            self._landed_locked(tag)
                        raise
                    with self._lock:  # one acquisition per frame (see _sender)
                        self._landed_locked(tag)
                        self._count_rx(tag, plain, HEADER.size + length)
                        slot.req._frame_done()
                        self._retire_locked((src, tag))
                else:
                    data = np.empty(plain, np.uint8)  # not zeroed: every byte is overwritten
                    conn.read_payload(length, into=memoryview(data))
                    with self._lock:
                        self._count_rx(tag, plain, HEADER.size + length)
                        if tag in self._aborted:
                            self._release_locked(src, plain)  # aborted while we read (abort_tag): dropped
                        elif slot.bounds is not None and (self._stopping or self._dead):
                            self._release_locked(src, plain)  # revoked while we read: never placed
                        elif slot.bounds is not None:  # posted while we read
                            self._release_locked(src, plain)
                            if chunk >= len(slot.bounds) - 1 or slot.bounds[chunk + 1] - slot.bounds[chunk] != plain:
                                # posted for another size (calls that differ): the receive fails,
                                # the link stays up, as for a frame that finds its receive posted
                                self._mismatch_locked(slot, (src, tag),
                                                      data[:MISMATCH_HEAD].tobytes() if chunk == 0 else None)
                            else:
                                slot.view[slot.bounds[chunk]:slot.bounds[chunk + 1]] = data
                                slot.req._frame_done()
                                self._retire_locked((src, tag))
                        else:
                            slot.frames[chunk] = data
        except Exception as exc:  # noqa: BLE001 - a closed or malformed link fails its peer
            if not self._dead:
                if isinstance(exc, Overrun) and self._on_abuse is not None:
                    try:
                        self._on_abuse(src, str(exc))
                    except Exception:  # noqa: BLE001 - the report is best effort; the link fails anyway
                        pass
                self._link_failed(link, exc)

    def _landed_locked(self, tag: int) -> None:
        """A frame read straight into a posted buffer of ``tag`` is no longer in
        flight: wake ``revoke``/``abort_tags`` when they wait for it."""
        still = self._inflight.pop(tag) - 1
        if still:
            self._inflight[tag] = still
        elif tag in self._aborted or not self._inflight:
            self._posted.notify_all()

    def _charge_locked(self, src: int, plain: int) -> None:
        """Count a frame buffered for a receive not posted yet against the caps."""
        cost = plain + FRAME_COST
        u = self._unexpected_by.setdefault(src, [0, 0])
        if u[1] >= UNEXPECTED_FRAMES:
            raise Overrun(f"rank {src} sent more than {UNEXPECTED_FRAMES} frames for receives not posted "
                          f"({u[0]} bytes counted)")
        if self._unexpected + cost > UNEXPECTED_MAX:
            raise Overrun(f"rank {src} sent more unexpected data than the {UNEXPECTED_MAX} bytes held "
                          f"({u[0]} bytes and {u[1]} frames of it)")
        self._unexpected += cost
        u[0] += cost
        u[1] += 1

    def _release_locked(self, src: int, plain: int) -> None:
        """A buffered frame was copied into its posted receive."""
        cost = plain + FRAME_COST
        self._unexpected -= cost
        u = self._unexpected_by.get(src)
        if u is not None:
            u[0] -= cost
            u[1] -= 1

    # waits -----------------------------------------------------------------
    def waitall(self, requests, timeout: float | None = None, op: str = "waitall") -> None:
        """Wait for ``requests``; bounded by ``timeout`` (else the transport's default).

        Raises:
            ProcessFailed: a peer's connection failed, or the transport was revoked.
            CommTimeout: the deadline passed.
            InvalidArgument: ``timeout`` is NaN, infinite, negative, a bool or not a
                number (0: poll once).
        """
        if timeout is None:
            timeout = self.timeout
        elif not wait_bound_ok(timeout):
            raise InvalidArgument(timeout_problem(timeout, zero=True) or f"timeout {timeout!r} out of range",
                                  rank=self._rank, op=op)
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in requests:
            if not isinstance(r, TCPRequest):
                r.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                continue
            while not r.event.is_set():
                if self._failure is not None:
                    raise self._failure
                left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                if left <= 0:
                    raise CommTimeout(f"not complete after {timeout:.3g} s (epoch {self.epoch}, peer {r.peer})",
                                      rank=self._rank, op=op)
                r.event.wait(left)
            r.test()

    # group ----------------------------------------------------------------
    @property
    def failure(self) -> BaseException | None:
        """The error every request fails with once the transport was revoked or closed, else None."""
        return self._failure

    @property
    def revoked(self) -> bool:
        """True once :meth:`revoke` or :meth:`close` ended this transport: every
        request fails from then on."""
        return self._failure is not None

    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._failed))

    def _count_rx(self, tag: int, payload: int, wire: int) -> None:
        """Count a received frame (the caller holds the lock)."""
        if tag < FIRST_ROUND_TAG:
            self.bytes_received += payload
            self.wire_bytes_received += wire
        else:
            self.first_round_bytes_received += payload
            self.first_round_wire_bytes_received += wire

    def close(self) -> None:
        with self._lock:
            if self._dead:
                return
            self._dead = True
            if self._failure is None:
                self._failure = ProcessFailed(f"transport closed (epoch {self.epoch})", rank=self._rank, op="tcp")
            links = list(self._links.values())
            for dq in self._slots.values():
                for slot in dq:
                    if slot.req is not None:
                        slot.req._fail(self._failure)
            self._posted.notify_all()
        for link in links:
            link.close()
        if threading.current_thread().name != "commlib-tcp-rx":
            with self._lock:  # the reads in flight end with their sockets: wait for them (briefly)
                self._quiesce_locked(QUIESCE)
