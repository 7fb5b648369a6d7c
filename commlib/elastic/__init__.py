"""Elastic peers over a WAN: a master, authenticated peers, collectives that survive churn.

The model is PCCL (Prime Collective Communications Library, arXiv 2505.14065):
a master keeps membership; the topology changes only at step boundaries, by a
vote of the live peers (:meth:`Peer.update_topology`); an all-reduce that loses
a peer is aborted on every survivor, the inputs are restored and it is retried
over the survivors; shared state is checked by SHA-256 hashes.  Every byte
travels over :mod:`commlib.transports.tcp` (authenticated frames, no pickle);
the collectives (``allreduce``, ``bcast``, ``allgather``, ``reduce_scatter``,
``alltoall``, ``barrier``) are calls of the collective engine over a
:class:`~commlib.transports.tcp.TCPTransport` of the current epoch, under the
master's verdict (:mod:`~commlib.elastic.group`).

Usage::

    import commlib.elastic as el
    master = el.Master(bind="0.0.0.0:29500", secret_file="secret"); master.start()
    peer = el.connect("master-host:29500", secret_file="secret")  # streams: 1 on loopback, else 4
    while training:
        if peer.update_topology():          # step boundary; admits joiners
            peer.sync_shared_state(state, revision)
        peer.allreduce(grad, op="avg", quantize="int8")

The package: :mod:`~commlib.elastic.protocol` (message kinds, limits, the
master's state machine and the threat model), :mod:`~commlib.elastic.master`
(:class:`Master`), :mod:`~commlib.elastic.peer` (:class:`Peer`,
:func:`connect`), :mod:`~commlib.elastic.join` (a peer's handshake with the master),
:mod:`~commlib.elastic.group` (the peer as a group of the engine:
its recovery policy and collectives), :mod:`~commlib.elastic.state_sync` (the peer's shared-state sync).  The quantized wire format is
:class:`commlib.transports.quantize.QuantizingTransport`; the errors
(:class:`PeerFailure`, :class:`AuthError`, :class:`SecretError`, :class:`EncryptionMismatch`,
:class:`NoHandshakeSlot`, :class:`SilentPort`, :class:`PeerClosed`, :class:`JobMismatch`) are in :mod:`commlib.core.errors`.
"""
from __future__ import annotations

from commlib.core.errors import (AuthError, EncryptionMismatch, JobMismatch, NoHandshakeSlot, PeerClosed, PeerFailure,
                                 SecretError, SilentPort)

from .master import Master
from .peer import Peer, connect
from .protocol import AUTO_STREAMS, HEARTBEAT_INTERVAL, PAIR_EXCHANGE_MAX

__all__ = ["Master", "Peer", "connect", "PeerFailure", "JobMismatch", "AuthError", "SecretError", "EncryptionMismatch",
           "NoHandshakeSlot", "SilentPort", "PeerClosed", "AUTO_STREAMS", "HEARTBEAT_INTERVAL", "PAIR_EXCHANGE_MAX"]
