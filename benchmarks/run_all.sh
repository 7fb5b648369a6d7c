#!/usr/bin/env bash
# Run every benchmark once and keep the JSON and plots in results/ (or $OUT).
# Each benchmark measures its own baseline in the same run and prints ratios.
#
#   bash benchmarks/run_all.sh            # 2 and 4 ranks where it matters
#   OUT=/tmp/bench bash benchmarks/run_all.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
MPIEXEC=${MPIEXEC:-mpiexec}
PY=${PYTHON:-python}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
run() { echo; echo "== $*"; "$@" || echo "!! failed: $*"; }
M() { local n=$1; shift; run "$MPIEXEC" --oversubscribe -n "$n" "$PY" "$@"; }

run "$PY" benchmarks/bench_pack.py --json "$OUT/pack.json" --plot "$OUT/pack.png"
M 2 benchmarks/bench_typed_pingpong.py --json "$OUT/pingpong.json" --plot "$OUT/pingpong.png"
M 2 benchmarks/bench_small.py --json "$OUT/small_p2.json"
for n in 2 4; do
  M "$n" benchmarks/bench_heat.py --json "$OUT/heat_p$n.json"
  M "$n" benchmarks/bench_halo.py --json "$OUT/halo_p$n.json"
  M "$n" benchmarks/bench_halo3d.py --json "$OUT/halo3d_p$n.json" --plot "$OUT/halo3d_p$n.png"
  M "$n" benchmarks/bench_attention.py --json "$OUT/attention_p$n.json"
  M "$n" benchmarks/bench_allreduce.py --json "$OUT/allreduce_p$n.json" --plot "$OUT/allreduce_p$n.png"
done
# fault-tolerant mode: overhead without failure (under ULFM) and recovery time
run "$MPIEXEC" --oversubscribe --with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum --prtemca state_base_error_non_zero_exit 0 \
  -n 2 "$PY" benchmarks/bench_ft.py overhead --trials 25 --min-bytes 1048576 --json "$OUT/ft_overhead.json"
run "$PY" benchmarks/bench_ft.py recovery --runs "${RUNS:-20}" --json "$OUT/ft_recovery.json"
# a DDP job losing a worker: recovery over commlib (ULFM) against torchft (needs pip install torchft)
if "$PY" -c "import torchft" 2>/dev/null; then
  run "$PY" benchmarks/bench_recovery_torchft.py --runs 5 --json "$OUT/recovery_torchft.json"
else
  echo; echo "== skipped benchmarks/bench_recovery_torchft.py: torchft is not installed (pip install torchft)"
fi
echo; echo "results in $OUT/"
