"""Joining an elastic job: a peer's connection to the master (:func:`reach_master`),
the authenticated handshake with its retries while the master's listener is
flooded, the job (``connect(job=...)``) and the master's welcome
(:func:`handshake`), and the errors of a refused join (:func:`job_refused`,
:func:`probe_refused`).  Every step waits what is left of connect's one deadline."""
from __future__ import annotations

import socket
import time

from commlib.core.errors import (AuthError, AuthenticationError, CommError, CommTimeout, InvalidArgument,
                                 JobMismatch, NoHandshakeSlot)
from commlib.core.seconds import Deadline
from commlib.transports import tcp

from .protocol import JOB, JOB_MAX, REFUSED, WELCOME, WHY_MAX

__all__ = ["reach_master", "handshake", "job_refused", "probe_refused"]


def reach_master(address: str, deadline: Deadline) -> socket.socket:
    """A TCP connection to the master at ``address`` within what is left of
    connect's ``deadline`` (one bound over the name's lookup and every address
    it resolves to).

    Raises:
        CommTimeout: no connection within the deadline (a flooded listener whose
            backlog drops the connection, a silent network, a stalled name lookup).
        CommError: the master cannot be reached (refused, unreachable, an
            address that does not resolve)."""
    try:
        infos = tcp.resolve(*tcp.parse_address(address), deadline.left())
    except TimeoutError:
        raise CommTimeout(f"cannot reach the master at {address}: the name lookup did not finish within "
                          f"connect's {deadline.timeout:g} s timeout (a stalled DNS server)", op="connect") from None
    except OSError as exc:
        raise CommError(f"cannot reach the master at {address}: {exc}", op="connect") from None
    try:
        sock = tcp.connect_first(infos, deadline.left)
    except socket.timeout:
        sock = None
    except OSError as exc:
        raise CommError(f"cannot reach the master at {address}: {exc}", op="connect") from None
    if sock is None:
        raise CommTimeout(f"cannot reach the master at {address}: no connection within connect's "
                          f"{deadline.timeout:g} s timeout (a flooded or stalled master, a network that "
                          "drops the connection)", op="connect")
    return sock


def job_refused(mine: bytes, theirs: bytes) -> JobMismatch:
    """The error of a join the master refused because this peer's job ``mine``
    differs from the job's ``theirs`` (both bytes; the first differing byte named)."""
    at = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
    return JobMismatch(
        f"this peer's job= ({len(mine)} bytes) differs from the job the master serves ({len(theirs)} bytes; "
        f"first difference at byte {at}), so it was not admitted and the job's peers saw nothing of it: "
        "start it with the job's settings (the job's bytes are this error's .job)",
        job=theirs, mine=mine, op="connect")


def probe_refused(why, data: str, advertise: str | None, bind: str | None, listener: str) -> CommError:
    """The error of a join the master refused (``refused``: its probe of this
    peer's data address ``data`` failed, ``why``; ``listener``: the address of
    this peer's data listener): :class:`InvalidArgument` when the address came
    from ``advertise`` or ``bind``, else :class:`CommError`."""
    why = why[:WHY_MAX] if isinstance(why, str) and why else "no reason given"
    if advertise is not None:
        return InvalidArgument(
            f"the master could not dial advertise={advertise!r} ({why}); the other peers would fail to dial it "
            f"too, so this peer was not admitted: advertise an address that reaches this peer's data listener "
            f"({listener}), or start the master with probe_timeout=None if only the master cannot reach it",
            op="connect")
    what = f"bind={bind!r}" if bind is not None else "this peer's data address"
    text = (f"the master could not dial {what} ({data}: {why}); the other peers would fail to dial it too, so "
            "this peer was not admitted: pass bind= an interface the others reach, or advertise= the address "
            "they dial (NAT, port forwarding)")
    return InvalidArgument(text, op="connect") if bind is not None else CommError(text, op="connect")


def handshake(sock: socket.socket, address: str, secret: bytes, hello: dict, deadline: Deadline, *,
              encrypt: bool, job: bytes | None, data: str, advertise: str | None, bind: str | None,
              listener: str) -> tuple[tcp.Connection, dict]:
    """The join over ``sock`` (a connection to the master at ``address``, from
    :func:`reach_master`): the authenticated handshake with ``hello`` (retried
    over a new connection, with jittered backoff, while the master's listener has
    no handshake slot), then ``job`` (when not None) and the master's welcome,
    all within ``deadline``.  ``data``, ``advertise``, ``bind``, ``listener``:
    this peer's data address and where it came from (the error of a refused
    probe names them).

    Returns:
        (the control connection, the welcome message).

    Raises:
        NoHandshakeSlot: the master's listener stayed flooded until the deadline.
        EncryptionMismatch: this peer's ``encrypt`` differs from the master's.
        AuthError: the handshake failed (a wrong secret), or the master closed
            the connection after it.
        JobMismatch: the master serves another job.
        InvalidArgument, CommError: the master's probe of the data address failed
            (:func:`probe_refused`).
        CommTimeout: no connection, handshake, job or welcome within the deadline."""
    who = f"the master at {address}"
    timeout = deadline.timeout
    tries = 0
    try:
        while True:
            tries += 1
            try:
                conn = tcp.client_handshake(sock, secret, hello, encrypt=encrypt, name=who,
                                            timeout=max(deadline.left(), 0.001))
                break
            except NoHandshakeSlot:
                # the master's listener is flooded: back off (with jitter) and try again
                # within the timeout; then say so (not "wrong secret")
                delay = tcp.retry_delay(tries)
                if deadline.left() <= delay + 0.05:
                    raise
                time.sleep(delay)
                sock = reach_master(address, deadline)
        stage = "the job"
        try:
            if job is not None:
                conn.send_ctrl({"t": JOB, "job": job}, timeout=max(deadline.left(), 0.001))
            stage = "the welcome"
            kind, _, msg = conn.read_ctrl(deadline=deadline.at, limit=1 << 16)
            if kind == tcp.K_CTRL and isinstance(msg, dict) and msg.get("t") == REFUSED:
                conn.close()
                theirs = msg.get("job")
                if job is not None and isinstance(theirs, bytes) and 1 <= len(theirs) <= JOB_MAX:
                    raise job_refused(job, theirs)
                raise probe_refused(msg.get("why"), data, advertise, bind, listener)
            if kind != tcp.K_CTRL or not isinstance(msg, dict) or msg.get("t") != WELCOME:
                raise tcp.FrameError("expected welcome")
        except TimeoutError:
            conn.close()
            if stage == "the job":
                raise CommTimeout(f"{who} authenticated this peer but did not take its job= within connect's "
                                  f"{timeout:g} s timeout: a stalled master", op="connect") from None
            raise CommTimeout(f"{who} authenticated this peer but sent no welcome within connect's {timeout:g} s "
                              f"timeout (it first dials this peer's data address {data}, for up to its "
                              "probe_timeout: can the master reach it?)", op="connect") from None
        except (tcp.FrameError, OSError) as exc:
            conn.close()
            raise AuthError(f"{who} closed the connection after authenticating this peer "
                            f"({type(exc).__name__}): it refused this peer's hello, or serves its maximum "
                            "of peers", op="connect") from None
    except AuthError:
        raise
    except AuthenticationError as exc:
        raise AuthError(exc.detail, op="connect") from None
    return conn, msg
