"""commlib.tcp_comm.TCPCommunicator: the collectives of commlib.Communicator over the
TCP transport, its ranks meeting through a store (torch.distributed.Store's
set/get; here a dict behind a Condition, so no torch is needed).

Ranks are threads of this process, 1-4 of them, on loopback.  Oracles are
computed here from the seeded inputs, in float64 or exactly (Python ints, numpy
bool logic), never by commlib; reductions are also checked bit-identical across
ranks.  Inputs are small integers held in every dtype, so sums and products are
exact in float16/bfloat16 and avg is one rounding of the exact mean.

Bad calls: arguments that differ across ranks, or one rank's own bad argument,
raise InvalidArgument on every rank and the next call works; a closed peer, a
peer that skips a call and a wrong secret make the others raise within the
call's timeout.  numba device arrays (the CUDA simulator without a GPU) run in
two rank processes meeting through a file store.  tests/run.sh runs this file
with mpi4py unimportable.
"""
import json
import os
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import commlib
from commlib.tcp_comm import TCPCommunicator, routed_host

from seeds import test_seed

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
INTS = [np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)]
BOOL = np.dtype(bool)


class DictStore:
    """torch.distributed.Store's set/get: ``get`` blocks until the key is set
    (at most ``wait`` seconds, then raises as torch's stores do)."""

    def __init__(self, wait: float = 20.0):
        self.data, self.wait = {}, wait
        self.cv = threading.Condition()

    def set(self, key, value):
        with self.cv:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self.cv.notify_all()

    def get(self, key):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, self.wait):
                raise RuntimeError(f"store timeout waiting for {key!r}")
            return self.data[key]


def run(n, fn, join=45.0):
    """``fn(rank)`` on ``n`` threads; returns (results, errors) by rank."""
    out, err = [None] * n, [None] * n

    def go(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001
            err[r] = exc

    th = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join(join)
    assert not any(t.is_alive() for t in th), "a rank hung"
    return out, err


def ok(n, fn):
    out, err = run(n, fn)
    for e in err:
        if e is not None:
            raise e
    return out


def form(n, store=None, **kw):
    store = DictStore() if store is None else store
    return ok(n, lambda r: TCPCommunicator.from_store(store, r, n, **kw))


@pytest.fixture
def group(request):
    made = []

    def make(n, **kw):
        comms = form(n, **kw)
        made.extend(comms)
        return comms

    yield make
    for c in made:
        c.close()


def rng_for(*salt):
    return np.random.default_rng([test_seed(), *salt])


def inputs(n, dtype, count, op, salt):
    """Each rank's input: small integers in ``dtype`` (exact in every format)."""
    rng = rng_for(*salt)
    if dtype == BOOL:
        return [rng.integers(0, 2, count).astype(bool) for _ in range(n)]
    if op == "prod":
        vals = [1, 2] if dtype.kind == "u" else [-1, 1, 2]
        return [rng.choice(vals, count).astype(dtype) for _ in range(n)]
    lo = 0 if dtype.kind == "u" else -8
    return [rng.integers(lo, 9, count).astype(dtype) for _ in range(n)]


def oracle(xs, op, dtype):
    """The reduction of ``xs`` computed here: exactly (Python ints / bool logic) or in float64."""
    if dtype == BOOL:
        a = np.array(xs)
        return {"min": a.all(0), "max": a.any(0), "band": a.all(0), "bor": a.any(0),
                "bxor": np.bitwise_xor.reduce(a.astype(np.int64), 0).astype(bool)}[op]
    if dtype in INTS:
        a = [[int(v) for v in x] for x in xs]
        cols = list(zip(*a))
        red = {"sum": sum, "min": min, "max": max,
               "prod": lambda c: int(np.prod([int(v) for v in c], dtype=object)),
               "band": lambda c: _fold(c, lambda p, q: p & q), "bor": lambda c: _fold(c, lambda p, q: p | q),
               "bxor": lambda c: _fold(c, lambda p, q: p ^ q)}[op]
        return np.array([red(c) for c in cols], dtype=object)
    a = np.array([x.astype(np.float64) for x in xs])
    return {"sum": a.sum(0), "prod": a.prod(0), "min": a.min(0), "max": a.max(0), "avg": a.sum(0) / len(xs)}[op]


def _fold(c, f):
    acc = c[0]
    for v in c[1:]:
        acc = f(acc, v)
    return acc


def check_reduced(got, want, dtype, op):
    if dtype == BOOL:
        np.testing.assert_array_equal(got, want)
    elif dtype in INTS:
        assert [int(v) for v in got] == [int(v) for v in want]
    elif op == "avg":  # the exact mean, rounded once to the format (and the exact sum was representable)
        eps = float(np.finfo(dtype).eps) if dtype != BF16 else 2.0 ** -7
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=eps, atol=eps)
    else:
        np.testing.assert_array_equal(got.astype(np.float64), want)


def ops_for(dtype):
    if dtype == BOOL:
        return ["min", "max", "band", "bor", "bxor"]
    if dtype in INTS:
        return ["sum", "prod", "min", "max", "band", "bor", "bxor"]
    return ["sum", "prod", "min", "max", "avg"]


# ------------------------------------------------------------------ the collectives
def test_size_one_needs_no_store_or_socket():
    """A group of one: the store is not touched, and every collective gives the rank's own data."""
    store = DictStore()
    with TCPCommunicator.from_store(store, 0, 1, timeout=5) as c:
        assert (c.rank, c.size, c.address) == (0, 1, None)
        x = np.arange(10, dtype=np.float32)
        np.testing.assert_array_equal(c.allreduce(x.copy(), op="avg"), x)
        np.testing.assert_array_equal(c.allreduce(np.arange(3000.0)), np.arange(3000.0))
        np.testing.assert_array_equal(c.allgather(x), x.reshape(1, 10))
        np.testing.assert_array_equal(c.reduce_scatter(x, op="max"), x)
        np.testing.assert_array_equal(c.bcast(x.copy()), x)
        np.testing.assert_array_equal(c.alltoall(x), x.reshape(1, 10))
        c.barrier()
        with pytest.raises(commlib.InvalidArgument):
            c.allreduce(np.arange(4), op="avg")
    assert store.data == {}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_every_dtype_and_op(group, n):
    """Every dtype and op, one-round small calls and algorithm calls (recursive
    doubling / ring by size): the oracle's values, bit-identical on every rank."""
    comms = group(n, timeout=20)
    cases = [(dt, op, count) for dt in FLOATS + INTS + [BOOL] for op in ops_for(dt) for count in (5, 3001)]
    # the ring above recursive doubling's range, and each algorithm named
    cases += [(np.dtype(np.float32), "sum", 70001), (np.dtype(np.float64), "max", 40000)]

    def body(r):
        got = []
        for i, (dt, op, count) in enumerate(cases):
            x = inputs(n, dt, count, op, (1, n, i))[r]
            got.append(comms[r].allreduce(x.copy(), op=op))
        for algo in ("ring", "recursive_doubling"):
            x = inputs(n, np.dtype(np.float64), 999, "sum", (2, n))[r]
            got.append(comms[r].allreduce(x, np.empty_like(x), algorithm=algo))
        return got

    res = ok(n, body)
    for i, (dt, op, count) in enumerate(cases):
        want = oracle(inputs(n, dt, count, op, (1, n, i)), op, dt)
        check_reduced(res[0][i], want, dt, op)
        assert res[0][i].dtype == dt
        for r in range(1, n):
            assert res[r][i].tobytes() == res[0][i].tobytes(), (dt, op, count, r)
    want = oracle(inputs(n, np.dtype(np.float64), 999, "sum", (2, n)), "sum", np.dtype(np.float64))
    for r in range(n):
        for k in (1, 2):
            np.testing.assert_array_equal(res[r][-k], want)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter_uneven_counts(group, n):
    """Counts that do not divide (fewer elements than ranks included): rank r gets
    block r of the reduction, blocks cut as numpy.array_split cuts them."""
    comms = group(n, timeout=20)
    cases = [(np.dtype(np.float64), "sum", c) for c in (1, n + 1, 7 * n + 3, 50001)]
    cases += [(np.dtype(np.int32), "max", 13), (BF16, "sum", 5 * n), (np.dtype(np.uint8), "bxor", 9)]

    def body(r):
        return [comms[r].reduce_scatter(inputs(n, dt, count, op, (3, n, i))[r], op=op)
                for i, (dt, op, count) in enumerate(cases)]

    res = ok(n, body)
    for i, (dt, op, count) in enumerate(cases):
        want = oracle(inputs(n, dt, count, op, (3, n, i)), op, dt)
        for r, block in enumerate(np.array_split(np.asarray(want), n)):
            assert res[r][i].shape == (len(block),), (count, r)
            check_reduced(res[r][i], block, dt, op)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allgather_bcast_alltoall_barrier(group, n):
    comms = group(n, timeout=20)
    big = 300_000  # float64: 2.4 MB, a pipelined broadcast and a striped all-gather

    def data(r, shape, dt, salt):
        return (rng_for(4, n, r, salt).integers(-100, 100, shape)).astype(dt)

    entered = [threading.Event() for _ in range(n)]

    def body(r):
        c = comms[r]
        out = {}
        out["ag"] = c.allgather(data(r, (3, 2), np.float16, 0))
        out["ag_big"] = c.allgather(data(r, (big // 8,), np.float64, 1))
        out["ag_bool"] = c.allgather(data(r, (5,), np.int8, 2) > 0)
        for root in range(n):
            for k, count in (("s", 7), ("l", big)):
                buf = data(root, (count,), np.float64, 3) if r == root else np.zeros(count)
                out[f"bc{root}{k}"] = c.bcast(buf, root=root)
        out["a2a"] = c.alltoall(data(r, (n, 4), np.int64, 4))
        out["a2a_big"] = c.alltoall(data(r, (n * 20000,), BF16, 5))
        out["ag_ring"] = c.allgather(data(r, (5,), np.int32, 6), algorithm="ring")
        out["bc_binomial"] = c.bcast(data(0, (9,), np.uint16, 7) if r == 0 else np.zeros(9, np.uint16),
                                     algorithm="binomial")
        out["a2a_pairwise"] = c.alltoall(data(r, (n, 3), np.float32, 8), algorithm="pairwise")
        c.barrier(algorithm="dissemination")
        entered[r].set()
        c.barrier()
        out["all_entered"] = all(e.is_set() for e in entered)
        return out

    res = ok(n, body)
    for r in range(n):
        o = res[r]
        np.testing.assert_array_equal(o["ag"], np.stack([data(q, (3, 2), np.float16, 0) for q in range(n)]))
        np.testing.assert_array_equal(o["ag_big"], np.stack([data(q, (big // 8,), np.float64, 1) for q in range(n)]))
        np.testing.assert_array_equal(o["ag_bool"], np.stack([data(q, (5,), np.int8, 2) > 0 for q in range(n)]))
        for root in range(n):
            np.testing.assert_array_equal(o[f"bc{root}s"], data(root, (7,), np.float64, 3))
            np.testing.assert_array_equal(o[f"bc{root}l"], data(root, (big,), np.float64, 3))
        np.testing.assert_array_equal(o["a2a"], np.stack([data(q, (n, 4), np.int64, 4)[r] for q in range(n)]))
        np.testing.assert_array_equal(o["a2a_big"],
                                      np.stack([data(q, (n, 20000), BF16, 5)[r] for q in range(n)]))
        np.testing.assert_array_equal(o["ag_ring"], np.stack([data(q, (5,), np.int32, 6) for q in range(n)]))
        np.testing.assert_array_equal(o["bc_binomial"], data(0, (9,), np.uint16, 7))
        np.testing.assert_array_equal(o["a2a_pairwise"],
                                      np.stack([data(q, (n, 3), np.float32, 8)[r] for q in range(n)]))
        assert o["all_entered"], f"rank {r} left the barrier before every rank entered it"


def test_point_to_point_and_collectives_never_meet(group):
    """User messages posted around a collective, on the same tags a collective
    takes, arrive intact, and so does the collective's result."""
    n = 3
    comms = group(n, timeout=20)

    def body(r):
        c = comms[r]
        tp = c.transport
        right, left = (r + 1) % n, (r - 1) % n
        got = np.zeros(1000, np.int64)
        reqs = [tp.irecv(got, left, 0), tp.isend(np.full(1000, r, np.int64), right, 0)]
        s = c.allreduce(np.full(5000, r + 1, np.float64))
        tp.waitall(reqs, 10)
        return got, s

    for r, (got, s) in enumerate(ok(n, body)):
        assert (got == (r - 1) % n).all()
        assert (s == n * (n + 1) / 2).all()


def test_nonblocking_and_agree_arguments(group):
    n = 2
    comms = group(n, timeout=20)

    def body(r):
        c = comms[r]
        req = c.iallreduce(np.full(10, r + 1.0))
        res = req.wait(10)
        c.agree_arguments([7, 8], ["a", "b"], op="mystep")
        with pytest.raises(commlib.InvalidArgument, match="b"):
            c.agree_arguments([7, 8 + r], ["a", "b"], op="mystep")
        return res

    for res in ok(n, body):
        assert (res == 3.0).all()


# ------------------------------------------------------------------ bad calls
MISMATCHES = {
    "count": lambda c, r, n: c.allreduce(np.ones(100 + (r == n - 1))),
    "dtype": lambda c, r, n: c.allreduce(np.ones(4000, np.float32 if r == n - 1 else np.int32)),
    "op": lambda c, r, n: c.allreduce(np.ones(8), op="max" if r == n - 1 else "sum"),
    "small-vs-large": lambda c, r, n: c.allreduce(np.ones(10 if r == n - 1 else 100_000)),
    "root": lambda c, r, n: c.bcast(np.ones(4000), root=int(r == n - 1)),
    "collective": lambda c, r, n: c.allgather(np.ones(8)) if r == n - 1 else c.allreduce(np.ones(8)),
    "rs-dtype": lambda c, r, n: c.reduce_scatter(np.ones(4000, np.float64 if r == n - 1 else np.float32)),
    "own-op": lambda c, r, n: c.allreduce(np.ones(6, np.int32), op="avg" if r == n - 1 else "sum"),
    "own-readonly": lambda c, r, n: c.allreduce(np.ones(3000) if r != n - 1 else np.broadcast_to(1.0, (3000,))),
    "alltoall-count": lambda c, r, n: c.alltoall(np.ones(n * 4 + (r == n - 1))),
    "algorithm": lambda c, r, n: c.allgather(np.ones(8), algorithm="bruck" if r == n - 1 else "ring"),
    "one-names-mpi": lambda c, r, n: c.bcast(np.ones(8), algorithm="mpi" if r == n - 1 else "auto"),
}


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "allgather", "bcast", "alltoall", "barrier"])
def test_algorithm_mpi_is_refused_on_every_rank(group, name):
    """No MPI library here: algorithm="mpi" is an InvalidArgument (on every rank), and the next call works."""
    n = 2
    comms = group(n, timeout=10)
    x = np.ones(4 * n)
    calls = {"allreduce": lambda c: c.allreduce(x.copy(), algorithm="mpi"),
             "reduce_scatter": lambda c: c.reduce_scatter(x, algorithm="mpi"),
             "allgather": lambda c: c.allgather(x, algorithm="mpi"),
             "bcast": lambda c: c.bcast(x.copy(), algorithm="mpi"),
             "alltoall": lambda c: c.alltoall(x, algorithm="mpi"),
             "barrier": lambda c: c.barrier(algorithm="mpi")}
    _, err = run(n, lambda r: calls[name](comms[r]))
    assert all(isinstance(e, commlib.InvalidArgument) and "mpi" in str(e) for e in err), err
    assert [float(v.sum()) for v in ok(n, lambda r: comms[r].allreduce(np.ones(3)))] == [6.0, 6.0]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_mismatched_calls_raise_on_every_rank(group, n):
    """Each mismatch (and one rank's own bad argument) raises InvalidArgument on
    every rank, within the call's timeout, and the next call works."""
    comms = group(n, timeout=10)

    def body(r):
        seen = {}
        for name, call in MISMATCHES.items():
            t0 = time.monotonic()
            try:
                call(comms[r], r, n)
                seen[name] = None
            except commlib.InvalidArgument as exc:
                seen[name] = (str(exc), time.monotonic() - t0)
            after = comms[r].allreduce(np.full(3, float(r)))
            assert (after == n * (n - 1) / 2).all(), name
        return seen

    res = ok(n, body)
    for name in MISMATCHES:
        for r in range(n):
            got = res[r][name]
            assert got is not None, f"{name}: rank {r} raised nothing"
            assert got[1] < 9.0, f"{name}: rank {r} took the whole timeout"


def test_a_closed_peer_fails_the_call_within_its_timeout(group):
    """The last rank closes; the others' collectives raise ProcessFailed (its
    connection refused or dropped) or CommTimeout within the call's timeout."""
    n = 3
    comms = group(n, timeout=20)
    # connections made first, so both the dialled and the accepted side see the close
    ok(n, lambda r: comms[r].allreduce(np.ones(5000)))
    comms[-1].close()
    comms[-1].close()  # idempotent
    assert "closed" in repr(comms[-1])

    def body(r):
        t0 = time.monotonic()
        with pytest.raises((commlib.ProcessFailed, commlib.CommTimeout)):
            comms[r].allreduce(np.ones(5000), timeout=2.0)
        return time.monotonic() - t0

    for took in ok(n - 1, body):
        assert took < 2.0 + 3.0


def test_a_peer_that_never_connected_and_closed_fails_the_call(group):
    """The peer closed before any connection was made: the lower rank's dial is
    refused (ProcessFailed), the higher one times out."""
    n = 2
    comms = group(n, timeout=20)
    comms[1].close()
    t0 = time.monotonic()
    with pytest.raises((commlib.ProcessFailed, commlib.CommTimeout)):
        comms[0].allreduce(np.ones(10), timeout=2.0)
    assert time.monotonic() - t0 < 2.0 + 3.0


@pytest.mark.parametrize("what", ["allreduce", "barrier"])
def test_the_group_timeout_bounds_a_call_a_peer_skips(group, what):
    """No ``timeout`` in the call: the communicator's (1 s) is its deadline."""
    comms = group(2, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(commlib.CommTimeout, match="1 s"):
        if what == "barrier":
            comms[0].barrier()
        else:
            comms[0].allreduce(np.ones(100_000))
    assert time.monotonic() - t0 < 1.0 + 3.0


def test_bad_timeout_refused_on_every_rank(group):
    n = 2
    comms = group(n, timeout=10)
    _, err = run(n, lambda r: comms[r].allreduce(np.ones(4), timeout=float("nan") if r == 1 else 5.0))
    assert all(isinstance(e, commlib.InvalidArgument) for e in err), err


# ------------------------------------------------------------------ forming the group
def test_secret_drawn_by_rank_zero_given_or_from_the_environment(monkeypatch):
    monkeypatch.delenv("COMMLIB_SECRET", raising=False)
    store = DictStore()
    comms = form(2, store, timeout=10)
    try:
        assert len(store.data["commlib_tcp/secret"]) == 32
        assert len(store.data["commlib_tcp/gid"]) == 16
        assert {"commlib_tcp/addr/0", "commlib_tcp/addr/1"} <= set(store.data)
        assert [c.address for c in comms] == [store.data[f"commlib_tcp/addr/{r}"].decode() for r in range(2)]
        assert sum(ok(2, lambda r: comms[r].allreduce(np.ones(3)))[0]) == 6
    finally:
        for c in comms:
            c.close()
    for how in ("arg", "env"):
        store = DictStore()
        if how == "env":
            monkeypatch.setenv("COMMLIB_SECRET", "x" * 20)
            comms = form(2, store, timeout=10, prefix="p")
        else:
            comms = form(2, store, timeout=10, secret=b"y" * 16, prefix="p")
        try:
            assert "p/secret" not in store.data and "p/gid" in store.data
            assert sum(ok(2, lambda r: comms[r].allreduce(np.ones(3)))[0]) == 6
        finally:
            for c in comms:
                c.close()


def test_a_rank_with_another_secret_fails_within_the_timeout(monkeypatch):
    monkeypatch.delenv("COMMLIB_SECRET", raising=False)
    store = DictStore()
    comms = ok(2, lambda r: TCPCommunicator.from_store(store, r, 2, timeout=10, secret=bytes([65 + r]) * 16))
    try:
        out, err = run(2, lambda r: comms[r].allreduce(np.ones(3), timeout=1.5))
        assert all(isinstance(e, (commlib.ProcessFailed, commlib.CommTimeout)) for e in err), err
    finally:
        for c in comms:
            c.close()


def test_from_store_refuses_bad_arguments():
    s = DictStore()
    for kw in ({"rank": 2, "size": 2}, {"rank": -1, "size": 2}, {"rank": 0, "size": 0}, {"rank": True, "size": 2},
               {"rank": 0, "size": 1, "timeout": float("nan")}, {"rank": 0, "size": 1, "timeout": 0},
               {"rank": 0, "size": 2, "streams": 0}, {"rank": 0, "size": 2, "host": "a b"}):
        with pytest.raises(commlib.InvalidArgument):
            TCPCommunicator.from_store(s, **kw)
    with pytest.raises(commlib.AuthenticationError):  # SecretError: shorter than 16 bytes
        TCPCommunicator.from_store(s, 0, 2, secret=b"short")
    assert s.data == {}


def test_a_store_that_fails_is_a_comm_error():
    s = DictStore(wait=0.2)
    with pytest.raises(commlib.CommError, match="gid"):
        TCPCommunicator.from_store(s, 1, 2, timeout=5)


def test_published_address_and_routing():
    assert routed_host(None) == "127.0.0.1"
    assert routed_host("127.0.0.1") == "127.0.0.1"
    assert routed_host("localhost") == "127.0.0.1"
    assert routed_host("no-such-host.invalid") == "127.0.0.1"
    s = DictStore()
    s.set("commlib_tcp/addr/1", b"10.11.12.14:5")  # rank 1's entry (no rank 1 runs: no call is made)
    with TCPCommunicator.from_store(s, 0, 2, timeout=5, host="10.11.12.13") as c:
        port = c.address.rsplit(":", 1)[1]
        assert c.address == f"10.11.12.13:{port}" and int(port) > 0
        assert s.data["commlib_tcp/addr/0"] == c.address.encode()
        assert repr(c).startswith("<TCPCommunicator rank=0 size=2 address=10.11.12.13:")
    s = DictStore()
    s.set("commlib_tcp/addr/1", b"not an address")
    with pytest.raises(commlib.InvalidArgument):
        TCPCommunicator.from_store(s, 0, 2, timeout=5)


def test_unsupported_fault_tolerance(group):
    c = group(1)[0]
    assert c.ft is None and c.failed_ranks == () and c.fault_tolerant is None
    with pytest.raises(NotImplementedError):
        c.shrink(c.collective_transport())
    with pytest.raises(NotImplementedError):
        c.recover()
    with pytest.raises(commlib.InvalidArgument):
        c.add_failure_callback(lambda *a: None)


def test_imports_no_mpi():
    """A fresh interpreter where mpi4py cannot be imported forms a group of one and of two."""
    code = """
import sys, threading, numpy as np
from commlib.tcp_comm import TCPCommunicator
class S:
    def __init__(s): s.d, s.cv = {}, threading.Condition()
    def set(s, k, v):
        with s.cv: s.d[k] = v; s.cv.notify_all()
    def get(s, k):
        with s.cv: s.cv.wait_for(lambda: k in s.d, 20); return s.d[k]
c = TCPCommunicator.from_store(S(), 0, 1, timeout=5)
assert c.allreduce(np.ones(3)).sum() == 3
st, out = S(), [None, None]
def go(r):
    with TCPCommunicator.from_store(st, r, 2, timeout=10) as c:
        out[r] = c.allreduce(np.full(4000, r + 1.0))
th = [threading.Thread(target=go, args=(r,)) for r in range(2)]
[t.start() for t in th]; [t.join(30) for t in th]
assert all(o is not None and (o == 3).all() for o in out), out
bad = sorted(m for m in sys.modules if m.startswith(("mpi4py", "commlib.transports.mpi")))
assert not bad, bad
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests", "no_mpi"),
                                                         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=50, env=env,
                       cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


DEVICE_RANK = r'''
import json, os, sys, time
import numpy as np
from numba import cuda
from commlib.tcp_comm import TCPCommunicator

class DirStore:  # torch's FileStore in miniature: one file per key
    def __init__(self, d):
        self.d = d
    def set(self, k, v):
        p = os.path.join(self.d, k.replace("/", "_"))
        with open(p + ".tmp", "wb") as f:
            f.write(v)
        os.replace(p + ".tmp", p)
    def get(self, k):
        p, t = os.path.join(self.d, k.replace("/", "_")), time.monotonic() + 30
        while not os.path.exists(p):
            assert time.monotonic() < t, k
            time.sleep(0.01)
        with open(p, "rb") as f:
            return f.read()

d, r, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x = np.random.default_rng([int(sys.argv[4]), r]).integers(-8, 9, 3001).astype(np.float32)
with TCPCommunicator.from_store(DirStore(d), r, n, timeout=30) as c:
    ring = cuda.to_device(x)
    c.allreduce(ring)                               # the ring, reduced on the device
    small = cuda.to_device(x[:5].astype(np.float64))
    c.allreduce(small, op="max")                    # one round, staged
    g = c.allgather(cuda.to_device(x[:4]))
    rs = c.reduce_scatter(cuda.to_device(x[:7]))
    b = cuda.to_device(x[:6] if r == 1 else np.zeros(6, np.float32))
    c.bcast(b, root=1)
    kinds = sorted({type(a).__name__ for a in (g, rs)})
    print(json.dumps({"ring": ring.copy_to_host().tolist(), "small": small.copy_to_host().tolist(),
                      "g": g.copy_to_host().tolist(), "rs": rs.copy_to_host().tolist(),
                      "b": b.copy_to_host().tolist(), "kinds": kinds}))
'''


def test_device_arrays_staged_through_host(tmp_path):
    """numba device arrays (the CUDA simulator without a GPU; ranks are processes,
    as the simulator's kernels cannot run on two threads at once): the ring on the
    device, one-round and staged calls, results of the input's kind."""
    pytest.importorskip("numba")
    n, seed = 2, test_seed()
    procs = [subprocess.Popen([sys.executable, "-P", "-c", DEVICE_RANK, str(tmp_path), str(r), str(n), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, errs = p.communicate(timeout=50)
            assert p.returncode == 0, errs[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    xs = [np.random.default_rng([seed, r]).integers(-8, 9, 3001).astype(np.float64) for r in range(n)]
    total = np.sum(xs, axis=0)
    for r, o in enumerate(outs):
        assert o["ring"] == total.tolist()
        assert o["small"] == np.max([x[:5] for x in xs], axis=0).tolist()
        assert o["g"] == [x[:4].tolist() for x in xs]
        assert o["rs"] == np.array_split(total[:7], n)[r].tolist()
        assert o["b"] == xs[1][:6].tolist()
        assert o["kinds"] and all("CUDA" in k or "Device" in k for k in o["kinds"]), o["kinds"]
