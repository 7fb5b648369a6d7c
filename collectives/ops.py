"""Reduction operators for the collective algorithms.

An :class:`Op` combines two arrays of the same dtype element-wise, in place:
``op.reduce(acc, x)`` sets ``acc[i] = acc[i] (op) x[i]``.  Every operator here is
commutative and, for IEEE floats, ``a + b`` and ``b + a`` round to the same bits,
so an algorithm that fixes *which* partial results are combined (not which
operand comes first) gives bit-identical results on every rank.

Operators (MPI-4.0 §6.9.2 names in parentheses):

- ``"sum"`` (``MPI_SUM``), ``"prod"`` (``MPI_PROD``), ``"min"`` (``MPI_MIN``),
  ``"max"`` (``MPI_MAX``): every supported dtype.
- ``"avg"``: sum, then one division by the group size after the reduction
  (as NCCL's ``ncclAvg``); floating dtypes only.
- ``"band"``, ``"bor"``, ``"bxor"`` (``MPI_BAND``, ``MPI_BOR``, ``MPI_BXOR``):
  integer and bool dtypes only.

Dtypes: ``float16``, ``bfloat16`` (``ml_dtypes``), ``float32``, ``float64``,
signed and unsigned 8- to 64-bit integers, ``bool``.  Arithmetic happens in the
buffer's own dtype (a float16 sum accumulates in float16, as MPI and NCCL do).
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from commlib.core.errors import InvalidArgument
from commlib.transports.base import native_op_name

from . import _device_reduce  # numpy and commlib.core.buffer; numba.cuda / CuPy load on a device array's first use

__all__ = ["Op", "OPS", "get_op", "reduce_into", "dtype_code", "dtype_name", "is_floating", "is_integer"]

try:  # ml_dtypes is a hard dependency, but keep the module importable without it
    import ml_dtypes as _mld

    _BFLOAT16 = np.dtype(_mld.bfloat16)
except Exception:  # pragma: no cover
    _BFLOAT16 = None

_FLOAT_NAMES = {"float16", "float32", "float64", "bfloat16"}


@functools.lru_cache(maxsize=256)
def is_floating(dtype) -> bool:
    """True for float16/32/64 and bfloat16 (which numpy sees as kind ``'V'``)."""
    dtype = np.dtype(dtype)
    return dtype.name in _FLOAT_NAMES


@functools.lru_cache(maxsize=256)
def is_integer(dtype) -> bool:
    """True for signed/unsigned integers and bool."""
    return np.dtype(dtype).kind in "iub"


@functools.lru_cache(maxsize=256)
def dtype_code(dtype) -> int:
    """A small integer naming ``dtype`` identically in every process (used by the
    argument-consistency header; numpy's ``dtype.num`` is not stable for
    user-defined dtypes such as bfloat16)."""
    dtype = np.dtype(dtype)
    return (zlib.crc32(dtype.str.encode() + dtype.name.encode()) & 0x3FFFFFFF) + 1


def dtype_name(code: int):
    """The name of the dtype whose :func:`dtype_code` is ``code`` (a byte order
    other than this machine's named too: ``"float32 (big-endian)"``; the code itself
    when unknown)."""
    for d in [*np.sctypeDict.values(), *([_BFLOAT16] if _BFLOAT16 is not None else [])]:
        try:
            native = np.dtype(d)
            for dt in (native, native.newbyteorder()):
                if dtype_code(dt) == code:
                    if dt.isnative or dt.byteorder == "|":
                        return dt.name
                    return f"{dt.name} ({'big' if dt.byteorder == '>' else 'little'}-endian)"
        except TypeError:
            continue
    return code


@dataclass(frozen=True)
class Op:
    """A commutative element-wise reduction.

    Attributes:
        name: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``, ``"band"``,
            ``"bor"`` or ``"bxor"``.
        code: a stable small integer (for the argument-consistency header).
        ufunc: the numpy ufunc that combines two operands.
        mean: True for ``"avg"`` (divide by the group size once, after the sum).
    """

    name: str
    code: int
    ufunc: Callable
    mean: bool = False

    def reduce(self, acc: np.ndarray, x: np.ndarray) -> None:
        """``acc <- acc (op) x`` element-wise, in place (same shape and dtype)."""
        self.ufunc(acc, x, out=acc)

    def finalize(self, acc: np.ndarray, size: int) -> None:
        """Apply the post-reduction step (``avg``: divide by ``size``) in place."""
        if self.mean and size > 1:
            np.divide(acc, np.asarray(size, dtype=acc.dtype), out=acc)

    def check(self, dtype, *, rank=None, op: str = "reduce") -> None:
        """Raise :class:`InvalidArgument` when this operator does not fit ``dtype``."""
        dtype = np.dtype(dtype)
        if (self.name, dtype) in _CHECKED:
            return
        if not (is_floating(dtype) or is_integer(dtype)):
            raise InvalidArgument(f"dtype {dtype.name} is not supported by reductions", rank=rank, op=op)
        if self.name in ("band", "bor", "bxor") and not is_integer(dtype):
            raise InvalidArgument(f"op '{self.name}' needs an integer dtype, got {dtype.name}", rank=rank, op=op)
        if self.mean and not is_floating(dtype):
            raise InvalidArgument(f"op 'avg' needs a floating dtype, got {dtype.name}", rank=rank, op=op)
        if self.name in ("sum", "prod") and dtype.kind == "b":
            raise InvalidArgument(f"op '{self.name}' is not defined for bool; use 'bor'/'band'", rank=rank, op=op)
        _CHECKED.add((self.name, dtype))


_CHECKED: set = set()


#: the reduction operators by name (``op="sum"`` etc.): each an :class:`Op`
OPS: dict[str, Op] = {
    "sum": Op("sum", 1, np.add),
    "prod": Op("prod", 2, np.multiply),
    "min": Op("min", 3, np.minimum),
    "max": Op("max", 4, np.maximum),
    "avg": Op("avg", 5, np.add, mean=True),
    "band": Op("band", 6, np.bitwise_and),
    "bor": Op("bor", 7, np.bitwise_or),
    "bxor": Op("bxor", 8, np.bitwise_xor),
}


def get_op(op, *, rank=None, opname: str = "reduce") -> Op:
    """Look up an operator by name (case-insensitive) or pass an :class:`Op` through.

    Also accepts a wire library's own reduction objects that a loaded
    transport names (:func:`commlib.transports.base.native_op_name`): the MPI
    transport (:mod:`commlib.transports.mpi`, loaded by ``commlib.init``) names
    ``mpi4py.MPI.Op``'s ``SUM, PROD, MIN, MAX, BAND, BOR, BXOR``.  This module
    never imports MPI (an elastic peer runs none).

    Raises:
        InvalidArgument: an unknown operator.
    """
    if isinstance(op, Op):
        return op
    if not isinstance(op, str):
        name = native_op_name(op)
        if name is not None:
            return OPS[name]
        raise InvalidArgument(f"unknown op {op!r}; expected one of {sorted(OPS)} (or an MPI.Op such as MPI.SUM "
                              "once commlib's MPI transport is loaded)", rank=rank, op=opname)
    o = OPS.get(op.lower())
    if o is None:
        raise InvalidArgument(f"unknown op {op!r}; expected one of {sorted(OPS)}", rank=rank, op=opname)
    return o


def reduce_into(acc, incoming, op) -> None:
    """``acc <- acc (op) incoming`` element-wise, in place, where the data lives:
    numpy arrays with the op's ufunc, device arrays (CuPy, numba, the CUDA
    simulator's) with the device kernels of :mod:`._device_reduce` (same bits
    as the ufunc; numba.cuda or CuPy load when the first device array comes).

    Args:
        acc, incoming: 1-D arrays, same size and dtype, both host or both device.
        op: an :class:`Op` or its name.
    """
    o = get_op(op)
    if isinstance(acc, np.ndarray):
        o.reduce(acc, np.asarray(incoming))
        return
    _device_reduce.reduce_into(acc, incoming, o)
