"""Frames and sockets of the TCP transport: the frame header, kinds and caps,
:class:`FrameError`, and :class:`Connection`, which writes and reads the frames
of one socket; with the socket helpers (:func:`parse_address`,
:func:`resolve`, :func:`open_socket`, :func:`tune_socket`) and the msgpack control bodies
(:func:`pack_ctrl`, :func:`unpack_ctrl`).

:mod:`commlib.transports.tcp_auth` authenticates a :class:`Connection` (and may
give it AES-GCM sealers); :mod:`commlib.transports.tcp` stripes messages over
connections.

Frames (every integer in network byte order, ``struct`` format ``!2sBBHIQIHI``,
28 bytes)::

    magic   2s  b"CL"
    version B   1
    kind    B   CHALLENGE, RESPONSE, PROOF (handshake), CTRL (msgpack body),
                DATA (raw array bytes), PING, BUSY (a listener with no
                handshake slot for this connection, before closing it)
    flags   H   bit 0: the payload is AES-GCM sealed (16-byte tag at its end)
    epoch   I   membership epoch of the sender's topology (0 for control)
    tag     Q   operation tag (the transport's TagAllocator slot)
    chunk   I   frame index within the message (see :func:`.tcp.frame_bounds`)
    stream  H   connection index within the peer pair
    length  I   payload bytes that follow

Hard caps: a control body carries at most :data:`CTRL_MAX` bytes, a data frame
at most :data:`FRAME_MAX` (a frame before authentication:
:data:`.tcp_auth.PREAUTH_MAX`).  Anything malformed (bad magic, version, kind,
an over-long length, undecodable msgpack, a failed AES-GCM tag) is a
:class:`FrameError` and closes the connection without a reply.

Sockets use ``TCP_NODELAY`` and 4 MiB buffers.  A :class:`Connection` puts its
socket in blocking mode once and never changes it: an unbounded read or write
blocks in the kernel (the data path: one system call per wake-up), a bounded one
passes ``MSG_DONTWAIT`` and waits in ``poll`` for its own deadline.  (Python's
``settimeout`` is per socket object: a writer setting its timeout while a reader
thread of the same socket ran without one used to switch the socket to
non-blocking under the reader, whose ``recv`` then failed with ``EAGAIN`` and
tore down a healthy control connection.)
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time

import msgpack

from commlib.core.errors import CommError, InvalidArgument

__all__ = [
    "HEADER", "MAGIC", "VERSION", "K_CHALLENGE", "K_RESPONSE", "K_PROOF", "K_CTRL", "K_DATA", "K_PING", "K_BUSY",
    "F_SEALED",
    "CTRL_MAX", "FRAME_MAX", "SOCK_BUF", "GCM_TAG", "FrameError", "Connection", "pack_ctrl", "unpack_ctrl",
    "tune_socket", "parse_address", "resolve", "open_socket", "connect_first",
]

HEADER = struct.Struct("!2sBBHIQIHI")
MAGIC = b"CL"
VERSION = 1
K_CHALLENGE, K_RESPONSE, K_PROOF, K_CTRL, K_DATA, K_PING, K_BUSY = 1, 2, 3, 4, 5, 6, 7
_KINDS = frozenset((K_CHALLENGE, K_RESPONSE, K_PROOF, K_CTRL, K_DATA, K_PING, K_BUSY))
F_SEALED = 1

CTRL_MAX = 4 << 20            #: bytes of a msgpack control body
FRAME_MAX = 16 << 20          #: bytes of one data frame
SOCK_BUF = 4 << 20
GCM_TAG = 16


class FrameError(CommError):
    """A malformed or over-long frame (the connection is closed, nothing is replied)."""


# ---------------------------------------------------------------- helpers
def parse_address(addr: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)`` (IPv6 as ``[::1]:port``)."""
    if not isinstance(addr, str) or ":" not in addr:
        raise InvalidArgument(f"address must be 'host:port', got {addr!r}", op="parse_address")
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise InvalidArgument(f"bad port in {addr!r}", op="parse_address") from None
    if not 0 <= p < 65536:
        raise InvalidArgument(f"bad port in {addr!r}", op="parse_address")
    return host, p


def resolve(host: str, port: int, timeout: float | None) -> list:
    """``socket.getaddrinfo(host, port, type=SOCK_STREAM)`` within ``timeout``
    seconds (None: the resolver's own bound).  An address literal needs no
    lookup; a name is looked up on a daemon thread (the resolver has no bound of
    its own to pass: a stalled DNS server holds ``getaddrinfo`` for its retries,
    tens of seconds), which a caller past ``timeout`` leaves behind to finish.

    Raises:
        TimeoutError: the lookup did not finish within ``timeout``.
        OSError: the name does not resolve (``socket.gaierror``).
    """
    try:  # an address literal: no lookup, no thread
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    if timeout is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    got: list = []
    done = threading.Event()

    def lookup() -> None:
        try:
            got.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            got.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name="commlib-resolve", daemon=True).start()
    if not done.wait(max(0.0, timeout)):
        raise TimeoutError(f"the name lookup of {host!r} did not finish within {timeout:g} s")
    if isinstance(got[0], OSError):
        raise got[0]
    return got[0]


def open_socket(address: str, timeout: float) -> socket.socket:
    """A TCP connection to ``"host:port"`` (not yet authenticated: pass it to
    :func:`client_handshake`) within ``timeout`` seconds in all: the name's
    lookup (:func:`resolve`) and the connects to each address it gives.  The
    socket keeps a timeout of what was left (as ``socket.create_connection``).

    Raises:
        TimeoutError: nothing answered within ``timeout`` (the lookup included).
        OSError: unreachable, refused, or a name that does not resolve.
    """
    deadline = time.monotonic() + timeout
    sock = connect_first(resolve(*parse_address(address), timeout), lambda: deadline - time.monotonic())
    if sock is None:
        raise TimeoutError(f"no connection to {address} within {timeout:g} s")
    return sock


def connect_first(infos: list, left) -> socket.socket | None:
    """A socket connected to the first address of ``infos`` (from :func:`resolve`)
    that accepts, each connect bounded by ``left()`` (the seconds left of the
    caller's deadline); None when the deadline passed before any answered.

    Raises:
        OSError: the last address's error (refused, unreachable, its connect timed out).
    """
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        t = left()
        if t <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(t)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    if last is not None:
        raise last
    return None


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY (no Nagle delay on small frames) and large kernel buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:  # pragma: no cover - capped by the kernel
            pass


def pack_ctrl(obj) -> bytes:
    """A control body (msgpack; plain types only, never pickle)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack_ctrl(body: bytes, limit: int = CTRL_MAX):
    """Decode a control body with hard limits; any failure is a :class:`FrameError`."""
    if len(body) > limit:
        raise FrameError("control body over its cap")
    try:
        # unpackb bounds every container by the body's length; the explicit
        # caps below keep a small body from describing huge containers
        obj = msgpack.unpackb(body, raw=False, max_str_len=limit, max_bin_len=limit, max_array_len=1 << 16,
                              max_map_len=1 << 16, max_ext_len=0, strict_map_key=False, use_list=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types on bad input
        raise FrameError(f"undecodable control body ({type(exc).__name__})") from None
    return obj


_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0x40)


def _wait_io(sock: socket.socket, events: int, deadline: float) -> None:
    """Wait until ``sock`` is ready for ``events`` (``select.POLLIN`` or
    ``select.POLLOUT``; errors and hang-ups count as ready, so the next call
    reports them), at most until ``deadline`` (``time.monotonic()`` seconds).

    Raises:
        socket.timeout: ``deadline`` passed.
        ConnectionError: the socket was closed (by another thread).
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    fd = sock.fileno()
    if fd < 0:
        raise ConnectionError("connection closed")
    poller = select.poll()
    poller.register(fd, events | select.POLLERR | select.POLLHUP)
    poller.poll(int(left * 1000) + 1)  # the caller retries its call, then waits again or times out


#: an unbounded read of more than :data:`RCVLOWAT_MIN` bytes sleeps until this many
#: (or the rest of the read) have arrived, then takes all that is there
#: (``SO_RCVLOWAT`` and ``poll``): a wake-up per MiB instead of one per arriving
#: segment, 7-21% less CPU for a 16-64 MiB elastic all-reduce at 3-4 peers on
#: loopback (docs/elastic-protocol.md); the kernel caps the mark at half the receive buffer
RCVLOWAT = 1 << 20
#: reads up to this many bytes take the plain path (at 1.3 MiB the mark's extra
#: system calls cost about what the wake-ups it saves do)
RCVLOWAT_MIN = 2 << 20
_SO_RCVLOWAT = getattr(socket, "SO_RCVLOWAT", None)


def _recv_large_into(sock: socket.socket, mv: memoryview) -> bool:
    """Fill ``mv`` (more than :data:`RCVLOWAT_MIN` bytes) from ``sock``, unbounded.

    Each wait is a ``poll`` with the socket's low-water mark at what is left of
    the read, capped at :data:`RCVLOWAT` (never more: the sender may write
    nothing after this read), and each read takes what is there without
    sleeping (``MSG_DONTWAIT``): a ``recv`` that slept under a mark would, after
    a partial copy, wait for that much *new* data, which may never come.  The
    mark is 1 again after the read.

    Returns:
        False, having read nothing, when the socket refuses the option (the
        caller reads the plain way).

    Raises:
        ConnectionError / OSError: the connection closed or failed.
    """
    got, n = 0, len(mv)
    fd = sock.fileno()
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, min(n, RCVLOWAT))
    except OSError:
        if sock.fileno() < 0:
            raise ConnectionError("connection closed") from None
        return False
    po = select.poll()
    po.register(fd, select.POLLIN)
    try:
        while True:
            # a hang-up or error counts as ready (the recv reports it); after the bound
            # the recv takes whatever is there (and fails on a socket closed meanwhile)
            po.poll(500)
            try:
                k = sock.recv_into(mv[got:], n - got, _DONTWAIT)
            except BlockingIOError:
                continue
            if k == 0:
                raise ConnectionError("connection closed")
            got += k
            if got == n:
                return True
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, min(n - got, RCVLOWAT))
    finally:
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, 1)
        except OSError:  # closed meanwhile: nothing reads it any more
            pass


def _recv_exact_into(sock: socket.socket, mv: memoryview, deadline: float | None = None) -> None:
    """Fill ``mv`` from ``sock``, waiting at most until ``deadline`` (None: no bound).

    The socket stays in blocking mode: without a deadline each ``recv`` blocks in
    the kernel (one system call per wake-up on the data path; more than
    :data:`RCVLOWAT_MIN` bytes: :func:`_recv_large_into`); with one, each
    ``recv`` is ``MSG_DONTWAIT`` and the waits are ``poll`` calls bounded by it."""
    got, n = 0, len(mv)
    if deadline is None and n > RCVLOWAT_MIN and _SO_RCVLOWAT is not None and _recv_large_into(sock, mv):
        return
    flags = 0 if deadline is None else _DONTWAIT
    while got < n:
        try:
            k = sock.recv_into(mv[got:], n - got, flags)
        except BlockingIOError:
            if deadline is None:  # pragma: no cover - a Connection's socket is blocking
                raise
            _wait_io(sock, select.POLLIN, deadline)
            continue
        if k == 0:
            raise ConnectionError("connection closed")
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf), deadline)
    return buf


def send_all(sock: socket.socket, data, deadline: float | None = None) -> None:
    """Write all of ``data`` (bytes-like) to ``sock``, waiting at most until
    ``deadline`` (None: a plain blocking ``sendall``; else ``MSG_DONTWAIT`` sends
    and bounded ``poll`` waits)."""
    if deadline is None:
        sock.sendall(data)
        return
    mv = memoryview(data).cast("B")
    off, n = 0, len(mv)
    while off < n:
        try:
            off += sock.send(mv[off:], _DONTWAIT)
        except BlockingIOError:
            _wait_io(sock, select.POLLOUT, deadline)


# ------------------------------------------------------------- connection
class Connection:
    """One authenticated TCP connection: framed, thread-safe sends, one reader.

    Attributes:
        sock: the socket.
        tx, rx: the sealers of the frames sent / received (``seal(header, payload)``,
            ``open(header, payload)``: :class:`.tcp_auth._Sealer`, set by the handshake
            with ``encrypt=True``), or None: plain frames.
        hello: the client's hello (a dict) as the server received it (server side).
        peer: free slot for the owner (peer id, rank...).
    """

    def __init__(self, sock: socket.socket, *, tx=None, rx=None):
        sock.setblocking(True)  # once, for good: a bounded call passes MSG_DONTWAIT and polls
        self.sock = sock
        self.tx, self.rx = tx, rx
        self.lock = threading.Lock()
        self.closed = False
        self.hello: dict = {}
        self.peer = None
        self.last_rx = time.monotonic()

    # sends ------------------------------------------------------------
    def send_frame(self, kind: int, payload=b"", *, epoch: int = 0, tag: int = 0, chunk: int = 0, stream: int = 0,
                   timeout: float | None = None) -> int:
        """Write one frame (the payload sealed when the connection is encrypted).

        Args:
            timeout: seconds the call may block, the wait for another writer of
                this connection included (None: unbounded).

        Returns:
            bytes written: the 28-byte header, the payload and, sealed, its 16-byte tag.

        Raises:
            TimeoutError: ``timeout`` passed, waiting for another writer (the
                connection stays open) or writing (it is then closed).
            ConnectionError / OSError: the connection failed (it is then closed).
        """
        # a tuple is a gather: the parts of one payload
        parts = [p if isinstance(p, (bytes, bytearray)) else memoryview(p).cast("B")
                 for p in (payload if isinstance(payload, tuple) else (payload,))]
        n = sum(len(p) for p in parts)
        deadline = None if timeout is None else time.monotonic() + timeout
        # the wait for another writer (the heartbeat's ping to a master that reads
        # nothing holds the lock for up to its own bound) counts against the timeout
        # too: nothing of this frame is written then, so the connection stays open
        if not self.lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"another write held the connection for the whole timeout of {timeout:g} s")
        try:
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                if self.tx is not None or n <= 65536:  # sealing (or a small frame): one buffer
                    mv = parts[0] if len(parts) == 1 else b"".join(parts)
                    data = self._frame_bytes(kind, mv, epoch, tag, chunk, stream)
                    send_all(self.sock, data, deadline)
                    return len(data)
                return self._send_parts_locked(kind, parts, n, epoch, tag, chunk, stream, deadline)
            except BaseException:
                self._close_locked()
                raise
        finally:
            self.lock.release()

    def _send_parts_locked(self, kind: int, parts: list, n: int, epoch: int, tag: int, chunk: int, stream: int,
                           deadline) -> int:
        """One unsealed frame whose payload is ``parts`` (``n`` bytes): header and
        parts in one ``sendmsg`` (one segment less, no copy), the rest as the socket
        drains; the lock held."""
        views = [memoryview(HEADER.pack(MAGIC, VERSION, kind, 0, epoch, tag, chunk, stream, n))] + parts
        try:
            sent = self.sock.sendmsg(views, [], 0 if deadline is None else _DONTWAIT)
        except BlockingIOError:  # MSG_DONTWAIT with a full buffer
            sent = 0
        for v in views:
            if sent >= len(v):
                sent -= len(v)
                continue
            send_all(self.sock, v[sent:], deadline)
            sent = 0
        return HEADER.size + n

    def _frame_bytes(self, kind: int, mv, epoch: int, tag: int, chunk: int, stream: int) -> bytes:
        """One whole frame as bytes: the header, then the payload, sealed (with its
        16-byte tag) when the connection is encrypted."""
        if self.tx is not None:
            hdr = HEADER.pack(MAGIC, VERSION, kind, F_SEALED, epoch, tag, chunk, stream, len(mv) + GCM_TAG)
            return hdr + self.tx.seal(hdr, mv)
        return HEADER.pack(MAGIC, VERSION, kind, 0, epoch, tag, chunk, stream, len(mv)) + bytes(mv)

    def try_send_frame_locked(self, kind: int, payload, *, epoch: int = 0, tag: int = 0, chunk: int = 0,
                              stream: int = 0):
        """Write one frame without blocking, :attr:`lock` held by the caller.

        Returns:
            ``(wire_bytes, rest)``: the frame's bytes on the wire (header, payload,
            sealed: its tag) and the memoryview of what the socket did not take at
            once (empty when all was written). The caller writes ``rest`` with
            :meth:`send_raw` before any other frame on this connection.

        Raises:
            ConnectionError / OSError: the connection failed (it is then closed).
        """
        if self.closed:
            raise ConnectionError("connection closed")
        try:
            data = self._frame_bytes(kind, memoryview(payload).cast("B"), epoch, tag, chunk, stream)
            try:
                sent = self.sock.send(data, _DONTWAIT)
            except BlockingIOError:
                sent = 0
            return len(data), memoryview(data)[sent:]
        except BaseException:
            self._close_locked()
            raise

    def send_raw(self, data) -> None:
        """Write bytes that continue a frame :meth:`try_send_frame_locked` began.

        Raises:
            ConnectionError / OSError: the connection failed (it is then closed).
        """
        with self.lock:
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                send_all(self.sock, data)
            except BaseException:
                self._close_locked()
                raise

    def send_ctrl(self, obj, timeout: float | None = None) -> None:
        self.send_frame(K_CTRL, pack_ctrl(obj), timeout=timeout)

    # receives -----------------------------------------------------------
    def read_header(self, deadline: float | None = None):
        """The next header as a tuple ``(kind, flags, epoch, tag, chunk, stream, length)``.

        Raises:
            FrameError: bad magic, version or kind.
            ConnectionError / OSError / socket.timeout: the connection failed.
        """
        raw = bytes(recv_exact(self.sock, HEADER.size, deadline))
        magic, version, kind, flags, epoch, tag, chunk, stream, length = HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION or kind not in _KINDS or flags & ~F_SEALED:
            raise FrameError("bad frame header")
        if bool(flags & F_SEALED) != (self.rx is not None):
            raise FrameError("sealing does not match the session")
        if self.rx is not None and length < GCM_TAG:
            raise FrameError("sealed frame too short")
        self.last_rx = time.monotonic()
        self._hdr = raw
        return kind, flags, epoch, tag, chunk, stream, length

    def read_payload(self, length: int, into: memoryview | None = None, deadline: float | None = None):
        """Read the payload of the header just read; sealed payloads are opened.

        ``into`` (exactly the plaintext size) receives it without a copy when not sealed.
        """
        if self.rx is not None:
            body = recv_exact(self.sock, length, deadline)
            plain = self.rx.open(self._hdr, body)
            if into is not None:
                if len(plain) != len(into):
                    raise FrameError("frame length does not match the posted receive")
                into[:] = plain
                return None
            return plain
        if into is not None:
            _recv_exact_into(self.sock, into, deadline)
            return None
        return bytes(recv_exact(self.sock, length, deadline))

    def plain_length(self, length: int) -> int:
        return length - GCM_TAG if self.rx is not None else length

    def discard(self, length: int) -> None:
        """Read and drop ``length`` payload bytes (a frame of another epoch)."""
        if self.rx is not None:
            self.read_payload(length)  # keeps the nonce counter in step
            return
        buf = bytearray(min(length, 1 << 20))
        mv = memoryview(buf)
        left = length
        while left:
            k = min(left, len(buf))
            _recv_exact_into(self.sock, mv[:k])
            left -= k

    def read_ctrl(self, deadline: float | None = None, limit: int = CTRL_MAX):
        """The next frame that is not a PING, decoded: ``(kind, header, body)``;
        a CTRL body is decoded msgpack, a DATA body raw bytes (capped by ``limit``)."""
        while True:
            kind, flags, epoch, tag, chunk, stream, length = self.read_header(deadline)
            if length > limit + (GCM_TAG if self.rx is not None else 0):
                raise FrameError("frame over its cap")
            body = self.read_payload(length, deadline=deadline)
            if kind == K_PING:
                continue
            if kind == K_CTRL:
                return kind, (epoch, tag, chunk, stream), unpack_ctrl(bytes(body), limit)
            return kind, (epoch, tag, chunk, stream), body

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                self.sock.close()
            except OSError:
                pass

    def close(self) -> None:
        """Close without a word (idempotent; safe from any thread)."""
        if self.closed:
            return
        # never wait for the send lock: a sender may be blocked in sendall
        self._close_locked()
