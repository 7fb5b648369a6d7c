"""Sequence-parallel language-model training: ``python -m commlib.apps.lm``.

Trains a small decoder-only transformer (byte-level, rotary or learned
positions, grouped-query attention, pre-norm RMSNorm blocks) on the Python
standard library's own source, with every training sequence's *context*
sharded over the ranks: each rank holds ``1/P`` of the tokens and attention
runs sequence-parallel (``commlib.nn``): ring attention in the zigzag layout by
default (Liu et al. 2023; zigzag of ring-flash-attention), its bidirectional
ring variant, DeepSpeed-Ulysses (Jacobs et al. 2023) or the hybrid of both.

One training step on ``P`` ranks:

1. every rank builds the identical global batch (``--batch`` sequences of
   ``--seq-len`` byte tokens, documents packed; the same seed everywhere) and
   keeps its shard of the tokens in the chosen layout.  The batch is packed as
   one sequence of ``batch * seq_len`` tokens whose document boundaries
   (``cu_seqlens``, the FlashAttention varlen convention; each row start is one
   too) keep attention inside each file;
2. forward on the shard: embeddings, norms and MLPs are per token; attention is
   the one collective step; positions are the tokens' global positions;
3. loss: the sum of this rank's token cross-entropies divided by the global
   token count ``batch * seq_len``, so the ranks' losses add up to the mean;
4. backward (the attention backward communicates too), during which torch's
   ``DistributedDataParallel``, over commlib's ``torch.distributed`` backend
   (``"commlib"``), sums the parameter gradients over every rank in buckets:
   the parameters are replicated and stay bit-identical;
5. clip the global gradient norm, AdamW (linear warmup, then cosine decay).

``--dp N`` adds data parallelism: the ranks form a ``(dp, cp)`` mesh
(``torch.distributed.device_mesh.init_device_mesh``, ``cp = P / N``); data-parallel
group ``d`` takes its share of the global batch's rows (the same global batch
at every ``N``), packs them as above and shards that sequence over the ``cp``
ranks of its group (the attention runs on the cp group's commlib
communicator).  Every rank's loss is still divided by the global token count,
so the gradient of the global mean loss is the sum of all ranks' gradients
over cp and dp alike, which DDP takes on the flattened dp x cp group (as
torchtitan reduces over ``dp_cp`` with context parallelism).

``--window W`` makes layers local (every layer, or layers ``0, K, 2K, ...``
with ``--window-every K``, as Gemma 2 alternates local and global layers): a
token attends to itself and the ``W - 1`` tokens before it in its document
(FlashAttention's ``window_size=(W - 1, 0)``; Longformer, Mistral), and those
layers exchange only the K/V rows inside the window between neighbouring
ranks (``commlib.nn.ring_attention(window=...)``), not the sequence;
``--verify``'s oracle applies the same window mask.

So 1, 2 and 4 ranks train the same model on the same tokens, and the losses
agree to rounding.  ``--verify`` retrains on rank 0 alone with plain torch
attention on the whole sequences (the single-process oracle) and reports the
largest relative loss difference (exit status 1 above ``--verify-tol``; in
bfloat16 the first step's loss is judged, the same parameters and batch on
both sides, and the rest reported: two bfloat16 trainings drift apart).

Reports per step: training loss, validation loss every ``--eval-every`` steps
(held-out files), tokens per second, peak memory per rank (max RSS on the CPU,
``torch.cuda.max_memory_allocated`` on the GPU); ``--json`` writes them with
the configuration, ``--plot`` draws the loss curves.

Examples::

    mpiexec -n 2 python -P -m commlib.apps.lm
    mpiexec -n 4 python -P -m commlib.apps.lm --attention ulysses --heads 8 --kv-heads 4 --verify
    mpiexec -n 4 python -P -m commlib.apps.lm --dp 2 --verify
    mpiexec -n 4 python -P -m commlib.apps.lm --attention hybrid --ulysses-degree 2 --json lm.json --plot lm.png
    mpiexec -n 4 python -P -m commlib.apps.lm --layout contiguous --seq-len 1024 --window 128 --window-every 2 --verify
    mpiexec -n 8 python -P -m commlib.apps.lm --device cuda --dtype bfloat16 --seq-len 16384 --d-model 512 \\
        --heads 8 --layers 8 --steps 500
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import commlib  # light: the errors only until init is used
# the attention package imports numpy only: the layouts at no cost
from commlib.collectives.attention import LAYOUTS, layout_of

from .._cli import EXIT_REQUEUE, ULFM_LAUNCH, OneLineParser, StopSignals, init_comm, unwritable, world_rank, world_size

__all__ = ["ATTENTIONS", "LAYOUTS", "PHASES", "lr_at", "pad_unit", "plan_attention", "build_parser", "parse_args",
           "check_sizes", "run", "main"]

ATTENTIONS = ("ring", "bidirectional", "ulysses", "hybrid")
#: where in a step ``--kill`` strikes
PHASES = ("forward", "backward", "allreduce", "optimizer", "eval")
DTYPES = ("float32", "bfloat16")
#: --verify's default tolerance on the largest relative loss difference, per --dtype
VERIFY_TOL = {"float32": 1e-4, "bfloat16": 1e-2}
MAX_INT = 1 << 31


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = OneLineParser(
        "lm",
        prog="python -m commlib.apps.lm",
        description=doc[0] + "\n\n" + doc[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Data: the *.py files of this Python's standard library (third-party folders left out), bytes as\n"
               "tokens (256 = document start), about 10 % of the files held out for validation.\n\n"
               "Example: mpiexec -n 4 python -P -m commlib.apps.lm --verify --json lm.json --plot lm.png")
    a = p.add_argument
    a("--attention", choices=ATTENTIONS, default="ring",
      help="sequence-parallel attention: ring (K/V travel around the ring), bidirectional (K/V travel both "
           "ways, half the ring steps), ulysses (all-to-all over heads: --heads and --kv-heads divisible by "
           "the rank count), hybrid (Ulysses inside groups of --ulysses-degree ranks, ring across them) "
           "(default ring)")
    a("--layout", choices=LAYOUTS, default=None,
      help="which tokens each rank holds: contiguous blocks, striped (token t on rank t mod P) or zigzag "
           "(chunks r and 2P-1-r of 2P, balanced under the causal mask) (default zigzag; ulysses: contiguous)")
    a("--ulysses-degree", type=int, default=None, metavar="U",
      help="hybrid: ranks per Ulysses group (divides the rank count, --heads and --kv-heads) (default 2)")
    a("--dp", type=int, default=1, metavar="N",
      help="data parallelism: the ranks form a (dp, cp) mesh, cp = ranks / N; the global batch is split over the "
           "N data-parallel groups, each sequence sharded over the cp ranks of its group (the attention's ranks), "
           "and torch's DistributedDataParallel on the commlib backend sums the gradients over the mesh; N "
           "divides the rank count and is at most --batch (default 1: every rank shares each sequence)")
    a("--steps", type=int, default=40, help="training steps (default 40)")
    a("--seq-len", type=int, default=256,
      help="tokens per training sequence (the context each rank holds 1/P of); any length at any rank count: "
           "the sharded sequence is padded to the layout's unit (P, zigzag 2P) with a padding document that "
           "no token attends to and the loss leaves out (default 256)")
    a("--batch", type=int, default=4, help="sequences per step (default 4)")
    a("--d-model", type=int, default=64, help="model width, a multiple of --heads (default 64)")
    a("--heads", type=int, default=4, help="query heads (default 4)")
    a("--kv-heads", type=int, default=None,
      help="key/value heads (grouped-query attention), dividing --heads (default: --heads / 2 when even)")
    a("--layers", type=int, default=2, help="transformer blocks (default 2)")
    a("--pos", choices=("rope", "learned"), default="rope",
      help="position embedding: rotary (rope) or a learned table of --seq-len positions (default rope)")
    a("--no-doc-mask", action="store_true",
      help="let attention cross document (file) boundaries: causal over each whole sequence")
    a("--window", type=int, default=None, metavar="W",
      help="sliding-window (local) attention: a token attends to itself and the W - 1 tokens before it "
           "(window_size (W-1, 0), causal, within its document), in every layer or every --window-every-th; "
           "with --attention ring or bidirectional (and across hybrid's groups) the ranks exchange only the K/V "
           "rows inside the window (a halo), not the sequence; with ulysses it is a mask (default: global "
           "attention in every layer)")
    a("--window-every", type=int, default=None, metavar="K",
      help="with --window: layers 0, K, 2K, ... are local (windowed), the others global, as Gemma 2 alternates "
           "them (default 1: every layer local)")
    a("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    a("--warmup", type=int, default=10,
      help="steps of linear learning-rate warmup; then cosine decay to a tenth of --lr at the last step "
           "(default 10)")
    a("--clip", type=float, default=1.0,
      help="clip the global gradient norm (after the allreduce) to this; 0: no clipping (default 1.0)")
    a("--eval-every", type=int, default=10, help="steps between validation losses (and after the last step) "
                                                 "(default 10)")
    a("--eval-batches", type=int, default=2, help="held-out batches per validation loss (default 2)")
    a("--seed", type=int, default=0, help="seed of the parameters and of the order of the training files "
                                          "(default 0)")
    a("--device", choices=("cpu", "cuda"), default="cpu",
      help="cpu, or cuda: one GPU per rank, by node-local rank (default cpu)")
    a("--dtype", choices=DTYPES, default="float32",
      help="float32, or bfloat16 autocast (float32 parameters, gradients and optimizer) (default float32)")
    a("--threads", type=int, default=1,
      help="torch intra-op threads per rank; the ranks are the parallelism, and the default model's operations "
           "are too small to gain from more threads (on a busy machine they lose much: every parallel "
           "operation waits for a thread the scheduler has not run yet); raise it for a wide model with a few "
           "ranks per node, up to the cores per rank (default 1)")
    a("--verify", action="store_true",
      help="retrain on rank 0 alone with plain torch attention on the whole sequences and compare every "
           "loss; exit status 1 when the largest relative difference exceeds --verify-tol (the oracle holds "
           "the whole context and a dense --seq-len^2 mask on one process: for small runs)")
    a("--verify-tol", type=float, default=None,
      help="largest relative loss difference --verify accepts (default 1e-4 for float32, every loss judged; "
           "1e-2 for bfloat16, the first step's loss judged: later bfloat16 losses drift apart as rounding "
           "differences compound, and are reported)")
    a("--fault-tolerant", action="store_true",
      help="survive dead ranks (ULFM: mpiexec --with-ft ulfm ..., see the README): the survivors keep the "
           "parameters and optimizer state of the last completed step, re-plan the (dp, cp) mesh for their count "
           "(the asked --dp, or the largest divisor of the survivors below it; the report says so), rebuild the "
           "process group, the mesh and DDP, re-shard the batch and every sequence over themselves and redo the "
           "step (commlib.ResilientRunner); without ULFM every wait is bounded and a failure ends "
           "the run with the resume command of the last --checkpoint")
    a("--kill", action="append", default=[], metavar="RANK:STEP[:PHASE]",
      help="fault injection (repeatable): COMM_WORLD rank RANK dies at once (os._exit(137), no cleanup) in step STEP (1-based) at PHASE, "
           f"one of {', '.join(PHASES)} (default forward: inside the first layer's attention; backward: when "
           "autograd reaches it; eval: an evaluation step only)")
    a("--checkpoint", metavar="DIR",
      help="write checkpoints (model, optimizer, data position, RNG; atomic: temporary file, checksum, rename) "
           "into DIR, a writable folder, made if missing (the lowest rank writes); with it, SIGUSR1 or SIGTERM (a "
           "time limit or a preemption coming) stop every rank after the same step, that step is checkpointed and "
           f"the run exits {EXIT_REQUEUE} (a job script requeues on it; --resume DIR continues)")
    a("--checkpoint-every", type=int, default=None, metavar="N",
      help="steps between checkpoints (default 10 with --checkpoint); the last step is always written")
    a("--resume", metavar="DIR",
      help="continue from the newest checkpoint in DIR, on any rank count, with the losses an uninterrupted "
           "run has (the same model options as the run that wrote it; a larger --steps extends the run: the "
           "learning-rate schedule of the first run is kept and the added steps run at its last rate, --lr / 10 once "
           "the warmup is over)")
    a("--json", metavar="PATH", help="write the configuration and the per-step figures as JSON (rank 0)")
    a("--plot", metavar="PATH", help="PNG of the training and validation loss curves (rank 0)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--quiet", action="store_true", help="no progress bar and no text report")
    return p


def lr_at(args, step: int) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup over ``--warmup``
    steps, then cosine decay from ``--lr`` to ``--lr / 10`` at the last step of
    the schedule, ``args.schedule_steps`` (``--steps``; the first run's steps
    when a resume extended the run); the steps after it keep the schedule's
    last rate (``--lr / 10`` when the warmup ended before it)."""
    span = getattr(args, "schedule_steps", None) or args.steps
    step = min(step, span - 1)
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, span - 1 - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def pad_unit(layout: str, size: int) -> int:
    """Tokens of a sharded sequence must be a multiple of this (``P``; zigzag ``2P``)."""
    return layout_of(layout).unit(size)


def _degree_fits(d: int, size: int, heads: int, kv_heads: int) -> bool:
    return size % d == 0 and heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)


def plan_attention(attention: str, ulysses_degree, size: int, heads: int, kv_heads: int):
    """The attention a run of ``size`` ranks uses for the asked ``attention``.

    Ring and bidirectional run at any rank count.  Ulysses needs ``size`` to
    divide the heads (and the K/V heads, or be divided by them); hybrid needs
    that of its Ulysses degree and the degree to divide ``size``.  When the
    rank count changed (a failure, a resume) and that no longer holds, the
    Ulysses degree falls back to the largest one that fits (Ulysses inside
    groups, hybrid), or to the ring.

    Returns:
        (kind, ulysses_degree or None, note): ``note`` is None when nothing
        changed, else one line saying what was re-planned.
    """
    if attention not in ("ulysses", "hybrid"):
        return attention, None, None
    want = size if attention == "ulysses" else int(ulysses_degree)
    if _degree_fits(want, size, heads, kv_heads):
        return attention, (None if attention == "ulysses" else want), None
    d = max(x for x in range(1, min(want, size) + 1) if _degree_fits(x, size, heads, kv_heads))
    kind, degree = ("hybrid", d) if d > 1 else ("ring", None)
    was = "ulysses" if attention == "ulysses" else f"hybrid with Ulysses degree {want}"
    now = f"hybrid with Ulysses degree {d}" if d > 1 else "the ring"
    return kind, degree, (f"{was} does not fit {size} ranks ({heads} heads, {kv_heads} K/V heads): "
                          f"attention re-planned as {now}")


def parse_kills(parser, values, steps: int, eval_steps) -> list:
    """``--kill RANK:STEP[:PHASE]`` values as ``(rank, step, phase)`` (step 1-based)."""
    out = []
    for v in values:
        parts = v.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rank, step = int(parts[0]), int(parts[1])
        except ValueError:
            parser.error(f"--kill {v!r}: expected RANK:STEP[:PHASE], e.g. 1:5:backward")
        phase = parts[2] if len(parts) == 3 else "forward"
        if phase not in PHASES:
            parser.error(f"--kill {v!r}: phase {phase!r} is not one of {', '.join(PHASES)}")
        if rank < 0:
            parser.error(f"--kill {v!r}: rank must be >= 0")
        if not 1 <= step <= steps:
            parser.error(f"--kill {v!r}: step must be in [1, --steps {steps}]")
        if phase == "eval" and step not in eval_steps:
            parser.error(f"--kill {v!r}: step {step} has no evaluation (every --eval-every step and the last)")
        out.append((rank, step, phase))
    return out


def check_sizes(parser, a, size: int) -> None:
    """The checks that depend on the job's rank count ``size`` (``parser.error``:
    one line on stderr, exit status 2, on every rank alike)."""
    err = parser.error
    if size % a.dp:
        err(f"--dp {a.dp} does not divide the rank count {size}")
    for rank, step, phase in a.kill:
        if rank >= size:
            err(f"--kill {rank}:{step}:{phase}: rank {rank} is not a rank of this {size}-rank job")
    P = size // a.dp  # the ranks sharing each sequence (cp)
    if a.attention in ("ulysses", "hybrid"):
        u, what = (P, "the cp rank count") if a.attention == "ulysses" else (a.ulysses_degree, "--ulysses-degree")
        if P % u:
            err(f"hybrid: --ulysses-degree {u} does not divide the cp rank count {P}")
        if a.heads % u:
            err(f"{a.attention}: --heads {a.heads} is not divisible by {what} {u}")
        if a.kv_heads % u and u % a.kv_heads:
            err(f"{a.attention}: --kv-heads {a.kv_heads} neither divides nor is divisible by {what} {u}")


def parse_args(argv=None, size: int | None = None):
    """Parse and check the command line.

    ``size`` is the job's rank count (default: from the launcher's environment,
    1 without one); the rank-count checks run again once MPI is up when the
    launcher did not tell.

    Raises:
        SystemExit: 2 after one line on stderr (rank 0) for a value the run
            cannot use; 0 after ``--help``.
    """
    p = build_parser()
    a = p.parse_args(argv)
    err = p.error
    for name in ("dp", "steps", "seq_len", "batch", "d_model", "heads", "layers", "eval_every", "eval_batches"):
        v = getattr(a, name)
        if not 1 <= v <= MAX_INT:
            err(f"--{name.replace('_', '-')} must be in [1, {MAX_INT}], got {v}")
    if a.kv_heads is None:
        a.kv_heads = a.heads // 2 if a.heads % 2 == 0 else a.heads
    if not 1 <= a.kv_heads <= a.heads or a.heads % a.kv_heads:
        err(f"--kv-heads {a.kv_heads} must divide --heads {a.heads}")
    if a.d_model % a.heads:
        err(f"--d-model {a.d_model} is not a multiple of --heads {a.heads}")
    if a.pos == "rope" and (a.d_model // a.heads) % 2:
        err(f"rotary embeddings need an even head dimension; --d-model / --heads is {a.d_model // a.heads}")
    if a.seq_len < 2:
        err(f"--seq-len must be >= 2, got {a.seq_len}")
    if a.dp > a.batch:
        err(f"--dp {a.dp} exceeds --batch {a.batch}: every data-parallel group needs a sequence")
    if a.batch * a.seq_len > 1 << 40:
        err(f"--batch x --seq-len is {a.batch * a.seq_len} tokens, too many")
    if not (math.isfinite(a.lr) and a.lr > 0):
        err(f"--lr must be a finite number > 0, got {a.lr}")
    if not (math.isfinite(a.weight_decay) and a.weight_decay >= 0):
        err(f"--weight-decay must be a finite number >= 0, got {a.weight_decay}")
    if not 0 <= a.warmup <= MAX_INT:
        err(f"--warmup must be in [0, {MAX_INT}], got {a.warmup}")
    if not (math.isfinite(a.clip) and a.clip >= 0):
        err(f"--clip must be a finite number >= 0, got {a.clip}")
    if not 0 <= a.seed < 1 << 32:
        err(f"--seed must be in [0, 2**32), got {a.seed}")
    if not 1 <= a.threads <= 4096:
        err(f"--threads must be in [1, 4096], got {a.threads}")
    if a.verify_tol is None:
        a.verify_tol = VERIFY_TOL[a.dtype]
    elif not (math.isfinite(a.verify_tol) and a.verify_tol > 0):
        err(f"--verify-tol must be a finite number > 0, got {a.verify_tol}")
    a.layout = a.layout or ("contiguous" if a.attention == "ulysses" else "zigzag")
    if a.window_every is not None and a.window is None:
        err("--window-every needs --window W")
    if a.window is not None:
        if not 1 <= a.window <= MAX_INT:
            err(f"--window must be in [1, {MAX_INT}], got {a.window}")
        if a.window_every is None:
            a.window_every = 1
        if not 1 <= a.window_every <= MAX_INT:
            err(f"--window-every must be in [1, {MAX_INT}], got {a.window_every}")

    if a.ulysses_degree is not None and a.attention != "hybrid":
        err("--ulysses-degree applies to --attention hybrid only")
    if a.attention == "hybrid":
        if a.ulysses_degree is None:
            a.ulysses_degree = 2
        if not 1 <= a.ulysses_degree <= MAX_INT:
            err(f"--ulysses-degree must be >= 1, got {a.ulysses_degree}")
    for opt, path in (("--json", a.json), ("--plot", a.plot)):
        if path is not None:
            problem = unwritable(path)
            if problem:
                err(f"{opt} {path}: {problem}")
    if a.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            err("--plot needs matplotlib (pip install matplotlib)")
    if a.quiet:
        a.no_progress = True
    eval_steps = {s + 1 for s in range(a.steps) if (s + 1) % a.eval_every == 0 or s == a.steps - 1}
    a.kill = parse_kills(p, a.kill, a.steps, eval_steps)
    if a.checkpoint_every is not None and a.checkpoint is None:
        err("--checkpoint-every needs --checkpoint DIR")
    if a.checkpoint is not None:
        if a.checkpoint_every is None:
            a.checkpoint_every = 10
        if not 1 <= a.checkpoint_every <= MAX_INT:
            err(f"--checkpoint-every must be in [1, {MAX_INT}], got {a.checkpoint_every}")
    from .checkpoint import check_checkpoint_dir, latest_checkpoint, saved_config  # noqa: PLC0415  (no torch)

    if a.checkpoint:  # a missing folder is made, as torch's and Lightning's checkpoint tools do
        try:
            os.makedirs(a.checkpoint, exist_ok=True)
        except OSError as exc:
            err(f"--checkpoint {a.checkpoint}: cannot create the folder ({exc.strerror or exc})")
    for opt, d, write in (("--checkpoint", a.checkpoint, True), ("--resume", a.resume, False)):
        if d is not None:
            problem = check_checkpoint_dir(d, for_write=write)
            if problem:
                err(f"{opt} {d}: {problem}")
    if a.checkpoint is not None and (a.resume is None or os.path.realpath(a.resume) != os.path.realpath(
            a.checkpoint)):
        have = latest_checkpoint(a.checkpoint)
        if have is not None:  # nothing overwritten: a fresh run would replace that run's checkpoints
            err(f"--checkpoint {a.checkpoint}: holds a checkpoint of step {have[0]}; continue it with "
                f"--resume {a.checkpoint}, or name an empty folder")
    _check_extension(p, a, saved_config(a.resume) if a.resume is not None else None)
    check_sizes(p, a, size if size is not None else (world_size() or 1))
    a._parser = p
    return a


def _check_extension(parser, a, saved) -> None:
    """``--resume`` with ``--steps``: the run may be extended, not shortened.

    Sets ``a.schedule_steps`` (the steps the learning-rate schedule spans: the
    first run's, kept by every resume) and ``a.extension`` (None, or the one
    line saying how the schedule continues when ``--steps`` grew)."""
    a.schedule_steps, a.extension, a.steps_then = a.steps, None, None
    if not saved or type(saved.get("steps")) is not int:
        return
    was = a.steps_then = saved["steps"]
    span = saved.get("schedule_steps", was)
    if a.steps < was:
        parser.error(f"--steps {a.steps}: the checkpoint's run has {was} steps; --resume may extend a run "
                     "(a larger --steps), not shorten it")
    a.schedule_steps = span
    if a.steps > was:
        last = lr_at(a, span - 1)
        how = (f"warmup {a.warmup}, cosine decay to {last:g} (--lr / 10) at step {span}" if a.warmup < span else
               f"warmup of {a.warmup} steps, longer than the schedule: {last:g} at step {span}")
        a.extension = (f"run extended from {was} to {a.steps} steps: the learning-rate schedule of the first "
                       f"{span} steps is kept ({how}); steps {span + 1}-{a.steps} run at its last rate, {last:g}")


def run(args, comm=None, stop=None):
    """Train as ``args`` say on ``comm`` (default: ``commlib.init()``); returns
    the report dict on rank 0, None elsewhere.  See :func:`.train.run`."""
    from .train import run as _run  # noqa: PLC0415  (torch loads here)

    return _run(args, comm, stop)


def main(argv=None) -> int:
    """The command line; returns the exit status (2: a refused value, one line
    on stderr from rank 0; 1: ``--verify`` failed; 130: interrupted by Ctrl-C,
    one line on stderr; 75, ``EXIT_REQUEUE``: with ``--checkpoint``, SIGUSR1 or
    SIGTERM stopped the run after a step and its checkpoint, one line on stderr)."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a refusal (2)
        return exc.code if isinstance(exc.code, int) else 2
    # with a checkpoint folder, SIGUSR1/SIGTERM (a time limit or preemption coming) end the run
    # after the current step with its checkpoint: caught from here on, before torch loads
    stop = StopSignals().install() if args.checkpoint is not None else None
    if args.device == "cuda":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            if world_rank() == 0:
                print("lm: error: --device cuda: torch sees no GPU (torch.cuda.is_available() is False)",
                      file=sys.stderr)
            return 2
    # --fault-tolerant (and --checkpoint: a failure must end the run in bounded time, naming the
    # checkpoint) runs on a fault-tolerant communicator: ULFM survives failures, elsewhere every
    # wait is bounded by COMMLIB_TIMEOUT; on_failure="raise": a collective that lost a rank raises
    # on every survivor (its sum would miss a shard's gradient) and the step is redone
    from .resume import Stopped  # noqa: PLC0415  (no torch)

    ft = args.fault_tolerant or args.checkpoint is not None
    try:
        comm = init_comm("lm", **({"fault_tolerant": True, "on_failure": "raise"} if ft else {}))
    except SystemExit as exc:  # the launch refused: one line from rank 0
        return exc.code
    try:
        check_sizes(args._parser, args, comm.size)  # a launcher that did not name the size
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if comm.rank == 0:
        _start_lines(args, comm)
    try:
        rep = run(args, comm, stop)
    except commlib.InvalidArgument as exc:  # raised on every rank alike: a clean exit
        if comm.rank == 0:
            print(f"lm: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (commlib.ProcessFailed, commlib.CommTimeout) as exc:
        if not ft:
            raise
        # not recovered (no ULFM, or a state lost): every survivor says so in one line and exits
        # (MPI_Finalize bounded: it can wait for ever for the dead rank)
        comm.ft.bound_finalize()
        from .report import failure_line  # noqa: PLC0415

        print(failure_line(args, comm, exc), file=sys.stderr, flush=True)
        return 1
    except Stopped as exc:  # every rank alike, the checkpoint written
        if comm.rank == 0:
            print(f"lm: {exc}; exit {EXIT_REQUEUE} (continue with --resume {exc.checkpoint}, on any rank count)",
                  file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; 130 as a shell reports SIGINT
        print(f"lm: interrupted (rank {comm.rank})", file=sys.stderr, flush=True)
        if comm.size > 1:  # the other ranks may be waiting on this one
            comm.abort(130)
        return 130
    except BaseException as exc:  # one rank failing alone must not leave the others hanging
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        print(f"rank {comm.rank}: lm app: {exc!r}; aborting the job", file=sys.stderr, flush=True)
        comm.abort(3)
    if rep is None:
        return 0
    from .report import print_report, write_outputs  # noqa: PLC0415

    if not args.quiet:
        print_report(rep)
    write_outputs(rep, args)
    ver = rep.get("verify")
    return 1 if ver is not None and not ver["passed"] else 0


def _start_lines(args, comm) -> None:
    """Rank 0's lines at the start (stderr): --fault-tolerant without ULFM; what a stop signal does."""
    if args.fault_tolerant and comm.fault_tolerant != "ulfm":
        print(f"lm: warning: --fault-tolerant, but this launch has no ULFM ({comm.fault_tolerant} mode): a rank's "
              "death ends the run within COMMLIB_TIMEOUT on every survivor (they name the last --checkpoint); to "
              f"survive it, launch the Open MPI wheel's {ULFM_LAUNCH} -n N python -P -m commlib.apps.lm ...",
              file=sys.stderr, flush=True)
    if args.checkpoint is not None and not args.quiet:
        print(f"lm: on SIGUSR1 or SIGTERM the run checkpoints into {args.checkpoint} after its current step and "
              f"exits {EXIT_REQUEUE}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # pragma: no cover - python -m runs __main__.py
    sys.exit(main())
