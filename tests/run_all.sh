#!/usr/bin/env bash
# The README's test command after the install: the Open MPI suite (tests/run.sh),
# then the MPICH leg (tests/run_mpich.sh), each run whatever the other's result,
# so one failing stage hides no other leg. Exits non-zero if either failed; a
# failed leg is named in the recap file $COMMLIB_RECAP (when set; .ci/run prints it).
#
#   bash tests/run_all.sh            # both legs
#   RANKS="2" bash tests/run_all.sh  # the variables of run.sh and run_mpich.sh pass through
set -u
cd "$(dirname "$0")/.."
status=0
for leg in tests/run.sh tests/run_mpich.sh; do
  bash "$leg"
  rc=$?
  echo "== $leg: exit $rc"
  if [ "$rc" != 0 ]; then
    status=1
    [ -n "${COMMLIB_RECAP:-}" ] && echo "leg failed (exit $rc): bash $leg" >> "$COMMLIB_RECAP"
  fi
done
exit $status
