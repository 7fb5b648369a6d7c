"""The ``commlib`` command line.

``commlib info`` prints provenance for a job log: versions of commlib, mpi4py,
numpy, numba, numba-cuda, CuPy and torch; the MPI library; whether ULFM (fault
tolerance) and CUDA-aware MPI are available; the GPUs this process sees; and
whether a device kernel compiles and runs (``device_kernels``: ``ok (<GPU
name>)``, ``simulator`` under numba's CUDA simulator, or ``unavailable
(<reason>)``). That check compiles and launches a tiny numba.cuda kernel in a
child process bounded in time, so a broken driver or toolkit can neither hang
nor crash ``commlib info``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import commlib
from commlib.core import device

__all__ = ["OneLineParser", "device_kernel_check", "info", "launcher_rank", "main", "unwritable"]

#: environment variables with this process's rank and the job's size, set by
#: the launchers (Open MPI's mpiexec/prterun, MPICH's and Intel MPI's hydra,
#: MVAPICH), in the order they are read; PMIx direct launch (srun --mpi=pmix)
#: names the rank only, so Slurm's task rank and step task count come last
#: (an srun task; a batch script's own process has no step count)
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def env_int(names) -> int | None:
    """The first of the environment variables ``names`` that holds an integer (None if none does)."""
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


def launcher_rank() -> int:
    """This process's rank as the launcher's environment tells it (0 without a launcher);
    reads no MPI."""
    rank = env_int(RANK_VARS)
    return 0 if rank is None else rank


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a refusal is one line on stderr (``PROG: error: ...``), printed by
    rank 0 of a launcher's job only (every rank parses the same command line and exits
    alike), then ``SystemExit(2)``: no usage block, no traceback.

    Args:
        name: the short name in the error line (default: ``prog``; a subcommand's
            parser, made by ``add_subparsers``, gets ``commlib SUBCOMMAND``).
        **kwargs: as for :class:`argparse.ArgumentParser`.
    """

    def __init__(self, name: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.short_name = name or self.prog

    def rank(self) -> int:
        """The rank whose refusal is printed when it is 0 (a hook: apps read MPI's world too)."""
        return launcher_rank()

    #: seconds a rank other than 0 waits before it exits: mpiexec ends the whole job when
    #: the first rank exits non-zero, which could drop rank 0's line before it is written
    OTHER_RANKS_DELAY = 0.5

    def error(self, message):  # noqa: D401 - argparse's hook
        if self.rank() == 0:
            sys.stderr.write(f"{self.short_name}: error: {message}\n")
            sys.stderr.flush()
        else:
            import time  # noqa: PLC0415

            time.sleep(self.OTHER_RANKS_DELAY)
        raise SystemExit(2)

#: Seconds the device-kernel check may take (import, compile, launch) by default.
KERNEL_CHECK_TIMEOUT = 120.0

# Run by device_kernel_check in a child process: numpy and numba only (never MPI: a
# child of an MPI process must not initialize MPI with its parent's environment).
# The last line printed is "ok <GPU name>", "simulator" or "fail <reason>".
_KERNEL_CHECK = r"""
import sys
try:
    import numpy as np
    from numba import config, cuda

    @cuda.jit
    def _odd(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = 2 * i + 1

    n = 96
    d = cuda.device_array(n, dtype=np.int32)
    _odd[(n + 31) // 32, 32](d)
    cuda.synchronize()
    got = d.copy_to_host()
    want = 2 * np.arange(n, dtype=np.int32) + 1
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        print(f"fail kernel ran but wrote {got[bad]} at index {bad}, expected {want[bad]}")
        sys.exit(1)
    if config.ENABLE_CUDASIM:  # numba's own reading of NUMBA_ENABLE_CUDASIM
        print("simulator")
    else:
        name = cuda.get_current_device().name
        print("ok " + (name.decode() if isinstance(name, bytes) else str(name)))
except BaseException as exc:
    print("fail " + " ".join(f"{type(exc).__name__}: {exc}".split()).rstrip(" :"))
    sys.exit(1)
"""


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _version(mod: str, dists: tuple[str, ...] = ()) -> str | None:
    """``mod.__version__``; None when not installed.

    A distribution in ``dists`` that is installed but fails to import gives its
    version and the import error, instead of passing for not installed.
    """
    try:
        m = importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - info must print whatever is broken
        for dist in dists:
            try:
                return f"{importlib.metadata.version(dist)} (import fails: {_one_line(exc, 120)})"
            except importlib.metadata.PackageNotFoundError:
                continue
        return None
    return getattr(m, "__version__", "unknown")


def _dist_version(*dists: str) -> str | None:
    """Installed version of the first of ``dists`` found, without importing it (None if none)."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def device_kernel_check(timeout: float = KERNEL_CHECK_TIMEOUT) -> str:
    """Compile and launch a tiny numba.cuda kernel and check what it wrote.

    The kernel runs in a child process (this interpreter, numpy and numba only), so
    a driver that hangs or crashes costs at most ``timeout`` seconds and a line of
    text; this function never raises.

    Args:
        timeout: seconds the child may take to import numba, compile and run.

    Returns:
        ``"ok (<GPU name>)"`` when the kernel ran on a GPU and wrote the expected
        values, ``"simulator"`` when it ran in numba's CUDA simulator
        (``NUMBA_ENABLE_CUDASIM=1``), else ``"unavailable (<one-line reason>)"``.
    """
    try:
        proc = subprocess.run([sys.executable, "-P", "-c", _KERNEL_CHECK], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    except subprocess.TimeoutExpired:
        return f"unavailable (no answer within {timeout:g} s)"
    except Exception as exc:  # noqa: BLE001 - info must print whatever is broken
        return f"unavailable ({_one_line(f'{type(exc).__name__}: {exc}')})"
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    if proc.returncode == 0 and last == "simulator":
        return "simulator"
    if proc.returncode == 0 and last.startswith("ok "):
        return f"ok ({last[3:]})"
    if last.startswith("fail "):
        return f"unavailable ({_one_line(last[5:])})"
    err = proc.stderr.strip().splitlines()
    why = err[-1] if err else f"check exited with status {proc.returncode}"
    return f"unavailable ({_one_line(why)})"


def _pmi_in_use() -> str:
    """Which process-management interface started this process, from the environment it left."""
    env = os.environ
    if env.get("PMIX_NAMESPACE"):
        return f"PMIx (namespace {env['PMIX_NAMESPACE']})"
    if env.get("PMI_FD") or env.get("PMI_PORT"):
        return "PMI-1/PMI-2 (" + ("PMI_FD" if env.get("PMI_FD") else "PMI_PORT") + ")"
    return "none (MPI starts as a singleton)"


def slurm_rows() -> dict:
    """``commlib info``'s Slurm rows, none outside a Slurm job: the job, the step and this task, the
    PMI in use, and the line :func:`~commlib.transports.mpi_process.slurm_singleton` says when the
    step's tasks each got an MPI world of 1 (MPI is initialized here)."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        return {}
    from commlib.transports.mpi_process import slurm_singleton  # noqa: PLC0415

    rows = {"slurm_job": f"{env['SLURM_JOB_ID']} on {env.get('SLURM_JOB_NUM_NODES', '?')} node(s)"}
    if env.get("SLURM_STEP_ID"):  # (inside a step SLURM_NTASKS is the step's count, not the job's)
        rows["slurm_step"] = (f"{env['SLURM_STEP_ID']}: {env.get('SLURM_STEP_NUM_TASKS', '?')} task(s) on "
                              f"{env.get('SLURM_STEP_NUM_NODES', '?')} node(s); this is task "
                              f"{env.get('SLURM_PROCID', '?')} on {env.get('SLURMD_NODENAME', '?')}")
    else:
        rows["slurm_job"] += f", {env.get('SLURM_NTASKS', '?')} task(s)"
        rows["slurm_step"] = "none (the batch script's own process)"
    rows["pmi"] = _pmi_in_use()
    try:
        msg = slurm_singleton()
    except Exception as exc:  # noqa: BLE001 - info must print whatever is broken
        msg = f"unknown ({exc})"
    if msg:
        rows["slurm_singleton"] = msg.removeprefix("commlib: ")
    return rows


def info(kernel_check: bool = True, kernel_timeout: float = KERNEL_CHECK_TIMEOUT) -> dict:
    """Collect the provenance record (a JSON-serializable dict).

    Args:
        kernel_check: run :func:`device_kernel_check` (``device_kernels``); False
            reports ``"not checked"``.
        kernel_timeout: seconds that check may take.
    """
    # MPI (MPI_Init) and the fault-tolerance module load here, not when the module is
    # imported: ``commlib master`` runs an elastic master, which uses no MPI at all
    from mpi4py import MPI  # noqa: PLC0415

    from commlib.transports.mpi_process import ft_mode_info, tcp_flags_text  # noqa: PLC0415

    rec = {
        "commlib": commlib.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "mpi4py": _version("mpi4py"),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba_cuda", ("numba-cuda",)),
        "cupy": _version("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")),
        # Not imported: importing torch is slow and may initialize CUDA.
        "torch": _dist_version("torch"),
    }
    try:
        rec["mpi_library"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
        rec["mpi_standard"] = "%d.%d" % MPI.Get_version()
        rec["mpi_library_path"] = device.mpi_library_path()
        rec["world_size"] = MPI.COMM_WORLD.Get_size()
    except Exception as exc:  # pragma: no cover - broken MPI installs
        rec["mpi_library"] = f"unavailable ({exc})"
    rec.update(slurm_rows())
    rec["ulfm"] = device.ulfm_available()
    try:
        ft = ft_mode_info()
        rec["fault_tolerance"] = ft["mode"]
        if ft.get("hint"):
            rec["fault_tolerance_hint"] = ft["hint"]
        tcp = ft.get("tcp_rdma")
        if tcp is not None:  # Open MPI: under ULFM the TCP BTL should do no RDMA put (docs/faults-and-security.md)
            if not tcp["tcp_btl"]:
                rec["tcp_btl_rdma"] = "n/a (TCP BTL not in use)"
            else:
                rec["tcp_btl_rdma"] = (f"{'on' if tcp['rdma'] else 'off'} (btl_tcp_flags "
                                       f"{tcp_flags_text(tcp['btl_tcp_flags'])}, read via {tcp['source']})")
    except Exception as exc:  # noqa: BLE001 - info must print whatever is broken
        rec["fault_tolerance"] = f"unknown ({exc})"
    rec["cuda_aware_query"] = device.cuda_support_query()
    rec["cuda_aware"] = device.cuda_aware()
    rec["cuda_simulator"] = device.simulator_enabled()
    rec["gpus"] = device.visible_gpus()
    rec["device_kernels"] = device_kernel_check(kernel_timeout) if kernel_check else "not checked"
    return rec


def _seconds(text: str) -> float:
    """argparse type: a positive number of seconds (a bad value exits with status 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds: {text!r}")
    return value


def _address(text: str) -> str:
    """argparse type: ``HOST:PORT`` with a non-empty host and a port in 0..65535 (0: any free port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 0..65535, got {text!r}")
    return text


def _positive_ints(limit: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(f"must be in 1..{limit}, got {value}")
        return value
    return parse


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (None when it can), without creating it;
    for checking ``--json``/``--plot`` paths before a run."""
    if not path:
        return "empty path"
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "not writable"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"directory {parent} is not writable"


def _writable_file(text: str) -> str:
    """argparse type: a path a file can be written at (checked before a long measurement)."""
    why = unwritable(text)
    if why:
        raise argparse.ArgumentTypeError(f"{text!r}: {why}")
    return text


def _serve(args) -> int:
    """``commlib master``: 0 after Ctrl-C or SIGTERM; 2 when the address or the secret is unusable."""
    import signal  # noqa: PLC0415

    from commlib import elastic  # noqa: PLC0415
    from commlib.core.config import config  # noqa: PLC0415

    if args.secret_file is None and config.elastic_secret is None:
        print("commlib master: error: no shared secret: pass --secret-file F or set COMMLIB_ELASTIC_SECRET",
              file=sys.stderr)
        return 2
    job = None
    if args.job_file is not None:
        try:
            with open(args.job_file, "rb") as fh:
                job = fh.read(elastic.protocol.JOB_MAX + 1)
        except OSError as exc:
            print(f"commlib master: error: --job-file {args.job_file!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        if not 1 <= len(job) <= elastic.protocol.JOB_MAX:
            print(f"commlib master: error: --job-file {args.job_file!r} must hold 1..{elastic.protocol.JOB_MAX} "
                  f"bytes, it holds {'none' if not job else 'more'}", file=sys.stderr)
            return 2
    try:
        master = elastic.Master(bind=args.bind, secret_file=args.secret_file,
                                heartbeat_timeout=args.heartbeat_timeout, encrypt=args.encrypt,
                                probe_timeout=None if args.no_probe else args.probe_timeout, job=job).start()
    except (elastic.SecretError, commlib.InvalidArgument) as exc:  # the secret, the address: the user's values
        print(f"commlib master: error: {exc.detail}", file=sys.stderr)
        return 2
    except OSError as exc:  # binding the listener: a port in use, an address not of this host, a privileged port
        print(f"commlib master: error: cannot listen on {args.bind}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except commlib.CommError as exc:
        print(f"commlib master: error: {exc}", file=sys.stderr)
        return 1

    def on_term(*_):
        raise KeyboardInterrupt  # stops the master as Ctrl-C does

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, on_term)
    try:
        print(f"commlib master listening on {master.address}", flush=True)
        master.serve_forever()  # returns on Ctrl-C inside its wait
    except KeyboardInterrupt:  # one that came before or after that wait
        pass
    finally:
        for sig in saved:  # stopping: a second signal changes nothing
            signal.signal(sig, signal.SIG_IGN)
        master.stop()
    print("commlib master stopped", flush=True)
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    return 0


def main(argv=None) -> int:
    parser = OneLineParser(prog="commlib", description="commlib command line: provenance (info), the datatype "
                           "model's tables (calibrate), an elastic job's master (master). A bad value exits with "
                           "status 2 after one line on stderr.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser(
        "info",
        help="versions, MPI library, ULFM / CUDA-awareness, GPUs, whether device kernels run",
        description="Print provenance for a job log: versions of commlib, Python, mpi4py, numpy, numba, "
                    "numba-cuda, CuPy and torch (\"not installed\" when absent); the MPI library; "
                    "fault-tolerance mode; CUDA-awareness; the GPUs this process sees; and "
                    "device_kernels: a tiny numba.cuda kernel compiled and launched in a child process "
                    "and its output checked: \"ok (GPU name)\", \"simulator\" (NUMBA_ENABLE_CUDASIM=1) "
                    "or \"unavailable (reason)\".",
    )
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_info.add_argument("--no-kernel-check", action="store_true",
                        help="skip the device-kernel check (device_kernels: not checked)")
    p_info.add_argument("--kernel-timeout", type=_seconds, default=KERNEL_CHECK_TIMEOUT, metavar="SECONDS",
                        help=f"seconds the device-kernel check may take (default {KERNEL_CHECK_TIMEOUT:g})")
    p_cal = sub.add_parser(
        "calibrate",
        help="measure the datatype send-strategy tables (run with mpiexec -n 2)",
        description="Ping-pong between ranks 0 and 1 for every send strategy over message sizes x "
                    "contiguous block lengths; writes the tables the strategy model interpolates. "
                    "Point commlib at the file with COMMLIB_MODEL=PATH.",
    )
    p_cal.add_argument("--out", type=_writable_file, default="commlib-model.json", metavar="PATH",
                       help="output JSON, written by rank 0 (default commlib-model.json)")
    p_cal.add_argument("--sizes", type=_positive_ints(1 << 30), nargs="+", default=[64, 1024, 16384, 262144, 4 << 20],
                       metavar="BYTES", help="message sizes in bytes, 1..2^30 (default 64 1024 16384 262144 4194304)")
    p_cal.add_argument("--blocks", type=_positive_ints(1 << 30), nargs="+", default=[1, 8, 64, 512, 4096],
                       metavar="BYTES", help="contiguous block lengths in bytes (default 1 8 64 512 4096)")
    p_cal.add_argument("--repeat", type=_positive_ints(1 << 20), default=20, metavar="N",
                       help="round trips per point; the best is kept (default 20)")
    p_cal.add_argument("--device", action="store_true", help="also measure device strategies (needs a GPU)")
    p_master = sub.add_parser(
        "master",
        help="run the master of an elastic job (membership, heartbeats, epochs; blocks, Ctrl-C stops)",
        description="Run the master of an elastic job (commlib.elastic): peers connect with "
                    "commlib.elastic.connect('HOST:PORT', secret_file=F). The master keeps membership, admits "
                    "joiners at step boundaries, declares a silent peer dead after --heartbeat-timeout seconds, "
                    "and decides every all-reduce's outcome. Every connection authenticates with HMAC-SHA256 "
                    "over the shared secret before anything else; a wrong secret gets a closed connection. "
                    "Blocks until Ctrl-C.",
    )
    p_master.add_argument("--bind", type=_address, default="127.0.0.1:29500", metavar="HOST:PORT",
                          help="address to listen on (default 127.0.0.1:29500; 0.0.0.0:PORT for every interface; "
                               "port 0: a free port, printed at start)")
    p_master.add_argument("--secret-file", metavar="F",
                          help="file holding the shared secret (at least 16 bytes; default: the "
                               "COMMLIB_ELASTIC_SECRET environment variable)")
    p_master.add_argument("--heartbeat-timeout", type=_seconds, default=2.0, metavar="SECONDS",
                          help="silence after which a peer is declared dead (default 2)")
    p_master.add_argument("--encrypt", action="store_true",
                          help="seal every frame with AES-GCM (peers must pass encrypt=True)")
    p_master.add_argument("--probe-timeout", type=_seconds, default=5.0, metavar="SECONDS",
                          help="before admitting a joiner, dial its data address and require its own listener "
                               "to answer within this bound; a joiner nobody could dial is refused at connect "
                               "(default 5)")
    p_master.add_argument("--no-probe", action="store_true",
                          help="admit joiners without dialling their data address (for a master that cannot "
                               "reach the peers' network although the peers reach each other)")
    p_master.add_argument("--job-file", metavar="PATH",
                          help="file whose bytes describe the job (at most 16384; compared byte for byte with "
                               "each joiner's connect(job=...)): a joiner of another job is refused before "
                               "admission. Default: the first peer admitted with a job fixes it; peers with no "
                               "job are admitted either way")
    args = parser.parse_args(argv)
    if args.cmd == "master":
        return _serve(args)
    if args.cmd == "calibrate":
        from commlib.calibrate import calibrate  # noqa: PLC0415 - loads mpi4py.MPI (see info)

        comm = commlib.init()
        if comm.size < 2:
            if comm.rank == 0:
                print("commlib calibrate: error: needs at least 2 ranks (mpiexec -n 2 commlib calibrate)",
                      file=sys.stderr)
            return 2
        rec = calibrate(comm, args.sizes, args.blocks, repeat=args.repeat, device=args.device,
                        progress=comm.rank == 0 and sys.stderr.isatty())
        if comm.rank == 0:
            with open(args.out, "w", encoding="utf-8") as fh:
                json.dump(rec, fh, indent=1)
            print(f"wrote {args.out}: {', '.join(f'{loc}: {sorted(t)}' for loc, t in rec['tables'].items())}")
        return 0
    if args.cmd == "info":
        rec = info(kernel_check=not args.no_kernel_check, kernel_timeout=args.kernel_timeout)
        if args.json:
            print(json.dumps(rec, indent=2))
        else:
            width = max(len(k) for k in rec)
            for k, v in rec.items():
                if v is None:
                    v = "not installed" if k in ("cupy", "numba_cuda", "torch") else "n/a"
                elif isinstance(v, list):
                    v = ", ".join(v) if v else "none"
                print(f"{k:<{width}}  {v}")
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
