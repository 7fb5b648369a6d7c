"""An elastic peer runs no MPI: ``commlib.elastic`` and the DiLoCo app import without
loading ``mpi4py.MPI`` (no ``MPI_Init``), and a master with two peers on loopback
joins and all-reduces in an interpreter where importing mpi4py fails.

``tests/run.sh`` runs this file, ``test_elastic.py``, ``test_tcp.py`` and
``test_diloco.py`` with ``tests/no_mpi`` first on ``PYTHONPATH`` (mpi4py cannot be
imported at all there), after checking that it indeed cannot."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, timeout: float = 120):
    r = subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_elastic_and_diloco_import_without_loading_mpi(record_property):
    """A fresh interpreter imports the elastic layer and the DiLoCo app without
    loading ``mpi4py.MPI`` (nor commlib's MPI transport).  The import's wall time
    is printed and recorded (``import_seconds``; about 0.25-0.4 s on the 2-core CI box),
    not asserted: timings there are noisy."""
    pytest.importorskip("sklearn")
    out = _run("""
        import sys, time
        t0 = time.perf_counter()
        import commlib.elastic, commlib.apps.diloco
        seconds = time.perf_counter() - t0
        loaded = sorted(m for m in sys.modules if m.startswith(("mpi4py", "commlib.transports.mpi")))
        assert "mpi4py.MPI" not in sys.modules, loaded
        assert "commlib.transports.mpi" not in sys.modules, loaded
        print(f"import_seconds {seconds:.3f}")
    """)
    seconds = float(out.split("import_seconds", 1)[1].split()[0])
    record_property("import_seconds", seconds)
    print(f"import commlib.elastic, commlib.apps.diloco: {seconds:.3f} s")


def test_master_and_peers_allreduce_where_mpi4py_cannot_import():
    out = _run("""
        import sys, threading
        sys.modules["mpi4py"] = None  # any "import mpi4py" now raises ImportError
        try:
            import mpi4py  # noqa: F401
            raise SystemExit("mpi4py still importable")
        except ImportError:
            pass
        import numpy as np
        import commlib.elastic as el

        secret = b"k" * 32
        master = el.Master(secret=secret).start()
        results, errors = {}, []

        def peer(i):
            try:
                p = el.connect(master.address, secret=secret, timeout=30.0)
                while p.size < 2:
                    p.update_topology()
                x = np.arange(1000, dtype=np.float32) * (i + 1)
                p.allreduce(x, op="sum")
                results[i] = x.copy()
                p.close()
            except Exception as exc:
                errors.append(repr(exc))

        ths = [threading.Thread(target=peer, args=(i,)) for i in range(2)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(90)
        master.stop()
        assert not errors, errors
        want = np.arange(1000, dtype=np.float32) * 3
        assert all(np.array_equal(results[i], want) for i in range(2)), results
        print("OK", "mpi4py.MPI" in sys.modules)
    """)
    assert "OK False" in out, out
