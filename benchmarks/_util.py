"""Shared helpers for the benchmarks: timing and JSON output (not installed)."""
from __future__ import annotations

import json
import math
import time


def best_of(fn, repeat=5, number=1, barrier=None):
    """Minimum wall time in seconds of ``number`` calls of ``fn`` over ``repeat`` trials."""
    best = math.inf
    for _ in range(repeat):
        if barrier is not None:
            barrier()
        t = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t) / number)
    return best


def geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def write_json(path, record):
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2)
