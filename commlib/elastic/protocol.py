"""The elastic job's control protocol: message kinds, limits, and the master's state machine.

Every control message is a msgpack map (:func:`commlib.transports.tcp_frames.pack_ctrl`;
never pickle) whose ``"t"`` names its kind, one of the constants below.

The master's state machine
--------------------------

Admission: a peer's control connection authenticates (the handshake's HMACs
cover its hello: ``role``, ``data``, its data address, ``streams`` and ``probe``,
16 random bytes); only then does the master *probe* the data address, off its
state machine (on that connection's own thread, holding no lock), within
``probe_timeout`` seconds: it dials it, completes the handshake as a client (the
listener must prove the secret) with the hello ``{purpose: PROBE, tok: probe}``,
and waits for the answer ``{t: PROBE}``, which the joiner's listener sends only
to its own token (and only until its ``welcome``; it attaches nothing and closes).
Then ``welcome``, or, when the address did not answer so, ``refused`` with the
reason and the connection closed: the joiner never becomes a peer of the master,
so the members see nothing of it (no epoch, no failed call).  A joiner whose
probe is pending delays no other peer's join (each probe has its own thread).
The probe proves what the master can reach; members on another network than
the master may still fail to dial an address that passed (docs/elastic-protocol.md,
*Admission*).

The job's description (``connect(job=...)``, ``Master(job=...)``): opaque bytes (at
most :data:`JOB_MAX`; compared byte for byte, never decoded, never pickled) that
say which job a peer was started for (an app's job flags, say).  A joiner with a
job says so in its hello (``job: True``) and, once the handshake has completed
both ways (the master proved the secret too; sealed with ``encrypt=True``), sends
it as its first message ``{t: JOB, job}``: a party without the secret never sees
it, and the job is not bound by the pre-authentication frame cap.  The master
reads it within :data:`JOB_WAIT` seconds (else it closes the connection) and,
before its probe, compares it with *the job's*: the bytes given up front
(``Master(job=...)``, ``commlib master --job-file``), else those of the first
peer it admitted with a job.  A joiner whose bytes differ is sent ``refused``
with ``job`` (the job's bytes, so the joiner can name what differs) and closed:
it never becomes a peer, the members see nothing of it.  A joiner with no job
(``job=None``, older peers) is admitted as before and neither checked nor fixes
the job: it makes no claim, so a group formed by peers with no job is joined by
the first peer with a job, whose bytes become the job's.  The job is checked
again when the joiner is admitted (two joiners with different jobs probed at
once: the first admitted wins) and is kept for the master's lifetime, also when
every member has left: a master serves one job.

Peer states: ``pending`` (authenticated and probed, not yet admitted) → ``member`` (in the
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

Operations (all-reduce): tag ``(epoch, seq)``, ``seq`` the call's number: each
member counts its calls from the number the master gave it when it was admitted
(``topo``'s ``seq``: the group's next call); a call keeps its number through its
retries (each in a newer epoch), so the members' numbering of their calls, not
the epoch, pairs a call with the other members' calls.
``open`` → ``complete`` when every member of the epoch reported
``done``; ``open`` → ``abort`` on a member's death, a member's ``fail`` report,
or any report for an epoch older than the current one; ``open`` → ``refused``
on a member's ``refuse`` report (its call differs from its ring neighbour's:
the members' calls differ), with no new epoch: every member's ``term`` carries
the reporter's ``why``, and each raises it as :class:`~commlib.InvalidArgument`
over the same connections.  The terminal state is
decided once and each live member of the epoch receives exactly one terminal
message (``term``) for the tag.  Once every live member has it, the master
forgets the operation (per epoch it keeps the range of ``seq`` over which every
operation ended, and those that ended out of order): a report for it that
arrives later (it crossed the ``term``) is ignored.

Given-up calls: a member that leaves a call with an error the group did not
decide (its own timeout, ``retry=False`` after an abort, an argument of its own
that it found bad before anything moved) reports ``give_up`` for the call's
``seq``; the master passes it on to every other live member (``gave_up``) and
refuses the call if it is open in the current epoch.  Each member then fails
that call too, whether it is in it, retrying it, or yet to make it (a member
that was late for it), so no member's later call is paired with another
member's earlier one.

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
master keeps the winning revision and hashes.  A member whose own arguments are
bad raises at once and sends ``sync`` with ``bad`` (its error): when every live
member has sent ``sync``, that round's ``plan`` carries ``refused`` (the errors)
instead, every other member raises it, and nothing moves.

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

Dropped members: a member whose peer-to-peer traffic overruns another member's
receive caps (too many frames or bytes for receives never posted) is reported by
that member (``drop``) and declared dead, as if its connection had closed.

Threat model (see docs/faults-and-security.md): anyone may reach the ports; only holders
of the shared secret can authenticate (HMAC-SHA256 challenge-response both
ways, nothing but a random challenge is sent before, and a BUSY frame to a
connection the listener evicts); the master dials a peer's data address only after
that peer authenticated (the probe); only members of an epoch hold tickets to open
peer-to-peer connections, each bound to (epoch or sync round, source,
destination, stream, purpose).  Members are trusted not to lie about their
inputs; frames can be sealed with AES-GCM under keys from an ephemeral X25519
exchange (``encrypt=True``).
"""
from __future__ import annotations

import os
import sys
import time

from commlib.collectives.specs import PAIR_EXCHANGE_MAX as _PAIR_EXCHANGE_MAX
from commlib.core.config import config
from commlib.core.errors import InvalidArgument

__all__ = ["WELCOME", "REFUSED", "TOPO", "TERM", "VOTED", "PLAN", "SYNC_END", "VOTE", "DONE", "FAIL", "REFUSE",
           "SYNC", "SYNCED", "BYE", "DROP", "GIVE_UP", "GAVE_UP", "RING", "FETCH", "PROBE", "HEARTBEAT_INTERVAL",
           "JOB", "AUTO_STREAMS", "PAIR_EXCHANGE_MAX", "TICKET_TTL", "PROBE_TIMEOUT", "PROBE_TOKEN",
           "MAX_PEERS", "FETCH_MAX", "FETCH_PARK", "FETCH_PARK_S", "TRAFFIC", "WHY_MAX", "JOB_MAX", "JOB_WAIT", "REPORT_FLOOR", "is_int", "is_bytes", "dbg",
           "check_job"]

# --- master -> peer
WELCOME = "welcome"    #: after authentication: ``id``, the peer's ticket ``key``, ``hb`` (heartbeat seconds)
REFUSED = "refused"    #: instead of ``welcome`` (then the connection closes): ``why``, the reason the master
#:                        could not reach the peer's data address (its probe failed); or, with ``job`` (the
#:                        job's bytes), the joiner's ``JOB`` differs from the job's
TOPO = "topo"          #: a new epoch: ``e``, ``members`` ``[[id, data address]...]`` in ring order, ``tickets``, ``exp``
#:                        and ``seq``, the group's next call number (a new member numbers its calls from it)
TERM = "term"          #: an operation's terminal state: ``e``, ``s``, ``ok`` (committed or aborted); ``why``
#:                        when a member refused it (``refuse``): the members' calls differ
VOTED = "voted"        #: a vote completed: ``e`` (the epoch after it), ``v`` (the job's step count)
PLAN = "plan"          #: a shared-state round's plan: ``round``, ``rev``, ``hashes``, ``donors``, ``fetchers``...
#:                        (or ``lost``: the job's state is held by no live peer; or ``refused``: a member's errors)
#:                        (a fetcher's plan also carries its ``tickets`` to each donor, purpose FETCH, bound to the round)
SYNC_END = "sync_end"  #: every fetcher of ``round`` is done
GAVE_UP = "gave_up"    #: a member gave up call ``s`` (``kind``: ``"arg"`` its argument was bad, ``"timeout"``
#:                        its time ran out, ``"fail"`` a failure; ``why``): fail that call here too
# --- peer -> master
JOB = "job"            #: a joiner's first message after the handshake when its hello carries ``job: True``:
#:                        ``job``, the job's description (bytes, 1..JOB_MAX; compared, never decoded)
VOTE = "vote"          #: at a step boundary (:meth:`Peer.update_topology`)
DONE = "done"          #: operation ``(e, s)`` finished on this peer
FAIL = "fail"          #: operation ``(e, s)`` failed on this peer (a peer died, a bounded wait ran out)
REFUSE = "refuse"      #: operation ``(e, s)``: this peer's call differs from its ring neighbour's (``why``)
SYNC = "sync"          #: a shared-state submission: ``rev``, per-tensor ``hashes`` and ``meta``; ``bad``: this
#:                        member's own argument error (it raised): the round is refused on every member
SYNCED = "synced"      #: this fetcher finished its transfers
BYE = "bye"            #: leaving
DROP = "drop"          #: member ``id`` of epoch ``e`` overran this peer's receive caps (``why``): drop it
GIVE_UP = "give_up"    #: this member left call ``s`` with an error the group did not decide (``kind``, ``why``)
# --- the purpose of a peer-to-peer connection (in its authenticated hello)
RING = "ring"          #: a collective's data connection of one epoch
FETCH = "fetch"        #: a shared-state fetch from a donor
PROBE = "probe"        #: the master's probe of a joiner's data address (hello ``purpose``, with ``tok``: the
#:                        joiner's ``probe`` bytes); the joiner's listener answers ``{"t": PROBE}`` and closes

#: seconds between a peer's heartbeats
HEARTBEAT_INTERVAL = 0.25
#: seconds a member's report to the master (a collective's ``done`` / ``fail`` /
#: ``refuse``, a sync's ``synced`` or refusal) may still take when its call's deadline
#: has (nearly) passed: the master decides for every member once each has reported,
#: and a write that runs out of time closes the control connection (the master is
#: lost); the report is a few bytes, which a master that reads at all takes at once
REPORT_FLOOR = 0.25
#: ring connections per pair of peers on different hosts with ``connect(streams=None)``
#: (the default); a pair on loopback addresses uses one
AUTO_STREAMS = 4
#: bytes up to which a 2-peer unquantized all-reduce is one exchange of the whole
#: vector: the collective specification table's threshold
#: (:data:`commlib.collectives.specs.PAIR_EXCHANGE_MAX`), named here for users
PAIR_EXCHANGE_MAX = _PAIR_EXCHANGE_MAX
#: seconds the master gives its probe of a joiner's data address (connect, handshake,
#: answer) by default (:class:`~commlib.elastic.Master`'s ``probe_timeout``)
PROBE_TIMEOUT = 5.0
#: bytes of a joiner's probe token (its hello's ``probe``)
PROBE_TOKEN = 16
#: seconds a ticket stays valid
TICKET_TTL = 6 * 3600.0
#: peers one master serves at most
MAX_PEERS = 1024
#: fetch connections a donor serves at once
FETCH_MAX = 64
#: fetch connections a donor holds, without a thread, while the plan that names them is
#: on its way to it (the fetcher read the same plan first), and for how many seconds
FETCH_PARK = 64
FETCH_PARK_S = 5.0
#: bytes of a job's description at most (``connect(job=...)``, ``Master(job=...)``)
JOB_MAX = 16384
#: seconds the master waits for a joiner's ``JOB`` message after the handshake
JOB_WAIT = 5.0
#: characters of a refusal's reason (``refuse``, ``term``) the master relays
WHY_MAX = 2000
#: the data plane's traffic counters (:attr:`Peer.stats`)
TRAFFIC = ("bytes_sent", "bytes_received", "wire_bytes_sent", "wire_bytes_received", "bytes_buffered",
           "first_round_bytes_sent", "first_round_bytes_received", "first_round_wire_bytes_sent",
           "first_round_wire_bytes_received")


def dbg(msg: str) -> None:
    """One trace line on stderr with ``COMMLIB_ELASTIC_DEBUG`` set."""
    if config.elastic_debug:
        print(f"[elastic {time.monotonic():.3f} pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def check_job(job, op: str) -> bytes | None:
    """A job's description as bytes (None stays None).

    Args:
        job: None, or a bytes-like object (bytes, bytearray, memoryview) of
            1..:data:`JOB_MAX` bytes; copied, never decoded.
        op: the operation, for the error message.

    Raises:
        InvalidArgument: ``job`` is of another type (a str: encode it first), empty,
            or longer than :data:`JOB_MAX` bytes.
    """
    if job is None:
        return None
    if not isinstance(job, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"job must be None or bytes (an opaque description of the job, compared byte for "
                              f"byte), got {type(job).__name__}", op=op)
    job = bytes(job)  # a copy: a memoryview's bytes in C order, whatever its format
    if not 1 <= len(job) <= JOB_MAX:
        raise InvalidArgument(f"job must hold 1..{JOB_MAX} bytes, got {len(job)}", op=op)
    return job


def is_bytes(x, n=None) -> bool:
    return isinstance(x, bytes) and (n is None or len(x) == n)


def is_int(x, lo=0, hi=(1 << 62)) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi
