"""The one-round small collective: every rank's data rides in the first round's row.

A small ``algorithm="auto"`` allreduce, reduce_scatter or bcast needs no
second round of messages: the engine's first round (one all-gather of a
fixed-size row per rank, :func:`commlib.collectives.engine.first_round`)
already carries up to :func:`small_capacity` payload bytes per rank, so every
rank holds every rank's data afterwards.  Each rank then combines the gathered
payloads locally in the order the ring allreduce and reduce-scatter use
(:func:`ring_order_steps`), so all ranks compute the same bits, and the same
bits as a ring call of the same data.

No communication here: the functions read the gathered payloads
(``uint8``, shape ``(size, capacity)``) and write host arrays.
"""
from __future__ import annotations

import numpy as np

from commlib.core.agreement import FIELDS
from commlib.core.config import config

from ._common import chunk_bounds_list

__all__ = ["SMALL", "small_capacity", "ring_order_steps", "apply_steps", "reduce_rows", "root_payload", "COMMUTATIVE"]

#: header code of the one-round small path (the ``algorithm`` field of a small ``"auto"`` call)
SMALL = 0
#: bytes of a first-round row before its payload: the error flag and the header fields, int64
HEAD_BYTES = 8 * (1 + len(FIELDS))
#: ops whose IEEE 754 (or bitwise) combination is exactly commutative
COMMUTATIVE = ("sum", "prod", "avg", "band", "bor", "bxor")


def small_capacity(size: int) -> int:
    """Payload bytes a first-round row carries on a group of ``size`` ranks:
    ``COMMLIB_SMALL_BYTES``, capped so that a row gathered from every rank stays
    within 64 KiB (the first round must stay cheap for large calls too)."""
    return max(0, min(config.small_bytes, 65536 // max(size, 1) - HEAD_BYTES)) // 8 * 8


def ring_order_steps(parts: list, count: int, op) -> list:
    """The ring's reduction order over per-rank operands, as steps for :func:`apply_steps`.

    Element ``j`` of chunk ``c`` (``chunk_bounds(count, size)``) combines the
    ranks in :func:`~commlib.collectives.reduce_scatter_ring.ring_order` ``(c)``
    (``c+1, c+2, ...`` mod size), the order the ring allreduce and
    reduce_scatter use, so a one-round call and a ring call of the same data
    give the same bits.

    Args:
        parts: one 1-D array of ``count`` elements per rank, in rank order.
        count: elements per rank.
        op: an :class:`~commlib.collectives.ops.Op`.

    Returns:
        list of ``(lo, hi, operands)``: elements ``[lo, hi)`` combine ``operands`` left to right.
    """
    n = len(parts)
    if n == 2 and op.name in COMMUTATIVE:
        # ring order at 2 ranks is (1, 0) for chunk 0 and (0, 1) for chunk 1;
        # IEEE 754 + and *, and the bitwise ops, are exactly commutative, so
        # one call over the whole vector gives the ring's bits
        return [(0, count, parts)]
    b = chunk_bounds_list(count, n)
    return [(b[c], b[c + 1], [parts[(c + 1 + k) % n][b[c]:b[c + 1]] for k in range(n)])
            for c in range(n) if b[c + 1] > b[c]]


def apply_steps(steps: list, ufunc, out: np.ndarray) -> None:
    """Combine each step's operands left to right with ``ufunc`` into ``out[lo:hi]`` (1-D)."""
    if len(steps) == 1 and len(steps[0][2]) == 2:  # the 2-rank commutative case: one call
        lo, hi, (a, b) = steps[0]
        ufunc(a, b, out=out if hi - lo == out.shape[0] else out[lo:hi])
        return
    whole = out.shape[0]
    for lo, hi, operands in steps:
        dst = out if hi - lo == whole else out[lo:hi]
        if len(operands) == 1:
            dst[...] = operands[0]
            continue
        ufunc(operands[0], operands[1], out=dst)
        for p in operands[2:]:
            ufunc(dst, p, out=dst)


def reduce_rows(payloads: np.ndarray, dtype, count: int, op, out: np.ndarray) -> None:
    """Reduce the ranks' first-round payloads into ``out`` in the ring's order
    (:func:`ring_order_steps`; bit-identical on every rank).

    Args:
        payloads: uint8, shape ``(size, capacity)`` from the first round, or a
            sequence of ``size`` uint8 rows (:func:`.pair_round.pair_first_round`).
        dtype, count: the elements in each payload.
        op: an :class:`~commlib.collectives.ops.Op`.
        out: 1-D host array of ``count`` elements of ``dtype``.
    """
    nb = count * np.dtype(dtype).itemsize
    parts = [np.ascontiguousarray(p[:nb]).view(dtype) for p in payloads]
    apply_steps(ring_order_steps(parts, count, op), op.ufunc, out)
    op.finalize(out, len(parts))


def root_payload(payloads: np.ndarray, root: int, out: np.ndarray) -> None:
    """The one-round bcast: copy rank ``root``'s payload into the 1-D host array ``out``."""
    out[...] = np.ascontiguousarray(payloads[root, :out.nbytes]).view(out.dtype)
