"""Reference results shared by the collective tests and the fault-injection worker."""
import numpy as np

from commlib.collectives._common import chunk_bounds
from commlib.collectives.ops import get_op
from commlib.collectives.reduce_scatter_ring import ring_order


def ring_oracle(inputs, op="sum"):
    """The allreduce of ``inputs`` (one array per rank) in the ring's fixed
    reduction order, chunk by chunk: what every rank must hold bit for bit."""
    o = get_op(op)
    n = len(inputs)
    out = np.empty_like(inputs[0])
    b = chunk_bounds(out.size, n)
    for c in range(n):
        order = ring_order(c, n)
        acc = inputs[order[0]][b[c]:b[c + 1]].copy()
        for r in order[1:]:
            o.reduce(acc, inputs[r][b[c]:b[c + 1]])
        o.finalize(acc, n)
        out[b[c]:b[c + 1]] = acc
    return out
