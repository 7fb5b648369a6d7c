"""Show that the tests bite: apply deliberate bugs one at a time and run the tests that guard them.

Each mutation is a patch in ``tests/mutations/NN-name.patch`` (a one- to few-line bug
in one source file).  For each: ``git apply`` the patch, run that mutation's test
selection (serial pytest, pytest under ``mpiexec``, or pytest with mpi4py blocked as
in ``tests/run.sh``'s no-MPI stage), restore the file with ``git checkout -- FILE``
(in a ``finally``, also on Ctrl-C or SIGTERM), and record CAUGHT (some selection
failed or timed out) or MISSED (all passed).  Before the mutations, each distinct
selection runs once on the clean tree: a selection that fails there proves nothing
(BASELINE FAIL).  Prints a table; exits 1 if any mutation is missed or a baseline
fails.  Not part of CI (minutes on 2 cores); run it through ``tests/mutations.sh``.

    bash tests/mutations.sh                   # all, with the baseline
    bash tests/mutations.sh --only 03 10      # some (ids or name parts)
    bash tests/mutations.sh --no-baseline
    bash tests/mutations.sh --markdown        # the table as Markdown (docs/testing.md)
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "tests" / "mutations"
#: a file naming the source file a mutation is applied to while it is: tests/mutations.sh's
#: trap restores it if this driver is killed outright
STATE = Path(os.environ.get("COMMLIB_MUTATION_STATE", f"/tmp/commlib-mutation-applied.{os.getpid()}"))


def serial(*args, timeout=300):
    return ("serial", 1, list(args), timeout)


def mpi(n, *args, timeout=300):
    return ("mpi", n, list(args), timeout)


def no_mpi(*args, timeout=300):
    return ("no-mpi", 1, list(args), timeout)


#: (patch stem, what the bug is, the test selections that should catch it)
MUTATIONS = [
    ("01-noop-barrier", "Communicator.barrier returns at once",
     [mpi(3, "tests/test_collectives.py", "-k", "barrier"),
      mpi(3, "tests/test_bad_input.py", "-k", "barrier")]),
    ("02-dropped-contribution", "ring reduce-scatter: rank 0's contribution to its last chunk not added",
     [mpi(3, "tests/test_collectives.py", "-k", "test_allreduce and float64")]),
    ("03-pack-off-by-one", "host pack kernel: last element of each row not copied",
     [serial("tests/test_datatypes.py")]),
    ("04-zigzag-swapped", "zigzag layout: chunks r and 2P-1-r swapped",
     [serial("tests/test_attention.py", "-m", "not mpi"),
      mpi(2, "tests/test_attention.py", "-k", "ring_matches_dense or shard_unshard")]),
    ("05-lse-merge-max-dropped", "torch out/lse merge: max term of logaddexp dropped",
     [mpi(2, "tests/test_nn_ring.py", "-k", "matches_oracle")]),
    ("06-halo-corner-skipped", "halo exchange: the (+1,+1,..) corner ghost not unpacked",
     [mpi(4, "tests/test_halo.py")]),
    ("07-wrong-reduction-order", "one-round allreduce: operands combined from rank c, not c+1",
     [mpi(3, "tests/test_collectives.py", "-k", "test_allreduce and float32"),
      mpi(3, "tests/test_collectives_ring_order.py"),
      no_mpi("tests/test_elastic.py", "-k", "one_shot_allreduce_holds_the_ring_order")]),
    ("08-buffer-not-restored", "recovery loop: input not restored when an error leaves the call",
     [no_mpi("tests/test_elastic_engine.py", "-k", "restores_the_input")]),
    ("09-lost-tcp-frame", "TCP transport: a message's second frame counted as sent, never written",
     [no_mpi("tests/test_tcp.py")]),
    ("10-causal-mask-missing", "numpy attention block: causal mask not applied",
     [serial("tests/test_attention.py", "-m", "not mpi")]),
    ("11-cu-seqlens-off-by-one", "document of a query: searchsorted side='left' (boundary off by one)",
     [serial("tests/test_nn_ring.py", "-m", "not mpi"),
      mpi(2, "tests/test_nn_ring.py", "-k", "matches_oracle")]),
    ("12-checkpoint-wrong-step", "load_checkpoint: the oldest kept checkpoint, not the newest",
     [serial("tests/test_lm_checkpoint.py")]),
    ("13-noop-dissemination-barrier", "the dissemination barrier (COMMLIB_CHECK_ARGS=0) returns at once",
     [mpi(3, "tests/test_collectives.py", "-k", "barrier_holds")]),
    ("14-elastic-noop-barrier", "elastic Peer.barrier returns at once",
     [no_mpi("tests/test_elastic_collectives.py", "-k", "barrier_holds")]),
    ("15-int8-dequantize-scale", "int8 wire format: every dequantized value 10% off (scale x 1.1)",
     [no_mpi("tests/test_elastic.py", "-k", "quantized_bit_identical")]),
]


def patched_file(patch: Path) -> str:
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            return line[len("+++ b/"):]
    raise SystemExit(f"{patch}: no '+++ b/FILE' line")


def git(*args, check=True, **kw):
    return subprocess.run(["git", *args], cwd=ROOT, check=check, text=True, capture_output=True, **kw)


def restore(path: str) -> None:
    git("checkout", "--", path)
    STATE.unlink(missing_ok=True)


def env_for(kind: str) -> dict:
    env = dict(os.environ)
    env.setdefault("OMPI_MCA_btl", "^ofi")
    if os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    if shutil.which("nvidia-smi") is None:
        env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    if kind == "no-mpi":
        pp = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(ROOT / "tests" / "no_mpi") + (":" + pp if pp else "")
    return env


def command(sel) -> list[str]:
    kind, n, args, timeout = sel
    py = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout}"]
    if kind == "mpi":
        return [os.environ.get("MPIEXEC", "mpiexec"), "--oversubscribe", "-n", str(n), *py, "--with-mpi", "-m", "mpi",
                "--timeout-method=thread", *args]
    return [*py, "-x", *args]  # one rank: stop at the first failure


def describe(sel) -> str:
    kind, n, args, _ = sel
    where = {"serial": "", "mpi": f"mpi -n{n} ", "no-mpi": "no-mpi "}[kind]
    return where + " ".join(a.replace("tests/", "") if a.startswith("tests/") else repr(a) if " " in a else a
                            for a in args)


def run_selection(sel, log) -> tuple[str, float]:
    """'pass', 'fail', 'timeout' or 'empty' (nothing collected), and seconds."""
    kind, timeout = sel[0], sel[3]
    cmd = command(sel)
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env_for(kind), stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        rc = p.wait(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        _stop(p)
        rc = "timeout"
    except BaseException:
        _stop(p)
        raise
    dt = time.monotonic() - t0
    log.write(f"[rc {rc}, {dt:.0f} s]\n")
    log.flush()
    if rc == 0:
        return "pass", dt
    if rc == 5:
        return "empty", dt
    return ("timeout" if rc == "timeout" or rc in (124, 137) else "fail"), dt


def _stop(p) -> None:
    """End a selection's process group: SIGTERM (mpiexec then ends its ranks), SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            pass


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutation ids or parts of names")
    ap.add_argument("--no-baseline", action="store_true", help="skip the clean-tree run of each selection")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--log", default=os.environ.get("COMMLIB_MUTATION_LOG", "/tmp/commlib-mutations.log"),
                    help="the tests' output (default %(default)s)")
    a = ap.parse_args(argv)
    # SIGINT too: a shell starts a background job with SIGINT ignored, and Python then
    # leaves it ignored; a Ctrl-C or kill -INT must still restore the file
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    chosen = [m for m in MUTATIONS if not a.only or any(o in m[0] for o in a.only)]
    if not chosen:
        raise SystemExit(f"no mutation matches {a.only}")
    files = {m[0]: patched_file(PATCHES / f"{m[0]}.patch") for m in chosen}
    dirty = git("status", "--porcelain", "--", *sorted(set(files.values()))).stdout.strip()
    if dirty:  # restoring with git checkout would throw these changes away
        raise SystemExit(f"refusing to run: uncommitted changes in files the mutations patch:\n{dirty}")
    t_all = time.monotonic()
    rows, bad_baseline = [], set()
    with open(a.log, "w") as log:
        print(f"tests' output: {a.log}", file=sys.stderr)
        if not a.no_baseline:
            seen = {}
            for m in chosen:
                for sel in m[2]:
                    key = describe(sel)
                    if key in seen:
                        continue
                    print(f"baseline: {key} ...", file=sys.stderr, flush=True)
                    log.write(f"\n=== baseline (clean tree): {key}\n")
                    seen[key] = run_selection(sel, log)
                    print(f"  {seen[key][0]} ({seen[key][1]:.0f} s)", file=sys.stderr, flush=True)
                    if seen[key][0] != "pass":
                        bad_baseline.add(key)
        for stem, what, sels in chosen:
            path = files[stem]
            print(f"{stem}: {what} ({path}) ...", file=sys.stderr, flush=True)
            log.write(f"\n=== {stem}: {what} ({path})\n")
            t0 = time.monotonic()
            outcomes = []
            try:
                STATE.write_text(path + "\n")
                git("apply", str(PATCHES / f"{stem}.patch"))
                for sel in sels:
                    outcomes.append((describe(sel), *run_selection(sel, log)))
            finally:
                restore(path)
            dt = time.monotonic() - t0
            caught_by = [d for d, r, _ in outcomes if r in ("fail", "timeout") and d not in bad_baseline]
            if any(d in bad_baseline for d, _, _ in outcomes):
                result = "BASELINE FAIL"
            elif any(r == "empty" for _, r, _ in outcomes):
                result = "NO TESTS"
            else:
                result = "CAUGHT" if caught_by else "MISSED"
            detail = "; ".join(f"{d}: {r} {s:.0f}s" for d, r, s in outcomes)
            rows.append((stem, what, path, detail, result, dt))
            print(f"  {result} ({dt:.0f} s): {detail}", file=sys.stderr, flush=True)
    total = time.monotonic() - t_all
    if a.markdown:
        print("| mutation | file | tests run (result, seconds) | result | seconds |")
        print("|---|---|---|---|---|")
        for stem, what, path, detail, result, dt in rows:
            print(f"| {stem}: {what} | `{path}` | {detail} | **{result}** | {dt:.0f} |")
    else:
        w = max(len(r[0]) for r in rows)
        for stem, what, path, detail, result, dt in rows:
            print(f"{stem:<{w}}  {result:<13} {dt:5.0f} s  {path}\n{'':<{w}}  {detail}")
    n_caught = sum(r[4] == "CAUGHT" for r in rows)
    print(f"\n{n_caught}/{len(rows)} caught, {total:.0f} s in all"
          + (f"; baseline failed: {sorted(bad_baseline)}" if bad_baseline else ""))
    return 0 if n_caught == len(rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: the patched file is restored", file=sys.stderr)
        sys.exit(130)
