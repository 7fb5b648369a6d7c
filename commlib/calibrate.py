"""``commlib calibrate``: measure the send-strategy tables of the datatype model.

The model (loading, interpolating, choosing) is :mod:`commlib.datatypes.strategy`;
this module produces its tables by timing typed sends through the public
:class:`~commlib.Communicator` API (``comm.send``/``comm.recv`` with
``datatype=``), one strategy at a time, forced through
:data:`commlib.core.config.config` (``forced_strategy``).  It sits in the
user-API layer because it drives a communicator; the datatypes layer below it
never imports it.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Iterable

import numpy as np
from mpi4py import MPI

from commlib.core.config import config
from commlib.core.errors import DatatypeError
from commlib.datatypes.strategy import DEVICE_STRATEGIES, HOST_STRATEGIES
from commlib.datatypes import Vector

__all__ = ["calibrate", "probe_type"]

_TAG = 0


def probe_type(nbytes: int, block: int) -> Vector:
    """A vector of ``nbytes/block`` blocks of ``block`` bytes, stride 2 blocks,
    over float64 elements when the block allows (MPI's engine treats a block
    of doubles and a block of bytes differently), else bytes."""
    block = min(block, nbytes)
    if block % 8 == 0:
        return Vector(max(1, nbytes // block), block // 8, 2 * block // 8, np.float64)
    return Vector(max(1, nbytes // block), block, 2 * block, np.uint8)


@contextlib.contextmanager
def _forced(strategy: str):
    """Force every typed send/receive of this process to ``strategy``
    (``config.forced_strategy`` overrides ``COMMLIB_DATATYPE_STRATEGY``)."""
    saved = config.forced_strategy
    config.forced_strategy = strategy
    try:
        yield
    finally:
        config.forced_strategy = saved


def _locality(comm, peer: int) -> str:
    # node_peers: the ranks on this rank's node, computed collectively when the
    # transport was created (empty while a transport does not provide it)
    return "intra" if peer in getattr(comm.transport, "node_peers", frozenset()) else "inter"


def calibrate(comm, sizes: Iterable[int] = (64, 1024, 16384, 262144, 4 << 20),
              blocks: Iterable[int] = (1, 8, 64, 512, 4096), repeat: int = 20, device: bool = False,
              progress: bool = False) -> dict:
    """Measure strategy tables by ping-pong between ranks 0 and 1 of ``comm``.

    Every rank must call it (ranks other than 0 and 1 only wait).  Times are
    one-way (half the round trip), seconds, the best of ``repeat`` round trips.

    Args:
        comm: a commlib Communicator with at least 2 ranks.
        sizes: message sizes, bytes.
        blocks: contiguous block lengths, bytes.
        device: also measure device strategies (needs a GPU, not the simulator).
        progress: tqdm bar on rank 0.

    Returns:
        dict: ``{"tables": {locality: {strategy: {...}}}, "meta": {...}}``, what
        :meth:`commlib.datatypes.strategy.Model.load` reads; rank 0's
        measurements, broadcast so every rank returns the same record.
    """
    if comm.size < 2:
        raise DatatypeError("calibrate needs at least 2 ranks (mpiexec -n 2 commlib calibrate)",
                            rank=comm.rank, op="calibrate")
    sizes, blocks = sorted(set(sizes)), sorted(set(blocks))
    strategies = HOST_STRATEGIES
    if device:
        strategies += DEVICE_STRATEGIES if comm.cuda_aware else ("mapped", "staged")
    peer = 1 if comm.rank == 0 else 0
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm  # noqa: PLC0415  - optional, only for the progress bar

        bar = tqdm(total=len(strategies) * len(sizes) * len(blocks), desc="calibrate", unit="pt")
    # rank 0's results travel to every rank in one float64 array:
    # [1.0 when the peer is on this node, start time, seconds per strategy x size x block]
    res = np.zeros(2 + len(strategies) * len(sizes) * len(blocks))
    res[0] = _locality(comm, peer) == "intra"
    res[1] = time.time()
    secs = res[2:].reshape(len(strategies), len(sizes), len(blocks))
    for i, nb in enumerate(sizes):
        for j, bl in enumerate(blocks):
            t = probe_type(nb, bl)
            host = np.zeros(max(t.extent, 1), np.uint8)
            bufs = {s: _device_copy(host) if s in DEVICE_STRATEGIES else host for s in strategies}
            secs[:, i, j] = _ping_pong(comm, peer, t, bufs, strategies, repeat)
            if bar is not None:
                bar.update(len(strategies))
    if bar is not None:
        bar.close()
    comm.bcast(res, root=0)
    loc = "intra" if res[0] else "inter"
    tables = {s: {"bytes": sizes, "block": blocks, "seconds": secs[k].tolist()} for k, s in enumerate(strategies)}
    library = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    return {"tables": {loc: tables},
            "meta": {"mpi": library, "ranks": comm.size, "repeat": repeat,
                     "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(res[1]))}}


def _device_copy(host):
    from numba import cuda  # noqa: PLC0415  - numba.cuda is heavy and only needed with device=True

    return cuda.to_device(host)


def _ping_pong(comm, peer, t, bufs, strategies, repeat) -> list:
    """Best one-way time of each strategy over ``repeat`` round trips (rank 0;
    inf elsewhere).  Strategies are interleaved round by round, so drift in the
    machine's load biases none of them."""
    best = [math.inf] * len(strategies)
    for _ in range(repeat):
        for k, strat in enumerate(strategies):
            buf = bufs[strat]
            comm.barrier()
            if comm.rank > 1:
                continue
            with _forced(strat):
                if comm.rank == 0:
                    a = time.perf_counter()
                    comm.send(buf, peer, _TAG, datatype=t)
                    comm.recv(buf, peer, _TAG, datatype=t)
                    best[k] = min(best[k], (time.perf_counter() - a) / 2)
                else:
                    comm.recv(buf, peer, _TAG, datatype=t)
                    comm.send(buf, peer, _TAG, datatype=t)
    return best
