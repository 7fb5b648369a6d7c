"""Elastic peers over a WAN: a master, authenticated peers, an all-reduce that survives churn.

The model is PCCL (Prime Collective Communications Library, arXiv 2505.14065):
a master keeps membership; the topology changes only at step boundaries, by a
vote of the live peers (:meth:`Peer.update_topology`); an all-reduce that loses
a peer is aborted on every survivor, the inputs are restored and it is retried
over the survivors; shared state is checked by SHA-256 hashes.  Every byte
travels over :mod:`commlib.transports.tcp` (authenticated frames, no pickle);
the all-reduce is :func:`commlib.collectives.allreduce_ring.allreduce_ring`
over a :class:`~commlib.transports.tcp.TCPTransport` of the current epoch.

Usage::

    import commlib.elastic as el
    master = el.Master(bind="0.0.0.0:29500", secret_file="secret"); master.start()
    peer = el.connect("master-host:29500", secret_file="secret")  # streams: 1 on loopback, else 4
    while training:
        if peer.update_topology():          # step boundary; admits joiners
            peer.sync_shared_state(state, revision)
        peer.allreduce(grad, op="avg", quantize="int8")

The master's state machine
--------------------------

Peer states: ``pending`` (authenticated, not yet admitted) → ``member`` (in the
current epoch) → ``dead`` (connection closed, a malformed frame, or silent for
``heartbeat_timeout`` seconds; never comes back: a restarted process joins as
a new peer).

Epochs: ``epoch`` numbers membership + ring order.  A new epoch is made

* at once when a member dies;
* ``abort_grace`` seconds after an operation is aborted on a member's report
  (``fail``) when no death explains it (same members, fresh connections);
* when a vote completes and the live members plus the pending peers that are
  waiting differ from the current members (admission).

Each new epoch is pushed to its members (``topo``: members in ring order with
their data addresses, the tickets this member needs); every operation of an
older epoch that has no terminal state is aborted.

Operations (all-reduce): tag ``(epoch, seq)``, ``seq`` counting the epoch's
operations.  ``open`` → ``complete`` when every member of the epoch reported
``done``; ``open`` → ``abort`` on a member's death, a member's ``fail`` report,
or any report for an epoch older than the current one.  The terminal state is
decided once and each live member of the epoch receives exactly one terminal
message (``term``) for the tag.

Votes (``update_topology``): members and pending peers send ``vote``; when every
live member of the current epoch has voted, pending voters are admitted (a new
epoch if membership changed) and every voter gets ``voted``.  With no live
members, the pending voters form the first epoch.

Shared state (``sync_shared_state``): rounds.  When every live member has sent
``sync`` (revision, per-tensor SHA-256, dtypes and shapes), the master picks
the highest revision, and among the peers there the largest group with equal
hashes (ties: the group with the lowest ring rank); that group are the donors,
the others fetch from them.  Every member gets ``plan``; when every live
fetcher has reported ``synced`` (or died) every member gets ``sync_end``.  The
master keeps the winning revision and hashes.

Orphaned state: a live peer is always a member of the current epoch or pending
(:meth:`Master.groups` checks it), so there is one group at a time.  When an
epoch is made with no members after a revision was recorded, the group that held
the job's state is gone; the group that pending voters form next must, at its
first sync round, include a peer at that revision with those hashes (or a newer
revision); otherwise the round is refused (``plan`` with ``lost``: every member's
``sync_shared_state`` raises) instead of letting fresh peers start a second
history of the job under the same master.

Heartbeats: a peer is silent when nothing arrived for ``heartbeat_timeout`` and
no unread bytes wait in its socket; a monitor tick that finds the master itself
was not scheduled for over 0.5 s restarts every silence clock (the silence was
the master's).

Threat model (see docs/ELASTIC.md): anyone may reach the ports; only holders
of the shared secret can authenticate (HMAC-SHA256 challenge-response both
ways, nothing but a random challenge is sent before); only members of an epoch
hold tickets to open peer-to-peer connections.  Members are trusted not to lie
about their inputs; data frames can be sealed with AES-GCM (``encrypt=True``).
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import queue
import select
import threading
import time

import numpy as np

from commlib.collectives.allreduce_recursive_doubling import allreduce_recursive_doubling
from commlib.collectives.allreduce_ring import allreduce_ring, ring_scratch
from commlib.collectives.snapshot import LazySnapshot
from commlib.collectives.ops import get_op, is_floating
from commlib.core.buffer import grown
from commlib.core.errors import AuthenticationError, CommError, CommTimeout, InvalidArgument, ProcessFailed
from commlib.transports import tcp
from commlib.transports.base import Request, check_plain_dtype

__all__ = ["Master", "Peer", "connect", "PeerFailure", "AuthError"]

#: seconds between a peer's heartbeats
HEARTBEAT_INTERVAL = 0.25
#: ring connections per pair of peers on different hosts with ``connect(streams=None)``
#: (the default); a pair on loopback addresses uses one
AUTO_STREAMS = 4
#: bytes up to which a 2-peer unquantized all-reduce is one exchange of the whole
#: vector instead of the ring's two steps (measured on loopback, 2 cores: 4-256 KiB
#: 1.3-1.8x faster, 1 MiB even, 8 MiB slower)
PAIR_EXCHANGE_MAX = 1 << 20
_TRAFFIC = ("bytes_sent", "bytes_received", "wire_bytes_sent", "wire_bytes_received", "bytes_buffered")
_TICKET_TTL = 6 * 3600.0
_MAX_PEERS = 1024
_DEBUG = bool(os.environ.get("COMMLIB_ELASTIC_DEBUG"))


def _dbg(msg: str) -> None:
    if _DEBUG:
        import sys  # noqa: PLC0415
        print(f"[elastic {time.monotonic():.3f} pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


class PeerFailure(ProcessFailed):
    """A peer died during an elastic operation (raised when ``retry=False``, or
    when retries could not complete it)."""


class AuthError(AuthenticationError):
    """Authentication with the master failed (wrong or missing secret, or the
    master refused); the other side learned nothing."""


def _is_bytes(x, n=None) -> bool:
    return isinstance(x, bytes) and (n is None or len(x) == n)


def _is_int(x, lo=0, hi=(1 << 62)) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


# =====================================================================  master
class _MPeer:
    """The master's record of one peer."""

    def __init__(self, pid: int, conn: tcp.Connection, data: str, streams: int, key: bytes):
        self.id, self.conn, self.data, self.streams, self.key = pid, conn, data, streams, key
        self.state = "pending"
        self.waiting = False          # a pending peer waiting in update_topology
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, msg) -> None:
        self.outbox.put(msg)


class Master:
    """The membership master (see the module docstring for its state machine).

    Args:
        bind: ``"host:port"`` to listen on (port 0: any free port).
        secret, secret_file: the shared secret (else ``COMMLIB_ELASTIC_SECRET``).
        heartbeat_timeout: seconds of silence after which a peer is dead.
        abort_grace: seconds to wait for a death report before re-forming an
            epoch after an abort that no death explains.
        form_wait: with no live members, seconds the first pending voter waits
            for others starting at the same time (they form the first epoch together).
        encrypt: seal frames with AES-GCM (peers must agree).
    """

    def __init__(self, bind: str = "127.0.0.1:0", secret: bytes | str | None = None, secret_file: str | None = None,
                 *, heartbeat_timeout: float = 2.0, abort_grace: float = 0.3, form_wait: float = 0.25,
                 encrypt: bool = False):
        self.bind = bind
        self.secret = tcp.read_secret(secret, secret_file)
        self.heartbeat_timeout, self.abort_grace, self.encrypt = heartbeat_timeout, abort_grace, encrypt
        self.form_wait = form_wait
        self._key = os.urandom(32)            # master-only: derives each peer's ticket key
        self._lock = threading.RLock()
        self._peers: dict[int, _MPeer] = {}
        self._next_id = 1
        self.epoch = 0
        self.step = 0                         # completed votes (the job's step counter)
        self.members: list[int] = []         # ring order of the current epoch
        self._epoch_members: dict[int, list[int]] = {}
        self._ops: dict[tuple, dict] = {}     # (epoch, seq) -> {"done": set, "term": None|bool, "sent": set}
        self._voters: set[int] = set()
        self._sync: dict[int, dict] = {}      # id -> submission of the open round
        self._sync_round = 0
        self._fetchers: set[int] | None = None  # of the round being transferred
        self._renew_at: float | None = None
        self._form_at: float | None = None
        self.revision = None
        self.hashes: dict | None = None
        # (revision, hashes) of a group that is gone: every member left or died after the
        # state was synced.  A group formed later from pending peers alone must show it
        # holds that state at its first sync, else the sync is refused ("lost"): one job,
        # one history per master (see "Orphaned state" in the docstring)
        self._orphan: tuple | None = None
        self._last_tick: float | None = None
        self._listener = None
        self._stopped = threading.Event()
        self.stats = {"epochs": 0, "aborts": 0, "completes": 0, "deaths": 0, "refused": 0, "stalls": 0,
                      "lost_syncs": 0}

    # lifecycle ---------------------------------------------------------------
    def start(self) -> "Master":
        """Listen and serve on background threads; returns self."""
        self._listener = tcp.Listener(self.bind, self.secret, self._on_conn, encrypt=self.encrypt)
        self.address = self._listener.address
        threading.Thread(target=self._monitor, name="commlib-master-monitor", daemon=True).start()
        return self

    def serve_forever(self) -> None:
        """Block until :meth:`stop` (or Ctrl-C)."""
        if self._listener is None:
            self.start()
        try:
            while not self._stopped.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def stop(self) -> None:
        """Close the listener and every connection."""
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            peers = list(self._peers.values())
        for p in peers:
            p.outbox.put(None)
            p.conn.close()

    # connections -------------------------------------------------------------
    def _on_conn(self, conn: tcp.Connection) -> None:
        h = conn.hello
        data, streams = h.get("data"), h.get("streams")
        if h.get("role") != "peer" or not isinstance(data, str) or len(data) > 300 or not _is_int(streams, 1, 64):
            conn.close()
            return
        try:
            tcp.parse_address(data)
        except CommError:
            conn.close()
            return
        with self._lock:
            if self._stopped.is_set() or len(self._peers) >= _MAX_PEERS:
                conn.close()
                return
            pid = self._next_id
            self._next_id += 1
            key = hashlib.sha256(self._key + pid.to_bytes(8, "big")).digest()
            p = _MPeer(pid, conn, data, streams, key)
            self._peers[pid] = p
        _dbg(f"master: peer {pid} connected (data {data})")
        threading.Thread(target=self._writer, args=(p,), daemon=True, name="commlib-master-tx").start()
        p.send({"t": "welcome", "id": pid, "key": key, "hb": HEARTBEAT_INTERVAL})
        threading.Thread(target=self._reader, args=(p,), daemon=True, name="commlib-master-rx").start()

    def _writer(self, p: _MPeer) -> None:
        while True:
            try:
                msg = p.outbox.get(timeout=0.5)
            except queue.Empty:
                msg = "hb"
            if msg is None or p.conn.closed:
                return
            try:
                if msg == "hb":
                    p.conn.send_frame(tcp.K_PING, b"", timeout=self.heartbeat_timeout)
                else:
                    p.conn.send_ctrl(msg, timeout=self.heartbeat_timeout)
            except Exception as exc:  # noqa: BLE001 - a peer that does not read is dead
                _dbg(f"master: writer to peer {p.id} failed: {exc!r}")
                self._died(p.id)
                return

    def _reader(self, p: _MPeer) -> None:
        try:
            while not self._stopped.is_set():
                kind, _, msg = p.conn.read_ctrl(limit=1 << 20)
                if kind != tcp.K_CTRL or not isinstance(msg, dict):
                    raise tcp.FrameError("expected a control message")
                self._handle(p, msg)
        except Exception as exc:  # noqa: BLE001 - closed, malformed, or a bad message: the peer is gone
            _dbg(f"master: reader of peer {p.id} ended: {exc!r}")
        self._died(p.id)

    def _silent(self, p: _MPeer, now: float) -> bool:
        """True when ``p`` sent nothing for ``heartbeat_timeout`` seconds.  Bytes
        waiting unread in its socket count as a sign of life: the peer spoke, this
        process (its reader thread) was just not scheduled to read them yet."""
        if now - p.conn.last_rx <= self.heartbeat_timeout:
            return False
        try:
            readable = bool(select.select([p.conn.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True
        if readable:
            p.conn.last_rx = now
            return False
        return True

    def _monitor(self) -> None:
        while not self._stopped.wait(0.05):
            now = time.monotonic()
            with self._lock:
                last, self._last_tick = self._last_tick, now
                if last is not None and now - last > 0.5:
                    # this process was not scheduled for a while (a starved CPU): the
                    # peers' silence is ours; restart their clocks rather than declare
                    # live peers dead
                    self.stats["stalls"] += 1
                    _dbg(f"master: monitor stalled {now - last:.2f} s; heartbeat clocks restarted")
                    for p in self._peers.values():
                        p.conn.last_rx += now - last   # the silence before the stall still counts
                    continue
                for p in list(self._peers.values()):
                    if p.state != "dead" and self._silent(p, now):
                        self._died(p.id)
                if self._form_at is not None and now >= self._form_at:
                    self._check_vote()
                if self._renew_at is not None and now >= self._renew_at:
                    self._renew_at = None
                    self._new_epoch(self._live(self.members), "abort")

    # state machine -------------------------------------------------------------
    def groups(self) -> list[list[int]]:
        """The groups this master serves: ``[members]`` of the current epoch, or ``[]``
        when it has none.  Raises AssertionError when the invariant "one group per
        master" is broken: a peer the master considers alive is neither a member of
        the current epoch nor pending, or a member is not alive (for tests)."""
        with self._lock:
            alive = {i for i, p in self._peers.items() if p.state != "dead"}
            members = set(self.members)
            stray = sorted(i for i in alive if i not in members and self._peers[i].state != "pending")
            gone = sorted(members - alive)
            assert not stray, f"peers {stray} alive but neither members of epoch {self.epoch} nor pending"
            assert not gone, f"members {gone} of epoch {self.epoch} are dead"
            assert all(self._peers[i].state == "member" for i in members)
            return [list(self.members)] if self.members else []

    def _live(self, ids) -> list[int]:
        return [i for i in ids if i in self._peers and self._peers[i].state != "dead"]

    def _died(self, pid: int) -> None:
        with self._lock:
            p = self._peers.get(pid)
            if p is None or p.state == "dead":
                return
            was_member = p.state == "member"
            _dbg(f"master: peer {pid} dead (was {p.state}; silent {time.monotonic() - p.conn.last_rx:.2f} s)")
            p.state = "dead"
            self.stats["deaths"] += 1
            p.outbox.put(None)
            p.conn.close()
            self._voters.discard(pid)
            self._sync.pop(pid, None)
            if was_member and pid in self.members:
                self._new_epoch(self._live(self.members), "death")
            self._check_vote()
            self._check_sync()
            self._check_fetch()
            # forget the dead once nothing refers to them
            if not any(pid in m for m in self._epoch_members.values()):
                self._peers.pop(pid, None)

    def _new_epoch(self, members: list[int], why: str) -> None:
        """Make epoch + 1 with ``members`` (ring order: join order); abort what
        is open in older epochs; push the topology to every member."""
        self._renew_at = None
        old = self.epoch
        self.epoch += 1
        self.stats["epochs"] += 1
        if not members and self.revision is not None:
            self._orphan = (self.revision, dict(self.hashes or {}))
        self.members = sorted(members)
        self._epoch_members[self.epoch] = list(self.members)
        _dbg(f"master: epoch {self.epoch} members {self.members} ({why}); peers "
             f"{ {i: q.state + ('*' if q.waiting else '') for i, q in self._peers.items()} }")
        for pid in self.members:
            self._peers[pid].state = "member"
            self._peers[pid].waiting = False
        for (e, s), op in list(self._ops.items()):
            if e <= old and op["term"] is None:
                self._terminate((e, s), False)
        exp = time.time() + _TICKET_TTL
        addrs = [[pid, self._peers[pid].data] for pid in self.members]
        for src in self.members:
            ns = self._peers[src].streams
            tickets = {dst: [tcp.make_ticket(self._peers[dst].key, self.epoch, src, dst, s, exp) for s in range(ns)]
                       for dst in self.members if dst != src}
            self._peers[src].send({"t": "topo", "e": self.epoch, "members": addrs, "tickets": tickets, "exp": exp,
                                   "why": why, "rev": self.revision})
        self._prune()

    def _terminate(self, tag, ok: bool) -> None:
        op = self._ops.setdefault(tag, {"done": set(), "term": None, "sent": set()})
        if op["term"] is None:
            op["term"] = ok
            self.stats["completes" if ok else "aborts"] += 1
        for pid in self._live(self._epoch_members.get(tag[0], [])):
            if pid not in op["sent"]:
                op["sent"].add(pid)
                self._peers[pid].send({"t": "term", "e": tag[0], "s": tag[1], "ok": op["term"]})

    def _prune(self) -> None:
        """Forget operations every live member has its terminal message for, and empty old epochs."""
        for tag, op in list(self._ops.items()):
            if op["term"] is not None and set(self._live(self._epoch_members.get(tag[0], []))) <= op["sent"]:
                if tag[0] < self.epoch:
                    del self._ops[tag]
        live_epochs = {t[0] for t in self._ops} | {self.epoch}
        for e in list(self._epoch_members):
            if e not in live_epochs:
                del self._epoch_members[e]

    def _handle(self, p: _MPeer, msg: dict) -> None:
        t = msg.get("t")
        with self._lock:
            if p.state == "dead":
                return
            if t == "vote":
                if p.state == "member":
                    self._voters.add(p.id)
                else:
                    p.waiting = True
                self._check_vote()
            elif t in ("done", "fail"):
                e, s = msg.get("e"), msg.get("s")
                if not (_is_int(e) and _is_int(s)):
                    raise tcp.FrameError("bad operation report")
                if p.id not in self._epoch_members.get(e, ()):
                    # an epoch this peer was not in (or long gone): refuse quietly
                    p.send({"t": "term", "e": e, "s": s, "ok": False})
                    return
                tag = (e, s)
                op = self._ops.get(tag)
                if op is not None and op["term"] is not None:
                    if p.id not in op["sent"]:
                        op["sent"].add(p.id)
                        p.send({"t": "term", "e": e, "s": s, "ok": op["term"]})
                    return
                if e < self.epoch or t == "fail":
                    self._terminate(tag, False)
                    if t == "fail" and e == self.epoch and self._renew_at is None:
                        self._renew_at = time.monotonic() + self.abort_grace
                    return
                op = self._ops.setdefault(tag, {"done": set(), "term": None, "sent": set()})
                op["done"].add(p.id)
                if set(self._live(self.members)) <= op["done"]:
                    self._terminate(tag, True)
                    self._prune()
            elif t == "sync":
                if p.state != "member":
                    raise tcp.FrameError("sync from a non-member")
                rev, hashes, meta = msg.get("rev"), msg.get("hashes"), msg.get("meta")
                if not (_is_int(rev, -(1 << 62)) and isinstance(hashes, dict) and isinstance(meta, dict)
                        and all(isinstance(k, str) and _is_bytes(v, 32) for k, v in hashes.items())
                        and set(meta) == set(hashes)):
                    raise tcp.FrameError("bad sync message")
                self._sync[p.id] = {"rev": rev, "hashes": hashes, "meta": meta}
                self._check_sync()
            elif t == "synced":
                if self._fetchers is not None:
                    self._fetchers.discard(p.id)
                    self._check_fetch()
            elif t == "bye":
                raise tcp.FrameError("bye")
            else:
                raise tcp.FrameError("unknown message")

    def _check_vote(self) -> None:
        live = set(self._live(self.members))
        waiting = [pid for pid, p in self._peers.items() if p.state == "pending" and p.waiting]
        if not live <= self._voters or (not live and not waiting):
            return
        if not live:
            # forming the first group (or re-forming after everyone died): gather
            # the peers that start together for ``form_wait`` seconds
            now = time.monotonic()
            if self._form_at is None:
                self._form_at = now + self.form_wait
            if now < self._form_at:
                return
        self._form_at = None
        new = sorted(live | set(waiting))
        _dbg(f"master: vote {self.step + 1} complete: live {sorted(live)} waiting {sorted(waiting)} "
             f"members {self.members}")
        if new != self.members:
            self._new_epoch(new, "vote")
        self.step += 1
        for pid in set(self._voters) | set(waiting):
            if pid in self._peers and self._peers[pid].state == "member":
                self._peers[pid].send({"t": "voted", "e": self.epoch, "v": self.step})
        self._voters.clear()

    def _check_sync(self) -> None:
        live = self._live(self.members)
        if self._fetchers is not None or not live or not set(live) <= set(self._sync):
            return
        subs = {pid: self._sync[pid] for pid in live}
        top = max(s["rev"] for s in subs.values())
        groups: dict = {}
        for pid in live:  # ring order: ties go to the group holding the lowest rank
            s = subs[pid]
            if s["rev"] == top:
                key = tuple(sorted((k, h, str(s["meta"][k])) for k, h in s["hashes"].items()))
                groups.setdefault(key, []).append(pid)
        if self._orphan is not None:
            orev, ohashes = self._orphan
            if not any(s["rev"] > orev or (s["rev"] == orev and s["hashes"] == ohashes) for s in subs.values()):
                # every peer that held the job's state is gone; these peers would start a
                # second history under this master: refuse (each member raises)
                self._sync_round += 1
                self._sync = {pid: s for pid, s in self._sync.items() if pid not in subs}
                self.stats["lost_syncs"] += 1
                _dbg(f"master: sync round {self._sync_round} refused: state at revision {orev} is held by no "
                     f"live peer (best {top})")
                for pid in live:
                    self._peers[pid].send({"t": "plan", "round": self._sync_round, "e": self.epoch, "lost": orev})
                return
            self._orphan = None
        donors = max(groups.values(), key=len)
        win = subs[donors[0]]
        fetchers = [pid for pid in live if pid not in donors]
        self.revision, self.hashes = top, dict(win["hashes"])
        self._sync_round += 1
        self._sync = {pid: s for pid, s in self._sync.items() if pid not in subs}
        self._fetchers = set(fetchers)
        addrs = {pid: self._peers[pid].data for pid in donors}
        plan = {"t": "plan", "round": self._sync_round, "e": self.epoch, "rev": top, "hashes": win["hashes"],
                "meta": win["meta"], "donors": donors, "addrs": addrs, "fetchers": fetchers}
        for pid in live:
            self._peers[pid].send(plan)
        self._check_fetch()

    def _check_fetch(self) -> None:
        if self._fetchers is None:
            return
        self._fetchers &= set(self._live(self._peers))
        if self._fetchers:
            return
        self._fetchers = None
        for pid in self._live(self.members):
            self._peers[pid].send({"t": "sync_end", "round": self._sync_round})
        self._check_sync()


# =====================================================================  peer
class _Topo:
    def __init__(self, msg: dict, my_id: int):
        self.epoch = msg["e"]
        self.ids = [int(m[0]) for m in msg["members"]]
        self.addrs = {int(m[0]): str(m[1]) for m in msg["members"]}
        self.tickets = msg["tickets"]
        self.exp = msg["exp"]
        self.rank = self.ids.index(my_id) if my_id in self.ids else None


class _QuantTransport:
    """A view of a transport that sends float chunks as fp16 or int8 (+ one
    float32 scale per message) and dequantizes on receipt, so the ring modules
    run unchanged over quantized wire data.

    Bit identity: the first time a region is sent, it is quantized and
    overwritten in place with its own dequantized value; a region that arrived
    (already dequantized) is forwarded with the exact bytes it came in.  So a
    chunk's owner dequantizes its own reduced chunk before the all-gather and
    every peer ends with the same bits.
    """

    def __init__(self, inner, mode: str):
        self.inner, self.mode = inner, mode
        self.tags = inner.tags
        self._cache: dict = {}

    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)

    def _wire_nbytes(self, count: int) -> int:
        return 2 * count if self.mode == "fp16" else 4 + count

    def _encode(self, x: np.ndarray) -> np.ndarray:
        if self.mode == "fp16":
            w = x.astype(np.float16)
            x[...] = w.astype(x.dtype)
            return w.view(np.uint8)
        amax = float(np.max(np.abs(x))) if x.size else 0.0
        scale = np.float32(amax / 127.0) if np.isfinite(amax) and amax > 0 else np.float32(1.0)
        if scale == 0:
            scale = np.float32(1.0)
        q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
        w = np.empty(4 + x.size, np.uint8)
        w[:4] = np.frombuffer(scale.tobytes(), np.uint8)
        w[4:] = q.view(np.uint8)
        self._decode(w, x)
        return w

    def _decode(self, w: np.ndarray, x: np.ndarray) -> None:
        if self.mode == "fp16":
            x[...] = w.view(np.float16).astype(x.dtype)
            return
        scale = x.dtype.type(w[:4].view(np.float32)[0])
        np.multiply(w[4:].view(np.int8).astype(x.dtype), scale, out=x)

    def isend(self, buf, dest, tag=0) -> Request:
        key = (buf.ctypes.data, buf.nbytes)
        w = self._cache.get(key)
        if w is None:
            w = self._encode(buf)
            self._cache[key] = w
        return self.inner.isend(w, dest, tag)

    def irecv(self, buf, source, tag=0) -> Request:
        w = np.empty(self._wire_nbytes(buf.size), np.uint8)
        req = self.inner.irecv(w, source, tag)
        key = (buf.ctypes.data, buf.nbytes)

        def finish():
            self._decode(w, buf)
            self._cache[key] = w

        req.on_complete = finish
        return req

    def waitall(self, requests, timeout=None, op="waitall") -> None:
        self.inner.waitall(requests, timeout, op)


class Peer:
    """One elastic peer (made by :func:`connect`).

    Attributes:
        id: the master's id for this peer (stable for its lifetime).
        rank, size, epoch: in the current topology (``rank`` None while pending).
        step: the master's count of completed votes, as of this peer's last
            :meth:`update_topology` (the same on every member: a job-wide step number).
    """

    def __init__(self, address: str, secret: bytes, *, streams: int | None = None, timeout: float = 30.0,
                 encrypt: bool = False, bind: str | None = None, advertise: str | None = None):
        if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int)
                                    or not 1 <= streams <= 64):
            raise InvalidArgument(f"streams must be None or 1..64, got {streams!r}", op="connect")
        # streams=None: AUTO_STREAMS connections to a peer on another host, one to a peer on a
        # loopback address (striping there only adds threads that compete for the same CPUs)
        self._auto_streams = streams is None
        self.streams = AUTO_STREAMS if streams is None else int(streams)
        self.secret, self.timeout, self.encrypt = secret, float(timeout), encrypt
        self.master_address = address
        try:
            sock = tcp.open_socket(address, timeout)
        except OSError as exc:
            raise CommError(f"cannot reach the master at {address}: {exc}", op="connect") from None
        local = sock.getsockname()[0]
        self._listener = tcp.Listener(bind or f"{local}:0", secret, self._on_data_conn, encrypt=encrypt)
        data = advertise or (self._listener.address if bind is None or not bind.startswith("0.0.0.0")
                             else f"{local}:{self._listener.address.rsplit(':', 1)[1]}")
        try:
            self._conn = tcp.client_handshake(sock, secret, {"role": "peer", "data": data, "streams": self.streams},
                                              timeout=min(timeout, 10.0), encrypt=encrypt)
            kind, _, msg = self._conn.read_ctrl(deadline=time.monotonic() + timeout, limit=1 << 16)
            if kind != tcp.K_CTRL or not isinstance(msg, dict) or msg.get("t") != "welcome":
                raise tcp.FrameError("expected welcome")
        except (AuthenticationError, tcp.FrameError, OSError) as exc:
            self._listener.close()
            raise AuthError(f"the master at {address} refused the connection ({type(exc).__name__})",
                            op="connect") from None
        except BaseException:
            self._listener.close()
            raise
        self.id, self._key = int(msg["id"]), bytes(msg["key"])
        self._cv = threading.Condition()
        self._topo: _Topo | None = None      # adopted
        self._latest: _Topo | None = None    # newest pushed
        self._terms: dict = {}
        self._voted: int | None = None
        self._plans: dict = {}
        self._sync_ends: set = set()
        self._lost: str | None = None
        self._closed = False
        self._seq = 0
        self.step = 0
        self._tr: tcp.TCPTransport | None = None
        self._parked: list = []
        self._serving = None                 # (min epoch, {name: memoryview}) while a donor
        self._last_members: frozenset | None = None
        self._counts = {"retries": 0, "aborts": 0}
        self._traffic = dict.fromkeys(_TRAFFIC, 0)  # of the ring transports of past epochs
        self._scratch: np.ndarray | None = None
        self._ring_keep: np.ndarray | None = None  # the in-place ring's receive scratch (ring_scratch)
        self._pair_keep: np.ndarray | None = None  # 2 peers: the result and the received vector
        threading.Thread(target=self._reader, daemon=True, name="commlib-peer-rx").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="commlib-peer-hb").start()

    # properties --------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counters of this peer since :func:`connect` (a new dict on each read):

        - ``retries``, ``aborts``: all-reduces aborted (a peer died or failed) and retried;
        - ``bytes_sent``, ``bytes_received``: payload bytes of the all-reduce data plane
          (the ring's messages, over every epoch's transport; quantized messages count
          their wire size). A ring all-reduce of ``B`` bytes over ``n`` peers sends and
          receives ``2 (n - 1) / n * B`` per peer (to rounding of the chunk bounds);
        - ``wire_bytes_sent``, ``wire_bytes_received``: the same frames as they crossed
          the wire: payloads plus a 28-byte header per frame (plus a 16-byte AES-GCM tag
          per frame with ``encrypt=True``); received also counts frames dropped (an old
          epoch's, an aborted operation's);
        - ``bytes_buffered``: payload bytes that arrived before their receive was posted
          and took one extra copy.

        Not counted: the control connection to the master, handshakes, and
        :meth:`sync_shared_state` transfers (its result gives ``bytes_received``).
        """
        with self._cv:
            out = dict(self._counts)
            tr = self._tr
            for k in _TRAFFIC:
                out[k] = self._traffic[k] + (getattr(tr, k) if tr is not None else 0)
        return out

    def _retire(self, tr) -> None:
        """Close an epoch's transport, keeping its byte counts in :attr:`stats`."""
        tr.close()
        with self._cv:
            if self._tr is tr:
                self._tr = None
            for k in _TRAFFIC:
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
                    if t == "topo":
                        topo = _Topo(msg, self.id)
                        if self._latest is None or topo.epoch > self._latest.epoch:
                            self._latest = topo
                            tr = self._tr
                            if tr is not None and tr.epoch < topo.epoch:
                                tr.revoke("a newer epoch began")
                    elif t == "term":
                        self._terms[(msg["e"], msg["s"])] = bool(msg["ok"])
                        tr = self._tr
                        if not msg["ok"] and tr is not None and tr.epoch == msg["e"]:
                            tr.revoke("operation aborted by the master")
                    elif t == "voted":
                        self._voted = int(msg["e"])
                        self.step = int(msg.get("v", 0))
                    elif t == "plan":
                        self._plans[int(msg["round"])] = msg
                    elif t == "sync_end":
                        self._sync_ends.add(int(msg["round"]))
                    self._cv.notify_all()
        except Exception as exc:  # noqa: BLE001
            with self._cv:
                self._lost = self._lost or f"lost the master ({type(exc).__name__})"
                tr = self._tr
                self._cv.notify_all()
            if tr is not None:
                tr.revoke("lost the master")

    def _heartbeat(self) -> None:
        while not self._closed and self._lost is None:
            try:
                self._conn.send_frame(tcp.K_PING, b"", timeout=5.0)
            except Exception:  # noqa: BLE001
                return
            time.sleep(HEARTBEAT_INTERVAL)

    def _send(self, msg) -> None:
        try:
            self._conn.send_ctrl(msg, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001
            raise CommError(f"lost the master ({type(exc).__name__})", rank=self.rank, op="elastic") from None

    def _wait(self, pred, timeout: float, op: str):
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                v = pred()
                if v is not None:
                    return v
                if self._lost is not None:
                    raise CommError(self._lost, rank=self.rank, op=op)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"no answer from the master after {timeout:.3g} s", rank=self.rank, op=op)
                self._cv.wait(min(left, 0.5))

    def _adopt(self) -> _Topo | None:
        """Make the newest pushed topology the current one (at an operation's start)."""
        with self._cv:
            latest = self._latest
            if latest is not None and (self._topo is None or latest.epoch > self._topo.epoch):
                self._topo = latest
                self._seq = 0
                self._terms = {k: v for k, v in self._terms.items() if k[0] >= latest.epoch}
            return self._topo

    # data plane -------------------------------------------------------------
    def _on_data_conn(self, conn: tcp.Connection) -> None:
        h = conn.hello
        src, dst, e, st, ns, exp, tkt = (h.get(k) for k in ("src", "dst", "e", "stream", "streams", "exp", "tkt"))
        if not (_is_int(src) and dst == self.id and _is_int(e) and _is_int(st, 0, 63) and _is_int(ns, 1, 64)
                and isinstance(exp, float) and tcp.verify_ticket(self._key, tkt, e, src, dst, st, exp)):
            conn.close()
            return
        if h.get("purpose") == "fetch":
            threading.Thread(target=self._serve_when_ready, args=(conn, e), daemon=True, name="commlib-donor").start()
            return
        with self._cv:
            tr = self._tr
            if tr is not None and tr.epoch == e:
                pass
            elif (tr is None or e > tr.epoch) and len(self._parked) < 4096:
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

    def _dial(self, topo: _Topo, dst: int, stream: int, purpose: str, timeout: float) -> tcp.Connection:
        tickets = topo.tickets.get(dst)
        if tickets is None or stream >= len(tickets):
            raise ProcessFailed(f"no ticket for peer {dst}", failed=[], rank=topo.rank, op="elastic")
        s = tcp.open_socket(topo.addrs[dst], timeout)
        hello = {"src": self.id, "dst": dst, "e": topo.epoch, "stream": stream,
                 "streams": self._streams_to(topo.addrs[dst]) if purpose == "ring" else self.streams,
                 "exp": float(topo.exp), "tkt": tickets[stream], "purpose": purpose}
        return tcp.client_handshake(s, self.secret, hello, timeout=timeout, encrypt=self.encrypt)

    def _streams_to(self, addr: str) -> int:
        """Ring connections to the peer whose data address is ``addr``: ``streams`` as
        given, or with ``streams=None``, 1 on a loopback address and :data:`AUTO_STREAMS`
        elsewhere."""
        if not self._auto_streams:
            return self.streams
        try:
            host = tcp.parse_address(addr)[0]
        except CommError:
            return self.streams
        if host == "localhost":
            return 1
        try:
            return 1 if ipaddress.ip_address(host).is_loopback else self.streams
        except ValueError:
            return self.streams

    def _transport(self, topo: _Topo) -> tcp.TCPTransport:
        tr = self._tr
        if tr is not None and tr.epoch == topo.epoch:
            return tr
        if tr is not None:
            self._retire(tr)
        tr = tcp.TCPTransport(topo.rank, len(topo.ids), topo.epoch,
                              lambda r, s: self._dial(topo, topo.ids[r], s, "ring", min(self.timeout, 10.0)),
                              streams=lambda r: self._streams_to(topo.addrs[topo.ids[r]]), timeout=self.timeout)
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
    def update_topology(self, timeout: float | None = None) -> bool:
        """Step boundary: vote with the live peers; pending peers are admitted.

        Blocks until every live member has called it (a pending peer: until it is
        admitted).  Returns True when the member set differs from the one this
        peer saw at its previous call (always True on admission).

        Raises:
            CommTimeout: no decision within ``timeout`` (default: the peer's timeout).
            CommError: the master is gone.
        """
        timeout = self.timeout if timeout is None else timeout
        self._adopt()
        with self._cv:
            self._voted = None
        self._send({"t": "vote"})
        e = self._wait(lambda: self._voted, timeout, "update_topology")
        self._wait(lambda: True if self._latest is not None and self._latest.epoch >= e else None, timeout,
                   "update_topology")
        topo = self._adopt()
        members = frozenset(topo.ids)
        changed = members != self._last_members
        self._last_members = members
        return changed

    def allreduce(self, buf: np.ndarray, op: str = "sum", quantize: str | None = None, retry: bool = True,
                  timeout: float | None = None, max_retries: int = 16) -> np.ndarray:
        """All-reduce ``buf`` in place over the current members; bit-identical on all.

        Runs :func:`~commlib.collectives.allreduce_ring.allreduce_ring` over the
        epoch's TCP transport, then waits for the master's terminal message.  If
        the operation is aborted (a peer died or failed), ``buf`` is restored and
        the operation is retried over the next epoch's members (``retry``).  The
        restore comes from a copy-before-write snapshot taken while the ring's
        transfers are in flight, into a scratch buffer the peer keeps between calls
        (as large as its largest all-reduce).  With 2 members, no quantization and
        at most :data:`PAIR_EXCHANGE_MAX` bytes, the ring's two steps become one
        exchange of the whole vector
        (:func:`~commlib.collectives.allreduce_recursive_doubling.allreduce_recursive_doubling`,
        the same bytes on the wire, both peers combining rank 0's vector as the
        left operand), computed into a kept scratch of twice ``buf``'s size and
        copied into ``buf`` only once the master commits: an abort leaves ``buf``
        untouched.

        Args:
            buf: contiguous numpy array (any shape), same shape and dtype on every peer.
            op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"`` or ``"prod"``.
            quantize: None, ``"fp16"`` or ``"int8"`` (floating dtypes only): the
                wire format of each message; every peer still ends with the same bits.
            retry: on an abort, retry over the survivors (else raise PeerFailure).
            timeout: seconds for each ring step and the wait for the verdict.
            max_retries: aborts tolerated before PeerFailure.

        Returns:
            ``buf``.

        Raises:
            InvalidArgument: bad buffer, op or quantize; not a member.
            PeerFailure: aborted and ``retry=False`` (or too many retries).
        """
        timeout = self.timeout if timeout is None else timeout
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise InvalidArgument("buf must be a C-contiguous numpy array", rank=self.rank, op="allreduce")
        check_plain_dtype(buf.dtype, self.rank, "allreduce", "buf")
        if op not in ("sum", "avg", "min", "max", "prod"):
            raise InvalidArgument(f"op must be sum, avg, min, max or prod, got {op!r}", rank=self.rank, op="allreduce")
        opx = get_op(op)
        opx.check(buf.dtype, rank=self.rank, op="allreduce")
        if quantize not in (None, "fp16", "int8"):
            raise InvalidArgument(f"quantize must be None, 'fp16' or 'int8', got {quantize!r}", rank=self.rank,
                                  op="allreduce")
        if quantize is not None and not is_floating(buf.dtype):
            raise InvalidArgument("quantize needs a floating dtype", rank=self.rank, op="allreduce")
        flat = buf.reshape(-1)
        aborts = 0
        while True:
            topo = self._adopt()
            if topo is None or topo.rank is None:
                raise InvalidArgument("this peer is not a member yet: call update_topology() first",
                                      rank=None, op="allreduce")
            e, s = topo.epoch, self._seq
            snap = result = None
            try:
                tr = self._transport(topo)
                if tr.size == 1:
                    opx.finalize(flat, 1)  # the identity for every op: nothing to save
                elif tr.size == 2 and quantize is None and flat.nbytes <= PAIR_EXCHANGE_MAX:
                    # one exchange of the whole vector (recursive doubling at 2 ranks): half
                    # the ring's steps, the same bytes; the result is built out of place, so
                    # ``buf`` is untouched until the commit and an abort has nothing to restore.
                    # Above PAIR_EXCHANGE_MAX the ring wins: its snapshot copies overlap its
                    # transfers, while here the combine and the final copy of the whole
                    # vector do not
                    nb = flat.nbytes
                    self._pair_keep = grown(self._pair_keep, 2 * nb)
                    result = self._pair_keep[:nb].view(flat.dtype)
                    allreduce_recursive_doubling(tr, result, opx, sendbuf=flat, timeout=timeout,
                                                 tmp=self._pair_keep[nb:2 * nb].view(flat.dtype))
                else:
                    # copy-before-write snapshot into a reused scratch (no page faults, the
                    # copies overlap the ring's transfers); restored only on an abort
                    self._scratch = grown(self._scratch, flat.nbytes)  # the largest all-reduce so far
                    snap = LazySnapshot(flat, self._scratch)
                    self._ring_keep, tmp = ring_scratch(self._ring_keep, flat, tr.size)
                    if quantize is None:
                        allreduce_ring(tr, flat, opx, timeout=timeout, save=snap, tmp=tmp)
                    else:
                        # the quantizing view overwrites a chunk with its dequantized value when it
                        # first sends it, before the ring's lazy saves: save everything up front
                        snap.save_all()
                        allreduce_ring(_QuantTransport(tr, quantize), flat, opx, timeout=timeout, tmp=tmp)
                report = "done"
            except (CommError, OSError):
                report = "fail"
            self._send({"t": report, "e": e, "s": s})
            ok = self._wait(lambda: self._terms.pop((e, s), None), timeout + 5.0, "allreduce")
            if ok:
                self._seq += 1
                if result is not None:
                    flat[...] = result
                return buf
            if snap is not None:
                snap.restore()
            self._counts["aborts"] += 1
            aborts += 1
            if not retry or aborts > max_retries:
                raise PeerFailure(f"all-reduce aborted in epoch {e} (a peer failed)", rank=topo.rank,
                                  op="allreduce")
            # the next epoch (survivors, fresh connections) comes from the master
            self._wait(lambda: True if self._latest is not None and self._latest.epoch > e else None,
                       timeout, "allreduce")
            self._counts["retries"] += 1

    def sync_shared_state(self, state: dict, revision: int, timeout: float | None = None) -> dict:
        """Make ``state`` identical on every member (see the module docstring).

        Args:
            state: name → numpy array (C-contiguous); updated in place (a missing
                name, or one of another dtype/shape, gets a new array).
            revision: this peer's revision of ``state``.
            timeout: seconds to wait for the plan and for the transfers.

        Returns:
            ``{"revision", "bytes_received", "donor", "seconds"}`` (donor: the peer
            id bytes came from, None when in sync).

        Raises:
            CommError: every donor failed or the received bytes did not verify.
        """
        timeout = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        topo = self._adopt()
        if topo is None or topo.rank is None:
            raise InvalidArgument("not a member: call update_topology() first", op="sync_shared_state")
        if not _is_int(revision, -(1 << 62)):
            raise InvalidArgument("revision must be an int", rank=topo.rank, op="sync_shared_state")
        hashes, meta, views = {}, {}, {}
        for name, arr in state.items():
            if not isinstance(name, str) or not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
                raise InvalidArgument(f"state[{name!r}] must be a C-contiguous numpy array keyed by str",
                                      rank=topo.rank, op="sync_shared_state")
            check_plain_dtype(arr.dtype, topo.rank, "sync_shared_state", name)
            mv = memoryview(arr.reshape(-1).view(np.uint8))
            hashes[name] = hashlib.sha256(mv).digest()
            meta[name] = [arr.dtype.str, list(arr.shape)]
            views[name] = mv
        with self._cv:
            rounds_before = set(self._plans)
        self._send({"t": "sync", "rev": int(revision), "hashes": hashes, "meta": meta})
        plan = self._wait(lambda: next((p for r, p in sorted(self._plans.items()) if r not in rounds_before), None),
                          timeout, "sync_shared_state")
        rnd = int(plan["round"])
        with self._cv:
            self._plans.pop(rnd, None)
        if plan.get("lost") is not None:
            raise CommError(f"the job's shared state (revision {plan['lost']}) is held by no live peer: every peer "
                            "that had it left or died before this group formed; start a new master for a new job",
                            rank=topo.rank, op="sync_shared_state")
        donors = [int(d) for d in plan["donors"]]
        result = {"revision": int(plan["rev"]), "bytes_received": 0, "donor": None}
        if not plan["fetchers"]:
            result["seconds"] = time.monotonic() - t0
            return result
        if self.id in donors:
            self._serving = (int(plan["e"]), views)
            try:
                self._wait(lambda: True if rnd in self._sync_ends else None, timeout, "sync_shared_state")
            finally:
                self._serving = None
            result["seconds"] = time.monotonic() - t0
            return result
        try:
            got, donor = self._fetch(plan, state, topo, timeout, own=hashes)
        finally:
            self._send({"t": "synced"})
        self._wait(lambda: True if rnd in self._sync_ends else None, timeout, "sync_shared_state")
        result.update(bytes_received=got, donor=donor, seconds=time.monotonic() - t0)
        return result

    # state transfer ---------------------------------------------------------
    _RANGE = 4 << 20

    def _serve_when_ready(self, conn: tcp.Connection, e: int) -> None:
        """A fetcher may dial as soon as it has the sync plan, before this donor
        has read the same plan: wait for it (bounded by ``timeout``), then serve;
        a fetch for an older epoch is refused."""
        deadline = time.monotonic() + self.timeout
        while True:
            serving = self._serving
            if serving is not None:
                if e < serving[0]:
                    break
                self._serve(conn, serving[1])
                return
            if self._closed or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        conn.close()

    def _serve(self, conn: tcp.Connection, views: dict) -> None:
        """Donor side of one fetch connection: answer range requests from ``views``."""
        rate = float(os.environ.get("COMMLIB_ELASTIC_SERVE_RATE", "0") or 0)  # bytes/s; testing / WAN emulation
        try:
            while self._serving is not None:
                kind, _, msg = conn.read_ctrl(deadline=time.monotonic() + self.timeout, limit=1 << 12)
                if kind != tcp.K_CTRL or not isinstance(msg, dict):
                    raise tcp.FrameError("bad request")
                name, off, n = msg.get("k"), msg.get("o"), msg.get("n")
                mv = views.get(name) if isinstance(name, str) else None
                if mv is None or not _is_int(off) or not _is_int(n, 0, tcp.FRAME_MAX) or off + n > len(mv):
                    raise tcp.FrameError("bad range")
                if rate > 0:
                    step = 1 << 16
                    for a in range(off, off + n, step):
                        time.sleep(min(step, off + n - a) / rate)
                        if self._serving is None:
                            raise ConnectionError("round over")
                conn.send_frame(tcp.K_DATA, mv[off:off + n], timeout=self.timeout)
        except Exception:  # noqa: BLE001
            pass
        conn.close()

    def _fetch(self, plan: dict, state: dict, topo: _Topo, timeout: float, own: dict | None = None):
        """Fetch every tensor whose hash differs, from the donors in turn; verify.

        ``own``: name → SHA-256 of this peer's tensors as they were when the
        call began (still valid for an array kept as it is: one pass over the
        state less before the first byte)."""
        want = {k: bytes(v) for k, v in plan["hashes"].items()}
        own = dict(own or {})
        views = {}
        for name, h in want.items():
            dt, shape = plan["meta"][name]
            dt = np.dtype(dt)
            if dt.hasobject:
                raise CommError("a donor's state holds object dtype", op="sync_shared_state")
            shape = tuple(int(x) for x in shape)
            arr = state.get(name)
            if not isinstance(arr, np.ndarray) or arr.dtype != dt or arr.shape != shape or not arr.flags.c_contiguous:
                arr = np.empty(shape, dt)
                state[name] = arr
                own.pop(name, None)
            views[name] = memoryview(arr.reshape(-1).view(np.uint8))
        todo = [(k, o, min(self._RANGE, len(views[k]) - o)) for k in sorted(views)
                if (own.get(k) or hashlib.sha256(views[k]).digest()) != want[k]
                for o in range(0, max(len(views[k]), 1), self._RANGE)]
        todo = [r for r in todo if r[2] > 0 or len(views[r[0]]) == 0]
        donors = [int(d) for d in plan["donors"]]
        start = (topo.rank or 0) % len(donors)
        order = donors[start:] + donors[:start]
        got, used = 0, None
        for d in order:
            if not todo:
                break
            try:
                n, todo = self._fetch_from(d, topo, views, todo, timeout)
                got += n
                used = d
            except _DonorFailed as exc:
                got += exc.nbytes
                todo = exc.todo
                continue
        for k in views:
            if hashlib.sha256(views[k]).digest() != want[k]:
                raise CommError(f"state tensor {k!r} did not verify (every donor failed or lied)",
                                rank=topo.rank, op="sync_shared_state")
        return got, used

    def _fetch_from(self, donor: int, topo: _Topo, views, todo, timeout):
        """Fetch ranges ``todo`` from ``donor`` over up to ``streams`` connections.

        Returns (bytes, []) or raises :class:`_DonorFailed` with what is left."""
        work = queue.SimpleQueue()
        for r in todo:
            work.put(r)
        left = list(todo)
        lock = threading.Lock()
        done_bytes = [0]
        errors = []

        def worker(stream):
            try:
                conn = self._dial(topo, donor, stream, "fetch", min(timeout, 10.0))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                return
            try:
                while True:
                    try:
                        r = work.get_nowait()
                    except queue.Empty:
                        return
                    k, o, n = r
                    try:
                        conn.send_ctrl({"k": k, "o": o, "n": n}, timeout=timeout)
                        kind, flags, ep, tg, ch, st, length = conn.read_header(time.monotonic() + timeout)
                        if kind != tcp.K_DATA or conn.plain_length(length) != n:
                            raise tcp.FrameError("bad reply")
                        conn.read_payload(length, into=views[k][o:o + n], deadline=time.monotonic() + timeout)
                    except Exception as exc:  # noqa: BLE001
                        errors.append(exc)
                        return
                    with lock:
                        left.remove(r)
                        done_bytes[0] += n
            finally:
                conn.close()

        nconn = max(1, min(self.streams, len(todo)))
        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(nconn)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout + 15.0)
        if left:
            raise _DonorFailed(done_bytes[0], left)
        return done_bytes[0], []

    def close(self) -> None:
        """Leave: say goodbye to the master and close every connection."""
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send_ctrl({"t": "bye"}, timeout=2.0)
        except Exception:  # noqa: BLE001
            pass
        self._conn.close()
        if self._tr is not None:
            self._retire(self._tr)
        self._listener.close()
        for item in self._parked:
            item[4].close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _DonorFailed(Exception):
    def __init__(self, nbytes, todo):
        self.nbytes, self.todo = nbytes, todo


def connect(address: str, secret: bytes | str | None = None, secret_file: str | None = None, *,
            streams: int | None = None,
            timeout: float = 30.0, encrypt: bool = False, bind: str | None = None,
            advertise: str | None = None) -> Peer:
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
            same cores: docs/ELASTIC.md), :data:`AUTO_STREAMS` (4) to any other.
        timeout: seconds any single wait may take.
        encrypt: seal every frame with AES-GCM (the master and all peers must agree).
        bind: ``host:port`` for this peer's data listener (default: the interface
            that reaches the master, any port).
        advertise: the ``host:port`` other peers should dial (behind NAT / port forwarding).

    Raises:
        AuthError: the secret is wrong or missing, or the master refused.
        CommError: the master cannot be reached.
    """
    try:
        key = tcp.read_secret(secret, secret_file)
    except AuthenticationError as exc:
        raise AuthError(exc.detail, op="connect") from None
    return Peer(address, key, streams=streams, timeout=timeout, encrypt=encrypt, bind=bind, advertise=advertise)
