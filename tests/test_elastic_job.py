"""The elastic master's job check at the door (``connect(job=...)``, ``Master(job=...)``,
``commlib master --job-file``): a joiner of another job is refused before admission, so
the members see nothing of it (same epoch, same membership, no abort, and their next
vote and all-reduce complete with the right sums).

Oracles: the members' epoch and membership as the master and each member hold them,
the master's counters, the sums recomputed from the peers' ids, and the raw bytes on
the wire (recorded by a TCP proxy) for what a party without the secret receives.
"""
import os
import time
import subprocess
import sys
import threading

import numpy as np
import pytest

import commlib
import commlib.elastic as el
from commlib.core.errors import JobMismatch
from commlib.elastic.protocol import JOB_MAX
from commlib.transports import tcp
from test_elastic import run_peers
from test_elastic_adversary import RecordingProxy

pytestmark = pytest.mark.timeout(60)

SECRET = b"test-secret-0123456789abcdef"
JOB = b'{"hidden":[16],"job":"alpha-7f3c9e"}'
OTHER = b'{"hidden":[32],"job":"omega-2b81d4"}'


def _each(peers, fn):
    """Run ``fn(peer)`` on every peer at once; returns the results (raises the first error)."""
    return run_peers(peers, lambda i, p: fn(p), timeout=30)


def _form(peers):
    """Every peer votes until the group has them all (a joiner whose vote arrives after the
    members' vote enters at the next one)."""
    def go(p):
        deadline = time.monotonic() + 30
        while True:
            p.update_topology(timeout=20)
            if p.size == len(peers):
                return
            assert time.monotonic() < deadline, "the group did not form"
    _each(peers, go)


def _step(peers, k):
    """One training step on every member: a vote, then an all-reduce checked against the ids' sum."""
    def go(p):
        p.update_topology(timeout=20)
        buf = np.full(1000, float(p.id * (k + 1)))
        p.allreduce(buf, "sum", timeout=20)
        return buf
    for buf in _each(peers, go):
        assert np.all(buf == float(sum(p.id for p in peers) * (k + 1)))


def _close(master, peers):
    for p in peers:
        p.close()
    master.stop()


def test_a_joiner_of_another_job_is_refused_at_the_door_and_the_members_see_nothing():
    """Two members of job JOB run steps; a joiner with OTHER arrives meanwhile: its connect
    raises JobMismatch within its connect timeout (5 s: room for a loaded CI box; an
    admission would succeed instead), carrying the job's bytes; the members' epoch and
    membership never change, nothing is aborted, and their steps all complete."""
    master = el.Master(secret=SECRET).start()
    peers = []
    try:
        peers = [el.connect(master.address, secret=SECRET, streams=1, timeout=20, job=JOB) for _ in range(2)]
        _form(peers)
        assert master.job == JOB
        epoch, epochs, members = master.epoch, master.stats["epochs"], list(master.members)
        got = {}

        def joiner():
            try:
                got["peer"] = el.connect(master.address, secret=SECRET, streams=1, timeout=5.0, job=OTHER)
            except BaseException as exc:  # noqa: BLE001
                got["err"] = exc

        th = threading.Thread(target=joiner, daemon=True)
        th.start()
        for k in range(4):
            _step(peers, k)
        th.join(10)
        assert not th.is_alive()
        if "peer" in got:
            got["peer"].close()
        err = got.get("err")
        assert isinstance(err, JobMismatch) and isinstance(err, commlib.InvalidArgument), repr(err)
        assert err.job == JOB and err.mine == OTHER and "connect" in str(err) and "not admitted" in str(err)
        assert master.stats["job_refusals"] == 1 and master.stats["aborts"] == 0
        assert (master.epoch, master.stats["epochs"], master.members) == (epoch, epochs, members)
        assert all(p.epoch == epoch and p.size == 2 for p in peers)
        assert master.groups() == [members]
        _step(peers, 9)  # an all-reduce after it completes
        assert all(p.epoch == epoch for p in peers)
    finally:
        _close(master, peers)


def test_same_job_admitted_none_makes_no_claim_and_the_job_outlives_its_members():
    """The first member has job=None: it fixes nothing (master.job stays None); the first peer
    with a job fixes it; the same bytes (as a bytearray) are admitted, another job is refused,
    and job=None is still admitted.  When every member has left the master keeps the job."""
    master = el.Master(secret=SECRET).start()
    peers = []
    try:
        peers.append(el.connect(master.address, secret=SECRET, timeout=20))
        _form(peers)
        assert master.job is None
        peers.append(el.connect(master.address, secret=SECRET, timeout=20, job=JOB))
        assert master.job == JOB and peers[-1].job == JOB
        peers.append(el.connect(master.address, secret=SECRET, timeout=20, job=bytearray(JOB)))
        with pytest.raises(JobMismatch) as info:
            el.connect(master.address, secret=SECRET, timeout=5, job=OTHER)
        assert info.value.job == JOB
        peers.append(el.connect(master.address, secret=SECRET, timeout=20))  # no job: no claim
        _form(peers)
        _step(peers, 0)
        for p in peers:
            p.close()
        peers = []
        with pytest.raises(JobMismatch):
            el.connect(master.address, secret=SECRET, timeout=5, job=OTHER)
        assert master.job == JOB and master.stats["job_refusals"] == 2
        peers.append(el.connect(master.address, secret=SECRET, timeout=20, job=JOB))
    finally:
        _close(master, peers)


def _sync(peers, value, revision):
    """Every member syncs a state of ``value`` at ``revision``; returns the states."""
    states = [{"w": np.full(256, value, np.float32)} for _ in peers]
    run_peers(peers, lambda i, p: p.sync_shared_state(states[i], revision), timeout=30)
    return states


@pytest.mark.parametrize("given", [None, JOB], ids=["job-from-the-joiners", "Master(job=JOB)"])
def test_two_jobs_in_a_row_on_one_master(given):
    """A job runs to its end (a sync at revision 3, steps) and its members leave with
    close(finished=True): the master releases the job.  The next job, under the same
    master, with a fresh state at revision 0 (and, when the joiners fixed the first
    job's description, other flags), is admitted, forms, syncs and steps.  A job given
    to Master(job=...) is kept: another job is still refused at the door."""
    master = el.Master(secret=SECRET, job=given).start()
    peers = []
    try:
        peers = [el.connect(master.address, secret=SECRET, streams=1, timeout=20, job=JOB) for _ in range(2)]
        _form(peers)
        _sync(peers, 1.0, 3)
        for k in range(2):
            _step(peers, k)
        assert master.job == JOB and master.revision == 3
        for p in peers:
            p.close(finished=True)
        peers = []
        deadline = time.monotonic() + 20
        while master.stats["jobs_finished"] < 1:
            assert time.monotonic() < deadline, "the master did not see the job finish"
            time.sleep(0.02)
        assert master.job == given and master.revision is None
        nxt = OTHER if given is None else JOB
        if given is not None:
            with pytest.raises(JobMismatch):
                el.connect(master.address, secret=SECRET, timeout=5, job=OTHER)
        peers = [el.connect(master.address, secret=SECRET, streams=1, timeout=20, job=nxt) for _ in range(2)]
        _form(peers)
        states = _sync(peers, 2.0, 0)  # a new history: not refused as the old job's lost state
        assert all(np.all(s["w"] == 2.0) for s in states) and master.revision == 0
        for k in range(2):
            _step(peers, k)
        assert master.job == nxt and master.stats["job_refusals"] == (0 if given is None else 1)
    finally:
        _close(master, peers)


def test_job_given_up_front_and_two_joiners_of_different_jobs_at_once():
    """Master(job=JOB): the first joiner, with OTHER, is refused.  On a master with no job, two
    joiners of different jobs connecting at once: exactly one is admitted, and its bytes are
    the job's (the check is repeated at admission, after the probes)."""
    master = el.Master(secret=SECRET, job=JOB).start()
    try:
        with pytest.raises(JobMismatch) as info:
            el.connect(master.address, secret=SECRET, timeout=5, job=OTHER)
        assert info.value.job == JOB and master.stats["epochs"] == 0 and not master._peers
    finally:
        master.stop()
    for trial in range(5):
        master = el.Master(secret=SECRET).start()
        out = {}
        try:
            def go(job):
                try:
                    out[job] = el.connect(master.address, secret=SECRET, timeout=10, job=job)
                except JobMismatch as exc:
                    out[job] = exc

            ths = [threading.Thread(target=go, args=(j,), daemon=True) for j in (JOB, OTHER)]
            for t in ths:
                t.start()
            for t in ths:
                t.join(20)
            admitted = [j for j, r in out.items() if isinstance(r, el.Peer)]
            refused = [j for j, r in out.items() if isinstance(r, JobMismatch)]
            assert len(admitted) == 1 and len(refused) == 1, (trial, out)
            assert master.job == admitted[0] and out[refused[0]].job == admitted[0]
        finally:
            _close(master, [r for r in out.values() if isinstance(r, el.Peer)])


@pytest.mark.parametrize("encrypt", [False, True])
def test_the_job_never_reaches_a_party_without_the_secret(encrypt):
    """A joiner with the wrong secret and a job gets nothing back but the challenge (no job
    bytes), and its own job never leaves it (it is sent only after the master proved the
    secret).  With encrypt=True, a refused (authenticated) joiner's and the master's job
    bytes cross the wire sealed: neither appears in the recording."""
    master = el.Master(secret=SECRET, job=JOB, encrypt=encrypt).start()
    try:
        proxy = RecordingProxy(master.address)
        with pytest.raises(el.AuthError) as info:
            el.connect(proxy.address, secret=b"another-secret-0123456789", timeout=5, job=OTHER, encrypt=encrypt)
        assert not isinstance(info.value, JobMismatch) and not hasattr(info.value, "job")
        assert proxy.done.wait(5)
        assert JOB not in bytes(proxy.s2c) and OTHER not in bytes(proxy.c2s)
        assert tcp.HEADER.unpack(bytes(proxy.s2c[:tcp.HEADER.size]))[2] == tcp.K_CHALLENGE
        assert len(proxy.s2c) == tcp.HEADER.size + 32, "the master sent more than its challenge"
        if encrypt:
            proxy = RecordingProxy(master.address)
            with pytest.raises(JobMismatch) as info:
                el.connect(proxy.address, secret=SECRET, timeout=5, job=OTHER, encrypt=True)
            assert info.value.job == JOB and proxy.done.wait(5)
            assert JOB not in bytes(proxy.s2c) and OTHER not in bytes(proxy.c2s)
        assert master.stats["epochs"] == 0 and not master._peers
    finally:
        master.stop()


def test_bad_job_arguments_raise_before_anything_moves(tmp_path):
    """A job that is not bytes, empty, or over JOB_MAX raises InvalidArgument naming it, on
    connect (before dialling: an unreachable address is never tried) and on Master; the
    command line refuses an unusable --job-file in one line with exit status 2."""
    for bad in ("text", b"", b"x" * (JOB_MAX + 1), 7):
        with pytest.raises(commlib.InvalidArgument, match="job must") as info:
            el.connect("127.0.0.1:1", secret=SECRET, timeout=1, job=bad)
        assert info.value.op == "connect"
        with pytest.raises(commlib.InvalidArgument, match="job must"):
            el.Master(secret=SECRET, job=bad)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    env = {**os.environ, "COMMLIB_ELASTIC_SECRET": SECRET.decode()}
    for path in (str(tmp_path / "missing"), str(empty)):
        r = subprocess.run([sys.executable, "-P", "-m", "commlib.cli", "master", "--bind", "127.0.0.1:0",
                            "--job-file", path], capture_output=True, text=True, timeout=30, env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("commlib master: error: --job-file") and path in r.stderr, r.stderr
