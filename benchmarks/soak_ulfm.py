"""ULFM soak: does one rank's death cost a second, healthy one?  A/B of Open MPI's TCP BTL flags.

Each run is one ``mpiexec --with-ft ulfm --mca btl tcp,self`` job of
``tests/ft_worker.py`` in timed mode (launched by ``tests/test_ft_kill.py``'s
``run_one``): NP ranks, three successive float32 allreduces of MIB MiB in
``commlib.init(fault_tolerant=True)`` mode; one or two victims (drawn at
random, any rank) each ``os._exit`` a random time into a call (the first call
included).  Per run it counts

- **victims**: planned victims that died (a victim whose timer falls after
  its call ended lives on, and is checked like any survivor);
- **extra**: ranks that died but were not victims: a watchdog fail-stop
  (exit 70 after Open MPI wedged the rank: docs/faults-and-security.md) or any other death;
  **mpi_crashes** counts the processes Open MPI crashed while recovery built a
  communicator (``test_ft_kill.mpi_crash_pids``);
- **hang**: ``mpiexec`` did not return within its limit (``STARTUP_S + T + 5``);
- **wrong**: survivors' results differ (SHA-256) or differ from the ring oracle
  over the inputs of the ranks each call ended with (computed here, after the
  job); "raised" (every survivor raised ``ProcessFailed``/``CommTimeout``) and
  "bad" (anything else, a job left without survivors included) are counted apart;
- **recovery**: per call with a kill, the slowest survivor's call time less
  the first kill's delay in that call (about kill to recovered result; the
  ranks enter a call within a few ms of each other), the run's worst.

The arms run the SAME kill plans and inputs, alternating run by run (plan
``i``: arm order flipped on odd ``i``, so neither arm always runs first), one
job at a time.  Arms: ``put`` (Open MPI's default TCP flags,
``send,put,inplace,need-ack,need-csum,hetero-rdma``) and ``noput``
(``--mca btl_tcp_flags send,inplace,need-ack,need-csum``: no RDMA put, large
messages as pipelined sends, no ob1 FIN).  Reproduce (docs/faults-and-security.md)::

    python -P benchmarks/soak_ulfm.py --runs 30 --seed 2222 --json soak_ab.json
    python -P benchmarks/soak_ulfm.py --runs 70 --seed 3333 --arms noput --json soak_noput.json

``--budget-s`` stops starting new plans after that many seconds (the table
covers the plans done); ``JSON.partial`` grows as it goes.

``--cost``: what the setting costs with no failure.  ``bench_allreduce.py``
(MPI's Allreduce and commlib's ring, plain mode) over ``--mca btl tcp,self``,
4-64 MiB, in alternating jobs with and without the flags (the order flipped
every repetition), at each rank count; prints per size the median over
repetitions of the paired busbw ratio noput / put::

    python -P benchmarks/soak_ulfm.py --cost --ranks 2 --reps 4 --json cost2.json
    python -P benchmarks/soak_ulfm.py --cost --ranks 4 --reps 4 --json cost4.json

(on a shared machine, only a quiet run says anything: the load average is
printed per job)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from _util import OneLineParser, float_in, int_in, ints_in, subset_of, writable_file  # noqa: E402

import test_ft_kill as K  # noqa: E402 - tests/test_ft_kill.py: run_one, classify
from launch import FT_PUT_ARGS, LAUNCH_ATTEMPTS, TCP_FLAGS_WITHOUT_PUT, ft_args, launcher_failed  # noqa: E402

ARMS = {"put": FT_PUT_ARGS, "noput": ft_args(tcp_flags=TCP_FLAGS_WITHOUT_PUT)}


plan = K.exit_plan        # the kill plans, shared with the CI-size soak in tests/test_ft_kill.py
assess = K.extra_deaths  # victims died, extra deaths (fail-stops apart), recovery time


def table(outcomes, arms):
    rows = []
    for arm in arms:
        os_ = [o for o in outcomes if o["arm"] == arm]
        rec = sorted(o["recovery_s"] for o in os_ if o["recovery_s"] is not None)

        def q(f):
            return round(rec[min(len(rec) - 1, int(f * len(rec)))], 2) if rec else None

        cnt = lambda k: sum(o["outcome"] == k for o in os_)  # noqa: E731
        rows.append({
            "arm": arm, "runs": len(os_),
            "two_victims": sum(o["victims_planned"] == 2 for o in os_),
            "kill_in_first_call": sum(any(v[1] == 0 for v in o["spec"]) for o in os_),
            "victims_died": f"{sum(o['victims_died'] for o in os_)}/{sum(o['victims_planned'] for o in os_)}",
            "runs_with_extra_death": sum(bool(o["extra_ranks"]) for o in os_),
            "extra_deaths": sum(len(o["extra_ranks"]) for o in os_),
            "extra_failstops": sum(len(o["extra_failstop_ranks"]) for o in os_),
            "mpi_crashes": sum(o["mpi_crashes"] for o in os_),
            "hangs": cnt("hang"), "wrong": cnt("wrong"), "raised": cnt("raised"),
            "bad": cnt("bad") + cnt("failstopped") + cnt("mpi_crashed"), "recovered": cnt("recovered"),
            "recovery_median_s": q(0.5), "recovery_p90_s": q(0.9), "recovery_max_s": q(1.0),
            "wall_median_s": round(statistics.median(o["wall"] for o in os_), 1) if os_ else None,
        })
    return rows


def print_table(rows):
    cols = ["arm", "runs", "two_victims", "kill_in_first_call", "victims_died", "runs_with_extra_death",
            "extra_failstops", "mpi_crashes", "hangs", "wrong", "raised", "bad", "recovery_median_s", "recovery_p90_s",
            "recovery_max_s", "wall_median_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def cost(args):
    """Alternating bench_allreduce.py jobs with and without the put-less flags."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    flags = {"put": [], "noput": ["--mca", "btl_tcp_flags", ARMS["noput"][ARMS["noput"].index("btl_tcp_flags") + 1]]}
    variants = ("MPI.Allreduce", "ring")
    res = {}  # (np, arm) -> [rows of one job]
    t0 = time.monotonic()
    ranks, reps = args.ranks, args.reps
    reps = dict(zip(ranks, reps * len(ranks) if len(reps) == 1 else reps))
    for np_ in ranks:
        for rep in range(reps[np_]):
            for arm in (("put", "noput") if rep % 2 == 0 else ("noput", "put")):
                with tempfile.TemporaryDirectory() as d:
                    out = os.path.join(d, "b.json")
                    cmd = [K.MPIEXEC, "--oversubscribe", "--mca", "btl", "tcp,self", *flags[arm], "-n", str(np_),
                           sys.executable, str(HERE / "bench_allreduce.py"), "--min-bytes", str(4 << 20),
                           "--max-bytes", str(64 << 20), "--variants", "ring", "--trials", str(args.trials),
                           "--json", out]
                    for _ in range(LAUNCH_ATTEMPTS):  # prterun may fail to start a job (tests/launch.py)
                        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                        if p.returncode == 0 or not launcher_failed(p.stdout + p.stderr, os.path.exists(out)):
                            break
                    if p.returncode != 0:
                        raise SystemExit(f"{' '.join(cmd)}: status {p.returncode}\n{(p.stdout + p.stderr)[-3000:]}")
                    rec = json.load(open(out))
                res.setdefault((np_, arm), []).append(rec)
                print(f"{np_} ranks rep {rep} {arm:5s}: " + "  ".join(
                    f"{r['bytes'] >> 20} MiB MPI {r['MPI.Allreduce']['busbw_GBps']:.3f} "
                    f"ring {r['ring']['busbw_GBps']:.3f}"
                    for r in rec["rows"]) + f"  (load {rec['loadavg_start'][0]:.1f}-{rec['loadavg_end'][0]:.1f})",
                    flush=True)
    rows = []
    for np_ in ranks:
        for i, r in enumerate(res[(np_, "put")][0]["rows"]):
            row = {"ranks": np_, "MiB": r["bytes"] >> 20}
            for v in variants:
                bw = {a: [rec["rows"][i][v]["busbw_GBps"] for rec in res[(np_, a)]] for a in ("put", "noput")}
                row[v] = {"put_GBps": round(statistics.median(bw["put"]), 3),
                          "noput_GBps": round(statistics.median(bw["noput"]), 3),
                          "ratio": round(statistics.median(b / a for a, b in zip(bw["put"], bw["noput"])), 3),
                          "ratio_min": round(min(b / a for a, b in zip(bw["put"], bw["noput"])), 3),
                          "ratio_max": round(max(b / a for a, b in zip(bw["put"], bw["noput"])), 3)}
            rows.append(row)
    print(f"{time.monotonic() - t0:.0f} s; busbw (GB/s), median over {reps} repetitions; ratio = noput / put "
          "(median of paired repetitions, min-max)")
    print("| ranks | MiB | MPI put | MPI noput | MPI ratio | ring put | ring noput | ring ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, g = r["MPI.Allreduce"], r["ring"]
        print(f"| {r['ranks']} | {r['MiB']} | {m['put_GBps']} | {m['noput_GBps']} | {m['ratio']} "
              f"({m['ratio_min']}-{m['ratio_max']}) | {g['put_GBps']} | {g['noput_GBps']} | {g['ratio']} "
              f"({g['ratio_min']}-{g['ratio_max']}) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "jobs": {f"{k[0]}:{k[1]}": v for k, v in res.items()}},
                                              indent=1))


def main(argv=None):
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", type=int_in(1, 100000, "plans"), default=20, help="kill plans (each run once per arm)")
    ap.add_argument("--seed", type=int, default=2222, help="seed of the kill plans")
    ap.add_argument("--np", type=int_in(3, 64, "ranks"), default=5, help="ranks per job (up to two die)")
    ap.add_argument("--mib", type=float_in(0, 4096, "MiB"), default=64, help="allreduce size per call, MiB")
    ap.add_argument("--timeout", type=float_in(0, 3600, "seconds"), default=10, help="COMMLIB_TIMEOUT of the jobs (s)")
    ap.add_argument("--arms", type=subset_of(tuple(ARMS)), default="put,noput",
                    help="comma-separated arms, of: " + ", ".join(ARMS))
    ap.add_argument("--budget-s", type=float_in(0, 10 ** 7, "seconds", lo_ok=True), default=0,
                    help="start no new plan after this many seconds (0: no budget)")
    ap.add_argument("--json", type=writable_file, default=None, help="write the table's rows to this JSON file")
    ap.add_argument("--cost", action="store_true", help="measure the setting's cost instead (no kills)")
    ap.add_argument("--ranks", type=ints_in(2, 64, "ranks"), default="2,4", help="--cost: rank counts")
    ap.add_argument("--reps", type=ints_in(1, 1000, "jobs"), default="3",
                    help="--cost: jobs per setting and rank count (one, or one per rank count)")
    ap.add_argument("--trials", type=int_in(1, 10000, "trials"), default=3, help="--cost: bench_allreduce.py --trials")
    args = ap.parse_args(argv)
    if len(args.reps) not in (1, len(args.ranks)):
        ap.error(f"--reps gives {len(args.reps)} counts for {len(args.ranks)} rank counts: give one, or one each")
    if args.cost:
        return cost(args)
    arms = args.arms
    plans = plan(args.seed, args.runs, args.np)
    t0 = time.monotonic()
    outcomes = []
    for i, spec in enumerate(plans):
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: stopped after {i} plans", flush=True)
            break
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            la = os.getloadavg()[0]
            o = K.run_one([list(v) for v in spec], args.seed + i, nprocs=args.np, mib=args.mib,
                          timeout=args.timeout, ft_args=ARMS[arm])
            o.update(arm=arm, plan=i, load=round(la, 2))
            assess(o, args.np)
            outcomes.append(o)
            print(f"plan {i:3d} {arm:5s} {json.dumps(spec)}: {o['outcome']}, extra {o['extra_ranks']} "
                  f"(fail-stop {o['extra_failstop_ranks']}), victims {o['victims_died']}/{o['victims_planned']}, "
                  f"recovery {o['recovery_s']} s, wall {o['wall']} s, load {la:.1f}"
                  + (f"; {o['problems']}" if o["problems"] else ""), flush=True)
            if args.json:
                Path(args.json + ".partial").write_text(json.dumps({"table": table(outcomes, arms), "runs": outcomes}))
    rows = table(outcomes, arms)
    summary = {"seed": args.seed, "np": args.np, "mib": args.mib, "timeout": args.timeout,
               "grace": K.GRACE, "calls": K.CALLS, "total_s": round(time.monotonic() - t0, 1),
               "arms": {a: ARMS[a] for a in arms}, "table": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "table"}))
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "runs": outcomes}, indent=1))


if __name__ == "__main__":
    main()
