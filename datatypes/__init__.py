"""commlib.datatypes: MPI derived datatypes, canonicalized and packed on host or GPU.

Build types with the MPI constructors' names (MPI-4.0 §5.1) or decode any
committed ``MPI.Datatype``; every type canonicalizes to one strided block
``{start, counts[], strides[]}`` in bytes or, when irregular, to an
offsets/lengths form (TEMPI, Pearson et al., HPDC'22, extended to every
combiner and any number of dimensions); ``pack``/``unpack`` move the bytes with
numba kernels on the host and numba.cuda kernels on the device, byte-identical
to ``MPI_Pack``.

Pack with ``pack(buf, datatype, count=1, out=None, *, origin=0)``; in hot loops
bind the checks once with ``Packer(datatype, buf, count)`` and call it.  The
canonical form of a type is ``datatype.canonical()``; ``plan_for(datatype,
count)`` shows the cached plan (kind, word width, byte range touched).

Example::

    import numpy as np
    from commlib import datatypes as dts

    a = np.arange(4 * 6, dtype=np.float64).reshape(4, 6)
    col = dts.Resized(dts.Vector(4, 1, 6, np.float64), 0, 8)   # one column
    packed = dts.pack(a, col, count=2)                           # columns 0 and 1
    assert (packed.view(np.float64) == a[:, :2].T.ravel()).all()
"""
from .canonical import Blocks, StridedBlock
from .pack import Packer, pack, plan_for, unpack
from .array_types import Darray, Subarray
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
    "Datatype",
    "Named",
    "Contiguous",
    "Vector",
    "Hvector",
    "Indexed",
    "Hindexed",
    "IndexedBlock",
    "HindexedBlock",
    "Struct",
    "Subarray",
    "Darray",
    "Resized",
    "as_datatype",
    "from_mpi",
    "pack",
    "unpack",
    "plan_for",
    "Packer",
    "StridedBlock",
    "Blocks",
]
