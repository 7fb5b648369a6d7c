#!/usr/bin/env bash
# Fault-tolerant collectives under ULFM: run the fault-injection suite and the
# FT benchmarks (overhead without failure, recovery-time distribution).
#
#   jobs/mpirun/ft_collectives.sh            # tests + benchmarks, JSON in ./ft_results
#   COMMLIB_FT_CASES=100 RUNS=50 jobs/mpirun/ft_collectives.sh
#
# Runs from any folder. Environment: OUT (default ft_results, made here), RUNS
# (recovery jobs, default 30), COMMLIB_FT_CASES (randomized kill cases of the
# tests), PYTHON (default python), MPIEXEC (default: the mpiexec beside PYTHON).
#
# Launch line every fault-tolerant job needs with Open MPI 5:
#   mpiexec --with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum \
#           --prtemca state_base_error_non_zero_exit 0 ...
# (--with-ft ulfm: survivors are told about failures; tcp: the shared-memory BTL
#  did not report a killed rank; btl_tcp_flags without "put": with the TCP BTL's
#  RDMA put on, a rank's death wedged a healthy survivor in about one run in five,
#  which the watchdog then had to fail-stop (docs/faults-and-security.md, "The Open MPI defect and its flag");
#  state_base_error_non_zero_exit 0: a rank that exits non-zero does not make
#  prterun end the whole job.)
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; "") ;; *) echo "ft_collectives.sh: error: no arguments (see --help)" >&2; exit 2 ;; esac
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python}
PYPATH=$(command -v "$PY") || { echo "ft_collectives.sh: error: '$PY' not found (set PYTHON)" >&2; exit 2; }
MPIEXEC=${MPIEXEC:-$(dirname "$PYPATH")/mpiexec}
command -v "$MPIEXEC" >/dev/null || { echo "ft_collectives.sh: error: '$MPIEXEC' not found (set MPIEXEC)" >&2; exit 2; }
RUNS=${RUNS:-30}
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || { echo "ft_collectives.sh: error: RUNS must be a positive integer, got '$RUNS'" >&2; exit 2; }
OUT=${OUT:-ft_results}
mkdir -p "$OUT"
EXTRA=(--oversubscribe)
if [ "$(id -u)" = 0 ]; then EXTRA+=(--allow-run-as-root); fi
# shellcheck disable=SC2054  # the commas belong to the MCA values
FT=(--with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum
    --prtemca state_base_error_non_zero_exit 0)

echo "== provenance ($(date -u +%FT%TZ))"
"$PY" -P -m commlib.cli info || true
echo "== the FT launch's TCP BTL (tcp_btl_rdma must say off)"
"$MPIEXEC" "${EXTRA[@]}" "${FT[@]}" -n 1 "$PY" -P -m commlib.cli info --no-kernel-check | grep -E "fault_tolerance|tcp_btl" || true
echo "== fault-injection tests (randomized kill points; seed printed on failure)"
"$PY" -P -m pytest -q -p no:cacheprovider "$REPO/tests/test_ft.py"
echo "== FT overhead without failure (4 ranks)"
"$MPIEXEC" "${EXTRA[@]}" "${FT[@]}" -n 4 "$PY" "$REPO/benchmarks/bench_ft.py" overhead --json "$OUT/ft_overhead.json"
echo "== recovery time distribution"
"$PY" "$REPO/benchmarks/bench_ft.py" recovery --runs "$RUNS" --json "$OUT/ft_recovery.json"
