"""Run-time configuration: every ``COMMLIB_*`` environment variable, read once.

The one place commlib reads its environment (the README lists the same table).
Values are read when this module is imported; code may override them on
:data:`config` (e.g. ``commlib.core.config.config.timeout = 5``) before creating
communicators.  Three are read at each use instead (properties of
:class:`Config`): ``COMMLIB_DATATYPE_STRATEGY`` and numba's
``NUMBA_ENABLE_CUDASIM`` (a job or a test may set them late) and
``COMMLIB_ELASTIC_SECRET`` (never stored).

==============================  =========  =====================================================
variable                        default    meaning
==============================  =========  =====================================================
``COMMLIB_CUDA_AWARE``          ``auto``   ``auto`` (ask MPI: ``MPIX_Query_cuda_support``), ``1``
                                           (MPI reads device pointers), ``0`` (stage via host)
``COMMLIB_TIMEOUT``             ``60``     seconds a blocking wait may take in fault-tolerant
                                           mode before :class:`~commlib.CommTimeout`
``COMMLIB_CHECK_ARGS``          ``1``      ``0`` skips the cross-rank argument agreement of the
                                           large-message collectives (small ones carry it free)
``COMMLIB_FT_MODE``             (detect)   ``ulfm`` or ``timeout``: force the fault-tolerance mode
``COMMLIB_FT_WATCHDOG``         ``1``      ``0``: no watchdog thread; every wait is polled instead
``COMMLIB_FT_GRACE``            ``2``      seconds past ``COMMLIB_TIMEOUT`` (after its revoke) a
                                           rank stuck inside MPI waits before it fails itself
                                           (exit status 70; ``0``: never); docs/faults-and-security.md
``COMMLIB_FT_DEBUG``            (off)      any value: trace fault-tolerance steps on stderr
``COMMLIB_FINALIZE_TIMEOUT``    ``3``      seconds ``MPI_Finalize`` may take at exit after a failure
``COMMLIB_DATATYPE_STRATEGY``   (model)    ``mpi|pack|device|mapped|staged``: force how typed
                                           sends move non-contiguous data
``COMMLIB_MODEL``               (built-in) path of a strategy model measured by
                                           ``commlib calibrate``
``COMMLIB_SMALL_BYTES``         ``1024``   largest allreduce / reduce_scatter / bcast payload
                                           (bytes) sent in one round with its argument header
``COMMLIB_DEVICE_KERNELS``      ``auto``   ``auto``: the CUDA C pack kernels through CuPy where
                                           CuPy runs, numba.cuda kernels otherwise; ``numba``
                                           forces the numba.cuda ones (to test them on a GPU)
``COMMLIB_ELASTIC_SECRET``      (none)     the elastic peers' shared secret when no
                                           ``secret``/``--secret-file`` is given (read at each
                                           use, :attr:`Config.elastic_secret`; never stored)
``COMMLIB_ELASTIC_SERVE_RATE``  ``0``      bytes/s cap on a donor's shared-state serving (0: no
                                           cap; for tests and WAN emulation)
``COMMLIB_ELASTIC_DEBUG``       (off)      any value: trace the elastic master's and peers'
                                           protocol (joins, votes, refused syncs, why a
                                           connection ended) on stderr
``COMMLIB_SLURM_SINGLETON``     ``warn``   MPI world size 1 inside a Slurm step of several tasks
                                           (``srun`` without the ``--mpi=`` this MPI needs):
                                           ``warn`` (once, naming it), ``error`` (``commlib.init``
                                           raises; the job scripts set it) or ``off``
``COMMLIB_TORCH_ASYNC``         ``auto``   how the torch backend runs ``async_op=True`` calls:
                                           ``auto`` runs those made inside a backward pass (DDP's
                                           and FSDP's gradient buckets) in the calling thread when
                                           the rank has no core to spare beside torch's threads,
                                           on the group's worker thread otherwise; ``inline``:
                                           those in the calling thread; ``thread``: all on the
                                           worker
``NUMBA_ENABLE_CUDASIM``        ``0``      numba's own variable, read here too: ``1`` runs device
                                           kernels in numba's CUDA simulator (CI without a GPU)
==============================  =========  =====================================================

``COMMLIB_SMALL_BYTES`` is 1 KiB because the one-round row (payload plus a 56-byte
header) must stay under the MPI library's eager limit: with Open MPI's shared-memory
transport (4 KiB eager limit) a 4 KiB payload made an 8-byte allreduce 50 us
instead of 7-19 us at 2 ranks, measured by ``benchmarks/bench_allreduce.py``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["Config", "config"]

_FALSE = ("0", "false", "no", "off")


#: the process environment's own store (CPython's ``os.environ._data``: bytes
#: keys on POSIX), which ``os.environ[...] =``, ``del``, ``putenv`` through
#: ``os.environ`` and pytest's monkeypatch all update; None where it is absent
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = getattr(os.environ, "encodekey", None)
#: name -> (its key in the store, the raw value last read, the default, the parsed string): read-at-each-use
#: variables parse only when the value changes
_ENV_SEEN: dict = {}


def _env_str(name: str, default: str) -> str:
    """``name``'s value, stripped and lower-cased (``default`` when unset), read
    now.  A read costs ~0.05 us, not ``os.environ.get``'s ~0.5 us (a missing
    key raises and catches a KeyError inside it): the typed point-to-point
    path reads ``COMMLIB_DATATYPE_STRATEGY`` on every call."""
    if _ENV_DATA is None or _ENV_KEY is None:
        return os.environ.get(name, default).strip().lower()
    seen = _ENV_SEEN.get(name)
    if seen is not None:
        raw = _ENV_DATA.get(seen[0])
        if raw is seen[1] and seen[2] == default:
            return seen[3]
    else:
        raw = _ENV_DATA.get(_ENV_KEY(name))
    value = (default if raw is None else os.environ.get(name, default)).strip().lower()
    _ENV_SEEN[name] = (_ENV_KEY(name), raw, default, value)
    return value


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return default
    return v.strip().lower() not in _FALSE


@dataclass
class Config:
    """commlib settings (see the module docstring for each variable).

    Attributes:
        cuda_aware: ``"auto"``, ``"1"`` or ``"0"``.
        timeout: seconds for bounded waits (fault-tolerant mode).
        check_args: run the cross-rank argument agreement of large collectives.
        ft_mode: ``"ulfm"``, ``"timeout"`` or ``""`` (detect).
        ft_watchdog: use the watchdog thread under ULFM.
        ft_grace: seconds the watchdog lets a revoked rank take to leave MPI
            before it fails itself (0: never).
        ft_debug: trace fault-tolerance steps on stderr.
        finalize_timeout: seconds, bound on ``MPI_Finalize`` after a failure.
        datatype_strategy: forced typed-send strategy, or ``""`` (the model decides).
        model: path of a calibrated strategy model, or ``""``.
        small_bytes: one-round threshold of the small collectives, bytes.
        device_kernels: ``"auto"`` or ``"numba"``.
        elastic_debug: trace the elastic protocol on stderr.
        torch_async: ``"auto"``, ``"inline"`` or ``"thread"`` (the torch backend's
            asynchronous calls; :mod:`commlib.nn.distributed`).
        elastic_serve_rate: bytes/s cap on a donor serving shared state to a
            joining elastic peer (0: no cap).
        elastic_secret: (property, read at each use) the elastic peers' shared
            secret from ``COMMLIB_ELASTIC_SECRET``, or None.
        cuda_simulator: (property, read at each use) numba's CUDA simulator is on.
    """

    cuda_aware: str = field(default_factory=lambda: _env_str("COMMLIB_CUDA_AWARE", "auto"))
    timeout: float = field(default_factory=lambda: float(os.environ.get("COMMLIB_TIMEOUT", "60")))
    check_args: bool = field(default_factory=lambda: _env_flag("COMMLIB_CHECK_ARGS", True))
    ft_mode: str = field(default_factory=lambda: _env_str("COMMLIB_FT_MODE", ""))
    ft_watchdog: bool = field(default_factory=lambda: _env_flag("COMMLIB_FT_WATCHDOG", True))
    ft_grace: float = field(default_factory=lambda: float(os.environ.get("COMMLIB_FT_GRACE", "2")))
    ft_debug: bool = field(default_factory=lambda: bool(os.environ.get("COMMLIB_FT_DEBUG")))
    finalize_timeout: float = field(default_factory=lambda: float(os.environ.get("COMMLIB_FINALIZE_TIMEOUT", "3")))
    model: str = field(default_factory=lambda: os.environ.get("COMMLIB_MODEL", "").strip())
    small_bytes: int = field(default_factory=lambda: int(os.environ.get("COMMLIB_SMALL_BYTES", "1024")))
    device_kernels: str = field(default_factory=lambda: _env_str("COMMLIB_DEVICE_KERNELS", "auto"))
    slurm_singleton: str = field(default_factory=lambda: _env_str("COMMLIB_SLURM_SINGLETON", "warn"))
    torch_async: str = field(default_factory=lambda: _env_str("COMMLIB_TORCH_ASYNC", "auto"))
    elastic_debug: bool = field(default_factory=lambda: bool(os.environ.get("COMMLIB_ELASTIC_DEBUG")))
    elastic_serve_rate: float = field(
        default_factory=lambda: float(os.environ.get("COMMLIB_ELASTIC_SERVE_RATE", "0") or 0))
    forced_strategy: str | None = None

    @property
    def datatype_strategy(self) -> str:
        """The forced typed-send strategy (``""``: the model decides).  Read from
        ``COMMLIB_DATATYPE_STRATEGY`` at each use, so a job (or a test) may set it
        late; assigning ``forced_strategy`` overrides it."""
        forced = self.forced_strategy
        if forced is not None:
            return forced
        seen = _ENV_SEEN.get("COMMLIB_DATATYPE_STRATEGY")  # _env_str's memo, inlined: read on every typed call
        if seen is not None and _ENV_DATA.get(seen[0]) is seen[1] and seen[2] == "":
            return seen[3]
        return _env_str("COMMLIB_DATATYPE_STRATEGY", "")

    @property
    def elastic_secret(self) -> bytes | None:
        """The elastic peers' shared secret from ``COMMLIB_ELASTIC_SECRET`` (its
        UTF-8 bytes; None when unset or empty), used when no ``secret`` or
        ``secret_file`` is given.  Read at each use and never stored, so it stays
        out of ``repr(config)`` and logs; a launcher may set it late.  Its length
        is checked where it is used (at least 16 bytes)."""
        v = os.environ.get("COMMLIB_ELASTIC_SECRET")
        return v.encode() if v else None

    @property
    def cuda_simulator(self) -> bool:
        """True when numba's CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM``
        set and not ``0``).  Read at each use: numba reads it when its config is
        first imported, and a test set-up may set it (and reload numba's config)
        after commlib is imported."""
        return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


config = Config()
