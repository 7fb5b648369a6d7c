"""A small allreduce (the one-round path: the first round carries every rank's
vector and each rank reduces them itself) gives the ring's bits, at 3 and 4 ranks.

At 2 ranks any order gives the same bits (IEEE 754 + and * are commutative); from
3 ranks on, the association matters, and the one-round path must combine chunk
``c`` over ranks ``c+1, c+2, ..., c`` (mod size), as the ring does, so a
one-round call and a ring call of the same data agree bit for bit.  Without this
file, a one-round reduction that starts at rank ``c`` instead passed every MPI
test (``tests/mutations/07-wrong-reduction-order.patch``).

Oracle, written here (not commlib's ``ring_order`` or ``chunk_bounds``): chunks as
``numpy.array_split``, combined left to right in the vector's dtype.
"""
import numpy as np
import pytest

import commlib

pytestmark = pytest.mark.mpi(min_size=3)


@pytest.fixture(scope="module")
def comm():
    return commlib.init()


def _inputs(size, dtype, count, seed):
    return [np.random.default_rng([seed, r]).uniform(0.5, 1.5, count).astype(dtype) for r in range(size)]


def _ring_order_oracle(inputs, ufunc):
    n = len(inputs)
    out = np.empty_like(inputs[0])
    for c, ix in enumerate(np.array_split(np.arange(out.size), n)):
        if ix.size == 0:
            continue
        lo, hi = int(ix[0]), int(ix[-1]) + 1
        acc = inputs[(c + 1) % n][lo:hi].copy()
        for k in range(2, n + 1):
            ufunc(acc, inputs[(c + k) % n][lo:hi], out=acc)
        out[lo:hi] = acc
    return out


@pytest.mark.parametrize("algorithm", ["auto", "ring"])
@pytest.mark.parametrize("op", ["sum", "prod"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [3, 17, 100])
def test_small_allreduce_in_ring_order(comm, algorithm, op, dtype, count):
    seed = 4000 + count
    inputs = _inputs(comm.size, dtype, count, seed)
    x = inputs[comm.rank].copy()
    out = comm.allreduce(x, np.empty_like(x), op=op, algorithm=algorithm)
    want = _ring_order_oracle(inputs, {"sum": np.add, "prod": np.multiply}[op])
    assert out.tobytes() == want.tobytes(), (
        f"rank {comm.rank}: {algorithm} {op} {np.dtype(dtype).name} x{count} (seed {seed}): "
        f"{int((out != want).sum())} elements differ from the ring order's bits")
