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

import functools

import numpy as np

from commlib.core.errors import InvalidArgument
from commlib.core.seconds import Deadline, call_deadline, check_timeout, time_left, timeout_problem

from ..agreement import agree_call

from .blocks import get_array_module
from .transport import transport_of

__all__ = [
    "LAYOUTS",
    "Layout",
    "Contiguous",
    "Striped",
    "Zigzag",
    "layout_of",
    "local_seq_len",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]


class Layout:
    """How a global sequence is spread over ``P`` ranks: one object per
    layout, parsed once from its name (:func:`layout_of`), owning everything
    that depends on it.

    Every method is pure (no communication) and the same on every rank:

    * :meth:`positions` / :meth:`all_positions`: the padded-global positions
      of a rank's local rows (ascending), and of every rank's (what the
      window's halo exchange computes its rows from, :mod:`.window`);
    * :meth:`unit` / :meth:`local_seq_len` / :meth:`seq_local_problem`: the
      lengths the layout can shard;
    * :meth:`local_start` / :meth:`gather_order`: shard and unshard (a
      slice, or a reorder of the rank-order concatenation of the shards);
    * :meth:`halves` / :meth:`piece_positions`: the two halves of a shard the
      bidirectional ring schedule sends round opposite ways;
    * :attr:`strided_groups`: which ranks form a Ulysses group of the
      hybrid's grid (``commlib.nn.hybrid``).

    Layouts compare equal to (and hash as) their name, and their ``repr``
    is their name's, so messages and sets written with names keep working.

    Attributes:
        name: ``"contiguous"``, ``"striped"`` or ``"zigzag"``.
        code: its index in :data:`LAYOUTS` (the agreed header's value).
    """

    name = ""
    #: the hybrid's Ulysses groups are strided (``g, g + R, ...``) rather than consecutive ranks
    strided_groups = False
    #: tokens a shard's length must be a multiple of
    _rows_unit = 1

    @property
    def code(self) -> int:
        return LAYOUTS.index(self.name)

    def unit(self, size: int) -> int:
        """A global length this layout shards without padding is a multiple of this."""
        return self._rows_unit * int(size)

    def local_seq_len(self, seq_len: int, size: int) -> int:
        """Tokens per rank, padding included, for a global length ``seq_len``."""
        return self._rows_unit * -(-int(seq_len) // self.unit(size))

    def seq_local_problem(self, seq_local: int):
        """A message when ``seq_local`` rows cannot be a shard of this layout, else None."""
        return None

    def positions(self, rank: int, size: int, seq_local: int) -> np.ndarray:
        """Padded-global positions (int64, ascending) of rank ``rank``'s ``seq_local`` rows."""
        raise NotImplementedError

    def all_positions(self, size: int, seq_local: int) -> tuple:
        """Every rank's :meth:`positions` (cached: read-only arrays)."""
        return _all_positions(self, int(size), int(seq_local))

    def local_start(self, rank: int, size: int, seq_local: int):
        """Where rank ``rank``'s rows start when they are one slice of the
        global sequence (shard by slicing), else None (shard by index)."""
        return None

    def gather_order(self, size: int, seq_local: int):
        """Where each global token sits in the rank-order concatenation of
        the shards (int64 ``(P * L,)``), or None when that concatenation is
        the natural order already."""
        return np.argsort(np.concatenate(self.all_positions(size, seq_local)), kind="stable")

    def halves(self, seq_local: int) -> tuple:
        """Local row indices of a shard's two halves (bidirectional ring):
        ``[0, ceil(L/2))`` and the rest; two sorted int64 arrays partitioning
        ``range(L)``."""
        h = -(-int(seq_local) // 2)
        return np.arange(0, h, dtype=np.int64), np.arange(h, int(seq_local), dtype=np.int64)

    def piece_positions(self, owner: int, size: int, seq_local: int, half=None) -> np.ndarray:
        """Global positions of ``owner``'s shard, or of one half of it (ascending int64)."""
        pos = self.positions(owner, size, seq_local)
        return pos if half is None else pos[self.halves(seq_local)[half]]

    def __eq__(self, other):
        if isinstance(other, Layout):
            return other.name == self.name
        return isinstance(other, str) and other == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return repr(self.name)

    def __str__(self):
        return self.name


class Contiguous(Layout):
    """Rank ``r`` holds ``[r * L, (r + 1) * L)`` (Ring Attention)."""

    name = "contiguous"

    def positions(self, rank, size, seq_local):
        n = int(seq_local)
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)

    def local_start(self, rank, size, seq_local):
        return int(rank) * int(seq_local)

    def gather_order(self, size, seq_local):
        return None


class Striped(Layout):
    """Token ``t`` on rank ``t mod P`` (Striped Attention)."""

    name = "striped"
    strided_groups = True

    def positions(self, rank, size, seq_local):
        return rank + size * np.arange(int(seq_local), dtype=np.int64)


class Zigzag(Layout):
    """Chunks ``r`` and ``2P - 1 - r`` of ``2P`` (ring-flash-attention)."""

    name = "zigzag"
    _rows_unit = 2

    def seq_local_problem(self, seq_local):
        return f"zigzag needs an even seq_local, got {int(seq_local)}" if int(seq_local) % 2 else None

    def positions(self, rank, size, seq_local):
        n = int(seq_local)
        if n % 2:
            raise InvalidArgument(self.seq_local_problem(n), rank=rank, op="sequence_positions")
        c = n // 2
        return np.concatenate([
            np.arange(rank * c, (rank + 1) * c, dtype=np.int64),
            np.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, dtype=np.int64),
        ])

    def halves(self, seq_local):
        """Each half takes the first (half 0) or second (half 1) half of *both*
        chunks of ``c = L/2`` rows: ``[0, h) + [c, c + h)`` and the rest, with
        ``h = ceil(c/2)`` (see :mod:`.schedule`)."""
        n = int(seq_local)
        c = n // 2
        h = -(-c // 2)
        first = np.concatenate([np.arange(0, h), np.arange(c, c + h)])
        second = np.concatenate([np.arange(h, c), np.arange(c + h, n)])
        return first.astype(np.int64), second.astype(np.int64)


#: the sequence layouts every ring variant and ``shard_sequence`` accept
LAYOUTS = ("contiguous", "striped", "zigzag")
_BY_NAME = {cls.name: cls() for cls in (Contiguous, Striped, Zigzag)}


@functools.lru_cache(maxsize=64)
def _all_positions(layout: Layout, size: int, seq_local: int) -> tuple:
    out = []
    for r in range(size):
        pos = layout.positions(r, size, seq_local)
        pos.flags.writeable = False
        out.append(pos)
    return tuple(out)


def layout_of(layout, *, rank=None, op="attention") -> Layout:
    """The :class:`Layout` of ``layout`` (a name of :data:`LAYOUTS`, or a
    :class:`Layout`, returned as it is).

    Raises:
        InvalidArgument: anything else, naming ``rank`` and ``op``.
    """
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str) and layout in _BY_NAME:
        return _BY_NAME[layout]
    raise InvalidArgument(f"layout {layout!r} is not one of {LAYOUTS}", rank=rank, op=op)


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


def local_seq_len(seq_len: int, size: int, layout="contiguous") -> int:
    """Tokens per rank, padding included, for a global length ``seq_len`` (:meth:`Layout.local_seq_len`)."""
    return layout_of(layout, op="local_seq_len").local_seq_len(seq_len, size)


def sequence_positions(layout, rank: int, size: int, seq_local: int) -> np.ndarray:
    """Padded-global positions of the ``seq_local`` tokens rank ``rank`` holds.

    Args:
        layout: one of :data:`LAYOUTS` (or a :class:`Layout`).
        rank: in ``[0, size)``.
        size: number of ranks ``P``.
        seq_local: tokens per rank ``L`` (even for zigzag).

    Returns:
        numpy.ndarray: int64 ``(seq_local,)``, sorted ascending.

    Raises:
        InvalidArgument: unknown layout, or an odd ``seq_local`` with zigzag.
    """
    return layout_of(layout, rank=rank, op="sequence_positions").positions(rank, size, seq_local)


def shard_sequence(x, comm, layout: str = "contiguous", *, axis: int = 1, pad: bool = True):
    """This rank's shard of a global array (no communication).

    A length the layout cannot divide (``P``; ``2P`` for zigzag) is
    zero-padded at the sequence's global end to ``P * seq_local`` tokens (see
    :func:`local_seq_len`), as :func:`commlib.nn.shard_sequence` does: pass
    the true ``seq_len`` to the attention call so the padding is masked, and
    to :func:`unshard_sequence` to drop it.

    Args:
        x: global array (numpy or CuPy), identical on every rank, sequence on ``axis``.
        comm: the :class:`commlib.Communicator` (only ``rank`` and ``size`` are used).
        layout: one of :data:`LAYOUTS`.
        axis: the sequence axis (default 1, as in ``(batch, seq, heads, head_dim)``).
        pad: zero-pad a length the layout cannot divide (default); False
            refuses it.

    Returns:
        tuple: ``(x_local, positions)``: the contiguous shard with ``seq_local``
        tokens on ``axis``, and its int64 padded-global positions (entries
        ``>= seq_len`` are padding), e.g. for rotary embeddings.

    Raises:
        InvalidArgument: a torch tensor (use :func:`commlib.nn.shard_sequence`,
            which keeps autograd), unknown layout, ``axis`` out of range, or
            with ``pad=False`` a length the layout cannot divide.
    """
    op = "shard_sequence"
    refuse_torch(x, "x", rank=comm.rank, op=op)
    layout = layout_of(layout, rank=comm.rank, op=op)
    if not -x.ndim <= axis < x.ndim:
        raise InvalidArgument(f"axis {axis} out of range for a {x.ndim}-d array", rank=comm.rank, op=op)
    xp = get_array_module(x)
    axis %= x.ndim
    n = x.shape[axis]
    if not pad and n % layout.unit(comm.size):
        raise InvalidArgument(f"sequence length {n} is not divisible by {layout.unit(comm.size)} ({comm.size} ranks, "
                              f"layout {layout!r}) and pad=False; pad=True (the default) zero-pads it at the end "
                              "(mask the padding in attention), or choose another length", rank=comm.rank, op=op)
    L = layout.local_seq_len(n, comm.size)
    pos = layout.positions(comm.rank, comm.size, L)
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
        xp, axis, L, n, layout = _unshard_local(x_local, rank, size, layout, seq_len, axis, timeout, op)
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
        idx[axis] = xp.asarray(layout.positions(r, size, L))
        full[tuple(idx)] = parts[r]
    idx = [slice(None)] * mine.ndim
    idx[axis] = slice(0, n)
    return full[tuple(idx)]


#: the header fields of an :func:`unshard_sequence` call (dims past the 8th fold into ``dim7``)
_UNSHARD_FIELDS = ("ndim", "axis", "layout", "seq_len", "dtype") + tuple(f"dim{i}" for i in range(8))


def _unshard_local(x_local, rank, size, layout, seq_len, axis, timeout, op):
    """This rank's checks of an :func:`unshard_sequence` call: ``(xp, axis, seq_local, seq_len, Layout)``.

    Raises:
        InvalidArgument: naming ``rank`` and ``op``.
    """
    refuse_torch(x_local, "x_local", rank=rank, op=op)
    layout = layout_of(layout, rank=rank, op=op)
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
    if layout.local_seq_len(n, size) != L:
        raise InvalidArgument(
            f"seq_local {L} does not match seq_len {n} on {size} ranks with layout {layout!r} "
            f"(expected {layout.local_seq_len(n, size)})", rank=rank, op=op)
    return xp, axis, L, n, layout


def _unshard_header(x, axis, layout, n) -> tuple:
    """The call as the ints of :data:`_UNSHARD_FIELDS` (the dtype name's first 8 bytes)."""
    dims = [int(d) for d in x.shape[:7]] + [int(np.prod(x.shape[7:], dtype=np.int64))] if x.ndim > 7 else \
        [int(d) for d in x.shape] + [-1] * (8 - x.ndim)
    name = np.dtype(x.dtype).name.encode()[:8].ljust(8, b"\0")
    return (x.ndim, axis, layout.code, n, int(np.frombuffer(name, np.int64)[0]), *dims)


def _describe_unshard(name: str, value: int):
    if name == "dtype":
        return np.int64(value).tobytes().rstrip(b"\0").decode(errors="replace")
    if name == "layout":
        return repr(LAYOUTS[value])
    return value
