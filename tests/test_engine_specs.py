"""The collective engine and its specification table, without MPI traffic.

- every row of ``SPECS`` carries its algorithms (a host run for each name,
  the ``algorithm=`` values and header codes unchanged);
- the cached host-allreduce plan sends the very row the general path's first
  round sends (header and payload bytes), on a stand-in transport of two
  ranks that records what goes out (the oracle: the general path);
- ``Communicator``'s collective methods are front ends: no closure, a few
  lines of code each (the algorithms live in ``commlib.collectives``).
"""
import ast
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from commlib.collective_api import ALGORITHMS  # noqa: E402
from commlib.collectives.engine import SPECS, Engine, FirstRoundRows  # noqa: E402
from commlib.core.agreement import FIELDS  # noqa: E402
from commlib.core.tags import TagAllocator  # noqa: E402

FRONT_ENDS = ("allreduce", "reduce_scatter", "allgather", "bcast", "alltoall", "barrier", "iallreduce",
              "ireduce_scatter", "iallgather", "ibcast", "ialltoall", "sendrecv_resilient")


def test_rows_carry_their_algorithms():
    assert ALGORITHMS == {
        "allreduce": ("auto", "ring", "recursive_doubling", "mpi"),
        "reduce_scatter": ("auto", "ring", "mpi"),
        "allgather": ("auto", "ring", "mpi"),
        "bcast": ("auto", "binomial", "mpi"),
        "alltoall": ("auto", "pairwise", "mpi"),
        "barrier": ("auto", "dissemination", "mpi"),
    }
    assert [s.code for s in SPECS.values()] == [1, 2, 3, 4, 5, 6]
    for spec in SPECS.values():
        assert set(spec.header) <= set(FIELDS)
        assert all(callable(spec.impl[name].run) for name in spec.algorithms[1:])
        assert callable(spec.prepare) and callable(spec.deliver)
    assert SPECS["allreduce"].small and SPECS["reduce_scatter"].small and SPECS["bcast"].small
    assert not SPECS["allgather"].small
    # the barrier agrees too (its algorithm), so a bad or mismatched one fails on every rank
    assert SPECS["barrier"].header == ("algorithm",)
    assert SPECS["allreduce"].impl["ring"].device is not None and SPECS["reduce_scatter"].impl["ring"].device
    assert SPECS["allreduce"].values({"count": 5, "dtype": 3, "op": 1, "algorithm": 2, "root": 9}) == [1, 5, 3, 1, 0, 2]


class _Mirror:
    """Two ranks, seen from rank 0: the other rank sends exactly what this one
    does (its all-gather hands this rank's row back twice, its sendrecv
    returns what was sent); every row that goes out is recorded."""

    size, rank, cuda_aware, fault_tolerant = 2, 0, False, False
    first_round_tags = None

    def __init__(self):
        self.sent, self.pending = [], {}
        self.tags = TagAllocator(0, 1 << 20)

    def has_native(self, what):
        return what == "allgather"

    def native_allgather(self, row, rows):
        self.sent.append(np.array(row, copy=True).tobytes())
        rows.reshape(2, -1)[...] = row

    def allgather_plan(self, row, rows):
        return lambda: self.native_allgather(row, rows)

    def sendrecv(self, sendbuf, dest, recvbuf, source, sendtag=0, recvtag=0):
        np.asarray(recvbuf).reshape(-1)[...] = np.asarray(sendbuf).reshape(-1)

    def irecv(self, buf, source, tag=0):
        self.pending[tag] = buf

    def isend(self, buf, dest, tag=0):
        np.asarray(self.pending.pop(tag)).reshape(-1)[...] = np.asarray(buf).reshape(-1)

    def waitall(self, requests, timeout=None, op="waitall"):
        pass


class _Comm:
    ft = None
    rank, size, failed_ranks = 0, 2, ()

    def __init__(self):
        self.transport = _Mirror()

    def collective_transport(self):
        return self.transport


class _Sub(np.ndarray):
    """Not an exact ndarray: the engine's general path."""


@pytest.mark.parametrize("count,algorithm", [(3, "auto"), (40, "auto"), (20000, "auto"), (20000, "ring"),  # even: equal ring chunks
                                             (700, "recursive_doubling")])
@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_cached_plan_sends_the_general_paths_row(count, algorithm, op):
    x = np.arange(count, dtype=np.float32) / 7
    comm = _Comm()
    eng = Engine(comm)
    fast = eng.allreduce(x.copy(), np.empty_like(x), op=op, algorithm=algorithm)
    assert eng._host.plans  # the call ran from a cached plan
    general = np.empty_like(x).view(_Sub)
    eng.execute("allreduce", x.copy().view(_Sub), general, op, algorithm)
    first_fast, first_general = comm.transport.sent[0], comm.transport.sent[1]
    assert first_fast == first_general  # header and payload, byte for byte
    assert fast.tobytes() == np.asarray(general).tobytes()


def test_first_round_rows_are_the_general_paths_geometry():
    """The kept rows hold agree()'s row: the header, then small_capacity bytes."""
    from commlib.collectives.agreement import encode_row
    from commlib.collectives.one_round import small_capacity

    kept = FirstRoundRows(_Mirror())
    assert kept.cap == small_capacity(2)
    assert kept.row.size == encode_row([0] * len(FIELDS), capacity=small_capacity(2)).size
    assert kept.rows.shape == (2, kept.row.size)


class _FaultTolerantMirror(_Mirror):
    """A fault-tolerant transport: MPI's own collectives must not be called."""

    fault_tolerant = True

    def native_allgather(self, row, rows):
        raise AssertionError("an MPI collective on a fault-tolerant transport")

    def allgather_plan(self, row, rows):
        raise AssertionError("a persistent MPI collective on a fault-tolerant transport")


@pytest.mark.parametrize("count", [3, 20000])
def test_fault_tolerant_first_round_is_point_to_point(count):
    """A fault-tolerant transport's first round is commlib's own all-gather:
    Open MPI's collectives free their pending sends when a request fails, and
    a freed send that fails later aborts the process (so the survivors of a
    death could not recover)."""
    from commlib.collectives.agreement import agree

    comm = _Comm()
    comm.transport = _FaultTolerantMirror()
    x = np.arange(count, dtype=np.float64)
    out = Engine(comm).execute("allreduce", x.copy().view(_Sub), np.empty_like(x).view(_Sub), "sum", "auto")
    assert np.asarray(out).tobytes() == (2 * x).tobytes()  # the mirror rank holds the same x
    rows = agree(comm.transport, [1, 2, 3], op="test", capacity=8)
    assert rows.shape[0] == 2


def test_front_ends_are_thin():
    src = (Path(__file__).resolve().parents[1] / "commlib" / "collective_api.py").read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "CollectiveMixin")
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    for name in FRONT_ENDS:
        f = methods[name]
        nested = [n for n in ast.walk(f) if n is not f and isinstance(n, (ast.FunctionDef, ast.Lambda))]
        assert not nested, f"{name} defines a closure"
        doc = f.body[0]
        doc_lines = doc.end_lineno - doc.lineno + 1 if isinstance(doc, ast.Expr) else 0
        assert f.end_lineno - f.lineno + 1 - doc_lines <= 30, name
