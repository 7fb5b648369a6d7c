#!/usr/bin/env bash
# Run commlib's whole test suite: serial tests (fault-injection and elastic
# tests launch their own mpiexec jobs from here), then the MPI tests under
# mpiexec at 1, 2, 3 and 4 ranks. Every stage is bounded in time, so one hung
# rank cannot hang the run.
#
#   bash tests/run.sh            # everything
#   RANKS="2 4" bash tests/run.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RANKS=${RANKS:-"1 2 3 4"}
MPIEXEC=${MPIEXEC:-mpiexec}
MPIFLAGS=${MPIFLAGS:-"--oversubscribe"}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Without a GPU, device kernels run in numba's CUDA simulator.
command -v nvidia-smi >/dev/null 2>&1 || export NUMBA_ENABLE_CUDASIM=${NUMBA_ENABLE_CUDASIM:-1}
export PYTHONDONTWRITEBYTECODE=1
status=0
# shellcheck source=tests/stage.sh
. tests/stage.sh

# The serial tests in two stages. The timing-driven files (fault injection, the
# elastic layer's sockets and deadlines, command lines killed on a timer) run one
# test at a time, as before: side by side on a 2-core machine their deadlines
# would race each other. The rest are plain CPU work (the CUDA simulator,
# hypothesis against MPI's own packing) and run in $WORKERS pytest-xdist workers.
TIMED=${COMMLIB_TIMED_TESTS-"tests/test_ft.py tests/test_ft_heat.py tests/test_ft_kill.py tests/test_elastic.py
  tests/test_elastic_churn.py tests/test_tcp.py tests/test_diloco.py tests/test_cli_refusal.py"}
WORKERS=${COMMLIB_TEST_WORKERS:-2}
skip=()
for f in $TIMED; do skip+=("--ignore=$f"); done
stage "serial tests ($WORKERS workers)" timeout 1500 "$PY" -P -m pytest -q -rfE -p no:cacheprovider --timeout=600 \
  -n "$WORKERS" tests "${skip[@]}" "$@" || status=1
if [ -n "${TIMED// /}" ]; then
  # shellcheck disable=SC2086
  stage "serial tests, timing-driven (one at a time)" timeout 1500 "$PY" -P -m pytest -q -rfE -p no:cacheprovider \
    --timeout=600 $TIMED "$@" || status=1
fi

# Under mpiexec a test that times out ends its rank (pytest-timeout's thread
# method, with every thread's stack printed) and so the job: the signal method
# cannot interrupt a rank blocked inside MPI, whose peers then wait for it
# until the stage's own limit.
for n in $RANKS; do
  # shellcheck disable=SC2086
  stage "MPI tests on $n rank(s)" timeout 900 "$MPIEXEC" $MPIFLAGS -n "$n" "$PY" -P -m pytest -q -rfE \
    -p no:cacheprovider --with-mpi -m mpi --timeout=300 --timeout-method=thread tests "$@" || status=1
done
exit $status
