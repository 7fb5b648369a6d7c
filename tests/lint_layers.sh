#!/usr/bin/env bash
# Assemble the installed commlib (its layers may live in separate folders in an
# editable install) into one tree, then run import-linter's contracts on it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -P - "$tmp" <<'PY'
import importlib, os, shutil, sys
dst = os.path.join(sys.argv[1], "commlib")
root = importlib.import_module("commlib").__path__[0]
shutil.copytree(root, dst, ignore=shutil.ignore_patterns("__pycache__"))
for layer in ("transports", "datatypes", "collectives", "apps"):
    src = importlib.import_module(f"commlib.{layer}").__path__[0]
    if os.path.realpath(src) != os.path.realpath(os.path.join(root, layer)):
        shutil.copytree(src, os.path.join(dst, layer), ignore=shutil.ignore_patterns("__pycache__"))
PY
cd "$tmp" && PYTHONPATH="$tmp" "$(dirname "$(command -v "$PY")")/lint-imports" --config "$here/.importlinter" "$@"
