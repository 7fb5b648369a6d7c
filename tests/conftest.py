"""Shared test set-up.

Without a GPU the device kernels run in numba's CUDA simulator.  numba reads
``NUMBA_ENABLE_CUDASIM`` when its config is first imported, which a plugin
may already have done, so set it and re-read the config here, before any test
module imports ``numba.cuda``.
"""
import os
import shutil

import pytest

from seeds import ENV as SEED_ENV, repeat_hint, test_seed  # tests/ is on the path (rootdir conftest)

if not os.environ.get("COMMLIB_REAL_GPU") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    import numba.core.config

    numba.core.config.reload_config()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Seed hypothesis from ``COMMLIB_TEST_SEED`` (unless ``--hypothesis-seed`` is
    given) and load the ``commlib`` profile: ``print_blob`` on, so a failure also
    prints the ``@reproduce_failure`` line that replays it exactly."""
    try:
        from hypothesis import settings  # noqa: PLC0415
    except ImportError:
        return
    settings.register_profile("commlib", print_blob=True)
    if not config.getoption("--hypothesis-profile", default=None):
        settings.load_profile("commlib")
    if hasattr(config.option, "hypothesis_seed") and config.option.hypothesis_seed is None:
        config.option.hypothesis_seed = str(test_seed())


def pytest_report_header(config):
    return f"commlib test {repeat_hint()}; hypothesis seed {getattr(config.option, 'hypothesis_seed', None)}"


@pytest.fixture
def seed() -> int:
    """The suite's random seed (``COMMLIB_TEST_SEED``, else a fixed default; see
    tests/seeds.py): every test that draws random numbers starts from it."""
    return test_seed()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure's report names the seed that repeats it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        hyp = getattr(item.config.option, "hypothesis_seed", None)
        text = repeat_hint()
        if hyp is not None and "hypothesis" in item.keywords:
            text += f"; hypothesis: --hypothesis-seed={hyp} (also set by {SEED_ENV})"
        report.sections.append(("commlib test seed", text))


def pytest_runtest_logreport(report):
    """Under mpiexec, print a failure's traceback the moment it happens, with the
    rank: when another rank then hangs and the stage is killed (or a rank is
    ended by pytest-timeout), pytest's own summary at the end never comes."""
    if not report.failed or "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        return
    import sys  # noqa: PLC0415

    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "?"))
    text = "\n".join(report.longreprtext.splitlines()[-25:])
    sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n{text}\n")
    sys.stderr.flush()


@pytest.fixture
def gpu_empty_slices(monkeypatch):
    """In the CUDA simulator, indexing a zero-element numba device array raises as
    numba-cuda does on a real GPU ("non-empty slice into empty slice": an empty
    allocation has a NULL pointer, and numpy 2 gives an empty array stride 0, so
    the slice's extent is one element; a superset here: every empty array), so a
    code path that slices an empty device vector fails here too, not only on a
    GPU (an H100 found ``allreduce(avg)`` of 0 elements doing that)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
        return  # a real GPU raises by itself
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    real_get, real_set = FakeCUDAArray.__getitem__, FakeCUDAArray.__setitem__

    def getitem(self, item):
        if self.size == 0:
            raise RuntimeError("non-empty slice into empty slice")
        return real_get(self, item)

    def setitem(self, key, value):  # numba's __setitem__ views the NULL allocation the same way
        if self.size == 0:
            raise RuntimeError("non-empty slice into empty slice")
        return real_set(self, key, value)

    monkeypatch.setattr(FakeCUDAArray, "__getitem__", getitem)
    monkeypatch.setattr(FakeCUDAArray, "__setitem__", setitem)


@pytest.fixture(scope="module")
def world():
    """commlib's communicator over MPI.COMM_WORLD (``commlib.init()``); a test module may define its own."""
    import commlib  # noqa: PLC0415

    return commlib.init()


@pytest.fixture(scope="module")
def selfcomm():
    """commlib's communicator over MPI.COMM_SELF: a one-rank group inside any job."""
    import commlib  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    return commlib.init(MPI.COMM_SELF)


@pytest.hookimpl(hookwrapper=True)
def pytest_terminal_summary(terminalreporter):
    """Plain-text logs: pytest-mpi's "MPI Information" section prints
    ``MPI.Get_library_version()``, which under Open MPI ends in a NUL byte
    (and then ``grep`` calls the whole log binary); written here without it."""
    write = terminalreporter.write
    terminalreporter.write = lambda content, **markup: write(content.replace("\x00", ""), **markup)
    try:
        yield
    finally:
        del terminalreporter.write  # the class's own method again
