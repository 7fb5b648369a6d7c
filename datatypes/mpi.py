"""Decoding ``MPI.Datatype`` handles into commlib types (MPI-4.0 §5.1.13).

:func:`from_mpi` walks ``MPI_Type_get_envelope`` / ``MPI_Type_get_contents``
(mpi4py's ``Datatype.decode()``) recursively, frees every inner handle that
``decode()`` returns (never a predefined one), and caches the decoded commlib type
on the MPI handle as an MPI attribute, so later calls on the same handle cost one
attribute lookup and a freed-then-reused handle can never hit a stale entry.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from commlib.core.errors import DatatypeError

from . import types as _t

__all__ = ["from_mpi", "check_committed"]

_KEYVAL = None
_NAMED_CACHE: dict = {}
_COMMIT_PROBE_IN = np.zeros(0, np.uint8)
_COMMIT_PROBE_OUT = np.zeros(1, np.uint8)


def _keyval():
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Datatype.Create_keyval()
    return _KEYVAL


def check_committed(dt, op: str = "from_mpi") -> None:
    """Raise :class:`DatatypeError` unless ``dt`` is a committed, not freed datatype.

    MPI has no "is committed" query; a zero-count ``MPI_Pack`` fails with
    ``MPI_ERR_TYPE`` on an uncommitted type and writes nothing.  mpi4py infers
    that count by dividing by the extent, so types of extent 0 cannot be probed
    and are accepted as they are.
    """
    if not isinstance(dt, MPI.Datatype):
        raise DatatypeError(f"expected an MPI.Datatype, got {type(dt).__name__}", op=op)
    if dt == MPI.DATATYPE_NULL:
        raise DatatypeError("MPI.DATATYPE_NULL (a freed or null datatype) cannot be used", op=op)
    if dt.is_predefined or dt.Get_extent()[1] == 0:
        return
    try:
        dt.Pack(_COMMIT_PROBE_IN, _COMMIT_PROBE_OUT, 0, MPI.COMM_SELF)
    except MPI.Exception as exc:
        raise DatatypeError(
            f"datatype {_name(dt)} is not committed (call Commit() first) or is invalid: {exc}", op=op
        ) from None


def _name(dt) -> str:
    try:
        n = dt.Get_name()
    except MPI.Exception:  # pragma: no cover
        n = ""
    if n:
        return n
    try:
        return f"<{dt.combiner_name if hasattr(dt, 'combiner_name') else dt.decode()[1]} handle 0x{dt.handle:x}>"
    except Exception:  # pragma: no cover
        return "<MPI datatype>"


def from_mpi(dt, *, check: bool = True) -> "_t.Datatype":
    """Decode a committed ``MPI.Datatype`` into an equivalent commlib type.

    Every combiner is handled, nested to any depth: named (basic and pair types),
    DUP, CONTIGUOUS, VECTOR, HVECTOR, INDEXED, HINDEXED, INDEXED_BLOCK,
    HINDEXED_BLOCK, STRUCT, SUBARRAY (C and Fortran order), DARRAY and RESIZED.
    The result is cached on the handle (an MPI attribute); the handle is not freed.

    Args:
        dt: a committed ``MPI.Datatype``.
        check: verify the handle is committed (done once per handle; the result
            is cached).

    Returns:
        Datatype: a commlib type with the same type map, size, bounds and extent.

    Raises:
        DatatypeError: for a null, freed or uncommitted handle, or a combiner
            commlib does not handle (the Fortran F90_* parameterized types, VALUE_INDEX).
    """
    if isinstance(dt, _t.Datatype):
        return dt
    if not isinstance(dt, MPI.Datatype):
        raise DatatypeError(f"expected an MPI.Datatype, got {type(dt).__name__}", op="from_mpi")
    if dt == MPI.DATATYPE_NULL:
        raise DatatypeError("MPI.DATATYPE_NULL (a freed or null datatype) cannot be used", op="from_mpi")
    if dt.is_predefined:
        h = dt.handle
        t = _NAMED_CACHE.get(h)
        if t is None:
            t = _NAMED_CACHE[h] = _decode(dt)
        return t
    kv = _keyval()
    t = dt.Get_attr(kv)
    if t is not None:
        return t
    if check:
        check_committed(dt)
    t = _decode(dt)
    try:
        dt.Set_attr(kv, t)
    except MPI.Exception:  # pragma: no cover - MPIs that refuse attributes
        pass
    return t


def _named(dt):
    from mpi4py.util import dtlib  # noqa: PLC0415

    size = dt.Get_size()
    try:
        np_dt = dtlib.to_numpy_dtype(dt)
    except Exception:  # noqa: BLE001
        np_dt = None
    lb, ext = dt.Get_extent()
    if np_dt is not None and np_dt.itemsize == ext and lb == 0:
        t = _t.Named(np_dt, mpi=dt)
        if t.size == size:
            return t
    # unknown to numpy (e.g. MPI_WCHAR maps to a zero-size '<U'): raw bytes
    return _t.Named(np.dtype(f"V{ext}"), mpi=dt, size=size)


def _decode(dt):
    if dt.is_named or dt.is_predefined:
        return _named(dt)
    base, combiner, p = dt.decode()
    inner = []
    try:
        if combiner == "STRUCT":
            inner = list(p["datatypes"])
            kids = [from_mpi(x, check=False) if x.is_predefined else _decode(x) for x in inner]
            t = _t.Struct(p["blocklengths"], p["displacements"], kids)
        else:
            inner = [base]
            b = from_mpi(base, check=False) if base.is_predefined else _decode(base)
            if combiner == "DUP":
                t = b
            elif combiner == "CONTIGUOUS":
                t = _t.Contiguous(p["count"], b)
            elif combiner == "VECTOR":
                t = _t.Vector(p["count"], p["blocklength"], p["stride"], b)
            elif combiner == "HVECTOR":
                t = _t.Hvector(p["count"], p["blocklength"], p["stride"], b)
            elif combiner == "INDEXED":
                t = _t.Indexed(p["blocklengths"], p["displacements"], b)
            elif combiner == "HINDEXED":
                t = _t.Hindexed(p["blocklengths"], p["displacements"], b)
            elif combiner == "INDEXED_BLOCK":
                t = _t.IndexedBlock(p["blocklength"], p["displacements"], b)
            elif combiner == "HINDEXED_BLOCK":
                t = _t.HindexedBlock(p["blocklength"], p["displacements"], b)
            elif combiner == "SUBARRAY":
                t = _t.Subarray(p["sizes"], p["subsizes"], p["starts"], b, order=p["order"])
            elif combiner == "DARRAY":
                dargs = [(-1 if a == MPI.DISTRIBUTE_DFLT_DARG else a) for a in p["dargs"]]
                t = _t.Darray(p["size"], p["rank"], p["gsizes"], p["distribs"], dargs, p["psizes"], b,
                              order=p["order"])
            elif combiner == "RESIZED":
                t = _t.Resized(b, p["lb"], p["extent"])
            else:
                raise DatatypeError(f"unsupported combiner {combiner} in {_name(dt)}", op="from_mpi")
    finally:
        for h in inner:
            if h != MPI.DATATYPE_NULL and not h.is_predefined:
                h.Free()
    # the decoded bounds must agree with MPI's; if an MPI pads differently, MPI wins
    lb, ext = dt.Get_extent()
    if (t.lb, t.extent) != (lb, ext) or t.size != dt.Get_size():
        if t.size != dt.Get_size():
            raise DatatypeError(
                f"decoded {combiner} type has size {t.size}, MPI says {dt.Get_size()}", op="from_mpi"
            )
        t = _t.Resized(t, lb, ext)
    return t
