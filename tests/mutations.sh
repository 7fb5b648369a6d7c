#!/usr/bin/env bash
# Show that the tests bite: apply each deliberate bug of tests/mutations/*.patch in
# turn, run the tests that guard that code, print CAUGHT/MISSED per bug; exit 1 if
# any is missed. Not part of CI (several minutes on 2 cores). The driver is
# tests/mutations.py (its docstring has the options); it restores each patched file
# with "git checkout -- FILE" as soon as its tests end, also on Ctrl-C, and this
# trap restores it if the driver itself is killed.
#
#   bash tests/mutations.sh                # all 12, after a clean-tree baseline run
#   bash tests/mutations.sh --only 03 07   # some
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
COMMLIB_MUTATION_STATE=$(mktemp "${TMPDIR:-/tmp}/commlib-mutation.XXXXXX")
export COMMLIB_MUTATION_STATE
rm -f "$COMMLIB_MUTATION_STATE"   # present only while a mutation is applied
cleanup() {
  if [ -s "$COMMLIB_MUTATION_STATE" ]; then
    f=$(cat "$COMMLIB_MUTATION_STATE")
    echo "restoring $f" >&2
    git checkout -- "$f"
  fi
  rm -f "$COMMLIB_MUTATION_STATE"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"$PY" -P tests/mutations.py "$@"
