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
``COMMLIB_DATATYPE_STRATEGY=<name>``.  ``commlib calibrate``
(:mod:`commlib.calibrate`, which times typed sends through a communicator)
measures the tables into a JSON file (``COMMLIB_MODEL`` points commlib at it);
without one commlib uses the tables shipped in ``default_model.json``.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from commlib.core.config import config
from commlib.core.errors import DatatypeError

from .canonical import StridedBlock
from .pack import plan_for

__all__ = [
    "HOST_STRATEGIES",
    "DEVICE_STRATEGIES",
    "Model",
    "block_length",
    "default_model",
    "set_model",
]

HOST_STRATEGIES = ("mpi", "pack")
DEVICE_STRATEGIES = ("device", "mapped", "staged")
_DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model.json")


def block_length(datatype, count: int = 1) -> float:
    """Mean length in bytes of the contiguous runs ``count`` elements of
    ``datatype`` pack from (the canonical form's innermost dense run)."""
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
            "seconds": [[..] per bytes row]}}}`` (what
            :func:`commlib.calibrate.calibrate` writes under ``"tables"``).
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

        ``COMMLIB_DATATYPE_STRATEGY`` (``config.datatype_strategy``, read at
        each call) forces one (it must be valid for the buffer's side).  Choices
        are cached per (type, count, device, locality).

        Raises:
            DatatypeError: a forced strategy that does not apply.
        """
        forced = config.datatype_strategy
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
        path = config.model or _DEFAULT_PATH
        _model = Model.load(path)
    return _model


generation = 0  # bumped by set_model, so callers' cached choices expire


def set_model(model: Model | None) -> None:
    """Replace the process-wide model (None: reload from ``config.model`` or the shipped tables)."""
    global _model, generation
    _model = model
    generation += 1
