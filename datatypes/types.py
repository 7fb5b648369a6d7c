"""commlib's derived datatypes: one class per MPI type constructor (MPI-4.0 §5.1).

Every type knows its packed ``size``, its bounds (``lb``, ``ub``, ``extent``,
``true_lb``, ``true_ub``, ``true_extent``; bytes, computed per the MPI standard,
including the alignment padding ε of types without explicit bound markers and the
sticky markers that ``Resized`` sets), its canonical layout (``canonical()``,
cached) and how to build the equivalent committed ``MPI.Datatype``
(``to_mpi()``).  Types are immutable; a type caches its canonical form and its
pack plans, so building it once and packing it every step is cheap.

``base`` arguments accept a commlib type, an ``MPI.Datatype`` (decoded with
:func:`from_mpi`, which builds these types from the plain-value tree that
:mod:`.mpi` reads off the handle) or anything ``numpy.dtype()`` accepts.

This module gathers the types from where they are defined:

* :mod:`.constructors`: the :class:`Datatype` base, :class:`Named`, the vector,
  indexed, struct and resized constructors, :func:`as_datatype` and
  :func:`from_mpi`;
* :mod:`.array_types`: :class:`Subarray` and :class:`Darray` (and the
  ``DISTRIBUTE_*`` names of the distributions).
"""
from __future__ import annotations

from .array_types import (
    DISTRIBUTE_BLOCK,
    DISTRIBUTE_CYCLIC,
    DISTRIBUTE_DFLT_DARG,
    DISTRIBUTE_NONE,
    Darray,
    Subarray,
)
from .constructors import (
    Contiguous,
    Datatype,
    Hindexed,
    HindexedBlock,
    Hvector,
    Indexed,
    IndexedBlock,
    Named,
    Resized,
    Struct,
    Vector,
    as_datatype,
    from_mpi,
)

__all__ = [
    "DISTRIBUTE_BLOCK",
    "DISTRIBUTE_CYCLIC",
    "DISTRIBUTE_DFLT_DARG",
    "DISTRIBUTE_NONE",
    "Contiguous",
    "Darray",
    "Datatype",
    "Hindexed",
    "HindexedBlock",
    "Hvector",
    "Indexed",
    "IndexedBlock",
    "Named",
    "Resized",
    "Struct",
    "Subarray",
    "Vector",
    "as_datatype",
    "from_mpi",
]
