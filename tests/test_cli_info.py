"""``commlib info``: the versions it reports and its device-kernel check.

The command runs in a child process, as a user or a job script runs it. Without a
GPU (the default here) the kernel runs in numba's CUDA simulator and the check
must say ``simulator``; with ``COMMLIB_REAL_GPU=1`` it must say ``ok (<GPU name>)``.
"""
import json
import os
import subprocess
import sys

import pytest

from commlib.cli import device_kernel_check

REAL_GPU = bool(os.environ.get("COMMLIB_REAL_GPU"))
VERSION_KEYS = ("commlib", "python", "mpi4py", "numpy", "numba", "numba_cuda", "cupy", "torch")


def _env():
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    if not REAL_GPU:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return env


def _commlib(*args, timeout=240):
    return subprocess.run([sys.executable, "-P", "-m", "commlib.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env(), stdin=subprocess.DEVNULL)


def _kernels_ok(value):
    return value.startswith("ok (") if REAL_GPU else value == "simulator"


@pytest.mark.timeout(300)
def test_info_text_reports_versions_and_kernel_check():
    proc = _commlib("info")
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.strip())
    for key in VERSION_KEYS + ("device_kernels",):
        assert rows.get(key, "").strip(), f"no {key} line in:\n{proc.stdout}"
    import numba
    import numpy

    assert rows["numpy"] == numpy.__version__ and rows["numba"] == numba.__version__
    assert rows["numba_cuda"] != "not installed"
    assert _kernels_ok(rows["device_kernels"]), rows["device_kernels"]


@pytest.mark.timeout(300)
def test_info_json_and_skipped_check():
    proc = _commlib("info", "--json")
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    for key in VERSION_KEYS:
        assert key in rec
    assert _kernels_ok(rec["device_kernels"]), rec["device_kernels"]
    proc = _commlib("info", "--json", "--no-kernel-check")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["device_kernels"] == "not checked"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["0", "-3", "inf", "soon"])
def test_info_bad_timeout_exits_2(value):
    proc = _commlib("info", "--kernel-timeout", value)
    assert proc.returncode == 2
    assert "--kernel-timeout" in proc.stderr and proc.stdout == ""


@pytest.mark.timeout(120)
def test_kernel_check_is_bounded():
    # Too little time to even import numba: one line saying so, no exception.
    assert device_kernel_check(timeout=0.01) == "unavailable (no answer within 0.01 s)"


@pytest.mark.timeout(120)
def test_kernel_check_reports_a_failure_in_one_line(monkeypatch, tmp_path):
    # A child interpreter in which `from numba import cuda` fails: the check names the error.
    fake = tmp_path / "numba"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('numba is broken here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = device_kernel_check(timeout=60)
    assert result == "unavailable (ImportError: numba is broken here)", result
