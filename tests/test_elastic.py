"""Elastic peers (commlib.elastic) on loopback, in one process: membership,
all-reduce bit parity (plain, fp16, int8), shared-state sync, the CLI.

Oracles: the reduction recomputed in float64 from the seeds (plain sum must be
exact to rounding), SHA-256 of every peer's result (bit parity), SHA-256 of the
synced state against the donor's.
"""
import hashlib
import threading

import numpy as np
import pytest

import commlib
import commlib.elastic as el
from commlib.collectives.one_round import small_capacity
from commlib.collectives.allreduce_ring import PAIR_BYTES
from commlib.collectives.allreduce_tcp import TcpPlans
from commlib.collectives.specs import choose_tcp_allreduce
from oracles import ring_oracle  # tests/ is on the path (rootdir conftest)
from seeds import test_seed
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)

SECRET = b"test-secret-0123456789abcdef"


def _h(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def run_outcomes(peers, fn, timeout=60):
    """Run ``fn(i, peer)`` on every peer at once; returns ``[(result, exception, seconds)]``
    (one of result and exception None).  Fails when a peer is still running after ``timeout``."""
    import time

    res = [None] * len(peers)

    def go(i):
        t0 = time.monotonic()
        try:
            res[i] = (fn(i, peers[i]), None, time.monotonic() - t0)
        except BaseException as exc:  # noqa: BLE001
            res[i] = (None, exc, time.monotonic() - t0)

    ths = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(peers))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout)
    assert not any(t.is_alive() for t in ths), "a peer hung"
    return res


def run_peers(peers, fn, timeout=60):
    """:func:`run_outcomes`, raising the first peer's exception; returns the results."""
    out = run_outcomes(peers, fn, timeout)
    for _, e, _ in out:
        if e is not None:
            raise e
    return [r for r, _, _ in out]


def form(peers, n, timeout=30.0):
    """Every peer calls update_topology until the group has ``n`` members (a
    joiner whose vote arrives after the members' vote enters at the next one).
    Returns each peer's first return value."""
    import time

    def fn(i, p):
        deadline = time.monotonic() + timeout
        first = p.update_topology()
        while p.size != n:
            assert time.monotonic() < deadline, "the group did not form"
            p.update_topology()
        return first

    return run_peers(peers, fn)


@pytest.fixture
def group(request):
    n, streams = request.param if hasattr(request, "param") else (3, 2)
    master = el.Master(secret=SECRET).start()
    peers = [el.connect(master.address, secret=SECRET, streams=streams, timeout=20) for _ in range(n)]
    form(peers, n)
    yield master, peers
    for p in peers:
        p.close()
    master.stop()


@pytest.mark.parametrize("group", [(2, 1), (3, 2), (4, 4)], indirect=True)
@pytest.mark.parametrize("count", [0, 1, 5, 1000, 300_001])
def test_allreduce_sum_parity(group, count):
    _, peers = group
    assert sorted(p.rank for p in peers) == list(range(len(peers)))
    data = {p.id: np.random.default_rng(p.id).standard_normal(count).astype(np.float32) for p in peers}

    def fn(i, p):
        b = data[p.id].copy()
        assert p.allreduce(b, "sum") is b
        return b

    out = run_peers(peers, fn)
    assert len({_h(o) for o in out}) == 1
    ref = np.sum([data[i].astype(np.float64) for i in sorted(data)], axis=0)
    np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("op", ["avg", "min", "max", "prod"])
def test_allreduce_ops(group, op):
    _, peers = group
    data = {p.id: np.random.default_rng(p.id).uniform(0.5, 1.5, 4097) for p in peers}
    out = run_peers(peers, lambda i, p: p.allreduce(data[p.id].copy(), op))
    assert len({_h(o) for o in out}) == 1
    stack = np.stack([data[i] for i in sorted(data)])
    ref = {"avg": stack.mean(0), "min": stack.min(0), "max": stack.max(0), "prod": stack.prod(0)}[op]
    np.testing.assert_allclose(out[0], ref, rtol=1e-12)


def quantized_error_bound(inputs, quantize, op="avg"):
    """Per-element bound of a quantized all-reduce's error against the exact
    reduction, from the wire format (transports/quantize.py) and the rounds each
    element goes through; ``inputs``: float32 vectors in rank order.

    int8: a message carries ``q = rint(x / s)`` with one step ``s = max|x| / 127``
    per message, so one round moves an element by at most ``s / 2``, where the
    message's max includes the errors of the rounds before.  fp16: a round moves
    an element ``v`` by at most ``2**-11 |v|`` (and ``2**-25`` below the normal range).

    Rounds: at 2 ranks up to ``PAIR_BYTES`` each rank's whole vector is one
    message (one round per input, none after the reduction).  Otherwise the ring
    (chunks as ``numpy.array_split``): the partial sums of chunk ``c`` go round
    from rank ``c + 1``, one round per send (``n - 1``), each rank adding its
    input; rank ``c`` adds its own and (``avg``) divides by ``n``; the all-gather
    quantizes the result once more (forwarded bytes are exact).  Plus float32
    rounding of the sums, the divisions and the products (``8 n 2**-24 sum|x|``)."""
    n, x = len(inputs), [np.asarray(a, np.float64).ravel() for a in inputs]
    div = n if op == "avg" else 1

    def round_err(v, err):  # the most one round moves the elements of message v (already err off)
        if quantize == "int8":
            return np.full(v.shape, (np.max(np.abs(v)) + np.max(err, initial=0.0)) / 127 / 2 if v.size else 0.0)
        return 2.0 ** -11 * (np.abs(v) + err) + 2.0 ** -25

    if n == 2 and inputs[0].nbytes <= PAIR_BYTES:
        bound = sum(round_err(v, np.zeros_like(v)) for v in x) / div
    else:
        bound = np.empty(x[0].size)
        for c, idx in enumerate(np.array_split(np.arange(x[0].size), n)):
            partial, err = np.zeros(idx.size), np.zeros(idx.size)
            for k in range(n - 1):  # the reduce-scatter's sends of chunk c
                partial = partial + x[(c + 1 + k) % n][idx]
                err = err + round_err(partial, err)
            total, err = (partial + x[c][idx]) / div, err / div
            bound[idx] = err + round_err(total, err)  # the all-gather's round
    return bound + 8 * n * 2.0 ** -24 * sum(np.abs(v) for v in x)


@pytest.mark.parametrize("group,shape", [((2, 1), (37, 101)), ((2, 1), (70_001,)), ((3, 2), (37, 101)),
                                         ((4, 4), (1009,)), ((4, 4), (0,))],
                         indirect=["group"], ids=["2-pair", "2-ring", "3-ring", "4-ring", "4-empty"])
@pytest.mark.parametrize("quantize", ["fp16", "int8"])
def test_allreduce_quantized_bit_identical(group, shape, quantize):
    """Quantized all-reduces ("avg") end bit-identical on every peer, each element
    within its bound (:func:`quantized_error_bound`: half a quantization step per
    round it went through); a dequantization 10% off fails it
    (tests/mutations/15-int8-dequantize-scale.patch)."""
    _, peers = group
    data = {p.rank: np.random.default_rng(p.id).standard_normal(shape).astype(np.float32) for p in peers}
    data[0].reshape(-1)[:3] *= 50  # large elements in chunk 0 only: its step grows, its bound with it
    out = run_peers(peers, lambda i, p: p.allreduce(data[p.rank].copy(), "avg", quantize=quantize))
    assert len({_h(o) for o in out}) == 1, "quantized results differ between peers"
    inputs = [data[r] for r in range(len(peers))]
    ref = np.mean([a.astype(np.float64) for a in inputs], axis=0)
    err = np.abs(out[0].astype(np.float64) - ref).ravel()
    bound = quantized_error_bound(inputs, quantize)
    worst = int(np.argmax(err - bound)) if err.size else 0
    assert np.all(err <= bound), (f"element {worst}: error {err[worst]:.3g} > bound {bound[worst]:.3g} "
                                  f"(ref {ref.ravel()[worst]:.4g})")


def _ring_messages(count, itemsize, n, r, received=False):
    """Byte sizes of the messages rank ``r`` sends (``received``: receives) in a ring
    all-reduce of ``count`` items over ``n`` ranks: reduce-scatter step s sends chunk
    r-s-1, the all-gather chunk r-s; rank r receives what rank r-1 sends; chunks as
    numpy.array_split cuts them.  At 2 ranks an unquantized all-reduce of at most
    ``PAIR_EXCHANGE_MAX`` bytes sends none: its vector travels whole in the first
    round (:func:`_pair_round_bytes`).  Between loopback addresses the first
    reduce-scatter chunk travels in the first round too, behind the header row
    (:func:`_ring_first_round_bytes`): left out here."""
    if n == 2 and count * itemsize <= el.PAIR_EXCHANGE_MAX:
        return []
    if received:
        r = (r - 1) % n
    sizes = [len(c) * itemsize for c in np.array_split(np.arange(count), n)]
    return [sizes[(r - s - 1) % n] for s in range(1, n - 1)] + [sizes[(r - s) % n] for s in range(n - 1)]


def _ring_first_round_bytes(count, itemsize, n, r, received=False):
    """The first-round message of a ring all-reduce between loopback addresses
    (collectives/agreement.py, RingHead): the header row (48 bytes and the small-call
    area of ``small_capacity(n)``, padded to 64 bytes), then the first chunk rank
    ``r`` sends (``received``: the one it receives from ``r - 1``)."""
    if received:
        r = (r - 1) % n
    sizes = [len(c) * itemsize for c in np.array_split(np.arange(count), n)]
    return -(-(48 + small_capacity(n)) // 64) * 64 + sizes[(r - 1) % n]


def _rd_messages(count, itemsize, n, r, received=False):
    """Byte sizes of the messages rank ``r`` sends (``received``: receives) in a
    recursive-doubling all-reduce of ``count`` items over ``n`` ranks (MPICH's
    scheme, collectives/allreduce_recursive_doubling.py): with ``p2`` the largest
    power of two <= n and ``rem = n - p2``, even ranks below ``2 rem`` send their
    vector to ``r + 1`` and get the result back at the end; every other rank makes
    ``log2(p2)`` whole-vector exchanges, and odd ranks below ``2 rem`` also receive
    the fold-in and send the result back."""
    nbytes = count * itemsize
    p2 = 1 << (n.bit_length() - 1)
    rem, k = n - p2, p2.bit_length() - 1
    if r < 2 * rem and r % 2 == 0:
        return [nbytes]
    return [nbytes] * (k + (1 if r < 2 * rem else 0))


def _data_messages(count, itemsize, n, r, received=False):
    """The data plane's messages of an unquantized all-reduce: the algorithm
    :func:`commlib.collectives.specs.choose_tcp_allreduce` picks (the first round's
    aside: a small or 2-peer call sends none on the data plane)."""
    algo = choose_tcp_allreduce(count * itemsize, n, False)
    if algo == "recursive_doubling":
        return _rd_messages(count, itemsize, n, r, received)
    if algo == "ring":
        return _ring_messages(count, itemsize, n, r, received)
    return []


def _pair_round_bytes(nbytes):
    """At 2 peers, the first-round message of an all-reduce of ``nbytes`` bytes (at
    most PAIR_EXCHANGE_MAX): 48 header bytes, then the vector, or the small-call
    area of ``small_capacity(2)`` bytes, whichever is larger (one frame)."""
    return 48 + max(small_capacity(2), nbytes)


def _frames(nbytes, streams):
    """Frames of one message by the striping rule of docs/elastic-protocol.md."""
    max_frame, stripe_min = 16 << 20, 64 << 10
    return max(-(-nbytes // max_frame), min(streams, -(-nbytes // stripe_min)), 1)


@pytest.mark.parametrize("group", [(2, 1), (3, 2), (4, 1)], indirect=True)
@pytest.mark.parametrize("count,dtype", [(1000, np.float32), (300_001, np.float64)])
def test_stats_count_the_ring_traffic(group, count, dtype):
    """Peer.stats against the algorithm's known traffic, plus 28 bytes of header per
    frame on the wire.  The ring (300_001 float64 on 3-4 peers): 2 (n-1)/n x the
    buffer per peer (exactly the chunk sizes), 2 (n-1) x the buffer over all peers.
    Recursive doubling (1000 float32 on 4 peers, up to RECURSIVE_DOUBLING_TCP_MAX):
    whole-vector messages, log2(n) per peer.  At 2 peers up to 1 MiB the whole
    buffer travels in the first round instead, one message each way (48 header
    bytes and the vector, one frame), and the data plane carries nothing; at 3
    peers up to ONE_SHOT_TCP_MAX likewise, two such messages each way (Bruck's
    all-gather of the header rows and vectors)."""
    _, peers = group
    n = len(peers)
    streams = peers[0].streams
    before = {p.id: p.stats for p in peers}
    run_peers(peers, lambda i, p: p.allreduce(np.ones(count, dtype), "sum"))
    after = {p.id: p.stats for p in peers}
    nbytes = count * np.dtype(dtype).itemsize
    total = 0
    for p in peers:
        d = {k: after[p.id][k] - before[p.id][k] for k in after[p.id]}
        msgs = _data_messages(count, np.dtype(dtype).itemsize, n, p.rank)
        rmsgs = _data_messages(count, np.dtype(dtype).itemsize, n, p.rank, received=True)
        assert d["bytes_sent"] == sum(msgs) and d["bytes_received"] == sum(rmsgs)
        ring = choose_tcp_allreduce(nbytes, n, False) == "ring"
        if ring:  # the first chunk rides behind the header row, in the first round
            fr = _ring_first_round_bytes(count, np.dtype(dtype).itemsize, n, p.rank)
            frr = _ring_first_round_bytes(count, np.dtype(dtype).itemsize, n, p.rank, received=True)
            assert d["first_round_bytes_sent"] == fr and d["first_round_bytes_received"] == frr
            assert d["first_round_wire_bytes_sent"] == fr + 28 and d["first_round_wire_bytes_received"] == frr + 28
            pad = -(-(48 + small_capacity(n)) // 64) * 64
            total += fr - pad
            for k, first in (("bytes_sent", fr - pad), ("bytes_received", frr - pad)):
                assert abs(d[k] + first - 2 * (n - 1) / n * nbytes) <= 2 * (n - 1) * np.dtype(dtype).itemsize
        assert d["wire_bytes_sent"] == sum(msgs) + 28 * sum(_frames(m, streams) for m in msgs)
        assert d["wire_bytes_received"] == sum(rmsgs) + 28 * sum(_frames(m, streams) for m in rmsgs)
        assert d["bytes_buffered"] <= d["bytes_received"]
        assert d["retries"] == d["aborts"] == 0
        total += d["bytes_sent"]
        if n == 2 and nbytes <= el.PAIR_EXCHANGE_MAX:
            m = _pair_round_bytes(nbytes)
            assert d["first_round_bytes_sent"] == d["first_round_bytes_received"] == m
            assert d["first_round_wire_bytes_sent"] == d["first_round_wire_bytes_received"] == m + 28
            total += m - 48
        one_shot = choose_tcp_allreduce(nbytes, n, False) == "one_shot"
        if one_shot:  # n - 1 messages each way, one frame each: 48 header bytes and a vector
            m = 48 + nbytes
            assert d["first_round_bytes_sent"] == d["first_round_bytes_received"] == (n - 1) * m
            assert d["first_round_wire_bytes_sent"] == d["first_round_wire_bytes_received"] == (n - 1) * (m + 28)
            total += (n - 1) * nbytes
    if ring or n == 2:
        assert total == 2 * (n - 1) * nbytes
    elif one_shot:  # every peer's vector to every other peer
        assert total == n * (n - 1) * nbytes
    else:  # recursive doubling: n log2(n) vectors at 4 peers
        assert total == {4: 8}[n] * nbytes


def test_stats_encrypted_and_auto_streams():
    """With encrypt=True each frame adds a 16-byte AES-GCM tag on the wire (a ring
    call's frames and a one-shot call's gather-sent ones, whose result must still be
    the ring order's); with the default streams=None, peers on loopback use one
    connection per pair."""
    master = el.Master(secret=SECRET, encrypt=True).start()
    peers = [el.connect(master.address, secret=SECRET, timeout=20, encrypt=True) for _ in range(3)]
    try:
        form(peers, 3)
        count = 1 << 18
        before = {p.id: p.stats for p in peers}
        out = run_peers(peers, lambda i, p: p.allreduce(np.full(count, p.rank + 1.0, np.float32), "sum"))
        assert all(np.all(o == 6.0) for o in out)
        for p in peers:
            d = {k: p.stats[k] - before[p.id][k] for k in before[p.id]}
            msgs = _ring_messages(count, 4, 3, p.rank)
            assert d["bytes_sent"] == sum(msgs)
            assert d["wire_bytes_sent"] == sum(msgs) + (28 + 16) * sum(_frames(m, 1) for m in msgs)
            links = p._tr._links
            assert links and all(len(link.conns) == 1 for link in links.values())
        # a one-shot call, sealed: two gather-sent frames of header row and vector each way
        count = 25_000
        data = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(3)]
        before = {p.id: p.stats for p in peers}
        out = run_peers(peers, lambda i, p: p.allreduce(data[p.rank].copy(), "sum"))
        assert all(_h(o) == _h(ring_oracle(data, "sum")) for o in out)
        for p in peers:
            d = {k: p.stats[k] - before[p.id][k] for k in before[p.id]}
            assert d["bytes_sent"] == 0 and d["first_round_bytes_sent"] == 2 * (48 + 4 * count)
            assert d["first_round_wire_bytes_sent"] == 2 * (48 + 4 * count + 28 + 16)
    finally:
        for p in peers:
            p.close()
        master.stop()


def test_stats_survive_epochs():
    """Counts of a past epoch's transport stay in Peer.stats after a new epoch begins."""
    master = el.Master(secret=SECRET).start()
    a, b = (el.connect(master.address, secret=SECRET, streams=1, timeout=20) for _ in range(2))
    c = None
    try:
        form([a, b], 2)
        run_peers([a, b], lambda i, p: p.allreduce(np.ones(1000, np.float32)))
        first = a.stats["first_round_bytes_sent"]
        assert first == _pair_round_bytes(4000)  # at 2 peers the vector goes in the first round
        c = el.connect(master.address, secret=SECRET, streams=1, timeout=20)
        form([a, b, c], 3)
        run_peers([a, b, c], lambda i, p: p.allreduce(np.ones(999, np.float32)))
        assert a.stats["bytes_sent"] == sum(_data_messages(999, 4, 3, a.rank))
        # one-shot at 3 peers: Bruck's 2 steps, each the header row and the vector
        assert choose_tcp_allreduce(999 * 4, 3, False) == "one_shot"
        assert a.stats["first_round_bytes_sent"] == first + 2 * (48 + 999 * 4)
    finally:
        for p in (a, b, c):
            if p is not None:
                p.close()
        master.stop()


def test_bad_arguments(group):
    _, peers = group
    p = peers[0]
    with pytest.raises(commlib.InvalidArgument):
        p.allreduce(np.zeros(4, np.float32), op="bogus")
    with pytest.raises(commlib.InvalidArgument):
        p.allreduce(np.zeros(4, np.int32), quantize="int8")
    with pytest.raises(commlib.InvalidArgument):
        p.allreduce(np.zeros((4, 4))[:, 0])
    assert issubclass(el.PeerFailure, commlib.CommError) and issubclass(el.AuthError, commlib.CommError)


def test_join_at_step_boundary_and_sync():
    master = el.Master(secret=SECRET).start()
    try:
        a, b = (el.connect(master.address, secret=SECRET, streams=2, timeout=20) for _ in range(2))
        form([a, b], 2)
        assert (a.size, b.size) == (2, 2)
        state = {"w": np.arange(50_000, dtype=np.float32), "b": np.ones(7)}
        c = el.connect(master.address, secret=SECRET, streams=2, timeout=20)
        assert c.rank is None
        peers = [a, b, c]
        changed = form(peers, 3)
        assert changed[2] is True and {p.size for p in peers} == {3}
        states = [{k: v.copy() for k, v in state.items()}, {k: v.copy() for k, v in state.items()},
                  {"w": np.zeros(50_000, np.float32)}]
        res = run_peers(peers, lambda i, p: p.sync_shared_state(states[i], 7 if i < 2 else 0))
        assert [r["bytes_received"] for r in res[:2]] == [0, 0]
        assert res[2]["bytes_received"] == state["w"].nbytes + state["b"].nbytes
        assert res[2]["donor"] in (a.id, b.id) and {r["revision"] for r in res} == {7}
        for s in states:
            assert {k: _h(v) for k, v in s.items()} == {k: _h(v) for k, v in state.items()}
        # in sync: nobody receives a byte
        res = run_peers(peers, lambda i, p: p.sync_shared_state(states[i], 7))
        assert [r["bytes_received"] for r in res] == [0, 0, 0]
        assert run_peers(peers, lambda i, p: p.update_topology()) == [False, False, False]
        for p in peers:
            p.close()
    finally:
        master.stop()


def test_cli_master_help(capsys):
    """``commlib master --help`` explains the probe options; a bad
    ``--probe-timeout`` is one line on stderr and exit status 2."""
    from commlib.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["master", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--probe-timeout" in out and "--no-probe" in out
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as exc:
            main(["master", "--probe-timeout", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "--probe-timeout" in err[-1], err


# ---------------------------------------------------------------- one group per master
def _wait_for(pred, timeout=10.0, what="condition"):
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _in_thread(fn):
    box = {}

    def go():
        try:
            box["v"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["e"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()

    def result(timeout=20.0):
        t.join(timeout)
        assert not t.is_alive(), "hung"
        if "e" in box:
            raise box["e"]
        return box.get("v")

    return result


@pytest.mark.timeout(30)
def test_joiner_mid_vote_member_dies_one_group():
    """A joiner votes while two members wait in the vote for a third, which then dies
    (its connection drops, as on SIGKILL): the survivors and the joiner come out of
    that one vote in one epoch, and the master serves exactly that group."""
    master = el.Master(secret=SECRET, heartbeat_timeout=2.0).start()
    try:
        a, b, c = (el.connect(master.address, secret=SECRET, streams=2, timeout=15) for _ in range(3))
        form([a, b, c], 3)
        assert master.groups() == [sorted([a.id, b.id, c.id])]
        ra, rb = _in_thread(a.update_topology), _in_thread(b.update_topology)
        _wait_for(lambda: {a.id, b.id} <= master._voters, what="the members' votes")
        j = el.connect(master.address, secret=SECRET, streams=2, timeout=15)
        rj = _in_thread(j.update_topology)
        _wait_for(lambda: j.id in master._peers and master._peers[j.id].waiting, what="the joiner's vote")
        master.groups()                      # mid-vote: the joiner is pending, nothing else moved
        c._conn.close()                      # c dies in the vote (no goodbye)
        assert [ra(), rb(), rj()] == [True, True, True]
        want = sorted([a.id, b.id, j.id])
        assert master.groups() == [want]
        assert {p.epoch for p in (a, b, j)} == {master.epoch}
        assert all(sorted(p.members) == want for p in (a, b, j))
        data = {p.id: np.arange(1000, dtype=np.int64) * p.id for p in (a, b, j)}
        out = run_peers([a, b, j], lambda i, p: p.allreduce(data[p.id].copy(), "sum"))
        assert len({_h(o) for o in out}) == 1
        np.testing.assert_array_equal(out[0], np.arange(1000, dtype=np.int64) * sum(want))
        for p in (a, b, j, c):
            p.close()
    finally:
        master.stop()


@pytest.mark.timeout(30)
def test_joiner_after_last_member_left_cannot_fork_the_job():
    """The churn-run split brain: the last members vote for the last time, a joiner
    arrives, the members leave; the joiner, alone, must not start a second history
    from scratch under the same master.  Its first sync is refused (no live peer holds
    the job's state); a peer that does hold it (a member that had been dropped,
    rejoining) heals the job, and the joiner fetches the state from it."""
    master = el.Master(secret=SECRET).start()
    try:
        a, b = (el.connect(master.address, secret=SECRET, streams=2, timeout=15) for _ in range(2))
        form([a, b], 2)
        state = {"w": np.arange(4096, dtype=np.float32)}
        run_peers([a, b], lambda i, p: p.update_topology())           # the final vote
        run_peers([a, b], lambda i, p: p.sync_shared_state({k: v.copy() for k, v in state.items()}, 30))
        j = el.connect(master.address, secret=SECRET, streams=2, timeout=15)
        rj = _in_thread(j.update_topology)
        _wait_for(lambda: j.id in master._peers and master._peers[j.id].waiting, what="the joiner's vote")
        a.close()
        b.close()
        assert rj() is True                                              # j forms a group alone ...
        assert master.groups() == [[j.id]]
        fresh = {"w": np.zeros(4096, np.float32)}
        with pytest.raises(commlib.CommError, match="held by no live peer"):
            j.sync_shared_state(fresh, 0)                                # ... but cannot fork the job
        assert master.revision == 30
        # a peer holding revision 30 comes back: one group again, and the joiner catches up
        r = el.connect(master.address, secret=SECRET, streams=2, timeout=15)
        form([j, r], 2)
        assert master.groups() == [sorted([j.id, r.id])]
        states = [fresh, {k: v.copy() for k, v in state.items()}]
        res = run_peers([j, r], lambda i, p: p.sync_shared_state(states[i], [0, 30][i]))
        assert res[0]["bytes_received"] == state["w"].nbytes and res[0]["donor"] == r.id
        assert _h(states[0]["w"]) == _h(state["w"])
        for p in (j, r):
            p.close()
    finally:
        master.stop()


@pytest.mark.timeout(30)
def test_first_group_still_forms_from_pending_peers():
    """No state was ever synced: pending peers alone form the first group and sync."""
    master = el.Master(secret=SECRET).start()
    try:
        a, b = (el.connect(master.address, secret=SECRET, streams=1, timeout=15) for _ in range(2))
        form([a, b], 2)
        res = run_peers([a, b], lambda i, p: p.sync_shared_state({"w": np.full(10, float(i))}, i))
        assert {r["revision"] for r in res} == {1}
        a.close()
        b.close()
    finally:
        master.stop()


@pytest.mark.timeout(30)
def test_heartbeat_survives_a_starved_master(tmp_path):
    """The master process is not scheduled for 3 s (SIGSTOP), three times its 1 s
    heartbeat timeout: when it runs again it must not declare its live peers dead
    (their silence was its own), and the job goes on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    port = __import__("socket").socket()
    port.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "commlib.cli", "master", "--bind", addr, "--secret-file",
                             str(secret), "--heartbeat-timeout", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert b"listening" in proc.stdout.readline()
        a, b = (el.connect(addr, secret=SECRET, streams=1, timeout=15) for _ in range(2))
        form([a, b], 2)
        epoch = a.epoch
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        proc.send_signal(signal.SIGCONT)
        time.sleep(1.5)                      # a monitor that wrongly counted the stall has acted by now
        assert a._lost is None and b._lost is None, "the master dropped live peers after its own stall"
        assert run_peers([a, b], lambda i, p: p.update_topology()) == [False, False]
        out = run_peers([a, b], lambda i, p: p.allreduce(np.full(8, i + 1.0), "sum"))
        assert out[0].tolist() == [3.0] * 8 and a.epoch == epoch
        a.close()
        b.close()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_bench_elastic_command_line():
    """benchmarks/bench_elastic.py: every option has a help text with its default;
    bad values exit 2 with one line on stderr and no output (nothing runs)."""
    import os
    import subprocess
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                         "bench_elastic.py")
    r = subprocess.run([sys.executable, "-P", bench, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    opts = ["--sections", "--peers", "--min-bytes", "--max-bytes", "--trials", "--streams", "--wan-latency-ms",
            "--wan-rate-mbps", "--wan-bytes", "--kill-trials", "--diloco-steps", "--timeout", "--json", "--plot"]
    text = " ".join(r.stdout.split())
    for o in opts:
        i = text.index(o + " ", text.index("options:"))
        assert "default:" in text[i:i + 400], o
    for bad in (["--peers", "1"], ["--min-bytes", "-3"], ["--streams", "0"], ["--sections", "foo"],
                ["--trials", "x"], ["--timeout", "nan"], ["--wan-rate-mbps", "0"],
                ["--min-bytes", "100", "--max-bytes", "10"], ["--json", "/nonexistent-dir/x.json"]):
        r = subprocess.run([sys.executable, "-P", bench] + bad, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, bad
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)
        assert "error:" in r.stderr


@pytest.mark.parametrize("n", [2, 3])
def test_bench_socket_floor_ring_is_a_correct_allreduce(tmp_path, n):
    """The benchmark's plain-socket floor (worker_sockring) must run the same ring and
    reduce correctly: every worker checks its warm-up all-reduce of ones equals n
    (a wrong chunk order or a lost step fails that check and the worker exits non-zero),
    sizes not divisible by n included."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import bench_elastic as be
    finally:
        sys.path.pop(0)
    sizes = [4, 12, 4096, 65540]
    res = be.run_sockring(str(tmp_path), n, sizes, 1, 120)
    assert res["peers"] == n
    assert [row["bytes"] for row in res["rows"]] == sizes
    assert all(row["time_s"] > 0 for row in res["rows"])


def test_ab_harness_paired_verdict():
    """benchmarks/ab_elastic.py's paired summary: after = before * c in every
    repetition gives a median paired speed of exactly 1/c and the verdict of its
    side of 1; repetitions that straddle 1 are "within the spread"; under 4
    repetitions no verdict is given."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import ab_elastic as ab
    finally:
        sys.path.pop(0)
    rng = np.random.default_rng(7)
    before = list(rng.uniform(500, 5000, 9))
    for c, verdict in ((0.8, "faster"), (1.25, "slower")):
        out = ab.paired_summary(before, [b * c for b in before])
        assert out == f"paired {1 / c:.2f}x [{1 / c:.2f}, {1 / c:.2f}] {verdict}", out
    mixed = [b * f for b, f in zip(before, (0.9, 1.1, 0.95, 1.05, 1.0, 0.97, 1.03, 0.92, 1.08))]
    assert ab.paired_summary(before, mixed).endswith("within the spread")
    assert ab.paired_summary(before[:3], before[:3]) == "paired 1.00x"


@pytest.mark.parametrize("group", [(2, 2)], indirect=True)
@pytest.mark.parametrize("op", ["sum", "min", "max", "prod", "avg"])
def test_pair_allreduce_one_operand_order_on_both_peers(group, op):
    """At 2 peers the all-reduce is one exchange and a combine on each side: both
    must compute ``x0 (op) x1`` with rank 0's vector on the left, so NaNs with
    different payloads and signed zeros give the same bits on both peers. Oracle:
    numpy's ufunc on the two inputs in rank order (avg: the sum halved)."""
    _, peers = group
    nan_a = np.frombuffer(np.uint32(0x7FC00001).tobytes(), np.float32)[0]
    nan_b = np.frombuffer(np.uint32(0xFFC12345).tobytes(), np.float32)[0]
    data = {}
    for p in peers:
        x = np.random.default_rng(p.rank).standard_normal(10_001).astype(np.float32)
        x[:4] = [nan_a, 0.0, -0.0, 1.0] if p.rank == 0 else [nan_b, -0.0, 0.0, nan_a]
        data[p.rank] = x
    out = run_peers(peers, lambda i, p: (p.rank, p.allreduce(data[p.rank].copy(), op)))
    assert len({_h(o) for _, o in out}) == 1, "the two peers hold different bits"
    ufunc = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]
    ref = ufunc(data[0], data[1])
    if op == "avg":
        ref = ref / np.float32(2)
    assert _h(out[0][1]) == _h(ref)


@pytest.mark.parametrize("group", [(3, 2)], indirect=True)
@pytest.mark.parametrize("op", ["sum", "min", "max", "prod", "avg"])
@pytest.mark.parametrize("count", [300, 10_001, 65_536])
def test_one_shot_allreduce_holds_the_ring_order_on_every_peer(group, op, count):
    """At 3 peers up to ONE_SHOT_TCP_MAX bytes the all-reduce is one-shot: the first
    round all-gathers every peer's header row and whole vector, and each peer
    reduces the three itself.  Each must compute the ring's reduction order, so the
    peers hold the same bits, NaNs with different payloads and signed zeros
    included, and a one-shot call gives what a ring call of the same data would.
    Oracle: tests/oracles.py's ring_oracle on the inputs in rank order.  Nothing
    moves on the data plane."""
    _, peers = group
    assert choose_tcp_allreduce(count * 4, 3, False) == "one_shot"
    nan_a = np.frombuffer(np.uint32(0x7FC00001).tobytes(), np.float32)[0]
    nan_b = np.frombuffer(np.uint32(0xFFC12345).tobytes(), np.float32)[0]
    data = {}
    for p in peers:
        x = np.random.default_rng(p.rank).standard_normal(count).astype(np.float32)
        x[:4] = ([nan_a, 0.0, -0.0, 1.0], [nan_b, -0.0, 0.0, nan_a], [1.0, -0.0, -0.0, nan_b])[p.rank]
        x[-3:] = (0.0, -0.0, 3.0) if p.rank else (-0.0, 0.0, nan_b)  # the last chunk too
        data[p.rank] = x
    before = [p.stats for p in peers]
    out = run_peers(peers, lambda i, p: (p.rank, p.allreduce(data[p.rank].copy(), op)))
    assert len({_h(o) for _, o in out}) == 1, "the peers hold different bits"
    assert _h(out[0][1]) == _h(ring_oracle([data[r] for r in range(3)], op))
    assert all(p.stats["bytes_sent"] == b["bytes_sent"] for p, b in zip(peers, before))


@pytest.mark.parametrize("group", [(3, 2)], indirect=True)
def test_ring_head_plan_reused_only_for_the_same_call(group):
    """The ring's first round is a cached plan (the engine's plan cache of the
    all-reduce row's TCP path, collectives/allreduce_tcp.py): a ring-sized call
    with the same header on the same epoch reuses it, with a fresh tag; any other
    header builds a new one.  A sequence that interleaves the same ring call with a
    one-shot call and a refused one (whose first rounds write another scratch: each
    peer holds a different header there after the refusal), other dtypes, ops and
    counts of the same bytes, and a refused ring call gives the ring_oracle bits on
    every peer each time; the refused calls leave every buffer as they were."""
    _, peers = group
    count = 300_000  # 1.2 MB of float32: the ring at 3 peers
    assert choose_tcp_allreduce(count * 4, 3, False) == "ring"
    rng = np.random.default_rng(11)
    calls = [(np.float32, count, "sum"), (np.float32, 10_000, "sum"), "refused one-shot", (np.float32, count, "sum"),
             (np.float64, count // 2, "sum"), (np.float32, count, "max"), (np.int32, count, "sum"),
             "refused", (np.float32, count, "sum"), (np.float32, count, "sum")]
    heads = []
    for call in calls:
        if call.__class__ is str:
            # refused: rank 0's count (ring: its head row) or op (one-shot: every peer then
            # holds another peer's header in its first-round scratch) differs
            n = count if call == "refused" else 10_000
            data = {r: rng.standard_normal(n + (r == 0 and call == "refused")).astype(np.float32) for r in range(3)}
            bufs = {r: data[r].copy() for r in range(3)}
            ops = {r: "max" if r == 0 and call != "refused" else "sum" for r in range(3)}
            out = run_outcomes(peers, lambda i, p: p.allreduce(bufs[p.rank], ops[p.rank]))
            assert all(isinstance(e, commlib.InvalidArgument) for _, e, _ in out), out
            assert all(_h(bufs[r]) == _h(data[r]) for r in range(3)), "a refused call changed a buffer"
            continue
        dtype, n, op = call
        data = {r: (rng.standard_normal(n) * 100).astype(dtype) for r in range(3)}
        out = run_peers(peers, lambda i, p: (p.rank, p.allreduce(data[p.rank].copy(), op)))
        want = _h(ring_oracle([data[r] for r in range(3)], op))
        assert all(_h(o) == want for _, o in out), f"call {call}: not the ring order's bits"
        plans = {p.rank: p._engine.plan_cache("allreduce", TcpPlans).head_plan for p in peers}
        heads.append({r: plan[2] if plan else None for r, plan in plans.items()})
        if choose_tcp_allreduce(n * np.dtype(dtype).itemsize, 3, False) == "ring":
            # the head spoke under this call's own first-round tags (what a refusal aborts)
            for p in peers:
                assert plans[p.rank][2].tag in p._tr.operation_tags(p._seq - 1)[1], (call, p.rank)
    # one plan is kept: the one-shot call leaves it and the repeated ring call reuses it;
    # each new header (dtype, op, count) makes a new one (peers 1 and 2 made the plan of
    # the calls after the refusal in the refused call, peer 0 in the first of them)
    for r in range(3):
        assert heads[0][r] is heads[1][r] is heads[2][r]
        assert len({id(heads[i][r]) for i in (0, 3, 4, 5, 6)}) == 5
        assert heads[6][r] is heads[7][r]


def test_pair_abort_after_the_exchange_leaves_buf_untouched():
    """A 2-peer all-reduce writes ``buf`` only after the master commits: when the
    other peer has sent its vector but leaves before the commit (its "done" never
    reaches the master), the operation is aborted after the exchange, and the
    survivor's ``buf`` must still hold its input, bit for bit; the retry over the
    survivor alone then returns exactly that input."""

    master = el.Master(secret=SECRET).start()
    peers = [el.connect(master.address, secret=SECRET, streams=1, timeout=20) for _ in range(2)]
    try:
        form(peers, 2)
        gone = peers[1]
        send = gone._send
        reported = threading.Event()

        def withhold_done(msg, *args):
            if msg.get("t") == "done":
                reported.set()  # the exchange is over on this side; the master never hears
                return
            send(msg, *args)

        gone._send = withhold_done
        xs = [np.random.default_rng(5 + r).standard_normal(200_003).astype(np.float32) for r in range(2)]
        bufs = [x.copy() for x in xs]
        done = {}

        def run(r):
            try:
                done[r] = peers[r].allreduce(bufs[r], "sum", timeout=10, retry=(r == 0))
            except Exception as exc:  # noqa: BLE001 - the leaving peer's call fails
                done[r] = exc

        ths = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for th in ths:
            th.start()
        assert reported.wait(30), "the exchange did not finish"
        # the survivor has combined and waits for the verdict: the master holds its "done"
        wait_until(lambda: any(peers[0].id in op["done"] for op in list(master._ops.values())),
                   what="the survivor's done at the master")
        gone.close()
        for th in ths:
            th.join(60)
        assert not any(th.is_alive() for th in ths), "a peer hung"
        assert done[0] is bufs[0]
        assert _h(bufs[0]) == _h(xs[0]), "the survivor's input was not kept"
        st = peers[0].stats
        assert st["aborts"] >= 1 and st["retries"] >= 1
        assert peers[0].size == 1
    finally:
        for p in peers:
            p.close()
        master.stop()


def test_a_calls_messages_to_the_master_are_bounded_by_its_deadline():
    """A call's ``timeout`` is the deadline of the whole call (issue 41, point 3):
    every control message a call sends the master (a sync's digest, its
    ``synced``, its refusal of a bad argument; a collective's report) is bounded
    by what is left of that call's deadline (5 s here), never by the peer's
    ``timeout`` (20 s), and names the call."""
    master = el.Master(secret=SECRET).start()
    peers = [el.connect(master.address, secret=SECRET, streams=1, timeout=20) for _ in range(2)]
    sent = []
    try:
        form(peers, 2)
        for p in peers:
            def record(msg, timeout=None, op="elastic", send=p._send):
                sent.append((msg["t"], timeout, op))
                send(msg, timeout, op)
            p._send = record
        w = np.arange(1000, dtype=np.float32)
        states = [{"w": w.copy()}, {"w": np.zeros(1000, np.float32)}]
        res = run_peers(peers, lambda i, p: p.sync_shared_state(states[i], 7 - 7 * i, timeout=5))
        assert res[1]["bytes_received"] == w.nbytes
        run_peers(peers, lambda i, p: p.allreduce(np.ones(10, np.float32), "sum", timeout=5))
        bad = run_outcomes(peers, lambda i, p: p.sync_shared_state({"w": w.copy()}, "x" if i == 0 else 7,
                                                                   timeout=5))
        assert all(isinstance(e, commlib.InvalidArgument) for _, e, _ in bad), bad
        assert {t for t, _, _ in sent} == {"sync", "synced", "done"}, sent
        assert all(b is not None and 0 < b <= 5 for _, b, _ in sent), sent
        assert {op for _, _, op in sent} == {"sync_shared_state", "allreduce"}, sent
    finally:
        for p in peers:
            p.close()
        master.stop()


def test_master_keeps_a_bounded_record_of_an_epochs_operations(group):
    """The master forgets an operation once every member has its terminal
    message, in the current epoch too: after 300 all-reduces in one epoch it
    holds no open operation and one number for them (before, every operation
    of the epoch stayed until the next epoch and each report walked them all,
    so a call's cost grew with the calls before it: 0.6 ms a call at first,
    9 ms after 7000, bench_elastic's 2-peer worker)."""
    master, peers = group
    epoch = master.epoch
    run_peers(peers, lambda i, p: [p.allreduce(np.ones(8, np.float32)) for _ in range(300)])
    assert master.epoch == epoch and master.stats["completes"] == 300
    with master._lock:
        assert master._ops == {}
        assert master._forgotten == {epoch: (0, 300, set())}
    assert all(not p._terms and not p._refusals for p in peers)  # every verdict taken by its call


class _Rec:
    """A master's peer record whose messages are kept (no connection)."""

    def __init__(self, pid):
        from commlib.elastic.master import _MPeer

        self.p = _MPeer(pid, None, f"127.0.0.1:{9000 + pid}", 1, bytes(32))
        self.sent = []
        self.p.send = self.sent.append

    def terms(self):
        return [(m["s"], m["ok"]) for m in self.sent if m["t"] == "term"]


def test_master_answers_each_report_once_after_forgetting():
    """Driven report by report (no sockets): each member gets exactly one
    ``term`` per operation; a report that arrives after the operation was
    forgotten (it crossed the ``term``) gets nothing and opens nothing;
    operations forgotten out of order are still told from new ones; an epoch's
    record goes with the epoch."""
    from commlib.elastic.protocol import DONE, FAIL, TERM

    assert TERM == "term"
    m = el.Master(secret=SECRET)
    a, b = _Rec(1), _Rec(2)
    m._peers = {1: a.p, 2: b.p}
    m._new_epoch([1, 2], "test")
    e = m.epoch

    def report(rec, s, t=DONE):
        m._handle(rec.p, {"t": t, "e": e, "s": s})

    report(a, 0)
    assert a.terms() == [] and (e, 0) in m._ops
    report(b, 0)
    assert a.terms() == b.terms() == [(0, True)] and m._ops == {}
    report(a, 0)                 # late: crossed its term
    report(b, 0, FAIL)
    assert a.terms() == b.terms() == [(0, True)] and m._ops == {}
    # seq 2 ends before seq 1 (a member gave up on 1 and went on)
    report(a, 1)
    report(a, 2)
    report(b, 2)
    assert b.terms() == [(0, True), (2, True)] and list(m._ops) == [(e, 1)]
    assert m._forgotten[e] == (0, 1, {2})
    report(b, 2)                 # forgotten out of order: still answered already
    assert b.terms() == [(0, True), (2, True)]
    report(b, 1)
    assert sorted(a.terms()) == sorted(b.terms()) == [(0, True), (1, True), (2, True)]
    assert m._ops == {} and m._forgotten[e] == (0, 3, set())
    report(a, 3, FAIL)           # an abort: kept until the next epoch, which it brings
    report(b, 3)
    assert a.terms()[-1] == b.terms()[-1] == (3, False) and len(b.terms()) == 4
    m._new_epoch([1, 2], "test")
    assert m._ops == {} and e not in m._forgotten and e not in m._epoch_members


def test_master_passes_a_given_up_call_on_to_every_other_member():
    """Driven report by report: a member's ``give_up`` reaches every other live
    member (``gave_up``, with the giver's id and cause), refuses the call where it
    is open in the current epoch (every member, the giver included, gets one ``term``),
    sets a new member's first call number past it (``topo``'s ``seq``), and is
    ignored for a call already committed; a malformed one closes the giver."""
    from commlib.elastic.protocol import DONE, GIVE_UP
    from commlib.transports.tcp import FrameError

    m = el.Master(secret=SECRET)
    a, b, c = _Rec(1), _Rec(2), _Rec(3)
    m._peers = {1: a.p, 2: b.p, 3: c.p}
    m._new_epoch([1, 2, 3], "test")
    e = m.epoch
    m._handle(b.p, {"t": DONE, "e": e, "s": 0})           # b is in call 0; c is late
    m._handle(a.p, {"t": GIVE_UP, "s": 0, "kind": "fail", "why": "CommTimeout: 1 s"})
    for rec in (b, c):
        notes = [x for x in rec.sent if x["t"] == "gave_up"]
        assert notes == [{"t": "gave_up", "s": 0, "kind": "fail", "why": "CommTimeout: 1 s", "id": 1}]
    assert not [x for x in a.sent if x["t"] == "gave_up"]
    # the giver too gets the verdict: its answer when it gave up waiting for one
    assert a.terms() == b.terms() == c.terms() == [(0, False)]
    assert m._ops == {} and m.stats["given_up"] == 1
    # a call committed while still held (a member's verdict not yet sent) stays committed
    m._handle(a.p, {"t": DONE, "e": e, "s": 1})
    m._handle(b.p, {"t": DONE, "e": e, "s": 1})
    m._live = lambda ids: [i for i in ids if i != 3]      # c as good as gone: 1 commits on a, b
    m._handle(a.p, {"t": DONE, "e": e, "s": 1})
    assert a.terms()[-1] == b.terms()[-1] == (1, True)
    m._ops[(e, 1)] = {"done": {1, 2}, "term": True, "sent": {1, 2}}
    m._handle(b.p, {"t": GIVE_UP, "s": 1, "kind": "fail", "why": "late"})
    assert [x["s"] for x in a.sent if x["t"] == "gave_up"] == [] and m.stats["given_up"] == 1
    del m._live
    d = _Rec(4)
    m._peers[4] = d.p
    m._new_epoch([1, 2, 3, 4], "test")
    assert [x["seq"] for x in d.sent if x["t"] == "topo"] == [2]
    with pytest.raises(FrameError):
        m._handle(a.p, {"t": GIVE_UP, "s": 2, "kind": "oops", "why": "x"})


def test_sync_leaves_every_member_with_the_same_names_and_bytes(group):
    """A member whose state has a name the job's state lacks ends without it (it used
    to keep it, even at a lower revision); a read-only array whose bytes differ is
    replaced by a new array holding the job's bytes, the caller's array left as it
    was (the fetch into it used to fail as "did not verify (every donor failed or
    lied)"); a read-only array already equal is kept as it is."""
    master, peers = group
    n = len(peers)
    job = {"w": np.arange(1000, dtype=np.float32), "b": np.full(7, 3, np.int64)}
    frozen = np.zeros(1000, np.float32)
    frozen.flags.writeable = False
    same = job["b"].copy()
    same.flags.writeable = False
    states = [{k: v.copy() for k, v in job.items()} for _ in range(n)]
    states[1] = {"w": frozen, "b": same, "extra": np.ones(5)}
    res = run_peers(peers, lambda i, p: p.sync_shared_state(states[i], 9 if i != 1 else 3))
    assert all(r["revision"] == 9 for r in res)
    for st in states:
        assert sorted(st) == ["b", "w"]
        assert all(st[k].dtype == job[k].dtype and np.array_equal(st[k], job[k]) for k in job)
    assert states[1]["w"] is not frozen and not frozen.any()
    assert states[1]["b"] is same


# ---------------------------------------------------------------- admission: the master probes the data address
def _refusing_address():
    """``(socket, "127.0.0.1:port")``: a port bound and never listened on, so every
    connect to it is refused while the socket is held (no other process can take it)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.timeout(120)
def test_unreachable_advertise_is_refused_at_connect_and_costs_the_members_nothing():
    """A joiner whose ``advertise`` resolves but answers nothing (a port nothing
    listens on) used to be admitted; every member's dial to it then failed, and the
    group re-formed epoch after epoch until it left.  The master probes the address
    at admission: the joiner is refused at connect, naming the address and why,
    while two members run steps (vote + all-reduce) that all complete with the right
    sums, in the epoch they started in.  Randomized trials: the join races votes
    and calls at different points."""
    import random
    import time

    seed = test_seed()
    rng = random.Random(seed)
    master = el.Master(secret=SECRET).start()
    dead, bad = _refusing_address()
    try:
        a, b = (el.connect(master.address, secret=SECRET, streams=1, timeout=20) for _ in range(2))
        form([a, b], 2)
        epoch, epochs = master.epoch, master.stats["epochs"]
        steps = 8
        for trial in range(6):
            delay = rng.uniform(0.0, 0.15)
            scale = rng.choice([1, 1000, 70_000])  # small (one round), pair exchange, ring-sized

            def joiner():
                time.sleep(delay)
                try:
                    j = el.connect(master.address, secret=SECRET, streams=1, timeout=20, advertise=bad)
                except commlib.InvalidArgument as exc:
                    return exc
                try:  # admitted (the defect): it joins the members' steps, as a training loop would
                    for _ in range(steps):
                        j.update_topology(timeout=10)
                        j.allreduce(np.zeros(scale), timeout=10)
                except commlib.CommError:
                    pass
                finally:
                    j.close()
                return None

            joined = _in_thread(joiner)

            def member(i, p):
                sums = []
                for k in range(steps):
                    p.update_topology(timeout=20)
                    buf = np.full(scale, float(p.id * (k + 1)))
                    p.allreduce(buf, "sum", timeout=20)
                    sums.append(buf)
                return sums

            out = run_peers([a, b], member)
            err = joined(30)
            where = f"seed {seed}, trial {trial} (join after {delay:.3f} s, {scale} elements)"
            assert isinstance(err, commlib.InvalidArgument), f"{where}: the joiner was admitted"
            assert f"could not dial advertise={bad!r}" in str(err) and "refused" in str(err), str(err)
            for sums in out:
                for k, buf in enumerate(sums):
                    assert np.all(buf == float((a.id + b.id) * (k + 1))), f"{where}: step {k} has a wrong sum"
            assert a.epoch == b.epoch == master.epoch == epoch, f"{where}: the epoch changed"
            assert master.stats["epochs"] == epochs and master.stats["aborts"] == 0, where
            assert a.stats["retries"] == b.stats["retries"] == 0, where
            assert master.groups() == [sorted([a.id, b.id])], where
        assert master.stats["deaths"] == 0 and master.stats["probe_refusals"] == 6
        for p in (a, b):
            p.close()
    finally:
        dead.close()
        master.stop()


@pytest.mark.timeout(60)
def test_advertise_of_the_peers_own_listener_is_admitted():
    """``advertise`` naming the peer's own listener (its ``bind`` address, given
    explicitly) passes the probe: the peer is admitted and works."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    master = el.Master(secret=SECRET).start()
    try:
        a, b = (el.connect(master.address, secret=SECRET, streams=1, timeout=20) for _ in range(2))
        j = el.connect(master.address, secret=SECRET, streams=1, timeout=20, bind=f"127.0.0.1:{port}",
                       advertise=f"127.0.0.1:{port}")
        assert j._listener.address == f"127.0.0.1:{port}"
        form([a, b, j], 3)
        out = run_peers([a, b, j], lambda i, p: p.allreduce(np.full(5000, float(p.id)), "sum"))
        assert all(np.all(o == float(a.id + b.id + j.id)) for o in out)
        assert master.stats["probes"] == 3 and master.stats["probe_refusals"] == 0
        for p in (a, b, j):
            p.close()
    finally:
        master.stop()


@pytest.mark.timeout(60)
def test_advertise_of_another_peers_listener_is_refused():
    """An address that answers with the secret but is another peer's listener (a
    typo'd port on a host running several peers) is refused too: the probe carries
    the joiner's own token, which only its listener answers.  A holder of the secret
    probing a listener with another token gets nothing but the handshake."""
    import os

    from commlib.transports import tcp

    master = el.Master(secret=SECRET).start()
    try:
        a, b = (el.connect(master.address, secret=SECRET, streams=1, timeout=20) for _ in range(2))
        form([a, b], 2)
        epoch = master.epoch
        with pytest.raises(commlib.InvalidArgument, match="not this peer's") as info:
            el.connect(master.address, secret=SECRET, streams=1, timeout=20, advertise=a._listener.address)
        assert f"advertise={a._listener.address!r}" in str(info.value)
        conn = tcp.client_handshake(tcp.open_socket(a._listener.address, 5), SECRET,
                                    {"purpose": "probe", "tok": os.urandom(16)})
        conn.sock.settimeout(5)
        assert conn.sock.recv(1 << 16) == b"", "a listener answered a probe that was not its own"
        conn.close()
        out = run_peers([a, b], lambda i, p: p.allreduce(np.full(10, float(p.id)), "sum"))
        assert all(np.all(o == float(a.id + b.id)) for o in out)
        assert a.epoch == b.epoch == master.epoch == epoch
        for p in (a, b):
            p.close()
    finally:
        master.stop()


@pytest.mark.timeout(60)
def test_a_pending_probe_delays_no_other_join():
    """A joiner whose advertised address accepts connections and says nothing (the
    probe waits for its challenge) holds up no one: another peer joins, is admitted
    and runs an all-reduce with the members while that probe is still pending; when
    the silent address goes away the slow joiner is refused."""
    import socket

    master = el.Master(secret=SECRET, probe_timeout=30.0).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes connections; nobody accepts or speaks
    addr = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        a, b = (el.connect(master.address, secret=SECRET, streams=1, timeout=20) for _ in range(2))
        form([a, b], 2)
        slow = _in_thread(lambda: el.connect(master.address, secret=SECRET, streams=1, timeout=40, advertise=addr))
        _wait_for(lambda: master._probing == 1, what="the slow joiner's probe")
        j = el.connect(master.address, secret=SECRET, streams=1, timeout=20)
        form([a, b, j], 3)
        out = run_peers([a, b, j], lambda i, p: p.allreduce(np.full(100, float(p.id)), "sum"))
        assert all(np.all(o == float(a.id + b.id + j.id)) for o in out)
        assert master._probing == 1, "the slow probe ended before the other join completed"
        silent.close()  # its queued connections are reset: the probe fails at once
        with pytest.raises(commlib.InvalidArgument, match=f"could not dial advertise={addr!r}"):
            slow(30)
        assert master.groups() == [sorted([a.id, b.id, j.id])]
        for p in (a, b, j):
            p.close()
    finally:
        silent.close()
        master.stop()


def test_master_probe_timeout_argument():
    """``probe_timeout``: a finite number of seconds > 0, or None (no probe: a joiner
    is admitted whatever its address, as before)."""
    for bad in (0, -1.0, float("nan"), float("inf"), True, "3"):
        with pytest.raises(commlib.InvalidArgument, match="probe_timeout"):
            el.Master(secret=SECRET, probe_timeout=bad)
    master = el.Master(secret=SECRET, probe_timeout=None).start()
    dead, bad = _refusing_address()
    try:
        p = el.connect(master.address, secret=SECRET, streams=1, timeout=20, advertise=bad)
        assert p.id in master._peers and master.stats["probes"] == 0
        p.close()
    finally:
        dead.close()
        master.stop()
