"""The one-shot all-reduce's first round: every rank's header row and whole vector to every rank.

A one-shot all-reduce (the name NCCL-derived libraries such as TensorRT-LLM give
it) is an all-gather of the ranks' whole vectors, each rank then reducing the
``n`` vectors itself.  Here the all-gather is Bruck's (Bruck et al., IEEE TPDS
8(11), 1997; :mod:`.allgather_bruck`: ``ceil(log2 n)`` steps) and each block is
a rank's first-round message, ``[header row | vector]``, so the argument
agreement costs no message of its own: every rank receives every header and
compares each with its own before anything is reduced.  The reduction is in
the ring's order (:func:`.one_round.reduce_rows`), bit-identical on every rank.

On 3 ranks this is 2 messages a rank of one vector each, against recursive
doubling's fold-in, exchange and fold-out (its busiest rank moves as many
vectors, in 3 messages) after an argument agreement of 2 more; on 2 ranks it
is the pair exchange (:mod:`.pair_round`); from 4 ranks each rank moves
``n - 1`` vectors where recursive doubling moves ``log2 n``.

Step ``k = 1, 2, 4, ...`` goes to rank ``r + k`` and comes from ``r - k``, the
way a ring's first step goes, under the first tag of the first-round
allocator: a rank whose call differs and chose the ring
(:class:`.agreement.RingHead`) or the mirrored all-gather of :func:`.agreement.agree`
meets this message, of another size, and fails its receive at once.  The caller
makes a refusal that only some ranks see every rank's (the elastic master's
verdict).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from commlib.core.errors import MessageSizeMismatch

from ._common import next_tag, waitall
from .agreement import encode_row, difference, size_refusal
from .allgather_bruck import bruck_steps

__all__ = ["one_shot_first_round", "one_shot_bytes"]


def one_shot_bytes(nfields: int, size: int, vector_nbytes: int) -> int:
    """Scratch bytes :func:`one_shot_first_round` needs: the ``size - 1`` other
    ranks' messages, ``8 * (1 + nfields) + vector_nbytes`` bytes each."""
    return (size - 1) * (8 * (1 + nfields) + vector_nbytes)


def one_shot_first_round(first, values: Sequence[int], *, op: str, vector: np.ndarray, keep: np.ndarray,
                         timeout: float | None = None, names: Sequence[str], describe=None) -> list:
    """All-gather every rank's ``[header row | vector]``, comparing headers as they come.

    Args:
        first: the group's transport as the first round uses it (its ``tags`` the
            first-round allocator; single-frame messages; gather sends, so
            ``vector`` is sent as it is, never copied or written).
        values: this rank's header ints (the same count on every rank).
        op: operation name for errors.
        vector: 1-D contiguous host array, this rank's input.
        keep: uint8 scratch of at least :func:`one_shot_bytes` bytes.
        timeout: seconds each wait may take.
        names, describe: field names and value formatter for the mismatch message.

    Returns:
        list: ``size`` uint8 arrays of ``vector.nbytes`` bytes in rank order,
        rank ``r``'s a view of ``vector``, the others views of ``keep``.

    Raises:
        NeighbourRefusal: a received header differs from this rank's, or a
            message has another size (the sender's call differs); only the
            ranks that received it know.
        ProcessFailed / CommTimeout: from the transport.
    """
    n, r = first.size, first.rank
    head = 8 * (1 + len(values))
    mine = vector.reshape(-1).view(np.uint8)
    msg = head + mine.nbytes
    row = encode_row(values)
    own = row.tobytes()
    got = keep[:(n - 1) * msg]  # block i: rank (r - 1 - i) % n's message
    tag = next_tag(first)
    for k, m, have in bruck_steps(n):  # Bruck's schedule, mirrored: to r + k, from r - k
        source = (r - k) % n
        into = got[(have - 1) * msg:(have - 1 + m) * msg]
        rq = first.irecv(into, source, tag)
        # the first m blocks this rank holds: its own, then ranks r - 1, r - 2, ...
        sq = first.isend((row, mine, got[:(m - 1) * msg]) if m > 1 else (row, mine), (r + k) % n, tag)
        try:
            waitall(first, [rq], timeout)
        except MessageSizeMismatch as exc:
            raise size_refusal(names, describe, values, r, source, op, exc.head) from None
        for j in range(m):
            theirs = into[j * msg:j * msg + head]
            if theirs.tobytes() != own:
                raise difference(names, describe, values, theirs.view(np.int64), r, (source - j) % n, op)
        waitall(first, [sq], timeout)
    out = [mine] * n
    for i in range(n - 1):
        out[(r - 1 - i) % n] = got[i * msg + head:(i + 1) * msg]
    return out
