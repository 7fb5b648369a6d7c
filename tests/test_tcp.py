"""The TCP transport (commlib.transports.tcp) and the elastic master under attack, on loopback.

* the ring modules of ``collectives/`` over :class:`TCPTransport` (plain and
  sealed with AES-GCM, 1-4 streams): results against float64 sums, bit parity;
* authentication: a wrong secret, no secret, a replayed handshake and a forged
  ticket are refused and the attacker receives nothing but the 32-byte
  challenge (no membership, no state, no error text);
* fuzzed frames (hypothesis) at the master and at a peer's data port: no
  crash, bounded memory, honest peers go on.
"""
from __future__ import annotations

import contextlib
import hashlib
import socket
import sys
import threading
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import commlib
import commlib.elastic as el
from commlib.collectives.allgather_bruck import allgather_bruck
from commlib.collectives.allreduce_ring import allreduce_ring
from commlib.transports import tcp
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)
SECRET = b"tcp-test-secret-0123456789"


# ------------------------------------------------------------------ helpers
def make_group(n, streams=2, epoch=1, encrypt=False):
    ts = [None] * n
    ready = threading.Event()

    def on_conn_for(r):
        def on_conn(conn):
            ready.wait(5)
            h = conn.hello
            ts[r].attach(h["src"], h["stream"], h["streams"], conn)
        return on_conn

    lst = [tcp.Listener("127.0.0.1:0", SECRET, on_conn_for(r), encrypt=encrypt) for r in range(n)]

    def connect_for(r):
        def connect(peer, stream):
            s = tcp.open_socket(lst[peer].address, 5)
            return tcp.client_handshake(s, SECRET, {"src": r, "stream": stream, "streams": streams}, encrypt=encrypt)
        return connect

    for r in range(n):
        ts[r] = tcp.TCPTransport(r, n, epoch, connect_for(r), streams=streams, timeout=10)
    ready.set()
    return ts, lst


@contextlib.contextmanager
def tcp_group(n, streams=2, epoch=1, encrypt=False):
    """:func:`make_group`'s transports, closed (with their listeners) on exit."""
    ts, lst = make_group(n, streams, epoch, encrypt)
    try:
        yield ts
    finally:
        for t in ts:
            t.close()
        for s in lst:
            s.close()


def run_all(items, fn):
    out, err = [None] * len(items), [None] * len(items)

    def go(i):
        try:
            out[i] = fn(items[i])
        except BaseException as exc:  # noqa: BLE001
            err[i] = exc

    th = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(items))]
    for t in th:
        t.start()
    for t in th:
        t.join(60)
    for e in err:
        if e is not None:
            raise e
    return out


def recv_all(sock, limit=1 << 20, timeout=2.0) -> bytes:
    """Everything the other side sends until it closes (or ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while len(data) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, ConnectionError):
        pass
    return data


def challenge_only(data: bytes) -> bool:
    """True when ``data`` is nothing but the server's CHALLENGE frame (header + 32 random bytes)."""
    if len(data) == 0:
        return True
    if len(data) != tcp.HEADER.size + 32:
        return False
    return tcp.HEADER.unpack(data[:tcp.HEADER.size])[2] == tcp.K_CHALLENGE


# ------------------------------------------------------------------ transport
@pytest.mark.parametrize("n,streams,encrypt", [(2, 1, False), (3, 4, False), (4, 2, False), (3, 2, True)])
def test_ring_allreduce_over_tcp(n, streams, encrypt):
    with tcp_group(n, streams, encrypt=encrypt) as ts:
        for count in (0, 3, 4099, 1 << 19):
            data = [np.random.default_rng(i).standard_normal(count) for i in range(n)]

            def fn(t):
                b = data[t.rank].copy()
                allreduce_ring(t, b, "sum", timeout=10)
                return b

            out = run_all(ts, fn)
            assert len({o.tobytes() for o in out}) == 1
            np.testing.assert_allclose(out[0], np.sum(data, axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_bruck_allgather_over_tcp(n):
    """Bruck's allgather (the argument agreement's) on 1-7 ranks gives every
    rank every block in rank order, bit for bit, and each rank sends
    ceil(log2 n) messages carrying n - 1 blocks."""
    with tcp_group(n, 2) as ts:
        for count in (1, 6, 700):
            data = [np.random.default_rng(10 * n + i).integers(0, 1 << 60, count, dtype=np.int64) for i in range(n)]
            sent = [t.bytes_sent for t in ts]
            sends = [0] * n

            def fn(t):
                isend = t.isend

                def counted(*a, **kw):
                    sends[t.rank] += 1
                    return isend(*a, **kw)

                t.isend = counted
                try:
                    out = np.full(n * count, -1, np.int64)
                    allgather_bruck(t, data[t.rank], out, timeout=10)
                finally:
                    del t.isend
                return out

            for o in run_all(ts, fn):
                assert o.tobytes() == np.concatenate(data).tobytes()
            for t, before in zip(ts, sent):
                assert sends[t.rank] == (n - 1).bit_length()  # ceil(log2 n) steps
                assert t.bytes_sent - before == (n - 1) * count * 8


def test_request_completion_wakes_every_waiter_once_set():
    """A request's completion flag (``tcp.Completion``, threading.Event's
    set/is_set/wait over one lock): unset, a bounded wait returns False after
    its timeout; once set, every waiter, blocked or later, returns True; set()
    calls racing each other (a frame done and a sender's failure) never raise."""
    c = tcp.Completion()
    t0 = time.monotonic()
    assert not c.wait(0.05) and not c.is_set()
    assert time.monotonic() - t0 >= 0.04
    # two set() calls that both read the flag unset before either writes it (a frame
    # done under the transport's lock, a sender's failure outside it): the second
    # release finds the lock open and must not raise
    c = tcp.Completion()
    c.set()
    c._flag = False  # the second caller's stale read of the flag
    c.set()
    assert c.is_set() and c.wait(0)
    rng = np.random.default_rng(5)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches between any two bytecodes: the races happen
    try:
        _completion_races(rng)
    finally:
        sys.setswitchinterval(switch)


def _completion_races(rng):
    for _trial in range(200):
        c = tcp.Completion()
        got, errors = [], []
        go = threading.Barrier(7)

        def waiter():
            go.wait()
            got.append(c.wait(2.0))

        def setter(delay):
            go.wait()
            time.sleep(float(delay))
            try:
                c.set()
            except BaseException as exc:  # noqa: BLE001 - a racing set must not raise
                errors.append(exc)

        th = [threading.Thread(target=waiter) for _ in range(4)]
        th += [threading.Thread(target=setter, args=(d,)) for d in rng.random(3) * 1e-4]
        for t in th:
            t.start()
        for t in th:
            t.join(10)
        assert errors == [] and got == [True] * 4 and c.is_set()
        assert c.wait(0) and c.wait(None)  # stays set for later waiters


def test_frame_bounds_and_striping():
    for nbytes in (0, 1, tcp.STRIPE_MIN, 10 * tcp.STRIPE_MIN + 3, 3 * tcp.FRAME_MAX + 1):
        for s in (1, 2, 4):
            b = tcp.frame_bounds(nbytes, s)
            assert b[0] == 0 and b[-1] == nbytes and all(b[i] <= b[i + 1] for i in range(len(b) - 1))
            assert max(b[i + 1] - b[i] for i in range(len(b) - 1)) <= tcp.FRAME_MAX
    assert len(tcp.frame_bounds(1 << 20, 4)) == 5       # 1 MiB over 4 streams: 4 frames
    assert len(tcp.frame_bounds(100, 4)) == 2           # small: one frame


def _arrived(t, src, tag) -> bool:
    """A frame of (src, tag) has reached ``t``'s receiver (its header read: a slot)."""
    return bool(t._slots.get((src, tag)))


def _posted(t) -> bool:
    """``t`` has a receive posted (a slot with its request)."""
    try:
        return any(s.req is not None for dq in list(t._slots.values()) for s in list(dq))
    except RuntimeError:  # a deque changed while read: look again
        return False


def _warm(ts):
    """One byte from rank 0 to rank 1 (tag 99): the link's connections are up."""
    q = ts[1].irecv(np.zeros(1, np.uint8), 0, tag=99)
    ts[0].isend(np.ones(1, np.uint8), 1, tag=99).wait(10)
    q.wait(10)


def _nframes(nbytes, streams):
    """Frames of a message by the cut docs/elastic-protocol.md states (an oracle independent of frame_bounds)."""
    return max(-(-nbytes // tcp.FRAME_MAX), min(streams, -(-nbytes // tcp.STRIPE_MIN)), 1)


@pytest.mark.parametrize("streams,encrypt", [(1, False), (2, True)])
def test_early_frames_wait_for_their_receive_and_counters(streams, encrypt):
    """A large message sent before its receive is posted stays in the kernel until the
    post (then lands in the buffer with no extra copy: bytes_buffered stays 0); the byte
    counters match the frames the spec says were written."""
    with tcp_group(2, streams, encrypt=encrypt) as ts:
        nbytes = 3 << 20
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, np.uint8)
        _warm(ts)
        sq = ts[0].isend(src, 1, tag=5)
        wait_until(lambda: _arrived(ts[1], 0, 5), what="the frame's header read")  # it arrives before the post
        ts[1].irecv(dst, 0, tag=5).wait(10)
        sq.wait(10)
        assert np.array_equal(dst, src)
        assert ts[1].bytes_buffered == 0
        k = _nframes(nbytes, streams)
        per_frame = tcp.HEADER.size + (tcp.GCM_TAG if encrypt else 0)
        assert ts[0].bytes_sent == ts[1].bytes_received == nbytes + 1
        assert ts[0].wire_bytes_sent == ts[1].wire_bytes_received == nbytes + 1 + (k + 1) * per_frame


def test_early_frame_buffered_when_another_receive_waits(monkeypatch):
    """Receives posted in the reverse order of the sends on one connection: the first
    frame is buffered at once (the application waits for the one behind it), no stall
    of POST_WAIT (made 30 s here, so a stall could not pass for speed), no deadlock."""
    monkeypatch.setattr(tcp, "POST_WAIT", 30.0)
    with tcp_group(2, 1) as ts:
        a = np.arange(1 << 18, dtype=np.float32)
        b = a[::-1].copy()
        ra, rb = np.zeros_like(a), np.zeros_like(b)
        _warm(ts)
        t0 = time.monotonic()
        qb = ts[1].irecv(rb, 0, tag=2)                     # posted first, sent second
        s1, s2 = ts[0].isend(a, 1, tag=1), ts[0].isend(b, 1, tag=2)
        qb.wait(20)
        assert time.monotonic() - t0 < tcp.POST_WAIT / 2
        ts[1].irecv(ra, 0, tag=1).wait(10)
        ts[0].waitall([s1, s2], 10)
        assert np.array_equal(ra, a) and np.array_equal(rb, b)
        assert ts[1].bytes_buffered == a.nbytes


def test_early_frame_never_posted_is_buffered_after_post_wait():
    """A frame whose receive is not posted within POST_WAIT seconds is buffered (bounded
    by UNEXPECTED_MAX) and the connection goes on: a later message is delivered."""
    with tcp_group(2, 1) as ts:
        x = np.ones(1 << 17, np.float32)
        y = np.full(1 << 17, 2.0, np.float32)
        ts[0].isend(x, 1, tag=7)
        ts[0].isend(y, 1, tag=8)
        # x is held for POST_WAIT, then buffered (y, behind it, is read next)
        wait_until(lambda: ts[1].bytes_buffered >= x.nbytes, what="x buffered after POST_WAIT")
        got_y = np.zeros_like(y)
        ts[1].irecv(got_y, 0, tag=8).wait(5)
        got_x = np.zeros_like(x)
        ts[1].irecv(got_x, 0, tag=7).wait(5)
        assert np.array_equal(got_x, x) and np.array_equal(got_y, y)
        assert ts[1].bytes_buffered == x.nbytes


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, True, False, "5"],
                         ids=["nan", "inf", "-1", "True", "False", "str"])
def test_waitall_refuses_a_bad_timeout_and_the_request_stays_valid(value):
    """The transport's own ``waitall``: a bool used to pass as 1 or 0 seconds and a
    str raised TypeError; every bad value now raises InvalidArgument at once, and
    the receive still completes once its message comes."""
    with tcp_group(2, 1) as ts:
        got = np.zeros(4)
        r = ts[1].irecv(got, 0, 5)
        with pytest.raises(commlib.InvalidArgument, match="timeout must be"):
            ts[1].waitall([r], timeout=value)
        ts[0].send(np.arange(4.0), 1, 5)
        ts[1].waitall([r], timeout=5)
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_peer_death_is_process_failed():
    with tcp_group(2, 2) as ts:
        b = np.zeros(1 << 16)
        r = ts[1].irecv(b, 0, 7)
        ts[0].send(np.ones(16), 1, 3)    # opens the link
        ts[0].close()
        with pytest.raises(commlib.ProcessFailed):
            ts[1].waitall([r], timeout=5)
        r2 = ts[1].irecv(np.zeros(4), 0, 9)
        with pytest.raises((commlib.ProcessFailed, commlib.CommTimeout)):
            ts[1].waitall([r2], timeout=0.5)


# ------------------------------------------------------------------ authentication
@pytest.fixture
def cluster():
    master = el.Master(secret=SECRET).start()
    peers = [el.connect(master.address, secret=SECRET, streams=2, timeout=10) for _ in range(2)]
    _form(peers)
    yield master, peers
    for p in peers:
        p.close()
    master.stop()


def _form(peers, n=2):
    def fn(p):
        deadline = time.monotonic() + 30
        p.update_topology()
        while p.size != n:
            assert time.monotonic() < deadline
            p.update_topology()
    run_all(peers, fn)


def _still_works(peers):
    out = run_all(peers, lambda p: p.allreduce(np.full(1000, float(p.rank + 1)), "sum"))
    assert all(np.all(o == 3.0) for o in out)


def test_wrong_or_missing_secret_refused(cluster, monkeypatch):
    master, peers = cluster
    with pytest.raises(el.AuthError):
        el.connect(master.address, secret=b"wrong-secret-0123456789", timeout=5)
    monkeypatch.delenv("COMMLIB_ELASTIC_SECRET", raising=False)
    with pytest.raises(el.AuthError):
        el.connect(master.address, timeout=5)
    # raw attacker: a well-formed RESPONSE under a wrong key gets nothing but the challenge
    s = tcp.open_socket(master.address, 5)
    hdr = s.recv(tcp.HEADER.size, socket.MSG_WAITALL)
    ns = s.recv(32, socket.MSG_WAITALL)
    nc = b"n" * 32
    hb = msgpack.packb({"role": "peer", "data": "127.0.0.1:1", "streams": 1})
    import hmac
    mac = hmac.new(b"wrong-secret-0123456789", b"commlib-c" + ns + nc + hb, hashlib.sha256).digest()
    s.sendall(tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.K_RESPONSE, 0, 0, 0, 0, 0, 64 + len(hb)) + nc + mac + hb)
    assert challenge_only(hdr + ns)
    assert recv_all(s) == b"", "the master sent something to an unauthenticated client"
    s.close()
    # the data port of a peer too
    p0 = peers[0]
    s = tcp.open_socket(p0._listener.address, 5)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    assert challenge_only(recv_all(s))
    s.close()
    assert master.members == sorted(p.id for p in peers)
    _still_works(peers)


def test_replayed_handshake_refused(cluster):
    master, peers = cluster
    # an honest client's RESPONSE (built here with the real secret), answered once...
    import hmac
    s = tcp.open_socket(master.address, 5)
    first = s.recv(tcp.HEADER.size + 32, socket.MSG_WAITALL)
    ns = first[tcp.HEADER.size:]
    nc = b"c" * 32
    hb = msgpack.packb({"role": "peer", "data": "127.0.0.1:9", "streams": 1})
    mac = hmac.new(SECRET, b"commlib-c" + ns + nc + hb, hashlib.sha256).digest()
    resp = tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.K_RESPONSE, 0, 0, 0, 0, 0, 64 + len(hb)) + nc + mac + hb
    s.sendall(resp)
    assert len(s.recv(tcp.HEADER.size + 32, socket.MSG_WAITALL)) == tcp.HEADER.size + 32  # the PROOF
    s.close()
    captured = {"resp": resp}
    # ...and replayed on a new connection: refused, nothing sent
    s2 = tcp.open_socket(master.address, 5)
    first = s2.recv(tcp.HEADER.size + 32, socket.MSG_WAITALL)
    s2.sendall(captured["resp"])
    rest = recv_all(s2)
    assert challenge_only(first) and rest == b"", "a replayed RESPONSE was answered"
    s2.close()
    _still_works(peers)


def test_forged_ticket_refused(cluster):
    master, peers = cluster
    p0, p1 = sorted(peers, key=lambda p: p.rank)
    topo = p0._topo
    good = topo.tickets[p1.id][0]
    attempts = [
        {"tkt": bytes(32)},                                       # forged
        {"tkt": bytes(b ^ 1 for b in good)},                      # tampered
        {"e": topo.epoch + 1},                                    # valid ticket, other epoch
        {"exp": float(topo.exp) + 1},                             # extended expiry
        {"dst": p0.id},                                           # to someone else
        {"src": p1.id},                                           # impersonation
        {"exp": time.time() - 1e6, "tkt": tcp.make_ticket(b"k" * 32, topo.epoch, p0.id, p1.id, 0,
                                                          time.time() - 1e6)},
    ]
    for change in attempts:
        hello = {"src": p0.id, "dst": p1.id, "e": topo.epoch, "stream": 0, "streams": 2, "exp": float(topo.exp),
                 "tkt": good, "purpose": "fetch"}
        hello.update(change)
        conn = tcp.client_handshake(tcp.open_socket(p1._listener.address, 5), SECRET, hello)
        # authenticated (it holds the secret) but not admitted: the peer closes without a word
        conn.send_ctrl({"k": "w", "o": 0, "n": 8})
        data = recv_all(conn.sock)
        assert data == b"", f"peer answered a connection with {change}"
        conn.close()
    _still_works(peers)


# ------------------------------------------------------------------ fuzzing
_frames = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda kind, flags, e, tag, length, body: tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, kind, flags, e, tag,
                                                                        0, 0, length) + body,
              st.integers(0, 255), st.integers(0, 3), st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 64 - 1),
              st.one_of(st.integers(0, 300), st.just(2 ** 32 - 1), st.just(1 << 30)), st.binary(max_size=300)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(_frames, min_size=1, max_size=4))
def test_fuzz_master_and_peer(fuzz_cluster, frames):
    master, peers = fuzz_cluster
    for addr in (master.address, peers[0]._listener.address):
        s = tcp.open_socket(addr, 5)
        try:
            for f in frames:
                s.sendall(f)
        except OSError:
            pass
        data = recv_all(s, timeout=0.1)
        assert challenge_only(data)
        s.close()


def _authenticated_garbage(master_addr, payloads):
    """Authenticated (holds the secret) clients sending garbage after the handshake."""
    for body in payloads:
        conn = tcp.client_handshake(tcp.open_socket(master_addr, 5), SECRET,
                                    {"role": "peer", "data": "127.0.0.1:1", "streams": 1})
        try:
            conn.sock.sendall(body)
        except OSError:
            pass
        recv_all(conn.sock, timeout=0.3)
        conn.close()


@pytest.fixture(scope="module")
def fuzz_cluster():
    # no probe of a joiner's data address: the garbage senders' hellos (no probe
    # token, an address nothing listens on) reach the master's reader
    master = el.Master(secret=SECRET, probe_timeout=None).start()
    peers = [el.connect(master.address, secret=SECRET, streams=1, timeout=10) for _ in range(2)]
    _form(peers)
    yield master, peers
    for p in peers:
        p.close()
    master.stop()


def _connection_pair():
    """Two ends of one loopback TCP connection, as plain (unauthenticated) :class:`tcp.Connection`s."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    a = socket.create_connection(ls.getsockname(), timeout=10)
    b = ls.accept()[0]
    ls.close()
    return tcp.Connection(a), tcp.Connection(b)


def test_fuzz_leaves_honest_peers_working(fuzz_cluster):
    master, peers = fuzz_cluster
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    big = tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.K_CTRL, 0, 0, 0, 0, 0, 2 ** 32 - 1) + b"x" * 100
    bomb = msgpack.packb([[[[]] * 10] * 10] * 10)
    bomb_frame = tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.K_CTRL, 0, 0, 0, 0, 0, len(bomb)) + bomb
    bad_msgpack = b"\xdd\xff\xff\xff\xff"  # array32 claiming 4 G elements
    bm_frame = tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.K_CTRL, 0, 0, 0, 0, 0, len(bad_msgpack)) + bad_msgpack
    msg = msgpack.packb({"t": "done", "e": "x", "s": None})
    bad_msg = tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.K_CTRL, 0, 0, 0, 0, 0, len(msg)) + msg
    _authenticated_garbage(master.address, [big, bomb_frame, bm_frame, bad_msg, b"\x00" * 1000])
    peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    assert peak < 64 << 20, f"the master allocated {peak} bytes for garbage"
    for p in peers:
        assert p.rank is not None
    run_all(peers, lambda p: p.update_topology())
    out = run_all(peers, lambda p: p.allreduce(np.full(10, float(p.rank + 1)), "sum"))
    assert all(np.all(o == 3.0) for o in out)
    assert len(master.members) == 2


def _tcp_pair():
    """A connected loopback TCP pair, tuned as the transport's sockets are."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    ls.close()
    for s in (a, b):
        tcp.tune_socket(s)
    return a, b


def _blocked_in_kernel(th) -> bool:
    """True when thread ``th`` sleeps in a system call other than a lock's (Linux /proc)."""
    with open(f"/proc/self/task/{th.native_id}/wchan") as fh:
        wchan = fh.read().strip()
    return wchan not in ("", "0") and "futex" not in wchan


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the reader's state")
def test_large_read_completes_when_its_rest_is_below_the_low_water_mark():
    """A read of more than RCVLOWAT_MIN bytes (the data path's, unbounded) waits
    under a low-water mark of at most RCVLOWAT bytes.  A first piece is in the
    receive queue when it starts (below the mark, or all but the last 1000 bytes)
    and the rest comes once it sleeps: it completes with every byte (a recv
    sleeping under the mark copies the first piece, then waits for a mark's worth
    of *new* data, and hangs), and the socket's mark is 1 again after (the next
    frame's 28-byte header wakes its reader at once)."""
    from commlib.transports import tcp_frames

    seed = 7
    print("seed", seed)
    n = tcp_frames.RCVLOWAT_MIN + (300 << 10)
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    a, b = _tcp_pair()
    try:
        for first in (tcp_frames.RCVLOWAT - (400 << 10), 1 << 10, n - 1000):
            a.sendall(data[:first])
            wait_until(lambda: _queued(b) == first, what="the first piece in the receive queue")
            out = {}
            th = threading.Thread(target=lambda: out.update(got=tcp_frames.recv_exact(b, n)), daemon=True)
            th.start()
            wait_until(lambda: _blocked_in_kernel(th), what="the reader waiting for the rest")
            a.sendall(data[first:])
            th.join(30)
            assert not th.is_alive(), f"the read of {n} bytes did not complete (first piece {first})"
            assert bytes(out["got"]) == data
            assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        a.close()
        b.close()


def _queued(sock) -> int:
    """Bytes in ``sock``'s receive queue (FIONREAD)."""
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_large_read_ends_when_its_connection_closes():
    """A large read waiting for the rest of its bytes ends with an error when the
    connection closes (the peer's side, or this side's Connection.close from
    another thread): it never waits on."""
    from commlib.transports import tcp_frames

    n = 2 * tcp_frames.RCVLOWAT_MIN
    for closer in ("peer", "shutdown"):
        a, b = _tcp_pair()
        errors = []

        def read():
            try:
                tcp_frames.recv_exact(b, n)
            except (ConnectionError, OSError) as exc:
                errors.append(exc)

        th = threading.Thread(target=read, daemon=True)
        th.start()
        a.sendall(b"x" * (n // 3))
        if closer == "peer":
            a.close()
        else:
            b.shutdown(socket.SHUT_RDWR)
        th.join(30)
        assert not th.is_alive() and len(errors) == 1, closer
        a.close()
        b.close()


def test_connection_reader_survives_a_writer_with_timeouts():
    """One connection, two threads on one side: a reader with no deadline and a
    writer sending with a timeout (as the master's and the peers' control
    connections do: heartbeats with a bound, reads without). The other side sends
    a stream of control messages. Every message must arrive, in order, and neither
    thread may fail: a reader whose socket is switched to non-blocking mode under
    it by the writer's timeout fails with EAGAIN (BlockingIOError), which once tore
    down healthy connections at random (about 1 bench run in 4)."""
    ca, cb = _connection_pair()
    count, errors, got = 4000, [], []
    stop = threading.Event()

    def reader():
        try:
            while True:
                kind, _, msg = ca.read_ctrl()
                if msg.get("t") == "stop":
                    return
                got.append(msg["i"])
        except Exception as exc:  # noqa: BLE001
            errors.append(("reader", exc))

    def writer():
        try:
            while not stop.is_set():
                ca.send_frame(tcp.K_PING, b"", timeout=2.0)
        except Exception as exc:  # noqa: BLE001
            errors.append(("writer", exc))

    def drain():  # side B reads (and drops) side A's pings
        try:
            while not stop.is_set():
                kind, _, _, _, _, _, length = cb.read_header(time.monotonic() + 5)
                cb.read_payload(length, deadline=time.monotonic() + 5)
        except Exception as exc:  # noqa: BLE001
            if not stop.is_set():
                errors.append(("drain", exc))

    ths = [threading.Thread(target=f, daemon=True) for f in (reader, writer, drain)]
    for t in ths:
        t.start()
    try:
        for i in range(count):
            cb.send_ctrl({"t": "x", "i": i}, timeout=5)
            if i % 4 == 0:
                time.sleep(0.0005)  # let the reader catch up and block in recv
        cb.send_ctrl({"t": "stop"}, timeout=5)
        ths[0].join(30)
    finally:
        stop.set()
        ths[1].join(10)
        ca.close()
        cb.close()
    assert not errors, errors
    assert got == list(range(count))


@pytest.mark.parametrize("posted_first", [True, False])
@pytest.mark.parametrize("sent,posted", [(4096, 4000), (200_000, 300_000), (1 << 20, 48)])
def test_first_round_message_of_another_size_fails_its_receive_only(posted_first, sent, posted):
    """A first-round message (one frame, never striped, even with 4 streams) whose
    size differs from the receive posted for it fails that receive with
    MessageSizeMismatch (an InvalidArgument), whether it came before or after the post (buffered, held, or
    read straight in), carrying the message's first 256 bytes (``head``: a first
    round's message starts with its sender's header row); the link stays up: the
    next messages, both ways, arrive intact."""
    with tcp_group(2, 4) as ts:
        _warm(ts)
        tag = tcp.FIRST_ROUND_TAG + 7
        src = np.random.default_rng(1).integers(0, 255, sent, dtype=np.uint8)
        dst = np.zeros(posted, np.uint8)
        if posted_first:
            rq = ts[1].irecv(dst, 0, tag=tag)
            sq = ts[0].isend(src, 1, tag=tag)
        else:
            sq = ts[0].isend(src, 1, tag=tag)
            wait_until(lambda: _arrived(ts[1], 0, tag), what="the frame's header read")  # it arrives before the post
            rq = ts[1].irecv(dst, 0, tag=tag)
        with pytest.raises(commlib.MessageSizeMismatch, match="does not match the posted receive") as info:
            rq.wait(10)
        assert info.value.head == src[:tcp.MISMATCH_HEAD].tobytes()
        assert not dst.any()
        sq.wait(10)
        assert not ts[0].failed_ranks() and not ts[1].failed_ranks()
        for a, b in ((0, 1), (1, 0)):
            x = np.random.default_rng(a).integers(0, 255, 70_000, dtype=np.uint8)
            y = np.zeros_like(x)
            r = ts[b].irecv(y, a, tag=9 + a)
            ts[a].isend(x, b, tag=9 + a).wait(10)
            r.wait(10)
            assert np.array_equal(x, y)


def test_small_messages_written_inline_keep_their_order():
    """Small messages go out from the caller's thread when the connection is idle,
    larger ones through the sender thread (striped over two connections): 200
    messages of mixed sizes on one tag arrive in the order sent (MPI's
    non-overtaking rule), bytes intact, over one connection and over two (where
    a later message's second frame may pass an earlier one-frame message)."""
    for streams in (1, 2):
        _inline_order(streams)


def _inline_order(streams):
    with tcp_group(2, streams) as ts:
        _warm(ts)
        rng = np.random.default_rng(3)
        sizes = rng.choice([8, 1000, tcp.INLINE_MAX, tcp.INLINE_MAX + 1, 200_000, 1 << 20], 200)
        msgs = [rng.integers(0, 255, int(n), dtype=np.uint8) for n in sizes]
        outs = [np.zeros_like(m) for m in msgs]
        rqs = [ts[1].irecv(o, 0, tag=3) for o in outs]
        sqs = [ts[0].isend(m, 1, tag=3) for m in msgs]
        ts[0].waitall(sqs, 20)
        ts[1].waitall(rqs, 20)
        assert all(np.array_equal(m, o) for m, o in zip(msgs, outs))


def test_abort_tag_unposts_receives_and_drops_frames(monkeypatch):
    """abort_tag: a posted receive of the tag fails with CommError and its buffer is
    never written; a frame of the tag buffered before the abort is freed; frames of
    it arriving later are dropped at once (not held for POST_WAIT, made 30 s here so
    a hold could not pass for speed), and the next message on the connection is delivered."""
    monkeypatch.setattr(tcp, "POST_WAIT", 30.0)
    with tcp_group(2, 1) as ts:
        _warm(ts)
        ts[0].isend(np.full(100, 3, np.uint8), 1, tag=9).wait(5)  # small: buffered, never posted
        deadline = time.monotonic() + 5
        while ts[1]._unexpected == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        ts[1].abort_tag(9)
        assert ts[1]._unexpected == 0
        got = np.zeros(1 << 18, np.uint8)
        rq = ts[1].irecv(got, 0, tag=5)
        ts[1].abort_tag(5)
        with pytest.raises(commlib.CommError, match="aborted"):
            rq.wait(5)
        after = np.zeros(8, np.uint8)
        r6 = ts[1].irecv(after, 0, tag=6)
        t0 = time.monotonic()
        ts[0].waitall([ts[0].isend(np.ones(1 << 18, np.uint8), 1, tag=5),
                       ts[0].isend(np.arange(8, dtype=np.uint8), 1, tag=6)], 20)
        r6.wait(20)
        assert time.monotonic() - t0 < tcp.POST_WAIT / 2
        assert np.array_equal(after, np.arange(8)) and not got.any()
        assert ts[1]._unexpected == 0 and ts[1].bytes_buffered == 100


def test_abort_tags_waits_for_reads_in_flight_and_fails_later_receives():
    """abort_tags (a refusal): it returns only once no frame of its tags is being read
    into a posted buffer (the caller restores that buffer next); the posted receive
    fails with the given error; a receive of those tags posted afterwards fails at
    once with it; the rest of the aborted message is dropped, and other tags' traffic
    goes on over the same link."""
    with tcp_group(2, 1) as ts:
        _warm(ts)
        data, first = ts[1].operation_tags(2)
        assert data == range(2 * tcp.OPERATION_TAGS, 3 * tcp.OPERATION_TAGS)
        assert first[0] == tcp.FIRST_ROUND_TAG + data[0] and len(first) == tcp.OPERATION_TAGS
        tag = data[1]
        big = np.zeros(1 << 28, np.uint8)
        rq = ts[1].irecv(big, 0, tag=tag)
        sq = ts[0].isend(np.ones(1 << 28, np.uint8), 1, tag=tag)
        deadline = time.monotonic() + 10
        while not ts[1]._inflight.get(tag):
            assert time.monotonic() < deadline, "the frame was never read into the posted buffer"
        ts[1].abort_tags((*data, *first), lambda t: commlib.InvalidArgument(f"refused {t}", rank=1, op="x"))
        assert tag not in ts[1]._inflight, "abort_tags returned while a frame was read into the buffer"
        with pytest.raises(commlib.InvalidArgument, match=f"refused {tag}"):
            rq.wait(5)
        late = ts[1].irecv(np.zeros(8, np.uint8), 0, tag=first[0])
        with pytest.raises(commlib.InvalidArgument, match=f"refused {first[0]}"):
            late.wait(0.1)
        sq.wait(10)  # the receiver drops the rest
        out = np.zeros(8, np.uint8)
        r = ts[1].irecv(out, 0, tag=data[-1] + 1)
        ts[0].waitall([ts[0].isend(np.arange(8, dtype=np.uint8), 1, tag=data[-1] + 1), r], 5)
        assert np.array_equal(out, np.arange(8)) and ts[1]._failure is None


def test_begin_operation_numbers_tags_from_the_sequence():
    """An operation's data and first-round tags follow from its sequence number
    alone, whatever earlier operations took."""
    with tcp_group(2, 1) as ts:
        ts[0].tags.slot(5)
        for t in ts:
            tags = t.begin_operation(3)
            assert tags == range(3 * tcp.OPERATION_TAGS, 4 * tcp.OPERATION_TAGS)
            assert t.tags.slot(2) == tags[0] and t.tags.slot(1) == tags[2]
            assert t.first_round_tags.slot() == tcp.FIRST_ROUND_TAG + tags[0]


@pytest.mark.parametrize("streams,encrypt", [(1, False), (2, False), (2, True)])
def test_gather_send_is_one_message_of_its_parts(streams, encrypt):
    """isend of a tuple under a first-round tag: the receiver's one buffer holds the
    parts back to back (small gathers joined, large ones sent without a copy; sealed
    connections join them), counted as first-round bytes; a data tag is refused."""
    with tcp_group(2, streams, encrypt=encrypt) as ts:
        _warm(ts)
        rng = np.random.default_rng(5)
        tag = tcp.FIRST_ROUND_TAG + 40
        for n in (8, tcp.INLINE_MAX, 300_000, 1 << 20):
            head = rng.integers(0, 255, 48, dtype=np.uint8)
            body = rng.standard_normal(n // 4 or 1).astype(np.float32)
            got = np.zeros(48 + body.nbytes, np.uint8)
            before = ts[0].first_round_bytes_sent, ts[0].bytes_sent
            rq = ts[1].irecv(got, 0, tag)
            ts[0].isend((head, body), 1, tag).wait(10)
            rq.wait(10)
            assert got[:48].tobytes() == head.tobytes() and got[48:].tobytes() == body.tobytes()
            assert ts[0].first_round_bytes_sent - before[0] == got.nbytes and ts[0].bytes_sent == before[1]
            tag += 1
        with pytest.raises(commlib.InvalidArgument, match="first-round tag"):
            ts[0].isend((head, body), 1, 3)


def test_receive_posted_for_another_size_while_its_frame_is_read():
    """The race a ring-sized call against a pair exchange hit: a large first-round
    frame is read into a private buffer (another receive from that peer is posted,
    so it is not held), and its receive is posted, for another size, while the
    bytes come in.  That receive fails with InvalidArgument; nothing is written past
    it and the link stays up (it used to fail the link with numpy's ValueError)."""
    with tcp_group(2, 1) as ts:
        _warm(ts)
        tag = tcp.FIRST_ROUND_TAG + 3
        pending = ts[1].irecv(np.zeros(16, np.uint8), 0, tag=5)  # posted, never sent: no hold
        conn = ts[1]._links[0].conns[0]
        small = np.zeros(1072, np.uint8)
        posted = {}
        real = conn.read_payload

        def read_payload(length, into=None):
            if length >= tcp.POST_WAIT_MIN and "rq" not in posted:
                posted["rq"] = ts[1].irecv(small, 0, tag=tag)  # posted while the frame is being read
            return real(length, into=into)

        conn.read_payload = read_payload
        big = np.ones(65584, np.uint8)
        ts[0].isend(big, 1, tag=tag).wait(10)
        deadline = time.monotonic() + 5
        while "rq" not in posted:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(commlib.InvalidArgument, match="does not match the posted receive"):
            posted["rq"].wait(10)
        assert not small.any() and not ts[1].failed_ranks()
        x, y = np.arange(100, dtype=np.uint8), np.zeros(100, np.uint8)
        r = ts[1].irecv(y, 0, tag=6)
        ts[0].isend(x, 1, tag=6).wait(10)
        r.wait(10)
        assert np.array_equal(x, y)
        ts[1].abort_tag(5)
        with pytest.raises(commlib.CommError):
            pending.wait(1)


class _First:
    """A TCP transport as a collective's first round uses it (its first-round tags)."""

    def __init__(self, tr):
        self._tr, self.tags = tr, tr.first_round_tags

    def __getattr__(self, name):
        return getattr(self._tr, name)


def _first_round(kind, tr, values, nbytes, timeout=10):
    from commlib.collectives.agreement import RingHead
    from commlib.collectives.one_shot import one_shot_bytes, one_shot_first_round
    from commlib.collectives.pair_round import message_bytes, pair_first_round
    first = _First(tr)
    vec = np.arange(nbytes, dtype=np.uint8)
    names = [f"f{i}" for i in range(len(values))]
    if kind == "one_shot":
        keep = np.zeros(one_shot_bytes(len(values), tr.size, nbytes), np.uint8)
        return one_shot_first_round(first, values, op="t", vector=vec, keep=keep, timeout=timeout, names=names)
    if kind == "ring_head":
        keep = np.zeros(RingHead.need(len(values), 64, 0), np.uint8)
        head = RingHead(first, values, op="t", capacity=64, keep=keep, send_joined=False, recv_joined=False,
                        names=names)
        return head.check_alone((tr.rank - 1) % tr.size, (tr.rank + 1) % tr.size, timeout)
    buf = [np.zeros(message_bytes(len(values), 64, nbytes), np.uint8) for _ in range(2)]
    return pair_first_round(first, values, op="t", capacity=64, sendbuf=buf[0], recvbuf=buf[1], vector=vec,
                            timeout=timeout, names=names)


@pytest.mark.parametrize("kind,n", [("one_shot", 3), ("ring_head", 2), ("ring_head", 3), ("pair", 2)])
def test_first_round_aborted_by_a_refusal_is_not_a_size_mismatch(kind, n):
    """A first round's receive failed by a relayed refusal (``abort_tags`` with the
    master's reason) raises that refusal, not a size refusal of this rank's own
    (which the elastic peer would report as a second ``refuse``); a message of
    another size still raises the size refusal (NeighbourRefusal), on the ranks
    that received it."""
    from commlib.collectives.agreement import NeighbourRefusal
    with tcp_group(n, 1) as ts:
        _warm(ts)
        for t in ts:
            t.begin_operation(5)
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("e", _catch(lambda: _first_round(kind, ts[1], [1, 2, 3],
                                                                                             4096))))
        th.start()
        wait_until(lambda: _posted(ts[1]), what="rank 1's first-round receive posted")  # nobody else calls
        data, first = ts[1].operation_tags(5)
        ts[1].abort_tags((*data, *first), lambda t: commlib.InvalidArgument("refused by the master", rank=1, op="t"))
        th.join(20)
        exc = out["e"]
        assert isinstance(exc, commlib.InvalidArgument) and not isinstance(exc, NeighbourRefusal), repr(exc)
        assert "refused by the master" in str(exc)
    with tcp_group(n, 1) as ts:
        _warm(ts)
        for t in ts:
            t.begin_operation(5)
        # rank 0's message is longer: a longer vector (one-shot, pair), a longer row (ring head)
        values = [[1, 2, 3, 4] if r == 0 and kind == "ring_head" else [1, 2, 3] for r in range(n)]
        got = run_all(list(range(n)), lambda r: _catch(lambda: _first_round(kind, ts[r], values[r],
                                                                            4096 + 8 * (r == 0), timeout=3)))
        if kind == "pair":  # both ranks judge the bare rows: the same refusal on both
            assert all(isinstance(e, commlib.InvalidArgument) and "differ" in str(e) for e in got), got
        else:  # rank 0's right neighbour receives its message, rank 0 rank n - 1's (rank 2 of a
            # one-shot may wait for rank 0's second step, which never comes: a timeout)
            for r in (0, 1):
                # (its head shows the sender's row: the fields that differ, or that the
                # message's form differs where the rows agree)
                assert isinstance(got[r], NeighbourRefusal) and "the calls differ" in str(got[r]), (r, got[r])


def _catch(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_send_frame_bounds_the_wait_for_another_writer():
    """A send with a timeout counts the wait for the connection's lock (held by
    another writer: the heartbeat's ping to a master that reads nothing) against
    it: TimeoutError within the bound, nothing written, the connection left open
    and usable once the other writer is done."""
    ca, cb = _connection_pair()
    try:
        ca.lock.acquire()  # another writer, stuck
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="another write held the connection"):
            ca.send_ctrl({"t": "late"}, timeout=1.0)
        dt = time.monotonic() - t0
        assert 1.0 <= dt <= 1.5, dt
        assert not ca.closed
        ca.lock.release()
        ca.send_ctrl({"t": "on time"}, timeout=5.0)
        kind, _, msg = cb.read_ctrl(deadline=time.monotonic() + 10)
        assert kind == tcp.K_CTRL and msg == {"t": "on time"}  # the timed-out frame never went out
    finally:
        ca.close()
        cb.close()
