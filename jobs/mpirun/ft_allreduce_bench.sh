#!/usr/bin/env bash
# Allreduce busbw, commlib's ring / recursive doubling / auto against MPI_Allreduce,
# 4 B .. 64 MiB at 2 and 4 ranks (ratios from one run; JSON per rank count).
#
#   jobs/mpirun/ft_allreduce_bench.sh        # writes allreduce_2.json, allreduce_4.json
set -euo pipefail
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-$(dirname "$(command -v "$PY")")/mpiexec}
EXTRA=(--oversubscribe)
if [ "$(id -u)" = 0 ]; then EXTRA+=(--allow-run-as-root); fi
for NP in ${RANKS:-2 4}; do
  echo "== allreduce on $NP ranks"
  "$MPIEXEC" "${EXTRA[@]}" -n "$NP" "$PY" benchmarks/bench_allreduce.py --json "allreduce_$NP.json"
done
