"""An elastic peer: control connection to the master, the epoch's data transport, the
all-reduce as a front end of the collective engine under the master's recovery policy,
and the shared-state sync (its methods in :mod:`.state_sync`)."""
from __future__ import annotations

import functools
import hmac
import ipaddress
import os
import socket
import threading
import time

import numpy as np

from commlib.collectives.allreduce_recursive_doubling import allreduce_recursive_doubling, combine_pair
from commlib.collectives.allreduce_ring import allreduce_ring, ring_scratch
from commlib.collectives.snapshot import LazySnapshot
from commlib.collectives.agreement import FirstRoundView, RingHead, agree
from commlib.collectives.one_round import reduce_rows, small_capacity
from commlib.collectives.one_shot import one_shot_bytes, one_shot_first_round
from commlib.collectives.pair_round import message_bytes, pair_first_round
from commlib.collectives.specs import choose_tcp_allreduce
from commlib.collectives.ops import OPS, dtype_code, dtype_name, get_op, is_floating
from commlib.collectives.recovery import run
from commlib.core.buffer import grown
from commlib.core.errors import (AuthError, AuthenticationError, CommError, CommTimeout, EncryptionMismatch,
                                 InvalidArgument, JobMismatch, NoHandshakeSlot, PeerClosed, PeerFailure,
                                 ProcessFailed)
from commlib.core.seconds import Deadline, check_timeout
from commlib.transports import tcp
from commlib.transports.base import check_plain_dtype
from commlib.transports.quantize import QuantizingTransport

from .group import ElasticGroup, MasterPolicy
from .state_sync import StateSync, one_thread
from .protocol import (BYE, DONE, DROP, FAIL, FETCH, GAVE_UP, GIVE_UP, JOB, PLAN, PROBE, REFUSE, REFUSED, RING,
                       SYNC_END, TERM, TOPO, VOTE, VOTED, WELCOME, AUTO_STREAMS, HEARTBEAT_INTERVAL, JOB_MAX,
                       PROBE_TOKEN, TRAFFIC, WHY_MAX, check_job, is_bytes, is_int)

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


#: the header of an elastic all-reduce (the first round's argument agreement)
_FIELDS = ("operation", "count", "dtype", "op", "quantize")
_QUANTIZE = (None, "fp16", "int8")
_SMALL = 0  # the quantize field of a call travelling in the first round (no quantization)
_OPERATION = 1
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


def _describe(name: str, value: int):
    """Header codes as the user wrote them, for mismatch messages."""
    if name == "quantize":
        return "none (one round)" if value == _SMALL else (_QUANTIZE[value - 1] or "none") if 0 < value <= 3 else value
    if name == "dtype":
        return dtype_name(value)
    if name == "op":
        return next((o.name for o in OPS.values() if o.code == value), value)
    return value


def _allreduce_header(buf, op, quantize, rank):
    """Validate one peer's all-reduce arguments, before anything moves.

    The buffer's kind, layout and writability are checked on every call; what
    follows from its dtype, size, ``op`` and ``quantize`` alone is validated once
    per combination and kept (:func:`_header_of`).

    Returns:
        ``(values, local_error, op)``: the header ints (:data:`_FIELDS`), this
        peer's :class:`InvalidArgument` or None, and the :class:`~commlib.collectives.ops.Op`.
    """
    try:
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise InvalidArgument("buf must be a C-contiguous numpy array", rank=rank, op="allreduce")
        if not buf.flags.writeable:
            raise InvalidArgument("buf is read-only: the all-reduce writes its result into it", rank=rank,
                                  op="allreduce")
        if type(op) is str and (quantize is None or type(quantize) is str):  # hashable: the kept answer
            values, opx = _header_of(buf.dtype, buf.size, op, quantize, rank)
            return list(values), None, opx
        values, opx = _header_of.__wrapped__(buf.dtype, buf.size, op, quantize, rank)
    except InvalidArgument as exc:
        return [0] * len(_FIELDS), exc, None
    return list(values), None, opx


@functools.lru_cache(maxsize=256)
def _header_of(dtype, size: int, op, quantize, rank) -> tuple:
    """The header ints and the Op of a valid call on a buffer of ``dtype`` and
    ``size`` elements (kept per combination: asked on every all-reduce).

    Raises:
        InvalidArgument: a dtype, ``op`` or ``quantize`` the all-reduce refuses
            (never kept: raised anew on each call).
    """
    check_plain_dtype(dtype, rank, "allreduce", "buf")
    if dtype.kind not in "biufc":
        raise InvalidArgument(f"buf must have a numeric dtype, got {dtype}", rank=rank, op="allreduce")
    if not isinstance(op, str) or op not in OPS:
        raise InvalidArgument(f"op must be one of {', '.join(OPS)}, got {op!r}", rank=rank, op="allreduce")
    opx = get_op(op, rank=rank, opname="allreduce")
    opx.check(dtype, rank=rank, op="allreduce")
    if quantize not in _QUANTIZE:
        raise InvalidArgument(f"quantize must be None, 'fp16' or 'int8', got {quantize!r}", rank=rank,
                              op="allreduce")
    if quantize is not None and not is_floating(dtype):
        raise InvalidArgument("quantize needs a floating dtype", rank=rank, op="allreduce")
    return (_OPERATION, size, dtype_code(dtype), opx.code, _QUANTIZE.index(quantize) + 1), opx


def _combine_pair_into(opx, flat, theirs, theirs_is_lower: bool) -> None:
    """The committed pair exchange's result into ``flat`` in place: ``flat (op)
    theirs`` with the lower rank's vector on the left (recursive doubling's
    order, so both members compute the same bits), then the op's finalize."""
    combine_pair(opx, flat, flat, theirs, theirs_is_lower)
    opx.finalize(flat, 2)


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
    """One elastic peer (made by :func:`connect`).

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
        if advertise is not None:
            host, port = tcp.parse_address(advertise)
            if port == 0:
                raise InvalidArgument(f"advertise={advertise!r} has port 0: name the port other peers dial",
                                      op="connect")
            try:
                socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
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
        deadline = time.monotonic() + timeout
        sock = self._reach_master(address, timeout)
        local = sock.getsockname()[0]
        self._listener = tcp.Listener(bind or f"{local}:0", secret, self._on_data_conn, encrypt=encrypt)
        data = advertise or (self._listener.address if bind is None or not bind.startswith("0.0.0.0")
                             else f"{local}:{self._listener.address.rsplit(':', 1)[1]}")
        hello = {"role": "peer", "data": data, "streams": self.streams, "probe": self._probe_token}
        if job is not None:
            hello["job"] = True  # the job itself follows the handshake: only a master that proved the secret reads it
        who = f"the master at {address}"
        tries = 0
        try:
            while True:
                tries += 1
                try:
                    self._conn = tcp.client_handshake(sock, secret, hello, encrypt=encrypt, name=who,
                                                      timeout=max(0.05, min(deadline - time.monotonic(), 10.0)))
                    break
                except NoHandshakeSlot:
                    # the master's listener is flooded: back off (with jitter) and try again
                    # within the timeout; then say so (not "wrong secret")
                    delay = tcp.retry_delay(tries)
                    if time.monotonic() + delay + 0.05 >= deadline:
                        raise
                    time.sleep(delay)
                    sock = self._reach_master(address, max(0.05, deadline - time.monotonic()))
            try:
                if job is not None:
                    self._conn.send_ctrl({"t": JOB, "job": job}, timeout=max(0.05, deadline - time.monotonic()))
                kind, _, msg = self._conn.read_ctrl(deadline=max(deadline, time.monotonic() + 1.0), limit=1 << 16)
                if kind == tcp.K_CTRL and isinstance(msg, dict) and msg.get("t") == REFUSED:
                    self._conn.close()
                    theirs = msg.get("job")
                    if job is not None and isinstance(theirs, bytes) and 1 <= len(theirs) <= JOB_MAX:
                        raise self._job_refused(job, theirs)
                    raise self._refused(msg.get("why"), data, advertise, bind)
                if kind != tcp.K_CTRL or not isinstance(msg, dict) or msg.get("t") != WELCOME:
                    raise tcp.FrameError("expected welcome")
            except socket.timeout:
                self._conn.close()
                raise CommTimeout(f"{who} authenticated this peer but sent no welcome within {timeout:g} s (it "
                                  f"first dials this peer's data address {data}, for up to its probe_timeout: "
                                  "can the master reach it?)", op="connect") from None
            except (tcp.FrameError, OSError) as exc:
                self._conn.close()
                raise AuthError(f"{who} closed the connection after authenticating this peer "
                                f"({type(exc).__name__}): it refused this peer's hello, or serves its maximum "
                                "of peers", op="connect") from None
        except (NoHandshakeSlot, EncryptionMismatch, CommTimeout, AuthError):
            self._listener.close()
            raise
        except AuthenticationError as exc:
            self._listener.close()
            raise AuthError(exc.detail, op="connect") from None
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
        self._scratch: np.ndarray | None = None  # the ring's snapshot; recursive doubling's receives
        self._ring_keep: np.ndarray | None = None  # the in-place ring's receive scratch (ring_scratch)
        self._pair_keep: np.ndarray | None = None  # the one-round, one-shot and recursive-doubling result
        self._round_keep: np.ndarray | None = None  # the first round's messages (pair exchange, one-shot)
        self._head_keep: np.ndarray | None = None  # the ring head's row and the left neighbour's message
        self._head_plan = None  # (transport, key, RingHead) of the last ring-sized call (_ring_head)
        threading.Thread(target=self._reader, daemon=True, name="commlib-peer-rx").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="commlib-peer-hb").start()

    @staticmethod
    def _job_refused(mine: bytes, theirs: bytes) -> JobMismatch:
        """The error of a join the master refused because this peer's job ``mine``
        differs from the job's ``theirs`` (both bytes; the first differing byte named)."""
        at = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
        return JobMismatch(
            f"this peer's job= ({len(mine)} bytes) differs from the job the master serves ({len(theirs)} bytes; "
            f"first difference at byte {at}), so it was not admitted and the job's peers saw nothing of it: "
            "start it with the job's settings (the job's bytes are this error's .job)",
            job=theirs, mine=mine, op="connect")

    def _refused(self, why, data: str, advertise: str | None, bind: str | None) -> CommError:
        """The error of a join the master refused (``refused``: its probe of this
        peer's data address ``data`` failed, ``why``): :class:`InvalidArgument` when
        the address came from ``advertise`` or ``bind``, else :class:`CommError`."""
        why = why[:WHY_MAX] if isinstance(why, str) and why else "no reason given"
        listener = self._listener.address
        if advertise is not None:
            return InvalidArgument(
                f"the master could not dial advertise={advertise!r} ({why}); the other peers would fail to dial it "
                f"too, so this peer was not admitted: advertise an address that reaches this peer's data listener "
                f"({listener}), or start the master with probe_timeout=None if only the master cannot reach it",
                op="connect")
        what = f"bind={bind!r}" if bind is not None else "this peer's data address"
        text = (f"the master could not dial {what} ({data}: {why}); the other peers would fail to dial it too, so "
                "this peer was not admitted: pass bind= an interface the others reach, or advertise= the address "
                "they dial (NAT, port forwarding)")
        return InvalidArgument(text, op="connect") if bind is not None else CommError(text, op="connect")

    @staticmethod
    def _reach_master(address: str, timeout: float) -> socket.socket:
        try:
            return tcp.open_socket(address, timeout)
        except OSError as exc:
            raise CommError(f"cannot reach the master at {address}: {exc}", op="connect") from None

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

        - ``first_round_bytes_sent``, ``first_round_bytes_received`` (and
          ``first_round_wire_bytes_*``): the first round of each all-reduce, its
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
            except Exception:  # noqa: BLE001
                return
            if self._fetch_parked:
                with self._cv:
                    self._sweep_fetches_locked()  # parked fetch connections past their deadline
            time.sleep(HEARTBEAT_INTERVAL)

    def _send(self, msg) -> None:
        try:
            self._conn.send_ctrl(msg, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001
            if self._closed:
                raise PeerClosed("this peer was closed (close() was called)", rank=self.rank, op="elastic") from None
            raise CommError(f"lost the master ({type(exc).__name__})", rank=self.rank, op="elastic") from None

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

    def _adopt(self) -> _Topo | None:
        """Make the newest pushed topology the current one (at an operation's start)."""
        with self._cv:
            latest = self._latest
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
        deadline = time.monotonic() + timeout
        tries, last = 0, None
        while True:
            tries += 1
            left = max(0.05, deadline - time.monotonic())
            try:
                s = tcp.open_socket(addr, left)
            except ConnectionRefusedError:
                raise ProcessFailed(f"{who} refused the connection: its process is gone", failed=[],
                                    rank=topo.rank, op="elastic") from None
            except OSError as exc:  # a connect timeout, an unreachable network: cannot connect (yet)
                last = exc
            else:
                try:
                    return tcp.client_handshake(s, self.secret, hello, timeout=left, encrypt=self.encrypt, name=who)
                except (NoHandshakeSlot, CommTimeout) as exc:  # busy or silent (SilentPort): not a death
                    last = exc
            if self._closed or (purpose == RING and self._latest is not None and self._latest.epoch > topo.epoch):
                raise ProcessFailed(f"gave up connecting to {who}: epoch {topo.epoch} is over", failed=[],
                                    rank=topo.rank, op="elastic")
            delay = tcp.retry_delay(tries)
            if time.monotonic() + delay >= deadline:
                raise ProcessFailed(f"cannot connect to {who} (alive as far as this peer knows): {tries} tries in "
                                    f"{timeout:g} s, last: {type(last).__name__}: {last}", failed=[],
                                    rank=topo.rank, op="elastic")
            time.sleep(delay)

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
            CommTimeout: no decision within ``timeout`` (default: the peer's timeout).
            InvalidArgument: ``timeout`` is not a finite number; another thread of this
                peer is in a call.
            CommError: the master is gone.
        """
        timeout = self._call_timeout(timeout, "update_topology")
        self._check_open("update_topology")
        self._adopt()
        with self._cv:
            self._voted = None
        self._send({"t": VOTE})
        e = self._wait(lambda: self._voted, timeout, "update_topology")
        self._wait(lambda: True if self._latest is not None and self._latest.epoch >= e else None, timeout,
                   "update_topology")
        topo = self._adopt()
        members = frozenset(topo.ids)
        changed = members != self._last_members
        self._last_members = members
        return changed

    @one_thread("allreduce")
    def allreduce(self, buf: np.ndarray, op: str = "sum", quantize: str | None = None, retry: bool = True,
                  timeout: float | None = None, max_retries: int = 16) -> np.ndarray:
        """All-reduce ``buf`` in place over the current members; bit-identical on all.

        A front end of the collective engine's steps, run by the one retry runner
        (:func:`commlib.collectives.recovery.run`) under the master's recovery
        policy: the first round agrees on the call's header (operation, count,
        dtype, op, quantize) over the epoch's TCP transport, so mismatched
        calls raise :class:`~commlib.InvalidArgument` on every peer, naming the
        difference, and every buffer holds its input; a call of at most
        :func:`~commlib.collectives.one_round.small_capacity` bytes (unquantized)
        travels inside that round and is reduced locally in the ring's order.
        Larger calls run :func:`~commlib.collectives.allreduce_ring.allreduce_ring`,
        whose first step carries the first round
        (:class:`~commlib.collectives.agreement.RingHead`): each member's header
        row goes in front of its first chunk (between loopback addresses; beside
        it elsewhere, :attr:`first_round_in_chunk`), and the left neighbour's row
        is compared before its chunk is combined or anything written: around the
        ring, every member finding its neighbour's header equal to its own means
        all are equal, at no message of its own; a member that finds a difference
        (or a first message of another size: a call that chose another
        algorithm) reports it to the master, whose verdict ends the call on every
        member with that member's message (other members may by then have run a
        few ring steps, undone from the snapshot; their chunks are dropped
        unused); with :attr:`overlap_first_round` False, or quantized, the row
        alone is checked before the ring starts; on 3 members, unquantized, up to
        :data:`~commlib.collectives.specs.ONE_SHOT_TCP_MAX` (512 KiB) one-shot
        (:mod:`commlib.collectives.one_shot`: the first round's all-gather carries
        every member's header row and whole vector, 2 messages a member, each
        reducing the three in the ring's order; a member that finds a header or
        size different reports it to the master, as the ring's); on 4 or more,
        unquantized, up to
        :data:`~commlib.collectives.specs.RECURSIVE_DOUBLING_TCP_MAX` (256 KiB)
        :func:`~commlib.collectives.allreduce_recursive_doubling.allreduce_recursive_doubling`
        out of place (``ceil(log2 n)`` steps instead of ``2 (n - 1)``; ``buf`` only
        read until the commit); or with 2 members, no quantization and at most
        :data:`commlib.elastic.PAIR_EXCHANGE_MAX` bytes (the specification table's threshold,
        :func:`commlib.collectives.specs.choose_tcp_allreduce`) one exchange of
        the whole vector, shipped right behind the header
        (:func:`commlib.collectives.pair_round.pair_first_round`: one round trip
        instead of two; a mismatched call then has sent its vector, which the
        other peer drops unused), the result
        computed out of place into a kept scratch and copied into ``buf`` only
        once the master commits).  Each peer then reports to the master, which
        commits the operation when every member reported success and aborts it
        otherwise; an aborted call is retried over the next epoch's members
        (``retry``).  The ring restores from a copy-before-write snapshot kept
        in a scratch buffer the peer reuses between calls.

        This peer's invalid arguments (a read-only, non-contiguous or non-numeric
        ``buf``, an unknown ``op`` or ``quantize``, a ``timeout`` that is not a
        finite number) raise at once, before anything is sent, and the call is
        given up on every member: each raises InvalidArgument naming this peer's
        rank and cause, instead of waiting for its timeout.  Calls are paired by
        their number (each member counts its calls; a retry keeps its number): a
        call that one member leaves with an error the group did not decide (its
        timeout, ``retry=False`` after an abort) is given up too, and fails on every
        member, a member late for it included (at once, with the giver's error
        class), so a late call is never combined with another member's next one.  On every error
        ``buf`` holds its input again, bit for bit, before the error leaves the call
        (the master lost included), and the peer is ready for the next call.

        Args:
            buf: writable C-contiguous numpy array (any shape) of a numeric dtype;
                the same dtype and size on every peer.
            op: a name of :data:`commlib.collectives.ops.OPS` (``"sum"``, ``"avg"``,
                ``"min"``, ``"max"``, ``"prod"``, bitwise ops on integers).
            quantize: None, ``"fp16"`` or ``"int8"`` (floating dtypes only): the
                wire format of each message; every peer still ends with the same bits.
            retry: on an abort, retry over the survivors (else raise PeerFailure).
            timeout: seconds the whole call may take, retries included (default:
                the peer's ``timeout``).
            max_retries: aborts tolerated before PeerFailure.

        Returns:
            ``buf``.

        Raises:
            InvalidArgument: bad buffer, op, quantize or timeout on any peer, or
                calls that differ between peers (on every peer alike); not a member;
                another thread of this peer is in a call (this peer alone).
            PeerFailure: aborted and ``retry=False`` (or more than ``max_retries``
                aborts); or another member gave this call up after one.
            CommTimeout: no committed result within ``timeout`` seconds (e.g. a
                member did not call the all-reduce), here or on a member that gave
                this call up for it (a member late for the call raises it at once).
            PeerClosed: this peer was closed.
            CommError: the master is lost.
        """
        rank = self.rank
        values, local_error, opx = _allreduce_header(buf, op, quantize, rank)
        try:
            timeout = self._call_timeout(timeout, "allreduce")
        except InvalidArgument as exc:
            local_error = local_error or exc
            timeout = 0.0
        deadline = Deadline(timeout, op="allreduce") if timeout > 0 else None
        if local_error is not None:
            # this peer's own bad argument: raised here, before any byte moves, and the
            # call given up on every member (each raises InvalidArgument naming it)
            self._refuse_call(local_error)
            raise local_error
        flat = buf.reshape(-1)
        policy = MasterPolicy(self, "allreduce", deadline, retry, max_retries)
        keep = {}
        try:
            finish = run(policy, functools.partial(self._allreduce_attempt, flat, values, opx, quantize, policy, keep),
                         lambda: keep["snap"].restore() if keep.get("snap") is not None else None)
        except BaseException as exc:
            policy.ended(exc)
            raise
        policy.ended(None)
        if finish is not None:  # committed: an out-of-place result goes into buf now
            finish()
        return buf

    def _refuse_call(self, error: InvalidArgument) -> None:
        """This member's next call is invalid here (``error``, found before anything
        moved): give it up on every member, so the others raise at once instead of
        waiting for their timeout.  Nothing to tell when this peer is not a member,
        closed or without its master."""
        if self._closed or self._lost is not None:
            return
        topo = self._adopt()
        if topo is None or topo.rank is None:
            return
        s = self._seq
        self._seq = s + 1
        # the epoch's transport, so the members' sends of this call (dialled to this
        # peer) are taken and dropped, not left waiting for a connection it never serves
        self._transport(topo)
        self._give_up(s, "arg", error.detail)

    def _allreduce_attempt(self, flat, values, opx, quantize, policy, keep, tr, left, survivors):
        """One attempt of :meth:`allreduce` on the epoch's transport ``tr``, ``left``
        seconds left: the first round, then the data part (:meth:`_allreduce_data`);
        returns what that returns.  ``keep["snap"]``: the ring's snapshot, for the
        runner's restore."""
        algo = choose_tcp_allreduce(flat.nbytes, tr.size, quantize is not None)
        try:
            if algo == "ring" and tr.size > 1:
                # the ring's first round: the header row in front of the ring's first
                # chunk, compared before anything is combined or written into buf; or
                # (overlap_first_round False; a quantized ring writes a chunk's
                # dequantized value into buf as it sends it) that row alone first
                alone = quantize is not None or not self.overlap_first_round
                head = self._ring_head(tr, values, flat, alone)
                if not alone:
                    return self._allreduce_data(tr, flat, opx, quantize, left, algo, None, keep, head=head)
                head.check_alone((tr.rank - 1) % tr.size, (tr.rank + 1) % tr.size, left)
                return self._allreduce_data(tr, flat, opx, quantize, left, algo, None, keep)
            rows = self._first_round(tr, values, algo, flat, left)
            return self._allreduce_data(tr, flat, opx, quantize, left, algo, rows, keep)
        except InvalidArgument:
            # the calls differ: a member that chose the ring has sent its first chunk
            # (and posted its receive) under this call's tags, another may wait in
            # the first round for a message that will not come; drop them all here
            # (abort_tags returns once no frame of theirs is still landing in a
            # kept scratch, so the scratch is reused as is)
            data, first = tr.operation_tags(policy.tag[1])
            tr.abort_tags((*data, *first))
            raise

    def _refusal(self, why: str, tag) -> InvalidArgument:
        """The error of an operation a member refused (:data:`.protocol.REFUSE`)."""
        return InvalidArgument(why, rank=self.rank, op=self._call_name or "allreduce")

    def _ring_head(self, tr, values, flat, alone: bool) -> RingHead:
        """The first round of a ring-sized all-reduce on ``tr``: a
        :class:`~commlib.collectives.agreement.RingHead`, the header row in front of
        the ring's first chunk, one message per member; ``alone`` (with
        :attr:`overlap_first_round` False, or a quantized call): the bare row on
        every link, checked before the ring starts (``RingHead.check_alone``).

        A link carries row and chunk joined when both its ends are on loopback
        addresses (both ends see that alike; elsewhere the chunk keeps the ring's
        striping over the link's connections) and they fit one frame.

        The head is kept for the next call (a cached plan, as NCCL keeps one per
        communicator): a call on the same transport (epoch) with the same header,
        chunk size and settings reuses it, its row already encoded in a scratch of
        its own (:attr:`_head_keep`, which no other path writes), with the next
        first-round tag of that call's operation."""
        n, r = tr.size, tr.rank
        header = values[:5]
        chunk = -(-flat.size // n) * flat.itemsize
        key = (tuple(header), chunk, alone, self.first_round_in_chunk)
        plan = self._head_plan
        if plan is not None and plan[0] is tr and plan[1] == key:
            return plan[2].renew()
        cap = small_capacity(n)
        need = RingHead.need(len(header), cap, chunk)
        self._head_keep = grown(self._head_keep, need)
        topo = self._topo
        fits = need <= tcp.FRAME_MAX and not alone

        def joined(a, b):
            if self.first_round_in_chunk is not None:
                return fits and self.first_round_in_chunk
            return fits and _loopback(topo.addrs[topo.ids[a]]) and _loopback(topo.addrs[topo.ids[b]])

        head = RingHead(FirstRoundView(tr), header, op="allreduce", capacity=cap, keep=self._head_keep,
                        send_joined=joined(r, (r + 1) % n), recv_joined=joined((r - 1) % n, r), names=_FIELDS,
                        describe=_describe)
        self._head_plan = (tr, key, head)
        return head

    def _first_round(self, tr, values, algo, flat, timeout):
        """The all-reduce's first round on ``tr``: the argument agreement, carrying a
        small call's vector (``algo == "small"``), at 2 members a pair exchange's
        (:mod:`commlib.collectives.pair_round`) and a one-shot call's
        (:mod:`commlib.collectives.one_shot`); returns every member's payload in
        rank order, or None on 1 member.

        Raises:
            InvalidArgument: the members' calls differ (on every member alike; a
                :class:`~commlib.collectives.agreement.NeighbourRefusal` on the
                members that saw it, made everyone's by the master).
        """
        n = tr.size
        header = values[:4] + [_SMALL if algo == "small" else values[4]]
        if algo == "one_shot":  # every member's header and whole vector to every member
            self._round_keep = grown(self._round_keep, one_shot_bytes(len(header), n, flat.nbytes))
            return one_shot_first_round(FirstRoundView(tr), header, op="allreduce", vector=flat, keep=self._round_keep,
                                        timeout=timeout, names=_FIELDS, describe=_describe)
        payload = flat.view(np.uint8) if algo == "small" else None
        if n == 2:  # one message each way: the header row with the payload or the whole vector
            vector = flat if algo == "pair_exchange" else None
            nb = message_bytes(len(header), small_capacity(n), flat.nbytes if vector is not None else 0)
            self._round_keep = grown(self._round_keep, 2 * nb)
            return pair_first_round(FirstRoundView(tr), header, op="allreduce", capacity=small_capacity(n),
                                    sendbuf=self._round_keep[:nb], recvbuf=self._round_keep[nb:2 * nb],
                                    payload=payload, vector=vector, timeout=timeout, names=_FIELDS,
                                    describe=_describe)
        if n > 2:
            # mirrored: the all-gather's first step goes the ring's way, so a member whose
            # call differs and chose the ring meets it (RingHead); rows back in rank order
            try:
                rows = agree(FirstRoundView(tr, mirror=True), header, op="allreduce", payload=payload,
                             capacity=small_capacity(n), timeout=timeout, names=_FIELDS, describe=_describe)
            except InvalidArgument as exc:  # raised under the mirrored rank: this member's real one
                raise InvalidArgument(exc.detail, rank=tr.rank, op=exc.op) from None
            return rows[[(n - r) % n for r in range(n)]]
        return None

    def _allreduce_data(self, tr, flat, opx, quantize, timeout, algo, rows, keep, head=None):
        """The data part of one all-reduce attempt on ``tr`` (``algo`` from
        :func:`~commlib.collectives.specs.choose_tcp_allreduce`); returns None
        when ``flat`` holds the result, else a callable that writes it into
        ``flat``, run after the commit (until then ``flat`` holds the input, so an
        abort has nothing to restore).  ``head``: the ring's first step carrying
        the first round (:class:`~commlib.collectives.agreement.RingHead`)."""
        keep["snap"] = None
        nb = flat.nbytes
        if tr.size == 1:
            opx.finalize(flat, 1)  # the identity for every op: nothing to save
            return None
        if algo in ("small", "pair_exchange", "one_shot"):
            # every member's vector came in the first round (at 2 members up to
            # PAIR_EXCHANGE_MAX bytes: collectives/pair_round.py; at 3 up to
            # ONE_SHOT_TCP_MAX: collectives/one_shot.py), reduced out of place, so
            # ``buf`` is untouched until the commit and an abort has nothing to
            # restore; bit-identical on every member: a small or one-shot call in the
            # ring's order, the pair exchange as recursive doubling's, rank 0's vector
            # on the left.  The pair exchange combines straight into ``buf`` after the
            # commit (an element-wise op of ``buf`` and the received vector: no
            # scratch, no copy); a small or one-shot call's rows may include ``buf``
            # itself (a gather send), so those reduce into a scratch and copy
            if algo == "pair_exchange":
                return functools.partial(_combine_pair_into, opx, flat, rows[1 - tr.rank][:nb].view(flat.dtype),
                                         tr.rank == 1)
            self._pair_keep = grown(self._pair_keep, nb)
            result = self._pair_keep[:nb].view(flat.dtype)
            reduce_rows(rows, flat.dtype, flat.size, opx, result)
            return functools.partial(np.copyto, flat, result)
        if algo == "recursive_doubling":
            # out of place, from ``flat`` (read, never written) into a kept scratch:
            # as the pair exchange, nothing to restore on an abort
            self._pair_keep = grown(self._pair_keep, nb)
            self._scratch = grown(self._scratch, nb)  # the ring's snapshot scratch, unused here: the receives
            result = self._pair_keep[:nb].view(flat.dtype)
            allreduce_recursive_doubling(tr, result, opx, sendbuf=flat, timeout=timeout,
                                         tmp=self._scratch[:nb].view(flat.dtype))
            return functools.partial(np.copyto, flat, result)
        # copy-before-write snapshot into a reused scratch (no page faults, the
        # copies overlap the ring's transfers); restored only on an error
        self._scratch = grown(self._scratch, nb)  # the largest all-reduce so far
        snap = keep["snap"] = LazySnapshot(flat, self._scratch)
        self._ring_keep, tmp = ring_scratch(self._ring_keep, flat, tr.size)
        if quantize is None:
            allreduce_ring(tr, flat, opx, timeout=timeout, save=snap, tmp=tmp, head=head)
        else:
            # the quantizing view overwrites a chunk with its dequantized value when it
            # first sends it, before the ring's lazy saves: save everything up front
            snap.save_all()
            allreduce_ring(QuantizingTransport(tr, quantize), flat, opx, timeout=timeout, tmp=tmp)
        return None

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

    def close(self) -> None:
        """Leave: say goodbye to the master and close every connection.  Any later
        call on this peer raises :class:`~commlib.core.errors.PeerClosed` (the
        all-reduce: :class:`~commlib.core.errors.CommError` "this peer was closed")."""
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send_ctrl({"t": BYE}, timeout=2.0)
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
            same cores: docs/ELASTIC.md), :data:`AUTO_STREAMS` (4) to any other.
        timeout: seconds any single wait may take.
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
        CommError: the master cannot be reached; or (neither ``advertise`` nor
            ``bind`` given) the master could not dial this peer's data address.
        CommTimeout: the master authenticated this peer but sent no answer
            within ``timeout`` (its probe of the data address may take up to
            its ``probe_timeout``).
    """
    try:
        key = tcp.read_secret(secret, secret_file)
    except AuthenticationError as exc:  # SecretError (an AuthError), named for connect
        raise (type(exc) if isinstance(exc, AuthError) else AuthError)(exc.detail, op="connect") from None
    return Peer(address, key, streams=streams, timeout=timeout, encrypt=encrypt, bind=bind, advertise=advertise,
                job=job)
