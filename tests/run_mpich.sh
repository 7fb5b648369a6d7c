#!/usr/bin/env bash
# The suite's MPICH leg: a second venv with the MPICH wheel (no ULFM), where
# the fault-injection tests check the bounded-time error instead of recovery,
# and the collectives run against MPICH's own. Bounded in time like run.sh.
#
#   bash tests/run_mpich.sh            # makes .venv-mpich on first use, else reinstalls commlib there
set -u
cd "$(dirname "$0")/.."
VENV=${MPICH_VENV:-.venv-mpich}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" || exit 1
  # the files this leg runs need no apps: "test-mpi", not "test"; torch (the CPU build kept on
  # these machines, Python < 3.12) for the LM app's checkpoint/resume without ULFM
  # --no-compile: bytecode is written on first import instead (tests/run.sh says why)
  "$VENV/bin/pip" install -q --no-compile ".[mpich,test-mpi]" "torch==2.13.0; python_version < '3.12'" || exit 1
else  # an existing venv gets this checkout, not the copy it was made with
  "$VENV/bin/pip" install -q --no-deps --force-reinstall . || exit 1
fi
PY="$VENV/bin/python"
lib=$("$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().split()[0])")
[ "$lib" = MPICH ] || { echo "mpi4py in $VENV is not linked to MPICH ($lib)" >&2; exit 1; }
command -v nvidia-smi >/dev/null 2>&1 || export NUMBA_ENABLE_CUDASIM=${NUMBA_ENABLE_CUDASIM:-1}
export PYTHONDONTWRITEBYTECODE=  # bytecode written on first import, as in tests/run.sh
status=0
# shellcheck source=tests/stage.sh
. tests/stage.sh
# three pytest-xdist workers: the bounded-error jobs mostly wait out their 2 s timeout
# (on 2 cores 35 s, one at a time 58 s)
stage "MPICH: serial collectives and bounded-error fault tests" timeout 900 "$PY" -P -m pytest -q -rfEs --color=no \
  -p no:cacheprovider --timeout=300 -n 3 --dist worksteal tests/test_collectives_unit.py tests/test_ft.py \
  tests/test_communicator.py || status=1
# a rank's death without ULFM: every survivor exits in bounded time naming the last checkpoint, and
# the resume on another rank count gives the uninterrupted run's losses (hydra -disable-auto-cleanup)
stage "MPICH: LM checkpoint, kill, resume (no ULFM)" timeout 600 "$PY" -P -m pytest -q -rfEs --color=no -p no:cacheprovider \
  --timeout=300 tests/test_lm_resume.py -k "without_ulfm" || status=1
# real Slurm jobs with this MPI (srun --mpi=pmi2, heat.sbatch): a cluster on this host, skipped where
# Slurm cannot run (tests/test_slurm.py); the LM jobs and the singleton checks run in tests/run.sh only
stage "MPICH: Slurm jobs (srun --mpi=pmi2, sbatch)" timeout 600 "$PY" -P -m pytest -q -rfEs --color=no \
  -p no:cacheprovider --timeout=300 tests/test_slurm.py -k "srun_heat or srun_attention or test_sbatch_heat_script" ||
  status=1
for n in ${RANKS:-2 3}; do
  stage "MPICH: MPI tests on $n rank(s)" timeout 600 "$VENV/bin/mpiexec" -n "$n" "$PY" -P -m pytest -q -rfEs --color=no \
    -p no:cacheprovider --with-mpi -m mpi --timeout=300 --timeout-method=thread \
    tests/test_collectives.py tests/test_communicator.py tests/test_halo.py tests/test_mixed_p2p.py || status=1
done
torch_hint "$PY"
exit $status
