"""Shared-memory segments between processes on one node (POSIX shared memory).

A :class:`Segment` is a file in ``/dev/shm`` mapped with :mod:`mmap`: the
process that creates it and the processes that attach to it by name see the
same bytes.  It is the wire of the node-local halo exchange
(:class:`commlib.collectives.halo_node.NodeHalo`): a rank writes its edge
cells straight into its neighbour's segment and publishes a step counter
there, with no message, no MPI call and no progress engine in between.

The creator unlinks the name once every peer has attached
(:meth:`Segment.unlink`): the memory then lives exactly as long as some
process maps it, so a job that dies leaves nothing behind in ``/dev/shm``.
Nothing here registers with :mod:`multiprocessing`'s resource tracker.

Ordering.  A publisher writes its data, then :func:`store_fence`, then the
counter; a reader that sees the counter sees the data.  That holds on x86-64
(total store order; the fence also orders the weakly ordered stores a large
``memcpy`` may use), which :func:`supported` requires: on other
architectures the node-local exchange is not offered.
"""
from __future__ import annotations

import mmap
import os
import platform
import threading

import numpy as np

__all__ = ["Segment", "supported", "store_fence", "SHM_DIR"]

#: where POSIX shared memory lives on Linux
SHM_DIR = "/dev/shm"

_FENCE = threading.Lock()


def supported() -> str | None:
    """None when this process can use node-local segments, else why not
    (one line): an x86-64 CPU and a writable ``/dev/shm`` are needed."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64 (total store order)"
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)):
        return f"{SHM_DIR} is not a writable directory"
    return None


def store_fence() -> None:
    """A full memory barrier: the stores before it are visible to other cores
    before the stores after it (a locked instruction: a lock taken and
    released)."""
    _FENCE.acquire()
    _FENCE.release()


class Segment:
    """``nbytes`` of shared memory, mapped: :attr:`buf` (a uint8 numpy array).

    Use :meth:`create` (zero-filled) or :meth:`attach` (by the creator's name);
    :meth:`close` unmaps (the arrays viewing :attr:`buf` must be dropped first).

    Raises:
        OSError: from ``open``/``ftruncate``/``posix_fallocate``/``mmap``
            (no space in ``/dev/shm``, the name taken or missing, ...).
    """

    def __init__(self, name: str, nbytes: int | None, create: bool):
        self.name = name
        self._path = os.path.join(SHM_DIR, name)
        self._owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self._path, flags, 0o600)
        try:
            size = os.fstat(fd).st_size
            if create:
                os.ftruncate(fd, int(nbytes))  # a new file reads as zeros
                # take the pages now: a full /dev/shm is an OSError here, not a SIGBUS at the first write
                os.posix_fallocate(fd, 0, int(nbytes))
            elif nbytes is not None and size < nbytes:
                raise OSError(f"shared segment {name} has {size} bytes, expected {nbytes}")
            self.nbytes = int(nbytes if create or nbytes is not None else size)
            self._map = mmap.mmap(fd, self.nbytes)
        except BaseException:
            if create:
                os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._map, np.uint8)

    @classmethod
    def create(cls, name: str, nbytes: int) -> "Segment":
        """A new zero-filled segment ``name`` (a file name, no slash) of ``nbytes`` bytes."""
        return cls(name, nbytes, True)

    @classmethod
    def attach(cls, name: str, nbytes: int | None = None) -> "Segment":
        """Map the existing segment ``name``: its first ``nbytes`` bytes (None:
        all of it; ``OSError`` when it is shorter)."""
        return cls(name, nbytes, False)

    def unlink(self) -> None:
        """Remove the name (the creator, once every peer has attached); the
        memory stays mapped where it is mapped.  Idempotent."""
        if self._owner:
            self._owner = False
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink (when still named) and unmap; where views of :attr:`buf`
        are still alive the mapping goes with the last of them instead.
        Idempotent."""
        self.unlink()
        if self._map is not None:
            self.buf = None
            try:
                self._map.close()
            except BufferError:  # a view is alive: the map is released when it is collected
                pass
            self._map = None
