"""The ``"commlib"`` torch backend's worker thread (commlib/nn/torch_works.py),
without MPI: when a work completes, relative to the worker's idle state."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from commlib.nn.torch_works import Worker  # noqa: E402

from waiting import wait_until  # noqa: E402


def test_a_work_completes_once_the_worker_is_idle():
    """A call's future completes only after the worker has let go of the call:
    a callback on it (run by the worker thread as the future completes, as a
    caller woken by it runs next) finds the worker idle and its ``running`` lock
    free when nothing else is queued, so the caller's next call may run inline;
    with a second call queued behind it, not idle.  10 trials of each."""
    w = Worker("commlib-test-worker")
    try:
        for trial in range(10):
            for queued in (0, 1):
                gate, seen = threading.Event(), []
                works = [w.submit(lambda: gate.wait(5), f"r{i}") for i in range(1 + queued)]
                works[0].get_future().then(lambda f: seen.append((w.idle(), w.running.locked())))
                gate.set()
                for work in works:
                    work.wait()
                wait_until(lambda: seen, 5, "the first work's callback")
                want = (True, False) if not queued else (False, False)
                assert seen[0] == want, (trial, queued, seen)
                assert w.idle(), (trial, queued)
    finally:
        w.stop()
