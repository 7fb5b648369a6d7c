"""Sequence layouts: which global tokens each rank holds.

With ``P`` ranks and a global sequence of ``seq_len`` tokens padded to
``P * seq_local``:

* ``"contiguous"``: rank ``r`` holds ``[r * L, (r + 1) * L)`` (Ring Attention,
  Liu et al. 2023, arXiv:2310.01889).  Causal masking leaves rank 0 nearly idle
  and rank ``P-1`` with all the work.
* ``"striped"``: token ``t`` on rank ``t mod P`` (Striped Attention, Brandon et
  al. 2023, arXiv:2311.09431): every block is about half visible.
* ``"zigzag"``: the sequence is cut in ``2P`` chunks of ``c = L / 2``; rank
  ``r`` holds chunks ``r`` and ``2P - 1 - r`` (the zigzag layout of
  ring-flash-attention, github.com/zhuzilin/ring-flash-attention): every
  off-diagonal block is exactly half visible.

Padding always sits at the global end (positions ``>= seq_len``), so on every
rank the local positions are sorted ascending and the padding is a suffix.
``seq_local`` for a given ``seq_len`` is ``ceil(seq_len / P)`` (contiguous,
striped) or ``2 * ceil(seq_len / (2P))`` (zigzag).
"""
from __future__ import annotations

import numpy as np

from commlib.core.errors import InvalidArgument
from commlib.core.seconds import Deadline, call_deadline, check_timeout, time_left, timeout_problem

from ..agreement import agree_call

from .blocks import get_array_module
from .transport import transport_of

__all__ = [
    "LAYOUTS",
    "check_layout",
    "local_seq_len",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]

LAYOUTS = ("contiguous", "striped", "zigzag")


def check_layout(layout, *, rank=None, op="attention") -> str:
    """Return ``layout`` if it is one of :data:`LAYOUTS`.

    Raises:
        InvalidArgument: unknown layout.
    """
    if layout not in LAYOUTS:
        raise InvalidArgument(f"layout {layout!r} is not one of {LAYOUTS}", rank=rank, op=op)
    return layout


def refuse_torch(x, name: str, *, rank=None, op: str) -> None:
    """Refuse a torch tensor given to a numpy/CuPy sequence call: its result
    would be a numpy array, the tensor's autograd graph silently lost.

    Raises:
        InvalidArgument: ``x`` is a torch tensor; the message points to the
            torch twin in :mod:`commlib.nn`.
    """
    if type(x).__module__.split(".")[0] == "torch":
        raise InvalidArgument(f"{name} is a {type(x).__module__}.{type(x).__name__}: commlib.{op} takes numpy or "
                              f"CuPy arrays (a torch tensor would come back as numpy, its autograd graph lost); "
                              f"use commlib.nn.{op} (or commlib.nn.Sharding(comm, layout)), which keeps autograd",
                              rank=rank, op=op)


def agreement_bound(timeout):
    """The bound of an argument agreement's waits: the call's ``timeout`` when it
    is valid (its :class:`~commlib.core.seconds.Deadline` as it is: the
    agreement waits what is left of it), else None (the rank that refused its
    own timeout still takes part, on the same point-to-point all-gather as the others)."""
    if timeout is None or timeout_problem(timeout) is not None:
        return None
    return timeout if type(timeout) is Deadline else float(timeout)


def local_seq_len(seq_len: int, size: int, layout: str = "contiguous") -> int:
    """Tokens per rank, padding included, for a global length ``seq_len``."""
    check_layout(layout, op="local_seq_len")
    if layout == "zigzag":
        return 2 * (-(-int(seq_len) // (2 * size)))
    return -(-int(seq_len) // size)


def sequence_positions(layout: str, rank: int, size: int, seq_local: int) -> np.ndarray:
    """Padded-global positions of the ``seq_local`` tokens rank ``rank`` holds.

    Args:
        layout: one of :data:`LAYOUTS`.
        rank: in ``[0, size)``.
        size: number of ranks ``P``.
        seq_local: tokens per rank ``L`` (even for zigzag).

    Returns:
        numpy.ndarray: int64 ``(seq_local,)``, sorted ascending.

    Raises:
        InvalidArgument: unknown layout, or an odd ``seq_local`` with zigzag.
    """
    check_layout(layout, rank=rank, op="sequence_positions")
    n = int(seq_local)
    if layout == "contiguous":
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)
    if layout == "striped":
        return rank + size * np.arange(n, dtype=np.int64)
    if n % 2:
        raise InvalidArgument(f"zigzag needs an even seq_local, got {n}", rank=rank, op="sequence_positions")
    c = n // 2
    return np.concatenate([
        np.arange(rank * c, (rank + 1) * c, dtype=np.int64),
        np.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, dtype=np.int64),
    ])


def shard_sequence(x, comm, layout: str = "contiguous", *, axis: int = 1):
    """This rank's shard of a global array (no communication).

    The sequence axis is zero-padded at its end to ``P * seq_local`` tokens
    (see :func:`local_seq_len`); pass the true ``seq_len`` to the attention
    call so padding is masked.

    Args:
        x: global array (numpy or CuPy), identical on every rank, sequence on ``axis``.
        comm: the :class:`commlib.Communicator` (only ``rank`` and ``size`` are used).
        layout: one of :data:`LAYOUTS`.
        axis: the sequence axis (default 1, as in ``(batch, seq, heads, head_dim)``).

    Returns:
        tuple: ``(x_local, positions)``: the contiguous shard with ``seq_local``
        tokens on ``axis``, and its int64 padded-global positions (entries
        ``>= seq_len`` are padding), e.g. for rotary embeddings.

    Raises:
        InvalidArgument: a torch tensor (use :func:`commlib.nn.shard_sequence`,
            which keeps autograd), unknown layout or ``axis`` out of range.
    """
    op = "shard_sequence"
    refuse_torch(x, "x", rank=comm.rank, op=op)
    check_layout(layout, rank=comm.rank, op=op)
    if not -x.ndim <= axis < x.ndim:
        raise InvalidArgument(f"axis {axis} out of range for a {x.ndim}-d array", rank=comm.rank, op=op)
    xp = get_array_module(x)
    axis %= x.ndim
    n = x.shape[axis]
    L = local_seq_len(n, comm.size, layout)
    pos = sequence_positions(layout, comm.rank, comm.size, L)
    valid = pos[pos < n]
    idx = [slice(None)] * x.ndim
    idx[axis] = xp.asarray(valid)
    part = x[tuple(idx)]
    if len(valid) < L:
        pad = list(part.shape)
        pad[axis] = L - len(valid)
        part = xp.concatenate([part, xp.zeros(pad, dtype=x.dtype)], axis=axis)
    return xp.ascontiguousarray(part), pos


def unshard_sequence(x_local, comm, layout: str = "contiguous", seq_len: int | None = None, *, axis: int = 1,
                     timeout: float | None = None):
    """Gather every rank's shard into the global array, on every rank.

    The inverse of :func:`shard_sequence`: an allgather written over the
    ``isend``/``irecv`` of the communicator's collectives transport (see
    :func:`.transport.transport_of`), then reordering by position and dropping
    the padding.

    Args:
        x_local: this rank's shard, ``seq_local`` tokens on ``axis``; same shape
            and dtype on every rank.
        comm: the :class:`commlib.Communicator`.
        layout: the layout the shards are in.
        seq_len: true global length (default ``P * seq_local``, no padding).
        axis: the sequence axis.
        timeout: the deadline of the whole call, in seconds (finite, > 0; None: no limit).

    Returns:
        array: ``seq_len`` tokens on ``axis``, same module and dtype as ``x_local``.

    Raises:
        InvalidArgument: a torch tensor (use :func:`commlib.nn.unshard_sequence`),
            unknown layout, bad axis, ``seq_len`` or ``timeout``,
            ``seq_local`` inconsistent with ``seq_len``, or shards whose shape,
            dtype, axis, layout or ``seq_len`` differ between ranks: on every
            rank alike, before any shard is sent (the argument agreement of
            :mod:`commlib.collectives.agreement`).
        CommTimeout: ``timeout`` passed.
        CommError: a peer failed (``ProcessFailed``) or another transport error.
    """
    op = "unshard_sequence"
    timeout = call_deadline(timeout, op)  # the deadline of the whole call: every wait gets what is left
    tp = transport_of(comm, timeout, op)
    tag = tp.tags.slot(1)
    rank, size = tp.rank, tp.size
    problem, header = None, ()
    try:
        xp, axis, L, n = _unshard_local(x_local, rank, size, layout, seq_len, axis, timeout, op)
        header = _unshard_header(x_local, axis, layout, n)
    except InvalidArgument as exc:
        problem = exc
    # as the attention calls: one round, did any rank refuse and do the calls agree
    agree_call(tp, header, op=op, names=_UNSHARD_FIELDS, local_error=problem, timeout=agreement_bound(timeout),
               describe=_describe_unshard)
    mine = xp.ascontiguousarray(x_local)
    parts = [None] * size
    parts[rank] = mine
    reqs = []
    for i in range(1, size):
        src = (rank - i) % size
        parts[src] = xp.empty_like(mine)
        reqs.append(tp.irecv(parts[src], src, tag))
    for i in range(1, size):
        reqs.append(tp.isend(mine, (rank + i) % size, tag))
    tp.waitall(reqs, time_left(timeout), op=op)
    shape = list(mine.shape)
    shape[axis] = size * L
    full = xp.empty(shape, dtype=mine.dtype)
    for r in range(size):
        idx = [slice(None)] * mine.ndim
        idx[axis] = xp.asarray(sequence_positions(layout, r, size, L))
        full[tuple(idx)] = parts[r]
    idx = [slice(None)] * mine.ndim
    idx[axis] = slice(0, n)
    return full[tuple(idx)]


#: the header fields of an :func:`unshard_sequence` call (dims past the 8th fold into ``dim7``)
_UNSHARD_FIELDS = ("ndim", "axis", "layout", "seq_len", "dtype") + tuple(f"dim{i}" for i in range(8))


def _unshard_local(x_local, rank, size, layout, seq_len, axis, timeout, op):
    """This rank's checks of an :func:`unshard_sequence` call: ``(xp, axis, seq_local, seq_len)``.

    Raises:
        InvalidArgument: naming ``rank`` and ``op``.
    """
    refuse_torch(x_local, "x_local", rank=rank, op=op)
    check_layout(layout, rank=rank, op=op)
    check_timeout(timeout, op=op, rank=rank)
    if not hasattr(x_local, "shape") or not hasattr(x_local, "dtype"):
        raise InvalidArgument(f"x_local must be a numpy or CuPy array, got {type(x_local).__name__}", rank=rank, op=op)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -x_local.ndim <= axis < x_local.ndim:
        raise InvalidArgument(f"axis {axis!r} out of range for a {x_local.ndim}-d array", rank=rank, op=op)
    xp = get_array_module(x_local)
    axis = int(axis) % x_local.ndim
    L = int(x_local.shape[axis])
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer))
                                or seq_len < 0):
        raise InvalidArgument(f"seq_len must be a non-negative int, got {seq_len!r}", rank=rank, op=op)
    n = size * L if seq_len is None else int(seq_len)
    if local_seq_len(n, size, layout) != L:
        raise InvalidArgument(
            f"seq_local {L} does not match seq_len {n} on {size} ranks with layout {layout!r} "
            f"(expected {local_seq_len(n, size, layout)})", rank=rank, op=op)
    return xp, axis, L, n


def _unshard_header(x, axis, layout, n) -> tuple:
    """The call as the ints of :data:`_UNSHARD_FIELDS` (the dtype name's first 8 bytes)."""
    dims = [int(d) for d in x.shape[:7]] + [int(np.prod(x.shape[7:], dtype=np.int64))] if x.ndim > 7 else \
        [int(d) for d in x.shape] + [-1] * (8 - x.ndim)
    name = np.dtype(x.dtype).name.encode()[:8].ljust(8, b"\0")
    return (x.ndim, axis, LAYOUTS.index(layout), n, int(np.frombuffer(name, np.int64)[0]), *dims)


def _describe_unshard(name: str, value: int):
    if name == "dtype":
        return np.int64(value).tobytes().rstrip(b"\0").decode(errors="replace")
    if name == "layout":
        return repr(LAYOUTS[value])
    return value
