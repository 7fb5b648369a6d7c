"""Failure detection for the MPI transport.

Under ULFM (User-Level Failure Mitigation; Bland, Bouteiller, Herault, Bosilca &
Dongarra, "Post-failure recovery of MPI communication capability: design and
rationale", IJHPCA 27(3), 2013) an operation involving a dead process completes
with an error of class ``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_PROC_FAILED_PENDING``
for a wildcard receive), and every operation on a communicator some survivor
revoked completes with ``MPI_ERR_REVOKED``.  Without ULFM a dead peer is only
noticed by a wait that does not end, so every wait in fault-tolerant mode is
bounded (``MPITransport.waitall`` with a ``timeout`` in seconds).
"""
from __future__ import annotations

from mpi4py import MPI

from commlib.core.errors import CommError, CommTimeout, ProcessFailed


__all__ = ["failure_class", "is_process_failure", "is_revoked", "to_comm_error", "mpi_failed_ranks",
           "raise_classified"]


def _cls(name: str) -> int | None:
    v = getattr(MPI, name, None)
    return int(v) if v is not None else None


_PROC_FAILED = {c for c in (_cls("ERR_PROC_FAILED"), _cls("ERR_PROC_FAILED_PENDING")) if c is not None}
_REVOKED = {c for c in (_cls("ERR_REVOKED"),) if c is not None}


def _class_of(code: int) -> int | None:
    """MPI's error class of ``code``; None when MPI does not know the code."""
    try:
        return int(MPI.Get_error_class(code))
    except MPI.Exception:
        return None


def failure_class(exc: BaseException) -> int | None:
    """The MPI error class of an ``MPI.Exception`` (None for other exceptions)."""
    if isinstance(exc, MPI.Exception):
        try:
            return int(exc.Get_error_class())
        except Exception:  # pragma: no cover
            return None
    return None


def is_process_failure(exc: BaseException) -> bool:
    """True for ``MPI_ERR_PROC_FAILED(_PENDING)`` or ``MPI_ERR_REVOKED``, or a
    commlib :class:`ProcessFailed` / :class:`CommTimeout`."""
    if isinstance(exc, (ProcessFailed, CommTimeout)):
        return True
    c = failure_class(exc)
    return c is not None and (c in _PROC_FAILED or c in _REVOKED)


def is_revoked(exc: BaseException) -> bool:
    """True for ``MPI_ERR_REVOKED``."""
    c = failure_class(exc)
    return c is not None and c in _REVOKED


def to_comm_error(exc: BaseException, *, rank=None, op=None, failed=()) -> CommError:
    """Translate an exception from a transport into the commlib hierarchy."""
    if isinstance(exc, CommError):
        return exc
    c = failure_class(exc)
    if c is not None and (c in _PROC_FAILED or c in _REVOKED):
        what = "communicator revoked by a survivor" if c in _REVOKED else "a peer process failed"
        return ProcessFailed(f"{what} ({exc})", failed=failed, rank=rank, op=op)
    return CommError(str(exc), rank=rank, op=op)


def mpi_failed_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """Ranks of ``comm`` the local ULFM runtime knows to have failed (empty
    without ULFM).  Uses ``MPI_Comm_get_failed`` (mpi4py ``Comm.Get_failed``)."""
    try:
        grp = comm.Get_failed()
    except (NotImplementedError, AttributeError, MPI.Exception):
        return ()
    try:
        n = grp.Get_size()
        if n == 0:
            return ()
        ranks = MPI.Group.Translate_ranks(grp, list(range(n)), comm.Get_group())
        return tuple(sorted(int(r) for r in ranks if r != MPI.UNDEFINED))
    finally:
        grp.Free()


def raise_classified(exc: MPI.Exception, statuses=(), rank=None, op: str = "waitall"):
    """Raise the error of an MPI call as a classified :class:`CommError`.

    A process failure or revocation (also when hidden behind
    ``MPI_ERR_IN_STATUS``: the real classes are in ``statuses``) becomes
    :class:`ProcessFailed`; anything else a :class:`CommError` carrying MPI's
    message.  The ``MPI.Exception`` is chained as the cause.
    """
    if failure_class(exc) == _cls("ERR_IN_STATUS"):
        codes = [s.Get_error() for s in statuses]
        # an implementation's internal code in a status (Open MPI's failed
        # MPI_Comm_idup requests after a peer died hold -2) has no class:
        # MPI_Error_class refuses it; it is left out here
        classes = {c for c in map(_class_of, codes) if c not in (None, MPI.SUCCESS, _cls("ERR_PENDING"))}
        if classes & (_PROC_FAILED | _REVOKED):
            what = "communicator revoked" if classes <= _REVOKED else "a peer process failed"
            raise ProcessFailed(f"{what} (error classes {sorted(classes)})", rank=rank, op=op) from exc
    raise to_comm_error(exc, rank=rank, op=op) from exc
