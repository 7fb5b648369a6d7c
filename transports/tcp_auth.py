"""Authentication of TCP connections: the challenge-response handshake
(:func:`client_handshake`, :func:`server_handshake`), the AES-GCM sealing of
frames it can switch on, the master's tickets (:func:`make_ticket`,
:func:`verify_ticket`), the shared secret (:func:`read_secret`), and the
:class:`Listener` that authenticates each connection it accepts.

The handshake runs over the frames of :mod:`commlib.transports.tcp_frames`; a
frame before authentication carries at most :data:`PREAUTH_MAX` bytes, and
anything wrong closes the connection without a reply.

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
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from typing import Callable

from commlib.core.config import config
from commlib.core.errors import AuthenticationError, CommTimeout, InvalidArgument

from .tcp_frames import (K_CHALLENGE, K_PROOF, K_RESPONSE, Connection, FrameError, pack_ctrl, parse_address,
                         tune_socket, unpack_ctrl)

__all__ = [
    "PREAUTH_MAX", "NONCE", "MAC", "read_secret", "client_handshake", "server_handshake", "make_ticket",
    "verify_ticket", "Listener",
]

PREAUTH_MAX = 4096            #: bytes of a frame before authentication
NONCE = 32
MAC = 32


# ------------------------------------------------------------- secret
def read_secret(secret: bytes | str | None = None, secret_file: str | None = None) -> bytes:
    """The shared secret: ``secret``, else the contents of ``secret_file``
    (surrounding whitespace stripped), else ``COMMLIB_ELASTIC_SECRET``
    (:attr:`commlib.core.config.Config.elastic_secret`, read at each use).

    Raises:
        AuthenticationError: none given, ``secret_file`` unreadable, or shorter than 16 bytes.
    """
    if secret is None and secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise AuthenticationError(f"cannot read the secret file {secret_file!r}: {exc.strerror or exc}",
                                      op="secret") from None
    if secret is None:
        secret = config.elastic_secret
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise AuthenticationError("no shared secret: pass secret= or secret_file=, or set COMMLIB_ELASTIC_SECRET",
                                  op="secret")
    if len(secret) < 16:
        raise AuthenticationError("the shared secret must be at least 16 bytes", op="secret")
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


def _derive_keys(secret: bytes, ns: bytes, nc: bytes) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=ns + nc, info=b"commlib-elastic aes-gcm v1").derive(secret)
    return okm[:32], okm[32:]  # client→server, server→client


# ------------------------------------------------------------- handshake
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
