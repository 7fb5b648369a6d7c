"""Run-time configuration, read from the environment once and overridable in code.

Environment variables:

- ``COMMLIB_CUDA_AWARE``: ``auto`` (default: ask the MPI library), ``1`` (trust
  that MPI reads device pointers), ``0`` (always stage device buffers through
  host memory).
- ``COMMLIB_TIMEOUT``: seconds a blocking wait in fault-tolerant or elastic mode
  may take before :class:`commlib.CommTimeout` (default 60).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["Config", "config"]


def _env_str(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower()


@dataclass
class Config:
    """commlib settings.

    Attributes:
        cuda_aware: ``"auto"``, ``"1"`` or ``"0"`` (see module doc).
        timeout: seconds for bounded waits (fault-tolerant / elastic mode).
    """

    cuda_aware: str = field(default_factory=lambda: _env_str("COMMLIB_CUDA_AWARE", "auto"))
    timeout: float = field(default_factory=lambda: float(os.environ.get("COMMLIB_TIMEOUT", "60")))


config = Config()
