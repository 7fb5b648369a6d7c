"""Fault-tolerant context-parallel training: ``python -m commlib.apps.lm --fault-tolerant`` (ULFM).

Each case launches the app under ``mpiexec --with-ft ulfm`` at 4 ranks with
ranks killed (exiting at once, no cleanup) in a chosen phase of a chosen step (``--kill``), and judges
the survivors' losses (training and validation, every step) against an
oracle this test computes itself: the single-process training with plain
torch attention on the whole sequences (``oracle_losses``: dense SDPA with
the document mask, no commlib), within 1e-4 relative in float32; and against
a plain 4-rank run without ``--fault-tolerant`` (the same tolerance).  The victims, steps and the
phases of the randomized cases come from the suite's seed (tests/seeds.py), printed
with every failure (``COMMLIB_TEST_SEED`` sets it; a fixed default otherwise).  Every job is bounded in time.
"""
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mpi4py  # noqa: E402

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from commlib.apps import lm as app  # noqa: E402
from commlib.core.device import ulfm_available  # noqa: E402
from launch import FINALIZE_TIMEOUT, FT_ARGS, run_job  # noqa: E402 - tests/launch.py
from lm_oracle import assert_losses, oracle  # noqa: E402 - tests/lm_oracle.py
from seeds import test_seed  # noqa: E402 - tests/seeds.py

pytestmark = pytest.mark.skipif(not ("Open MPI" in MPI.Get_library_version() and ulfm_available()),
                                reason="needs Open MPI with ULFM")
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
SEED = test_seed()
#: a small model, 6 steps, evaluation at steps 3 and 6; 2 x 61 tokens: 122 is a multiple of no
#: zigzag unit 2P at 2-4 ranks, so the padding document is in play before and after every failure
TINY = ["--steps", "6", "--seq-len", "61", "--batch", "2", "--d-model", "32", "--heads", "4", "--kv-heads", "2",
        "--layers", "2", "--eval-every", "3", "--eval-batches", "1", "--quiet"]
REL = 1e-4


def _lm(n, args, ft=True, timeout=150):
    out = tempfile.mktemp(suffix=".json")
    cmd = [MPIEXEC, "--oversubscribe"] + (FT_ARGS if ft else [])
    cmd += ["-n", str(n), sys.executable, "-P", "-m", "commlib.apps.lm", "--json", out] + args
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    env.setdefault("COMMLIB_TIMEOUT", "30")
    rc, text = run_job(cmd, env, timeout, started=lambda _: os.path.exists(out))
    if rc is None:
        pytest.fail(f"lm did not finish within {timeout} s (seed {SEED}): {' '.join(cmd)}")
    assert os.path.exists(out), f"seed {SEED}: no report\n{text[-3000:]}"
    rep = json.loads(Path(out).read_text())
    os.unlink(out)
    return rep, text


_PLAIN = {}


def _plain(argv):
    """The losses of the same run at 4 ranks without --fault-tolerant (and without failures)."""
    key = tuple(argv)
    if key not in _PLAIN:
        rep, _ = _lm(4, list(argv), ft=False)
        _PLAIN[key] = rep
    return _PLAIN[key]


def _assert_same_as_plain(rep, argv, what):
    plain = _plain(argv)
    expected = ([x["train_loss"] for x in plain["steps"]],
                {x["step"]: x["val_loss"] for x in plain["steps"] if x["val_loss"] is not None})
    assert_losses(rep, expected, REL, f"{what} against a plain run (seed {SEED})")


def _assert_losses(rep, argv, what):
    assert_losses(rep, oracle(argv, size=4), REL, f"{what} against the oracle (seed {SEED})")
    assert rep["parameters_identical_across_ranks"], (what, SEED)


def _check_failures(rep, kills, text):
    """``failures`` lists every victim once, with its step and phase, and the survivors' count."""
    rows = rep["failures"]
    assert sorted((f["world_rank"], f["step"], f["phase"]) for f in rows) == sorted(kills), (rows, SEED, text[-2000:])
    assert rep["ranks_final"] == rep["ranks"] - len(kills)
    for f in rows:
        assert f["recovery_s"] >= 0 and f["ranks_after"] >= rep["ranks_final"]


@pytest.mark.timeout(200)
def test_plain_run_at_uneven_length_matches_oracle():
    """No failure, no --fault-tolerant: 122 tokens over 4 ranks in zigzag (unit 8: a padding
    document of 6 tokens) and per-row sharding without document masking in the striped layout
    (61 tokens a row, 3 of padding each) give the oracle's losses."""
    for extra in ([], ["--no-doc-mask", "--layout", "striped"]):
        argv = TINY + extra
        rep = _plain(argv)
        assert rep["ranks_final"] == 4 and rep["failures"] == []
        _assert_losses(rep, argv, f"plain {extra}")


# phases of one step a kill strikes in, two per job (4 -> 3 -> 2 ranks)
PAIRS = [("forward", "backward"), ("allreduce", "optimizer"), ("eval", "backward")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phases", PAIRS, ids=lambda p: "+".join(p))
def test_two_kills_each_phase(phases):
    """Two ranks die in one run (random victims, rank 0 included, random steps; seeded): the
    survivors finish on 2 ranks with the oracle's losses, and the report lists both failures."""
    rng = random.Random(f"{SEED}-{'+'.join(phases)}")
    victims = rng.sample(range(4), 2)
    kills = []
    for v, ph in zip(victims, phases):
        step = rng.choice([3, 6]) if ph == "eval" else rng.randrange(1, 7)
        kills.append((v, step, ph))
    argv = TINY + [x for r, s, ph in kills for x in ("--kill", f"{r}:{s}:{ph}")]
    rep, text = _lm(4, argv + ["--fault-tolerant"])
    _check_failures(rep, kills, text)
    assert rep["ranks_final"] == 2
    assert "no ULFM" not in text  # the ULFM launch: no warning
    _assert_losses(rep, TINY, f"kills {kills}")
    _assert_same_as_plain(rep, TINY, f"kills {kills}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attention", ["hybrid"])
def test_ulysses_degree_replanned_after_a_kill(attention):
    """Hybrid with Ulysses degree 2 loses a rank: 3 ranks fit no degree that divides 4 heads, so
    the attention falls back to the ring, says so, and the losses stay; the app's own --verify runs
    on the lowest survivor and passes too (Ulysses' own fall-back is
    the same re-plan: test_replan_keeps_a_degree_that_fits; its kills: tests/test_nn_ft.py)."""
    rng = random.Random(f"{SEED}-{attention}")
    kill = (rng.randrange(4), rng.randrange(1, 7), rng.choice(["forward", "backward"]))
    extra = ["--attention", attention] + (["--ulysses-degree", "2"] if attention == "hybrid" else [])
    argv = TINY + extra
    rep, text = _lm(4, argv + ["--fault-tolerant", "--verify", "--kill", f"{kill[0]}:{kill[1]}:{kill[2]}"])
    _check_failures(rep, [kill], text)
    assert rep["verify"]["passed"] and rep["verify"]["max_rel_diff"] <= REL, rep["verify"]  # on the lowest survivor
    assert rep["attention_final"]["kind"] == "ring", rep["attention_final"]
    assert any("re-planned" in n for n in rep["notes"]) and "re-planned" in text
    _assert_losses(rep, argv, f"{attention} kill {kill}")


@pytest.mark.timeout(300)
def test_data_parallel_mesh_replanned_after_kills():
    """``--dp 2`` at 4 ranks (a 2 x 2 mesh, DDP on the commlib backend) loses one rank inside DDP's
    bucket all-reduce and another in an attention forward (random victims, rank 0 among the
    candidates, random steps; seeded): the survivors re-plan the mesh (2 x 2 -> 1 x 3 -> 2 x 1),
    rebuild the process group, the mesh and DDP, re-shard and redo the step, say so, and finish with
    the oracle's losses (the global batch is the same whatever the mesh)."""
    rng = random.Random(f"{SEED}-dp")
    victims = rng.sample(range(4), 2)
    kills = [(victims[0], rng.randrange(1, 4), "allreduce"), (victims[1], rng.randrange(4, 7), "forward")]
    argv = TINY + ["--dp", "2"]
    rep, text = _lm(4, argv + ["--fault-tolerant"] + [x for r, st, ph in kills for x in ("--kill", f"{r}:{st}:{ph}")])
    _check_failures(rep, kills, text)
    assert rep["mesh"] == {"dp": 2, "cp": 2} and rep["mesh_final"] == {"dp": 2, "cp": 1}, (rep["mesh_final"], SEED)
    assert [n for n in rep["notes"] if "mesh re-planned" in n] == [
        "mesh re-planned for 3 ranks: dp x cp 2 x 2 -> 1 x 3", "mesh re-planned for 2 ranks: dp x cp 1 x 3 -> 2 x 1"]
    assert "mesh re-planned" in text
    _assert_losses(rep, TINY, f"--dp 2 kills {kills}")


def test_mesh_plan_fits_the_ranks():
    """The mesh re-plan itself: the asked dp when it divides the ranks (and the batch has a row
    for each group), else the largest divisor below it."""
    from commlib.apps.lm.train import plan_mesh  # noqa: PLC0415

    assert plan_mesh(4, 2, 8) == (2, 2)
    assert plan_mesh(3, 2, 8) == (1, 3)
    assert plan_mesh(6, 4, 8) == (3, 2)
    assert plan_mesh(8, 4, 2) == (2, 4)
    assert plan_mesh(5, 1, 8) == (1, 5)


def test_replan_keeps_a_degree_that_fits():
    """The re-plan itself: the largest Ulysses degree that divides the ranks and heads."""
    assert app.plan_attention("hybrid", 4, 8, 8, 4)[:2] == ("hybrid", 4)
    kind, degree, note = app.plan_attention("hybrid", 4, 6, 8, 4)
    assert (kind, degree) == ("hybrid", 2) and "degree 2" in note
    assert app.plan_attention("ulysses", None, 3, 6, 3)[:2] == ("ulysses", None)
    assert app.plan_attention("ulysses", None, 3, 4, 2)[:2] == ("ring", None)
    assert app.plan_attention("ulysses", None, 6, 4, 2)[:2] == ("hybrid", 2)
    assert app.plan_attention("ring", None, 5, 4, 2) == ("ring", None, None)
