"""The language-model training app (``python -m commlib.apps.lm``).

Serial: ``pytest tests/test_lm_app.py`` (command line, data, the --verify path
against the single-process oracle); MPI:
``mpiexec -n N python -P -m pytest --with-mpi -m mpi tests/test_lm_app.py``
(N ranks train with each attention kind, and with ``--dp 2``'s (dp, cp) mesh
at 2 and 4 ranks, and must give the losses of the single-process oracle,
plain torch attention on whole sequences, within 1e-5 relative, over 20
float32 steps).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from commlib.apps import lm as app  # noqa: E402
from commlib.apps.lm import data  # noqa: E402

#: a tiny model: 20 steps of 2 x 48 tokens (48 divides into zigzag shards on 1-4 ranks)
TINY = ["--steps", "20", "--seq-len", "48", "--batch", "2", "--d-model", "32", "--heads", "4", "--kv-heads", "2",
        "--layers", "1", "--eval-every", "10", "--eval-batches", "1", "--threads", "1", "--quiet"]


def _clean_env():
    """The environment without the launcher's variables, so a child process
    started from an MPI rank initializes as its own singleton."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}


def _losses(rep):
    return ([s["train_loss"] for s in rep["steps"]],
            {s["step"]: s["val_loss"] for s in rep["steps"] if s["val_loss"] is not None})


# ----------------------------------------------------------------- data
@pytest.mark.timeout(60)
def test_data_is_deterministic_and_packed():
    root = data.stdlib_root()
    files = data.stdlib_files(root)
    assert files == sorted(files) and not any("site-packages" in f for f in files)
    train, val = data.split_files(files)
    assert set(train).isdisjoint(val) and len(train) + len(val) == len(files)
    assert 0.02 < len(val) / len(files) < 0.25
    a = data.TokenStream(root, train, seed=3)
    b = data.TokenStream(root, train, seed=3)
    x1, x2 = a.batch(3, 40), a.batch(3, 40)
    assert np.array_equal(x1, b.batch(3, 40)) and np.array_equal(x2, b.batch(3, 40))
    assert x1.shape == (3, 41) and x1.max() <= data.BOS
    assert np.array_equal(x1[:-1, -1], x1[1:, 0]) and x1[-1, -1] == x2[0, 0]  # rows overlap by one token
    # the stream is the files, each opened by BOS, in the seeded order
    order = np.random.default_rng([3, 0]).permutation(len(train))
    with open(os.path.join(root, train[order[0]]), "rb") as fh:
        head = np.frombuffer(fh.read(), np.uint8)[:39]
    assert x1[0, 0] == data.BOS and np.array_equal(x1[0, 1:1 + head.size], head)
    x = x1[:, :-1]
    cu = data.cu_seqlens(x)
    assert cu[0] == 0 and cu[-1] == x.size and np.all(np.diff(cu) > 0)
    assert set(np.flatnonzero(x.reshape(-1) == data.BOS)) | {0, 40, 80} == set(cu[:-1].tolist())


# ----------------------------------------------------------------- the command line
@pytest.mark.timeout(60)
def test_help_explains_options():
    res = subprocess.run([sys.executable, "-P", "-m", "commlib.apps.lm", "--help"], capture_output=True, text=True,
                         timeout=60, env=_clean_env())
    assert res.returncode == 0, res.stderr
    for opt in ("--attention", "--layout", "--ulysses-degree", "--steps", "--seq-len", "--batch", "--d-model",
                "--heads", "--kv-heads", "--layers", "--lr", "--seed", "--threads", "--device", "--dtype",
                "--verify", "--json", "--plot", "--eval-every"):
        assert opt in res.stdout


BAD_CLI = [
    ["--steps", "0"], ["--seq-len", "-8"], ["--seq-len", "x"], ["--batch", "0"], ["--d-model", "30"],
    ["--heads", "4", "--kv-heads", "3"], ["--d-model", "12", "--heads", "4"], ["--layers", "0"], ["--lr", "nan"],
    ["--lr", "0"], ["--weight-decay", "-1"], ["--warmup", "-1"], ["--clip", "nan"], ["--seed", "-1"],
    ["--threads", "0"], ["--eval-every", "0"],
    ["--attention", "tree"], ["--layout", "diagonal"], ["--dtype", "float16"], ["--device", "tpu"],
    ["--ulysses-degree", "2"], ["--attention", "hybrid", "--ulysses-degree", "0"], ["--verify-tol", "-1"],
    ["--json", "/nonexistent/x.json"], ["--plot", "/"], ["--no-such-option"],
    ["--kill", "x"], ["--kill", "1"], ["--kill", "1:0"], ["--kill", "1:99"], ["--kill", "-1:2"],
    ["--kill", "1:2:sideways"], ["--kill", "0:3:eval", "--eval-every", "10"], ["--checkpoint-every", "5"],
    ["--window", "0"], ["--window", "4", "--window-every", "0"], ["--window-every", "2"],
    ["--dp", "0"], ["--dp", "x"],
]
#: values refused for a given rank count (the launcher's, before MPI is up)
BAD_FOR_SIZE = [
    (4, ["--kill", "4:2"]),  # no rank 4 in a 4-rank job
    (4, ["--attention", "ulysses", "--heads", "6", "--kv-heads", "3", "--d-model", "48"]),
    (4, ["--attention", "hybrid", "--ulysses-degree", "3"]),
    (4, ["--attention", "hybrid", "--ulysses-degree", "4", "--heads", "2", "--kv-heads", "2"]),
    (4, ["--dp", "3", "--batch", "6"]),  # 3 does not divide 4 ranks
    (1, ["--dp", "2"]),
    (4, ["--dp", "4", "--batch", "2"]),  # a data-parallel group without a sequence
    (4, ["--dp", "2", "--attention", "ulysses", "--heads", "6", "--kv-heads", "3", "--d-model", "48"]),  # cp = 2
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size,argv", [(1, a) for a in BAD_CLI] + BAD_FOR_SIZE,
                         ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_cli_refuses_bad_values_before_running(size, argv, capsys, monkeypatch):
    """One line on stderr, exit status 2, nothing run."""
    monkeypatch.setattr(app, "run", lambda *a, **k: pytest.fail("ran despite a bad value"))
    monkeypatch.setattr(app, "world_size", lambda: size)
    monkeypatch.setattr(app, "world_rank", lambda: 0)
    monkeypatch.setattr("commlib.apps._cli.world_rank", lambda: 0)
    assert app.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lm: error: "), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["--heads", "4", "--kv-heads", "3"], ["--dp", "2"]], ids=" ".join)
def test_cli_process_exits_2_with_one_line(argv):
    """A value refused before anything runs (``--dp 2`` at one rank: the rank count checked
    after MPI is up): exit status 2, one line on stderr."""
    res = subprocess.run([sys.executable, "-P", "-m", "commlib.apps.lm", *argv],
                         capture_output=True, text=True, timeout=60, env=_clean_env())
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("lm: error: "), res.stderr
    assert res.stdout == ""


# ----------------------------------------------------------------- --verify (serial)
@pytest.mark.timeout(120)
def test_verify_against_single_process_oracle(tmp_path, capsys):
    """Ring attention over the (1-rank) communicator against plain torch SDPA on
    the whole sequences: the losses agree, --json and --plot are written."""
    comm = commlib.init()
    if comm.size != 1:
        pytest.skip("serial test")
    js, png = tmp_path / "lm.json", tmp_path / "lm.png"
    argv = TINY[:-1] + ["--steps", "10", "--eval-every", "5", "--pos", "learned", "--verify", "--json", str(js),
                        "--plot", str(png)]
    assert app.main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "PASSED" in out
    rep = json.loads(js.read_text())
    v = rep["verify"]
    assert v["passed"] and v["max_rel_diff"] <= 1e-4
    train, val = _losses(rep)
    assert len(train) == 10 and sorted(val) == [5, 10]
    assert np.isfinite(train).all() and train[-1] < train[0]  # it learns
    assert max(abs(a - b) / b for a, b in zip(train, v["oracle_train_loss"])) == pytest.approx(
        v["max_rel_diff_train"])
    assert rep["tokens_per_s"] > 0 and rep["peak_memory_bytes_per_rank"][0] > 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(120)
def test_verify_bfloat16_judges_the_first_step(monkeypatch, capsys, tmp_path):
    """bfloat16: a difference in a later loss is reported, not judged (two bf16
    trainings drift apart); one in the first step's loss fails."""
    comm = commlib.init()
    if comm.size != 1:
        pytest.skip("serial test")
    from commlib.apps.lm import train  # noqa: PLC0415

    real = train.oracle_losses
    for scale_first, code in ((1.0, 0), (1.05, 1)):
        def off(args, device=None, s=scale_first):
            t, v = real(args, device)
            return [t[0] * s] + [x * 1.05 for x in t[1:]], v

        monkeypatch.setattr(train, "oracle_losses", off)
        js = tmp_path / f"v{code}.json"
        argv = TINY[:-1] + ["--steps", "3", "--eval-every", "3", "--dtype", "bfloat16", "--verify", "--no-progress",
                            "--json", str(js)]
        assert app.main(argv) == code
        v = json.loads(js.read_text())["verify"]
        assert v["judged"] == "first step" and v["max_rel_diff_train"] > 0.04
        assert (v["first_step_rel_diff"] <= 1e-2) == (code == 0)
        assert ("PASSED" if code == 0 else "FAILED") in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_verify_failure_exits_1(monkeypatch, capsys):
    """A single-process run whose losses differ fails --verify (exit status 1)."""
    comm = commlib.init()
    if comm.size != 1:
        pytest.skip("serial test")
    from commlib.apps.lm import train  # noqa: PLC0415

    def off(args, device=None):
        t, v = real(args, device)
        return [x * 1.001 for x in t], v

    real = train.oracle_losses
    monkeypatch.setattr(train, "oracle_losses", off)
    assert app.main(TINY[:-1] + ["--steps", "2", "--eval-every", "2", "--verify", "--no-progress"]) == 1
    assert "FAILED" in capsys.readouterr().out


# ----------------------------------------------------------------- P ranks against the oracle
@pytest.fixture(scope="module")
def one_rank_losses():
    """The single-process oracle's losses (plain torch attention on whole sequences with the
    document mask: ``oracle_losses``, no commlib), (train per step, {1-based step: val}).
    Every rank computes its own copy side by side, which also warms every rank's torch up at
    once rather than one after the other."""
    from commlib.apps.lm.train import oracle_losses  # noqa: PLC0415

    train, val = oracle_losses(app.parse_args(TINY, size=1))
    return train, {s + 1: v for s, v in val.items()}


#: kind, layout, rank counts: every kind and layout at some rank count, few runs per count (CI time)
KINDS = [("ring", "zigzag", (1, 2, 3, 4)), ("bidirectional", "striped", (2, 3)), ("ulysses", "contiguous", (2, 4)),
         ("hybrid", "zigzag", (4,))]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout,sizes", KINDS, ids=lambda x: x if isinstance(x, str) else "")
def test_ranks_train_like_one_rank(one_rank_losses, kind, layout, sizes):
    comm = commlib.init()
    P = comm.size
    if P not in sizes:
        pytest.skip(f"{kind}/{layout} runs on {sizes} ranks")
    argv = TINY + ["--attention", kind, "--layout", layout]
    if kind == "hybrid":
        argv += ["--ulysses-degree", "2"]
    rep = app.run(app.parse_args(argv, size=P), comm)
    if comm.rank != 0:
        assert rep is None
        return
    assert rep["ranks"] == P and rep["sequence"]["tokens_per_rank"] == 2 * 48 // P
    assert rep["parameters_identical_across_ranks"]
    train, val = _losses(rep)
    ref_train, ref_val = one_rank_losses
    diff = max(abs(a - b) / b for a, b in zip(train, ref_train))
    diff_val = max(abs(val[s] - ref_val[s]) / ref_val[s] for s in ref_val)
    print(f"{kind}/{layout} P={P}: max rel loss diff vs the single-process oracle: train {diff:.2e}, val {diff_val:.2e}; "
          f"final train {train[-1]:.5f}")
    assert len(train) == 20 and diff <= 1e-5 and diff_val <= 1e-5


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_data_parallel_mesh_trains_like_one_rank(one_rank_losses):
    """``--dp 2``: a (2, P/2) mesh, each data-parallel group one of the batch's two sequences
    (at 4 ranks sharded over the 2 ranks of its cp group, at 2 ranks whole: cp = 1), DDP over
    the commlib backend summing the gradients over every rank: the losses of the single-process
    oracle within 1e-5, and the parameters bit-identical on every rank."""
    comm = commlib.init()
    P = comm.size
    if P not in (2, 4):
        pytest.skip("--dp 2 runs on 2 and 4 ranks")
    rep = app.run(app.parse_args(TINY + ["--dp", "2"], size=P), comm)
    if comm.rank != 0:
        assert rep is None
        return
    assert rep["mesh"] == rep["mesh_final"] == {"dp": 2, "cp": P // 2}
    assert rep["sequence"]["tokens_per_rank"] == 48 // (P // 2)  # one 48-token sequence per dp group
    assert rep["parameters_identical_across_ranks"]
    train, val = _losses(rep)
    ref_train, ref_val = one_rank_losses
    diff = max(abs(a - b) / b for a, b in zip(train, ref_train))
    diff_val = max(abs(val[s] - ref_val[s]) / ref_val[s] for s in ref_val)
    print(f"--dp 2 P={P}: max rel loss diff vs the single-process oracle: train {diff:.2e}, val {diff_val:.2e}")
    assert len(train) == 20 and diff <= 1e-5 and diff_val <= 1e-5


@pytest.mark.timeout(60)
def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    """Ctrl-C during training (one rank): exit status 130 and one line on stderr,
    no traceback and no MPI abort."""
    comm = commlib.init()
    if comm.size != 1:
        pytest.skip("serial test")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(app, "run", interrupted)
    monkeypatch.setattr(type(comm), "abort", lambda self, code=1: pytest.fail(f"abort({code}) on one rank"))
    assert app.main(TINY) == 130
    err = capsys.readouterr().err
    assert err == "lm: interrupted (rank 0)\n", err


# ----------------------------------------------------------------- --window: sliding-window layers
def test_window_mask_is_the_sliding_window():
    """The oracle's window mask, checked entry by entry from the definition:
    query i sees key j when i - W < j <= i (and the document mask allows it)."""
    from commlib.apps.lm.model import local_layers, window_mask  # noqa: PLC0415

    W, L = 3, 7
    docs = np.ones((2, 1, L, L), dtype=bool)
    docs[1, :, :, :4] = False
    got = window_mask(docs, W, L)
    for b in range(2):
        for i in range(L):
            for j in range(L):
                assert got[b, 0, i, j] == (docs[b, 0, i, j] and i - W < j <= i)
    assert window_mask(None, W, L).shape == (1, 1, L, L)
    assert local_layers(5, 4, 2) == [True, False, True, False, True]
    assert local_layers(3, None, None) == [False] * 3


#: --window runs: a local layer then a global one (window 7 tokens of 48, under a shard at 1-4 ranks)
WINDOWED = ["--layers", "2", "--window", "7", "--window-every", "2"]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout,sizes", [("ring", "contiguous", (1, 2, 4)), ("bidirectional", "zigzag", (3,)),
                                                ("ulysses", "contiguous", (2,))],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_window_ranks_train_like_one_rank(kind, layout, sizes):
    """``--window``: P ranks (the local layer a halo exchange) give the losses
    of the single-process training whose local layer is dense SDPA with the
    window mask, within 1e-5; and the window matters (those losses differ
    from global attention's)."""
    import lm_oracle  # noqa: PLC0415

    comm = commlib.init()
    P = comm.size
    if P not in sizes:
        pytest.skip(f"{kind}/{layout} --window runs on {sizes} ranks")
    argv = TINY[:TINY.index("--layers")] + TINY[TINY.index("--layers") + 2:] + WINDOWED
    rep = app.run(app.parse_args(argv + ["--attention", kind, "--layout", layout], size=P), comm)
    if comm.rank != 0:
        assert rep is None
        return
    want = lm_oracle.oracle(argv)
    lm_oracle.assert_losses(rep, want, 1e-5, f"--window {kind}/{layout} P={P}")
    if P == 1:  # the window changes the training (checked once: the oracles do not depend on P)
        glob_train, _ = lm_oracle.oracle(argv[:argv.index("--window")])
        assert max(abs(a - b) / b for a, b in zip(want[0], glob_train)) > 1e-3
