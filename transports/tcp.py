"""The TCP transport: authenticated, framed, striped point to point for elastic peers.

This module is the wire of :mod:`commlib.elastic`.  It offers the transport
contract of :mod:`commlib.transports.base` (``isend``/``irecv``/``send``/
``recv``/``sendrecv`` of contiguous arrays or :class:`~.base.Wire` bytes,
``waitall(timeout)``, :class:`~.base.Request` handles), so the ring algorithms
of :mod:`commlib.collectives` run over it unchanged, plus the pieces the
elastic layer builds on: frames, the authentication handshake, tickets and a
listener.

Frames (every integer in network byte order, ``struct`` format ``!2sBBHIQIHI``,
28 bytes)::

    magic   2s  b"CL"
    version B   1
    kind    B   CHALLENGE, RESPONSE, PROOF (handshake), CTRL (msgpack body),
                DATA (raw array bytes), PING
    flags   H   bit 0: the payload is AES-GCM sealed (16-byte tag at its end)
    epoch   I   membership epoch of the sender's topology (0 for control)
    tag     Q   operation tag (the transport's TagAllocator slot)
    chunk   I   frame index within the message (see :func:`frame_bounds`)
    stream  H   connection index within the peer pair
    length  I   payload bytes that follow

Hard caps: a frame before authentication carries at most :data:`PREAUTH_MAX`
bytes, a control body at most :data:`CTRL_MAX`, a data frame at most
:data:`FRAME_MAX`; a receiver never holds more than :data:`UNEXPECTED_MAX`
bytes of data that no receive was posted for.  Anything malformed (bad magic,
version, kind, an over-long length, undecodable msgpack, a failed AES-GCM tag)
closes the connection without a reply.  Data frames of another epoch or of an
aborted operation tag are read and dropped, so late bytes never land in a retry.

Handshake (both directions, one deadline, HMAC-SHA256 over the shared secret,
``hmac.compare_digest``):

1. server → client ``CHALLENGE``: 32 random bytes ``Ns`` (the only bytes an
   unauthenticated party ever receives);
2. client → server ``RESPONSE``: ``Nc`` (32 random bytes), then
   ``HMAC(secret, "commlib-c" | Ns | Nc | hello)`` (32), then ``hello`` (msgpack:
   who the client is, the ticket of a peer-to-peer connection);
3. server checks it (a wrong MAC: close, nothing sent), → client ``PROOF``:
   ``HMAC(secret, "commlib-s" | Nc | Ns | hello)``; the client checks it.

A replayed RESPONSE fails because ``Ns`` is fresh per connection.  With
``encrypt=True`` both sides derive two AES-256-GCM keys with HKDF-SHA256
(salt ``Ns | Nc``) and seal every later frame's payload (header as associated
data, a per-direction counter as nonce).

Striping: a message of ``L`` bytes to a peer with ``S`` connections is cut into
``k = max(ceil(L / FRAME_MAX), min(S, ceil(L / STRIPE_MIN)), 1)`` nearly equal
frames; frame ``i`` travels on connection ``i % S``.  Sender and receiver
compute the same cut from ``L`` and ``S``.

Threads, not selectors: each connection has a receiver thread that reads frames
straight into the posted receive buffer (``recv_into``, no copy) and a sender
thread fed by a queue that writes header and payload with one ``sendmsg``;
socket calls release the GIL, so the ``S`` streams of a pair move in parallel.
Sockets use ``TCP_NODELAY`` and 4 MiB buffers.  A :class:`Connection` puts its
socket in blocking mode once and never changes it: an unbounded read or write
blocks in the kernel (the data path: one system call per wake-up), a bounded one
passes ``MSG_DONTWAIT`` and waits in ``poll`` for its own deadline.  (Python's
``settimeout`` is per socket object: a writer setting its timeout while a reader
thread of the same socket ran without one used to switch the socket to
non-blocking under the reader, whose ``recv`` then failed with ``EAGAIN`` and
tore down a healthy control connection.)

Early frames: a frame of at least :data:`POST_WAIT_MIN` bytes whose receive is
not posted yet (a ring neighbour one step ahead) is left in the kernel's socket
buffer until the receive is posted, then read straight into it; it is read into a
private buffer (and copied on the post) only when another receive from that peer
is posted and incomplete (the application may wait for bytes queued behind it),
on a revoke, abort or close, or after :data:`POST_WAIT` seconds.  Frames are
never unpickled or interpreted: payloads are raw bytes.

Counters (exact once the requests are complete): ``bytes_sent`` /
``bytes_received`` (payload), ``wire_bytes_sent`` / ``wire_bytes_received``
(headers, payloads, AES-GCM tags), ``bytes_buffered`` (early payload bytes that
took the extra copy).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import queue
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Callable

import msgpack
import numpy as np

from commlib.core.errors import AuthenticationError, CommError, CommTimeout, InvalidArgument, ProcessFailed

from .base import Request, Transport, Wire, check_plain_dtype

__all__ = [
    "HEADER", "MAGIC", "VERSION", "K_CHALLENGE", "K_RESPONSE", "K_PROOF", "K_CTRL", "K_DATA", "K_PING",
    "PREAUTH_MAX", "CTRL_MAX", "FRAME_MAX", "UNEXPECTED_MAX", "FrameError", "Connection", "client_handshake",
    "server_handshake", "make_ticket", "verify_ticket", "frame_bounds", "TCPTransport", "Listener",
    "pack_ctrl", "unpack_ctrl", "tune_socket", "parse_address", "read_secret", "open_socket",
]

HEADER = struct.Struct("!2sBBHIQIHI")
MAGIC = b"CL"
VERSION = 1
K_CHALLENGE, K_RESPONSE, K_PROOF, K_CTRL, K_DATA, K_PING = 1, 2, 3, 4, 5, 6
_KINDS = frozenset((K_CHALLENGE, K_RESPONSE, K_PROOF, K_CTRL, K_DATA, K_PING))
F_SEALED = 1

PREAUTH_MAX = 4096            #: bytes of a frame before authentication
CTRL_MAX = 4 << 20            #: bytes of a msgpack control body
FRAME_MAX = 16 << 20          #: bytes of one data frame
STRIPE_MIN = 64 << 10         #: a message is striped only in pieces of at least this
UNEXPECTED_MAX = 1 << 30      #: bytes buffered for receives not yet posted, per transport
POST_WAIT = 0.5               #: seconds a receiver thread holds a frame that came before its receive was posted
POST_WAIT_MIN = 64 << 10      #: frames of at least this many bytes are held (smaller ones are buffered at once)
SOCK_BUF = 4 << 20
NONCE = 32
MAC = 32
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


def read_secret(secret: bytes | str | None = None, secret_file: str | None = None,
                env: str = "COMMLIB_ELASTIC_SECRET") -> bytes:
    """The shared secret: ``secret``, else the contents of ``secret_file``
    (surrounding whitespace stripped), else the environment variable ``env``.

    Raises:
        AuthenticationError: none given, or shorter than 16 bytes.
    """
    if secret is None and secret_file is not None:
        with open(secret_file, "rb") as f:
            secret = f.read().strip()
    if secret is None:
        secret = os.environ.get(env)
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise AuthenticationError(f"no shared secret: pass secret= or secret_file=, or set {env}", op="secret")
    if len(secret) < 16:
        raise AuthenticationError("the shared secret must be at least 16 bytes", op="secret")
    return bytes(secret)


def open_socket(address: str, timeout: float) -> socket.socket:
    """A TCP connection to ``"host:port"`` (not yet authenticated: pass it to :func:`client_handshake`).

    Raises:
        OSError: unreachable or refused.
    """
    return socket.create_connection(parse_address(address), timeout=timeout)


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


def frame_bounds(nbytes: int, streams: int) -> list[int]:
    """Byte offsets of the frames a message of ``nbytes`` is cut into (see the module docstring)."""
    k = max(-(-nbytes // FRAME_MAX), min(streams, -(-nbytes // STRIPE_MIN)), 1)
    base, extra = divmod(nbytes, k)
    return [i * base + min(i, extra) for i in range(k + 1)]


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


def _recv_exact_into(sock: socket.socket, mv: memoryview, deadline: float | None = None) -> None:
    """Fill ``mv`` from ``sock``, waiting at most until ``deadline`` (None: no bound).

    The socket stays in blocking mode: without a deadline each ``recv`` blocks in
    the kernel (one system call per wake-up on the data path); with one, each
    ``recv`` is ``MSG_DONTWAIT`` and the waits are ``poll`` calls bounded by it."""
    got, n = 0, len(mv)
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


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf), deadline)
    return buf


def _send_all(sock: socket.socket, data, deadline: float | None = None) -> None:
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


# ------------------------------------------------------------- AES-GCM
class _Sealer:
    """AES-256-GCM for one direction: implicit counter nonces (a replayed or
    reordered frame fails its tag), the frame header as associated data."""

    def __init__(self, key: bytes, direction: bytes):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.aead = AESGCM(key)
        self.direction = direction
        self.counter = 0

    def _nonce(self) -> bytes:
        n = self.direction + self.counter.to_bytes(8, "big")
        self.counter += 1
        return n

    def seal(self, header: bytes, payload) -> bytes:
        return self.aead.encrypt(self._nonce(), bytes(payload), header)

    def open(self, header: bytes, payload) -> bytes:
        try:
            return self.aead.decrypt(self._nonce(), bytes(payload), header)
        except Exception:  # noqa: BLE001 - InvalidTag
            raise FrameError("sealed frame failed authentication") from None


def _derive_keys(secret: bytes, ns: bytes, nc: bytes) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=ns + nc, info=b"commlib-elastic aes-gcm v1").derive(secret)
    return okm[:32], okm[32:]  # client→server, server→client


# ------------------------------------------------------------- connection
class Connection:
    """One authenticated TCP connection: framed, thread-safe sends, one reader.

    Attributes:
        sock: the socket.
        hello: the client's hello (a dict) as the server received it (server side).
        peer: free slot for the owner (peer id, rank...).
    """

    def __init__(self, sock: socket.socket, *, tx: _Sealer | None = None, rx: _Sealer | None = None):
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
            timeout: seconds the write may block (None: unbounded).

        Returns:
            bytes written: the 28-byte header, the payload and, sealed, its 16-byte tag.

        Raises:
            ConnectionError / OSError: the connection failed (it is then closed).
        """
        mv = memoryview(payload).cast("B") if not isinstance(payload, (bytes, bytearray)) else payload
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                if self.tx is not None:
                    n = len(mv) + GCM_TAG
                    hdr = HEADER.pack(MAGIC, VERSION, kind, F_SEALED, epoch, tag, chunk, stream, n)
                    body = self.tx.seal(hdr, mv)
                    _send_all(self.sock, hdr + body, deadline)
                    return HEADER.size + n
                hdr = HEADER.pack(MAGIC, VERSION, kind, 0, epoch, tag, chunk, stream, len(mv))
                if len(mv) <= 65536:
                    _send_all(self.sock, hdr + bytes(mv), deadline)
                else:
                    # header and payload in one system call (one segment less), the rest as it drains
                    try:
                        sent = self.sock.sendmsg([hdr, mv], [], 0 if deadline is None else _DONTWAIT)
                    except BlockingIOError:  # MSG_DONTWAIT with a full buffer
                        sent = 0
                    if sent < HEADER.size:
                        _send_all(self.sock, hdr[sent:], deadline)
                        _send_all(self.sock, mv, deadline)
                    elif sent < HEADER.size + len(mv):
                        _send_all(self.sock, mv[sent - HEADER.size:], deadline)
                return HEADER.size + len(mv)
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
        raw = bytes(_recv_exact(self.sock, HEADER.size, deadline))
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
            body = _recv_exact(self.sock, length, deadline)
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
        return bytes(_recv_exact(self.sock, length, deadline))

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


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes, hello: bytes) -> bytes:
    return hmac.new(secret, label + a + b + hello, hashlib.sha256).digest()


def client_handshake(sock: socket.socket, secret: bytes, hello: dict, *, timeout: float = 10.0,
                     encrypt: bool = False) -> Connection:
    """Authenticate to a server (both directions) and send ``hello``.

    Raises:
        AuthenticationError: the server did not prove knowledge of the secret, or
            closed the connection (a wrong secret on our side looks the same).
        CommTimeout: ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    tune_socket(sock)
    conn = Connection(sock)
    try:
        kind, _, _, _, _, _, length = conn.read_header(deadline)
        if kind != K_CHALLENGE or length != NONCE:
            raise FrameError("expected a challenge")
        ns = bytes(conn.read_payload(length, deadline=deadline))
        nc = secrets.token_bytes(NONCE)
        hb = pack_ctrl(hello)
        if len(hb) + 2 * NONCE > PREAUTH_MAX:
            raise InvalidArgument("hello too large", op="handshake")
        conn.send_frame(K_RESPONSE, nc + _mac(secret, b"commlib-c", ns, nc, hb) + hb,
                        timeout=max(0.001, deadline - time.monotonic()))
        kind, _, _, _, _, _, length = conn.read_header(deadline)
        if kind != K_PROOF or length != MAC:
            raise FrameError("expected a proof")
        proof = bytes(conn.read_payload(length, deadline=deadline))
        if not hmac.compare_digest(proof, _mac(secret, b"commlib-s", nc, ns, hb)):
            raise AuthenticationError("the server failed to prove the shared secret", op="handshake")
    except socket.timeout:
        conn.close()
        raise CommTimeout(f"handshake not complete after {timeout} s", op="handshake") from None
    except (FrameError, ConnectionError, OSError) as exc:
        conn.close()
        raise AuthenticationError(f"handshake refused ({type(exc).__name__})", op="handshake") from None
    except BaseException:
        conn.close()
        raise
    if encrypt:
        c2s, s2c = _derive_keys(secret, ns, nc)
        conn.tx, conn.rx = _Sealer(c2s, b"c2s_"), _Sealer(s2c, b"s2c_")
    return conn


def server_handshake(sock: socket.socket, secret: bytes, *, timeout: float = 5.0,
                     encrypt: bool = False) -> Connection | None:
    """Challenge a client; returns the authenticated connection (``conn.hello``
    holds its hello) or None after closing it silently (wrong MAC, malformed
    frame, deadline)."""
    deadline = time.monotonic() + timeout
    try:
        tune_socket(sock)
    except OSError:
        pass
    conn = Connection(sock)
    try:
        ns = secrets.token_bytes(NONCE)
        conn.send_frame(K_CHALLENGE, ns, timeout=timeout)
        kind, _, _, _, _, _, length = conn.read_header(deadline)
        if kind != K_RESPONSE or not 2 * NONCE <= length <= PREAUTH_MAX:
            raise FrameError("bad response")
        body = bytes(conn.read_payload(length, deadline=deadline))
        nc, mac, hb = body[:NONCE], body[NONCE:NONCE + MAC], body[2 * NONCE:]
        if not hmac.compare_digest(mac, _mac(secret, b"commlib-c", ns, nc, hb)):
            raise FrameError("bad mac")
        hello = unpack_ctrl(hb, PREAUTH_MAX)
        if not isinstance(hello, dict):
            raise FrameError("bad hello")
        conn.send_frame(K_PROOF, _mac(secret, b"commlib-s", nc, ns, hb),
                        timeout=max(0.001, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001 - anything wrong: close without a word
        conn.close()
        return None
    if encrypt:
        c2s, s2c = _derive_keys(secret, ns, nc)
        conn.tx, conn.rx = _Sealer(s2c, b"s2c_"), _Sealer(c2s, b"c2s_")
    conn.hello = hello
    return conn


# ------------------------------------------------------------- tickets
def make_ticket(key: bytes, epoch: int, src: int, dst: int, stream: int, expiry: float) -> bytes:
    """The master's ticket for connection ``stream`` from peer ``src`` to peer
    ``dst`` in ``epoch``, valid until ``expiry`` (Unix seconds): HMAC-SHA256 under
    ``dst``'s ticket key (which only the master and ``dst`` hold)."""
    msg = struct.pack("!IQQHd", epoch, src, dst, stream, float(expiry))
    return hmac.new(key, b"commlib-ticket" + msg, hashlib.sha256).digest()


def verify_ticket(key: bytes, ticket, epoch: int, src: int, dst: int, stream: int, expiry: float,
                  skew: float = 300.0) -> bool:
    """True when ``ticket`` is the master's for these fields and not expired."""
    if not isinstance(ticket, bytes) or len(ticket) != MAC:
        return False
    try:
        want = make_ticket(key, epoch, src, dst, stream, expiry)
    except (struct.error, TypeError, OverflowError):
        return False
    return hmac.compare_digest(ticket, want) and time.time() <= float(expiry) + skew


# ------------------------------------------------------------- listener
class Listener:
    """A listening socket whose accepted connections are authenticated each on
    its own short-lived thread (a slow or hostile client cannot block others)
    and handed to ``on_conn(conn)``; failures are closed silently.

    Args:
        bind: ``"host:port"`` (port 0: any free port).
        secret: shared secret.
        on_conn: called with each authenticated :class:`Connection`.
        encrypt: seal frames after the handshake.
        handshake_timeout: seconds for the whole handshake.
        max_pending: handshakes in flight at once (more are closed at once).
    """

    def __init__(self, bind: str, secret: bytes, on_conn: Callable[[Connection], None], *, encrypt: bool = False,
                 handshake_timeout: float = 5.0, max_pending: int = 64):
        host, port = parse_address(bind)
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.secret, self.on_conn, self.encrypt = secret, on_conn, encrypt
        self.handshake_timeout = handshake_timeout
        self._slots = threading.BoundedSemaphore(max_pending)
        self._stop = False
        h, p = self.sock.getsockname()[:2]
        self.address = f"[{h}]:{p}" if fam == socket.AF_INET6 else f"{h}:{p}"
        self._thread = threading.Thread(target=self._accept_loop, name="commlib-tcp-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                s, _ = self.sock.accept()
            except OSError:
                if self._stop:
                    return
                time.sleep(0.01)
                continue
            if not self._slots.acquire(blocking=False):
                s.close()
                continue
            threading.Thread(target=self._handshake, args=(s,), daemon=True, name="commlib-tcp-hs").start()

    def _handshake(self, s: socket.socket) -> None:
        try:
            conn = server_handshake(s, self.secret, timeout=self.handshake_timeout, encrypt=self.encrypt)
        finally:
            self._slots.release()
        if conn is None:
            return
        try:
            self.on_conn(conn)
        except Exception:  # noqa: BLE001 - a refused connection is closed silently
            conn.close()

    def close(self) -> None:
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass


# ------------------------------------------------------------- transport
class _Slot:
    """One message of one (source, tag): a posted receive and/or frames that came first."""

    __slots__ = ("req", "view", "bounds", "frames", "arrived", "done")

    def __init__(self):
        self.req = None          # the TCPRequest once posted
        self.view = None         # memoryview of the posted buffer (bytes)
        self.bounds = None       # frame offsets once posted
        self.frames = {}         # index -> bytes received before the post
        self.arrived = set()     # frame indices seen
        self.done = 0            # frames placed in view


class TCPRequest(Request):
    """A send or receive on a :class:`TCPTransport` (frames outstanding → done)."""

    __slots__ = ("transport", "peer", "left", "error", "event", "kind", "on_complete", "_tag")

    def __init__(self, transport, peer: int, left: int, kind: str):
        self.transport, self.peer, self.left, self.kind = transport, peer, left, kind
        self.error: BaseException | None = None
        self.event = threading.Event()
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
            if t._failure is not None:
                raise t._failure
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


class _Link:
    """The ``S`` connections to one peer, with a sender thread per connection."""

    def __init__(self, transport, rank: int, streams: int):
        self.t, self.rank, self.streams = transport, rank, streams
        self.conns: list[Connection | None] = [None] * streams
        self.queues = [queue.SimpleQueue() for _ in range(streams)]
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
        while True:
            job = q.get()
            if job is None:
                return
            req, mv, idx, tag = job
            try:
                if self.failed is None and not self.t._dead:
                    n = conn.send_frame(K_DATA, mv, epoch=self.t.epoch, tag=tag, chunk=idx, stream=stream)
                    with self.t._lock:
                        self.t.wire_bytes_sent += n
                        req._frame_done()
                else:
                    req._fail(self.failed or self.t._failure or ProcessFailed("transport closed", failed=[self.rank]))
            except Exception as exc:  # noqa: BLE001
                self.t._link_failed(self, exc)
                req._fail(self.t._peer_error(self.rank, "isend"))

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for c in self.conns:
            if c is not None:
                c.close()


class TCPTransport(Transport):
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

    Raises:
        InvalidArgument: ``streams`` out of 1..64.
    """

    name = "tcp"
    fault_tolerant = True
    thread_multiple = True
    tag_ub = (1 << 62)

    def __init__(self, rank: int, size: int, epoch: int, connect: Callable[[int, int], Connection], *,
                 streams: int | Callable[[int], int] = 4, timeout: float | None = 30.0):
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
        self._unexpected = 0
        self._failure: BaseException | None = None
        self._failed: set[int] = set()
        self._aborted: set[int] = set()
        self._dead = False
        self.bytes_sent = 0           # payload bytes of the messages posted with isend
        self.bytes_received = 0       # payload bytes of DATA frames placed or buffered
        self.wire_bytes_sent = 0      # DATA frames written: header + payload (+ AES-GCM tag)
        self.wire_bytes_received = 0  # DATA and PING frames read, dropped ones too
        self.bytes_buffered = 0       # payload bytes that came before their receive was posted (one extra copy)

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
            early, link.early = link.early, []
            for req, mv in early:
                self._enqueue(link, req, mv)
            for (src, _tag), dq in self._slots.items():
                if src == link.rank:
                    for slot in dq:
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
        return ProcessFailed(f"connection to rank {peer} failed (epoch {self.epoch})", failed=[peer],
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

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        mv = self._bytes_view(buf, "isend", self._rank)
        link = self._link(dest)
        with self._lock:
            if self._failure is not None:
                raise self._failure
            streams = link.streams
        bounds = frame_bounds(len(mv), streams or 1)  # provisional: recut when an inbound link attaches
        req = TCPRequest(self, dest, len(bounds) - 1, "isend")
        req._tag = tag
        with self._lock:
            self.bytes_sent += len(mv)
            if link.streams is None:  # inbound link not yet attached: striped when it is
                link.early.append((req, mv))
                return req
            self._enqueue(link, req, mv)
        return req

    def _enqueue(self, link: _Link, req: TCPRequest, mv: memoryview) -> None:
        bounds = frame_bounds(len(mv), link.streams)
        req.left = len(bounds) - 1
        if link.failed is not None:
            req._fail(self._peer_error(link.rank, "isend"))
            return
        for i in range(len(bounds) - 1):
            link.queues[i % link.streams].put((req, mv[bounds[i]:bounds[i + 1]], i, req._tag))

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        mv = self._bytes_view(buf, "irecv", self._rank)
        link = self._link(source)
        with self._lock:
            if self._failure is not None:
                raise self._failure
            dq = self._slots.setdefault((source, tag), deque())
            slot = None
            for s in dq:
                if s.req is None:
                    slot = s
                    break
            if slot is None:
                slot = _Slot()
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

    def _post_locked(self, slot: _Slot, streams: int, key) -> None:
        slot.bounds = frame_bounds(len(slot.view), streams)
        n = len(slot.bounds) - 1
        slot.req.left = n
        slot.req.event.clear() if n else slot.req.event.set()
        for idx, data in list(slot.frames.items()):
            if idx >= n or len(data) != slot.bounds[idx + 1] - slot.bounds[idx]:
                slot.req._fail(ProcessFailed(f"message from rank {key[0]} does not match the posted receive",
                                             failed=[key[0]], rank=self._rank, op="irecv"))
                return
            slot.view[slot.bounds[idx]:slot.bounds[idx + 1]] = data
            self._unexpected -= len(data)
            slot.req._frame_done()
        slot.frames.clear()
        self._retire_locked(key)
        self._posted.notify_all()

    def _retire_locked(self, key) -> None:
        dq = self._slots.get(key)
        while dq and dq[0].req is not None and dq[0].bounds is not None and dq[0].req.event.is_set():
            dq.popleft()
        if dq is not None and not dq:
            del self._slots[key]

    def _await_post_locked(self, link: _Link, src: int, tag: int, slot: _Slot) -> bool:
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
        return tag in self._aborted or self._dead

    def _other_posted_locked(self, src: int, slot: _Slot) -> bool:
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
                    drop = epoch != self.epoch or tag in self._aborted or self._dead
                    target = None
                    slot = None
                    if not drop:
                        key = (src, tag)
                        dq = self._slots.setdefault(key, deque())
                        for s in dq:
                            if chunk not in s.arrived:
                                slot = s
                                break
                        if slot is None:
                            slot = _Slot()
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
                                raise FrameError("frame does not match the posted receive")
                            target = slot.view[slot.bounds[chunk]:slot.bounds[chunk + 1]]
                        else:
                            if self._unexpected + plain > UNEXPECTED_MAX:
                                raise FrameError("too many unexpected bytes")
                            self._unexpected += plain
                            self.bytes_buffered += plain
                if drop:
                    conn.discard(length)
                    with self._lock:
                        self.wire_bytes_received += HEADER.size + length
                    continue
                if target is not None:
                    conn.read_payload(length, into=target)
                    with self._lock:
                        self.bytes_received += plain
                        self.wire_bytes_received += HEADER.size + length
                        slot.req._frame_done()
                        self._retire_locked((src, tag))
                else:
                    data = np.empty(plain, np.uint8)  # not zeroed: every byte is overwritten
                    conn.read_payload(length, into=memoryview(data))
                    with self._lock:
                        self.bytes_received += plain
                        self.wire_bytes_received += HEADER.size + length
                        if slot.bounds is not None:  # posted while we read
                            a, b = slot.bounds[chunk], slot.bounds[chunk + 1]
                            slot.view[a:b] = data
                            self._unexpected -= plain
                            slot.req._frame_done()
                            self._retire_locked((src, tag))
                        else:
                            slot.frames[chunk] = data
        except Exception as exc:  # noqa: BLE001 - a closed or malformed link fails its peer
            if not self._dead:
                self._link_failed(link, exc)

    # waits -----------------------------------------------------------------
    def waitall(self, requests, timeout: float | None = None, op: str = "waitall") -> None:
        """Wait for ``requests``; bounded by ``timeout`` (else the transport's default).

        Raises:
            ProcessFailed: a peer's connection failed, or the transport was revoked.
            CommTimeout: the deadline passed.
        """
        if timeout is None:
            timeout = self.timeout
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
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._failed))

    def abort_tag(self, tag: int) -> None:
        """Drop every later frame of operation ``tag``."""
        with self._lock:
            self._aborted.add(tag)
            self._posted.notify_all()

    def revoke(self, reason: str = "operation aborted") -> None:
        """Fail every pending and later request (an abort from the master)."""
        with self._lock:
            if self._failure is None:
                self._failure = ProcessFailed(f"{reason} (epoch {self.epoch})", failed=sorted(self._failed),
                                              rank=self._rank, op="tcp")
            for dq in self._slots.values():
                for slot in dq:
                    if slot.req is not None:
                        slot.req._fail(self._failure)
            self._posted.notify_all()

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
