"""Reading ``MPI.Datatype`` handles (MPI-4.0 §5.1.13): checks, decoding, caching.

:func:`decode` walks ``MPI_Type_get_envelope`` / ``MPI_Type_get_contents``
(mpi4py's ``Datatype.decode()``) recursively into a :class:`Decoded` tree of
plain values, freeing every inner handle that ``decode()`` returns (never a
predefined one).  The tree holds no commlib types: :mod:`.constructors` builds
them from it (:func:`commlib.datatypes.from_mpi`), so imports go one way,
constructors -> mpi.  :func:`cached` / :func:`cache` keep the built type on the handle as an MPI
attribute (predefined handles in a dict), so later calls on the same handle
cost one lookup and a freed-then-reused handle can never hit a stale entry.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from commlib.core.errors import DatatypeError

__all__ = ["Decoded", "COMBINERS", "decode", "check_handle", "check_committed", "cached", "cache"]

#: the combiners :func:`decode` reads (besides the named types)
COMBINERS = frozenset({"DUP", "CONTIGUOUS", "VECTOR", "HVECTOR", "INDEXED", "HINDEXED", "INDEXED_BLOCK",
                       "HINDEXED_BLOCK", "STRUCT", "SUBARRAY", "DARRAY", "RESIZED"})

_KEYVAL = None
_NAMED_CACHE: dict = {}
_COMMIT_PROBE_IN = np.zeros(0, np.uint8)
_COMMIT_PROBE_OUT = np.zeros(1, np.uint8)


@dataclass(frozen=True, eq=False)
class Decoded:
    """One constructor of an MPI type, as plain values.

    Attributes:
        combiner: ``"NAMED"`` or one of :data:`COMBINERS`.
        params: ``decode()``'s parameters without the inner handles
            (``"datatypes"``/base); DARRAY's default ``dargs`` read -1.  For
            ``"NAMED"``: ``{"dtype": the numpy dtype mpi4py maps it to, or None}``.
        kids: the decoded base (one), or STRUCT's types.
        size, lb, extent: what MPI reports for the handle (bytes).
        handle: the predefined handle, for ``"NAMED"``; else None.
    """

    combiner: str
    params: dict
    kids: tuple
    size: int
    lb: int
    extent: int
    handle: object = None


def _keyval():
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Datatype.Create_keyval()
    return _KEYVAL


def check_handle(dt, op: str = "from_mpi") -> None:
    """Raise :class:`DatatypeError` unless ``dt`` is an ``MPI.Datatype`` other than
    ``MPI.DATATYPE_NULL``."""
    if not isinstance(dt, MPI.Datatype):
        raise DatatypeError(f"expected an MPI.Datatype, got {type(dt).__name__}", op=op)
    if dt == MPI.DATATYPE_NULL:
        raise DatatypeError("MPI.DATATYPE_NULL (a freed or null datatype) cannot be used", op=op)


def check_committed(dt, op: str = "from_mpi") -> None:
    """Raise :class:`DatatypeError` unless ``dt`` is a committed, not freed datatype.

    MPI has no "is committed" query; a zero-count ``MPI_Pack`` fails with
    ``MPI_ERR_TYPE`` on an uncommitted type and writes nothing.  mpi4py infers
    that count by dividing by the extent, so types of extent 0 cannot be probed
    and are accepted as they are.
    """
    check_handle(dt, op)
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


def cached(dt):
    """The object :func:`cache` stored on the valid handle ``dt``, or None."""
    if dt.is_predefined:
        return _NAMED_CACHE.get(dt.handle)
    return dt.Get_attr(_keyval())


def cache(dt, obj):
    """Keep ``obj`` (a decoded commlib type) on the handle ``dt``; returns ``obj``."""
    if dt.is_predefined:
        _NAMED_CACHE[dt.handle] = obj
        return obj
    try:
        dt.Set_attr(_keyval(), obj)
    except MPI.Exception:  # pragma: no cover - MPIs that refuse attributes
        pass
    return obj


def decode(dt, *, check: bool = True) -> Decoded:
    """The constructor tree of ``dt`` (see :class:`Decoded`); ``dt`` is not freed.

    Raises:
        DatatypeError: for a null, freed or (``check``) uncommitted handle, or a
            combiner commlib does not handle (the Fortran F90_* parameterized
            types, VALUE_INDEX).
    """
    if check:
        check_committed(dt)
    else:
        check_handle(dt)
    return _decode(dt)


def _named(dt) -> Decoded:
    try:
        np_dt = dtlib.to_numpy_dtype(dt)
    except Exception:  # noqa: BLE001 - unknown to numpy
        np_dt = None
    lb, ext = dt.Get_extent()
    return Decoded("NAMED", {"dtype": np_dt}, (), dt.Get_size(), lb, ext, dt)


def _decode(dt) -> Decoded:
    if dt.is_named or dt.is_predefined:
        return _named(dt)
    base, combiner, p = dt.decode()
    inner = list(p.pop("datatypes")) if combiner == "STRUCT" else [base]
    try:
        if combiner not in COMBINERS:
            raise DatatypeError(f"unsupported combiner {combiner} in {_name(dt)}", op="from_mpi")
        kids = tuple(_decode(x) for x in inner)
    finally:
        for h in inner:
            if h != MPI.DATATYPE_NULL and not h.is_predefined:
                h.Free()
    if combiner == "DARRAY":
        p["dargs"] = [(-1 if a == MPI.DISTRIBUTE_DFLT_DARG else a) for a in p["dargs"]]
    lb, ext = dt.Get_extent()
    return Decoded(combiner, p, kids, dt.Get_size(), lb, ext)
