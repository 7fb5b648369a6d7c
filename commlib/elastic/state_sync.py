"""The elastic peer's shared-state sync: every member ends a sync holding the same bytes.

Rounds (the master's side: :mod:`commlib.elastic.protocol`).  Each member
sends ``sync`` (its revision, the SHA-256 of every array, dtypes and shapes);
when every live member has, the master picks the highest revision and, among
the peers there, the largest group with equal hashes (ties: the lowest ring
rank) as donors, and sends every member ``plan``.  A member whose hashes differ
fetches the differing arrays in ranges of at most 4 MiB from one donor at a
time (the first chosen by its rank), spread over up to ``streams`` connections
of purpose ``FETCH`` to it (tickets of this round, from the plan); what a
failed donor left goes to the next, and every array is verified against the
plan's hash before the sync returns.  A
donor serves read-only views of its arrays while the round lasts (a fetch
connection that arrives before the plan is parked, without a thread, for at
most :data:`~commlib.elastic.protocol.FETCH_PARK_S` seconds).  PCCL's
shared-state model (arXiv 2505.14065).

:class:`StateSync` is a mixin of :class:`commlib.elastic.peer.Peer`: it uses the
peer's control connection, topology and dialling.
"""
from __future__ import annotations

import functools
import hashlib
import queue
import threading
import time

import numpy as np

from commlib.core.config import config
from commlib.core.errors import CommError, InvalidArgument
from commlib.core.seconds import Deadline
from commlib.transports import tcp
from commlib.transports.base import check_plain_dtype

from .protocol import FETCH, FETCH_MAX, FETCH_PARK, FETCH_PARK_S, REPORT_FLOOR, SYNC, SYNCED, WHY_MAX, is_int

__all__ = ["StateSync"]


def one_thread(opname: str):
    """Decorate a peer's collective method: one such call at a time per peer.  A
    second thread's call while one runs raises InvalidArgument at once (the group
    pairs each member's calls by their order, which two threads would not keep);
    nothing is sent for it and the running call goes on."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if not self._call_lock.acquire(blocking=False):
                raise InvalidArgument(f"this peer is already in a call ({self._call_name}) from another thread: "
                                      "a Peer makes one call at a time", rank=self.rank, op=opname)
            try:
                self._call_name = opname
                return method(self, *args, **kwargs)
            finally:
                self._call_lock.release()
        return call
    return wrap


class StateSync:
    """Shared-state sync for :class:`~commlib.elastic.peer.Peer` (see the module docstring)."""

    @one_thread("sync_shared_state")
    def sync_shared_state(self, state: dict, revision: int, timeout: float | None = None) -> dict:
        """Make ``state`` identical on every member (see :mod:`commlib.elastic.state_sync`).

        Args:
            state: name → numpy array (C-contiguous); updated in place: a missing
                name, one of another dtype/shape, or a read-only array whose bytes
                differ gets a new array (the old one is left as it was), and on a
                member that fetches, a name the job's state lacks is removed.
            revision: this peer's revision of ``state``.
            timeout: the deadline of the whole call in seconds (the plan, the
                transfers, the round's end); default: the peer's ``timeout``.

        Returns:
            ``{"revision", "bytes_received", "donor", "seconds"}`` (donor: the peer
            id bytes came from, None when in sync).

        Raises:
            InvalidArgument: a bad state entry or revision, a ``timeout`` that is not a
                finite number (on this member at once, and the round refused on every
                member: each raises, naming it, once all have called, with ``state``
                untouched), another thread of this peer in a call, not a member.
            CommError: every donor failed or the received bytes did not verify.
        """
        t0 = time.monotonic()
        self._check_open("sync_shared_state")
        topo = self._adopt()
        if topo is None or topo.rank is None:
            raise InvalidArgument("not a member: call update_topology() first", op="sync_shared_state")
        # one bound for the whole call: the digest, the plan, the transfers, the round's end
        deadline, hashes, meta, views = self._sync_arguments(state, revision, timeout, topo.rank, t0)
        plan = self._sync_round(revision, hashes, meta, deadline, topo.rank)
        rnd = int(plan["round"])
        result = {"revision": int(plan["rev"]), "bytes_received": 0, "donor": None}
        if plan["fetchers"] and self.id in [int(d) for d in plan["donors"]]:
            self._serve_round(rnd, views, deadline.left())
        elif plan["fetchers"]:
            try:
                got, donor = self._fetch(plan, state, topo, deadline, own=hashes)
            finally:
                # the master ends the round (the donors' service) once every fetcher said
                # so: sent even when the fetch ran out of time (REPORT_FLOOR)
                self._send({"t": SYNCED}, max(deadline.left(), REPORT_FLOOR), "sync_shared_state")
            self._wait(lambda: True if rnd in self._sync_ends else None, deadline.left(), "sync_shared_state")
            result.update(bytes_received=got, donor=donor)
        result["seconds"] = time.monotonic() - t0
        return result

    def _sync_arguments(self, state, revision, timeout, rank, t0: float) -> tuple:
        """``(deadline, hashes, meta, views)`` of a sync call started at ``t0``
        (monotonic); this member's own bad argument raises InvalidArgument here at
        once, and the round is refused on every member (each raises naming it), not
        left to time out."""
        deadline = None
        try:
            deadline = Deadline(self._call_timeout(timeout, "sync_shared_state"), start=t0, op="sync_shared_state")
            return (deadline, *self._sync_submission(state, revision, rank))
        except InvalidArgument as exc:
            # the refusal goes out even past the call's deadline (REPORT_FLOOR): the other
            # members' round ends with it; a bad timeout leaves no deadline: the peer's
            bound = None if deadline is None else max(deadline.left(), REPORT_FLOOR)
            try:
                self._send({"t": SYNC, "rev": 0, "hashes": {}, "meta": {}, "bad": str(exc)[:WHY_MAX]}, bound,
                           "sync_shared_state")
                with self._cv:
                    self._refusals_owed += 1
            except CommError:
                pass  # a lost master ends every member's round anyway; the cause is this error
            raise

    #: refused plans still to come for rounds this member left at once (its own bad
    #: argument: it raised without waiting for the master's answer)
    _refusals_owed = 0

    def _drop_owed_refusals_locked(self) -> None:
        """Drop the refused plans owed for rounds this member left at once, however
        late they come (the master answers rounds in order)."""
        for r in sorted(self._plans):
            if self._refusals_owed and self._plans[r].get("refused") is not None:
                del self._plans[r]
                self._refusals_owed -= 1

    def _next_plan_locked(self, rounds_before: set):
        """The master's plan for this member's round (one not in ``rounds_before``), or None yet."""
        self._drop_owed_refusals_locked()
        for r, p in sorted(self._plans.items()):
            if r not in rounds_before:
                self._refusals_owed = 0  # answered after every round owed: nothing owed can still come
                return p
        return None

    def _sync_round(self, revision, hashes, meta, deadline: Deadline, rank) -> dict:
        """Submit this member's state digest; returns the master's plan for the
        round, both within what is left of the call's ``deadline``.

        Raises:
            InvalidArgument: the round was refused (a member's bad argument).
            CommError: no live peer holds the job's state.
        """
        with self._cv:
            self._drop_owed_refusals_locked()
            rounds_before = set(self._plans)
        self._send({"t": SYNC, "rev": int(revision), "hashes": hashes, "meta": meta}, deadline.left(),
                   "sync_shared_state")
        plan = self._wait(lambda: self._next_plan_locked(rounds_before), deadline.left(), "sync_shared_state")
        with self._cv:
            self._plans.pop(int(plan["round"]), None)
        if plan.get("refused") is not None:
            raise InvalidArgument(f"a member passed invalid arguments ({str(plan['refused'])[:WHY_MAX]}); the round "
                                  "was refused on every member, nothing was sent", rank=rank, op="sync_shared_state")
        if plan.get("lost") is not None:
            raise CommError(f"the job's shared state (revision {plan['lost']}) is held by no live peer: every peer "
                            "that had it left or died before this group formed; start a new master for a new job",
                            rank=rank, op="sync_shared_state")
        return plan

    def _serve_round(self, rnd: int, views: dict, timeout: float) -> None:
        """Serve this donor's state to the round's fetchers until the master ends the round."""
        self._start_serving(rnd, views)
        try:
            self._wait(lambda: True if rnd in self._sync_ends else None, timeout, "sync_shared_state")
        finally:
            self._stop_serving(rnd)

    @staticmethod
    def _sync_submission(state, revision, rank) -> tuple[dict, dict, dict]:
        """``(hashes, meta, views)`` of ``state`` for a ``sync`` message, or
        InvalidArgument naming this ``rank`` and the bad entry or revision."""
        if not is_int(revision, -(1 << 62)):
            raise InvalidArgument(f"revision must be an int, got {revision!r}", rank=rank, op="sync_shared_state")
        if not isinstance(state, dict):
            raise InvalidArgument(f"state must be a dict of name -> numpy array, got {type(state).__name__}",
                                  rank=rank, op="sync_shared_state")
        hashes, meta, views = {}, {}, {}
        for name, arr in state.items():
            if not isinstance(name, str) or not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
                raise InvalidArgument(f"state[{name!r}] must be a C-contiguous numpy array keyed by str",
                                      rank=rank, op="sync_shared_state")
            check_plain_dtype(arr.dtype, rank, "sync_shared_state", name)
            mv = memoryview(arr.reshape(-1).view(np.uint8))
            hashes[name] = hashlib.sha256(mv).digest()
            meta[name] = [arr.dtype.str, list(arr.shape)]
            views[name] = mv
        return hashes, meta, views

    # state transfer ---------------------------------------------------------
    _RANGE = 4 << 20

    def _on_fetch_conn(self, conn: tcp.Connection, rnd: int, src: int, stream: int) -> None:
        """A fetch connection whose FETCH ticket verified (bound to sync round ``rnd``,
        ``src`` → this donor, ``stream``).  Served only while this peer serves round
        ``rnd`` as a donor of a plan that names ``src`` as a fetcher, at most
        :data:`FETCH_MAX` at once and one per (``src``, ``stream``); a fetcher may dial
        before this donor has read the same plan: such a connection is parked, with
        no thread, until the plan arrives and serving starts (at most
        :data:`FETCH_PARK` of them, each for :data:`FETCH_PARK_S` seconds).  A ticket of
        an ended round, or of a round that does not name the pair, is closed at once."""
        with self._cv:
            if self._closed or rnd in self._sync_ends:
                conn.close()
                return
            pairs = self._plan_pairs.get(rnd)
            if pairs is None and rnd <= self._round_seen:
                conn.close()  # a round this donor saw without naming the pair (or long gone)
                return
            if pairs is not None and (self.id not in pairs[0] or src not in pairs[1]):
                conn.close()
                return
            serving = self._serving
            if serving is not None and serving[0] == rnd:
                self._serve_locked(conn, rnd, src, stream, serving[1])
                return
            self._sweep_fetches_locked()
            if len(self._fetch_parked) >= FETCH_PARK:
                conn.close()
                return
            self._fetch_parked.append((time.monotonic() + FETCH_PARK_S, rnd, src, stream, conn))

    def _serve_locked(self, conn, rnd: int, src: int, stream: int, views: dict) -> None:
        """Serve one admitted fetch connection on a thread of its own (capped)."""
        key = (src, stream)
        if key in self._fetch_active or len(self._fetch_active) >= FETCH_MAX:
            conn.close()
            return
        self._fetch_active[key] = conn
        threading.Thread(target=self._serve, args=(conn, views, rnd, key), daemon=True, name="commlib-donor").start()

    def _sweep_fetches_locked(self) -> None:
        """Close the parked fetch connections that can no longer be served: past their
        deadline, of an ended round, or of a known round that does not name the pair."""
        now = time.monotonic()
        keep = []
        for item in self._fetch_parked:
            deadline, rnd, src, _st, conn = item
            pairs = self._plan_pairs.get(rnd)
            if (now > deadline or self._closed or rnd in self._sync_ends
                    or (pairs is None and rnd <= self._round_seen)
                    or (pairs is not None and (self.id not in pairs[0] or src not in pairs[1]))):
                conn.close()
            else:
                keep.append(item)
        self._fetch_parked = keep

    def _start_serving(self, rnd: int, views: dict) -> None:
        """Serve round ``rnd`` as a donor: admit its parked fetch connections."""
        with self._cv:
            self._serving = (rnd, views)
            self._sweep_fetches_locked()
            parked, self._fetch_parked = self._fetch_parked, []
            for item in parked:
                if item[1] == rnd:
                    self._serve_locked(item[4], rnd, item[2], item[3], views)
                else:
                    self._fetch_parked.append(item)

    def _stop_serving(self, rnd: int) -> None:
        """Round ``rnd`` is over: close its fetch connections (their threads end at once)."""
        with self._cv:
            self._serving = None
            active, self._fetch_active = self._fetch_active, {}
            self._sweep_fetches_locked()
        for conn in active.values():
            conn.close()

    def _serving_round(self):
        serving = self._serving
        return None if serving is None else serving[0]

    def _serve(self, conn: tcp.Connection, views: dict, rnd: int, key) -> None:
        """Donor side of one fetch connection: answer range requests from ``views``
        while round ``rnd`` is served."""
        rate = config.elastic_serve_rate  # bytes/s; testing / WAN emulation
        try:
            while self._serving_round() == rnd:
                kind, _, msg = conn.read_ctrl(deadline=time.monotonic() + self.timeout, limit=1 << 12)
                if kind != tcp.K_CTRL or not isinstance(msg, dict):
                    raise tcp.FrameError("bad request")
                name, off, n = msg.get("k"), msg.get("o"), msg.get("n")
                mv = views.get(name) if isinstance(name, str) else None
                if mv is None or not is_int(off) or not is_int(n, 0, tcp.FRAME_MAX) or off + n > len(mv):
                    raise tcp.FrameError("bad range")
                if rate > 0:
                    step = 1 << 16
                    for a in range(off, off + n, step):
                        time.sleep(min(step, off + n - a) / rate)
                        if self._serving_round() != rnd:
                            raise ConnectionError("round over")
                conn.send_frame(tcp.K_DATA, mv[off:off + n], timeout=self.timeout)
        except Exception:  # noqa: BLE001
            pass
        conn.close()
        with self._cv:
            if self._fetch_active.get(key) is conn:
                del self._fetch_active[key]

    def _fetch(self, plan: dict, state: dict, topo, deadline: Deadline, own: dict | None = None):
        """Fetch every tensor whose hash differs, from the donors in turn, within
        ``deadline`` (the call's); verify.

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
            if (not isinstance(arr, np.ndarray) or arr.dtype != dt or arr.shape != shape or not arr.flags.c_contiguous
                    or (not arr.flags.writeable and own.get(name) != h)):
                # (a read-only array that differs cannot take the bytes: replaced, left as it was)
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
                n, todo = self._fetch_from(d, topo, views, todo, deadline, plan)
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
        for k in [k for k in state if k not in want]:
            del state[k]  # a name the job's state lacks: every member ends with the same names
        return got, used

    def _fetch_from(self, donor: int, topo, views, todo, deadline: Deadline, plan: dict):
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
                conn = self._dial(topo, donor, stream, FETCH, min(max(deadline.left(), 0.05), 10.0), plan=plan)
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
                        conn.send_ctrl({"k": k, "o": o, "n": n}, timeout=max(deadline.left(), 1e-3))
                        kind, flags, ep, tg, ch, st, length = conn.read_header(deadline.at)
                        if kind != tcp.K_DATA or conn.plain_length(length) != n:
                            raise tcp.FrameError("bad reply")
                        conn.read_payload(length, into=views[k][o:o + n], deadline=deadline.at)
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
            th.join(deadline.left() + 1.0)  # each worker's reads end at the deadline
        if left:
            raise _DonorFailed(done_bytes[0], left)
        return done_bytes[0], []


class _DonorFailed(Exception):
    def __init__(self, nbytes, todo):
        self.nbytes, self.todo = nbytes, todo
