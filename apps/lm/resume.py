"""Resuming and stopping a training run of ``python -m commlib.apps.lm`` (torch loads here).

* :func:`resume_training`: every rank reads ``--resume``'s newest checkpoint
  (all or none) into the model, the optimizer, the data stream and the RNGs;
* :func:`agree_or_raise`: a problem on one rank (a checkpoint that would not
  write or read) raises on every rank, so none waits for the one that failed;
* :class:`Stopped`: raised on every rank when a stop signal (SIGUSR1, SIGTERM:
  :class:`commlib.apps._cli.StopSignals`) ended the run after a step and its
  checkpoint; the command line exits :data:`commlib.apps._cli.EXIT_REQUEUE`.

A resumed run may extend ``--steps``: the configuration compared with the
checkpoint's leaves ``steps`` and ``schedule_steps`` out (:data:`EXTENDABLE`;
the command line checks them against the manifest: a larger ``--steps`` only,
and the learning-rate schedule of the first run kept).
"""
from __future__ import annotations

import numpy as np

from .checkpoint import CheckpointError, load_checkpoint, set_rng_state

__all__ = ["EXTENDABLE", "Stopped", "agree_or_raise", "resume_training"]

#: configuration keys a resume may change (checked by the command line, not by the checkpoint's config)
EXTENDABLE = ("steps", "schedule_steps")


class Stopped(Exception):
    """A stop signal ended the run after step ``step`` (1-based), checkpointed in ``checkpoint``."""

    def __init__(self, signal: str, step: int, steps: int, checkpoint: str):
        self.signal, self.step, self.steps, self.checkpoint = signal, step, steps, checkpoint
        super().__init__(f"{signal}: stopped after step {step} of {steps}; checkpoint of step {step} in "
                         f"{checkpoint}")


def agree_or_raise(comm, problem, what):
    """Every rank raises when one had ``problem`` (an exception, or None): one
    all-reduce, so no rank is left waiting on the one that failed."""
    bad = np.array([1.0 if problem is not None else 0.0])
    if comm.size > 1:
        comm.allreduce(bad)
    if bad[0] > 0:
        if problem is not None:
            raise problem
        raise CheckpointError(f"{what}: {int(bad[0])} rank(s) failed (the lowest rank says why)", rank=comm.rank,
                              op=f"lm {what}")


def resume_training(args, comm, cfg, model, opt, stream):
    """Load ``--resume``'s newest checkpoint on every rank (all or none: a
    rank that cannot read it makes every rank raise).

    Returns:
        (completed steps, train losses, {0-based step: val loss}, ranks): ``ranks``
        is the rank count of the run that wrote the checkpoint (None when the
        checkpoint does not say).
    """
    problem = st = None
    start = 0
    try:
        start, st = load_checkpoint(args.resume, cfg, map_location=next(model.parameters()).device,
                                    ignore=EXTENDABLE)
    except CheckpointError as exc:
        problem = exc
    agree_or_raise(comm, problem, "resume")
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    stream.load_state_dict(st["data"])
    set_rng_state(st["rng"])
    ranks = st.get("ranks")
    return (start, list(st["train_loss"]), {int(k): v for k, v in st["val_loss"].items()},
            int(ranks) if isinstance(ranks, int) else None)
