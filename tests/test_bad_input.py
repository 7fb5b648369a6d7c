"""Bad input gets a clear error on every rank, fast, and leaves things usable.

Each case: every rank raises a :class:`commlib.CommError` subclass whose
message names the rank and the call, within 1 s (``BOUND``); the caller's arrays are
unchanged; the communicator still works afterwards (an argument error moves
no byte).  Collectives refuse through their argument agreement, so a rank
with good arguments raises too; point-to-point calls refuse on the caller
before a send or receive is posted.
"""
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib import datatypes as dt
from commlib.core import errors
from commlib.core.errors import CommError, DatatypeError, InvalidArgument

# seconds within which every refusal must come.  The target is 1 s, checked on a
# quiet machine with COMMLIB_REFUSAL_BOUND=1; the default leaves room for 4 ranks spinning
# in MPI on 2 shared CI cores, and is still far below any timeout a refusal could wait for.
BOUND = float(os.environ.get("COMMLIB_REFUSAL_BOUND", "10"))


@pytest.fixture(scope="module")
def comm():
    c = commlib.init().dup()
    yield c
    c.free()


@pytest.fixture(scope="module")
def ftcomm():
    c = commlib.init(fault_tolerant=True, timeout=20)
    yield c


def _objects(n):
    a = np.empty(n, dtype=object)
    for i in range(n):
        a[i] = ("x", i)
    return a


def _refused(comm, fn, match=None, cls=CommError):
    """Run ``fn`` expecting a ``cls`` naming this rank within BOUND seconds; returns the error.

    Every rank calls this alike; the verdict is agreed (:func:`_agreed`), so a
    check failing on one rank fails the test on every rank at this point."""
    t0 = time.perf_counter()
    err = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (checked below, on every rank)
        err = exc
    took = time.perf_counter() - t0

    def check():
        assert isinstance(err, cls), f"expected {cls.__name__}, got {err!r}"
        msg = str(err)
        assert f"rank {comm.rank}" in msg, msg
        assert err.rank == comm.rank
        if match:
            assert match in msg, msg
        assert took < BOUND, (msg, took)

    _agreed(comm, check)
    return err


def _agreed(comm, check):
    """Run ``check()`` (assertions) on every rank, then agree on the verdict
    (one mpi4py allgather, which every rank reaches because nothing raised
    before it): a check that fails on some ranks fails the test on all of
    them, so no rank goes on into a collective the others left."""
    try:
        check()
        mine = None
    except AssertionError as exc:
        mine = f"rank {comm.rank}: {exc!r}"[:2000]
    bad = [m for m in comm.mpi_comm.allgather(mine) if m is not None]
    assert not bad, "; ".join(bad)


def _still_usable(comm):
    out = comm.allreduce(np.ones(3))
    assert np.array_equal(out, np.full(3, float(comm.size)))
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.zeros(2, np.int64)
    comm.sendrecv(np.array([comm.rank, 7], np.int64), nxt, got, prv, sendtag=3, recvtag=3)
    assert got.tolist() == [prv, 7]  # the next message is the right one: nothing stray was sent


# ------------------------------------------------------- what cannot travel
_OBJ_DTYPES = {"object": None, "struct-with-object": np.dtype([("a", "f8"), ("b", object)])}


def _bad_array(kind, n):
    if kind == "object":
        return _objects(n)
    a = np.zeros(n, _OBJ_DTYPES[kind])
    for i in range(n):
        a[i]["b"] = [i]
    return a


COLLECTIVES = {
    "allreduce": lambda c, a: c.allreduce(a),
    "allreduce-out": lambda c, a: c.allreduce(a, a.copy()),
    "reduce_scatter": lambda c, a: c.reduce_scatter(a),
    "allgather": lambda c, a: c.allgather(a),
    "bcast": lambda c, a: c.bcast(a),
    "bcast-mpi": lambda c, a: c.bcast(a, algorithm="mpi"),
    "alltoall": lambda c, a: c.alltoall(a),
    "iallgather": lambda c, a: c.iallgather(a, None).wait(),
    "ibcast": lambda c, a: c.ibcast(a).wait(),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(_OBJ_DTYPES))
@pytest.mark.parametrize("who", ["all", "rank0"])
@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collective_refuses_references_everywhere(comm, name, who, kind):
    n = 2 * comm.size
    bad = who == "all" or comm.rank == 0
    a = _bad_array(kind, n) if bad else np.arange(n, dtype=np.float64)
    keep = a.copy()
    _refused(comm, lambda: COLLECTIVES[name](comm, a), cls=InvalidArgument)
    assert all(x is y or x == y for x, y in zip(a.tolist(), keep.tolist()))  # untouched
    _still_usable(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["allreduce", "allgather", "bcast", "alltoall", "reduce_scatter"])
def test_fault_tolerant_collective_refuses_references(ftcomm, name):
    a = _objects(2 * ftcomm.size) if ftcomm.rank == ftcomm.size - 1 else np.ones(2 * ftcomm.size)
    _refused(ftcomm, lambda: COLLECTIVES[name](ftcomm, a), cls=InvalidArgument)
    assert np.array_equal(ftcomm.allreduce(np.ones(2)), np.full(2, float(ftcomm.size)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("c", ["plain", "ft"])
@pytest.mark.parametrize("bad", ["objects", "readonly-recvbuf"])
def test_sendrecv_resilient_refuses_on_every_rank(comm, ftcomm, c, bad):
    cm = comm if c == "plain" else ftcomm
    n, r = cm.size, cm.rank
    send = _objects(4) if r == 0 and bad == "objects" else np.ones(4)
    recv = np.zeros(4)
    if r == 0 and bad == "readonly-recvbuf":
        recv.flags.writeable = False
    _refused(cm, lambda: cm.sendrecv_resilient(send, (r + 1) % n, recv, (r - 1) % n), cls=InvalidArgument)
    assert not recv.any()
    got = np.zeros(4)
    cm.sendrecv_resilient(np.full(4, float(r)), (r + 1) % n, got, (r - 1) % n)
    assert np.array_equal(got, np.full(4, float((r - 1) % n)))


P2P = {
    "send": lambda c, a, nxt, prv: c.send(a, nxt),
    "isend": lambda c, a, nxt, prv: c.isend(a, nxt),
    "recv": lambda c, a, nxt, prv: c.recv(a, prv),
    "irecv": lambda c, a, nxt, prv: c.irecv(a, prv),
    "sendrecv-send": lambda c, a, nxt, prv: c.sendrecv(a, nxt, np.zeros(a.shape), prv),
    "sendrecv-recv": lambda c, a, nxt, prv: c.sendrecv(np.zeros(a.shape), nxt, a, prv),
    "typed-send": lambda c, a, nxt, prv: c.send(a, nxt, datatype=dt.Contiguous(2, np.float64)),
    "typed-irecv": lambda c, a, nxt, prv: c.irecv(a, prv, datatype=dt.Contiguous(2, np.float64)),
    "typed-sendrecv-send": lambda c, a, nxt, prv: c.sendrecv(a, nxt, np.zeros(4), prv,
                                                              sendtype=dt.Contiguous(2, np.float64)),
    "typed-sendrecv-recv": lambda c, a, nxt, prv: c.sendrecv(np.zeros(4), nxt, a, prv,
                                                              recvtype=dt.Contiguous(2, np.float64)),
    "mpi-type-send": lambda c, a, nxt, prv: c.send(a, nxt, datatype=MPI.DOUBLE, count=2),
    "transport-isend": lambda c, a, nxt, prv: c.transport.isend(a, nxt),
    "transport-irecv": lambda c, a, nxt, prv: c.transport.irecv(a, prv),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(_OBJ_DTYPES))
@pytest.mark.parametrize("name", list(P2P))
def test_point_to_point_refuses_references_before_posting(comm, name, kind):
    n, r = comm.size, comm.rank
    a = _bad_array(kind, 4)
    keep = a.copy()
    _refused(comm, lambda: P2P[name](comm, a, (r + 1) % n, (r - 1) % n), match="object", cls=InvalidArgument)
    assert all(x is y or x == y for x, y in zip(a.tolist(), keep.tolist()))
    _still_usable(comm)  # no receive was left posted (it would steal this message), no send went out


# ------------------------------------------------ raw MPI errors, messages
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["recv", "irecv", "send", "isend", "sendrecv"])
@pytest.mark.parametrize("tag", [-5, -2, 2 ** 40, "x", 1.5])
def test_bad_tags_name_the_rank(comm, call, tag):
    n, r = comm.size, comm.rank
    a = np.zeros(4)
    fn = {"recv": lambda: comm.recv(a, (r - 1) % n, tag=tag),
          "irecv": lambda: comm.irecv(a, (r - 1) % n, tag=tag),
          "send": lambda: comm.send(a, (r + 1) % n, tag=tag),
          "isend": lambda: comm.isend(a, (r + 1) % n, tag=tag),
          "sendrecv": lambda: comm.sendrecv(a, (r + 1) % n, a.copy(), (r - 1) % n, recvtag=tag)}[call]
    e = _refused(comm, fn, cls=InvalidArgument)
    assert e.op == call
    _still_usable(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["recv", "irecv", "send", "isend", "sendrecv"])
@pytest.mark.parametrize("what", ["peer", "tag"])
@pytest.mark.parametrize("value", [True, False])
def test_bool_peer_or_tag_is_refused(comm, call, what, value):
    """``dest=True`` used to send to rank 1 (and ``tag=True`` to use tag 1): a bool
    is not a rank or a tag."""
    n, r = comm.size, comm.rank
    a = np.zeros(4)
    nxt, prv, tag = (value, value, 0) if what == "peer" else ((r + 1) % n, (r - 1) % n, value)
    fn = {"recv": lambda: comm.recv(a, prv, tag=tag),
          "irecv": lambda: comm.irecv(a, prv, tag=tag),
          "send": lambda: comm.send(a, nxt, tag=tag),
          "isend": lambda: comm.isend(a, nxt, tag=tag),
          "sendrecv": lambda: comm.sendrecv(a, nxt, a.copy(), prv, sendtag=tag, recvtag=tag)}[call]
    e = _refused(comm, fn, cls=InvalidArgument, match="bool" if what == "peer" else "is not an int")
    assert e.op == call
    _still_usable(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["recv", "irecv"])
def test_message_larger_than_the_receive_buffer_says_so(comm, call):
    """The blocking receive raised MPI's bare "MPI_ERR_TRUNCATE: message
    truncated"; both receives now say what happened, naming the rank."""
    n, r = comm.size, comm.rank
    comm.isend(np.arange(8.0), (r + 1) % n, tag=21)
    small = np.zeros(4)
    fn = {"recv": lambda: comm.recv(small, (r - 1) % n, tag=21),
          "irecv": lambda: comm.irecv(small, (r - 1) % n, tag=21).wait(30)}[call]
    _refused(comm, fn, cls=CommError, match="a message was larger than its receive buffer")
    _still_usable(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["recv", "irecv", "sendrecv"])
def test_read_only_receive_buffer_names_the_rank(comm, call):
    """A read-only receive buffer (``np.frombuffer(bytes)``) raised mpi4py's
    "dlpack: buffer is not writable", naming neither the rank nor the call."""
    n, r = comm.size, comm.rank
    ro = np.frombuffer(bytes(32))
    fn = {"recv": lambda: comm.recv(ro, (r - 1) % n),
          "irecv": lambda: comm.irecv(ro, (r - 1) % n),
          "sendrecv": lambda: comm.sendrecv(np.zeros(4), (r + 1) % n, ro, (r - 1) % n)}[call]
    e = _refused(comm, fn, cls=errors.BufferError, match="read-only")
    assert e.op == call and bytes(ro) == bytes(32)
    _still_usable(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["send", "recv", "isend", "irecv"])
def test_stale_datatype_handle_is_a_datatype_error(comm, call):
    n, r = comm.size, comm.rank
    t = MPI.DOUBLE.Create_contiguous(2).Commit()
    other = MPI.Datatype.fromhandle(t.handle)  # a second Python handle to the same type
    t.Free()
    a = np.zeros(4)
    peer = (r + 1) % n if call in ("send", "isend") else (r - 1) % n
    for handle in (t, other):
        e = _refused(comm, lambda: getattr(comm, call)(a, peer, datatype=handle), cls=DatatypeError)
        assert e.op == call
        assert "freed" in str(e)
    _still_usable(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_too_big_datatype_messages_say_what_did_not_happen(comm):
    n, r = comm.size, comm.rank
    a = np.zeros(4)
    big = dt.Contiguous(100, np.float64)
    e = _refused(comm, lambda: comm.recv(a, (r - 1) % n, datatype=big), cls=DatatypeError)
    assert "no receive was posted" in str(e) and "sent" not in str(e)
    e = _refused(comm, lambda: comm.irecv(a, (r - 1) % n, datatype=big), cls=DatatypeError)
    assert "no receive was posted" in str(e)
    e = _refused(comm, lambda: comm.send(a, (r + 1) % n, datatype=big), cls=DatatypeError)
    assert "nothing was sent" in str(e)
    e = _refused(comm, lambda: comm.sendrecv(a, (r + 1) % n, a.copy(), (r - 1) % n, recvtype=big),
                 cls=DatatypeError)
    assert "no receive was posted" in str(e)
    _still_usable(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_peers_and_cartesian_queries(comm):
    a = np.zeros(2)
    for peer in (comm.size, -7, "x", 1.5):
        _refused(comm, lambda: comm.send(a, peer), cls=InvalidArgument)
        _refused(comm, lambda: comm.recv(a, peer), cls=InvalidArgument)
    cart = comm.cart_create([comm.size], periods=True)
    try:
        _refused(cart, lambda: cart.coords_of(comm.size + 3), cls=InvalidArgument)
        _refused(cart, lambda: cart.shift(5), cls=InvalidArgument)
        _refused(cart, lambda: cart.rank_of([0, 0, 0]), cls=InvalidArgument)
        assert cart.coords_of(cart.rank) == cart.coords
    finally:
        cart.free()
    _still_usable(comm)


# ------------------------------------------------ halo: validation cannot split
def _halo_world(topology, comm):
    from commlib.collectives.halo import HaloExchange

    n = comm.size
    if topology == "ring":
        cart = comm.cart_create([n], periods=True)
        local = (6,)
    elif topology == "chain":
        cart = comm.cart_create([n], periods=False)
        local = (6,)
    else:
        cart = comm.cart_create([0, 0], periods=True)
        local = (4, 5)
    return cart, HaloExchange(cart, local, width=1, corners=True)


def _changed(halo, how):
    if how == "shape":
        return np.zeros(tuple(s + 1 for s in halo.shape))
    if how == "dtype":
        return np.zeros(halo.shape, np.float32)
    if how == "order":
        return np.zeros(halo.shape, order="F") if len(halo.shape) > 1 else np.zeros(2 * halo.shape[0])[::2]
    if how == "objects":
        return np.empty(halo.shape, object)
    raise AssertionError(how)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("topology", ["ring", "chain", "grid"])
@pytest.mark.parametrize("how", ["shape", "dtype", "order", "objects"])
def test_halo_field_gone_bad_on_one_rank(topology, how):
    """After good exchanges, rank 0's field changes: every rank raises an
    InvalidArgument naming rank 0 before the exchange's timeout (neighbours in
    that exchange, other ranks when their next one starts), so from messages,
    not by waiting; nobody hangs and no ghost cell is written from an aborted
    exchange."""
    comm = commlib.init()
    cart, halo = _halo_world(topology, comm)
    timeout = 20.0  # long: a rank that learned of the abort by waiting it out fails the test, under any load
    try:
        good = halo.allocate(fill=float(cart.rank))
        for _ in range(2):  # (the first one compiles the pack kernels)
            halo.exchange(good, timeout=60)
        before = good.copy()
        err, took, steps = None, None, 0
        t0 = time.perf_counter()
        for _ in range(3):  # neighbours raise in the first, other ranks at the latest in the next
            steps += 1
            f = _changed(halo, how) if cart.rank == 0 else good
            try:
                halo.exchange(f, timeout=timeout)
            except CommError as exc:
                err, took = exc, time.perf_counter() - t0
                break

        def check():
            assert isinstance(err, InvalidArgument), (cart.rank, err)
            msg = str(err)
            assert msg.startswith(f"rank {cart.rank}: HaloExchange.exchange"), msg
            if cart.rank != 0:
                assert "rank 0" in msg and err.offenders == (0,), msg
                assert np.array_equal(good, before) or steps > 1  # the aborted exchange wrote no ghost cell
            assert took < timeout, (msg, took)

        _agreed(comm, check)
    finally:
        halo.free()
        cart.free()
    _still_usable(comm)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
def test_halo_abort_notice_from_an_offender_ahead():
    """A chain 0-1-2-3...: ranks >= 3 start exchange 1 only once rank 0 has aborted
    exchange 2 (rank 0 tells them so on a side communicator), so rank 2 waits in
    it (looking for abort notices meanwhile) while rank 0, which waits only for
    rank 1, already aborts exchange 2, and its notice reaches rank 2 early.
    Rank 2 must still finish exchange 1 (its neighbours run it normally and
    rank 1 waits for its exchange-2 message) and raise in exchange 2; before,
    it raised at once and rank 1 waited out its timeout (a CI hang)."""
    comm = commlib.init()
    cart, halo = _halo_world("chain", comm)
    side = cart.mpi_comm.Dup()  # the test's own ordering messages, apart from the halo's traffic
    timeout = 30.0
    try:
        good = halo.allocate(fill=float(cart.rank))
        halo.exchange(good, timeout=60)  # exchange 0 (compiles the pack kernels)
        if cart.rank >= 3:
            # late: rank 2 waits for rank 3 in exchange 1 while rank 0 aborts exchange 2
            side.recv(source=0, tag=77)
        t0 = time.perf_counter()
        halo.exchange(good, timeout=timeout)  # exchange 1: good everywhere
        ghosts_ok = bool(np.all(good[halo.interior] == cart.rank))
        err = None
        try:
            halo.exchange(_changed(halo, "dtype") if cart.rank == 0 else good, timeout=timeout)  # exchange 2
            if cart.rank != 1:  # neighbours of rank 0 raise in exchange 2; far ranks there or in the next
                halo.exchange(good, timeout=timeout)
        except CommError as exc:
            err = exc
        took = time.perf_counter() - t0
        if cart.rank == 0:  # exchange 2 aborted here: the late ranks may start exchange 1
            for r in range(3, cart.size):
                side.send(None, dest=r, tag=77)

        def check():
            assert ghosts_ok
            assert isinstance(err, InvalidArgument), err
            assert cart.rank == 0 or (err.offenders == (0,) and "rank 0" in str(err)), str(err)
            assert took < timeout, (str(err), took)  # from the messages, not by waiting

        _agreed(comm, check)
    finally:
        side.Free()
        halo.free()
        cart.free()
    _still_usable(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_halo_recovers_after_a_bad_call_among_neighbours():
    """Every rank is a neighbour of rank 0 (a periodic ring of <= 3, or a
    periodic 2-D grid): after rank 0's bad call every rank raised in that same
    exchange, all messages were matched, and the next good exchange works."""
    comm = commlib.init()
    cart, halo = _halo_world("grid" if comm.size == 4 else "ring", comm)
    if comm.size > 4 or (comm.size == 4 and min(cart.dims) < 2):
        pytest.skip("not every rank neighbours rank 0")
    try:
        good = halo.allocate(fill=float(cart.rank))
        halo.exchange(good, timeout=60)
        f = _changed(halo, "dtype") if cart.rank == 0 else good
        t0 = time.perf_counter()
        try:
            halo.exchange(f, timeout=30)  # long: raising by waiting it out would fail the bound below
            err = None
        except CommError as exc:
            err = exc
        took = time.perf_counter() - t0

        def check():
            assert isinstance(err, InvalidArgument) and took < 30, (err, took)  # from the messages, not by waiting

        _agreed(comm, check)
        good[...] = cart.rank
        halo.exchange(good, timeout=30)
        ghosts = good.copy()
        ghosts[halo.interior] = -1
        assert set(np.unique(ghosts)) - {-1.0} <= set(float(r) for r in range(comm.size))
        if comm.size > 1:
            assert (ghosts != cart.rank).any()
    finally:
        halo.free()
        cart.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_halo_field_count_mismatch_names_the_rank():
    """Rank 0 passes two fields where the others pass one (no rank's fields
    are wrong by themselves): nobody hangs; rank 0 and its neighbours raise an
    InvalidArgument naming their rank (the mismatch shows in the message
    headers, or as a message larger than the receive buffer); they notify the
    other ranks, which raise in a later exchange (at the latest the one in
    which a neighbour has stopped), naming
    rank 0 and the neighbour whose fields differ, or the neighbour that got a
    message too large for its plan (MPI cannot say from whom)."""
    comm = commlib.init()
    cart, halo = _halo_world("ring", comm)
    try:
        a, b = halo.allocate(), halo.allocate()
        halo.exchange(a, timeout=60)
        t0 = time.perf_counter()
        near = {0, 1 % comm.size, (comm.size - 1) % comm.size}
        err, steps = None, 0
        for _ in range(max(2, comm.size // 2)):  # far ranks: when a neighbour stopped, at the latest
            steps += 1
            try:
                halo.exchange(*((a, b) if cart.rank == 0 and steps == 1 else (a,)), timeout=30)
            except CommError as exc:
                err = exc
                break
        took = time.perf_counter() - t0

        def check():
            assert took < 30, (err, took)  # learned from the messages, not by waiting for the timeout
            assert isinstance(err, InvalidArgument), err
            assert str(err).startswith(f"rank {cart.rank}: HaloExchange.exchange"), str(err)
            if cart.rank in near:
                assert steps == 1, str(err)
                if cart.rank == 0:
                    assert "fields 1 (here 2)" in str(err), str(err)
            else:  # rank 0, or a neighbour of it that saw a message too large for its plan
                assert err.offenders and set(err.offenders) <= near, (str(err), err.offenders)

        _agreed(comm, check)
    finally:
        halo.free()
        cart.free()


# --------------------------------------- read-only buffers a collective would write
def _readonly_case(name, c, per, bad):
    """``(call, arrays)``: collective ``name`` on communicator ``c`` with ``per``
    elements per block, its written buffer read-only when ``bad``; ``arrays``:
    every buffer the call gets, to check afterwards that none changed."""
    n, r = c.size, c.rank
    x = np.arange(per * n, dtype=np.float64) + r
    if name == "allreduce-inplace":
        y, call = x, lambda: c.allreduce(x)
    elif name == "allreduce-recvbuf-is-sendbuf":
        y, call = x, lambda: c.allreduce(x, x)
    elif name == "allreduce-inplace-ring":
        y, call = x, lambda: c.allreduce(x, algorithm="ring")
    elif name == "allreduce-recvbuf":
        y = np.full(per * n, -1.0)
        call = lambda: c.allreduce(x, y)  # noqa: E731
    elif name == "reduce_scatter":
        y = np.full(per, -1.0)
        call = lambda: c.reduce_scatter(x, y)  # noqa: E731
    elif name == "allgather":
        x = x[:per].copy()
        y = np.full((n, per), -1.0)
        call = lambda: c.allgather(x, y)  # noqa: E731
    elif name == "alltoall":
        y = np.full(per * n, -1.0)
        call = lambda: c.alltoall(x, y)  # noqa: E731
    elif name in ("bcast", "bcast-mpi"):  # root 0: a non-root's buf is written
        y = x
        call = lambda: c.bcast(x, root=0, algorithm="mpi" if name == "bcast-mpi" else "auto")  # noqa: E731
    else:
        raise AssertionError(name)
    if bad:
        y.flags.writeable = False
    return call, [x] if y is x else [x, y]


READONLY = ["allreduce-inplace", "allreduce-recvbuf-is-sendbuf", "allreduce-inplace-ring", "allreduce-recvbuf",
            "reduce_scatter", "allgather", "alltoall", "bcast", "bcast-mpi"]
# elements per block: inside the first round's payload (the one-round path), and far above it
PER = {"small": 4, "large": 4096}


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["plain", "ft"])
@pytest.mark.parametrize("size", list(PER))
@pytest.mark.parametrize("name", READONLY)
def test_readonly_written_buffer_refused_everywhere(comm, ftcomm, mode, size, name):
    """The last rank's buffer that the call writes (recvbuf; sendbuf in place;
    a non-root's bcast buf) is read-only: every rank raises InvalidArgument
    before any byte moves (the same call with writable buffers ran just before,
    so a kept plan cannot skip the check), no rank's buffers changed, and the
    communicator still works."""
    c = comm if mode == "plain" else ftcomm
    n, r = c.size, c.rank
    bad = n - 1
    if name.startswith("bcast") and bad == 0:
        pytest.skip("one rank: it is the root, whose buf is only read")
    call, _ = _readonly_case(name, c, PER[size], False)
    call()  # the same call, good everywhere: the engine keeps its plan
    call, arrays = _readonly_case(name, c, PER[size], r == bad)
    before = [a.tobytes() for a in arrays]
    err = _refused(c, call, cls=InvalidArgument)

    def check():
        msg = str(err)
        if r == bad:
            assert "read-only" in msg, msg
        else:
            assert f"rank(s) [{bad}]" in msg, msg
        assert [a.tobytes() for a in arrays] == before, "a buffer changed"

    _agreed(c, check)
    if mode == "plain":
        _still_usable(c)
    else:
        assert np.array_equal(c.allreduce(np.ones(2)), np.full(2, float(n)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["plain", "ft"])
@pytest.mark.parametrize("size", list(PER))
@pytest.mark.parametrize("algorithm", ["auto", "binomial", "mpi"])
def test_bcast_from_a_readonly_root(comm, ftcomm, mode, size, algorithm):
    """The root's buf is only read: read-only there is fine (every rank gets its data)."""
    c = comm if mode == "plain" else ftcomm
    buf = np.arange(PER[size], dtype=np.float64) + c.rank
    if c.rank == 0:
        buf.flags.writeable = False
    out = c.bcast(buf, root=0, algorithm=algorithm)
    assert out is buf and np.array_equal(buf, np.arange(PER[size], dtype=np.float64))


# --------------------------------------------------- barrier, roots, messages
@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["plain", "ft"])
@pytest.mark.parametrize("bad_algorithm", ["bogus", 3, None])
@pytest.mark.parametrize("good", ["auto", "mpi", "dissemination"])
def test_barrier_bad_algorithm_on_one_rank(comm, ftcomm, mode, bad_algorithm, good):
    c = comm if mode == "plain" else ftcomm
    bad = c.size - 1
    err = _refused(c, lambda: c.barrier(algorithm=bad_algorithm if c.rank == bad else good), cls=InvalidArgument)

    def check():
        assert c.rank == bad or f"rank(s) [{bad}]" in str(err), str(err)

    _agreed(c, check)
    c.barrier(algorithm=good)  # still usable
    if mode == "plain":
        _still_usable(c)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["plain", "ft"])
@pytest.mark.parametrize("mine,theirs", [("dissemination", "mpi"), ("mpi", "auto"), ("auto", "mpi")])
def test_barrier_mismatched_algorithms(comm, ftcomm, mode, mine, theirs):
    """Rank 0 asks another barrier algorithm than the others: nobody waits, every rank refuses."""
    c = comm if mode == "plain" else ftcomm
    err = _refused(c, lambda: c.barrier(algorithm=mine if c.rank == 0 else theirs), cls=InvalidArgument,
                   match="algorithm differs")

    def check():
        assert "mpi" in str(err) and "dissemination" in str(err), str(err)  # the algorithms as named

    _agreed(c, check)
    c.barrier()
    if mode == "plain":
        _still_usable(c)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["plain", "ft"])
@pytest.mark.parametrize("root", [True, np.bool_(True), False])
def test_bcast_bool_root_refused(comm, ftcomm, mode, root):
    """A bool is no rank (Python counts True as 1): refused on every rank,
    though the other ranks pass the rank it would stand for."""
    c = comm if mode == "plain" else ftcomm
    bad = c.size - 1
    buf = np.arange(4.0) + c.rank
    keep = buf.copy()
    as_int = int(bool(root)) % c.size
    err = _refused(c, lambda: c.bcast(buf, root=root if c.rank == bad else as_int), cls=InvalidArgument)

    def check():
        assert np.array_equal(buf, keep), "buf changed"
        assert c.rank != bad or "bool" in str(err), str(err)

    _agreed(c, check)
    if mode == "plain":
        _still_usable(c)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mismatch_message_names_the_one_round_algorithm(comm):
    """A small "auto" allreduce (the one-round path) on rank 0 against "ring"
    elsewhere: the message names both algorithms, not a header code."""
    x = np.ones(4)
    err = _refused(comm, lambda: comm.allreduce(x, algorithm="auto" if comm.rank == 0 else "ring"),
                   cls=InvalidArgument, match="algorithm differs")

    def check():
        msg = str(err)
        assert "auto (one round)" in msg and "ring" in msg and " 0 and" not in msg, msg

    _agreed(comm, check)
    _still_usable(comm)
