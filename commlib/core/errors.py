"""The commlib error hierarchy.

Every error derives from :class:`CommError` and its message names the rank and
the operation (``"rank 2: halo_exchange: ..."``), so a failure in a job of
hundreds of ranks can be traced from any one rank's log.
"""
from __future__ import annotations

__all__ = [
    "CommError",
    "ProcessFailed",
    "CommTimeout",
    "DatatypeError",
    "BufferError",
    "AuthenticationError",
    "InvalidArgument",
    "MessageSizeMismatch",
    "PeerFailure",
    "AuthError",
    "SecretError",
    "EncryptionMismatch",
    "NoHandshakeSlot",
    "SilentPort",
    "PeerClosed",
    "JobMismatch",
]


class CommError(RuntimeError):
    """Base of every commlib error.

    Args:
        message: what went wrong.
        rank: the rank that raised it (``None`` when not known).
        op: the operation, e.g. ``"allreduce"`` or ``"HaloExchange.exchange"``.
    """

    def __init__(self, message: str, *, rank: int | None = None, op: str | None = None):
        self.rank = rank
        self.op = op
        prefix = []
        if rank is not None:
            prefix.append(f"rank {rank}")
        if op:
            prefix.append(op)
        self.detail = message
        super().__init__(": ".join(prefix + [message]) if prefix else message)


class InvalidArgument(CommError, ValueError):
    """A call's arguments are wrong (shape, dtype, size, option). Raised before any byte moves."""


class MessageSizeMismatch(InvalidArgument):
    """A message's size (bytes) differs from the receive posted for it.

    Raised by the TCP transport's receive (:class:`~commlib.transports.tcp.TCPTransport`)
    when the sender's message is larger or smaller than the posted buffer: nothing
    past the buffer is written, the rest of the message is dropped and the link stays
    up.  Collectives that post their first round's receive at the size their own call
    implies take it to mean the sender's call differs (and refuse the call), which
    they must not infer from any other :class:`InvalidArgument` (a receive aborted by
    a relayed refusal, say).

    Attributes:
        head: the first bytes (at most 256) of the message's first frame, when the
            transport read that frame (a first round's one-frame message always);
            else None.  A first round's message starts with its sender's header
            row, so the receiver can name the field that differs.
        source: the sender's rank, when the transport knows it; else None.
    """

    head: bytes | None = None
    source: int | None = None


class ProcessFailed(CommError):
    """One or more peer processes failed.

    Attributes:
        failed: ranks (in the communicator the operation ran on) known to have failed.
    """

    def __init__(self, message: str, *, failed=(), rank=None, op=None):
        self.failed = tuple(sorted(failed))
        super().__init__(message, rank=rank, op=op)


class CommTimeout(CommError, TimeoutError):
    """A blocking operation did not complete within its timeout (seconds)."""


class DatatypeError(CommError, TypeError):
    """A datatype is malformed, unsupported, uncommitted, or does not fit the buffer."""


class BufferError(CommError):  # noqa: A001 - deliberately shadows the builtin inside commlib
    """A buffer cannot be used: unsupported type, non-contiguous, wrong device."""


class AuthenticationError(CommError):
    """An elastic peer failed authentication; it is not admitted and is sent nothing."""


class PeerFailure(ProcessFailed):
    """An elastic all-reduce was aborted because a peer failed, and was not
    retried (``retry=False``) or its retries could not complete it."""


class AuthError(AuthenticationError):
    """Authentication of an elastic peer with the master failed (wrong or missing
    secret, or the master refused); the other side learned nothing."""


class SecretError(AuthError):
    """The shared secret is unusable on this side: none given, its file missing,
    unreadable or empty, or shorter than 16 bytes.  A setup error found before
    any byte is sent; the message names the file."""


class EncryptionMismatch(CommError):
    """Both sides proved the shared secret, but one seals frames (``encrypt=True``,
    ``--encrypt``) and the other does not; the connection is closed.  Start every
    peer and the master with the same setting."""


class NoHandshakeSlot(CommError):
    """The listener had no handshake slot for this connection (it holds too many
    unauthenticated connections from this source, e.g. a flood) and closed it
    with a *busy* reply: not a wrong secret.  Retried with backoff within the
    caller's timeout before it is raised."""


class SilentPort(CommTimeout):
    """The address accepted the TCP connection but sent no challenge within the
    timeout: not a commlib listener, or a stalled process."""


class PeerClosed(CommError):
    """The elastic peer was used after :meth:`~commlib.elastic.Peer.close`."""


class JobMismatch(InvalidArgument):
    """An elastic joiner's job description (``connect(job=...)``) differs from the
    job its master serves (``Master(job=...)``, else the first peer it admitted with
    a job); the joiner was refused before admission, so the members saw nothing of it.

    Attributes:
        job: the job's description (bytes) as the master sent it, so the caller can
            name what differs (only a peer that proved the shared secret receives it).
        mine: this joiner's description (bytes).
    """

    def __init__(self, message: str, *, job: bytes = b"", mine: bytes = b"", rank=None, op=None):
        self.job, self.mine = job, mine
        super().__init__(message, rank=rank, op=op)
