#!/usr/bin/env bash
# Run the distributed heat solver with mpirun.
#
#   jobs/mpirun/heat.sh [NP] [-- extra heat options]
#   NP=8 jobs/mpirun/heat.sh -- --grid 128 --steps 1000 --json heat.json
#
# Prints provenance (commlib info) first, so every log says what ran.
set -euo pipefail
NP=${1:-${NP:-4}}
shift || true
[ "${1:-}" = "--" ] && shift
MPIRUN=${MPIRUN:-mpirun}
EXTRA=()
if [ "$(id -u)" = 0 ]; then EXTRA+=(--allow-run-as-root); fi
# Oversubscribe only when asked or when there are fewer cores than ranks.
if [ "$(nproc)" -lt "$NP" ]; then EXTRA+=(--oversubscribe); fi

echo "== provenance ($(date -u +%FT%TZ))"
commlib info
echo "== heat on $NP ranks"
exec "$MPIRUN" "${EXTRA[@]}" -n "$NP" python -P -m commlib.apps.heat "$@"
