#!/usr/bin/env bash
# Distributed attention app and benchmark under mpirun.
#   NP=4 SEQ=16384 LAYOUT=zigzag jobs/mpirun/attention.sh            # app, forward+backward, checked
#   NP=4 SEQ=16384 BENCH=1 jobs/mpirun/attention.sh                   # benchmark ratios (JSON in $OUT)
# As root, Open MPI needs --allow-run-as-root; --oversubscribe for more ranks than cores.
set -euo pipefail
NP=${NP:-4}
SEQ=${SEQ:-8192}
LAYOUT=${LAYOUT:-zigzag}
DTYPE=${DTYPE:-float32}
OUT=${OUT:-.}
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-mpiexec}
EXTRA=()
[ "$(id -u)" = 0 ] && EXTRA+=(--allow-run-as-root)
EXTRA+=(--oversubscribe)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ -n "${BENCH:-}" ]; then
  exec "$MPIEXEC" "${EXTRA[@]}" -n "$NP" "$PY" benchmarks/bench_attention.py --seq "$SEQ" \
       --json "$OUT/bench_attention_p${NP}.json"
fi
exec "$MPIEXEC" "${EXTRA[@]}" -n "$NP" "$PY" -m commlib.apps.attention --seq "$SEQ" --layout "$LAYOUT" \
     --dtype "$DTYPE" --causal --backward --check --iters "${ITERS:-3}" --json "$OUT/attention_p${NP}.json"
