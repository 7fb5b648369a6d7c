"""torch tensors on commlib's transport: zero-copy byte views and stream order.

The transport (:class:`commlib.transports.base.Transport`) moves contiguous
numpy arrays (host) and arrays exposing ``__cuda_array_interface__`` (device).
A torch tensor goes on the wire as a ``uint8`` view of its own storage, so
bfloat16 and float16 need no numpy dtype and nothing is copied:

* a CPU tensor becomes ``t.view(torch.uint8).numpy()`` (shares memory);
* a CUDA tensor becomes ``t.view(torch.uint8)`` (its
  ``__cuda_array_interface__``); before a send reads it, the tensor's producing
  stream (torch's current stream) is synchronized, since the transport does
  not follow torch's streams.  A CUDA-aware MPI reads device memory directly; a
  transport without CUDA awareness stages the bytes through host memory (the
  transport's own device-array path).

Receive buffers are contiguous tensors, written in place by the transport.
"""
from __future__ import annotations

import torch

from commlib.core.seconds import time_left

__all__ = ["wire_view", "before_send", "isend_tensor", "irecv_tensor", "all_to_all_tensors"]


def wire_view(t: torch.Tensor):
    """A ``uint8`` view of contiguous tensor ``t``'s bytes for the transport.

    Args:
        t: a contiguous tensor (any dtype, CPU or CUDA).

    Returns:
        numpy.ndarray (CPU) or torch.Tensor with ``__cuda_array_interface__``
        (CUDA), ``t.numel() * t.element_size()`` bytes, sharing ``t``'s memory.

    Raises:
        ValueError: ``t`` is not contiguous (callers make it so first).
    """
    if not t.is_contiguous():
        raise ValueError("wire_view needs a contiguous tensor")
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    b = flat.view(torch.uint8) if flat.element_size() != 1 or flat.dtype != torch.uint8 else flat
    if b.is_cuda:
        return b
    return b.numpy()


def before_send(t: torch.Tensor) -> None:
    """Order a send after the kernels that produced ``t`` (CUDA: synchronize
    torch's current stream; CPU: nothing)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def isend_tensor(transport, t: torch.Tensor, dest: int, tag: int):
    """Post a send of contiguous ``t``'s bytes to ``dest``; returns the transport's request.

    ``t`` must not be written until the request completes."""
    before_send(t)
    return transport.isend(wire_view(t), dest, tag)


def irecv_tensor(transport, t: torch.Tensor, source: int, tag: int):
    """Post a receive into contiguous ``t`` (written in place) from ``source``."""
    if t.is_cuda:
        # the receive must not race kernels still reading t on torch's stream
        torch.cuda.current_stream(t.device).synchronize()
    return transport.irecv(wire_view(t), source, tag)


def all_to_all_tensors(transport, send, tag: int, timeout, op: str):
    """Pairwise all-to-all of tensors: ``send[j]`` goes to rank ``j``; returns
    the list whose entry ``i`` came from rank ``i`` (this rank's own entry is
    ``send[rank]`` itself, not a copy).

    Args:
        transport: the group's transport.
        send: ``transport.size`` contiguous tensors of one shape, dtype and device.
        tag: the call's tag; timeout: the call's deadline (a
            :class:`~commlib.core.seconds.Deadline`: the exchange waits what is
            left of it) or seconds for the whole exchange (None: no bound).
        op: the operation named in errors.

    Raises:
        CommTimeout: not complete within ``timeout``; CommError: a transport failure.
    """
    P, r = transport.size, transport.rank
    recv = [None] * P
    recv[r] = send[r]
    reqs = []
    for i in range(1, P):  # every receive posted before any send
        src = (r - i) % P
        recv[src] = torch.empty_like(send[r])
        reqs.append(irecv_tensor(transport, recv[src], src, tag))
    for i in range(1, P):
        dst = (r + i) % P
        reqs.append(isend_tensor(transport, send[dst], dst, tag))
    transport.waitall(reqs, time_left(timeout), op=op)
    return recv

