"""Packed bytes on the wire: commlib-packed data received with the MPI datatype,
and MPI-typed sends unpacked by commlib (MPI-4.0 §5.2: MPI_PACKED matches any
type signature).  Run with ``mpiexec -n 2 python -m pytest --with-mpi``."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from commlib import datatypes as dts

pytestmark = pytest.mark.timeout(60)

TYPES = [
    lambda: dts.Vector(7, 3, 5, np.float64),
    lambda: dts.Subarray([6, 7, 8], [2, 3, 4], [1, 2, 3], np.int32, order="F"),
    lambda: dts.Struct([1, 2, 1], [0, 8, 24], [np.float64, np.int32, np.uint8]),
    lambda: dts.Resized(dts.Vector(5, 1, 4, np.float32), 0, 4),
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make", TYPES)
def test_packed_send_typed_recv_and_back(make):
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    t = make()
    count = 3
    m = t.to_mpi()
    nbytes = max(t.true_ub + (count - 1) * t.extent, count * t.extent)
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    try:
        if rank == 0:
            comm.Send([dts.pack(data, t, count), MPI.PACKED], dest=1, tag=1)
            got = np.zeros(count * t.size, np.uint8)
            comm.Recv([got, MPI.PACKED], source=1, tag=2)
            back = np.zeros_like(data)
            dts.unpack(got, t, back, count)
            want = np.zeros_like(data)
            dts.unpack(dts.pack(data, t, count), t, want, count)
            np.testing.assert_array_equal(back, want)
        elif rank == 1:
            recv = np.zeros_like(data)
            comm.Recv([recv, count, m], source=0, tag=1)
            np.testing.assert_array_equal(dts.pack(recv, t, count), dts.pack(data, t, count))
            comm.Send([data, count, m], dest=0, tag=2)
    finally:
        m.Free()
