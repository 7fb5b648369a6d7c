"""A peer failing inside an attention call on a fault-tolerant communicator.

The torch layer's calls are point-to-point traffic on a communicator's
collectives transport (and, for the hybrid, on the transports of the grid's
sub-communicators).  Under ULFM (``commlib.init(fault_tolerant=True)``,
``mpiexec --with-ft ulfm``) a dead peer is reported only to the ranks that
wait on it; the others wait on live neighbours that will never send.  So:

* every wait of a call on a fault-tolerant communicator is bounded: a call
  given no ``timeout`` waits at most the communicator's own (its
  :attr:`~commlib.Communicator.p2p_timeout`, the ``timeout`` of ``init``),
  and raises :class:`~commlib.CommTimeout` past it (:func:`bound`);
* a rank whose call fails (forward, or autograd's backward) revokes every
  transport of the call's *family* before the error leaves the call: the
  communicator's collectives transport and user transport and the grid
  sub-communicators made for it (:func:`link`, :func:`guarded`), so every
  rank blocked on a live neighbour, in this call or in a collective of the
  communicator, returns :class:`~commlib.ProcessFailed` at once and can join
  the recovery.  Argument errors (:class:`~commlib.InvalidArgument`, raised on
  every rank alike) revoke nothing;
* an error whose communicator already shrank inside the call (a collective
  the call ran, e.g. the grid's ``split``, recovered under ULFM) carries
  ``recovered = True`` and revokes nothing: the communicator holds the
  survivors already and must not be revoked or shrunk again.

The caller's rule after ``ProcessFailed`` or ``CommTimeout`` from any of the
torch layer's calls: every survivor calls ``comm.recover()`` unless
``getattr(exc, "recovered", False)``, then calls again on the shrunk ``comm``
(the same object; shards re-cut for its new size).  Nothing cached for the
old communicator is reused: caches are keyed by its collectives transport,
which a shrink replaces (:mod:`commlib.nn.hybrid`).
"""
from __future__ import annotations

import contextlib
import weakref

from commlib.core.errors import InvalidArgument
from commlib.core.seconds import call_deadline

__all__ = ["bound", "link", "revoke_family", "guarded", "revoke"]


class _Family:
    """The transports one communicator's attention calls use (weakly held)."""

    __slots__ = ("members", "__weakref__")

    def __init__(self):
        self.members = weakref.WeakSet()


_FAMILIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transport -> _Family


def bound(comm, timeout, op: str | None = None):
    """The deadline of a call (:func:`commlib.core.seconds.call_deadline`, from
    now; ``op`` named in its timeouts): of ``timeout`` when given, else of the fault-tolerant communicator's
    own (``comm.p2p_timeout``), else None (no bound).  Every wait of the call
    waits what is left of it; an invalid ``timeout`` is returned as it is, for
    the call's validation to refuse on every rank."""
    if timeout is None:
        timeout = getattr(comm, "p2p_timeout", None)
    return call_deadline(timeout, op)


def _ulfm(comm) -> bool:
    ft = getattr(comm, "ft", None)
    return ft is not None and getattr(ft, "mode", None) == "ulfm"


def link(tp, *others) -> None:
    """Put ``others`` in ``tp``'s family: a failure of a call on any of them
    revokes them all.  Only transports of fault-tolerant communicators are
    linked (a revoke would make any other unusable for good)."""
    fam = _FAMILIES.get(tp)
    if fam is None:
        fam = _FAMILIES[tp] = _Family()
        fam.members.add(tp)
    for t in others:
        if t is None:
            continue
        old = _FAMILIES.get(t)
        if old is not None and old is not fam:
            for m in list(old.members):
                fam.members.add(m)
                _FAMILIES[m] = fam
        fam.members.add(t)
        _FAMILIES[t] = fam


def link_comm(comm, tp) -> None:
    """Link a fault-tolerant (ULFM) communicator's user transport to its collectives transport ``tp``."""
    if _ulfm(comm):
        link(tp, getattr(comm, "transport", None))


def revoke_family(tp) -> None:
    """Revoke ``tp`` and its family (ULFM ``MPIX_Comm_revoke``; a no-op
    without ULFM).  A transport in no family is revoked only when it belongs
    to a fault-tolerant communicator."""
    fam = _FAMILIES.get(tp)
    members = list(fam.members) if fam is not None else ([tp] if getattr(tp, "fault_tolerant", False) else [])
    for t in members:
        try:
            t.revoke()
        except Exception:  # noqa: BLE001 - best effort: one transport's refusal must not hide the failure
            pass


@contextlib.contextmanager
def guarded(tp, comm=None):
    """Run a call's communication; on a failure revoke ``tp``'s family before
    the error leaves (see the module notes).

    Args:
        tp: the transport the call runs on.
        comm: the communicator the call was given (or None): when its
            collectives transport is no longer ``tp`` the communicator shrank
            during the call, and the error is marked ``recovered = True``.
    """
    try:
        yield
    except InvalidArgument:
        raise
    except Exception as exc:
        if comm is not None and not getattr(exc, "recovered", False) and _ulfm(comm) \
                and comm.collective_transport() is not tp:
            # a collective of the call recovered the communicator (its collectives
            # transport was replaced): revoking now would break the survivors' new one
            try:
                exc.recovered = True
            except AttributeError:  # pragma: no cover - an exception type without a __dict__
                pass
        if not getattr(exc, "recovered", False):
            revoke_family(tp)
        raise


def revoke(comm) -> None:
    """Revoke every transport the torch layer uses for ``comm``: its
    collectives transport, its user transport and the hybrid grids'
    sub-communicators, so that every rank blocked in an attention call (or a
    collective) on it returns :class:`~commlib.ProcessFailed` at once.

    For a caller that saw a failure outside the torch layer (its own
    traffic): call it before ``comm.recover()``.  Never after an error with
    ``recovered = True`` (the communicator is the survivors' new one).  A
    no-op for a communicator that is not fault tolerant under ULFM.
    """
    if not _ulfm(comm):
        return
    tp = comm.collective_transport()  # made with the communicator (fault tolerant)
    link_comm(comm, tp)
    revoke_family(tp)
