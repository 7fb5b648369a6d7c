"""The suite's one random seed: ``COMMLIB_TEST_SEED`` (an int), else a fixed default.

Every test that draws random numbers takes its seed from here (the ``seed``
fixture in conftest.py, or :func:`test_seed` where a module needs it at
collection time, e.g. to parametrize randomized kill points), mixing in its own
constants where it wants a stream of its own; subprocesses get it through the
environment (:func:`seed_env`).  A failing test's report carries
``seed=N (set COMMLIB_TEST_SEED=N to repeat)``; pytest's header shows it too.
The default is fixed so that every rank of an MPI job draws the same numbers
and a plain run is repeatable; set another value (``COMMLIB_TEST_SEED=$RANDOM``)
to explore.  Hypothesis is seeded from it as well (``--hypothesis-seed``, unless
given on the command line).
"""
import os

DEFAULT_SEED = 20261129
ENV = "COMMLIB_TEST_SEED"


def test_seed() -> int:
    """``COMMLIB_TEST_SEED`` as an int, else :data:`DEFAULT_SEED`."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_SEED
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{ENV}={raw!r}: an integer, please") from None


test_seed.__test__ = False  # not a test, whatever its name


def seed_env(env: dict | None = None) -> dict:
    """``env`` (default: a copy of ``os.environ``) with ``COMMLIB_TEST_SEED`` set, for a subprocess."""
    out = dict(os.environ if env is None else env)
    out[ENV] = str(test_seed())
    return out


def repeat_hint(seed: int | None = None) -> str:
    """``seed=N (set COMMLIB_TEST_SEED=N to repeat)``."""
    seed = test_seed() if seed is None else seed
    return f"seed={seed} (set {ENV}={seed} to repeat)"
