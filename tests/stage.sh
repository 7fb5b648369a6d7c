# Sourced by tests/run.sh and tests/run_mpich.sh: run one bounded stage of the
# suite, its output streamed as usual; when it fails, its name and pytest's
# FAILED/ERROR lines go to the recap file $COMMLIB_RECAP (when set), which
# .ci/run prints last, so a failure shows at the end of a long CI log.
#
#   stage "MPI tests on 4 rank(s)" timeout 900 mpiexec ... || status=1
stage() {
  local name=$1 log rc t0=$SECONDS
  shift
  echo "== $name"
  log=$(mktemp "${TMPDIR:-/tmp}/commlib-stage.XXXXXX")
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" != 0 ] && [ -n "${COMMLIB_RECAP:-}" ]; then
    {
      echo "stage failed (exit $rc): $name"
      [ "$rc" = 124 ] && echo "  (killed by its time limit: a rank hung)"
      sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^(FAILED|ERROR) |\] FAILED |Timeout|^E +' | sort | uniq -c | sort -rn | head -40 | sed 's/^/  /'
    } >> "$COMMLIB_RECAP"
  fi
  rm -f "$log"
  return "$rc"
}
