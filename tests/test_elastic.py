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

pytestmark = pytest.mark.timeout(120)

SECRET = b"test-secret-0123456789abcdef"


def _h(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def run_peers(peers, fn, timeout=60):
    out, err = [None] * len(peers), [None] * len(peers)

    def go(i):
        try:
            out[i] = fn(i, peers[i])
        except BaseException as exc:  # noqa: BLE001
            err[i] = exc

    ths = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(peers))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout)
    assert not any(t.is_alive() for t in ths), "a peer hung"
    for e in err:
        if e is not None:
            raise e
    return out


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


@pytest.mark.parametrize("quantize,tol", [("fp16", 2e-3), ("int8", 3e-2)])
def test_allreduce_quantized_bit_identical(group, quantize, tol):
    _, peers = group
    data = {p.id: np.random.default_rng(p.id).standard_normal((37, 101)).astype(np.float32) for p in peers}
    out = run_peers(peers, lambda i, p: p.allreduce(data[p.id].copy(), "avg", quantize=quantize))
    assert len({_h(o) for o in out}) == 1, "quantized results differ between peers"
    ref = np.mean([data[i] for i in sorted(data)], axis=0)
    assert np.max(np.abs(out[0] - ref)) < tol * max(1.0, np.max(np.abs(ref))) * 10


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


def test_cli_master_help():
    from commlib.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["master", "--help"])
    assert exc.value.code == 0
