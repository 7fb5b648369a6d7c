#!/usr/bin/env bash
# Run commlib's whole test suite: serial tests (fault-injection and elastic
# tests launch their own mpiexec jobs from here), then the MPI tests under
# mpiexec at 1, 2, 3 and 4 ranks. Every stage is bounded in time, so one hung
# rank cannot hang the run.
#
#   bash tests/run.sh            # everything
#   RANKS="2 4" bash tests/run.sh
#   STAGES=no-mpi bash tests/run.sh   # some stages: serial timed no-mpi mpi (default: all)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RANKS=${RANKS:-"1 2 3 4"}
STAGES=${STAGES:-"serial timed no-mpi mpi"}
want() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
MPIEXEC=${MPIEXEC:-mpiexec}
MPIFLAGS=${MPIFLAGS:-"--oversubscribe"}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Open MPI's libfabric BTL (ofi) idles about 1 s in every job's MPI_Init probing for
# a fabric; jobs that name their BTLs (the fault-tolerant ones: tests/launch.py)
# never load it.  The others leave it out here (4 ranks, "from mpi4py import MPI":
# 1.37 s wall without, 0.35 s with; an MPI stage 3 s shorter).
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}
# Without a GPU, device kernels run in numba's CUDA simulator.
command -v nvidia-smi >/dev/null 2>&1 || export NUMBA_ENABLE_CUDASIM=${NUMBA_ENABLE_CUDASIM:-1}
# Bytecode is written on first import (into the venv; the checkout's tests/__pycache__
# is git-ignored) and reused by every later process: the README's install uses
# pip's --no-compile, which saves compiling all of torch, scipy and sympy up front
# (about 60 of its 95 s here), while this suite imports a small part of them.
export PYTHONDONTWRITEBYTECODE=
status=0
# shellcheck source=tests/stage.sh
. tests/stage.sh

# The serial tests in three stages. The timing-driven files (fault injection, the
# elastic layer's sockets and deadlines, command lines killed on a timer) run one
# test at a time, as before: side by side on a 2-core machine their deadlines
# would race each other. The rest are plain CPU work (the CUDA simulator,
# hypothesis against MPI's own packing) and run in $SERIAL_WORKERS pytest-xdist workers.
TIMED=${COMMLIB_TIMED_TESTS-"tests/test_ft.py tests/test_ft_heat.py tests/test_ft_kill.py
  tests/test_cli_refusal.py tests/test_ft_first_collective.py tests/test_nn_ft.py tests/test_lm_ft.py
  tests/test_lm_resume.py tests/test_resilient_example.py tests/test_slurm.py tests/test_ft_dup_after_death.py"}
# The elastic layer, its TCP transport and the DiLoCo app run with no MPI: these
# files run (the timing-driven ones one test at a time) with mpi4py made
# unimportable (tests/no_mpi first on PYTHONPATH: "import mpi4py" raises there,
# in their subprocesses too), instead of in the stages above, so an import of
# MPI on the elastic path fails CI and the suite takes no longer.
NO_MPI=${COMMLIB_NO_MPI_TESTS-"tests/test_elastic_no_mpi.py tests/test_elastic.py tests/test_elastic_job.py tests/test_elastic_engine.py
  tests/test_elastic_adversary.py tests/test_elastic_churn.py tests/test_elastic_collectives.py tests/test_tcp.py tests/test_diloco.py
  tests/test_tcp_comm.py tests/test_torch_backend_torchrun.py"}
NO_MPI_TIMED="tests/test_elastic_engine.py tests/test_elastic_adversary.py tests/test_elastic_churn.py tests/test_elastic_collectives.py"
WORKERS=${COMMLIB_TEST_WORKERS:-2}
# The plain-CPU stage runs one worker more than the machine has cores, with work
# stealing: its first tests compile numba kernels into an empty cache and start
# subprocesses, and a worker waiting on those leaves its core idle (2 cores, cold
# cache: 2 workers 100-127 s, 3 workers with work stealing 81-84 s, 4 workers 103 s).
SERIAL_WORKERS=${COMMLIB_SERIAL_WORKERS:-$((WORKERS + 1))}
skip=()
for f in $TIMED $NO_MPI; do skip+=("--ignore=$f"); done
want serial && { stage "serial tests ($SERIAL_WORKERS workers)" timeout 1500 "$PY" -P -m pytest -q -rfEs --color=no \
  -p no:cacheprovider --timeout=600 -n "$SERIAL_WORKERS" --dist worksteal tests "${skip[@]}" "$@" || status=1; }
# The ULFM kill-point jobs of test_ft.py (20 randomized runs and the corners: each an
# mpiexec job of 3-6 ranks, mostly waiting on its launch: 0.9 CPU-s in 1.3 s of wall)
# run two at a time in pytest-xdist workers; their bounds (a recovery under 2 s, a job
# under 30 s) are far above what two side by side take. The other timing-driven tests
# (stalls, watchdog deadlines, the kill-time runs that pace their own jobs) one test of
# a file at a time, two files side by side.
TIMED_PAR=${COMMLIB_TIMED_PAR_TESTS-"tests/test_ft.py::test_random_kill_points tests/test_ft.py::test_kill_corners tests/test_ft_dup_after_death.py"}
TIMED_ALONE=${COMMLIB_TIMED_ALONE_TESTS-"tests/test_slurm.py"}
timed_tests() {
  local t par="" deselect=() rc=0 alone_log="" alone_pid=""
  for t in $TIMED_PAR; do  # only those of files this run has in TIMED
    case " ${TIMED//$'\n'/ } " in *" ${t%%::*} "*) par="$par $t" deselect+=("--deselect=$t") ;; esac
  done
  local alone=() rest=() f
  for f in $TIMED; do
    case " $TIMED_ALONE " in *" $f "*) alone+=("$f") ;; *) rest+=("$f") ;; esac
  done
  # The Slurm jobs (a test cluster of their own, started by the file: daemons on
  # ports below the ephemeral range) run in the background beside the ULFM
  # kill-point jobs, which leave a core part idle (about 0.7 core each, two at a
  # time); their output is printed after those.
  if [ ${#alone[@]} -gt 0 ]; then
    alone_log=$(mktemp "${TMPDIR:-/tmp}/commlib-alone.XXXXXX")
    timeout 1500 "$PY" -P -m pytest -q -rfEs --color=no -p no:cacheprovider --timeout=600 "${alone[@]}" "$@" \
      >"$alone_log" 2>&1 &
    alone_pid=$!
  fi
  if [ -n "${par// /}" ]; then
    # shellcheck disable=SC2086
    timeout 1500 "$PY" -P -m pytest -q -rfEs --color=no -p no:cacheprovider --timeout=600 -n 2 $par "$@" || rc=1
  fi
  if [ -n "$alone_pid" ]; then
    echo "+ ${alone[*]} (run beside the kill-point jobs):"
    wait "$alone_pid" || rc=1
    cat "$alone_log"
    rm -f "$alone_log"
  fi
  # the rest: each file's tests one at a time, two files side by side (--dist
  # loadfile); their bounds are seconds above what a recovery takes, and all of them
  # passed side by side under a load of 6-12 (131 tests in 447 s; one at a time 808 s at a
  # load of 10-18, 322 s on a quiet machine)
  if [ ${#rest[@]} -gt 0 ]; then
    timeout 1500 "$PY" -P -m pytest -q -rfEs --color=no -p no:cacheprovider --timeout=600 -n 2 --dist loadfile \
      "${rest[@]}" "${deselect[@]}" "$@" || rc=1
  fi
  return $rc
}
if want timed && [ -n "${TIMED// /}" ]; then
  stage "serial tests, timing-driven (the ULFM kill-point jobs two at a time beside the Slurm jobs, then the rest two files at a time)" \
    timed_tests "$@" || status=1
fi
no_mpi_tests() {
  # the guard: with the stub first on the path, mpi4py must not import
  local pp
  pp="$PWD/tests/no_mpi${PYTHONPATH:+:$PYTHONPATH}"
  if PYTHONPATH=$pp "$PY" -P -c "import mpi4py" >/dev/null 2>&1; then
    echo "FAILED no-MPI guard: mpi4py imports with PYTHONPATH=$pp (tests/no_mpi/mpi4py missing or shadowed);" \
      "these tests would not show an MPI import"
    return 1
  fi
  echo "+ PYTHONPATH=$pp (mpi4py blocked)"
  # the timing-driven files (kills, floods, deadlines): each file's tests one at a
  # time, three files side by side (--dist loadfile): most of their time is waiting
  # out a deadline or a stalled peer (1.4 of their 3.6 minutes on a core; on 2 cores
  # 86 s wall three side by side, 117-131 s two, 3.6 minutes one); the rest in
  # $WORKERS pytest-xdist workers
  local f timed="" rest="" rc=0
  for f in $NO_MPI; do
    case " $NO_MPI_TIMED " in *" $f "*) timed="$timed $f" ;; *) rest="$rest $f" ;; esac
  done
  if [ -n "${rest// /}" ]; then
    # shellcheck disable=SC2086
    PYTHONPATH=$pp timeout 1500 "$PY" -P -m pytest -q -rfEs --color=no -p no:cacheprovider --timeout=600 -n "$WORKERS" $rest "$@" ||
      rc=1
  fi
  if [ -n "${timed// /}" ]; then
    # shellcheck disable=SC2086
    PYTHONPATH=$pp timeout 1500 "$PY" -P -m pytest -q -rfEs --color=no -p no:cacheprovider --timeout=600 \
      -n "$((WORKERS + 1))" --dist loadfile $timed "$@" || rc=1
  fi
  return $rc
}
if want no-mpi && [ -n "${NO_MPI// /}" ]; then
  stage "serial tests without MPI: elastic, TCP, DiLoCo (mpi4py blocked)" no_mpi_tests "$@" ||
    status=1
fi

# Under mpiexec a test that times out ends its rank (pytest-timeout's thread
# method, with every thread's stack printed) and so the job: the signal method
# cannot interrupt a rank blocked inside MPI, whose peers then wait for it
# until the stage's own limit.
# Only the files that hold MPI tests (a pytest.mark.mpi mark) are collected: every rank
# collects what it is given, and the other 30 files cost each rank 6-7 of its 11 s of
# collection, on 10 ranks in all.
want mpi || RANKS=""
MPI_FILES=$(grep -l -E "pytest\.mark\.mpi" tests/test_*.py | tr '\n' ' ')
for n in $RANKS; do
  # shellcheck disable=SC2086
  stage "MPI tests on $n rank(s)" timeout 900 "$MPIEXEC" $MPIFLAGS -n "$n" "$PY" -P -m pytest -q -rfEs --color=no \
    -p no:cacheprovider --with-mpi -m mpi --timeout=300 --timeout-method=thread $MPI_FILES "$@" || status=1
done
torch_hint "$PY"
exit $status
