"""The LM app's report: the summary printed at the end of a run, the loss plot
(matplotlib), the ``--json`` file, and the lines that describe failures."""
from __future__ import annotations

import json
import sys

from .checkpoint import latest_checkpoint

__all__ = ["print_report", "window_line", "plot_losses", "write_outputs", "failure_rows", "failure_line"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def print_report(rep) -> None:
    c = rep["config"]
    layout = c["layout"] + (f", ulysses degree {c['ulysses_degree']}" if c["attention"] == "hybrid" else "")
    ranks = f"{rep['ranks']} rank(s)" + (f" -> {rep['ranks_final']}" if rep.get("ranks_final", rep["ranks"])
                                          != rep["ranks"] else "")
    print(f"lm {c['attention']} ({layout}) on {ranks}, {rep['device']}, {c['dtype']}, "
          f"{rep['threads_per_rank']} thread(s) per rank")
    print(f"  model: {rep['parameters']:,} parameters, d_model {c['d_model']}, {c['layers']} layers, heads "
          f"{c['heads']}/{c['kv_heads']}, {c['pos']} positions")
    if c.get("window") is not None:
        print(window_line(c))
    sq = rep["sequence"]
    print(f"  tokens per step {sq['tokens_per_step']} ({c['batch']} x {c['seq_len']}"
          f"{', packed with document masking' if sq['packed'] else ', no document masking'}), "
          f"{sq['tokens_per_rank']} per rank; data: {rep['data']['train_files']} training / "
          f"{rep['data']['val_files']} held-out files of the standard library")
    print(f"  {c['steps']} steps: train loss {rep['steps'][0]['train_loss']:.4f} -> {rep['final_train_loss']:.4f}, "
          f"val loss {rep['final_val_loss']:.4f}")
    r = rep.get("resumed")
    if r:
        then = f"written on {r['ranks_then']} rank(s)" if r.get("ranks_then") else "its rank count not recorded"
        left = (f"; steps {r['from_step'] + 1}-{c['steps']} trained in this run" if r["from_step"] < c["steps"]
                else "")
        print(f"  resumed from the checkpoint of step {r['from_step']} in {r['checkpoint']} ({then}), now on "
              f"{r['ranks_now']} rank(s){left}")
    if rep["tokens_per_s"] is None:
        print(f"  resumed from step {rep.get('resumed_from_step')}, the run's last: no step left to run")
    else:
        print(f"  {rep['tokens_per_s']:.0f} tokens/s (median step {rep['step_time_s'] * 1e3:.1f} ms, slowest rank)")
    m, mf = rep.get("mesh"), rep.get("mesh_final")
    if m is not None:
        final = f" -> {mf['dp']} x {mf['cp']}" if mf != m else ""
        print(f"  mesh dp x cp {m['dp']} x {m['cp']}{final}: the batch split over dp, each sequence over cp; DDP "
              f"(commlib backend) sums the gradients over all {rep.get('ranks_final', rep['ranks'])} rank(s)")
    if not rep["parameters_identical_across_ranks"]:
        print("  WARNING: the ranks' parameters differ")
    for f in rep.get("failures", []):
        print(f"  failure: COMM_WORLD rank {f['world_rank']} lost in step {f['step']} ({f['phase']}); recovered in "
              f"{f['recovery_s']:.2f} s, the step redone on {f['ranks_after']} rank{'s' * (f['ranks_after'] != 1)}")
    for note in rep.get("notes", []):
        print(f"  note: {note}")
    print(f"  peak memory per rank ({rep['memory_kind']}): "
          f"{', '.join(_fmt_bytes(b) for b in rep['peak_memory_bytes_per_rank'])}")
    v = rep.get("verify")
    if v is not None:
        verdict = f"tolerance {v['tolerance']:.0e}: {'PASSED' if v['passed'] else 'FAILED'}"
        if v.get("judged") == "first step":
            print(f"  single-process check: first step's relative loss difference {v['first_step_rel_diff']:.2e}, "
                  f"{verdict}; largest over the run {v['max_rel_diff']:.2e} (train {v['max_rel_diff_train']:.2e}, "
                  f"val {v['max_rel_diff_val']:.2e}: bfloat16 trainings drift apart, not judged)")
        else:
            print(f"  single-process check: largest relative loss difference {v['max_rel_diff']:.2e} "
                  f"(train {v['max_rel_diff_train']:.2e}, val {v['max_rel_diff_val']:.2e}), {verdict}")


def window_line(c) -> str:
    """The report's line on ``--window`` (``c``: the report's ``config``): the
    window, which layers are local and, when the window is as long as the
    sequence or longer, that it masks nothing (those layers attend globally)."""
    w, every, layers, n = c["window"], c.get("window_every") or 1, c["layers"], c["seq_len"]
    local = list(range(0, layers, every))
    which = ("every layer" if len(local) == layers else
             f"layer{'s' * (len(local) > 1)} {', '.join(map(str, local[:4]))}{', ...' * (len(local) > 4)}")
    rest = layers - len(local)
    others = "" if not rest else f"; global attention in the other layer{'s' * (rest > 1)}"
    if w >= n:  # every key of a causal row is inside the window
        return (f"  sliding-window attention: the window ({w} tokens) covers the whole {n}-token sequence, so it "
                f"masks nothing: every layer attends globally (causal)")
    return f"  sliding-window attention: {w} tokens (window_size ({w - 1}, 0), causal) in {which}{others}"


def plot_losses(rep, path: str) -> None:
    """PNG: training and validation loss against step (and the oracle's, after
    ``--verify``), tokens/s below."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = rep["steps"]
    steps = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(6.4, 6), sharex=True, gridspec_kw=dict(height_ratios=(3, 1)))
    ax.plot(steps, [r["train_loss"] for r in rows], label=f"train ({rep['ranks']} ranks)")
    vs = [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None]
    ax.plot(*zip(*vs), "o-", label="validation")
    v = rep.get("verify")
    if v is not None:
        ax.plot(steps, v["oracle_train_loss"], "k--", lw=1, label="train, single process")
        ax.plot([int(s) for s in v["oracle_val_loss"]], list(v["oracle_val_loss"].values()), "kx", ms=7,
                label="validation, single process")
    c = rep["config"]
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(f"{c['attention']} attention, {c['layout']} layout, {rep['ranks']} ranks, "
                 f"{c['batch']}x{c['seq_len']} tokens/step")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(steps, [r["tokens_per_s"] for r in rows])
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(rep, args) -> None:
    """``--json`` and ``--plot`` (rank 0)."""
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1)
    if args.plot:
        plot_losses(rep, args.plot)


def failure_rows(args, failures) -> list:
    """``--json``'s ``failures``: one row per lost COMM_WORLD rank, with the
    phase ``--kill`` gave it (else ``"unknown"``)."""
    planned = {(r, step): phase for r, step, phase in args.kill}
    rows = []
    for f in failures:
        for w in f.failed or (None,):
            rows.append(dict(world_rank=w, step=f.step, phase=planned.get((w, f.step), "unknown"),
                             recovery_s=f.recovery_s, lost_s=f.lost_s, ranks_after=f.ranks_after, detected_unix=f.detected_unix,
                             redone_unix=f.detected_unix + f.recovery_s, error=f.error))
    return rows


def failure_line(args, comm, exc) -> str:
    """The one line a survivor prints when a failure ends the run (no ULFM):
    what failed, the last checkpoint and the command that resumes from it."""
    what = " ".join(str(exc).split())
    head = f"lm: rank {comm.rank}: a rank failed and this MPI cannot survive it ({what})"
    if args.checkpoint is None:
        return head + "; no --checkpoint: the run is lost"
    have = latest_checkpoint(args.checkpoint)
    if have is None:
        return head + f"; no checkpoint written yet in {args.checkpoint}: start again"
    argv, skip = [], False
    for a in sys.argv[1:]:  # the same options, less the fault injection and any earlier --resume
        if skip:
            skip = False
            continue
        if a in ("--kill", "--resume"):
            skip = True
            continue
        if a.startswith(("--kill=", "--resume=")):
            continue
        argv.append(a)
    cmd = " ".join(["mpiexec", "-n", "N", sys.executable, "-P", "-m", "commlib.apps.lm", *argv,
                     "--resume", args.checkpoint])
    return head + f"; last checkpoint: step {have[0]} in {args.checkpoint}; resume on any rank count N with: {cmd}"
