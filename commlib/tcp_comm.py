"""A communicator over commlib's own TCP transport, its members found through a key-value store.

:class:`TCPCommunicator` is the group a job gets where there is no MPI job,
e.g. under ``torchrun``: its ranks meet through a store with
``torch.distributed.Store``'s ``set``/``get`` (torch's ``TCPStore``,
``FileStore``, ``PrefixStore``, or any object with those two methods) and then
talk over :class:`~commlib.transports.tcp.TCPTransport`, the authenticated
transport of the elastic peers.  Its collectives are those of
:class:`commlib.Communicator` (the same :class:`~commlib.collective_api.CollectiveMixin`
front ends of the one collective engine, the same algorithms and the same
first round that refuses mismatched calls on every rank), and every call is
bounded: a call given no ``timeout`` has the communicator's ``timeout`` as
its deadline.

Importing this module loads no MPI (neither ``mpi4py`` nor
:mod:`commlib.transports.mpi`).

Example (every rank; ``store`` e.g. the ``torch.distributed.TCPStore`` that
``torchrun``'s ``MASTER_ADDR``/``MASTER_PORT`` name)::

    from commlib.tcp_comm import TCPCommunicator

    comm = TCPCommunicator.from_store(store, rank, world_size, timeout=60)
    comm.allreduce(grads)             # in place, bounded by 60 s
    comm.close()
"""
from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import threading
import time

from commlib.collective_api import CollectiveMixin
from commlib.collectives.engine import Engine
from commlib.core.config import config
from commlib.core.errors import CommError, InvalidArgument, ProcessFailed
from commlib.core.seconds import check_timeout
from commlib.transports import tcp

__all__ = ["TCPCommunicator", "routed_host"]

#: connections per pair of ranks on different hosts (one on a loopback address:
#: striping there only adds threads that compete for the same cores)
REMOTE_STREAMS = 4
#: seconds a rank gives one connection to a peer (retries of a busy or silent
#: listener included), at most: the call's own deadline bounds the wait for it too
DIAL_MAX = 30.0
#: the channels of the hello: user point to point, commlib's collectives
USER, COLLECTIVE = 0, 1
#: bytes of the group's token (drawn by rank 0) that every connection's hello carries
GROUP_TOKEN = 16
#: bytes of a secret rank 0 draws when none is given
SECRET_BYTES = 32


def routed_host(target: str | None) -> str:
    """The local address of the interface that routes toward ``target``.

    A UDP socket is connected toward ``target`` (no packet is sent) and its
    local address read back.

    Args:
        target: a host name or address (e.g. ``MASTER_ADDR``), or None.

    Returns:
        str: that local address, or ``"127.0.0.1"`` when ``target`` is None,
        does not resolve, has no route, or the route is a loopback one.
    """
    if not target:
        return "127.0.0.1"
    try:
        fam, _, _, _, sa = socket.getaddrinfo(target.strip("[]"), 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as u:
            u.connect(sa)
            local = u.getsockname()[0]
        if ipaddress.ip_address(local.split("%")[0]).is_loopback or ipaddress.ip_address(
                local.split("%")[0]).is_unspecified:
            return "127.0.0.1"
        return local
    except (OSError, ValueError, IndexError):
        return "127.0.0.1"


def _store_host(store) -> str | None:
    """The host of a torch ``TCPStore`` (through ``PrefixStore``'s
    ``underlying_store``), else ``MASTER_ADDR`` (torch's variable), else None."""
    s = store
    for _ in range(16):
        host = getattr(s, "host", None)
        if isinstance(host, str) and host:
            return host
        s = getattr(s, "underlying_store", None)
        if s is None:
            break
    return os.environ.get("MASTER_ADDR") or None


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(tcp.parse_address(addr)[0].split("%")[0]).is_loopback
    except (CommError, ValueError):
        return False


def _env_secret() -> bytes | None:
    """``COMMLIB_SECRET`` (its UTF-8 bytes), read at each use and never stored; None when unset or empty."""
    v = os.environ.get("COMMLIB_SECRET")
    return v.encode() if v else None


#: what ``algorithm="mpi"`` becomes on a TCP communicator: a name no collective has
_NO_MPI = "mpi (a TCPCommunicator has no MPI library: use 'auto' or a commlib algorithm)"


class _BoundedEngine(Engine):
    """The collective engine of a :class:`TCPCommunicator`: a call given no
    ``timeout`` gets the communicator's as its deadline, so every call is
    bounded (the engine's plans of unbounded small calls, which need a native
    all-gather, are never taken); ``algorithm="mpi"`` is an argument error."""

    __slots__ = ()

    def execute(self, opname: str, sendbuf=None, recvbuf=None, op="sum", algorithm: str = "auto", root=None, **kw):
        # no native collectives here: "mpi" is refused as an unknown algorithm, in the first round (a
        # rank that names it raises InvalidArgument, and so does every other rank of the call)
        if isinstance(algorithm, str) and algorithm == "mpi":
            algorithm = _NO_MPI
        return super().execute(opname, sendbuf, recvbuf, op, algorithm, root, **kw)

    def deadline(self, opname: str, timeout):
        return super().deadline(opname, self.comm.timeout if timeout is None else timeout)

    def allreduce(self, sendbuf, recvbuf=None, op="sum", algorithm: str = "auto", timeout=None):
        return self.execute("allreduce", sendbuf, recvbuf, op, algorithm, timeout=timeout)

    def bcast(self, buf, root=0, algorithm: str = "auto", timeout=None):
        return self.execute("bcast", buf, root=root, algorithm=algorithm, timeout=timeout)

    def barrier(self, algorithm: str = "auto", timeout=None) -> None:
        self.execute("barrier", algorithm=algorithm, timeout=timeout)


class TCPCommunicator(CollectiveMixin):
    """A group of ranks over commlib's TCP transport, with the collectives of
    :class:`commlib.Communicator`.

    Made by :meth:`from_store`.  Two transports of the same ranks: ``transport``
    for the user's point to point and :meth:`collective_transport` for
    commlib's collectives, on connections of their own, so the two never meet.
    Connections are opened on first use, by the lower rank of each pair, and
    authenticated with the group's shared secret (HMAC challenge-response of
    :mod:`commlib.transports.tcp_auth`); each carries the group's token, so a
    connection from another group that shares the secret is refused.

    Not fault tolerant: ``ft`` is None, ``failed_ranks`` empty, and
    :meth:`shrink` / :meth:`recover` unsupported.  A peer that dies or closes
    makes calls that need it raise :class:`~commlib.ProcessFailed` (its
    connection failed) or :class:`~commlib.CommTimeout` (its deadline passed);
    after either, treat the communicator as broken (a call's messages may
    stay posted).

    Attributes:
        rank (int): this rank, in ``[0, size)``.
        size (int): the number of ranks.
        timeout (float): seconds; the deadline of every collective call given
            no ``timeout`` (the whole call), and the default bound of
            ``transport.waitall``.
        transport (TCPTransport): the user's point to point:
            ``transport.isend(buf, dest, tag)``, ``transport.irecv(buf, source,
            tag)`` (C-contiguous host arrays, tags in ``[0, 2**61)``) and
            ``transport.waitall(requests, timeout)``.
        address (str | None): ``"host:port"`` this rank's listener was published
            at (None at size 1: no sockets).
    """

    #: the engine's first round of large calls follows ``COMMLIB_CHECK_ARGS``, as on MPI
    always_agree = False

    def __init__(self, rank: int, size: int, *, timeout: float, transport, coll_transport, listener=None,
                 address: str | None = None):
        self._rank, self._size, self.timeout = rank, size, timeout
        self.transport, self._coll_tp = transport, coll_transport
        self._listener, self.address = listener, address
        self._ft = None
        self._worker = None
        self._closed = False
        self._close_lock = threading.Lock()

    # ------------------------------------------------------------ construction
    @classmethod
    def from_store(cls, store, rank: int, size: int, *, timeout: float | None = None,
                   secret: bytes | str | None = None, host: str | None = None, streams: int | None = None,
                   encrypt: bool = False, prefix: str = "commlib_tcp") -> "TCPCommunicator":
        """Form the group: every rank of ``range(size)`` calls it with its own ``rank``.

        Each rank opens a listener (bound to all interfaces, a free port),
        publishes ``host:port`` in ``store`` under ``{prefix}/addr/{rank}`` and
        reads the others'.  Rank 0 draws the group's token (``{prefix}/gid``)
        and, when no secret is given, the group's 32-byte secret
        (``{prefix}/secret``).

        The store is trusted as the job's rendezvous, as torch itself trusts it:
        whoever can read it learns the secret drawn there and can join the
        group (pass ``secret`` or set ``COMMLIB_SECRET`` to keep the secret out
        of the store).  One group per ``prefix`` of a store: a second group on
        the same store needs its own (torch's ``PrefixStore`` per process group
        gives one).

        Args:
            store: ``set(key: str, value: bytes)`` and a blocking
                ``get(key: str) -> bytes`` (``torch.distributed.Store``); its
                own timeout bounds the rendezvous.
            rank: this rank, in ``[0, size)``.
            size: the number of ranks (>= 1).  At 1 no socket is opened and
                the store is not used.
            timeout: seconds (a finite number > 0): the deadline of every
                collective call given none (the whole call), and the default
                bound of ``transport.waitall``.  None: ``COMMLIB_TIMEOUT``
                (60 s by default).
            secret: the shared secret (at least 16 bytes), the same on every
                rank; None: ``COMMLIB_SECRET`` when set, else drawn by rank 0
                and passed through ``store``.
            host: the address the other ranks reach this rank at; None: the
                local address of the interface that routes toward the store's
                host (a ``TCPStore``'s ``host``, else ``MASTER_ADDR``), or
                ``127.0.0.1`` when that is a loopback address or unknown.
            streams: TCP connections per pair of ranks (1..64); None: 1 to a
                peer on a loopback address, 4 to others.
            encrypt: seal every frame (X25519 + AES-GCM); the same on every rank.
            prefix: the keys' prefix in ``store``.

        Returns:
            TCPCommunicator: this rank's member of the group.

        Raises:
            InvalidArgument: ``rank``/``size``/``timeout``/``streams`` out of
                range, or ``host`` not an address.
            SecretError: a ``secret`` (or ``COMMLIB_SECRET``) under 16 bytes.
            CommError: the store failed (e.g. its own timeout passed before
                every rank published), the cause chained.
        """
        op = "TCPCommunicator.from_store"
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"size must be an int >= 1, got {size!r}", op=op)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise InvalidArgument(f"rank {rank!r} out of range [0, {size})", op=op)
        timeout = check_timeout(timeout, op=op, rank=rank)
        if timeout is None:
            timeout = float(config.timeout)
        if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int)
                                    or not 1 <= streams <= 64):
            raise InvalidArgument(f"streams must be an int in 1..64, got {streams!r}", rank=rank, op=op)
        if size == 1:
            def no_peer(peer, stream):  # pragma: no cover - a group of one has no peer to dial
                raise ProcessFailed("a group of one has no peer", failed=[peer], rank=0, op=op)
            return cls(0, 1, timeout=timeout, transport=tcp.TCPTransport(0, 1, 0, no_peer, streams=1, timeout=timeout),
                       coll_transport=tcp.TCPTransport(0, 1, 0, no_peer, streams=1, timeout=timeout))

        if host is None:
            host = routed_host(_store_host(store))
        elif not isinstance(host, str) or not host.strip("[]") or any(ch.isspace() for ch in host):
            raise InvalidArgument(f"host must be an address or a host name, got {host!r}", rank=rank, op=op)
        elif ":" in host.strip("[]"):
            try:
                ipaddress.ip_address(host.strip("[]").split("%")[0])
            except ValueError:
                raise InvalidArgument(f"host {host!r} is neither an IPv6 address nor a host name",
                                      rank=rank, op=op) from None
        if secret is None:
            secret = _env_secret()
        key = tcp.read_secret(secret) if secret is not None else None

        def get(k: str) -> bytes:
            try:
                v = store.get(k)
            except Exception as exc:  # noqa: BLE001 - torch's stores raise their own types
                raise CommError(f"the store gave no {k!r} ({type(exc).__name__}: {exc})", rank=rank, op=op) from exc
            return v.encode() if isinstance(v, str) else bytes(v)

        def put(k: str, v: bytes) -> None:
            try:
                store.set(k, v)
            except Exception as exc:  # noqa: BLE001
                raise CommError(f"the store refused {k!r} ({type(exc).__name__}: {exc})", rank=rank, op=op) from exc

        if rank == 0:
            gid = secrets.token_bytes(GROUP_TOKEN)
            if key is None:
                key = secrets.token_bytes(SECRET_BYTES)
                put(f"{prefix}/secret", key)
            put(f"{prefix}/gid", gid)  # after the secret: a rank that reads the token finds the secret
        else:
            gid = get(f"{prefix}/gid")
            if key is None:
                key = get(f"{prefix}/secret")

        host = host.strip("[]")
        v6 = ":" in host
        group = _Wiring(rank, size, key, gid, encrypt, timeout, streams)
        listener = tcp.Listener("[::]:0" if v6 else "0.0.0.0:0", key, group.on_conn, encrypt=encrypt)
        try:
            port = tcp.parse_address(listener.address)[1]
            address = f"[{host}]:{port}" if v6 else f"{host}:{port}"
            user = tcp.TCPTransport(rank, size, 1, group.dialer(USER), streams=group.streams_to, timeout=timeout)
            coll = tcp.TCPTransport(rank, size, 1, group.dialer(COLLECTIVE), streams=group.streams_to,
                                    timeout=timeout)
            group.transports = (user, coll)
            put(f"{prefix}/addr/{rank}", address.encode())
            addrs = [address if r == rank else get(f"{prefix}/addr/{r}").decode("utf-8", "replace")
                     for r in range(size)]
            for r, a in enumerate(addrs):
                tcp.parse_address(a)  # a malformed entry is refused here, not at the first call
            group.addrs = addrs
            group.ready.set()
        except BaseException:
            group.ready.set()
            for t in group.transports:
                t.close()
            listener.close()
            raise
        return cls(rank, size, timeout=timeout, transport=user, coll_transport=coll, listener=listener,
                   address=address)

    # ------------------------------------------------------------ the group
    @property
    def rank(self) -> int:
        """This rank, in ``[0, size)``."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._size

    @property
    def cuda_aware(self) -> bool:
        """False: device buffers are staged through host memory."""
        return False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def collective_transport(self, op: str = "collective_transport", timeout: float | None = None):
        """The transport commlib's collectives run on (its own connections,
        made with the group: ``op`` and ``timeout`` are unused)."""
        return self._coll_tp

    def _engine(self) -> Engine:
        eng = self._coll_engine
        if eng is None:
            eng = self._coll_engine = _BoundedEngine(self)
        return eng

    def agree_arguments(self, values, names, *, op: str, local_error: CommError | None = None, describe=None,
                        timeout: float | None = None) -> None:
        """:meth:`commlib.Communicator.agree_arguments` on the collectives'
        transport, bounded by ``timeout`` (None: the communicator's ``timeout``)."""
        from commlib.collectives.agreement import agree_header  # noqa: PLC0415

        if len(names) != len(values):
            raise InvalidArgument(f"{len(values)} values but {len(names)} names", rank=self.rank, op=op)
        agree_header(self._coll_tp, [int(v) for v in values], op=op, local_error=local_error,
                     timeout=self.timeout if timeout is None else timeout, names=list(names), describe=describe,
                     native=False)

    def shrink(self, tp):
        """Unsupported: a TCP communicator is not fault tolerant.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("TCPCommunicator is not fault tolerant: no shrink")

    def recover(self) -> tuple:
        """Unsupported: a TCP communicator is not fault tolerant.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("TCPCommunicator is not fault tolerant: no recover")

    def add_failure_callback(self, fn) -> None:
        """Unsupported: a TCP communicator is not fault tolerant.

        Raises:
            InvalidArgument: always.
        """
        raise InvalidArgument("a TCPCommunicator is not fault tolerant: no failure callbacks", rank=self.rank,
                              op="add_failure_callback")

    def close(self) -> None:
        """Close both transports and the listener (idempotent).  Calls in
        progress on other threads, and the peers' calls that need this rank,
        fail with :class:`~commlib.ProcessFailed`."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for tp in (self.transport, self._coll_tp):
            tp.close()
        if self._listener is not None:
            self._listener.close()
        if self._worker is not None:
            self._worker.shutdown(wait=False)

    def __enter__(self) -> "TCPCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        where = f" address={self.address}" if self.address is not None else ""
        return f"<TCPCommunicator rank={self._rank} size={self._size}{where} timeout={self.timeout:g}{state}>"


class _Wiring:
    """The connections of one rank's group: dialling a peer's listener (lower
    rank side) and routing the listener's authenticated connections to the
    transport of their channel (higher rank side)."""

    def __init__(self, rank: int, size: int, key: bytes, gid: bytes, encrypt: bool, timeout: float,
                 streams: int | None):
        self.rank, self.size, self.key, self.gid, self.encrypt = rank, size, key, gid, encrypt
        self.timeout, self.streams = timeout, streams
        self.addrs: list[str] = []
        self.transports: tuple = ()
        self.ready = threading.Event()  # set once the transports exist (or the group failed to form)

    def streams_to(self, peer: int) -> int:
        if self.streams is not None:
            return self.streams
        return 1 if _is_loopback(self.addrs[peer]) else REMOTE_STREAMS

    def on_conn(self, conn) -> None:
        """An authenticated connection: attach it to its channel's transport, or close it."""
        self.ready.wait(self.timeout)
        h = conn.hello if isinstance(conn.hello, dict) else {}
        g, src, dst, ch, st, ns = (h.get(k) for k in ("g", "src", "dst", "ch", "stream", "streams"))
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (src, dst, ch, st, ns))
        if (not ints or not isinstance(g, bytes) or not hmac.compare_digest(g, self.gid) or dst != self.rank
                or ch not in (USER, COLLECTIVE) or len(self.transports) != 2):
            conn.close()
            return
        self.transports[ch].attach(src, st, ns, conn)  # (it checks src, stream and streams itself)

    def dialer(self, ch: int):
        """``connect(peer, stream)`` of channel ``ch``'s transport."""

        def connect(peer: int, stream: int):
            addr = self.addrs[peer]
            who = f"rank {peer} at {addr}"
            hello = {"g": self.gid, "src": self.rank, "dst": peer, "ch": ch, "stream": stream,
                     "streams": self.streams_to(peer)}
            left_max = min(self.timeout, DIAL_MAX)

            def refused():
                return ProcessFailed(f"{who} refused the connection: its process is gone or closed",
                                     failed=[peer], rank=self.rank, op="connect")

            def gave_up(tries, last):
                return ProcessFailed(f"cannot connect to {who}: {tries} tries in {left_max:g} s, last: "
                                     f"{type(last).__name__}: {last}", failed=[peer], rank=self.rank, op="connect")
            return tcp.dial(addr, self.key, hello, time.monotonic() + left_max, encrypt=self.encrypt, who=who,
                            refused=refused, gave_up=gave_up)

        return connect
