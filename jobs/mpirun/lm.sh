#!/usr/bin/env bash
# Train the sequence-parallel language model (python -m commlib.apps.lm) with mpirun.
#
#   jobs/mpirun/lm.sh [NP] [-- extra lm options]
#   jobs/mpirun/lm.sh 4 -- --attention hybrid --ulysses-degree 2 --verify --json lm.json --plot lm.png
#   NP=2 OUT=runs jobs/mpirun/lm.sh                 # writes runs/lm_p2.json and runs/lm_p2.png
#   FT=1 jobs/mpirun/lm.sh 4 -- --checkpoint ck      # survive dead ranks (Open MPI 5, ULFM)
#
# FT=1 adds the ULFM launch line (--with-ft ulfm, the TCP BTL without RDMA put, a rank
# exiting non-zero does not end the job) and --fault-tolerant: the survivors of a dead rank
# re-shard the sequences over themselves and redo the step (docs/guides/attention.md, "The LM app").
#
# Every rank holds 1/NP of each training sequence's tokens. Prints provenance
# (commlib info) first, so every log says what ran. Threads per rank default
# to the cores per rank (OMP_NUM_THREADS is set to match when unset).
set -euo pipefail
NP=${1:-${NP:-2}}
shift || true
[ "${1:-}" = "--" ] && shift
MPIRUN=${MPIRUN:-mpirun}
PY=${PYTHON:-python}
OUT=${OUT:-.}
EXTRA=()
if [ "$(id -u)" = 0 ]; then EXTRA+=(--allow-run-as-root); fi
# Oversubscribe only when there are fewer cores than ranks.
if [ "$(nproc)" -lt "$NP" ]; then EXTRA+=(--oversubscribe); fi
case "${FT:-0}" in
  1) EXTRA+=(--with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum
             --prtemca state_base_error_non_zero_exit 0)
     set -- --fault-tolerant "$@" ;;
  0) ;;
  *) echo "lm.sh: error: FT must be 0 or 1, got '$FT'" >&2; exit 2 ;;
esac
THREADS=$(( $(nproc) / NP ))
[ "$THREADS" -ge 1 ] || THREADS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}
mkdir -p "$OUT"

echo "== provenance ($(date -u +%FT%TZ))"
commlib info
echo "== lm on $NP ranks"
exec "$MPIRUN" "${EXTRA[@]}" -n "$NP" "$PY" -P -m commlib.apps.lm --threads "$OMP_NUM_THREADS" \
     --json "$OUT/lm_p${NP}.json" --plot "$OUT/lm_p${NP}.png" "$@"
