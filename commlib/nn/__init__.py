"""Sequence-parallel attention for torch models: autograd functions over a commlib communicator.

The torch layer above :mod:`commlib.collectives` (torch is imported here and
nowhere below; install it with ``pip install "commlib[torch]"``).  Every function
takes this rank's shard of the sequence as torch tensors, q
``(batch, seq_local, heads, head_dim)`` and k, v
``(batch, seq_local, kv_heads, head_dim)`` (``heads % kv_heads == 0``; K/V travel
unreplicated), on CPU or CUDA, in float16, bfloat16, float32 or float64, and
returns ``out`` shaped like q that ``loss.backward()`` differentiates with
respect to q, k and v.  Block math runs on torch's fused attention kernels that
return the log-sum-exp; block outputs and lse are merged in float32 (float64
for float64 inputs), never in the half dtype, and dq and the travelling dk/dv
accumulate in float32.

One argument order, q, k, v, then the communicator (``ring_attention(q, k, v,
comm)``, as the numpy/CuPy ``commlib.ring_attention`` takes them); the
communicator first works with a ``DeprecationWarning``.  ``qkv_format="bhsd"``
takes and returns SDPA's ``(batch, heads, seq, head_dim)`` order instead of
``"bshd"`` ``(batch, seq, heads, head_dim)`` (Transformer Engine's names);
shapes that only fit the other order are refused.

Like :func:`torch.nn.functional.scaled_dot_product_attention`: under
``torch.autocast`` q, k, v are cast as SDPA's are (float32/float16 to the
autocast dtype, float64 unchanged) before anything moves, the output is in that
dtype and the gradients in the inputs' dtypes; SDPA's keywords ``scale``,
``is_causal``, ``enable_gqa``, ``dropout_p=0.0`` and ``attn_mask=None`` are
accepted (an ``attn_mask`` tensor or a nonzero ``dropout_p`` is refused).

* :func:`ring_attention`: K/V travel round the ring (Ring Attention, Liu et al.
  2023, arXiv:2310.01889) in the ``"contiguous"``, ``"striped"`` (Brandon et al.
  2023, arXiv:2311.09431) or ``"zigzag"`` layout; ``cu_seqlens`` for packed
  variable-length documents (FlashAttention's convention).
* ``window=(left, right)`` on every attention function and the module:
  sliding-window attention (FlashAttention-2's ``window_size``, -1
  unbounded; Longformer, Mistral) with ``causal`` and ``cu_seqlens``; over the
  ring a halo exchange (:mod:`commlib.nn.window`) that moves only the K/V rows
  inside the window, in Ulysses a mask.
* :func:`ring_attention_bidirectional`: each K/V shard split in two halves that
  travel round the ring in opposite directions, so a step moves half the bytes
  per link (the idea of TokenRing, arXiv:2412.20501, with a backward).
* :func:`ulysses_attention`: all-to-all from sequence to head shards and back
  (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509).
* :func:`hybrid_attention`: Ulysses inside groups of ``ulysses_degree`` ranks, a
  ring across the groups (USP, Fang & Zhao 2024, arXiv:2405.07719).
* :class:`Sharding`: a communicator with the sequence layout said once (the
  recommended path): ``sp.shard(x)``, any attention call or module given
  ``sp`` as its communicator, ``sp.unshard(out)`` all use its layout.
* :func:`shard_sequence` / :func:`unshard_sequence`: between the global
  sequence and this rank's shard (the latter differentiable); a shard
  remembers its layout and an attention call in another layout refuses it.
* :class:`SequenceParallelAttention`: a ``torch.nn.Module`` a model swaps in for
  its attention call.
* the ``torch.distributed`` backend ``"commlib"`` (:mod:`commlib.nn.distributed`,
  registered by importing this package): :func:`init_process_group` under
  ``mpiexec``/``srun``, ``torch.distributed.init_process_group("commlib")`` under
  ``torchrun``; DDP, FSDP2 and ``DeviceMesh`` run on commlib's collectives.

Bad arguments raise :class:`commlib.InvalidArgument` on every rank before any
byte moves; ``timeout`` is the deadline of the whole call (seconds; on a
fault-tolerant communicator, its own ``timeout`` when the call gives none):
every wait waits what is left of it, and past it the call raises
:class:`commlib.CommTimeout` naming the rank and the operation.

After a failure (``commlib.init(fault_tolerant=True)`` under ULFM): a rank
dying inside any of these calls, forward or ``loss.backward()``, makes every
survivor raise :class:`commlib.ProcessFailed` or :class:`commlib.CommTimeout`
(the rank that fails revokes the communicator's transports, the hybrid
grid's sub-communicators included, so nobody stays blocked on a live
neighbour).  The caller's rule, on every survivor::

    except (commlib.ProcessFailed, commlib.CommTimeout) as exc:
        if not getattr(exc, "recovered", False):  # True: comm shrank already
            comm.recover()                        # revoke, agree, shrink
        # re-shard over comm.size ranks and call again on the same comm

An error with ``recovered = True`` came from a collective that already
shrank the communicator: revoking or recovering it again would break the
survivors' new group.  Nothing cached for the old group is reused (the
hybrid's grids are keyed by the group and split anew).  A caller that saw a
failure in its own traffic instead calls :func:`revoke` (this layer's
transports of ``comm``) before ``comm.recover()``.
"""
from ._failure import revoke
from .distributed import ProcessGroupCommlib, communicator_of, init_process_group, reinit_process_group
from .hybrid import hybrid_attention
from .shard import Sharding
from .module import SequenceParallelAttention
from .ring import ring_attention, ring_attention_bidirectional
from .shard import shard_sequence, unshard_sequence
from .ulysses import ulysses_attention

__all__ = [
    "ring_attention",
    "ring_attention_bidirectional",
    "ulysses_attention",
    "hybrid_attention",
    "shard_sequence",
    "unshard_sequence",
    "SequenceParallelAttention",
    "Sharding",
    "revoke",
    "ProcessGroupCommlib",
    "init_process_group",
    "reinit_process_group",
    "communicator_of",
]
