"""The membership master of an elastic job (its state machine: :mod:`commlib.elastic.protocol`)."""
from __future__ import annotations

import hashlib
import math
import os
import queue
import select
import socket
import threading
import time

from commlib.core.errors import (AuthenticationError, CommError, CommTimeout, EncryptionMismatch, InvalidArgument,
                                 NoHandshakeSlot, SilentPort)
from commlib.transports import tcp

from .protocol import (BYE, DONE, DROP, FAIL, FETCH, GAVE_UP, GIVE_UP, JOB, PLAN, PROBE, REFUSE, REFUSED, RING,
                       SYNC, SYNCED, SYNC_END, TERM, TOPO, VOTE, VOTED, WELCOME, HEARTBEAT_INTERVAL, JOB_MAX,
                       JOB_WAIT, MAX_PEERS, PROBE_TIMEOUT, PROBE_TOKEN, TICKET_TTL, WHY_MAX, check_job, dbg, is_bytes,
                       is_int)

__all__ = ["Master"]

#: the highest call number a member's tags can hold (``tcp.OPERATION_TAGS`` tags a call
#: below ``tcp.FIRST_ROUND_TAG``)
_SEQ_MAX = tcp.FIRST_ROUND_TAG // tcp.OPERATION_TAGS - 1


class _MPeer:
    """The master's record of one peer."""

    def __init__(self, pid: int, conn: tcp.Connection, data: str, streams: int, key: bytes):
        self.id, self.conn, self.data, self.streams, self.key = pid, conn, data, streams, key
        self.state = "pending"
        self.waiting = False          # a pending peer waiting in update_topology
        self.finished = False         # left with close(finished=True): the job is done
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
        probe_timeout: seconds the master gives its probe of a joiner's data
            address (connect, handshake, answer; :data:`~commlib.elastic.protocol.PROBE_TIMEOUT`
            by default): a joiner whose address does not answer with its own
            listener within it is refused (its ``connect`` raises, naming the
            address and why) and never becomes a member.  None: no probe (for a
            master that cannot reach the peers' network although the peers reach
            each other; a peer whose address the others cannot dial then fails
            the group's calls until it leaves).
        job: the job's description (bytes, 1..:data:`~commlib.elastic.protocol.JOB_MAX`;
            opaque, compared byte for byte): a joiner whose ``connect(job=...)``
            differs is refused before admission (its ``connect`` raises
            :class:`~commlib.core.errors.JobMismatch` carrying these bytes); the
            members see nothing of it.  None (default): the first peer admitted
            with a job fixes it.  Peers with ``job=None`` are admitted either way.
            Given here, it is kept for the master's lifetime.  Fixed by a joiner,
            it is kept while the job runs, also when every member has left or died;
            a job that finished releases it: when the last member leaves with
            ``close(finished=True)``, the master forgets the job's description and
            its state's revision, and the next job (other flags, a fresh state) is
            admitted under the same master.

    Raises:
        InvalidArgument: ``probe_timeout`` is not None nor a finite number of seconds > 0;
            ``job`` is not None nor 1..JOB_MAX bytes.
        SecretError: the secret is missing or too short.

    Attributes:
        stats: counters; ``probes`` (joiners' data addresses probed),
            ``probe_refusals`` (joiners refused because the probe failed) and
            ``job_refusals`` (joiners refused because their job differs) among them.
        job: the job's description (bytes), or None while no peer with a job was admitted
            (and again once a job that a joiner fixed has finished).
    """

    def __init__(self, bind: str = "127.0.0.1:0", secret: bytes | str | None = None, secret_file: str | None = None,
                 *, heartbeat_timeout: float = 2.0, abort_grace: float = 0.3, form_wait: float = 0.25,
                 encrypt: bool = False, probe_timeout: float | None = PROBE_TIMEOUT, job: bytes | None = None):
        self.job = self._job_given = check_job(job, "Master")
        if probe_timeout is not None:
            try:
                ok = not isinstance(probe_timeout, bool) and math.isfinite(float(probe_timeout)) and probe_timeout > 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise InvalidArgument(f"probe_timeout must be None or a finite number of seconds > 0, got "
                                      f"{probe_timeout!r}", op="Master")
            probe_timeout = float(probe_timeout)
        self.probe_timeout = probe_timeout
        self.bind = bind
        self.secret = tcp.read_secret(secret, secret_file)
        self.heartbeat_timeout, self.abort_grace, self.encrypt = heartbeat_timeout, abort_grace, encrypt
        self.form_wait = form_wait
        self._key = os.urandom(32)            # master-only: derives each peer's ticket key
        self._lock = threading.RLock()
        self._peers: dict[int, _MPeer] = {}
        self._probing = 0                     # joiners whose data address is being probed (not yet peers)
        self._next_id = 1
        self.epoch = 0
        self.step = 0                         # completed votes (the job's step counter)
        self.members: list[int] = []         # ring order of the current epoch
        self._epoch_members: dict[int, list[int]] = {}
        self._ops: dict[tuple, dict] = {}     # (epoch, seq) -> {"done": set, "term": None|bool, "sent": set}
        # per epoch, the operations forgotten once every live member had its terminal
        # message: (lo, hi, seqs) = every seq in [lo, hi), and those in seqs (the few
        # forgotten out of order); a late report for one of them is answered already
        self._forgotten: dict[int, tuple[int, int, set]] = {}
        self._calls = 0                       # the group's next call number (a new member's first)
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
                      "lost_syncs": 0, "dropped": 0, "given_up": 0, "probes": 0, "probe_refusals": 0,
                      "job_refusals": 0, "jobs_finished": 0}

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
        """An authenticated connection (on a thread of its own, from the listener):
        read the joiner's job (when its hello says it sends one) and refuse it when
        it differs from the job's, probe the joiner's data address (:meth:`_probe`),
        then admit it as a pending peer (``welcome``) or refuse it (``refused``,
        then close)."""
        h = conn.hello
        data, streams, tok = h.get("data"), h.get("streams"), h.get("probe")
        if (h.get("role") != "peer" or not isinstance(data, str) or len(data) > 300 or not is_int(streams, 1, 64)
                or not (tok is None or is_bytes(tok, PROBE_TOKEN)) or h.get("job") not in (None, True)):
            conn.close()
            return
        try:
            tcp.parse_address(data)
        except CommError:
            conn.close()
            return
        job = None
        if h.get("job") is True:
            # the joiner sends its job right after the handshake (after the master proved the secret)
            try:
                kind, _, msg = conn.read_ctrl(deadline=time.monotonic() + JOB_WAIT, limit=JOB_MAX + 64)
                job = msg.get("job") if kind == tcp.K_CTRL and isinstance(msg, dict) and msg.get("t") == JOB else None
            except Exception:  # noqa: BLE001 - silent, closed or malformed: not a joiner
                job = None
            if not (isinstance(job, bytes) and 1 <= len(job) <= JOB_MAX):
                conn.close()
                return
            if self._refuse_job(conn, job):
                return  # before the probe: a joiner of another job is not dialled
        if self.probe_timeout is not None:
            with self._lock:
                # a probe holds a thread and a dial for up to probe_timeout: counted as a peer
                if self._stopped.is_set() or len(self._peers) + self._probing >= MAX_PEERS:
                    conn.close()
                    return
                self._probing += 1
                self.stats["probes"] += 1
            try:
                why = ("its hello carries no probe token (a peer of an older commlib?)" if tok is None
                       else self._probe(data, tok))
            finally:
                with self._lock:
                    self._probing -= 1
            if why is not None:
                with self._lock:
                    self.stats["probe_refusals"] += 1
                dbg(f"master: joiner refused: its data address {data} failed the probe ({why})")
                try:
                    conn.send_ctrl({"t": REFUSED, "why": why[:WHY_MAX]}, timeout=2.0)
                except Exception:  # noqa: BLE001 - it learns nothing more, and is gone anyway
                    pass
                conn.close()
                return
        with self._lock:
            if self._stopped.is_set() or len(self._peers) >= MAX_PEERS:
                conn.close()
                return
            # checked again: another joiner of another job, probed at the same time, may
            # have been admitted first (the first admitted fixes the job's)
            other = job is not None and self.job is not None and job != self.job
            if not other:
                if job is not None and self.job is None:
                    self.job = job
                    dbg(f"master: the job's description fixed by this joiner ({len(job)} bytes)")
                pid = self._next_id
                self._next_id += 1
                key = hashlib.sha256(self._key + pid.to_bytes(8, "big")).digest()
                p = _MPeer(pid, conn, data, streams, key)
                self._peers[pid] = p
        if other:
            self._refuse_job(conn, job)
            return
        dbg(f"master: peer {pid} connected (data {data})")
        threading.Thread(target=self._writer, args=(p,), daemon=True, name="commlib-master-tx").start()
        p.send({"t": WELCOME, "id": pid, "key": key, "hb": HEARTBEAT_INTERVAL})
        threading.Thread(target=self._reader, args=(p,), daemon=True, name="commlib-master-rx").start()

    def _refuse_job(self, conn: tcp.Connection, job: bytes) -> bool:
        """Refuse the joiner on ``conn`` when the job's description is known and
        ``job`` differs: ``refused`` with ``why`` and ``job`` (the job's bytes: the
        joiner proved the secret), then close.  Nothing changes for any peer.
        Returns whether it refused."""
        with self._lock:
            mine = self.job
            if mine is None or job == mine:
                return False
            self.stats["job_refusals"] += 1
        dbg(f"master: joiner refused: its job ({len(job)} bytes) differs from the job's ({len(mine)} bytes)")
        try:
            conn.send_ctrl({"t": REFUSED, "job": mine,
                            "why": f"its job ({len(job)} bytes) differs from this master's job ({len(mine)} bytes)"},
                           timeout=2.0)
        except Exception:  # noqa: BLE001 - it learns nothing more, and is gone anyway
            pass
        conn.close()
        return True

    def _probe(self, data: str, tok: bytes) -> str | None:
        """Dial a joiner's data address ``data`` as its ring neighbours will, within
        :attr:`probe_timeout` seconds in all: connect, authenticate (the listener
        must prove the secret), send the probe hello (``purpose`` PROBE, ``tok``: the
        joiner's token) and wait for its listener's answer (``{"t": PROBE}``, sent
        only to its own token).  A busy listener (BUSY) is retried with backoff
        within the bound; anything else ends the probe.  Runs on the joiner's
        connection thread, holding no lock: other peers' joins and messages go on.

        Returns:
            None when the joiner's own listener answered; else why not (for the
            joiner's error message).  Raises nothing."""
        limit = self.probe_timeout
        deadline = time.monotonic() + limit
        hello = {"purpose": PROBE, "tok": tok}
        tries = 0
        while True:
            tries += 1
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer within the master's probe_timeout of {limit:g} s"
            try:
                sock = tcp.open_socket(data, left)
            except ConnectionRefusedError:
                return "connection refused: nothing listens there"
            except (socket.timeout, TimeoutError):
                return (f"no answer to a TCP connect within {limit:g} s: a firewall dropping the packets, or no "
                        "such host on the master's network")
            except OSError as exc:
                return f"{type(exc).__name__}: {exc.strerror or exc}"
            try:
                conn = tcp.client_handshake(sock, self.secret, hello, timeout=max(0.05, deadline - time.monotonic()),
                                            encrypt=self.encrypt, name=data)
            except NoHandshakeSlot:
                delay = tcp.retry_delay(tries)
                if time.monotonic() + delay >= deadline:
                    return f"its listener had no handshake slot free within {limit:g} s (busy)"
                time.sleep(delay)
                continue
            except SilentPort:
                return (f"it accepted the connection but sent no commlib challenge within {limit:g} s: not a "
                        "commlib listener, or a stalled one")
            except EncryptionMismatch as exc:
                return exc.detail
            except AuthenticationError:
                return ("it did not complete the handshake with the shared secret: not a commlib listener of this "
                        "job")
            except CommTimeout:
                return f"the handshake was not complete within the master's probe_timeout of {limit:g} s"
            except Exception as exc:  # noqa: BLE001 - whatever else: refused, with the reason
                return f"{type(exc).__name__}: {exc}"
            try:
                kind, _, msg = conn.read_ctrl(deadline=deadline, limit=256)
                if kind == tcp.K_CTRL and isinstance(msg, dict) and msg.get("t") == PROBE:
                    return None
                return "a listener answered the probe with something else: not this peer's"
            except (socket.timeout, TimeoutError):
                return (f"a listener holding the secret answered but did not confirm within {limit:g} s that it "
                        "is this peer's")
            except Exception:  # noqa: BLE001 - closed without an answer
                return ("a listener holding the secret answered, but it is not this peer's (another peer's data "
                        "address?)")
            finally:
                conn.close()

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
                dbg(f"master: writer to peer {p.id} failed: {exc!r}")
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
            dbg(f"master: reader of peer {p.id} ended: {exc!r}")
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
                    dbg(f"master: monitor stalled {now - last:.2f} s; heartbeat clocks restarted")
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
            dbg(f"master: peer {pid} dead (was {p.state}; silent {time.monotonic() - p.conn.last_rx:.2f} s)")
            p.state = "dead"
            self.stats["deaths"] += 1
            p.outbox.put(None)
            p.conn.close()
            self._voters.discard(pid)
            self._sync.pop(pid, None)
            if was_member and pid in self.members:
                self._new_epoch(self._live(self.members), "finished" if p.finished else "death")
                if not self.members and p.finished:
                    self._job_finished(pid)
            self._check_vote()
            self._check_sync()
            self._check_fetch()
            # forget the dead once nothing refers to them
            if not any(pid in m for m in self._epoch_members.values()):
                self._peers.pop(pid, None)

    def _job_finished(self, pid: int) -> None:
        """The last member left saying the job is done: forget the job's state
        (no orphan: the next group starts a new history) and the description a
        joiner fixed, so that the next job is admitted."""
        dbg(f"master: job finished (peer {pid}, the last member, left with finished=True): its state "
            f"(revision {self.revision}) and description released")
        self._orphan = None
        self.revision, self.hashes = None, None
        self.job = self._job_given
        self.stats["jobs_finished"] += 1

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
        dbg(f"master: epoch {self.epoch} members {self.members} ({why}); peers "
             f"{ {i: q.state + ('*' if q.waiting else '') for i, q in self._peers.items()} }")
        for pid in self.members:
            self._peers[pid].state = "member"
            self._peers[pid].waiting = False
        for (e, s), op in list(self._ops.items()):
            if e <= old and op["term"] is None:
                self._terminate((e, s), False)
        exp = time.time() + TICKET_TTL
        addrs = [[pid, self._peers[pid].data] for pid in self.members]
        for src in self.members:
            ns = self._peers[src].streams
            tickets = {dst: [tcp.make_ticket(self._peers[dst].key, self.epoch, src, dst, s, exp, RING)
                             for s in range(ns)]
                       for dst in self.members if dst != src}
            self._peers[src].send({"t": TOPO, "e": self.epoch, "members": addrs, "tickets": tickets, "exp": exp,
                                   "why": why, "rev": self.revision, "seq": self._calls})
        self._prune()

    @staticmethod
    def _term_msg(tag, op) -> dict:
        msg = {"t": TERM, "e": tag[0], "s": tag[1], "ok": op["term"]}
        if op.get("why") is not None:
            msg["why"] = op["why"]
        return msg

    def _terminate(self, tag, ok: bool, why: str | None = None) -> None:
        op = self._ops.setdefault(tag, {"done": set(), "term": None, "sent": set()})
        if op["term"] is None:
            op["term"] = ok
            op["why"] = why
            self.stats["completes" if ok else "refused" if why is not None else "aborts"] += 1
        for pid in self._live(self._epoch_members.get(tag[0], [])):
            if pid not in op["sent"]:
                op["sent"].add(pid)
                self._peers[pid].send(self._term_msg(tag, op))

    def _prune(self) -> None:
        """Forget operations every live member has its terminal message for, and empty old epochs.

        Each is remembered as forgotten (:meth:`_was_forgotten`) while its
        epoch is kept, so that a late report for one (it crossed its ``term``)
        is ignored, not taken for a new operation; what is kept per epoch stays
        a few entries however many operations it runs (an epoch's operations
        used to stay until the next epoch, and this loop ran over all of them
        at every operation: a call's cost grew with the calls before it)."""
        for tag, op in list(self._ops.items()):
            if op["term"] is not None and set(self._live(self._epoch_members.get(tag[0], []))) <= op["sent"]:
                del self._ops[tag]
                e, s = tag
                lo, hi, seqs = self._forgotten.get(e, (s, s, set()))
                if s == lo - 1:
                    lo = s
                elif not lo <= s < hi:
                    seqs.add(s)
                while hi in seqs:
                    seqs.discard(hi)
                    hi += 1
                self._forgotten[e] = (lo, hi, seqs)
        live_epochs = {t[0] for t in self._ops} | {self.epoch}
        for e in list(self._epoch_members):
            if e not in live_epochs:
                del self._epoch_members[e]
        for e in list(self._forgotten):
            if e not in self._epoch_members:
                del self._forgotten[e]

    def _was_forgotten(self, tag) -> bool:
        """Whether operation ``tag`` of a kept epoch ended and was forgotten by :meth:`_prune`."""
        lo, hi, seqs = self._forgotten.get(tag[0], (0, 0, ()))
        return lo <= tag[1] < hi or tag[1] in seqs

    def _handle(self, p: _MPeer, msg: dict) -> None:
        t = msg.get("t")
        with self._lock:
            if p.state == "dead":
                return
            if t == VOTE:
                if p.state == "member":
                    self._voters.add(p.id)
                else:
                    p.waiting = True
                self._check_vote()
            elif t in (DONE, FAIL, REFUSE):
                e, s = msg.get("e"), msg.get("s")
                why = msg.get("why") if t == REFUSE else None
                if not (is_int(e) and is_int(s)) or (t == REFUSE and not (isinstance(why, str)
                                                                         and 0 < len(why) <= WHY_MAX)):
                    raise tcp.FrameError("bad operation report")
                if p.id not in self._epoch_members.get(e, ()):
                    # an epoch this peer was not in (or long gone): refuse quietly
                    p.send({"t": TERM, "e": e, "s": s, "ok": False})
                    return
                tag = (e, s)
                if s <= _SEQ_MAX:  # (a call number past the tag space cannot be a joiner's first)
                    self._calls = max(self._calls, s + 1)
                if self._was_forgotten(tag):
                    return  # ended, and this member was sent its term (it crossed this report)
                op = self._ops.get(tag)
                if op is not None and op["term"] is not None:
                    if p.id not in op["sent"]:
                        op["sent"].add(p.id)
                        p.send(self._term_msg(tag, op))
                    return
                if t == REFUSE:
                    # the members' calls differ: refused on every member, over the same
                    # connections (no new epoch: nobody failed)
                    self._terminate(tag, False, why)
                    return
                if e < self.epoch or t == FAIL:
                    self._terminate(tag, False)
                    if t == FAIL and e == self.epoch and self._renew_at is None:
                        self._renew_at = time.monotonic() + self.abort_grace
                    return
                op = self._ops.setdefault(tag, {"done": set(), "term": None, "sent": set()})
                op["done"].add(p.id)
                if set(self._live(self.members)) <= op["done"]:
                    self._terminate(tag, True)
                    self._prune()
            elif t == SYNC:
                if p.state != "member":
                    raise tcp.FrameError("sync from a non-member")
                rev, hashes, meta = msg.get("rev"), msg.get("hashes"), msg.get("meta")
                if not (is_int(rev, -(1 << 62)) and isinstance(hashes, dict) and isinstance(meta, dict)
                        and all(isinstance(k, str) and is_bytes(v, 32) for k, v in hashes.items())
                        and set(meta) == set(hashes)):
                    raise tcp.FrameError("bad sync message")
                bad = msg.get("bad")
                if bad is not None and not isinstance(bad, str):
                    raise tcp.FrameError("bad sync message")
                self._sync[p.id] = {"rev": rev, "hashes": hashes, "meta": meta, "bad": bad}
                self._check_sync()
            elif t == SYNCED:
                if self._fetchers is not None:
                    self._fetchers.discard(p.id)
                    self._check_fetch()
            elif t == DROP:
                # a member reports that another one overran its receive caps (a flood of
                # frames for receives never posted): drop the accused as if it had died
                e, accused = msg.get("e"), msg.get("id")
                if not (is_int(e) and is_int(accused)):
                    raise tcp.FrameError("bad drop report")
                if (p.state == "member" and e == self.epoch and accused != p.id and accused in self.members
                        and p.id in self.members):
                    self.stats["dropped"] += 1
                    why = msg.get("why")
                    dbg(f"master: peer {accused} dropped on the report of peer {p.id} "
                        f"({why if isinstance(why, str) else '?'})")
                    self._died(accused)
            elif t == GIVE_UP:
                s, kind, why = msg.get("s"), msg.get("kind"), msg.get("why")
                if not (is_int(s, 0, _SEQ_MAX) and kind in ("arg", "fail", "timeout") and isinstance(why, str)
                        and 0 < len(why) <= WHY_MAX):
                    raise tcp.FrameError("bad give-up report")
                if p.state != "member":
                    return
                self._calls = max(self._calls, s + 1)
                tag = (self.epoch, s)
                op = self._ops.get(tag)
                if op is not None and op["term"]:
                    return  # committed before this member gave up on its verdict: the result stands
                dbg(f"master: peer {p.id} gave up call {s} ({kind}: {why[:200]})")
                self.stats["given_up"] += 1
                notice = {"t": GAVE_UP, "s": s, "kind": kind, "why": why, "id": p.id}
                for pid in self._live(self.members):
                    if pid != p.id:
                        self._peers[pid].send(notice)
                if op is not None and op["term"] is None:
                    # members that reported it wait for a verdict: refused (their gave_up
                    # notice, sent first, gives the cause); the giver too, when it gave the
                    # call up while waiting for the verdict (its answer)
                    self._terminate(tag, False, why)
                    self._prune()
            elif t == BYE:
                p.finished = msg.get("finished") is True  # close(finished=True): the job is done
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
        dbg(f"master: vote {self.step + 1} complete: live {sorted(live)} waiting {sorted(waiting)} "
             f"members {self.members}")
        if new != self.members:
            self._new_epoch(new, "vote")
        self.step += 1
        for pid in set(self._voters) | set(waiting):
            if pid in self._peers and self._peers[pid].state == "member":
                self._peers[pid].send({"t": VOTED, "e": self.epoch, "v": self.step})
        self._voters.clear()

    def _check_sync(self) -> None:
        live = self._live(self.members)
        if self._fetchers is not None or not live or not set(live) <= set(self._sync):
            return
        subs = {pid: self._sync[pid] for pid in live}
        bad = [s["bad"][:WHY_MAX] for s in subs.values() if s.get("bad") is not None]
        if bad:
            # a member's own argument was bad (it raised at once): the round is refused
            # on every member, naming it, and nothing moves
            self._sync_round += 1
            self._sync = {pid: s for pid, s in self._sync.items() if pid not in subs}
            why = "; ".join(sorted(bad))[:WHY_MAX]
            for pid in live:
                self._peers[pid].send({"t": PLAN, "round": self._sync_round, "e": self.epoch, "refused": why})
            return
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
                dbg(f"master: sync round {self._sync_round} refused: state at revision {orev} is held by no "
                     f"live peer (best {top})")
                for pid in live:
                    self._peers[pid].send({"t": PLAN, "round": self._sync_round, "e": self.epoch, "lost": orev})
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
        rnd = self._sync_round
        plan = {"t": PLAN, "round": rnd, "e": self.epoch, "rev": top, "hashes": win["hashes"],
                "meta": win["meta"], "donors": donors, "addrs": addrs, "fetchers": fetchers}
        exp = time.time() + TICKET_TTL
        for pid in live:
            if pid in self._fetchers:
                # a fetcher's tickets to each donor: purpose FETCH, this round only
                ns = self._peers[pid].streams
                tickets = {d: [tcp.make_ticket(self._peers[d].key, self.epoch, pid, d, s, exp, FETCH, rnd)
                               for s in range(ns)] for d in donors}
                self._peers[pid].send({**plan, "tickets": tickets, "exp": exp})
            else:
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
            self._peers[pid].send({"t": SYNC_END, "round": self._sync_round})
        self._check_sync()
