"""Ring reduce-scatter (the first half of the ring allreduce).

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2), 2009: the vector is cut into
``n`` chunks; in ``n - 1`` steps every rank sends one chunk to its right
neighbour ``(r + 1) % n``, receives one from its left neighbour and adds its own
contribution.  Each rank sends and receives ``(n - 1)/n`` of the vector.

Reduction order (fixed, hence bit-identical results): chunk ``c`` is accumulated
along the ring starting at rank ``c + 1``::

    x[c+1] (op) x[c+2] (op) ... (op) x[c]      (ranks mod n, left to right)

and ends, fully reduced, on rank ``c``.  :func:`ring_order` gives that order.
"""
from __future__ import annotations

import functools

import numpy as np

from commlib.core.errors import MessageSizeMismatch
from commlib.core.seconds import deadline_of

from ._common import exchange, next_tag, waitall
from .ops import get_op

__all__ = ["reduce_scatter_ring", "reduce_scatter_ring_inplace", "ring_order"]


def ring_order(chunk: int, size: int) -> list[int]:
    """Ranks in the order their contributions to ``chunk`` are combined."""
    return [(chunk + 1 + k) % size for k in range(size)]


def reduce_scatter_ring_inplace(transport, work: np.ndarray, op, bounds, *,
                                timeout: float | None = None, tmp: np.ndarray | None = None,
                                src: np.ndarray | None = None, save=None, head=None) -> None:
    """Reduce-scatter ``work`` in place over the ring.

    Args:
        transport: a :class:`commlib.transports.base.Transport`.
        work: 1-D contiguous host array, this rank's contribution; overwritten.
            On return ``work[bounds[r]:bounds[r+1]]`` holds the reduced chunk
            ``r`` (other chunks hold partial sums).
        op: :class:`commlib.collectives.ops.Op` or name.
        bounds: chunk offsets, ``size + 1`` ints (see ``chunk_bounds``; a list
            or tuple of Python ints is used as is).
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.
        tmp: scratch of at least the largest chunk (allocated when None or
            smaller); used in place only (out of place each partial is
            received straight into the ``work`` chunk it is combined into).
        src: this rank's contribution when it is not ``work`` (same size and
            dtype; not modified): saves copying it into ``work`` first.  Chunk
            ``(r - 1) % n`` of ``work`` is then left unset (an allgather fills it).
        save: a :class:`.snapshot.LazySnapshot` of ``work`` (in place only): each
            chunk is copied into it just before it is first overwritten, while
            that step's messages are in flight, so the copy hides behind the
            transfer.  The last step also saves chunk ``(r - 1) % n``, the
            one the allgather overwrites first.
        head: a :class:`.agreement.RingHead`: the first step carries the
            argument agreement (the header row in front of the first chunk, under
            the first-round tag), and the left neighbour's row is compared before
            its chunk is combined (the elastic peer's argument agreement,
            :meth:`commlib.elastic.Peer.allreduce`); raises its
            :class:`~.agreement.NeighbourRefusal` with that step's requests
            still posted: the caller aborts their tags.

    Raises:
        CommTimeout: a step did not finish within ``timeout``.
        ProcessFailed / CommError: from the transport (classified), when a peer fails.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    op = get_op(op)
    n, r = transport.size, transport.rank
    if n == 1:
        return
    if type(bounds) is not list and type(bounds) is not tuple:
        bounds = [int(x) for x in bounds]
    if src is work:
        src = None
    # Out of place, chunk rc of ``work`` is not written before step s receives
    # it (step s writes only chunk (r - s - 2) % n), so the partial from the
    # left lands in place and is combined there: no scratch, no extra pass over
    # it, one buffer less in the cache.  Only when ``src`` and ``work`` overlap
    # (a caller's aliasing views) does the scratch path stay safe.
    direct = src is not None and not np.may_share_memory(src, work)
    if not direct:
        maxlen = max(bounds[i + 1] - bounds[i] for i in range(n))
        if tmp is None or tmp.size < maxlen:
            tmp = np.empty(maxlen, dtype=work.dtype)
    right, left = (r + 1) % n, (r - 1) % n
    tag = next_tag(transport)
    local = work if src is None else src
    ufunc = op.ufunc
    if head is None and not direct and maxlen * work.itemsize > SEGMENT_BYTES:
        if timeout is None:  # exchange()'s unbounded step, without its call per step
            step = transport.sendrecv
        else:  # each segment within what is left of the call's deadline
            def step(sendbuf, dest, recvbuf, source, stag, rtag):
                exchange(transport, sendbuf, dest, recvbuf, source, stag, timeout)
        _segmented(step, work, local, bounds, tmp, ufunc, n, r, tag, save)
        return
    if timeout is None and save is None and head is None:  # whole chunks, unbounded: the transport's sendrecv
        sendrecv = transport.sendrecv
        for s in range(n - 1):
            sc = (r - s - 1) % n
            rc = (sc - 1) % n
            a, b = bounds[rc], bounds[rc + 1]
            dst = work[a:b]
            rbuf = dst if direct else tmp[:b - a]
            sendrecv((local if s == 0 else work)[bounds[sc]:bounds[sc + 1]], right, rbuf, left, tag, tag)
            ufunc(rbuf, local[a:b], out=dst)  # partial from the left (op) own contribution: ring_order
        return
    for s in range(n - 1):
        sc = (r - s - 1) % n
        rc = (sc - 1) % n
        a, b = bounds[rc], bounds[rc + 1]
        dst = work[a:b]
        rbuf = dst if direct else tmp[:b - a]
        overlap = None
        if save is not None:
            chunks = [(a, b)] + ([(bounds[left], bounds[left + 1])] if s == n - 2 else [])
            overlap = functools.partial(_save_chunks, save, chunks)
        if s == 0 and head is not None:
            _headed_step(transport, head, local[bounds[sc]:bounds[sc + 1]], right, rbuf, left, tag, timeout,
                         overlap, local[a:b], dst, ufunc, work.dtype)
            continue
        exchange(transport, (local if s == 0 else work)[bounds[sc]:bounds[sc + 1]], right, rbuf, left, tag,
                 timeout, overlap)
        ufunc(rbuf, local[a:b], out=dst)  # partial from the left (op) own contribution: ring_order


#: in place, a chunk larger than this many bytes is exchanged in segments of
#: about this size, each received into the same slice of the scratch and combined
#: at once: the partial then stays in cache instead of going out to memory and
#: back (at 64 MiB over 2 ranks, a 32 MiB scratch written by the transfer and
#: read by the reduction).  Below it, whole chunks: a segment costs a call.
SEGMENT_BYTES = 4 << 20


def _segmented(sendrecv, work, local, bounds, tmp, ufunc, n: int, r: int, tag: int, save=None) -> None:
    """The in-place steps of :func:`reduce_scatter_ring_inplace` (``sendrecv``:
    the transport's, or a step bounded by the call's deadline) with
    each chunk cut into ``k`` segments (the same ``k`` on every rank, from the
    largest chunk; segment ``j`` of a chunk depends on that chunk's length only,
    so a sender's and its receiver's segments match).  Same elements combined
    in the same order: the same bits as whole chunks.  ``save`` (a
    :class:`.snapshot.LazySnapshot`, or None): each segment is saved just
    before it is combined into (it is in cache then), and the last step saves
    the chunk the allgather overwrites first, as the whole-chunk steps do."""
    seg = max(1, SEGMENT_BYTES // work.itemsize)
    k = -(-max(bounds[i + 1] - bounds[i] for i in range(n)) // seg)
    for s in range(n - 1):
        sc = (r - s - 1) % n
        rc = (sc - 1) % n
        a, b = bounds[rc], bounds[rc + 1]
        sa = bounds[sc]
        out = local if s == 0 else work
        ls, lr = bounds[sc + 1] - sa, b - a
        for j in range(k):
            s0, s1 = sa + j * ls // k, sa + (j + 1) * ls // k
            r0, r1 = a + j * lr // k, a + (j + 1) * lr // k
            rbuf = tmp[:r1 - r0]
            sendrecv(out[s0:s1], (r + 1) % n, rbuf, (r - 1) % n, tag, tag)
            if save is not None:
                save.save(r0, r1)
            ufunc(rbuf, local[r0:r1], out=work[r0:r1])
        if save is not None and s == n - 2:
            left = (r - 1) % n
            save.save(bounds[left], bounds[left + 1])


def _headed_step(transport, head, chunk, right: int, rbuf, left: int, tag: int, timeout, overlap, mine, dst,
                 ufunc, dtype) -> None:
    """The ring's first step with the argument agreement in front (``head``, a
    :class:`.agreement.RingHead`): the row (and, joined, the chunk) under the
    first-round tag, the left neighbour's row compared before its chunk is
    combined into ``dst``."""
    first = head.first
    nbytes = rbuf.nbytes
    got = head.recv_buffer(nbytes)
    rq = first.irecv(got, left, head.tag)
    data = [] if head.recv_joined else [transport.irecv(rbuf, left, tag)]
    sends = [first.isend(head.send_parts(chunk), right, head.tag)]
    if not head.send_joined:
        sends.append(transport.isend(chunk, right, tag))
    if overlap is not None:
        overlap()
    try:
        waitall(first, [rq], timeout)
    except MessageSizeMismatch as exc:
        head.refuse_size(left, exc)
    head.check(got, left)
    waitall(transport, data + sends, timeout)
    if head.recv_joined:
        rbuf = got[head.prefix:head.prefix + nbytes].view(dtype)
    ufunc(rbuf, mine, out=dst)  # partial (op) own: ring_order


def _save_chunks(save, chunks) -> None:
    for lo, hi in chunks:
        save.save(lo, hi)


def reduce_scatter_ring(transport, sendbuf: np.ndarray, recvbuf: np.ndarray, op="sum", *,
                        timeout: float | None = None) -> None:
    """``MPI_Reduce_scatter_block`` by the ring algorithm.

    Args:
        transport: the point-to-point transport (``size`` = n ranks).
        sendbuf: 1-D contiguous host array of ``n * count`` elements; block ``i``
            (elements ``[i*count, (i+1)*count)``) goes to rank ``i``. Not modified.
        recvbuf: 1-D contiguous host array of ``count`` elements, same dtype;
            receives block ``rank`` reduced over all ranks (order: :func:`ring_order`).
        op: operator name or :class:`Op`; ``avg`` divides by n.
        timeout: the deadline of the whole call: seconds, or the caller's
            :class:`~commlib.core.seconds.Deadline` (None: unbounded); every
            step waits what is left of it.
    """
    timeout = deadline_of(timeout)  # one deadline for every step of the call
    op = get_op(op)
    n = transport.size
    count = recvbuf.size
    work = np.empty_like(sendbuf)
    bounds = np.arange(n + 1, dtype=np.int64) * count
    if n == 1:
        work[...] = sendbuf
    reduce_scatter_ring_inplace(transport, work, op, bounds, timeout=timeout, src=sendbuf)
    r = transport.rank
    mine = work[bounds[r]:bounds[r + 1]]
    op.finalize(mine, n)
    recvbuf[...] = mine
