"""Checkpoint and resume of ``python -m commlib.apps.lm`` on any rank count, and bad checkpoints.

- a run with ``--checkpoint`` loses a rank (``--kill``, no fault tolerance: the job
  ends as any MPI job does), and ``--resume`` on another rank count finishes with
  the losses of the single-process oracle this test computes (every step: the
  ones loaded from the checkpoint and the ones trained after the resume);
- without ULFM (MPICH, or ``COMMLIB_FT_MODE=timeout``: bounded waits, no shrink) every
  survivor exits within ``COMMLIB_TIMEOUT`` + grace with one line naming the last
  checkpoint and the resume command, and that command works;
- a checkpoint of another model configuration, a truncated or corrupted file, a
  missing folder or one that is a file: one line, exit status 2 on every rank,
  every file of the folder unchanged.

The victims and steps come from the suite's seed (tests/seeds.py), printed with every
failure (``COMMLIB_TEST_SEED`` sets it; a fixed default otherwise).
"""
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mpi4py  # noqa: E402

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from commlib.apps import lm as app  # noqa: E402
from launch import FINALIZE_TIMEOUT, FT_ARGS, run_job  # noqa: E402 - tests/launch.py
from lm_oracle import assert_losses, oracle  # noqa: E402 - tests/lm_oracle.py
from seeds import test_seed  # noqa: E402 - tests/seeds.py

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
OPEN_MPI = "Open MPI" in MPI.Get_library_version()
SEED = test_seed()
TINY = ["--steps", "6", "--seq-len", "61", "--batch", "2", "--d-model", "32", "--heads", "4", "--kv-heads", "2",
        "--layers", "1", "--eval-every", "3", "--eval-batches", "1", "--quiet"]
REL = 1e-4


def _env(**extra):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    env.setdefault("COMMLIB_FINALIZE_TIMEOUT", FINALIZE_TIMEOUT)
    return env


def _job(n, args, mpiargs=(), env=None, timeout=150):
    """(returncode, output, output) of an mpiexec job of the app (stdout and stderr together)."""
    cmd = [MPIEXEC, *([] if not OPEN_MPI else ["--oversubscribe"]), *mpiargs, "-n", str(n), sys.executable, "-P",
           "-m", "commlib.apps.lm", *args]
    rc, text = run_job(cmd, env or _env(), timeout, started=lambda t: "lm" in t)
    if rc is None:
        pytest.fail(f"lm did not finish within {timeout} s (seed {SEED}): {' '.join(cmd)}")
    return rc, text, text


def _oracle():
    return oracle(TINY)


def _assert_oracle(rep, expected, what):
    assert_losses(rep, expected, REL, f"{what} (seed {SEED})")


def _digest(folder):
    return {f: hashlib.sha256(Path(folder, f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}


@pytest.mark.timeout(400)
def test_checkpoint_kill_resume_on_other_rank_counts(tmp_path):
    """4 ranks checkpoint every 2 steps; a random rank dies in step 4-6 (no fault tolerance:
    the job ends); the run resumes on 3 ranks and finishes with the oracle's losses, the steps
    before the resume included (the resume on 2 ranks: the no-ULFM test below)."""
    rng = random.Random(SEED)
    victim, step = rng.randrange(4), rng.randrange(4, 7)
    ck = tmp_path / "ck"
    ck.mkdir()
    rc, out, err = _job(4, TINY + ["--checkpoint", str(ck), "--checkpoint-every", "2", "--kill", f"{victim}:{step}"])
    assert rc != 0, (SEED, err[-2000:])
    saved = json.loads((ck / "latest.json").read_text())["checkpoints"][-1]["step"]
    assert saved == 2 * ((step - 1) // 2), (SEED, victim, step, saved)
    oracle = _oracle()
    for n in (3,):
        d = tmp_path / f"ck{n}"
        d.mkdir()
        for f in ck.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        js = tmp_path / f"resumed{n}.json"
        rc, out, err = _job(n, TINY + ["--checkpoint", str(d), "--resume", str(d), "--json", str(js)])
        assert rc == 0, (SEED, n, err[-3000:])
        rep = json.loads(js.read_text())
        assert rep["resumed_from_step"] == saved and rep["ranks"] == n
        assert {k: rep["resumed"][k] for k in ("from_step", "ranks_then", "ranks_now")} == dict(
            from_step=saved, ranks_then=4, ranks_now=n), rep["resumed"]
        assert rep["resumed"]["extension"] is None
        _assert_oracle(rep, oracle, f"resumed on {n} ranks from step {saved} (victim {victim} in step {step})")
        assert json.loads((d / "latest.json").read_text())["checkpoints"][-1]["step"] == 6


#: a launcher that lets the survivors run on after a rank's death: Open MPI's ULFM launch line (the
#: app is told COMMLIB_FT_MODE=timeout: no shrink), MPICH's hydra without its clean-up
NO_CLEANUP = FT_ARGS if OPEN_MPI else ["-disable-auto-cleanup"]


@pytest.mark.timeout(300)
def test_without_ulfm_every_survivor_names_the_checkpoint(tmp_path):
    """Timeout mode (no ULFM: COMMLIB_FT_MODE=timeout): a rank dies in the backward of step 4;
    every survivor exits within COMMLIB_TIMEOUT + grace of the death with one line naming the
    last checkpoint (step 2) and the resume command, which then finishes the run on 2 ranks."""
    ck = tmp_path / "ck"
    ck.mkdir()
    t = 4
    env = _env(COMMLIB_FT_MODE="timeout", COMMLIB_TIMEOUT=str(t))
    rc, out, err = _job(3, TINY + ["--checkpoint", str(ck), "--checkpoint-every", "2", "--kill", "1:4:backward"],
                        mpiargs=NO_CLEANUP, env=env, timeout=120)
    # the ranks' lines arrive through the launcher's one pipe, and MPICH's hydra may splice two
    # of them into one line: read them as a text, not as lines
    said = re.findall(r"lm: rank (\d+): a rank failed and this MPI cannot survive it \(.*?\); last checkpoint: "
                      r"step (\d+) in ", err)
    assert sorted(int(r) for r, _ in said) == [0, 2] and {s for _, s in said} == {"2"}, err[-3000:]
    killed = float(re.search(r"dies in step 4 \(backward\) at t=([0-9.]+)", err).group(1))
    assert time.time() - killed < t + 2 + 10, "survivors took longer than the timeout + grace (+ start-up slack)"
    m = re.search(r"resume on any rank count N with: (mpiexec -n N .*? --resume " + re.escape(str(ck)) + ")", err)
    assert m, err[-3000:]
    cmd = m.group(1).split()
    assert "--resume" in cmd and "--kill" not in cmd
    js = tmp_path / "r.json"
    rc, out, err = _job(2, cmd[7:] + ["--json", str(js)])  # what follows python -P -m commlib.apps.lm
    assert rc == 0, err[-3000:]
    _assert_oracle(json.loads(js.read_text()), _oracle(), "resumed after a timeout-mode failure")


def _singleton_env():
    """The environment of a process that runs alone (no launcher's variables: an MPI singleton)."""
    return {k: v for k, v in _env().items() if not k.startswith(("OMPI_COMM", "PMIX_", "PRTE_", "PMI_"))}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A folder with the checkpoints of a 1-process run (steps 4 and 6)."""
    d = tmp_path_factory.mktemp("ck")
    res = subprocess.run([sys.executable, "-P", "-m", "commlib.apps.lm", *TINY, "--checkpoint", str(d),
                          "--checkpoint-every", "4"], capture_output=True, text=True, timeout=120,
                         env=_singleton_env())
    assert res.returncode == 0, res.stderr[-2000:]
    return d


def _corrupt(kind, folder):
    newest = json.loads((folder / "latest.json").read_text())["checkpoints"][-1]["file"]
    p = folder / newest
    data = bytearray(p.read_bytes())
    if kind == "truncated":
        p.write_bytes(bytes(data[: len(data) // 2]))
    elif kind == "flipped":
        data[len(data) // 2] ^= 0x40
        p.write_bytes(bytes(data))


BAD = [
    ("other-config", ["--d-model", "16"], "d_model"),
    ("truncated", [], "truncated"),
    ("flipped", [], "sha"),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,extra,word", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint_refused_on_every_rank(kind, extra, word, checkpoint_dir, tmp_path):
    """Resume from a checkpoint of another configuration (2 ranks), or a damaged one (1 process:
    the same agreement path): exit status 2, one 'lm: error:' line, every file unchanged."""
    d = tmp_path / "ck"
    d.mkdir()
    for f in checkpoint_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    _corrupt(kind, d)
    before = _digest(d)
    args = [a for a in TINY] + extra + ["--resume", str(d), "--checkpoint", str(d)]
    if kind == "other-config":
        rc, out, err = _job(2, args)
    else:
        res = subprocess.run([sys.executable, "-P", "-m", "commlib.apps.lm", *args], capture_output=True, text=True,
                             timeout=120, env=_singleton_env())
        rc, err = res.returncode, res.stdout + res.stderr
    assert rc == 2, (kind, err[-2000:])
    errors = [ln for ln in err.splitlines() if ln.startswith("lm: error:")]
    assert len(errors) == 1 and word in errors[0].lower(), (kind, err[-2000:])
    assert _digest(d) == before, f"{kind}: the folder changed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["missing-resume", "under-a-file", "file", "empty-resume", "occupied"])
def test_bad_checkpoint_folder_refused_before_running(case, checkpoint_dir, tmp_path, capsys, monkeypatch):
    """--resume from a missing or empty folder, --checkpoint where no folder can be made (under a
    file) or at a file, or into a folder holding another run's checkpoints: one line, exit 2,
    nothing run."""
    monkeypatch.setattr(app, "run", lambda *a, **k: pytest.fail("ran despite a bad folder"))
    monkeypatch.setattr(app, "world_size", lambda: 2)
    monkeypatch.setattr(app, "world_rank", lambda: 0)
    monkeypatch.setattr("commlib.apps._cli.world_rank", lambda: 0)
    f = tmp_path / "plain-file"
    f.write_text("x")
    argv = {"missing-resume": ["--resume", str(tmp_path / "nope")], "under-a-file": ["--checkpoint", str(f / "sub")],
            "file": ["--checkpoint", str(f)],
            "empty-resume": ["--resume", str(tmp_path)], "occupied": ["--checkpoint", str(checkpoint_dir)]}[case]
    before = _digest(checkpoint_dir)
    assert app.main(TINY + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lm: error: "), err
    assert _digest(checkpoint_dir) == before


@pytest.mark.timeout(60)
def test_missing_checkpoint_folder_is_made(tmp_path):
    d = tmp_path / "runs" / "lm"
    app.parse_args(TINY + ["--checkpoint", str(d)], size=1)
    assert d.is_dir() and not any(d.iterdir())


@pytest.mark.timeout(120)
def test_resume_of_a_finished_run_reports_and_exits_0(checkpoint_dir, tmp_path):
    """--resume of a checkpoint at the run's last step: the finished run's report, exit 0."""
    out = tmp_path / "r.json"
    before = _digest(checkpoint_dir)
    res = subprocess.run([sys.executable, "-P", "-m", "commlib.apps.lm", *TINY, "--resume", str(checkpoint_dir),
                          "--json", str(out)], capture_output=True, text=True, timeout=100, env=_singleton_env())
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["resumed_from_step"] == 6 and rep["tokens_per_s"] is None and len(rep["steps"]) == 6
    assert _digest(checkpoint_dir) == before



def _singleton(args, timeout=100):
    res = subprocess.run([sys.executable, "-P", "-m", "commlib.apps.lm", *args], capture_output=True, text=True,
                         timeout=timeout, env=_singleton_env())
    return res.returncode, res.stdout, res.stderr


def _lr_of_tiny(step0: int) -> float:
    """TINY's learning rate at 0-based step ``step0`` of a 6-step run extended: --lr 3e-3, warmup 10
    (longer than the 6 steps: the rate rises by 3e-4 a step), then kept at step 6's rate."""
    return 3e-3 * (min(step0, 5) + 1) / 10


@pytest.mark.timeout(150)
def test_resume_extends_the_run_and_says_how_the_schedule_goes_on(checkpoint_dir, tmp_path):
    """--resume with --steps 9 from a 6-step checkpoint (1 process): one line on how the schedule
    continues, the report's resumed block, the learning rates of every step, and the losses of a
    single-process training of 9 steps on that schedule (the first 6 equal to the 6-step run's).
    The run is given --fault-tolerant in a launch without ULFM (a process of its own): one warning
    line at the start names Open MPI's ULFM launch line, and the run goes on."""
    d = tmp_path / "ck"
    shutil.copytree(checkpoint_dir, d)
    out = tmp_path / "r.json"
    argv = [a for a in TINY]
    argv[argv.index("--steps") + 1] = "9"
    rc, _, err = _singleton(argv + ["--checkpoint", str(d), "--resume", str(d), "--json", str(out),
                                    "--fault-tolerant"])
    assert rc == 0, err[-2000:]
    warned = [ln for ln in err.splitlines() if "--fault-tolerant, but this launch has no ULFM" in ln]
    assert len(warned) == 1, err[-2000:]
    assert "mpiexec --with-ft ulfm --mca btl tcp,self --mca btl_tcp_flags send,inplace,need-ack,need-csum" in warned[0]
    said = [ln for ln in err.splitlines() if "run extended from 6 to 9 steps" in ln]
    assert len(said) == 1 and "steps 7-9 run at its last rate, 0.0018" in said[0], err[-2000:]
    rep = json.loads(out.read_text())
    r = rep["resumed"]
    assert (r["from_step"], r["ranks_then"], r["ranks_now"], r["steps_then"], r["schedule_steps"]) == (6, 1, 1, 6, 6)
    assert [s["lr"] for s in rep["steps"]] == pytest.approx([_lr_of_tiny(s) for s in range(9)], rel=1e-12)
    ref = app.parse_args(argv, size=1)
    ref.schedule_steps = 6  # the oracle trains 9 steps on the first run's schedule
    from commlib.apps.lm.train import oracle_losses  # noqa: PLC0415

    o_train, o_val = oracle_losses(ref)
    _assert_oracle(rep, (o_train, {s + 1: v for s, v in o_val.items()}), "extended from 6 to 9 steps")
    assert o_train[:6] == pytest.approx(_oracle()[0], rel=1e-12)
    m = json.loads((d / "latest.json").read_text())
    assert m["checkpoints"][-1]["step"] == 9 and m["config"]["steps"] == 9 and m["config"]["schedule_steps"] == 6


@pytest.mark.timeout(60)
def test_resume_may_not_shorten_the_run(checkpoint_dir, capsys, monkeypatch):
    monkeypatch.setattr(app, "run", lambda *a, **k: pytest.fail("ran a shortened run"))
    monkeypatch.setattr("commlib.apps._cli.world_rank", lambda: 0)
    argv = [a for a in TINY]
    argv[argv.index("--steps") + 1] = "5"
    assert app.main(argv + ["--resume", str(checkpoint_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps 5: the checkpoint's run has 6 steps" in err, err
