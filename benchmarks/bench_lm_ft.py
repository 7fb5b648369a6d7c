"""Fault-tolerant context-parallel training: what it costs, how fast it recovers, how often it works.

Three modes, each a series of ``mpiexec`` jobs of ``python -m commlib.apps.lm``
under the ULFM launch line of docs/guides/fault-tolerance.md (``--with-ft ulfm``, TCP BTL without RDMA
put), one job at a time:

``overhead``
    tokens/s with ``--fault-tolerant`` and no failure against the same run
    without it (the baseline, same launcher, same model), in alternating jobs
    (the order flipped every repetition); prints per job pair the ratio
    ft / plain of the app's median tokens/s (the slowest rank's step time),
    and the median ratio.

``soak``
    ``--plans`` randomized kill plans (victim: any COMM_WORLD rank, rank 0
    included; step; phase: forward, backward, allreduce, optimizer or eval),
    one kill per run at ``--np`` ranks.  Per run: did it finish all steps
    (``recovered``), did a rank other than the victim die (``extra`` fail-stops:
    ``ranks_final`` below ``np - 1``), are all training and validation losses
    within ``--rel`` of the single-process oracle (plain torch SDPA on whole
    sequences, computed here once), the recovery time from the survivor's
    detection to the redone step's start (``recovery_s``, the app's report),
    from the victim's death to the redone step's start (``kill_to_redo_s``: the
    victim prints ``time.time()`` just before its SIGKILL; one host, one clock)
    and the work lost (``lost_s``: the failed attempt's seconds before the
    failure was seen).  A table, the medians and ``--json``.

``recovery``
    the soak's measurement over a few fixed plans (one per phase), no oracle.

Reproduce (docs/faults-and-security.md, docs/performance.md)::

    python -P benchmarks/bench_lm_ft.py overhead --reps 5 --json lm_ft_overhead.json
    python -P benchmarks/bench_lm_ft.py soak --plans 30 --seed 38 --json lm_ft_soak.json
    python -P benchmarks/bench_lm_ft.py recovery --json lm_ft_recovery.json

On a GPU (ranks sharing it): add ``--device cuda`` (through ``benchmarks/gpu_lease.sh``
where a device is lent).  A busy machine inflates every time: the load average is
printed with each job.
"""
from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from _util import OneLineParser, find_mpiexec, float_in, int_in, write_json, writable_file  # noqa: E402

from launch import FINALIZE_TIMEOUT, FT_ARGS, run_job  # noqa: E402

PHASES = ("forward", "backward", "allreduce", "optimizer", "eval")


def run_lm(np_, args, ft_launch=True, timeout=600):
    """One job: (report dict or None, stderr+stdout text, wall seconds)."""
    out = tempfile.mktemp(suffix=".json")
    cmd = [find_mpiexec(), "--oversubscribe", *(FT_ARGS if ft_launch else []), "-n", str(np_), sys.executable, "-P",
           "-m", "commlib.apps.lm", "--json", out, "--no-progress", "--quiet", *args]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    t0 = time.perf_counter()
    rc, text = run_job(cmd, env, timeout, started=lambda _: os.path.exists(out))
    if rc is None:
        text += f"\n[hang: killed after {timeout} s]"
    wall = time.perf_counter() - t0
    rep = None
    if os.path.exists(out):
        rep = json.loads(Path(out).read_text())
        os.unlink(out)
    return rep, text, wall


def _load():
    return os.getloadavg()[0]


# ------------------------------------------------------------------ overhead
def overhead(a, model):
    rows = []
    for rep_i in range(a.reps):
        order = ("plain", "ft") if rep_i % 2 == 0 else ("ft", "plain")
        got = {}
        for arm in order:
            rep, text, _ = run_lm(a.np, model + (["--fault-tolerant"] if arm == "ft" else []))
            if rep is None:
                raise SystemExit(f"bench_lm_ft: the {arm} job failed:\n{text[-2000:]}")
            got[arm] = rep["tokens_per_s"]
        ratio = got["ft"] / got["plain"]
        rows.append(dict(rep=rep_i, plain_tokens_per_s=got["plain"], ft_tokens_per_s=got["ft"], ratio=ratio,
                         load=_load()))
        print(f"  pair {rep_i + 1}: plain {got['plain']:9.0f} tok/s   fault-tolerant {got['ft']:9.0f} tok/s   "
              f"ratio {ratio:.3f}   (load {_load():.1f})", flush=True)
    med = statistics.median(r["ratio"] for r in rows)
    print(f"fault-tolerant / plain tokens/s, median of {len(rows)} pairs: {med:.3f}")
    return dict(mode="overhead", rows=rows, median_ratio=med)


# ------------------------------------------------------------------ soak / recovery
def plans(a, eval_steps):
    rng = random.Random(a.seed)
    out = []
    for _ in range(a.plans):
        phase = rng.choice(PHASES)
        step = rng.choice(sorted(eval_steps)) if phase == "eval" else rng.randrange(1, a.steps + 1)
        out.append((rng.randrange(a.np), step, phase))
    return out


def _oracle(model, size: int):
    """The single-process losses of the model the jobs train (``size``: the jobs' rank
    count, which options such as ``--dp`` are checked against; the oracle runs alone)."""
    from commlib.apps import lm as app  # noqa: PLC0415
    from commlib.apps.lm.train import oracle_losses  # noqa: PLC0415

    args = app.parse_args(list(model), size=size)
    train, val = oracle_losses(args)
    return train, {s + 1: v for s, v in val.items()}


def _max_rel(rep, oracle):
    o_train, o_val = oracle
    d = [abs(s["train_loss"] - o) / abs(o) for s, o in zip(rep["steps"], o_train)]
    d += [abs(s["val_loss"] - o_val[s["step"]]) / abs(o_val[s["step"]]) for s in rep["steps"]
          if s["val_loss"] is not None]
    return max(d)


def soak(a, model, fixed=None):
    eval_steps = {s for s in range(1, a.steps + 1) if s % a.eval_every == 0 or s == a.steps}
    todo = fixed or plans(a, eval_steps)
    oracle = _oracle(model, a.np) if fixed is None else None
    rows = []
    try:
        from tqdm import tqdm  # noqa: PLC0415

        it = tqdm(todo, desc="kill plans", unit="run", file=sys.stderr)
    except ImportError:  # pragma: no cover
        it = todo
    for victim, step, phase in it:
        rep, text, wall = run_lm(a.np, model + ["--fault-tolerant", "--kill", f"{victim}:{step}:{phase}"])
        row = dict(victim=victim, step=step, phase=phase, wall_s=wall, load=_load(), recovered=rep is not None)
        m = re.search(r"dies in step \d+ \(\w+\) at t=([0-9.]+)", text)
        if rep is not None:
            f = rep["failures"]
            row.update(ranks_final=rep["ranks_final"], extra=a.np - 1 - rep["ranks_final"],
                       failures=len(f), identical=rep["parameters_identical_across_ranks"])
            if f:
                row.update(recovery_s=f[0]["recovery_s"], lost_s=f[0]["lost_s"])
                if m:
                    row["kill_to_redo_s"] = f[0]["redone_unix"] - float(m.group(1))
            if oracle is not None:
                row["max_rel_diff"] = _max_rel(rep, oracle)
                row["losses_ok"] = row["max_rel_diff"] <= a.rel
        else:
            row["tail"] = text[-1500:]
        rows.append(row)
    return summarize(rows, a)


def summarize(rows, a):
    print(f"{'victim':>6} {'step':>4} {'phase':>9} {'ok':>3} {'ranks':>5} {'extra':>5} {'detect->redo s':>14} "
          f"{'kill->redo s':>12} {'lost s':>7} {'max rel diff':>12} {'load':>5}")
    for r in rows:
        def f(k, fmt):
            v = r.get(k)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        print(f"{r['victim']:>6} {r['step']:>4} {r['phase']:>9} {'yes' if r['recovered'] else 'NO':>3} "
              f"{f('ranks_final', 'd'):>5} {f('extra', 'd'):>5} {f('recovery_s', '.3f'):>14} "
              f"{f('kill_to_redo_s', '.3f'):>12} {f('lost_s', '.3f'):>7} {f('max_rel_diff', '.1e'):>12} "
              f"{r['load']:5.1f}")

    def med(k):
        xs = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        return (statistics.median(xs), max(xs)) if xs else (float("nan"), float("nan"))

    ok = [r for r in rows if r["recovered"] and r.get("extra") == 0 and r.get("failures") == 1
          and r.get("losses_ok", True) and r.get("identical")]
    summary = dict(runs=len(rows), recovered=sum(r["recovered"] for r in rows), good=len(ok),
                   extra_fail_stops=sum(r.get("extra", 0) for r in rows),
                   losses_ok=sum(bool(r.get("losses_ok")) for r in rows),
                   recovery_s_median_max=med("recovery_s"), kill_to_redo_s_median_max=med("kill_to_redo_s"),
                   lost_s_median_max=med("lost_s"))
    print(f"runs {summary['runs']}: finished {summary['recovered']}, all good {summary['good']} "
          f"(one failure, no extra death, identical parameters{', losses within %g of the oracle' % a.rel}); "
          f"extra fail-stops {summary['extra_fail_stops']}")
    for k, name in (("recovery_s_median_max", "detection -> redone step"),
                    ("kill_to_redo_s_median_max", "kill -> redone step"), ("lost_s_median_max", "work lost")):
        m, x = summary[k]
        print(f"  {name}: median {m:.3f} s, max {x:.3f} s")
    return dict(mode="soak", rows=rows, summary=summary)


def main(argv=None):
    ap = OneLineParser("bench_lm_ft", description=__doc__.split("\n\n")[0],
                       formatter_class=__import__("argparse").ArgumentDefaultsHelpFormatter)
    ap.add_argument("mode", choices=("overhead", "soak", "recovery"), help="what to measure (see the module doc)")
    ap.add_argument("--np", type=int_in(2, 64, "ranks"), default=4, help="ranks per job")
    ap.add_argument("--steps", type=int_in(2, 10 ** 6, "steps"), default=10, help="training steps per job")
    ap.add_argument("--eval-every", type=int_in(1, 10 ** 6, "steps"), default=5, help="the app's --eval-every")
    ap.add_argument("--reps", type=int_in(1, 1000, "pairs"), default=4, help="overhead: job pairs")
    ap.add_argument("--plans", type=int_in(1, 100000, "plans"), default=30, help="soak: kill plans")
    ap.add_argument("--seed", type=int, default=38, help="soak: seed of the kill plans")
    ap.add_argument("--rel", type=float_in(0, 1, "relative difference"), default=1e-4,
                    help="soak: largest relative loss difference to the oracle")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the app's --device")
    ap.add_argument("--app-args", default="", help="more options for the app (one string), e.g. '--attention hybrid'")
    ap.add_argument("--json", type=writable_file, default=None, help="write the rows and the summary here")
    a = ap.parse_args(argv)
    model = ["--steps", str(a.steps), "--eval-every", str(a.eval_every), "--device", a.device, *a.app_args.split()]
    print(f"bench_lm_ft {a.mode}: {a.np} ranks, lm {' '.join(model)} (load {_load():.1f})", flush=True)
    if a.mode == "overhead":
        res = overhead(a, model)
    elif a.mode == "soak":
        res = soak(a, model)
    else:
        steps = [2, 4, 3, 6, a.eval_every]
        res = soak(a, model, fixed=[((i + 1) % a.np, min(s, a.steps), ph)
                                    for i, (s, ph) in enumerate(zip(steps, PHASES))])
    res["config"] = dict(vars(a), model=model)
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
