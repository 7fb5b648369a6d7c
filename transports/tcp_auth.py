"""Authentication of the TCP transport's connections: the handshake
(:func:`client_handshake`, :func:`server_handshake`), the AES-GCM sealing of
frames it can switch on, keyed by an ephemeral X25519 exchange, the master's
tickets (:func:`make_ticket`, :func:`verify_ticket`), the shared secret
(:func:`read_secret`), and the :class:`Listener` that authenticates the
connections it accepts in one event loop.

The handshake runs over the frames of :mod:`commlib.transports.tcp_frames`; a
frame before authentication carries at most :data:`PREAUTH_MAX` bytes, and
anything wrong closes the connection without a reply.

Handshake (both directions, one deadline, HMAC-SHA256 over the shared secret,
``hmac.compare_digest``):

1. server → client ``CHALLENGE``: 32 random bytes ``Ns`` (with, at most, a
   ``BUSY`` frame when the listener evicts the connection, the only bytes an
   unauthenticated party ever receives);
2. client → server ``RESPONSE``: ``Nc`` (32 random bytes), then
   ``HMAC(secret, "commlib-c" | Ns | Nc | hello)`` (32), then ``hello`` (msgpack:
   who the client is, the ticket of a peer-to-peer connection; with
   ``encrypt=True`` also ``x25519``: the client's ephemeral X25519 public key);
3. server checks it (a wrong MAC: close, nothing sent), → client ``PROOF``:
   ``HMAC(secret, "commlib-s" | Nc | Ns | hello | Ps)`` then ``Ps``, the server's
   ephemeral X25519 public key (empty when the server does not encrypt); the
   client checks it.  Either side that finds the other's ``encrypt`` setting
   differs from its own closes: the client raises :class:`EncryptionMismatch`
   (both proved the secret, so the cause may be named).

A replayed RESPONSE fails because ``Ns`` is fresh per connection.  With
``encrypt=True`` both sides derive two AES-256-GCM keys (one per direction)
with HKDF-SHA256 from the X25519 shared secret, salted with
``HMAC(secret, "commlib-kdf" | Ns | Nc | hello | Ps)``; the private keys live
only for the handshake.  Recording a session and learning the shared secret
later does not give its keys (forward secrecy); the HMACs keep an on-path
party without the secret from substituting its own public keys.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import random
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Callable

from commlib.core.config import config
from commlib.core.errors import (AuthenticationError, CommTimeout, EncryptionMismatch, InvalidArgument,
                                 NoHandshakeSlot, SecretError, SilentPort)

from .tcp_frames import (HEADER, K_BUSY, K_CHALLENGE, K_PROOF, K_RESPONSE, MAGIC, VERSION, Connection, FrameError,
                         open_socket, send_all, pack_ctrl, parse_address, tune_socket, unpack_ctrl)

__all__ = [
    "PREAUTH_MAX", "NONCE", "MAC", "KX", "HANDSHAKE_TIMEOUT", "MAX_PENDING", "PER_SOURCE", "read_secret",
    "client_handshake", "server_handshake", "make_ticket", "verify_ticket", "retry_delay", "dial", "Listener",
]

PREAUTH_MAX = 4096            #: bytes of a frame before authentication
NONCE = 32
MAC = 32
KX = "x25519"                 #: the hello's key for the client's ephemeral X25519 public key
HANDSHAKE_TIMEOUT = 3.0       #: seconds a listener gives a connection to send its whole RESPONSE
MAX_PENDING = 1024            #: unauthenticated connections a listener holds at once
PER_SOURCE = 64               #: of which from one source address (IPv6: one /64)


# ------------------------------------------------------------- secret
def read_secret(secret: bytes | str | None = None, secret_file: str | None = None) -> bytes:
    """The shared secret: ``secret``, else the contents of ``secret_file``
    (surrounding whitespace stripped), else ``COMMLIB_ELASTIC_SECRET``
    (:attr:`commlib.core.config.Config.elastic_secret`, read at each use).

    Raises:
        SecretError: none given, ``secret_file`` missing, unreadable or empty, or
            the secret shorter than 16 bytes (each message names the file).
    """
    where = "the shared secret"
    if secret is None and secret_file is not None:
        where = f"the secret in {secret_file!r}"
        try:
            with open(secret_file, "rb") as f:
                secret = f.read().strip()
        except FileNotFoundError:
            raise SecretError(f"the secret file {secret_file!r} does not exist", op="secret") from None
        except OSError as exc:
            raise SecretError(f"cannot read the secret file {secret_file!r}: {exc.strerror or exc}",
                              op="secret") from None
        if not secret:
            raise SecretError(f"the secret file {secret_file!r} is empty (or only whitespace)", op="secret")
    if secret is None:
        secret = config.elastic_secret
        where = "COMMLIB_ELASTIC_SECRET"
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise SecretError("no shared secret: pass secret= or secret_file=, or set COMMLIB_ELASTIC_SECRET",
                          op="secret")
    if len(secret) < 16:
        raise SecretError(f"{where} must be at least 16 bytes (got {len(secret)})", op="secret")
    return bytes(secret)


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


def _derive_keys(ecdh: bytes, secret: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(client→server, server→client) AES-256-GCM keys: HKDF-SHA256 of the X25519
    shared secret ``ecdh``, salted with an HMAC of the handshake ``transcript``
    under the shared ``secret`` (both are needed: the secret alone, with a
    recording of the handshake, does not give the keys)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    salt = hmac.new(secret, b"commlib-kdf" + transcript, hashlib.sha256).digest()
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=salt, info=b"commlib-elastic aes-gcm v2").derive(ecdh)
    return okm[:32], okm[32:]


def _x25519_pair():
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    priv = X25519PrivateKey.generate()
    return priv, priv.public_key().public_bytes_raw()


def _x25519_shared(priv, peer_pub: bytes) -> bytes:
    """The X25519 shared secret; FrameError for a malformed or low-order public key."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    try:
        return priv.exchange(X25519PublicKey.from_public_bytes(peer_pub))
    except Exception:  # noqa: BLE001 - ValueError: an all-zero result (a low-order point)
        raise FrameError("bad key exchange") from None


# ------------------------------------------------------------- handshake
def _mac(secret: bytes, label: bytes, a: bytes, b: bytes, hello: bytes) -> bytes:
    return hmac.new(secret, label + a + b + hello, hashlib.sha256).digest()


def _frame(kind: int, payload: bytes) -> bytes:
    """A plain frame (before authentication)."""
    return HEADER.pack(MAGIC, VERSION, kind, 0, 0, 0, 0, 0, len(payload)) + payload


#: the payload of a BUSY frame: why the listener closed the connection
BUSY_NO_SLOT = b"\x01"


def retry_delay(attempt: int, base: float = 0.05, cap: float = 1.0) -> float:
    """Seconds to wait before retry ``attempt`` (1, 2, ...) of a failed dial:
    exponential backoff with full jitter (uniform in ``[0, min(cap, base * 2**attempt)]``),
    so many peers retrying at once spread out instead of arriving together."""
    return random.uniform(0.0, min(cap, base * (2 ** min(attempt, 16))))


def dial(addr: str, secret: bytes, hello: dict, deadline: float, *, encrypt: bool, who: str,
         refused: Callable[[], BaseException], gave_up: Callable[[int, BaseException | None], BaseException],
         check: Callable[[], None] | None = None) -> Connection:
    """An authenticated connection to ``addr``, retried until ``deadline`` (``time.monotonic()``).

    A port not listening yet, a busy listener (no handshake slot) or a silent
    one is retried after :func:`retry_delay`; a refused connection raises
    ``refused()`` at once (the process is gone), and running out of time raises
    ``gave_up(tries, last_error)``.  ``check()`` runs before each retry and may
    raise to give up early."""
    tries, last = 0, None
    while True:
        tries += 1
        left = max(0.05, deadline - time.monotonic())
        try:
            s = open_socket(addr, left)
        except ConnectionRefusedError:
            raise refused() from None
        except OSError as exc:  # a connect timeout, an unreachable network: not reached (yet)
            last = exc
        else:
            try:
                return client_handshake(s, secret, hello, timeout=left, encrypt=encrypt, name=who)
            except (NoHandshakeSlot, CommTimeout) as exc:  # busy or silent (SilentPort): not a death
                last = exc
        if check is not None:
            check()
        delay = retry_delay(tries)
        if time.monotonic() + delay >= deadline:
            raise gave_up(tries, last)
        time.sleep(delay)


def _busy_queued(sock: socket.socket) -> bool:
    """True when a BUSY frame already waits after the challenge (a peek, no wait)."""
    try:
        head = sock.recv(HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    return len(head) == HEADER.size and HEADER.unpack(head)[2] == K_BUSY


def _peer_name(sock: socket.socket) -> str:
    try:
        h, p = sock.getpeername()[:2]
        return f"{h}:{p}"
    except OSError:
        return "the server"


def client_handshake(sock: socket.socket, secret: bytes, hello: dict, *, timeout: float = 10.0,
                     encrypt: bool = False, name: str | None = None) -> Connection:
    """Authenticate to a server (both directions) and send ``hello``.

    Args:
        name: how error messages name the server (default: its address).

    Raises:
        SilentPort: the server accepted the connection but sent no challenge within ``timeout``.
        NoHandshakeSlot: the listener had no handshake slot (it replied BUSY): retry later.
        EncryptionMismatch: both sides proved the secret; one encrypts, the other does not.
        AuthenticationError: the server closed the handshake after our response (a
            wrong secret on either side), failed to prove the secret, or did not
            speak the protocol.
        CommTimeout: ``timeout`` seconds passed after the challenge.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    who = name or _peer_name(sock)
    tune_socket(sock)
    conn = Connection(sock)
    stage = "challenge"
    try:
        kind, _, _, _, _, _, length = conn.read_header(deadline)
        if kind == K_BUSY:
            raise NoHandshakeSlot(f"{who} has no handshake slot free for this connection (busy: too many "
                                  "unauthenticated connections from this address); not a secret problem",
                                  op="handshake")
        if kind != K_CHALLENGE or length != NONCE:
            raise FrameError("expected a challenge")
        ns = bytes(conn.read_payload(length, deadline=deadline))
        if _busy_queued(sock):  # evicted while this side was not looking: say so before answering
            raise NoHandshakeSlot(f"{who} dropped this handshake for lack of a slot (busy: too many "
                                  "unauthenticated connections from this address); not a secret problem",
                                  op="handshake")
        nc = secrets.token_bytes(NONCE)
        h = dict(hello)
        priv = None
        if encrypt:
            priv, h[KX] = _x25519_pair()
        hb = pack_ctrl(h)
        if len(hb) + 2 * NONCE > PREAUTH_MAX:
            raise InvalidArgument("hello too large", op="handshake")
        stage = "response"
        conn.send_frame(K_RESPONSE, nc + _mac(secret, b"commlib-c", ns, nc, hb) + hb,
                        timeout=max(0.001, deadline - time.monotonic()))
        kind, _, _, _, _, _, length = conn.read_header(deadline)
        if kind == K_BUSY:
            raise NoHandshakeSlot(f"{who} dropped this handshake for lack of a slot (busy); not a secret problem",
                                  op="handshake")
        if kind != K_PROOF or length not in (MAC, MAC + 32):
            raise FrameError("expected a proof")
        body = bytes(conn.read_payload(length, deadline=deadline))
        proof, spub = body[:MAC], body[MAC:]
        if not hmac.compare_digest(proof, _mac(secret, b"commlib-s", nc, ns, hb + spub)):
            raise AuthenticationError(f"{who} failed to prove the shared secret", op="handshake")
        if encrypt and not spub:
            raise EncryptionMismatch(f"{who} does not encrypt frames, and this side does (encrypt=True): start the "
                                     "master and every peer with the same setting (--encrypt or not)",
                                     op="handshake")
        if not encrypt and spub:
            raise EncryptionMismatch(f"{who} encrypts frames (encrypt=True / --encrypt), and this side does not: "
                                     "start the master and every peer with the same setting", op="handshake")
    except socket.timeout:
        conn.close()
        if stage == "challenge":
            raise SilentPort(f"{who} accepted the connection but sent no challenge within {timeout:g} s: not a "
                             "commlib listener, or a stalled process", op="handshake") from None
        raise CommTimeout(f"handshake with {who} not complete after {timeout:g} s", op="handshake") from None
    except (NoHandshakeSlot, EncryptionMismatch, AuthenticationError, InvalidArgument):
        conn.close()
        raise
    except (FrameError, ConnectionError, OSError) as exc:
        conn.close()
        if isinstance(exc, ConnectionResetError) and stage == "response":
            # a server that refuses a wrong MAC closes after reading the whole response (a
            # clean end of stream); a reset means our response arrived after it dropped us
            raise NoHandshakeSlot(f"{who} reset the connection during the handshake: dropped for lack of a slot "
                                  "(a flood of connections), or its process stopped; not a secret problem",
                                  op="handshake") from None
        if stage == "challenge":
            raise AuthenticationError(f"{who} did not send a commlib challenge ({type(exc).__name__}): not a "
                                      "commlib listener?", op="handshake") from None
        took = time.monotonic() - t0
        slow = (f"; or this side was too slow: {took:.1f} s, the listener allows {HANDSHAKE_TIMEOUT:g} s"
                if took > 0.8 * HANDSHAKE_TIMEOUT else "")
        raise AuthenticationError(f"{who} closed the handshake after our response ({type(exc).__name__}): the shared "
                                  f"secret differs between the two sides{slow}", op="handshake") from None
    except BaseException:
        conn.close()
        raise
    if encrypt:
        c2s, s2c = _derive_keys(_x25519_shared(priv, spub), secret, ns + nc + hb + spub)
        conn.tx, conn.rx = _Sealer(c2s, b"c2s_"), _Sealer(s2c, b"s2c_")
    return conn


class _ServerHandshake:
    """The server side of one handshake, driven by the bytes that arrive (no
    socket, no thread): :attr:`challenge` to send first, then :meth:`feed` until it
    returns True; then :attr:`proof` (to send), :attr:`hello`, :attr:`keys`
    (``(tx, rx)`` sealers or None) and :attr:`mismatch` (True: the client's
    ``encrypt`` setting differs; close after sending the proof).

    Anything wrong raises :class:`FrameError` (close without a word)."""

    __slots__ = ("secret", "encrypt", "ns", "challenge", "buf", "need", "length", "proof", "hello", "keys",
                 "mismatch")

    def __init__(self, secret: bytes, encrypt: bool):
        self.secret, self.encrypt = secret, encrypt
        self.ns = secrets.token_bytes(NONCE)
        self.challenge = _frame(K_CHALLENGE, self.ns)
        self.buf = bytearray()
        self.need = HEADER.size
        self.length = None
        self.proof = self.hello = self.keys = None
        self.mismatch = False

    def want(self) -> int:
        """Bytes still missing from the RESPONSE (never more than its frame)."""
        return self.need - len(self.buf)

    def feed(self, data: bytes) -> bool:
        self.buf += data
        if self.length is None and len(self.buf) >= HEADER.size:
            magic, version, kind, flags, _e, _t, _c, _s, length = HEADER.unpack(bytes(self.buf[:HEADER.size]))
            if (magic != MAGIC or version != VERSION or kind != K_RESPONSE or flags
                    or not 2 * NONCE <= length <= PREAUTH_MAX):
                raise FrameError("bad response")
            self.length, self.need = length, HEADER.size + length
        if self.length is None or len(self.buf) < self.need:
            return False
        if len(self.buf) > self.need:
            raise FrameError("bytes after the response")
        self._verify(bytes(self.buf[HEADER.size:]))
        self.buf = bytearray()
        return True

    def _verify(self, body: bytes) -> None:
        nc, mac, hb = body[:NONCE], body[NONCE:NONCE + MAC], body[2 * NONCE:]
        if not hmac.compare_digest(mac, _mac(self.secret, b"commlib-c", self.ns, nc, hb)):
            raise FrameError("bad mac")
        hello = unpack_ctrl(hb, PREAUTH_MAX)
        if not isinstance(hello, dict):
            raise FrameError("bad hello")
        cpub = hello.pop(KX, None)
        spub = b""
        if self.encrypt:
            priv, spub = _x25519_pair()
            if isinstance(cpub, bytes) and len(cpub) == 32:
                c2s, s2c = _derive_keys(_x25519_shared(priv, cpub), self.secret, self.ns + nc + hb + spub)
                self.keys = (_Sealer(s2c, b"s2c_"), _Sealer(c2s, b"c2s_"))
            else:
                self.mismatch = True
        elif cpub is not None:
            self.mismatch = True
        self.proof = _frame(K_PROOF, _mac(self.secret, b"commlib-s", nc, self.ns, hb + spub) + spub)
        self.hello = hello


def _finish(sock: socket.socket, hs: _ServerHandshake, deadline: float) -> Connection | None:
    """Send the proof of a verified handshake; the authenticated connection, or None
    (closed) when the client's encryption setting differs or the send failed."""
    try:
        tune_socket(sock)
    except OSError:
        pass
    conn = Connection(sock)
    try:
        send_all(sock, hs.proof, deadline)
    except Exception:  # noqa: BLE001
        conn.close()
        return None
    if hs.mismatch:
        conn.close()  # the client learns why from the proof; nothing else is sent
        return None
    if hs.keys is not None:
        conn.tx, conn.rx = hs.keys
    conn.hello = hs.hello
    return conn


def server_handshake(sock: socket.socket, secret: bytes, *, timeout: float = HANDSHAKE_TIMEOUT,
                     encrypt: bool = False) -> Connection | None:
    """Challenge a client (blocking, on the caller's thread); returns the
    authenticated connection (``conn.hello`` holds its hello) or None after closing
    it silently (wrong MAC, malformed frame, deadline, an encryption mismatch).
    :class:`Listener` runs the same steps for many connections in one event loop."""
    deadline = time.monotonic() + timeout
    try:
        tune_socket(sock)
    except OSError:
        pass
    conn = Connection(sock)
    hs = _ServerHandshake(secret, encrypt)
    try:
        send_all(sock, hs.challenge, deadline)
        from .tcp_frames import recv_exact  # noqa: PLC0415 - a helper of the frames module
        while not hs.feed(bytes(recv_exact(sock, hs.want(), deadline))):
            pass
    except Exception:  # noqa: BLE001 - anything wrong: close without a word
        conn.close()
        return None
    return _finish(sock, hs, deadline)


# ------------------------------------------------------------- tickets
def make_ticket(key: bytes, epoch: int, src: int, dst: int, stream: int, expiry: float, purpose: str = "ring",
                round: int = 0) -> bytes:  # noqa: A002 - the sync round
    """The master's ticket for connection ``stream`` from peer ``src`` to peer
    ``dst`` in ``epoch``, for ``purpose`` (``"ring"``: a collective's data
    connection; ``"fetch"``: a state fetch of sync ``round``), valid until
    ``expiry`` (Unix seconds): HMAC-SHA256 under ``dst``'s ticket key (which only
    the master and ``dst`` hold).  A ticket is good for nothing else: another
    epoch, round, pair, stream or purpose fails its MAC."""
    p = purpose.encode()
    if len(p) > 32:
        raise ValueError("purpose too long")
    msg = struct.pack("!B", len(p)) + p + struct.pack("!IQQQHd", epoch, round, src, dst, stream, float(expiry))
    return hmac.new(key, b"commlib-ticket-v2" + msg, hashlib.sha256).digest()


def verify_ticket(key: bytes, ticket, epoch: int, src: int, dst: int, stream: int, expiry: float,
                  skew: float = 300.0, purpose: str = "ring", round: int = 0) -> bool:  # noqa: A002
    """True when ``ticket`` is the master's for these fields and not expired."""
    if not isinstance(ticket, bytes) or len(ticket) != MAC or not isinstance(purpose, str):
        return False
    try:
        want = make_ticket(key, epoch, src, dst, stream, expiry, purpose, round)
    except (struct.error, TypeError, OverflowError, ValueError, UnicodeError):
        return False
    return hmac.compare_digest(ticket, want) and time.time() <= float(expiry) + skew


# ------------------------------------------------------------- listener
class _Pending:
    """An accepted connection that has not authenticated yet (no thread: the loop feeds it)."""

    __slots__ = ("sock", "fd", "src", "deadline", "hs")

    def __init__(self, sock, fd, src, deadline, hs):
        self.sock, self.fd, self.src, self.deadline, self.hs = sock, fd, src, deadline, hs


def _source(addr) -> object:
    """The fairness key of a client address: its IPv4 address, or its IPv6 /64."""
    host = addr[0] if isinstance(addr, tuple) else str(addr)
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return ip.packed[:8]
    return str(ip)


class Listener:
    """A listening socket whose accepted connections are authenticated by one
    event loop (``selectors``), then handed to ``on_conn(conn)`` on a short-lived
    thread each; failures are closed silently.

    An unauthenticated connection costs no thread: a socket, a few hundred bytes
    of state and the RESPONSE bytes received so far (at most :data:`PREAUTH_MAX`).
    The loop holds at most ``max_pending`` of them, ``per_source`` per source
    address; a connection over either bound evicts the oldest pending one of its
    own source (or, at ``max_pending``, of the source holding the most), which is
    sent a ``BUSY`` frame and closed: a stranger holding hundreds of idle sockets
    from one address only ever displaces its own, and an honest client, whose
    handshake takes one round trip, gets through.  A connection that has not
    sent its whole RESPONSE within ``handshake_timeout`` seconds is closed
    without a word.

    Args:
        bind: ``"host:port"`` (port 0: any free port).
        secret: shared secret.
        on_conn: called with each authenticated :class:`Connection`.
        encrypt: seal frames after the handshake (X25519 + AES-GCM).
        handshake_timeout: seconds for the client's part of the handshake.
        max_pending: unauthenticated connections held at once.
        per_source: of which from one source address (an IPv6 /64).

    Attributes:
        stats: counters ``accepted``, ``authenticated``, ``evicted`` (sent BUSY),
            ``expired`` (deadline), ``refused`` (malformed, wrong MAC, encryption mismatch).
    """

    def __init__(self, bind: str, secret: bytes, on_conn: Callable[[Connection], None], *, encrypt: bool = False,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = MAX_PENDING,
                 per_source: int = PER_SOURCE):
        host, port = parse_address(bind)
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(1024)
        self.sock.setblocking(False)
        self.secret, self.on_conn, self.encrypt = secret, on_conn, encrypt
        self.handshake_timeout = handshake_timeout
        self.max_pending, self.per_source = max(1, max_pending), max(1, per_source)
        self.stats = {"accepted": 0, "authenticated": 0, "evicted": 0, "expired": 0, "refused": 0}
        self._pending: OrderedDict[int, _Pending] = OrderedDict()   # fd -> pending, oldest first
        self._by_src: dict[object, OrderedDict] = {}                 # source -> {fd: None}, oldest first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self.sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._accepting = True
        self._resume_at = 0.0
        self._stop = False
        h, p = self.sock.getsockname()[:2]
        self.address = f"[{h}]:{p}" if fam == socket.AF_INET6 else f"{h}:{p}"
        self._thread = threading.Thread(target=self._loop, name="commlib-tcp-listen", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Unauthenticated connections held now."""
        return len(self._pending)

    # the loop ---------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                now = time.monotonic()
                wait = 0.5
                if self._pending:
                    wait = min(wait, max(0.0, next(iter(self._pending.values())).deadline - now))
                if not self._accepting:
                    wait = min(wait, max(0.0, self._resume_at - now))
                for key, _mask in self._sel.select(wait):
                    if self._stop:
                        break
                    try:
                        if key.data == "accept":
                            self._accept()
                        elif key.data == "wake":
                            self._wake_r.recv(4096)
                        else:
                            self._readable(key.data)
                    except Exception:  # noqa: BLE001 - one connection's trouble never ends the loop
                        if isinstance(key.data, _Pending):
                            self._drop(key.data, "refused")
                self._expire(time.monotonic())
                if not self._accepting and time.monotonic() >= self._resume_at and not self._stop:
                    self._accepting = True
                    self._sel.register(self.sock, selectors.EVENT_READ, "accept")
        except Exception:  # noqa: BLE001 - the listener is being closed under the loop
            pass
        finally:
            self._shutdown()

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, then the pending ones get their turn
            try:
                s, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: free one of the heaviest source's, or pause accepting
                    if not self._evict_heaviest():
                        self._pause(0.05)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                self._pause(0.05)
                return
            self.stats["accepted"] += 1
            try:
                self._admit(s, addr)
            except Exception:  # noqa: BLE001 - never leak the socket
                s.close()

    def _admit(self, s: socket.socket, addr) -> None:
        """Make room for a new connection (fairly), send its challenge, watch it."""
        src = _source(addr)
        mine = self._by_src.get(src)
        if mine is not None and len(mine) >= self.per_source:
            self._make_room(mine)
        elif len(self._pending) >= self.max_pending:
            self._evict_heaviest()
        hs = _ServerHandshake(self.secret, self.encrypt)
        try:
            s.setblocking(False)  # large buffers and TCP_NODELAY come after authentication (_finish)
            if s.send(hs.challenge) != len(hs.challenge):  # an empty send buffer takes 60 bytes
                raise OSError("short send")
        except OSError:
            s.close()
            return
        p = _Pending(s, s.fileno(), src, time.monotonic() + self.handshake_timeout, hs)
        self._pending[p.fd] = p
        self._by_src.setdefault(src, OrderedDict())[p.fd] = None
        self._sel.register(s, selectors.EVENT_READ, p)

    def _pause(self, seconds: float) -> None:
        if self._accepting:
            self._accepting = False
            self._sel.unregister(self.sock)
        self._resume_at = time.monotonic() + seconds

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.fd, None)
        mine = self._by_src.get(p.src)
        if mine is not None:
            mine.pop(p.fd, None)
            if not mine:
                del self._by_src[p.src]
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, p: _Pending, counter: str) -> None:
        self._forget(p)
        self.stats[counter] += 1
        try:
            p.sock.close()
        except OSError:
            pass

    def _evict(self, p: _Pending) -> None:
        """Make room: tell ``p`` it has no slot (a BUSY frame), close it."""
        try:
            p.sock.send(_frame(K_BUSY, BUSY_NO_SLOT), socket.MSG_DONTWAIT)
        except OSError:
            pass
        self._drop(p, "evicted")

    def _make_room(self, mine: OrderedDict) -> None:
        """Free one slot of a source: its oldest connection that has sent nothing is
        evicted, but a connection whose RESPONSE is already waiting in its socket
        is read first (it may complete: an honest client answers within a round
        trip, a flood never does), and one that is part way through its RESPONSE
        is passed over."""
        for fd in list(mine)[:8]:
            p = self._pending.get(fd)
            if p is None:
                continue
            try:
                waiting = bool(p.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except (BlockingIOError, InterruptedError):
                waiting = False
            except OSError:
                waiting = True  # an error: _readable drops it
            if waiting:
                self._readable(p)
                if fd not in self._pending:
                    return  # authenticated or refused: its slot is free
            if not p.hs.buf and fd in self._pending:
                self._evict(p)
                return
        if mine:  # every candidate is part way through a RESPONSE: the oldest goes
            self._evict(self._pending[next(iter(mine))])

    def _evict_heaviest(self) -> bool:
        if not self._by_src:
            return False
        self._make_room(max(self._by_src.values(), key=len))
        return True

    def _expire(self, now: float) -> None:
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self._drop(p, "expired")

    def _readable(self, p: _Pending) -> None:
        try:
            data = p.sock.recv(p.hs.want())
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(p, "refused")
            return
        if not data:
            self._drop(p, "refused")
            return
        try:
            done = p.hs.feed(data)
        except Exception:  # noqa: BLE001 - malformed, wrong MAC, bad key: close without a word
            self._drop(p, "refused")
            return
        if not done:
            return
        self._forget(p)
        if p.hs.mismatch:
            self.stats["refused"] += 1
        else:
            self.stats["authenticated"] += 1
        # authenticated (it holds the secret): the proof, then on_conn, on a thread of its own
        threading.Thread(target=self._handoff, args=(p.sock, p.hs), daemon=True, name="commlib-tcp-auth").start()

    def _handoff(self, sock: socket.socket, hs: _ServerHandshake) -> None:
        conn = _finish(sock, hs, time.monotonic() + self.handshake_timeout)
        if conn is None:
            return
        if self._stop:
            conn.close()
            return
        try:
            self.on_conn(conn)
        except Exception:  # noqa: BLE001 - a refused connection is closed silently
            conn.close()

    def _shutdown(self) -> None:
        for p in list(self._pending.values()):
            self._forget(p)
            try:
                p.sock.close()
            except OSError:
                pass
        for s in (self.sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """Stop listening at once (new connections are refused from here on) and
        have the loop close every unauthenticated connection (idempotent; does not
        wait for the loop thread: a kill-like stop stays instantaneous)."""
        if self._stop:
            return
        self._stop = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a listening socket stops listening; the loop closes its fd
        except OSError:
            pass
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
