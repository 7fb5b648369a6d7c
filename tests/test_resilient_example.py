"""The fault-tolerance guide's resilient training loop (``docs/guides/fault-tolerance.md``, the block
after ``<!-- resilient-example -->``: torch's DDP on
the ``"commlib"`` backend under :class:`commlib.ResilientRunner`), run as written under ``mpiexec
--with-ft ulfm`` at 4 ranks with ranks SIGKILLed in every phase of a step (one job with one kill, one with two): at its start,
inside the backward pass while DDP's bucket all-reduces run (a gradient hook of the first layer), and
before the loss all-reduce; victims (rank 0 among them) and steps from a printed seed.  The survivors must finish
the 10 steps with the parameters of the same script run by one process without failures (float64,
within 1e-10) and report the failures.  Also :class:`commlib.ResilientRunner`'s argument checks and
its behaviour off ULFM (re-raise)."""
import os
import random
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mpi4py  # noqa: E402

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

import commlib  # noqa: E402
from commlib.core.device import ulfm_available  # noqa: E402
from launch import FINALIZE_TIMEOUT, FT_ARGS, run_job  # noqa: E402 - tests/launch.py

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
SEED = int(os.environ.get("COMMLIB_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
DIE = '''import os as _os, signal as _signal
_KILLS = {KILLS!r}  # (COMM_WORLD rank, 1-based step, phase)
def _die(phase):
    if (int(comm.world_ranks[comm.rank]), runner.completed + 1, phase) in _KILLS:
        _os.kill(_os.getpid(), _signal.SIGKILL)
'''
PHASES = ("start", "backward", "allreduce")
#: where each phase's kill goes in the README's step()
HOOKS = {
    "def step():\n": "def step():\n    _die('start')\n",
    "    loss.backward()": "    _h = net[0].weight.register_hook(lambda g: _die('backward'))\n    loss.backward()\n    _h.remove()",
    "    dist.all_reduce(loss": "    _die('allreduce')\n    dist.all_reduce(loss",
}
SAVE = '''
if comm.rank == 0:
    torch.save(torch.nn.utils.parameters_to_vector(net.parameters()), {PATH!r})
'''


def _example() -> str:
    text = (ROOT / "docs" / "guides" / "fault-tolerance.md").read_text()
    block = text.split("<!-- resilient-example -->", 1)[1]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def _run(tmp_path, kills, n):
    src = _example()
    for where, what in HOOKS.items():
        assert where in src, where
        src = src.replace(where, what, 1)
    src = src.replace("reshard(comm)\nrunner", DIE.replace("{KILLS!r}", repr(set(kills))) + "reshard(comm)\nrunner", 1)
    params = tmp_path / f"params-{n}-{len(kills)}.pt"
    src += SAVE.replace("{PATH!r}", repr(str(params)))
    script = tmp_path / "train.py"
    script.write_text(src)
    cmd = [MPIEXEC, "--oversubscribe", *FT_ARGS, "-n", str(n), sys.executable, str(script)] if n else \
        [sys.executable, str(script)]
    env = {k: v for k, v in os.environ.items() if n or not k.startswith(("OMPI_COMM", "PMIX_", "PRTE_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    rc, text = run_job(cmd, env, 150, started=lambda t: "loss " in t)
    if rc is None:
        pytest.fail(f"the guide's example did not finish in 150 s (seed {SEED}, kills {kills})")
    m = re.search(r"loss ([0-9.]+) on (\d+) ranks; failures: (.*)", text)
    assert m, f"seed {SEED}, kills {kills}:\n{text[-3000:]}"
    return torch.load(params), int(m.group(2)), m.group(3)


@pytest.mark.timeout(500)
@pytest.mark.skipif(not ("Open MPI" in MPI.Get_library_version() and ulfm_available()),
                    reason="needs Open MPI with ULFM")
def test_readme_example_survives_kills(tmp_path):
    ref, size, failures = _run(tmp_path, [], 0)
    assert size == 1 and failures == "[]"
    rng = random.Random(SEED)
    # two jobs: one kill, then two kills (4 -> 3 -> 2); between them every phase once, rank 0 a victim
    phases = rng.sample(PHASES, len(PHASES))
    victims = [0, *rng.sample(range(1, 4), 2)]
    rng.shuffle(victims)
    kills = [(v, rng.randrange(1, 11), p) for v, p in zip(victims, phases)]
    plans = [kills[:1], kills[1:]]
    for kills in plans:
        params, size, failures = _run(tmp_path, kills, 4)
        assert size == 4 - len(kills), (SEED, kills, failures)
        for v, s, _ in kills:
            assert re.search(rf"\({s}, \([^)]*\b{v}\b", failures), (SEED, kills, failures)
        err = (params - ref).abs().max().item()
        assert err <= 1e-10 * ref.abs().max().item(), f"seed {SEED}, kills {kills}: parameters differ by {err:.3g}"


def test_runner_refuses_bad_arguments(world):
    with pytest.raises(commlib.InvalidArgument, match="callable"):
        commlib.ResilientRunner(world, save=3)
    with pytest.raises(commlib.InvalidArgument, match="max_retries"):
        commlib.ResilientRunner(world, max_retries=-1)


def test_runner_without_ulfm_reraises_and_counts_steps(world):
    """Not under ULFM (this process): a failure raised in the step leaves run() unchanged, no
    load or reshard runs; a step that returns commits, saved state taken each time."""
    calls = []
    r = commlib.ResilientRunner(world, save=lambda: calls.append("save") or len(calls),
                                load=lambda s: calls.append("load"), reshard=lambda c: calls.append("reshard"))
    assert r.run(lambda a, b=0: a + b, 2, b=3) == 5 and r.completed == 1

    def boom():
        raise commlib.ProcessFailed("a peer died", rank=world.rank, op="test")

    with pytest.raises(commlib.ProcessFailed):
        r.run(boom)
    assert "load" not in calls and "reshard" not in calls and calls.count("save") == 2
    with pytest.raises(ZeroDivisionError):  # a bug is not a failure
        r.run(lambda: 1 / 0)
    assert r.completed == 1 and r.failures == []
