"""Send strategies for non-contiguous data and the measured model that picks one.

TEMPI (Pearson et al., HPDC'22) showed that which way a non-contiguous send
should go depends on the message size, the length of its contiguous blocks and
where the data lives, and that a small table of measurements plus
interpolation picks well.  The strategies (the receiver chooses its own
independently: packed messages travel as ``MPI_PACKED``, which MPI-4.0 §5.2
lets either side pair with a typed send or receive):

Host buffers:
    ``"mpi"``: hand the MPI datatype to MPI (``MPI_Send(buf, count, type)``).
    ``"pack"``: pack with commlib's kernels, send the bytes as ``MPI_PACKED``.
Device buffers:
    ``"device"``: pack on the device, send the device buffer (CUDA-aware MPI).
    ``"mapped"``: the pack kernel writes straight into pinned, mapped host
        memory; send that host buffer.
    ``"staged"``: pack on the device, copy to host, send.

The model holds tables of one-way times (seconds) over message size (bytes)
x contiguous block length (bytes), per locality (``"intra"``: peer on this
node, ``"inter"``: another node), per strategy.  It interpolates bilinearly in
log2-log2 space (clamped at the table's edges), caches its choice per
(type, count, device, locality), and can be forced with
``COMMLIB_DATATYPE_STRATEGY=<name>``.  ``commlib calibrate`` measures the
tables into a JSON file (``COMMLIB_MODEL`` points commlib at it); without one
commlib uses the tables shipped in ``default_model.json``.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Iterable

import numpy as np

from commlib.core.errors import DatatypeError

__all__ = [
    "HOST_STRATEGIES",
    "DEVICE_STRATEGIES",
    "Model",
    "block_length",
    "default_model",
    "calibrate",
]

HOST_STRATEGIES = ("mpi", "pack")
DEVICE_STRATEGIES = ("device", "mapped", "staged")
_DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model.json")


def block_length(datatype, count: int = 1) -> float:
    """Mean length in bytes of the contiguous runs ``count`` elements of
    ``datatype`` pack from (the canonical form's innermost dense run)."""
    from .canonical import StridedBlock  # noqa: PLC0415
    from .pack import plan_for  # noqa: PLC0415

    p = plan_for(datatype, count)
    lay = p.layout
    if p.kind == "empty":
        return 1.0
    if isinstance(lay, StridedBlock):
        return float(lay.counts[0])
    lengths = np.asarray(lay.lengths)
    return float(lengths.mean()) if lengths.size else 1.0


class Model:
    """Strategy model over measured tables.

    Args:
        tables: ``{"intra"|"inter": {strategy: {"bytes": [..], "block": [..],
            "seconds": [[..] per bytes row]}}}`` (what :func:`calibrate` writes
            under ``"tables"``).
        source: where the tables came from (for ``commlib info`` and reports).

    Raises:
        DatatypeError: malformed tables.
    """

    def __init__(self, tables: dict, source: str = "in-memory"):
        self.source = source
        self.tables = {}
        for loc, per in tables.items():
            self.tables[loc] = {}
            for strat, t in per.items():
                b = np.log2(np.asarray(t["bytes"], dtype=np.float64))
                k = np.log2(np.asarray(t["block"], dtype=np.float64))
                s = np.log2(np.maximum(np.asarray(t["seconds"], dtype=np.float64), 1e-12))
                if s.shape != (b.size, k.size) or np.any(np.diff(b) <= 0) or np.any(np.diff(k) <= 0):
                    raise DatatypeError(f"table {loc}/{strat}: seconds must be len(bytes) x len(block), "
                                        "axes increasing", op="Model")
                self.tables[loc][strat] = (b, k, s)
        self._cache: dict = {}

    @classmethod
    def load(cls, path: str) -> "Model":
        """Read a model file written by ``commlib calibrate``."""
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
        return cls(rec["tables"], source=path)

    def strategies(self, locality: str) -> tuple:
        return tuple(self.tables.get(locality) or self.tables.get("intra") or next(iter(self.tables.values())))

    def predict(self, strategy: str, nbytes: float, block: float, locality: str = "intra") -> float:
        """Predicted one-way time in seconds (bilinear in log2 space, clamped)."""
        per = self.tables.get(locality) or self.tables.get("intra") or next(iter(self.tables.values()))
        if strategy not in per:
            return math.inf
        b, k, s = per[strategy]
        x = math.log2(max(nbytes, 1.0))
        y = math.log2(max(min(block, nbytes), 1.0))
        # per-row interpolation along block, then along bytes
        rows = np.array([np.interp(y, k, s[i]) for i in range(b.size)])
        if x > b[-1] and b.size > 1:  # extrapolate linearly in bytes beyond the table (bandwidth-bound)
            slope = (rows[-1] - rows[-2]) / (b[-1] - b[-2])
            return float(2.0 ** (rows[-1] + slope * (x - b[-1])))
        return float(2.0 ** np.interp(x, b, rows))

    def choose(self, datatype, count: int, *, device: bool, locality: str = "intra",
               cuda_aware: bool = False) -> str:
        """The cheapest strategy for ``count`` elements of ``datatype``.

        ``COMMLIB_DATATYPE_STRATEGY`` forces one (it must be valid for the
        buffer's side).  Choices are cached per (type, count, device, locality).

        Raises:
            DatatypeError: a forced strategy that does not apply.
        """
        forced = os.environ.get("COMMLIB_DATATYPE_STRATEGY", "").strip()
        allowed = _allowed(device, cuda_aware)
        if forced:
            if forced not in allowed:
                raise DatatypeError(f"COMMLIB_DATATYPE_STRATEGY={forced!r} does not apply to a "
                                    f"{'device' if device else 'host'} buffer; choose from {allowed}",
                                    op="send")
            return forced
        key = (id(datatype), count, device, locality, cuda_aware)
        got = self._cache.get(key)
        if got is not None and got[0] is datatype:
            return got[1]
        nbytes = max(1, count * datatype.size)
        blk = block_length(datatype, count)
        best = min(allowed, key=lambda s: self.predict(s, nbytes, blk, locality))
        self._cache[key] = (datatype, best)
        return best


def _allowed(device: bool, cuda_aware: bool) -> tuple:
    if not device:
        return HOST_STRATEGIES
    return DEVICE_STRATEGIES if cuda_aware else ("mapped", "staged")


_model: Model | None = None


def default_model() -> Model:
    """The process-wide model: ``COMMLIB_MODEL`` if set, else the shipped tables."""
    global _model
    if _model is None:
        path = os.environ.get("COMMLIB_MODEL") or _DEFAULT_PATH
        _model = Model.load(path)
    return _model


generation = 0  # bumped by set_model, so callers' cached choices expire


def set_model(model: Model | None) -> None:
    """Replace the process-wide model (None: reload from the environment)."""
    global _model, generation
    _model = model
    generation += 1


# ------------------------------------------------------------ calibration
def _probe_type(nbytes: int, block: int):
    """A vector of ``nbytes/block`` blocks of ``block`` bytes, stride 2 blocks,
    over float64 elements when the block allows (MPI's engine treats a block
    of doubles and a block of bytes differently), else bytes."""
    from .types import Vector  # noqa: PLC0415

    block = min(block, nbytes)
    if block % 8 == 0:
        return Vector(max(1, nbytes // block), block // 8, 2 * block // 8, np.float64)
    return Vector(max(1, nbytes // block), block, 2 * block, np.uint8)


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
        dict: ``{"tables": {locality: {strategy: {...}}}, "meta": {...}}`` (rank 0;
        the same record is broadcast to every rank).
    """
    from mpi4py import MPI  # noqa: PLC0415

    from commlib.typed_p2p import locality_of, typed_recv, typed_send  # noqa: PLC0415

    if comm.size < 2:
        raise DatatypeError("calibrate needs at least 2 ranks (mpiexec -n 2 commlib calibrate)",
                            rank=comm.rank, op="calibrate")
    sizes, blocks = sorted(set(sizes)), sorted(set(blocks))
    strategies = HOST_STRATEGIES + ((("device", "mapped", "staged") if comm.cuda_aware else ("mapped", "staged"))
                                    if device else ())
    loc = locality_of(comm, 1 if comm.rank == 0 else 0) if comm.rank < 2 else "intra"
    out = {}
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(strategies) * len(sizes) * len(blocks), desc="calibrate", unit="pt")
    # Strategies are interleaved round by round at every point, so drift in
    # the machine's load biases none of them; each keeps its best round trip.
    secs = {s: np.zeros((len(sizes), len(blocks))) for s in strategies}
    for i, nb in enumerate(sizes):
        for j, bl in enumerate(blocks):
            t = _probe_type(nb, bl)
            host = np.zeros(max(t.extent, 1), np.uint8)
            bufs = {}
            for strat in strategies:
                if strat in DEVICE_STRATEGIES:
                    from numba import cuda  # noqa: PLC0415

                    bufs[strat] = cuda.to_device(host)
                else:
                    bufs[strat] = host
            best = dict.fromkeys(strategies, math.inf)
            for _ in range(repeat):
                for strat in strategies:
                    buf = bufs[strat]
                    comm.barrier()
                    if comm.rank == 0:
                        a = time.perf_counter()
                        typed_send(comm, buf, 1, t, 1, 0, strategy=strat)
                        typed_recv(comm, buf, 1, t, 1, 0, strategy=strat)
                        best[strat] = min(best[strat], (time.perf_counter() - a) / 2)
                    elif comm.rank == 1:
                        typed_recv(comm, buf, 0, t, 1, 0, strategy=strat)
                        typed_send(comm, buf, 0, t, 1, 0, strategy=strat)
            for strat in strategies:
                secs[strat][i, j] = best[strat]
            if bar is not None:
                bar.update(len(strategies))
    for strat in strategies:
        out[strat] = {"bytes": sizes, "block": blocks, "seconds": secs[strat].tolist()}
    if bar is not None:
        bar.close()
    rec = {"tables": {loc: out},
           "meta": {"mpi": MPI.Get_library_version().splitlines()[0].strip(), "ranks": comm.size,
                    "repeat": repeat, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    return comm.mpi_comm.bcast(rec if comm.rank == 0 else None, root=0)
