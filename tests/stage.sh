# Sourced by tests/run.sh and tests/run_mpich.sh: run one bounded stage of the
# suite, its output streamed as usual; when it fails, its name and pytest's
# FAILED/ERROR lines go to the recap file $COMMLIB_RECAP (when set), which
# .ci/run prints last, so a failure shows at the end of a long CI log. An
# mpiexec that fails to start before any rank runs is tried once more.
#
#   stage "MPI tests on 4 rank(s)" timeout 900 mpiexec ... || status=1
stage() {
  local name=$1 log rc t0=$SECONDS try
  shift
  for try in 1 2; do
    echo "== $name"
    log=$(mktemp "${TMPDIR:-/tmp}/commlib-stage.XXXXXX")
    "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    # Open MPI's launcher sometimes fails to start at all, before any rank runs
    # (seen once in CI, right after the fault-injection stage's hundreds of jobs;
    # other projects' CI report it too): that stage gets one more try. A stage
    # whose ranks ran and failed does not.
    if [ "$rc" != 0 ] && [ "$try" = 1 ] && grep -aq "PMIx server's listener thread failed to start" "$log" &&
      ! sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -aqE '[0-9]+ (passed|failed|error)|^(FAILED|ERROR) |\[ *[0-9]+%\]'; then
      echo "== $name: mpiexec failed to start (no rank ran; exit $rc): once more"
      rm -f "$log"
      continue
    fi
    break
  done
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" != 0 ] && [ -n "${COMMLIB_RECAP:-}" ]; then
    {
      echo "stage failed (exit $rc): $name"
      [ "$rc" = 124 ] && echo "  (killed by its time limit: a rank hung)"
      sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -a -E '^(FAILED|ERROR) |\] FAILED |Timeout|^E +' | sort | uniq -c | sort -rn | head -40 | sed 's/^/  /'
    } >> "$COMMLIB_RECAP"
  fi
  rm -f "$log"
  return "$rc"
}

# Sourced too: at the end of a run, one line on how to install torch when "$1" (the
# suite's Python) has none: its tests (commlib.nn, the LM app) then skip, and
# the SKIPPED lines above say which. On Python 3.11 torch==2.13.0 is the CPU build
# kept on these machines; elsewhere PyTorch's CPU index gives the CPU-only build
# (PyPI's Linux wheel pulls the CUDA build and GBs of nvidia packages).
torch_hint() {
  "$1" -P -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null &&
    return 0
  local cmd="$1 -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
  "$1" -c "import sys; sys.exit(sys.version_info[:2] != (3, 11))" 2>/dev/null && cmd="$1 -m pip install torch==2.13.0"
  echo "== torch is not installed: its tests skipped (the SKIPPED lines above); to run them, CPU-only: $cmd"
}
