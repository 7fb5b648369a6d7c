"""An elastic peer: joining (its data listener, which answers the master's probe
of its data address; the handshake with the master is :mod:`.join`), membership
(the control connection's reader, the votes of :meth:`Peer.update_topology`, the
topology adopted at each call), and the epoch's data transport (dialled with
the master's tickets).  Its collectives are front ends of the collective engine
under the master's verdict (:mod:`.group`); the shared-state sync is
:mod:`.state_sync`."""
from __future__ import annotations

import functools
import hmac
import ipaddress
import os
import threading
import time

from commlib.core.errors import (AuthError, AuthenticationError, CommError, CommTimeout, InvalidArgument,
                                 PeerClosed, PeerFailure, ProcessFailed)
from commlib.core.seconds import Deadline, check_timeout
from commlib.transports import tcp

from .group import ElasticGroup
from .join import handshake, reach_master
from .state_sync import StateSync, one_thread
from .protocol import (BYE, DROP, FETCH, GAVE_UP, GIVE_UP, PLAN, PROBE, RING, SYNC_END, TERM, TOPO, VOTE, VOTED,
                       AUTO_STREAMS, HEARTBEAT_INTERVAL, PROBE_TOKEN, TRAFFIC, WHY_MAX, check_job, is_bytes, is_int)

__all__ = ["Peer", "connect"]


class _Topo:
    def __init__(self, msg: dict, my_id: int):
        self.epoch = msg["e"]
        self.ids = [int(m[0]) for m in msg["members"]]
        self.addrs = {int(m[0]): str(m[1]) for m in msg["members"]}
        self.tickets = msg["tickets"]
        self.exp = msg["exp"]
        self.rank = self.ids.index(my_id) if my_id in self.ids else None
        self.seq = int(msg.get("seq", 0))  # the group's next call number: a new member's first


#: given-up call numbers a peer keeps (:meth:`Peer._call_given_up`)
_DEAD_CALLS_KEPT = 64


def _finite_seconds(value, op: str, rank=None) -> float:
    """``value`` as seconds (:func:`commlib.core.seconds.check_timeout`, 0 refused).

    Raises:
        InvalidArgument: None, not a number, a bool, NaN, infinite (a NaN or
            infinite bound would let a call wait forever), negative or 0, naming
            ``op`` and ``rank``."""
    if value is None:
        raise InvalidArgument("timeout must be a finite number of seconds > 0, got None", rank=rank, op=op)
    return check_timeout(value, op=op, rank=rank)


@functools.lru_cache(maxsize=1024)
def _loopback(addr: str) -> bool:
    """True when the data address ``addr`` (``host:port``) is on a loopback address
    (kept per address: asked for every peer of every epoch)."""
    try:
        host = tcp.parse_address(addr)[0]
    except CommError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Peer(ElasticGroup, StateSync):
    """One elastic peer (made by :func:`connect`): a group of the collective
    engine (:class:`~.group.ElasticGroup`: ``allreduce``, ``bcast``, ``allgather``,
    ``reduce_scatter``, ``alltoall``, ``barrier``), with ``update_topology`` and
    ``sync_shared_state``.

    Attributes:
        id: the master's id for this peer (stable for its lifetime).
        rank, size, epoch: in the current topology (``rank`` None while pending).
        step: the master's count of completed votes, as of this peer's last
            :meth:`update_topology` (the same on every member: a job-wide step number).
        overlap_first_round: True (the default): a ring-sized all-reduce's first
            round travels with the ring's first step (:attr:`first_round_in_chunk`),
            which hides its latency (an emulated 20 ms link, 2 peers, 2 MiB: 20 ms
            a call); a refused call has then sent its first chunk, dropped unused.
            False: the header row alone, checked before the ring's first chunk
            (this member then sends no chunk before the check; members whose own
            check passed may have).  Every member must use the same setting (the
            first messages differ: a member refuses one of the other form).
        first_round_in_chunk: None (the default): a ring-sized all-reduce sends its
            header row in front of its first chunk, one message, on a link whose
            two ends are on loopback addresses (elsewhere the row goes beside the
            chunk, which keeps the ring's striping over the link's connections);
            True / False: on every link / on none.  Every member must use the same
            setting (a member refuses a first message of the other form).
        job: the job description this peer was admitted with (``connect(job=...)``), or None.
    """

    overlap_first_round: bool = True
    first_round_in_chunk: bool | None = None

    def __init__(self, address: str, secret: bytes, *, streams: int | None = None, timeout: float = 30.0,
                 encrypt: bool = False, bind: str | None = None, advertise: str | None = None,
                 job: bytes | None = None):
        self.job = job = check_job(job, "connect")
        if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int)
                                    or not 1 <= streams <= 64):
            raise InvalidArgument(f"streams must be None or 1..64, got {streams!r}", op="connect")
        # streams=None: AUTO_STREAMS connections to a peer on another host, one to a peer on a
        # loopback address (striping there only adds threads that compete for the same CPUs)
        self._auto_streams = streams is None
        self.streams = AUTO_STREAMS if streams is None else int(streams)
        timeout = _finite_seconds(timeout, "connect")
        # one deadline for the whole call: the name lookups, reaching the master, the handshake
        # and its retries, the job, the welcome (the master's probe of the data address included)
        deadline = Deadline(timeout, op="connect")
        if advertise is not None:
            host, port = tcp.parse_address(advertise)
            if port == 0:
                raise InvalidArgument(f"advertise={advertise!r} has port 0: name the port other peers dial",
                                      op="connect")
            try:
                tcp.resolve(host, port, deadline.left())
            except TimeoutError:
                raise CommTimeout(f"advertise={advertise!r}: its name lookup did not finish within connect's "
                                  f"{timeout:g} s timeout (a stalled DNS server)", op="connect") from None
            except OSError as exc:
                # the other members would dial it and fail, every epoch, for as long as
                # this peer stays: refused here instead
                raise InvalidArgument(f"advertise={advertise!r} does not resolve ({exc}): the other peers could "
                                      "not dial it", op="connect") from None
        self.secret, self.timeout, self.encrypt = secret, timeout, encrypt
        self.master_address = address
        # the master's probe of this peer's data address carries this token; the listener
        # answers it (and nothing else) until the master's welcome (_on_data_conn)
        self._probe_token: bytes | None = os.urandom(PROBE_TOKEN)
        sock = reach_master(address, deadline)
        local = sock.getsockname()[0]
        self._listener = tcp.Listener(bind or f"{local}:0", secret, self._on_data_conn, encrypt=encrypt)
        data = advertise or (self._listener.address if bind is None or not bind.startswith("0.0.0.0")
                             else f"{local}:{self._listener.address.rsplit(':', 1)[1]}")
        hello = {"role": "peer", "data": data, "streams": self.streams, "probe": self._probe_token}
        if job is not None:
            hello["job"] = True  # the job itself follows the handshake: only a master that proved the secret reads it
        try:
            self._conn, msg = handshake(sock, address, secret, hello, deadline, encrypt=encrypt, job=job, data=data,
                                        advertise=advertise, bind=bind, listener=self._listener.address)
        except BaseException:
            self._listener.close()
            raise
        self.id, self._key = int(msg["id"]), bytes(msg["key"])
        self._probe_token = None  # admitted: no probe is answered from here on
        self._cv = threading.Condition()
        self._call_lock = threading.Lock()   # one collective call at a time (one_thread)
        self._aborted_epoch = 0              # the newest epoch the master aborted an operation of
        self._call_name = None
        self._topo: _Topo | None = None      # adopted
        self._latest: _Topo | None = None    # newest pushed
        self._recent: dict = {}              # epoch -> the last few pushed topologies
        self._terms: dict = {}
        self._refusals: dict = {}  # (epoch, seq) -> why: operations a member refused (REFUSE)
        # call number -> (kind, why, peer id): calls given up by a member (GIVE_UP), this
        # one's own included; the last few are kept
        self._dead_calls: dict[int, tuple[str, str, int]] = {}
        self._voted: int | None = None
        self._plans: dict = {}
        self._sync_ends: set = set()
        self._lost: str | None = None
        self._closed = False
        self._seq = 0
        self.step = 0
        self._tr: tcp.TCPTransport | None = None
        self._parked: list = []
        self._serving = None                 # (sync round, {name: memoryview}) while a donor
        self._last_members: frozenset | None = None
        # state fetches this peer serves as a donor (see _on_fetch_conn): the plans' (donors,
        # fetchers) by round, the highest round seen, the open fetch connections, and those
        # parked (no thread) until the plan that names them is read
        self._plan_pairs: dict = {}
        self._round_seen = 0
        self._fetch_active: dict = {}        # (src, stream) -> conn of the round being served
        self._fetch_parked: list = []        # (deadline, round, src, stream, conn)
        self._counts = {"retries": 0, "aborts": 0}
        self._traffic = dict.fromkeys(TRAFFIC, 0)  # of the ring transports of past epochs
        threading.Thread(target=self._reader, daemon=True, name="commlib-peer-rx").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="commlib-peer-hb").start()

    # properties --------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counters of this peer since :func:`connect` (a new dict on each read):

        - ``retries``, ``aborts``: collective calls aborted (a peer died or failed) and retried;
        - ``bytes_sent``, ``bytes_received``: payload bytes of the collectives' data plane
          (the ring's messages, over every epoch's transport; quantized messages count
          their wire size). A ring all-reduce of ``B`` bytes over ``n`` peers sends and
          receives ``2 (n - 1) / n * B`` per peer (to rounding of the chunk bounds);
        - ``wire_bytes_sent``, ``wire_bytes_received``: the same frames as they crossed
          the wire: payloads plus a 28-byte header per frame (plus a 16-byte AES-GCM tag
          per frame with ``encrypt=True``); received also counts frames dropped (an old
          epoch's, an aborted operation's);
        - ``bytes_buffered``: payload bytes that arrived before their receive was posted
          and took one extra copy.

        - ``first_round_bytes_sent``, ``first_round_bytes_received`` (and
          ``first_round_wire_bytes_*``): the first round of each collective, its
          argument agreement: ``n - 1`` rows of 48 header bytes plus
          :func:`~commlib.collectives.one_round.small_capacity` payload bytes each
          way per peer, which carry the whole vector of a small call; at 2 peers
          one message each way of 48 bytes plus the larger of that capacity and,
          for a call of at most :data:`commlib.elastic.PAIR_EXCHANGE_MAX` bytes,
          the whole vector (the data plane then carries nothing).

        Not counted: the control connection to the master, handshakes, and
        :meth:`sync_shared_state` transfers (its result gives ``bytes_received``).
        """
        with self._cv:
            out = dict(self._counts)
            tr = self._tr
            for k in TRAFFIC:
                out[k] = self._traffic[k] + (getattr(tr, k) if tr is not None else 0)
        return out

    def _retire(self, tr) -> None:
        """Close an epoch's transport, keeping its byte counts in :attr:`stats`."""
        tr.close()
        with self._cv:
            if self._tr is tr:
                self._tr = None
            for k in TRAFFIC:
                self._traffic[k] += getattr(tr, k)

    @property
    def rank(self):
        return None if self._topo is None else self._topo.rank

    @property
    def size(self):
        return 0 if self._topo is None else len(self._topo.ids)

    @property
    def epoch(self):
        return 0 if self._topo is None else self._topo.epoch

    @property
    def members(self) -> tuple:
        """Peer ids of the current topology, in ring order."""
        return () if self._topo is None else tuple(self._topo.ids)

    # control plane ----------------------------------------------------------
    def _reader(self) -> None:
        try:
            while True:
                kind, _, msg = self._conn.read_ctrl(limit=tcp.CTRL_MAX)
                if kind != tcp.K_CTRL or not isinstance(msg, dict):
                    raise tcp.FrameError("unexpected frame from the master")
                t = msg.get("t")
                with self._cv:
                    if t == TOPO:
                        topo = _Topo(msg, self.id)
                        if self._latest is None or topo.epoch > self._latest.epoch:
                            self._latest = topo
                            self._recent[topo.epoch] = topo  # (update_topology adopts the voted one)
                            for old in [k for k in self._recent if k < topo.epoch - 8]:
                                del self._recent[old]
                            tr = self._tr
                            if tr is not None and tr.epoch < topo.epoch:
                                tr.revoke("a newer epoch began")
                    elif t == TERM:
                        e, s, why = msg["e"], msg["s"], msg.get("why")
                        self._terms[(e, s)] = bool(msg["ok"])
                        tr = self._tr
                        if isinstance(why, str) and not msg["ok"]:
                            # a member's call differs from its neighbour's: every member
                            # refuses it over the same connections; the operation's waits
                            # end now with the reporter's reason (nothing lands in a
                            # buffer after this returns: the caller may restore it)
                            why = why[:WHY_MAX]
                            self._refusals[(e, s)] = why
                            if tr is not None and tr.epoch == e:
                                data, first = tr.operation_tags(s)
                                tr.abort_tags((*data, *first), functools.partial(self._refusal, why))
                        elif not msg["ok"] and tr is not None and tr.epoch == e:
                            self._aborted_epoch = max(self._aborted_epoch, e)  # a next epoch follows
                            tr.revoke("operation aborted by the master")
                    elif t == GAVE_UP:
                        self._call_given_up(int(msg["s"]), str(msg["kind"]), str(msg["why"])[:WHY_MAX],
                                            int(msg["id"]))
                    elif t == VOTED:
                        self._voted = int(msg["e"])
                        self.step = int(msg.get("v", 0))
                    elif t == PLAN:
                        rnd = int(msg["round"])
                        self._plans[rnd] = msg
                        self._round_seen = max(self._round_seen, rnd)
                        if msg.get("lost") is None and msg.get("refused") is None:
                            self._plan_pairs[rnd] = ({int(d) for d in msg["donors"]},
                                                     {int(f) for f in msg["fetchers"]})
                            for old in [r for r in self._plan_pairs if r < rnd - 8]:
                                del self._plan_pairs[old]
                        self._sweep_fetches_locked()
                    elif t == SYNC_END:
                        self._sync_ends.add(int(msg["round"]))
                        self._sweep_fetches_locked()
                    self._cv.notify_all()
        except Exception as exc:  # noqa: BLE001
            # revoke before anyone learns of the loss: a caller that restores its buffer
            # on the error then finds no receiver writing into it
            with self._cv:
                tr = self._tr
            if tr is not None:
                tr.revoke("lost the master")
            with self._cv:
                self._lost = self._lost or f"lost the master ({type(exc).__name__})"
                later = self._tr
                self._cv.notify_all()
            if later is not None and later is not tr:
                later.revoke("lost the master")

    def _heartbeat(self) -> None:
        while not self._closed and self._lost is None:
            try:
                self._conn.send_frame(tcp.K_PING, b"", timeout=5.0)
            except TimeoutError:
                if self._conn.closed:  # the write itself timed out: the connection is gone
                    return
                continue  # another write held the connection for 5 s: ping when it is done
            except Exception:  # noqa: BLE001
                return
            if self._fetch_parked:
                with self._cv:
                    self._sweep_fetches_locked()  # parked fetch connections past their deadline
            time.sleep(HEARTBEAT_INTERVAL)

    def _send(self, msg, timeout: float | None = None, op: str = "elastic") -> None:
        """Send ``msg`` to the master, the write bounded by ``timeout`` seconds (a
        call's: what is left of its deadline; None: the peer's ``timeout``).

        Raises:
            PeerClosed: this peer was closed.
            CommTimeout: the write did not finish in time (a master that reads
                nothing; the control connection is then closed, the master lost),
                or another write held the connection all that time (it stays open).
            CommError: the connection failed."""
        bound = self.timeout if timeout is None else max(timeout, 0.001)
        try:
            self._conn.send_ctrl(msg, timeout=bound)
        except Exception as exc:  # noqa: BLE001
            if self._closed:
                raise PeerClosed("this peer was closed (close() was called)", rank=self.rank, op=op) from None
            if isinstance(exc, TimeoutError):
                raise CommTimeout(f"the master took no message within {bound:.3g} s (it reads nothing): lost the "
                                  "master", rank=self.rank, op=op) from None
            raise CommError(f"lost the master ({type(exc).__name__})", rank=self.rank, op=op) from None

    def _call_given_up(self, s: int, kind: str, why: str, pid: int) -> None:
        """Record that member ``pid`` gave up call ``s`` (under ``_cv``); a wait
        of this peer's for that call's messages ends now with its error."""
        self._dead_calls[s] = (kind, why, pid)
        for old in sorted(self._dead_calls)[:-_DEAD_CALLS_KEPT]:
            del self._dead_calls[old]
        tr = self._tr
        if tr is not None:
            data, first = tr.operation_tags(s)
            tr.abort_tags((*data, *first),
                          lambda tag, rec=(kind, why, pid): self._dead_error(s, self._call_name or "allreduce", rec))

    def _dead_error(self, s: int, op: str, rec: tuple | None = None) -> CommError:
        """The error of call ``s``, given up by a member (``rec``, else its record
        kept by :meth:`_call_given_up`)."""
        kind, why, pid = rec or self._dead_calls[s]
        topo = self._topo
        who = ("this peer" if pid == self.id else f"rank {topo.ids.index(pid)} (peer {pid})"
               if topo is not None and pid in topo.ids else f"peer {pid}")
        if kind == "arg":
            return InvalidArgument(f"call {s} refused: {who}'s arguments are invalid ({why})", rank=self.rank, op=op)
        if kind == "timeout":  # the call ran out of time there: the same error here
            return CommTimeout(f"call {s} given up by {who} ({why}); it fails on every member", rank=self.rank,
                               op=op)
        return PeerFailure(f"call {s} given up by {who} ({why}); it fails on every member", rank=self.rank, op=op)

    def _give_up(self, s: int, kind: str, why: str) -> None:
        """Give up call ``s`` on every member: tell the master (best effort: a lost
        master ends every call anyway); no late frame of it is kept here."""
        with self._cv:
            self._call_given_up(s, kind, why, self.id)
        try:
            self._conn.send_ctrl({"t": GIVE_UP, "s": s, "kind": kind, "why": why[:WHY_MAX]}, timeout=2.0)
        except Exception:  # noqa: BLE001
            pass

    def _wait(self, pred, timeout: float, op: str):
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                v = pred()
                if v is not None:
                    return v
                if self._closed:
                    raise PeerClosed("this peer was closed (close() was called)", rank=self.rank, op=op)
                if self._lost is not None:
                    raise CommError(self._lost, rank=self.rank, op=op)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"no answer from the master after {timeout:.3g} s", rank=self.rank, op=op)
                self._cv.wait(min(left, 0.5))

    def _adopt(self, epoch: int | None = None) -> _Topo | None:
        """Make the newest pushed topology the current one (at an operation's start);
        ``epoch``: that epoch's when it is newer than the current one and still kept
        (``update_topology``: the voted epoch, so that every member reads the same
        rank, size and members after it even when a death began a later epoch)."""
        with self._cv:
            latest = self._latest
            if epoch is not None and epoch in self._recent:
                latest = self._recent[epoch]
            if latest is not None and (self._topo is None or latest.epoch > self._topo.epoch):
                if latest.rank is not None and (self._topo is None or self._topo.rank is None):
                    self._seq = latest.seq  # admitted: its calls pair with the group's next ones
                self._topo = latest
                self._terms = {k: v for k, v in self._terms.items() if k[0] >= latest.epoch}
                self._refusals = {k: v for k, v in self._refusals.items() if k[0] >= latest.epoch}
            return self._topo

    # data plane -------------------------------------------------------------
    def _on_data_conn(self, conn: tcp.Connection) -> None:
        h = conn.hello
        if h.get("purpose") == PROBE:
            # the master's probe of this peer's data address, while it admits this peer:
            # answered only to this peer's own token and only before the welcome; the
            # prober learns that this listener is the joiner's, and nothing else
            tok, mine = h.get("tok"), self._probe_token
            if mine is not None and is_bytes(tok, PROBE_TOKEN) and hmac.compare_digest(tok, mine):
                try:
                    conn.send_ctrl({"t": PROBE}, timeout=2.0)
                except Exception:  # noqa: BLE001 - the master's probe fails on its own
                    pass
            conn.close()
            return
        src, dst, e, st, ns, exp, tkt = (h.get(k) for k in ("src", "dst", "e", "stream", "streams", "exp", "tkt"))
        purpose, rnd = h.get("purpose", RING), h.get("r", 0)
        if not (is_int(src) and dst == self.id and is_int(e) and is_int(st, 0, 63) and is_int(ns, 1, 64)
                and purpose in (RING, FETCH) and is_int(rnd) and isinstance(exp, float)
                and tcp.verify_ticket(self._key, tkt, e, src, dst, st, exp, purpose=purpose,
                                      round=rnd if purpose == FETCH else 0)):
            conn.close()
            return
        if purpose == FETCH:
            self._on_fetch_conn(conn, rnd, src, st)
            return
        with self._cv:
            tr = self._tr
            known = self._latest.epoch if self._latest is not None else 0
            if tr is not None and tr.epoch == e:
                pass
            elif (tr is None or e > tr.epoch) and e >= known and len(self._parked) < 4096:
                # an epoch this peer has not started yet (its topology may still be on the
                # way): held until it does; older epochs are refused at once
                self._parked.append((e, src, st, ns, conn))
                return
            else:
                conn.close()
                return
            topo = self._topo
        self._attach(tr, topo, src, st, ns, conn)

    @staticmethod
    def _attach(tr, topo, src, st, ns, conn) -> None:
        if topo is None or topo.epoch != tr.epoch or src not in topo.ids:
            conn.close()
            return
        tr.attach(topo.ids.index(src), st, ns, conn)

    def _dial(self, topo: _Topo, dst: int, stream: int, purpose: str, timeout: float, *, plan: dict | None = None,
              ) -> tcp.Connection:
        """An authenticated connection to peer ``dst`` carrying the master's ticket:
        a ring connection of ``topo``'s epoch, or (``plan``: the sync round's plan,
        which holds this fetcher's tickets) a state fetch.

        A dial that cannot get through (the destination's listener busy or
        silent, a connect that times out) is retried with jittered exponential
        backoff (:func:`~commlib.transports.tcp_auth.retry_delay`) within
        ``timeout``; a ring dial stops as soon as a newer epoch is known (the
        master decided without this link).  A refused connect means the
        destination's process is gone: no retry.

        Raises:
            ProcessFailed: the peer is gone, or could not be reached within ``timeout``
                (each message says which).
            AuthenticationError, EncryptionMismatch: the destination refused the handshake.
        """
        src_tickets = topo.tickets if plan is None else plan.get("tickets", {})
        tickets = src_tickets.get(dst)
        if tickets is None or stream >= len(tickets):
            raise ProcessFailed(f"no ticket for peer {dst}", failed=[], rank=topo.rank, op="elastic")
        if plan is None:
            addr, exp, rnd, e = topo.addrs[dst], topo.exp, 0, topo.epoch
        else:
            addr, exp, rnd, e = str(plan["addrs"][dst]), plan["exp"], int(plan["round"]), int(plan["e"])
        hello = {"src": self.id, "dst": dst, "e": e, "stream": stream,
                 "streams": self._streams_to(addr) if purpose == RING else self.streams,
                 "exp": float(exp), "tkt": tickets[stream], "purpose": purpose, "r": rnd}
        who = f"peer {dst} at {addr}"

        def refused():
            return ProcessFailed(f"{who} refused the connection: its process is gone", failed=[],
                                 rank=topo.rank, op="elastic")

        def check():
            if self._closed or (purpose == RING and self._latest is not None and self._latest.epoch > topo.epoch):
                raise ProcessFailed(f"gave up connecting to {who}: epoch {topo.epoch} is over", failed=[],
                                    rank=topo.rank, op="elastic")

        def gave_up(tries, last):
            return ProcessFailed(f"cannot connect to {who} (alive as far as this peer knows): {tries} tries in "
                                 f"{timeout:g} s, last: {type(last).__name__}: {last}", failed=[],
                                 rank=topo.rank, op="elastic")
        return tcp.dial(addr, self.secret, hello, time.monotonic() + timeout, encrypt=self.encrypt, who=who,
                        refused=refused, gave_up=gave_up, check=check)

    def _streams_to(self, addr: str) -> int:
        """Ring connections to the peer whose data address is ``addr``: ``streams`` as
        given, or with ``streams=None``, 1 on a loopback address and :data:`AUTO_STREAMS`
        elsewhere."""
        if not self._auto_streams:
            return self.streams
        return 1 if _loopback(addr) else self.streams

    def _transport(self, topo: _Topo) -> tcp.TCPTransport:
        tr = self._tr
        if tr is not None and tr.epoch == topo.epoch:
            return tr
        if tr is not None:
            self._retire(tr)

        def abuse(r: int, why: str) -> None:
            # a member overran this peer's receive caps: the master drops it (as if it died)
            self._conn.send_ctrl({"t": DROP, "e": topo.epoch, "id": topo.ids[r], "why": why[:200]}, timeout=2.0)

        tr = tcp.TCPTransport(topo.rank, len(topo.ids), topo.epoch,
                              lambda r, s: self._dial(topo, topo.ids[r], s, RING, min(self.timeout, 10.0)),
                              streams=lambda r: self._streams_to(topo.addrs[topo.ids[r]]), timeout=self.timeout,
                              on_abuse=abuse)
        with self._cv:
            self._tr = tr
            parked, self._parked = self._parked, []
            keep = []
            for item in parked:
                if item[0] == topo.epoch:
                    self._attach(tr, topo, item[1], item[2], item[3], item[4])
                elif item[0] > topo.epoch:
                    keep.append(item)
                else:
                    item[4].close()
            self._parked = keep
        if self._latest is not None and self._latest.epoch > topo.epoch:
            tr.revoke("a newer epoch began")
        return tr

    # public API --------------------------------------------------------------
    @one_thread("update_topology")
    def update_topology(self, timeout: float | None = None) -> bool:
        """Step boundary: vote with the live peers; pending peers are admitted.

        Blocks until every live member has called it (a pending peer: until it is
        admitted).  Returns True when the member set differs from the one this
        peer saw at its previous call (always True on admission).

        Raises:
            CommTimeout: no decision within ``timeout``, the deadline of the whole call in
                seconds (default: the peer's timeout).
            InvalidArgument: ``timeout`` is not a finite number; another thread of this
                peer is in a call.
            CommError: the master is gone.
        """
        timeout = self._call_timeout(timeout, "update_topology")
        self._check_open("update_topology")
        self._adopt()
        with self._cv:
            self._voted = None
        deadline = Deadline(timeout, op="update_topology")  # one bound for the whole call
        self._send({"t": VOTE}, deadline.left(), "update_topology")
        e = self._wait(lambda: self._voted, deadline.left(), "update_topology")
        self._wait(lambda: True if self._latest is not None and self._latest.epoch >= e else None, deadline.left(),
                   "update_topology")
        topo = self._adopt(e)
        members = frozenset(topo.ids)
        changed = members != self._last_members
        self._last_members = members
        return changed

    def first_round_joined(self, a: int, b: int) -> bool:
        """Whether the link of ranks ``a`` and ``b`` carries a ring's header row and
        first chunk as one frame (:attr:`first_round_in_chunk`, else both ends on
        loopback addresses: both ends decide alike)."""
        if self.first_round_in_chunk is not None:
            return self.first_round_in_chunk
        topo = self._topo
        return _loopback(topo.addrs[topo.ids[a]]) and _loopback(topo.addrs[topo.ids[b]])

    def _refusal(self, why: str, tag) -> InvalidArgument:
        """The error of an operation a member refused (:data:`.protocol.REFUSE`)."""
        return InvalidArgument(why, rank=self.rank, op=self._call_name or "allreduce")

    def _call_timeout(self, timeout, op: str) -> float:
        """A call's ``timeout`` argument in seconds (None: the peer's).

        Raises:
            InvalidArgument: not a finite number (a NaN or infinite bound would let
                the call wait forever)."""
        return self.timeout if timeout is None else _finite_seconds(timeout, op, self.rank)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise PeerClosed("this peer was closed (close() was called): connect() again to rejoin",
                             rank=self.rank, op=op)

    def close(self, finished: bool = False) -> None:
        """Leave: say goodbye to the master and close every connection.  Any later
        call on this peer raises :class:`~commlib.core.errors.PeerClosed` (the
        all-reduce: :class:`~commlib.core.errors.CommError` "this peer was closed").

        Args:
            finished: this peer leaves because the job is done (its last step
                taken).  When the last member leaves so, the master releases the
                job: its description (unless the master was started with one)
                and its state, so that the next job may run under the same master.
                Default False: a peer leaving a job that goes on (or may be
                resumed by peers holding its state)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send_ctrl({"t": BYE, "finished": True} if finished else {"t": BYE}, timeout=2.0)
        except Exception:  # noqa: BLE001
            pass
        self._conn.close()
        if self._tr is not None:
            self._retire(self._tr)
        self._listener.close()
        for item in self._parked:
            item[4].close()
        with self._cv:
            self._serving = None
            fetches = list(self._fetch_active.values()) + [item[4] for item in self._fetch_parked]
            self._fetch_active, self._fetch_parked = {}, []
        for conn in fetches:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(address: str, secret: bytes | str | None = None, secret_file: str | None = None, *,
            streams: int | None = None,
            timeout: float = 30.0, encrypt: bool = False, bind: str | None = None,
            advertise: str | None = None, job: bytes | None = None) -> Peer:
    """Join the elastic job whose master listens at ``address`` (``"host:port"``).

    The peer starts ``pending``; it becomes a member at its first
    :meth:`Peer.update_topology` that the live members also reach.

    Args:
        address: the master's ``host:port``.
        secret, secret_file: the shared secret (else ``COMMLIB_ELASTIC_SECRET``).
        streams: TCP connections per peer pair (1..64; one message is striped over
            them), also the most connections of a state fetch.  None (default): 1 to a
            peer whose data address is a loopback address (on one machine more
            connections gained nothing measurable and add threads competing for the
            same cores: docs/elastic-protocol.md), :data:`AUTO_STREAMS` (4) to any other.
        timeout: the deadline of the whole call, in seconds (> 0, finite): reaching
            the master, the handshake and its retries, the job and the master's
            welcome (after its probe of this peer's data address) share it, so
            ``connect`` raises within ``timeout`` (plus scheduling slack) whichever
            stage stalls.  It is also the peer's default ``timeout`` of its calls
            (each call's own deadline).  The name lookup of the master's host is
            not bounded by it.
        encrypt: seal every frame with AES-GCM (the master and all peers must agree).
        bind: ``host:port`` for this peer's data listener (default: the interface
            that reaches the master, any port).
        advertise: the ``host:port`` other peers should dial (behind NAT / port forwarding).
            Before admitting this peer, the master dials its data address (this,
            else the listener's) and must reach this peer's own listener within
            its ``probe_timeout`` (5 s by default): an address nobody could dial
            is refused here instead of failing the group's calls once admitted.
        job: an opaque description of the job this peer is started for (bytes,
            1..:data:`~commlib.elastic.protocol.JOB_MAX` = 16384; e.g. an app's job
            flags as canonical JSON; compared byte for byte, never decoded or
            pickled).  Sent after the handshake (only to a master that proved the
            secret; sealed with ``encrypt=True``).  When the master's job differs
            (its ``Master(job=...)``, else the job of the first peer it admitted
            with one) this peer is refused before admission: the members see
            nothing of it.  None (default): no claim, admitted whatever the job.

    Raises:
        SecretError: (an :class:`AuthError`) the secret is missing, its file missing or
            empty, or too short; the message names the file.
        AuthError: the secret is wrong, or the master refused this peer.
        NoHandshakeSlot: the master's listener had no handshake slot for this peer
            within ``timeout`` (retried with backoff until then): a flood, not a secret problem.
        SilentPort: (a :class:`CommTimeout`) the address accepts connections but sends
            no challenge: not a commlib master.
        EncryptionMismatch: the master and this peer disagree on ``encrypt``.
        JobMismatch: (an :class:`InvalidArgument`) ``job`` differs from the master's;
            its ``job`` attribute holds the job's bytes, ``mine`` this peer's.
        InvalidArgument: ``job`` not None nor 1..JOB_MAX bytes; ``streams`` or ``timeout`` out of range, or an ``advertise``
            address that does not resolve or names port 0; or the master could not
            dial this peer's ``advertise`` (or ``bind``) address: the message names
            it and why ("the master could not dial advertise='h:p' (connection
            refused: ...)").
        CommError: the master cannot be reached (refused, unreachable, its name
            does not resolve); or (neither ``advertise`` nor ``bind`` given) the
            master could not dial this peer's data address.
        CommTimeout: no TCP connection to the master within ``timeout`` (a full
            backlog, a network that drops it), or the master authenticated this
            peer but took no job / sent no answer within ``timeout`` (its probe of
            the data address may take up to its ``probe_timeout``).
    """
    try:
        key = tcp.read_secret(secret, secret_file)
    except AuthenticationError as exc:  # SecretError (an AuthError), named for connect
        raise (type(exc) if isinstance(exc, AuthError) else AuthError)(exc.detail, op="connect") from None
    return Peer(address, key, streams=streams, timeout=timeout, encrypt=encrypt, bind=bind, advertise=advertise,
                job=job)
