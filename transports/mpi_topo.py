"""Sub-communicators and Cartesian grids of the MPI transport (a mixin of
:class:`~commlib.transports.mpi.MPITransport`): ``MPI_Comm_create_group``,
``MPI_Cart_create`` and the grid queries (MPI-4.0 §6.4, §8.5)."""
from __future__ import annotations

from mpi4py import MPI

from .failures import raise_classified

__all__ = ["Topology"]


class Topology:
    """Group and grid creation over ``self.comm``; the host class is an
    :class:`~commlib.transports.mpi.MPITransport` (``comm``, ``cuda_aware``, ``_rank``)."""

    def create_group(self, ranks, tag: int = 0) -> "Topology":
        """A transport over ``MPI_Comm_create_group`` of ``ranks`` (MPI-3.0 §6.4.2; collective over them only)."""
        g = self.comm.Get_group()
        sub = g.Incl([int(r) for r in ranks])
        try:
            c = self.comm.Create_group(sub, int(tag))
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "create_group")
        finally:
            sub.Free()
            g.Free()
        return type(self)(c, cuda_aware=self.cuda_aware)

    def create_cart(self, dims, periods, reorder: bool = False) -> "Topology":
        """A transport over ``MPI_Cart_create`` (collective); its ``comm`` is an ``MPI.Cartcomm``."""
        try:
            c = self.comm.Create_cart(list(dims), list(periods), reorder=reorder)
        except MPI.Exception as exc:
            raise_classified(exc, (), self._rank, "cart_create")
        return type(self)(c, cuda_aware=self.cuda_aware)

    def cart_topo(self):
        """``(dims, periods, coords)`` of this rank (``MPI_Cart_get``)."""
        dims, periods, coords = self.comm.Get_topo()
        return tuple(int(d) for d in dims), tuple(bool(p) for p in periods), tuple(int(c) for c in coords)

    def cart_rank(self, coords) -> int:
        """``MPI_Cart_rank`` of in-range ``coords``."""
        return int(self.comm.Get_cart_rank([int(c) for c in coords]))

    def cart_coords(self, rank: int) -> tuple[int, ...]:
        """``MPI_Cart_coords`` of ``rank``."""
        return tuple(int(c) for c in self.comm.Get_coords(int(rank)))

    def cart_shift(self, direction: int, disp: int = 1) -> tuple[int, int]:
        """``MPI_Cart_shift``: ``(source, dest)``, ``PROC_NULL`` off a non-periodic edge."""
        src, dst = self.comm.Shift(int(direction), int(disp))
        return int(src), int(dst)
