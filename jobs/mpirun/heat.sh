#!/usr/bin/env bash
# Run the distributed heat solver with mpirun.
#
#   jobs/mpirun/heat.sh [NP] [-- extra heat options]
#   jobs/mpirun/heat.sh 4 -- --grid 64 --steps 200
#   NP=8 jobs/mpirun/heat.sh -- --grid 128 --steps 1000 --json heat.json
#
# NP: ranks (the first argument, else $NP, else 4); options after -- go to
# `python -m commlib.apps.heat` (see its --help). Environment: MPIRUN (default
# mpirun), PYTHON (default python; the interpreter with commlib installed).
# Oversubscribes when this machine has fewer cores than NP. Prints provenance
# (commlib info) first, so every log says what ran. Exit status: the solver's;
# 2 for a bad NP or a missing mpirun/python.
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
NP=${NP:-4}
if [ $# -gt 0 ] && [ "$1" != "--" ]; then NP=$1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
if ! [[ "$NP" =~ ^[1-9][0-9]*$ ]]; then
  echo "heat.sh: error: NP must be a positive integer, got '$NP' (usage: heat.sh [NP] [-- heat options])" >&2
  exit 2
fi
MPIRUN=${MPIRUN:-mpirun}
PY=${PYTHON:-python}
for tool in "$MPIRUN" "$PY"; do
  command -v "$tool" >/dev/null || { echo "heat.sh: error: '$tool' not found (set MPIRUN / PYTHON)" >&2; exit 2; }
done
EXTRA=()
if [ "$(id -u)" = 0 ]; then EXTRA+=(--allow-run-as-root); fi
# Oversubscribe only when there are fewer cores than ranks.
if [ "$(nproc)" -lt "$NP" ]; then EXTRA+=(--oversubscribe); fi

echo "== provenance ($(date -u +%FT%TZ))"
"$PY" -P -m commlib.cli info
echo "== heat on $NP ranks"
exec "$MPIRUN" "${EXTRA[@]}" -n "$NP" "$PY" -P -m commlib.apps.heat "$@"
