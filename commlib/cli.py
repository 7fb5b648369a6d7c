"""The ``commlib`` command line.

``commlib info`` prints provenance for a job log: versions of commlib, mpi4py,
numpy, numba and CuPy; the MPI library; whether ULFM (fault tolerance) and
CUDA-aware MPI are available; the GPUs this process sees.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys

__all__ = ["info", "main"]


def _version(mod: str) -> str | None:
    try:
        m = importlib.import_module(mod)
    except Exception:
        return None
    return getattr(m, "__version__", "unknown")


def info() -> dict:
    """Collect the provenance record (a JSON-serializable dict)."""
    import commlib  # noqa: PLC0415

    from . import device  # noqa: PLC0415

    rec = {
        "commlib": commlib.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "mpi4py": _version("mpi4py"),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba_cuda"),
        "cupy": _version("cupy"),
    }
    try:
        from mpi4py import MPI  # noqa: PLC0415

        rec["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
        rec["mpi_standard"] = "%d.%d" % MPI.Get_version()
        rec["mpi_library_path"] = device.mpi_library_path()
        rec["world_size"] = MPI.COMM_WORLD.Get_size()
    except Exception as exc:  # pragma: no cover - broken MPI installs
        rec["mpi_library"] = f"unavailable ({exc})"
    rec["ulfm"] = device.ulfm_available()
    try:
        from commlib.collectives import ft_mode  # noqa: PLC0415

        rec["fault_tolerance"] = ft_mode()
    except Exception:
        rec["fault_tolerance"] = "ulfm" if rec["ulfm"] else "timeout"
    rec["cuda_aware_query"] = device.cuda_support_query()
    rec["cuda_aware"] = device.cuda_aware()
    rec["cuda_simulator"] = device.simulator_enabled()
    rec["gpus"] = device.visible_gpus()
    return rec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="commlib", description="commlib command line")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="versions, MPI library, ULFM / CUDA-awareness, GPUs")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    if args.cmd == "info":
        rec = info()
        if args.json:
            print(json.dumps(rec, indent=2))
        else:
            width = max(len(k) for k in rec)
            for k, v in rec.items():
                if v is None:
                    v = "not installed" if k in ("cupy", "numba_cuda") else "n/a"
                elif isinstance(v, list):
                    v = ", ".join(v) if v else "none"
                print(f"{k:<{width}}  {v}")
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
