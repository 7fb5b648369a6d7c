"""The datatype protocol and MPI's regular type constructors (MPI-4.0 §5.1.1-§5.1.2, §5.1.7).

:class:`Datatype` is the base of every commlib type: its packed ``size``, its
bounds (``lb``, ``ub``, ``extent``, ``true_lb``, ``true_ub``, ``true_extent``;
bytes, computed per the MPI standard, including the alignment padding ε of types
without explicit bound markers and the sticky markers that ``Resized`` sets),
its canonical layout (:meth:`Datatype.canonical`, cached) and how to build the
equivalent committed ``MPI.Datatype`` (:meth:`Datatype.to_mpi`).  Here too:
:class:`Named` (a numpy dtype), the vector, indexed, struct and resized
constructors, :func:`as_datatype` and :func:`from_mpi`.  The array constructors
(``Subarray``, ``Darray``) are in :mod:`.array_types`; the package gathers
both.

Why :func:`from_mpi` is here and finds constructors by name: every constructor
coerces its ``base`` with :func:`as_datatype`, which decodes an
``MPI.Datatype`` with :func:`from_mpi`, which builds constructors again, the
array ones included.  So that :mod:`.array_types` can import this module and
not the other way round, each concrete class registers itself under its MPI
combiner name when it is defined (``Datatype.__init_subclass__``) and builds
itself from decoded parameters (:meth:`Datatype.from_decoded`).  Importing
``commlib.datatypes`` defines them all, so every combiner of
:data:`commlib.datatypes.mpi.COMBINERS` has its class before any handle is
decoded.

Types are immutable; a type caches its canonical form and its pack plans, so
building it once and packing it every step is cheap.
"""
from __future__ import annotations

import operator

import numpy as np
from mpi4py import MPI

from commlib.core.errors import DatatypeError

from . import canonical as _c
from . import mpi as _mpi

__all__ = [
    "Contiguous",
    "Datatype",
    "Hindexed",
    "HindexedBlock",
    "Hvector",
    "Indexed",
    "IndexedBlock",
    "Named",
    "Resized",
    "Struct",
    "Vector",
    "as_datatype",
    "from_mpi",
    "int_arg",
    "ints_arg",
]


def _err(msg: str, op: str):
    return DatatypeError(msg, op=op)


def as_datatype(obj, op: str = "datatype") -> Datatype:
    """Coerce ``obj`` to a commlib :class:`Datatype`.

    Args:
        obj: a commlib type, an ``MPI.Datatype``, or anything ``numpy.dtype()`` accepts.
        op: operation named in error messages.

    Raises:
        DatatypeError: when ``obj`` is none of those.
    """
    if isinstance(obj, Datatype):
        return obj
    if isinstance(obj, MPI.Datatype):
        return from_mpi(obj)
    try:
        dt = np.dtype(obj)
    except TypeError:
        raise _err(f"cannot use {obj!r} as a datatype (commlib type, MPI.Datatype or numpy dtype)", op) from None
    t = _NAMED.get(dt)
    if t is None:  # one Named per dtype, so its pack plans are cached across calls
        t = Named(dt)
        if len(_NAMED) < 1024:
            _NAMED[dt] = t
    return t


_NAMED: dict = {}
#: combiner name -> the class that builds it (filled by Datatype.__init_subclass__)
_CONSTRUCTORS: dict = {}


def int_arg(x, what: str, op: str) -> int:
    """The argument ``x`` (named ``what`` in messages) as a Python int: ints and numpy
    integers only.  A float (2.5 or 2.0), a bool or a string is refused rather than
    truncated (:class:`DatatypeError` naming ``op``)."""
    if isinstance(x, (bool, np.bool_)):
        raise _err(f"{what} must be an int, got the bool {x!r}", op)
    try:
        return operator.index(x)
    except TypeError:
        raise _err(f"{what} must be an int, got {x!r}", op) from None


def ints_arg(seq, what: str, op: str) -> tuple:
    """The argument ``seq`` as a tuple of Python ints, each as :func:`int_arg` (a
    string is not a sequence of ints here)."""
    if isinstance(seq, (str, bytes)):
        raise _err(f"{what} must be a sequence of ints, got {seq!r}", op)
    try:
        items = list(seq)
    except TypeError:
        raise _err(f"{what} must be a sequence of ints, got {seq!r}", op) from None
    try:
        return tuple(int_arg(x, what, op) for x in items)
    except DatatypeError:
        raise _err(f"{what} must be a sequence of ints, got {seq!r}", op) from None


def _nonneg(x, what: str, op: str) -> int:
    x = int_arg(x, what, op)
    if x < 0:
        raise _err(f"{what} must be >= 0, got {x}", op)
    return x


class Datatype:
    """Base of every commlib datatype.

    Attributes:
        size: bytes of data in one element (the packed size, ``MPI_Type_size``).
        lb: lower bound in bytes (``MPI_Type_get_extent``).
        ub: upper bound in bytes; ``extent = ub - lb``.
        extent: bytes between consecutive elements when ``count > 1``.
        true_lb: lowest byte offset of data (``MPI_Type_get_true_extent``).
        true_ub: one past the highest byte offset of data.
        true_extent: ``true_ub - true_lb``.
        alignment: largest alignment of the basic types (bytes), for ε.
        markers: True when the bounds are explicit markers (set by ``Resized``,
            ``Subarray``, ``Darray``) that nesting keeps, as MPI does.
    """

    combiner = "ABSTRACT"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # a class naming its own combiner is that combiner's constructor for
        # from_mpi; the first one wins (commlib's, defined at import), so a
        # user's subclass never takes over the decoding
        if "combiner" in cls.__dict__:
            _CONSTRUCTORS.setdefault(cls.combiner, cls)

    def __init__(self):
        self._layout = None
        self._plans = {}

    @classmethod
    def from_decoded(cls, params: dict, kids: list) -> Datatype:
        """This constructor applied to one decoded MPI constructor.

        Args:
            params: :attr:`commlib.datatypes.mpi.Decoded.params` (the arguments
                ``MPI_Type_get_contents`` returns, without the inner handles).
            kids: the commlib types of the inner handles (the base, or a
                struct's types).
        """
        raise NotImplementedError(f"{cls.__name__} is not built from a decoded MPI type")  # pragma: no cover

    # ------------------------------------------------------------ bounds
    def _set_bounds(self, size, lb, ub, true_lb, true_ub, alignment, markers):
        self.size = int(size)
        self.lb = int(lb)
        self.ub = int(ub)
        self.extent = self.ub - self.lb
        self.true_lb = int(true_lb)
        self.true_ub = int(true_ub)
        self.true_extent = self.true_ub - self.true_lb
        self.alignment = int(alignment)
        self.markers = bool(markers)

    def _bounds_from_copies(self, parts):
        """Bounds of a type made of copies of children (MPI-4.0 §5.1.6-§5.1.7).

        Args:
            parts: list of ``(child, dmin, dmax, ncopies)``: ``ncopies`` copies of
                ``child`` at displacements (bytes) between ``dmin`` and ``dmax``.
        """
        # copies of an empty type (size 0) add nothing, not even bound markers
        # (Open MPI: contiguous(1, an empty darray) has extent 0)
        parts = [p for p in parts if p[3] > 0 and p[0].size > 0]
        if not parts:
            self._set_bounds(0, 0, 0, 0, 0, 1, False)
            return
        size = sum(t.size * n for t, _, _, n in parts)
        markers = any(t.markers for t, _, _, _ in parts)
        align = max(t.alignment for t, _, _, _ in parts)
        if markers:
            src = [p for p in parts if p[0].markers]
            lb = min(dmin + t.lb for t, dmin, _, _ in src)
            ub = max(dmax + t.ub for t, _, dmax, _ in src)
        else:
            # one block at a time, padding the extent to the running alignment
            # after each (what Open MPI's opal_datatype_add does; with blocks
            # added in order this can exceed a single final rounding)
            lb = ub = None
            al = 1
            for t, dmin, dmax, _ in parts:
                lo, hi = dmin + t.lb, dmax + t.ub
                lb = lo if lb is None else min(lb, lo)
                ub = hi if ub is None else max(ub, hi)
                al = max(al, t.alignment)
                eps = (ub - lb) % al
                if eps:
                    ub += al - eps
        data = [p for p in parts if p[0].size > 0]
        if data:
            tlb = min(dmin + t.true_lb for t, dmin, _, _ in data)
            tub = max(dmax + t.true_ub for t, _, dmax, _ in data)
        else:
            tlb = tub = 0
        self._set_bounds(size, lb, ub, tlb, tub, align, markers)

    # ------------------------------------------------------------ layout
    def canonical(self):
        """The canonical layout of one element, cached on the type.

        Returns:
            StridedBlock | Blocks: ``{start, counts[], strides[]}`` in bytes when the
            type map is one strided block of any number of dimensions, otherwise
            the offsets/lengths form (see :mod:`commlib.datatypes.canonical`).
        """
        lay = self._layout
        if lay is None:
            lay = self._layout = self._compute_layout()
        return lay

    def _compute_layout(self):  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------ MPI
    def _mpi_parts(self) -> tuple:
        """The types whose MPI handles :meth:`_create_mpi` builds on (the base)."""
        return (self.base,)

    def _create_mpi(self, *handles):  # pragma: no cover - abstract
        """A new uncommitted MPI.Datatype over ``handles``, those of :meth:`_mpi_parts`."""
        raise NotImplementedError

    def _build_mpi(self):
        """Return ``(handle, owned)``: an uncommitted MPI.Datatype equal to this type
        (``owned``: the caller frees it).  The parts' handles are freed here."""
        parts = []
        try:
            for t in self._mpi_parts():
                parts.append(t._build_mpi())
            return self._create_mpi(*(h for h, _ in parts)), True
        finally:
            for h, owned in parts:
                if owned:
                    h.Free()

    def to_mpi(self):
        """A new committed ``MPI.Datatype`` with this type map and bounds.

        The caller owns it and frees it (``Free()``), named types included (a
        ``Dup`` of the predefined handle is returned for those).

        Raises:
            DatatypeError: when MPI rejects the construction.
        """
        try:
            h, owned = self._build_mpi()
            if not owned:
                h = h.Dup()
            return h.Commit()
        except MPI.Exception as exc:
            raise _err(f"MPI could not build {self!r}: {exc}", "to_mpi") from None

    # ------------------------------------------------------------ misc
    def same_layout(self, other) -> bool:
        """True when both types pack the same bytes in the same order and have the
        same size and extent (so ``count > 1`` packs alike too)."""
        other = as_datatype(other)
        return (
            self.size == other.size
            and self.extent == other.extent
            and self.lb == other.lb
            and self.canonical() == other.canonical()
        )

    def __repr__(self):
        return f"{type(self).__name__}({self._repr_args()})"

    def _repr_args(self) -> str:
        return ""


# --------------------------------------------------------------------- named


def _fields(dt: np.dtype) -> list:
    """``(offset, dtype)`` of a structured dtype's fields, in offset order."""
    return sorted(((v[1], v[0]) for v in dt.fields.values() if len(v) >= 2), key=lambda x: x[0])


def _dtype_runs(dt: np.dtype, base: int, offs: list, lens: list):
    if dt.fields is None and dt.subdtype is None:
        if dt.itemsize:
            offs.append(base)
            lens.append(dt.itemsize)
        return
    if dt.subdtype is not None:
        sub, shape = dt.subdtype
        for i in range(int(np.prod(shape))):
            _dtype_runs(sub, base + i * sub.itemsize, offs, lens)
        return
    for off, fdt in _fields(dt):
        _dtype_runs(fdt, base + off, offs, lens)


class Named(Datatype):
    """A basic (named) type given as a numpy dtype, e.g. ``Named(numpy.float64)``.

    Structured dtypes are accepted too: their fields (in offset order) are the
    type map and their ``itemsize`` the extent, like mpi4py's
    ``dtlib.from_numpy_dtype`` and the MPI pair types ``MPI_DOUBLE_INT``, ...

    Args:
        dtype: anything ``numpy.dtype()`` accepts.
        mpi: the predefined ``MPI.Datatype`` this was decoded from, if any (kept
            so :meth:`to_mpi` returns a ``Dup`` of the same handle).
        size: override of the packed size in bytes (named MPI types whose numpy
            equivalent differs, e.g. ``MPI_WCHAR``).

    Raises:
        DatatypeError: for an object dtype or a zero-size dtype.
    """

    combiner = "NAMED"

    def __init__(self, dtype, *, mpi=None, size=None):
        super().__init__()
        op = "Named"
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise _err(f"not a numpy dtype: {dtype!r}", op) from None
        if dt.hasobject:
            raise _err(f"object dtype {dt} has no fixed byte layout", op)
        self.dtype = dt
        self._mpi = mpi
        if size is not None:
            n = int(size)
            self._runs = ([0], [n]) if n else ([], [])
            self._set_bounds(n, 0, n, 0, n, 1, False)
            return
        offs: list = []
        lens: list = []
        _dtype_runs(dt, 0, offs, lens)
        self._runs = (offs, lens)
        total = sum(lens)
        tlb = min(offs) if offs else 0
        tub = max(o + n for o, n in zip(offs, lens)) if offs else 0
        self._set_bounds(total, 0, dt.itemsize, tlb, tub, max(dt.alignment, 1), False)

    def _compute_layout(self):
        return _c.regularize(np.array(self._runs[0], np.int64), np.array(self._runs[1], np.int64))

    def _build_mpi(self):
        if self._mpi is not None:
            return self._mpi, False
        dt = self.dtype
        # structured dtypes keep their basic types: built as the commlib types
        # they are (a struct of the fields resized to the itemsize, an array
        # as a contiguous run of its element)
        if dt.subdtype is not None:
            sub, shape = dt.subdtype
            return Contiguous(int(np.prod(shape)), Named(sub))._build_mpi()
        if dt.fields is not None:
            fields = _fields(dt)
            st = Struct([1] * len(fields), [o for o, _ in fields], [Named(f) for _, f in fields])
            return Resized(st, 0, dt.itemsize)._build_mpi()
        if dt.kind != "V":
            try:
                t = MPI.Datatype.fromcode(dt.char)
            except (KeyError, ValueError):
                t = None
            if t is not None and t.size == dt.itemsize:
                return t, False
        return MPI.BYTE.Create_contiguous(dt.itemsize), True

    def _repr_args(self):
        return str(self.dtype)


# --------------------------------------------------------------------- regular


class Hvector(Datatype):
    """``count`` blocks of ``blocklength`` elements, ``stride`` bytes apart
    (``MPI_Type_create_hvector``).

    Args:
        count: number of blocks (>= 0).
        blocklength: elements per block (>= 0).
        stride: bytes between block starts (any sign).
        base: element type.

    Raises:
        DatatypeError: for negative counts or an unusable base.
    """

    combiner = "HVECTOR"

    def __init__(self, count, blocklength, stride, base):
        super().__init__()
        op = type(self).__name__
        self.count = self._nb = _nonneg(count, "count", op)
        self.blocklength = self._bl = _nonneg(blocklength, "blocklength", op)
        self.base = as_datatype(base, op)
        self.stride = int_arg(stride, "stride", op)
        self.stride_bytes = self.stride * self._stride_unit()
        ext = self.base.extent
        c, b, s = self.count, self.blocklength, self.stride_bytes
        span_lo = min(0, (c - 1) * s) + min(0, (b - 1) * ext) if c and b else 0
        span_hi = max(0, (c - 1) * s) + max(0, (b - 1) * ext) if c and b else 0
        self._bounds_from_copies([(self.base, span_lo, span_hi, c * b)])

    def _stride_unit(self):
        return 1

    def _compute_layout(self):
        return _c.replicate(self.base.canonical(), (self._bl, self._nb), (self.base.extent, self.stride_bytes))

    @classmethod
    def from_decoded(cls, params, kids):
        return cls(params["count"], params["blocklength"], params["stride"], kids[0])

    def _create_mpi(self, inner):
        return inner.Create_hvector(self._nb, self._bl, self.stride_bytes)

    def _repr_args(self):
        return f"{self.count}, {self.blocklength}, {self.stride}, {self.base!r}"


class Vector(Hvector):
    """``count`` blocks of ``blocklength`` elements, ``stride`` *elements* (base
    extents) apart (``MPI_Type_vector``).

    Args:
        count: number of blocks (>= 0).
        blocklength: elements per block (>= 0).
        stride: base extents between block starts (any sign).
        base: element type.
    """

    combiner = "VECTOR"

    def _stride_unit(self):
        return self.base.extent

    def _create_mpi(self, inner):
        return inner.Create_vector(self._nb, self._bl, self.stride)


class Contiguous(Hvector):
    """``count`` elements back to back (``MPI_Type_contiguous``).

    Args:
        count: number of elements (>= 0).
        base: element type.
    """

    combiner = "CONTIGUOUS"

    def __init__(self, count, base):
        b = as_datatype(base, "Contiguous")
        super().__init__(1, _nonneg(count, "count", "Contiguous"), b.extent, b)
        self.count = self.blocklength

    @classmethod
    def from_decoded(cls, params, kids):
        return cls(params["count"], kids[0])

    def _create_mpi(self, inner):
        return inner.Create_contiguous(self._bl)

    def _repr_args(self):
        return f"{self._bl}, {self.base!r}"


class Hindexed(Datatype):
    """Blocks of ``blocklengths[i]`` elements at ``displacements[i]`` bytes
    (``MPI_Type_create_hindexed``).

    Args:
        blocklengths: ints >= 0, one per block.
        displacements: ints, bytes, same length.
        base: element type.

    Raises:
        DatatypeError: for mismatched lengths or negative block lengths.
    """

    combiner = "HINDEXED"
    _unit_name = "bytes"

    def __init__(self, blocklengths, displacements, base):
        super().__init__()
        op = type(self).__name__
        self.base = as_datatype(base, op)
        bl = ints_arg(blocklengths, "blocklengths", op)
        dp = ints_arg(displacements, "displacements", op)
        if len(bl) != len(dp):
            raise _err(f"{len(bl)} blocklengths but {len(dp)} displacements", op)
        if any(b < 0 for b in bl):
            raise _err("blocklengths must be >= 0", op)
        self.blocklengths = bl
        self.displacements = dp
        unit = self._disp_unit()
        ext = self.base.extent
        parts = []
        for b, d in zip(bl, dp):
            if b:
                d0 = d * unit
                dl = d0 + (b - 1) * ext
                parts.append((self.base, min(d0, dl), max(d0, dl), b))
        self._bounds_from_copies(parts)

    def _disp_unit(self):
        return 1

    def _compute_layout(self):
        unit = self._disp_unit()
        ext = self.base.extent
        pairs = [(b, d * unit) for b, d in zip(self.blocklengths, self.displacements) if b]
        if not pairs:
            return _c.EMPTY
        base = self.base.canonical()
        lens = {b for b, _ in pairs}
        if len(lens) == 1:
            b = pairs[0][0]
            return _c.replicate(base, (b,), (ext,), displs=np.array([d for _, d in pairs], np.int64))
        if isinstance(base, _c.StridedBlock) and base.ndim == 1 and base.block == ext:
            # dense base: each block is one run of b * ext bytes
            offs = np.array([d + base.start for _, d in pairs], np.int64)
            lns = np.array([b * ext for b, _ in pairs], np.int64)
            return _c.regularize(offs, lns)
        return _c.concatenate([_c.replicate(base, (b,), (ext,)).shifted(d) for b, d in pairs])

    @classmethod
    def from_decoded(cls, params, kids):
        return cls(params["blocklengths"], params["displacements"], kids[0])

    def _create_mpi(self, inner):
        return inner.Create_hindexed(list(self.blocklengths), list(self.displacements))

    def _repr_args(self):
        return f"{list(self.blocklengths)}, {list(self.displacements)}, {self.base!r}"


class Indexed(Hindexed):
    """Blocks of ``blocklengths[i]`` elements at ``displacements[i]`` base extents
    (``MPI_Type_indexed``)."""

    combiner = "INDEXED"

    def _disp_unit(self):
        return self.base.extent

    def _create_mpi(self, inner):
        return inner.Create_indexed(list(self.blocklengths), list(self.displacements))


class HindexedBlock(Hindexed):
    """Blocks of one ``blocklength`` at ``displacements[i]`` bytes
    (``MPI_Type_create_hindexed_block``)."""

    combiner = "HINDEXED_BLOCK"

    def __init__(self, blocklength, displacements, base):
        bl = _nonneg(blocklength, "blocklength", type(self).__name__)
        dp = ints_arg(displacements, "displacements", type(self).__name__)
        super().__init__([bl] * len(dp), dp, base)
        self.blocklength = bl

    @classmethod
    def from_decoded(cls, params, kids):
        return cls(params["blocklength"], params["displacements"], kids[0])

    def _create_mpi(self, inner):
        return inner.Create_hindexed_block(self.blocklength, list(self.displacements))

    def _repr_args(self):
        return f"{self.blocklength}, {list(self.displacements)}, {self.base!r}"


class IndexedBlock(HindexedBlock):
    """Blocks of one ``blocklength`` at ``displacements[i]`` base extents
    (``MPI_Type_create_indexed_block``)."""

    combiner = "INDEXED_BLOCK"

    def _disp_unit(self):
        return self.base.extent

    def _create_mpi(self, inner):
        return inner.Create_indexed_block(self.blocklength, list(self.displacements))


class Struct(Datatype):
    """Blocks of ``blocklengths[i]`` elements of ``types[i]`` at
    ``displacements[i]`` bytes (``MPI_Type_create_struct``).

    Args:
        blocklengths: ints >= 0.
        displacements: ints, bytes.
        types: element types (commlib types, MPI datatypes or numpy dtypes).

    Raises:
        DatatypeError: for mismatched lengths or negative block lengths.
    """

    combiner = "STRUCT"

    def __init__(self, blocklengths, displacements, types):
        super().__init__()
        op = "Struct"
        bl = ints_arg(blocklengths, "blocklengths", op)
        dp = ints_arg(displacements, "displacements", op)
        ts = [as_datatype(t, op) for t in types]
        if not (len(bl) == len(dp) == len(ts)):
            raise _err(f"{len(bl)} blocklengths, {len(dp)} displacements, {len(ts)} types", op)
        if any(b < 0 for b in bl):
            raise _err("blocklengths must be >= 0", op)
        self.blocklengths, self.displacements, self.types = bl, dp, tuple(ts)
        parts = []
        for b, d, t in zip(bl, dp, ts):
            if b:
                dl = d + (b - 1) * t.extent
                parts.append((t, min(d, dl), max(d, dl), b))
        self._bounds_from_copies(parts)

    def _compute_layout(self):
        return _c.concatenate(
            [
                _c.replicate(t.canonical(), (b,), (t.extent,)).shifted(d)
                for b, d, t in zip(self.blocklengths, self.displacements, self.types)
                if b
            ]
        )

    @classmethod
    def from_decoded(cls, params, kids):
        return cls(params["blocklengths"], params["displacements"], kids)

    def _mpi_parts(self):
        return self.types

    def _create_mpi(self, *handles):
        return MPI.Datatype.Create_struct(list(self.blocklengths), list(self.displacements), list(handles))

    def _repr_args(self):
        return f"{list(self.blocklengths)}, {list(self.displacements)}, {list(self.types)!r}"


class Resized(Datatype):
    """``base`` with its lower bound and extent set (``MPI_Type_create_resized``).

    The column idiom: ``Resized(Vector(n, 1, m, float64), 0, 8)`` packs
    ``count`` consecutive columns of an ``n x m`` C array.

    Args:
        base: the type.
        lb: new lower bound, bytes.
        extent: new extent, bytes.
    """

    combiner = "RESIZED"

    def __init__(self, base, lb, extent):
        super().__init__()
        self.base = as_datatype(base, "Resized")
        self.new_lb = int_arg(lb, "lb", "Resized")
        self.new_extent = int_arg(extent, "extent", "Resized")
        b = self.base
        self._set_bounds(b.size, self.new_lb, self.new_lb + self.new_extent, b.true_lb, b.true_ub, b.alignment, True)

    def _compute_layout(self):
        return self.base.canonical()

    @classmethod
    def from_decoded(cls, params, kids):
        return cls(kids[0], params["lb"], params["extent"])

    def _create_mpi(self, inner):
        return inner.Create_resized(self.new_lb, self.new_extent)

    def _repr_args(self):
        return f"{self.base!r}, {self.new_lb}, {self.new_extent}"


# --------------------------------------------------------------------- decoding


def from_mpi(dt, *, check: bool = True) -> Datatype:
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
    if isinstance(dt, Datatype):
        return dt
    _mpi.check_handle(dt)
    try:
        t = _mpi.cached(dt)
        if t is None:
            t = _mpi.cache(dt, _from_decoded(_mpi.decode(dt, check=check)))
    except MPI.Exception as exc:  # a stale handle (a copy of a freed one) reads as MPI_ERR_INTERN...
        raise DatatypeError(f"the MPI datatype cannot be read ({exc}): a freed handle, or a copy of one?",
                            op="from_mpi") from None
    return t


def _from_decoded(node) -> Datatype:
    """The commlib type of a :class:`commlib.datatypes.mpi.Decoded` tree."""
    if node.combiner == "NAMED":  # one Named per predefined handle
        t = _mpi.cached(node.handle)
        return t if t is not None else _mpi.cache(node.handle, _named_from_mpi(node))
    kids = [_from_decoded(k) for k in node.kids]
    if node.combiner == "DUP":
        t = kids[0]
    else:
        cls = _CONSTRUCTORS.get(node.combiner)
        if cls is None:  # pragma: no cover - every combiner in mpi.COMBINERS has its class
            raise DatatypeError(f"no commlib constructor for combiner {node.combiner}", op="from_mpi")
        t = cls.from_decoded(node.params, kids)
    # the decoded bounds must agree with MPI's; if an MPI pads differently, MPI wins
    if t.size != node.size:
        raise DatatypeError(f"decoded {node.combiner} type has size {t.size}, MPI says {node.size}", op="from_mpi")
    if (t.lb, t.extent) != (node.lb, node.extent):
        t = Resized(t, node.lb, node.extent)
    return t


def _named_from_mpi(node) -> Named:
    np_dt = node.params["dtype"]
    if np_dt is not None and np_dt.itemsize == node.extent and node.lb == 0:
        t = Named(np_dt, mpi=node.handle)
        if t.size == node.size:
            return t
    # unknown to numpy (e.g. MPI_WCHAR maps to a zero-size '<U'): raw bytes
    return Named(np.dtype(f"V{node.extent}"), mpi=node.handle, size=node.size)
