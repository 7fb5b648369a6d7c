"""Reference results shared by the collective tests and the fault-injection worker.

Written from the algorithms' definitions with numpy alone: nothing here comes
from commlib (its chunking, ring order or operator table), so a wrong helper
there cannot cancel out against the same helper here.
"""
import numpy as np

# MPI's predefined reductions as numpy ufuncs; "avg" is a sum followed by one
# division by the number of contributions, in the array's own dtype
UFUNCS = {
    "sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}


def ring_oracle(inputs, op="sum"):
    """The allreduce of ``inputs`` (one array per rank, in rank order) in the
    ring's fixed reduction order: what every rank must hold bit for bit.

    The ring reduce-scatter (Patarasuk & Yuan 2009) cuts the vector of
    ``count`` elements into ``n`` chunks, the first ``count % n`` of them one
    element longer than the rest.  Chunk ``c`` starts at rank ``c + 1``, goes
    once around the ring (``c + 1 -> c + 2 -> ... -> c``, modulo ``n``), each
    rank combining its own piece into the partial it received, and is complete
    at rank ``c``; the all-gather then only copies.  So chunk ``c`` of the
    result is ``((x[c+1] op x[c+2]) op ...) op x[c]``, left to right.

    Args:
        inputs: ``n`` arrays of one dtype and size.
        op: a name in :data:`UFUNCS`.

    Returns:
        np.ndarray: a new array shaped and typed like ``inputs[0]``.
    """
    ufunc = UFUNCS[op]
    n = len(inputs)
    flat = [np.ascontiguousarray(x).reshape(-1) for x in inputs]
    count = flat[0].size
    base, extra = divmod(count, n)
    out = np.empty(count, dtype=flat[0].dtype)
    start = 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        acc = flat[(c + 1) % n][start:stop].copy()
        for k in range(2, n + 1):
            acc = ufunc(acc, flat[(c + k) % n][start:stop]).astype(acc.dtype, copy=False)
        if op == "avg":
            acc = np.divide(acc, np.asarray(n, dtype=acc.dtype)).astype(acc.dtype, copy=False)
        out[start:stop] = acc
        start = stop
    return out.reshape(np.shape(inputs[0]))


def ftcs_heat(grid, c, steps):
    """The 3-D heat field after ``steps`` explicit (FTCS) steps from
    ``sin(pi x) sin(pi y) sin(pi z)`` on ``grid`` interior points (zero
    boundary, ``x_k = (k + 1) / (n + 1)``), with ``c[i] = alpha dt / h_i^2``:
    plain numpy on the whole grid, in the heat app's per-cell order of
    operations (so bit-comparable with it).

    Returns:
        np.ndarray: the interior, shaped ``grid``, float64.
    """
    x = [np.sin(np.pi * (np.arange(1, m + 1) / (m + 1))) for m in grid]
    u = np.zeros([m + 2 for m in grid])
    u[1:-1, 1:-1, 1:-1] = x[0][:, None, None] * x[1][None, :, None] * x[2][None, None, :]
    inner = (slice(1, -1),) * 3
    for _ in range(steps):
        centre, acc = u[inner], None
        for i in range(3):
            lo, hi = list(inner), list(inner)
            lo[i], hi[i] = slice(0, -2), slice(2, None)
            term = c[i] * (u[tuple(lo)] - 2.0 * centre + u[tuple(hi)])
            acc = term if acc is None else acc + term
        un = u.copy()
        un[inner] = centre + acc
        u = un
    return u[inner]
