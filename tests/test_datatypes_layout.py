"""How the datatype classes are found by ``from_mpi`` (serial, no MPI launch).

The types live in two modules (``constructors``, ``array_types``); ``from_mpi``
finds each class by its MPI combiner name, registered when the class is
defined.  These tests pin that the registry is complete, that a user's subclass
never takes over a combiner, and that ``commlib.datatypes`` gathers every
public name of the two.
"""
import numpy as np
from mpi4py import MPI

from commlib import datatypes as dts

array_types, constructors, dmpi = dts.array_types, dts.constructors, dts.mpi


def test_every_combiner_has_its_class():
    # DUP decodes to its base; every other combiner commlib reads is built by a class
    for name in dmpi.COMBINERS - {"DUP"}:
        cls = getattr(dts, "".join(w.capitalize() for w in name.split("_")))
        assert cls.combiner == name
        assert cls.from_decoded.__func__ is not constructors.Datatype.from_decoded.__func__, name


def test_a_user_subclass_does_not_take_over_decoding():
    class MyVector(dts.Vector):
        combiner = "VECTOR"

    h = MPI.DOUBLE.Create_vector(3, 1, 4).Commit()
    try:
        t = dts.from_mpi(h)
    finally:
        h.Free()
    assert type(t) is dts.Vector
    assert MyVector(3, 1, 4, np.float64).same_layout(t)


def test_array_types_decode_through_the_registry():
    h = MPI.DOUBLE.Create_subarray([4, 6], [2, 3], [1, 2]).Commit()
    d = MPI.INT.Create_darray(4, 3, [8, 8], [MPI.DISTRIBUTE_BLOCK, MPI.DISTRIBUTE_CYCLIC],
                              [MPI.DISTRIBUTE_DFLT_DARG, 2], [2, 2]).Commit()
    try:
        s, t = dts.from_mpi(h), dts.from_mpi(d)
    finally:
        h.Free()
        d.Free()
    assert type(s) is array_types.Subarray and s.same_layout(dts.Subarray([4, 6], [2, 3], [1, 2], np.float64))
    assert type(t) is array_types.Darray and (t.size, t.extent) == (16 * 4, 64 * 4)


def test_the_package_gathers_every_public_name():
    for name in dts.__all__:
        if hasattr(constructors, name) or hasattr(array_types, name):
            assert getattr(dts, name) is getattr(constructors if hasattr(constructors, name) else array_types, name)
    public = {n for m in (constructors, array_types) for n in vars(m)
              if isinstance(vars(m)[n], type) and issubclass(vars(m)[n], constructors.Datatype)}
    assert public <= set(dts.__all__), public - set(dts.__all__)
    assert {"as_datatype", "from_mpi"} <= set(dts.__all__)
