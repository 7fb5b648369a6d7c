"""Soak of torch DDP on the ``"commlib"`` backend under ULFM: the fault-tolerance guide's resilient training loop
(``<!-- resilient-example -->``) run as written, one rank SIGKILLed per job at a random step and
phase (``start`` of the step, ``backward`` while DDP's bucket all-reduces run, before the loss
``allreduce``), victims drawn from every rank, rank 0 included.

Per job it checks that the survivors finished (3 of 4 ranks), that their parameters equal the
failure-free one-process run's within 1e-10 (float64), that no rank other than the victim died,
and it reads every survivor's ``Failure.recovery_s`` (failure seen to redone step started: revoke,
shrink, state restore, process-group and DDP rebuild).  Prints a table, the count finished/right,
the recovery median and maximum; ``--json`` keeps every job.

    python -P benchmarks/soak_torch_ddp.py --runs 30 --seed 7 --json soak_ddp.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from launch import FINALIZE_TIMEOUT, FT_ARGS  # noqa: E402 - tests/launch.py: the ULFM launch line

PHASES = ("start", "backward", "allreduce")
HOOKS = {
    "def step():\n": "def step():\n    _die('start')\n",
    "    loss.backward()": "    _h = net[0].weight.register_hook(lambda g: _die('backward'))\n    loss.backward()\n"
                          "    _h.remove()",
    "    dist.all_reduce(loss": "    _die('allreduce')\n    dist.all_reduce(loss",
}
DIE = '''import os as _os, signal as _signal, time as _time
_KILLS = {KILLS!r}
_TIMING = {TIMING!r}
def _die(phase):
    if (int(comm.world_ranks[comm.rank]), runner.completed + 1, phase) in _KILLS:
        if _TIMING:                                     # the kill's wall time, for the recovery benchmark
            with open(_TIMING + "/kill", "w") as _f:
                _f.write(repr(_time.time()))
        _os.kill(_os.getpid(), _signal.SIGKILL)
def _log_step():
    if _TIMING:                                         # steps done, group size, wall time at the step's end
        with open(_TIMING + f"/steps.{int(comm.world_ranks[comm.rank])}", "a") as _f:
            _f.write(f"{runner.completed} {comm.size} {_time.time()!r}\\n")
'''
TAIL = '''
torch.save(torch.nn.utils.parameters_to_vector(net.parameters()), {PATH!r} + f".{comm.rank}")
print(f"recovery_s {comm.rank} {[round(f.recovery_s, 4) for f in runner.failures]}", flush=True)
'''


def example() -> str:
    """The resilient training loop of ``docs/guides/fault-tolerance.md`` (``<!-- resilient-example -->``), as written."""
    text = (ROOT / "docs" / "guides" / "fault-tolerance.md").read_text()
    return text.split("<!-- resilient-example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def model_source() -> str:
    """The example's data, model and optimizer: its lines from ``torch.manual_seed`` to ``opt =``
    (they need ``torch`` imported), for other frameworks to train the same model on the same data."""
    lines = example().splitlines()
    first = next(i for i, s in enumerate(lines) if s.startswith("torch.manual_seed("))
    last = next(i for i, s in enumerate(lines) if s.startswith("opt = "))
    return "\n".join(lines[first:last + 1]) + "\n"


def steps() -> int:
    """How many steps the example's loop runs."""
    return int(re.search(r"^for i in range\((\d+)\):", example(), re.M).group(1))


def script(kills, params_path, timing=None) -> str:
    """The example with the kill hooks; ``timing`` (a folder) makes the victim write its kill time
    to ``timing/kill`` and every rank its steps to ``timing/steps.<world rank>``."""
    src = example()
    for where, what in HOOKS.items():
        src = src.replace(where, what, 1)
    die = DIE.replace("{KILLS!r}", repr(set(kills))).replace("{TIMING!r}", repr(timing and str(timing)))
    src = src.replace("reshard(comm)\nrunner", die + "reshard(comm)\nrunner", 1)
    src = src.replace("    loss = runner.run(step)", "    loss = runner.run(step)\n    _log_step()", 1)
    return src + TAIL.replace("{PATH!r}", repr(str(params_path)))


def run(tmp, kills, n, timeout, timing=None):
    import torch  # noqa: PLC0415

    params = Path(tmp) / "params.pt"
    for f in Path(tmp).glob("params.pt.*"):
        f.unlink()
    path = Path(tmp) / "train.py"
    path.write_text(script(kills, params, timing))
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = ([mpiexec, "--oversubscribe", *FT_ARGS, "-n", str(n), sys.executable, str(path)] if n
           else [sys.executable, str(path)])
    env = {k: v for k, v in os.environ.items() if n or not k.startswith(("OMPI_COMM", "PMIX_", "PRTE_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env).stdout
    except subprocess.TimeoutExpired:
        return {"hang": True}
    res = {"hang": False, "wall_s": time.monotonic() - t0}
    res["params"] = {int(p.suffix[1:]): torch.load(p) for p in Path(tmp).glob("params.pt.*")}
    res["recovery_s"] = [x for m in re.finditer(r"recovery_s \d+ \[([^\]]*)\]", out)
                         for x in map(float, filter(None, m.group(1).split(",")))]
    m = re.search(r"on (\d+) ranks; failures: (.*)", out)
    res["size"], res["failures"] = (int(m.group(1)), m.group(2)) if m else (None, None)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="kill plans (jobs), default 30")
    p.add_argument("--ranks", type=int, default=4, help="ranks per job, default 4")
    p.add_argument("--seed", type=int, default=None, help="seed of the plans (default: drawn, printed)")
    p.add_argument("--timeout", type=float, default=180, help="seconds a job may take, default 180")
    p.add_argument("--json", help="write every job's outcome here")
    a = p.parse_args(argv)
    if a.runs < 1 or a.ranks < 2 or a.timeout <= 0:
        p.error("--runs >= 1, --ranks >= 2 and --timeout > 0, please")
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}: {a.runs} jobs of {a.ranks} ranks, one SIGKILL each")
    with tempfile.TemporaryDirectory() as tmp:
        ref = run(tmp, [], 0, a.timeout)["params"][0]
        rows, rec = [], []
        for i in range(a.runs):
            plan = (rng.randrange(a.ranks), rng.randrange(1, 11), PHASES[i % 3])
            r = run(tmp, [plan], a.ranks, a.timeout)
            ok = not r["hang"] and r["size"] == a.ranks - 1 and len(r["params"]) == a.ranks - 1
            err = max(((v - ref).abs().max().item() for v in r.get("params", {}).values()), default=float("inf"))
            right = ok and err <= 1e-10 * ref.abs().max().item()
            rec += r.get("recovery_s", [])
            rows.append({"plan": plan, "finished": ok, "right": right, "max_param_error": err,
                         "recovery_s": r.get("recovery_s"), "wall_s": r.get("wall_s"), "hang": r["hang"]})
            print(f"{i + 1:3d} victim {plan[0]} step {plan[1]:2d} {plan[2]:9s} finished {ok!s:5s} "
                  f"right {right!s:5s} err {err:.2g} recovery_s {r.get('recovery_s')}", flush=True)
    fin, right = sum(r["finished"] for r in rows), sum(r["right"] for r in rows)
    med = statistics.median(rec) if rec else float("nan")
    print(f"finished {fin}/{a.runs}, parameters within 1e-10 of one process {right}/{a.runs}; "
          f"recovery (per survivor) median {med:.3f} s, max {max(rec, default=float('nan')):.3f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"seed": seed, "ranks": a.ranks, "jobs": rows,
                                            "recovery_median_s": med}, indent=1, default=str))
    return 0 if right == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
