#!/usr/bin/env bash
# Allreduce busbw, commlib's ring / recursive doubling / auto against MPI_Allreduce,
# 4 B .. 64 MiB at 2 and 4 ranks (ratios from one run; JSON per rank count).
#
#   jobs/mpirun/ft_allreduce_bench.sh            # writes allreduce_2.json, allreduce_4.json here
#   RANKS="2 3" jobs/mpirun/ft_allreduce_bench.sh
#
# Runs from any folder (the JSON files land in the current one). Environment:
# RANKS (default "2 4"), PYTHON (default python), MPIEXEC (default: the mpiexec
# beside PYTHON, e.g. the Open MPI wheel's in a venv).
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; "") ;; *) echo "ft_allreduce_bench.sh: error: no arguments (see --help)" >&2; exit 2 ;; esac
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python}
PYPATH=$(command -v "$PY") || { echo "ft_allreduce_bench.sh: error: '$PY' not found (set PYTHON)" >&2; exit 2; }
MPIEXEC=${MPIEXEC:-$(dirname "$PYPATH")/mpiexec}
command -v "$MPIEXEC" >/dev/null || { echo "ft_allreduce_bench.sh: error: '$MPIEXEC' not found (set MPIEXEC)" >&2; exit 2; }
RANKS=${RANKS:-2 4}
for NP in $RANKS; do
  [[ "$NP" =~ ^[1-9][0-9]*$ ]] || { echo "ft_allreduce_bench.sh: error: RANKS must be positive integers, got '$NP'" >&2; exit 2; }
done
EXTRA=(--oversubscribe)
if [ "$(id -u)" = 0 ]; then EXTRA+=(--allow-run-as-root); fi
for NP in $RANKS; do
  echo "== allreduce on $NP ranks"
  "$MPIEXEC" "${EXTRA[@]}" -n "$NP" "$PY" "$REPO/benchmarks/bench_allreduce.py" --json "allreduce_$NP.json"
done
