"""The README's short tour (the block after ``<!-- tour -->``) is ``docs/tour.py`` word for word, and
runs as written to the end under ``mpiexec`` at 2 and 3 ranks (3: the zigzag shards padded), each job
bounded in time: a tour that deadlocks (every rank sending to one rank) fails here instead of hanging."""
import os
import shutil
import sys
from pathlib import Path

import pytest

import mpi4py

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from launch import run_job  # noqa: E402 - tests/launch.py

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def _readme_tour() -> str:
    block = (ROOT / "README.md").read_text().split("<!-- tour -->", 1)[1]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_tour_is_docs_tour():
    assert _readme_tour() == (ROOT / "docs" / "tour.py").read_text(), \
        "the README's tour and docs/tour.py differ: copy one into the other"


@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("n", [2, 3])
def test_readme_tour_runs(tmp_path, n):
    script = tmp_path / "tour.py"
    script.write_text(_readme_tour())
    flags = ["--oversubscribe"] if "Open MPI" in MPI.Get_library_version() else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_", "PRTE_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    rc, text = run_job([MPIEXEC, *flags, "-n", str(n), sys.executable, "-P", str(script)], env, 90,
                       started=lambda t: "Traceback" in t or "tour done" in t)
    assert rc is not None, f"the README tour did not finish in 90 s at {n} ranks (a deadlock?):\n{text[-3000:]}"
    assert rc == 0, f"the README tour failed at {n} ranks (exit {rc}):\n{text[-3000:]}"
    assert f"tour done on {n} ranks" in text, text[-3000:]
