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

from mpi4py import MPI

import commlib
from commlib.calibrate import calibrate
from commlib.collectives import ft_mode_info
from commlib.core import device

__all__ = ["info", "main"]


def _version(mod: str) -> str | None:
    try:
        m = importlib.import_module(mod)
    except Exception:
        return None
    return getattr(m, "__version__", "unknown")


def info() -> dict:
    """Collect the provenance record (a JSON-serializable dict)."""
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
        rec["mpi_library"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
        rec["mpi_standard"] = "%d.%d" % MPI.Get_version()
        rec["mpi_library_path"] = device.mpi_library_path()
        rec["world_size"] = MPI.COMM_WORLD.Get_size()
    except Exception as exc:  # pragma: no cover - broken MPI installs
        rec["mpi_library"] = f"unavailable ({exc})"
    rec["ulfm"] = device.ulfm_available()
    try:
        ft = ft_mode_info()
        rec["fault_tolerance"] = ft["mode"]
        if ft.get("hint"):
            rec["fault_tolerance_hint"] = ft["hint"]
    except Exception as exc:  # noqa: BLE001 - info must print whatever is broken
        rec["fault_tolerance"] = f"unknown ({exc})"
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
    p_cal = sub.add_parser(
        "calibrate",
        help="measure the datatype send-strategy tables (run with mpiexec -n 2)",
        description="Ping-pong between ranks 0 and 1 for every send strategy over message sizes x "
                    "contiguous block lengths; writes the tables the strategy model interpolates. "
                    "Point commlib at the file with COMMLIB_MODEL=PATH.",
    )
    p_cal.add_argument("--out", default="commlib-model.json", help="output JSON (default commlib-model.json)")
    p_cal.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 16384, 262144, 4 << 20],
                       help="message sizes in bytes")
    p_cal.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 512, 4096],
                       help="contiguous block lengths in bytes")
    p_cal.add_argument("--repeat", type=int, default=20, help="round trips per point (best is kept)")
    p_cal.add_argument("--device", action="store_true", help="also measure device strategies (needs a GPU)")
    args = parser.parse_args(argv)
    if args.cmd == "calibrate":
        comm = commlib.init()
        rec = calibrate(comm, args.sizes, args.blocks, repeat=args.repeat, device=args.device,
                        progress=comm.rank == 0 and sys.stderr.isatty())
        if comm.rank == 0:
            with open(args.out, "w", encoding="utf-8") as fh:
                json.dump(rec, fh, indent=1)
            print(f"wrote {args.out}: {', '.join(f'{loc}: {sorted(t)}' for loc, t in rec['tables'].items())}")
        return 0
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
