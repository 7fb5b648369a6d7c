"""The pieces of the ``"commlib"`` torch.distributed backend that are not the
group itself: torch tensors as the numpy arrays the collective engine takes,
torch's reduce ops as commlib's, and the ``Work`` handles with the worker
threads that complete them (:mod:`commlib.nn.distributed` is the group)."""
from __future__ import annotations

import queue
import threading
import time

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from commlib.core.errors import CommTimeout, InvalidArgument

__all__ = ["FAST_DTYPES", "FAST_OPS", "NUMPY_DTYPES", "FLOAT_DTYPES", "numpy_view", "bits_view", "HostTensor", "reduce_op", "needs_scaling",
           "Work", "done", "Worker", "P2PWaiter", "split_sizes", "p2p_tag"]

_ROP = dist.ReduceOp.RedOpType
_OPS = {_ROP.SUM: "sum", _ROP.AVG: "avg", _ROP.PRODUCT: "prod", _ROP.MIN: "min", _ROP.MAX: "max",
        _ROP.BAND: "band", _ROP.BOR: "bor", _ROP.BXOR: "bxor"}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NUMPY_DTYPES = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32,
                torch.float64: np.float64, torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16,
                torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}


#: the dtypes and ops of the synchronous all-reduce's hot path (numpy views, ops that need no check)
FAST_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.int32, torch.int64))
FAST_OPS = {_ROP.SUM: "sum", _ROP.MIN: "min", _ROP.MAX: "max", _ROP.PRODUCT: "prod"}

# ------------------------------------------------------------------ tensors
def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of CPU contiguous tensor ``t`` (bfloat16 as ml_dtypes.bfloat16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class HostTensor:
    """A host, contiguous stand-in for tensor ``t`` (``t`` itself when it already is one).

    ``array`` is the numpy view the engine works on; :meth:`back` copies the
    result into ``t`` when it is a stand-in (a non-contiguous or CUDA tensor)."""

    __slots__ = ("t", "h", "array")

    def __init__(self, t: torch.Tensor, rank: int, op: str, load: bool = True):
        if t.dtype not in NUMPY_DTYPES:
            raise InvalidArgument(f"dtype {t.dtype} is not supported (one of {sorted(map(str, NUMPY_DTYPES))})",
                                  rank=rank, op=op)
        self.t = t
        if t.device.type == "cpu" and t.is_contiguous():
            self.h = t
        elif load:
            self.h = t.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()
        else:
            self.h = torch.empty(t.shape, dtype=t.dtype)
        self.array = numpy_view(self.h).reshape(-1)

    def back(self) -> None:
        if self.h is not self.t:
            with torch.no_grad():
                self.t.copy_(self.h)


def reduce_op(reduce_op, dtype, rank: int, opname: str):
    """(commlib op name, PREMUL_SUM factor or None) of a torch ``ReduceOp``."""
    kind = getattr(reduce_op, "op", reduce_op)
    if kind == _ROP.PREMUL_SUM:
        factor = reduce_op.__getstate__()[1]
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return "sum", float(factor)
    name = _OPS.get(kind)
    if name is None:
        raise InvalidArgument(f"reduce op {reduce_op} is not supported", rank=rank, op=opname)
    if name == "avg" and dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"ReduceOp.AVG needs a floating dtype, got {dtype}", rank=rank, op=opname)
    return name, None


# ------------------------------------------------------------------ works
class Work(dist.Work):
    """A ``Work`` over a ``torch.futures.Future`` that completes with the call's
    output tensors: ``wait()`` raises the call's error, if it failed.

    A failed call's future completes too (with the output tensors as they
    are): torch's C++ consumers of a Python group's future (DDP's reducer)
    crash on a future that holds an error.  The error comes from ``wait()``,
    ``exception()`` and ``is_success()``, and the group raises it again on its
    next call (:class:`~commlib.nn.distributed.ProcessGroupCommlib`)."""

    def __init__(self, fut: torch.futures.Future, error: list | None = None):
        super().__init__()
        self._fut = fut
        self._error = error if error is not None else []

    def wait(self, timeout=None) -> bool:
        """Wait for the call; ``timeout`` (a ``timedelta`` or seconds; None or 0:
        no bound, torch's ``kNoTimeout``) bounds this wait only.

        Raises:
            CommTimeout: the call did not complete within ``timeout``.
            CommError: the call's own error.
        """
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else (timeout or 0)
        if seconds > 0 and not self._fut.done():
            deadline = time.monotonic() + seconds
            while not self._fut.done():
                if time.monotonic() >= deadline:
                    raise CommTimeout(f"the call did not complete within {seconds:g} s", op="Work.wait")
                time.sleep(min(1e-3, max(0.0, deadline - time.monotonic())))
        self._fut.wait()
        if self._error:
            raise self._error[0]
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and not self._error

    def exception(self):
        return self._error[0] if self._error else None


def done(result) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return Work(fut)


def _call(error: list, call, on_error=None) -> None:
    """Run ``call()``, keeping an error in ``error`` (delivered by :meth:`Work.wait`)."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - delivered by Work.wait()
        error.append(exc)
        if on_error is not None:
            on_error(exc)


def _finish(fut, error: list, call, result, on_error=None) -> None:
    """Run ``call()``; complete ``fut`` with ``result`` whatever happens, keeping an error in ``error``."""
    _call(error, call, on_error)
    fut.set_result(result)


class Worker:
    """One thread per group that runs its calls in the order they were made."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self.running = threading.Lock()  # held while a call of the group runs (worker or caller)
        self._thread = None
        self._name = name

    def idle(self) -> bool:
        return self._pending == 0

    def submit(self, fn, result, on_error=None) -> Work:
        """Queue ``fn()``; the work completes with ``result`` (see :class:`Work` for errors)."""
        fut, error = torch.futures.Future(), []
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name=self._name)
                self._thread.start()
        self._q.put((fn, fut, error, result, on_error))
        return Work(fut, error)

    def run_here(self, fn, result, on_error=None) -> Work:
        """Run ``fn()`` now, in the calling thread, as the worker would (the
        caller holds :attr:`running` and has found the worker idle): the work
        returned is complete, and a failure is delivered as the worker
        delivers it (its future completes, ``wait()`` raises)."""
        fut, error = torch.futures.Future(), []
        _finish(fut, error, fn, result, on_error)
        return Work(fut, error)

    def stop(self, timeout: float = 1.0) -> None:
        """End the thread once the calls queued before are done (waits at most ``timeout`` seconds)."""
        th = self._thread
        if th is not None and th.is_alive():
            self._q.put(None)
            th.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut, error, result, on_error = item
            with self.running:
                try:
                    _call(error, fn, on_error)
                finally:
                    with self._lock:
                        self._pending -= 1
            # completed only once the worker is idle again (when nothing else is queued):
            # a caller woken by this work finds it idle, so its next call may run inline
            fut.set_result(result)


class P2PWaiter:
    """Completes point-to-point works: waits their requests in a thread of its own,
    so a receive posted by ``irecv`` progresses while the caller runs on."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None

    def add(self, req, tensors, after=None) -> Work:
        """A work that completes with ``tensors`` once ``req`` has (then ``after()`` runs)."""
        fut, error = torch.futures.Future(), []
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="commlib-torch-p2p")
            self._thread.start()
        self._q.put((req, tensors, after, fut, error))
        return Work(fut, error)

    stop = Worker.stop

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            req, tensors, after, fut, error = item

            def call(req=req, after=after):
                req.wait()
                if after is not None:
                    after()
            _finish(fut, error, call, tensors)


def needs_scaling(op) -> bool:
    kind = getattr(op, "op", op)
    return kind == _ROP.PREMUL_SUM


def bits_view(a: np.ndarray) -> np.ndarray:
    """``a`` as a numpy array torch can wrap (bfloat16 bits as int16)."""
    a = np.ascontiguousarray(a)
    return a.view(np.int16) if a.dtype == ml_dtypes.bfloat16 else a


def split_sizes(t, sizes, n, rank, opname, what):
    sizes = list(sizes) if sizes else []
    if not sizes:
        if t.shape[0] % n if t.dim() else True:
            raise InvalidArgument(f"{what} of first dimension {tuple(t.shape)[:1]} does not split evenly over "
                                  f"{n} ranks", rank=rank, op=opname)
        sizes = [t.shape[0] // n] * n
    if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != (t.shape[0] if t.dim() else 0):
        raise InvalidArgument(f"{what} split sizes {sizes} do not cover the first dimension of "
                              f"{tuple(t.shape)} in {n} parts", rank=rank, op=opname)
    return list(torch.split(t, sizes, dim=0))


def p2p_tag(tag: int) -> int:
    return int(tag) & 0x3FFFFFFF
