"""Checkpoints of the language-model app (``commlib.apps.lm.checkpoint``): serial, CPU.

Oracles: an uninterrupted training run (the resumed run's losses and
parameters must equal it bit for bit), the stream's own batches, and the
SHA-256 of every file of a checkpoint directory before and after each refusal
(nothing may change).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from commlib.apps.lm import checkpoint as ck  # noqa: E402
from commlib.apps.lm import data  # noqa: E402
from commlib.apps.lm.model import TransformerLM, dense_attention, loss_sum  # noqa: E402

CFG = dict(d_model=32, heads=4, kv_heads=2, layers=1, seq_len=16, batch=2, lr=3e-3, steps=6, seed=0)


def _files(directory) -> dict:
    """{name: SHA-256} of every file in ``directory``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as fh:
            out[name] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _small_state(k=0):
    return dict(model={"w": torch.arange(6.0).reshape(2, 3) + k}, step_losses=[1.5, 1.25], note="x",
                data=dict(epoch=0, buffer=torch.tensor([1, 256], dtype=torch.int16)))


@pytest.fixture
def saved(tmp_path):
    """A directory holding checkpoints of steps 1 and 2 (CFG)."""
    d = str(tmp_path / "ckpt")
    os.mkdir(d)
    ck.save_checkpoint(d, 1, _small_state(1), CFG)
    path = ck.save_checkpoint(d, 2, _small_state(2), CFG)
    return d, path


# ----------------------------------------------------------------- the data stream
def _tiny_corpus(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    paths = []
    for i, n in enumerate((37, 5, 80, 13)):
        p = f"f{i}.py"
        (root / p).write_bytes(bytes((i * 7 + j) % 256 for j in range(n)))
        paths.append(p)
    return str(root), paths


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [True, False])
def test_stream_state_round_trip(tmp_path, shuffle):
    root, paths = _tiny_corpus(tmp_path)
    a = data.TokenStream(root, paths, seed=5, shuffle=shuffle)
    for consumed in range(12):  # from the fresh stream on, across several epochs (135 tokens each)
        st = a.state_dict()
        f = io.BytesIO()
        torch.save(st, f)
        f.seek(0)
        b = data.TokenStream(root, paths, seed=5, shuffle=shuffle)
        b.load_state_dict(torch.load(f, weights_only=True))
        for _ in range(8):
            assert np.array_equal(a.batch(2, 9), b.batch(2, 9))
        sa, sb = a.state_dict(), b.state_dict()
        assert torch.equal(sa.pop("buffer"), sb.pop("buffer")) and sa == sb
        a.batch(1, 7 + consumed)
    assert a.state_dict()["epoch"] >= 3
    with pytest.raises(ValueError, match="seed 5 there, 6 here"):
        data.TokenStream(root, paths, seed=6, shuffle=shuffle).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="another stream"):
        data.TokenStream(root, paths[:3], seed=5, shuffle=shuffle).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="not a TokenStream state"):
        data.TokenStream(root, paths, seed=5, shuffle=shuffle).load_state_dict({"epoch": 0})


# ----------------------------------------------------------------- training resumes bit for bit
class Run:
    """A small training run whose every step consumes torch's, numpy's and
    Python's random generators (dropout, a numpy and a random factor), so a
    resume that missed any state would show in the losses."""

    def __init__(self, init_seed=CFG["seed"]):
        seed = CFG["seed"]
        torch.manual_seed(init_seed)
        self.model = TransformerLM(data.VOCAB, CFG["d_model"], CFG["heads"], CFG["kv_heads"], CFG["layers"],
                                   CFG["seq_len"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=CFG["lr"], betas=(0.9, 0.95), weight_decay=0.01,
                                     foreach=False)
        root = data.stdlib_root()
        self.stream = data.TokenStream(root, data.split_files(data.stdlib_files(root))[0], seed=seed)
        self.step = 0
        self.losses = []

    def train_step(self):
        B, L = CFG["batch"], CFG["seq_len"]
        tokens = self.stream.batch(B, L)
        x, y = torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(tokens[:, 1:].copy())
        self.opt.zero_grad(set_to_none=False)
        logits = self.model(x, torch.arange(L), lambda q, k, v: dense_attention(q, k, v))
        logits = torch.nn.functional.dropout(logits, 0.1, training=True)
        scale = 1.0 + 0.01 * float(np.random.rand()) + 0.01 * random.random()
        loss = loss_sum(logits, y) * scale / (B * L)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=False)
        for g in self.opt.param_groups:
            g["lr"] = CFG["lr"] * (self.step + 1) / CFG["steps"]  # a pure function of the step
        self.opt.step()
        self.step += 1
        self.losses.append(float(loss.detach()))

    def state(self):
        return dict(model=self.model.state_dict(), optimizer=self.opt.state_dict(), data=self.stream.state_dict(),
                    rng=ck.rng_state(), losses=list(self.losses))

    def restore(self, step, state):
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["data"])
        ck.set_rng_state(state["rng"])
        self.step, self.losses = step, list(state["losses"])


@pytest.mark.timeout(120)
def test_resume_is_bit_identical(tmp_path, seed):
    torch.set_num_threads(1)
    seed %= 1000  # the suite's seed (COMMLIB_TEST_SEED; printed with a failure) seeds the global RNGs
    print("global RNG seed", seed)
    np.random.seed(seed)
    random.seed(seed)
    rng0 = ck.rng_state()
    whole = Run()
    for _ in range(CFG["steps"]):
        whole.train_step()
    whole_end = ck.rng_state()

    ck.set_rng_state(rng0)
    first = Run()
    for _ in range(3):
        first.train_step()
    d = str(tmp_path)
    ck.save_checkpoint(d, first.step, first.state(), CFG)

    np.random.seed(seed + 1)  # everything the restore must put back, disturbed
    random.seed(seed + 1)
    second = Run(init_seed=CFG["seed"] + 1)  # other parameters, the same data
    torch.manual_seed(12345)
    step, state = ck.load_checkpoint(d, CFG)
    assert step == 3
    second.restore(step, state)
    for _ in range(CFG["steps"] - 3):
        second.train_step()
    assert second.losses == whole.losses  # bit for bit
    for (n, p), q in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(p, q), n
    end = ck.rng_state()
    ck.set_rng_state(whole_end)
    assert torch.equal(end["torch"], torch.get_rng_state()) and end["python"] == ck.rng_state()["python"]
    assert torch.equal(end["numpy"]["keys"], ck.rng_state()["numpy"]["keys"])


# ----------------------------------------------------------------- layout, keep, API
@pytest.mark.timeout(60)
def test_layout_keep_and_latest(tmp_path):
    d = str(tmp_path)
    paths = [ck.save_checkpoint(d, s, _small_state(s), CFG) for s in (1, 2)]
    (tmp_path / ".tmp-0123456789abcdef.pt").write_bytes(b"a save killed midway")
    (tmp_path / "notes.txt").write_bytes(b"the user's")
    paths.append(ck.save_checkpoint(d, 3, _small_state(3), CFG))
    assert (tmp_path / "notes.txt").read_bytes() == b"the user's"
    os.unlink(tmp_path / "notes.txt")
    names = sorted(os.listdir(d))
    assert names == sorted([ck.MANIFEST] + [os.path.basename(p) for p in paths[1:]])  # keep=2
    man = json.loads(open(os.path.join(d, ck.MANIFEST)).read())
    for e, p in zip(man["checkpoints"], paths[1:]):
        assert hashlib.sha256(open(p, "rb").read()).hexdigest() == e["sha256"] and e["bytes"] == os.path.getsize(p)
    assert ck.latest_checkpoint(d) == (3, paths[2])
    step, st = ck.load_checkpoint(d, CFG)
    assert step == 3 and torch.equal(st["model"]["w"], _small_state(3)["model"]["w"]) and st["note"] == "x"
    assert torch.equal(st["data"]["buffer"], torch.tensor([1, 256], dtype=torch.int16))
    assert st["step_losses"] == [1.5, 1.25]
    assert ck.load_checkpoint(d, CFG, step=2)[0] == 2
    with pytest.raises(ck.CheckpointError, match="no checkpoint of step 1 .*kept: steps 2, 3"):
        ck.load_checkpoint(d, CFG, step=1)
    assert ck.check_checkpoint_dir(d, for_write=True) is None and ck.check_checkpoint_dir(d, for_write=False) is None
    assert ck.check_checkpoint_dir(d, for_write=False, config=CFG) is None
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]
    umask = os.umask(0o022)
    os.umask(umask)
    assert {os.stat(os.path.join(d, n)).st_mode & 0o777 for n in names} == {0o666 & ~umask}
    assert issubclass(ck.CheckpointError, commlib.InvalidArgument)


@pytest.mark.timeout(60)
def test_directory_checks_do_not_load_torch(tmp_path):
    code = ("import sys; from commlib.apps.lm import checkpoint as ck; "
            "print(ck.check_checkpoint_dir(sys.argv[1], for_write=False), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code, str(tmp_path)], capture_output=True, text=True,
                         timeout=50)
    assert out.stdout.split("\n")[0] == f"no checkpoint in {tmp_path} (no latest.json) False", out.stderr


@pytest.mark.timeout(60)
def test_training_config():
    from commlib.apps import lm as app

    a = app.parse_args(["--steps", "7"], size=1)
    cfg = ck.training_config(a, "abc")
    assert cfg["steps"] == 7 and cfg["corpus"] == "abc" and cfg["vocab"] == data.VOCAB
    assert set(ck.CONFIG_KEYS) <= set(cfg) and "attention" not in cfg
    json.dumps(cfg)


# ----------------------------------------------------------------- refusals: nothing changes
def _refused(d, call, match):
    before = _files(d) if os.path.isdir(d) else None
    with pytest.raises(ck.CheckpointError, match=match) as exc:
        call()
    assert "\n" not in str(exc.value)
    if before is not None:
        assert _files(d) == before
    return str(exc.value)


@pytest.mark.timeout(60)
def test_other_configuration(saved):
    d, _ = saved
    other = dict(CFG, heads=8, layers=2)
    other.pop("seed")
    msg = _refused(d, lambda: ck.load_checkpoint(d, other), "another configuration")
    assert "heads 4 in the checkpoint, 8 in this run" in msg and "layers 1 in the checkpoint, 2 in this run" in msg
    assert "seed 0 in the checkpoint, absent in this run" in msg and "lr" not in msg
    _refused(d, lambda: ck.save_checkpoint(d, 3, _small_state(), other), "another configuration.*nothing written")
    assert "heads 4" in ck.check_checkpoint_dir(d, for_write=True, config=other)


@pytest.mark.timeout(60)
def test_a_longer_run_may_resume_and_nothing_else_may_differ(saved):
    """ignore=("steps", "schedule_steps") (a resume that extends --steps): the checkpoint loads and
    the next save goes in with the new configuration; any other difference is still refused, by
    load and save alike, and names only that key."""
    d, _ = saved
    extend = ("steps", "schedule_steps")
    longer = dict(CFG, steps=9, schedule_steps=6)
    assert ck.load_checkpoint(d, longer, ignore=extend)[0] == 2
    other = dict(longer, lr=1e-3)
    msg = _refused(d, lambda: ck.load_checkpoint(d, other, ignore=extend), "another configuration")
    assert "lr 0.003 in the checkpoint, 0.001 in this run" in msg and "steps " not in msg, msg
    _refused(d, lambda: ck.save_checkpoint(d, 3, _small_state(), other, ignore=extend),
             "another configuration.*nothing written")
    _refused(d, lambda: ck.load_checkpoint(d, longer), "steps 6 in the checkpoint, 9 in this run")  # no ignore
    ck.save_checkpoint(d, 3, _small_state(3), longer, ignore=extend)
    with open(os.path.join(d, ck.MANIFEST)) as fh:
        assert json.load(fh)["config"]["steps"] == 9


@pytest.mark.timeout(60)
def test_truncated_and_flipped(saved):
    d, path = saved
    raw = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(raw[:len(raw) // 2])
    _refused(d, lambda: ck.load_checkpoint(d, CFG),
             re.escape(f"{path} is truncated: {len(raw) // 2} bytes of {len(raw)}"))
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 0x10
    with open(path, "wb") as fh:
        fh.write(flipped)
    _refused(d, lambda: ck.load_checkpoint(d, CFG), "corrupted: its SHA-256 differs")
    assert ck.load_checkpoint(d, CFG, step=1)[0] == 1  # the previous one is still whole
    os.unlink(path)
    _refused(d, lambda: ck.load_checkpoint(d, CFG), "named by latest.json is missing")
    with open(os.path.join(d, ck.MANIFEST), "w") as fh:
        fh.write('{"format": "commlib.apps.lm checkpoint", "version": 1, "checkpoints": [{"file": "../x"}]}')
    _refused(d, lambda: ck.load_checkpoint(d, CFG), "not a checkpoint manifest")
    _refused(d, lambda: ck.save_checkpoint(d, 3, _small_state(), CFG), "not a checkpoint manifest")


@pytest.mark.timeout(60)
def test_missing_empty_and_not_a_directory(tmp_path):
    missing = str(tmp_path / "nope")
    _refused(missing, lambda: ck.load_checkpoint(missing, CFG), "does not exist")
    _refused(missing, lambda: ck.save_checkpoint(missing, 1, _small_state(), CFG), "does not exist")
    assert not os.path.exists(missing)
    _refused(str(tmp_path), lambda: ck.load_checkpoint(str(tmp_path), CFG), "no checkpoint in .*no latest.json")
    assert ck.check_checkpoint_dir(str(tmp_path), for_write=True) is None
    f = tmp_path / "file"
    f.write_bytes(b"keep")
    _refused(str(f), lambda: ck.save_checkpoint(str(f), 1, _small_state(), CFG), "is not a directory")
    under = str(f / "sub")
    _refused(under, lambda: ck.save_checkpoint(under, 1, _small_state(), CFG), "does not exist")
    assert f.read_bytes() == b"keep" and sorted(os.listdir(tmp_path)) == ["file"]


_UNWRITABLE = r"""
import hashlib, os, sys
from commlib.apps.lm import checkpoint as ck
d = sys.argv[1]
cfg = dict(d_model=32, heads=4, kv_heads=2, layers=1, seq_len=16, batch=2, lr=3e-3, steps=6, seed=0)
print(ck.check_checkpoint_dir(d, for_write=True))
try:
    ck.save_checkpoint(d, 3, {"x": 1}, cfg)
except ck.CheckpointError as exc:
    print("refused:", exc)
print("loaded", ck.load_checkpoint(d, cfg)[0])
"""


@pytest.mark.timeout(120)
def test_unwritable_directory():
    d = tempfile.mkdtemp(prefix="commlib-ckpt-")  # under /tmp: an unprivileged child can reach it
    try:
        ck.save_checkpoint(d, 2, _small_state(2), CFG)
        before = _files(d)
        child = dict(capture_output=True, text=True, timeout=100)
        if os.geteuid() == 0:  # root writes through the mode bits: check as an unprivileged user
            child.update(user=65534, cwd="/")
            try:
                probe = subprocess.run([sys.executable, "-P", "-c", "import commlib.apps.lm.checkpoint"], **child)
            except (OSError, subprocess.SubprocessError) as exc:
                pytest.skip(f"running as root, and a child as uid 65534 cannot start ({exc})")
            if probe.returncode:
                pytest.skip(f"running as root, and uid 65534 cannot import commlib: {probe.stderr.splitlines()[-1]}")
        os.chmod(d, 0o555)
        try:
            out = subprocess.run([sys.executable, "-P", "-c", _UNWRITABLE, d], **child)
        finally:
            os.chmod(d, 0o755)
        lines = out.stdout.splitlines()
        assert out.returncode == 0, out.stderr
        assert lines[0] == f"checkpoint directory {d} is not writable (Permission denied)"
        assert lines[1].startswith("refused: ") and "not writable" in lines[1] and "nothing written" in lines[1]
        assert lines[2] == "loaded 2"  # reading needs no write access
        assert _files(d) == before
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------- failing saves leave the previous one
@pytest.mark.timeout(60)
def test_save_failing_midway(saved, monkeypatch):
    d, _ = saved
    before = _files(d)
    real_save = torch.save

    def half_then_fail(obj, f, *a, **k):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[:100])
        raise RuntimeError("disk vanished")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(RuntimeError, match="disk vanished"):
        ck.save_checkpoint(d, 3, _small_state(3), CFG)
    assert _files(d) == before
    monkeypatch.setattr(torch, "save", real_save)

    def no_space(path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "_write_json_atomic", no_space)  # the step file is in place, the manifest fails
    _refused(d, lambda: ck.save_checkpoint(d, 3, _small_state(3), CFG), "No space left on device.*previous .* kept")
    assert _files(d) == before
    assert ck.load_checkpoint(d, CFG)[0] == 2


@pytest.mark.timeout(60)
def test_unstorable_state_is_refused_before_writing(saved):
    d, _ = saved
    before = _files(d)
    with pytest.raises(TypeError, match=r"state\['rng'\]\['numpy'\]: numpy.ndarray cannot be stored"):
        ck.save_checkpoint(d, 3, {"rng": {"numpy": np.zeros(3)}}, CFG)
    with pytest.raises(TypeError, match="bytes.*uint8 tensor"):
        ck.save_checkpoint(d, 3, {"data": b""}, CFG)
    with pytest.raises(TypeError, match="JSON"):
        ck.save_checkpoint(d, 3, {}, dict(CFG, f=np.float32(1)))
    with pytest.raises(ValueError, match="step"):
        ck.save_checkpoint(d, 0, {}, CFG)
    assert _files(d) == before


# ----------------------------------------------------------------- weights_only
class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.timeout(60)
def test_weights_only(saved, monkeypatch, tmp_path):
    d, path = saved
    calls = []
    real_load = torch.load

    def spy(*a, **k):
        calls.append(k.get("weights_only"))
        return real_load(*a, **k)

    monkeypatch.setattr(torch, "load", spy)
    assert ck.load_checkpoint(d, CFG)[0] == 2 and calls == [True]
    monkeypatch.setattr(torch, "load", real_load)

    # a file holding a pickled object whose unpickling would run code, with a matching manifest entry
    marker = str(tmp_path / "pwned")
    buf = io.BytesIO()
    torch.save(dict(format=ck.FORMAT, version=ck.VERSION, step=2, config=CFG, state={"x": Evil(marker)}), buf)
    raw = buf.getvalue()
    with open(path, "wb") as fh:
        fh.write(raw)
    man_path = os.path.join(d, ck.MANIFEST)
    man = json.loads(open(man_path).read())
    man["checkpoints"][-1].update(sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw))
    with open(man_path, "w") as fh:
        json.dump(man, fh)
    _refused(d, lambda: ck.load_checkpoint(d, CFG), r"holds (builtins|io)\.open beyond tensors .*weights_only=True")
    assert not os.path.exists(marker)


@pytest.mark.timeout(60)
def test_rng_state_round_trip():
    s = ck.rng_state()
    f = io.BytesIO()
    torch.save(s, f)
    f.seek(0)
    a = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    ck.set_rng_state(torch.load(f, weights_only=True))
    b = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    with pytest.raises(ck.CheckpointError, match="not a random-number-generator state"):
        ck.set_rng_state({"numpy": {}})
