"""Checkpoints of the language-model app: save training's state, resume it exactly.

A checkpoint directory holds::

    step-00000012-0123456789ab.pt   torch.save of {format, version, step, config, state}
    step-00000010-ba9876543210.pt   the one before (``keep`` of them, default 2)
    latest.json                     the manifest: format, version, config, and
                                    checkpoints: [{file, step, sha256, bytes}, ...],
                                    the newest last

The file name carries the step and the first 12 hex digits of the file's
SHA-256, so a new file never replaces one the manifest names.

**Writing** (:func:`save_checkpoint`): the payload is written to a temporary
file in the directory (hashed with SHA-256 while it is written), flushed and
fsynced, renamed into place with :func:`os.replace`; then the manifest is
written the same way (temporary file, fsync, ``os.replace``, fsync of the
directory); only then are the checkpoints that fell out of the last ``keep``
removed.  An error at any point leaves the previous manifest and every file
it names as they were and removes what the save wrote; so does a crash, but
for its temporary file (``.tmp-*``, removed by the next save) and, when it
struck between the two renames, the new step file (named by no manifest,
never read, never removed).  **One
rank writes**: the caller picks it (the lowest surviving rank, say; every rank
holds the same replicated state); two processes saving into one directory at
once are not supported.

**Reading** (:func:`load_checkpoint`): the manifest's newest entry, its size and
SHA-256 checked, then ``torch.load(..., weights_only=True)``: tensors and plain
values only, never arbitrary pickled objects (so RNG and data positions are
stored as tensors, numbers, lists and dicts); the configuration saved
must equal the caller's.  Every rank may read the same file (a shared file
system, or one machine).

torch loads on the first save, load or RNG call: :func:`check_checkpoint_dir`
serves a command line's checks before torch loads.

Every refusal is a :class:`CheckpointError` (a :class:`commlib.InvalidArgument`)
with a one-line message: a missing or unwritable directory, no checkpoint, a
truncated or corrupted file, another configuration (the differing keys and
both values), a file holding objects ``weights_only`` refuses.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import platform
import random
import re
import secrets
from collections import OrderedDict

import numpy as np

import commlib

from .data import VOCAB

__all__ = ["CheckpointError", "MANIFEST", "CONFIG_KEYS", "save_checkpoint", "load_checkpoint",
           "check_checkpoint_dir", "latest_checkpoint", "saved_config", "training_config", "rng_state", "set_rng_state"]

#: the manifest's name in a checkpoint directory
MANIFEST = "latest.json"
#: the command-line values (``args`` attribute names) that fix the training
#: trajectory: a resume with another value of any would not reproduce the run
CONFIG_KEYS = ("steps", "seq_len", "batch", "d_model", "heads", "kv_heads", "layers", "pos", "no_doc_mask", "lr",
               "weight_decay", "warmup", "clip", "seed", "dtype")
FORMAT = "commlib.apps.lm checkpoint"
VERSION = 1
_TMP_PREFIX = ".tmp-"
_FILE_RE = re.compile(r"step-[0-9]{8,}-[0-9a-f]{12}\.pt")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_MISSING = object()


class CheckpointError(commlib.InvalidArgument):
    """A checkpoint cannot be written or read; the message is one line."""


# ------------------------------------------------------------------ configuration
def training_config(args, corpus: str) -> dict:
    """The configuration a resume must match: the :data:`CONFIG_KEYS` of the
    parsed command line ``args``, the vocabulary, the corpus digest ``corpus``
    (:func:`.data.corpus_digest` of the files) and the Python version (its
    standard library is the data), and ``--window``/``--window-every`` when a
    window is set, and ``schedule_steps`` when the learning-rate schedule
    spans other steps than ``steps`` (a run extended by a resume).  Attention kind, layout, rank count, device
    and threads are left out: a run resumes under any of them."""
    cfg = {k: getattr(args, k) for k in CONFIG_KEYS}
    span = getattr(args, "schedule_steps", None)
    if span is not None and span != args.steps:  # an extended run: the schedule's span, when it differs
        cfg["schedule_steps"] = span
    if getattr(args, "window", None) is not None:  # only when set: checkpoints of global attention still match
        cfg.update(window=args.window, window_every=args.window_every)
    cfg.update(vocab=VOCAB, corpus=corpus, python=platform.python_version())
    return cfg


def _plain_config(config) -> dict:
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise TypeError("config must be a dict with str keys")
    try:  # JSON values only, tuples read as lists: what the manifest holds
        return json.loads(json.dumps(config, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"config must hold JSON values only: {exc}") from None


def _config_diff(saved: dict, now: dict, ignore=()) -> list[str]:
    def show(v):
        return "absent" if v is _MISSING else json.dumps(v)

    out = []
    for k in sorted((set(saved) | set(now)) - set(ignore)):
        a, b = saved.get(k, _MISSING), now.get(k, _MISSING)
        if a is _MISSING or b is _MISSING or a != b:
            out.append(f"{k} {show(a)} in the checkpoint, {show(b)} in this run")
    return out


# ------------------------------------------------------------------ state checks
def _check_state(obj, where: str) -> None:
    """TypeError unless ``torch.load(weights_only=True)`` reads ``obj`` back."""
    import torch  # noqa: PLC0415

    t = type(obj)
    if t in (str, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size, torch.Tensor,
             torch.nn.Parameter):
        return
    if t in (dict, OrderedDict):
        for k, v in obj.items():
            if type(k) not in (str, int, float, bool, type(None)):
                raise TypeError(f"{where}: key {k!r} of type {type(k).__qualname__} cannot be stored")
            _check_state(v, f"{where}[{k!r}]")
        return
    if t in (list, tuple, set):
        for i, v in enumerate(obj):
            _check_state(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where}: {t.__module__}.{t.__qualname__} cannot be stored (torch.load(weights_only=True) "
                    "reads tensors, numbers, str, lists, tuples and dicts only; bytes: a uint8 tensor)")


# ------------------------------------------------------------------ files
class _HashingWriter:
    """A write-only file object that hashes and counts what passes through."""

    def __init__(self, fh):
        self.fh, self.sha256, self.bytes = fh, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha256.update(b)
        self.bytes += len(b)
        return self.fh.write(b)

    def flush(self) -> None:
        self.fh.flush()


def _create_temp(directory: str, suffix: str) -> tuple[int, str]:
    """(fd, path) of a new file in ``directory`` opened for writing, with the
    mode a plain ``open`` gives (0o666 less the umask; ``mkstemp`` gives 0o600)."""
    while True:
        path = os.path.join(directory, f"{_TMP_PREFIX}{secrets.token_hex(8)}{suffix}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), path
        except FileExistsError:
            continue


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _write_json_atomic(path: str, obj) -> None:
    directory = os.path.dirname(path)
    fd, tmp = _create_temp(directory, ".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    finally:
        _unlink_quietly(tmp)


def _read_manifest(directory: str) -> dict | None:
    """The manifest (validated), None when the directory has none."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(1 << 24)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        m = json.loads(raw)
        if m.get("format") != FORMAT:
            raise ValueError
        if m.get("version") != VERSION:
            raise CheckpointError(f"{path} is of checkpoint format version {m.get('version')!r}; this commlib "
                                  f"reads version {VERSION}")
        entries = m["checkpoints"]
        ok = isinstance(m["config"], dict) and isinstance(entries, list) and entries and all(
            isinstance(e, dict) and isinstance(e.get("file"), str) and _FILE_RE.fullmatch(e["file"])
            and type(e.get("step")) is int and e["step"] >= 1 and isinstance(e.get("sha256"), str)
            and _SHA_RE.fullmatch(e["sha256"]) and type(e.get("bytes")) is int for e in entries)
        if not ok:
            raise ValueError
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path} is corrupted (not a checkpoint manifest)") from None
    return m


def check_checkpoint_dir(directory: str, *, for_write: bool, config: dict | None = None,
                         ignore=()) -> str | None:
    """What stops ``directory`` serving as a checkpoint directory, in one line,
    or None.  Cheap: no checkpoint file is read (the manifest is).

    Args:
        directory: the folder.
        for_write: True for ``--checkpoint`` (it must exist and take a new
            file: a file is created and removed to know, which holds for root
            too); False for ``--resume`` (it must hold a checkpoint).
        config: when given, a manifest of another configuration is a problem
            too (for writing: the run would replace another run's checkpoints).
        ignore: configuration keys left out of that comparison (``("steps",)``:
            a resumed run that extends ``--steps``).
    """
    if not directory:
        return "empty checkpoint directory name"
    if not os.path.exists(directory):
        return f"checkpoint directory {directory} does not exist"
    if not os.path.isdir(directory):
        return f"checkpoint directory {directory} is not a directory"
    if for_write:
        try:
            fd, probe = _create_temp(directory, ".probe")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return f"checkpoint directory {directory} is not writable ({exc.strerror or exc})"
    try:
        m = _read_manifest(directory)
    except CheckpointError as exc:
        return exc.detail
    if m is None:
        return None if for_write else f"no checkpoint in {directory} (no {MANIFEST})"
    if config is not None:
        diff = _config_diff(m["config"], _plain_config(config), ignore)
        if diff:
            return f"checkpoint directory {directory} holds a checkpoint of another configuration: " + "; ".join(diff)
    return None


def saved_config(directory: str) -> dict | None:
    """The configuration the manifest of ``directory`` holds (the newest
    checkpoint's run), unverified; None when there is none or it cannot be read."""
    try:
        m = _read_manifest(directory)
    except CheckpointError:
        return None
    return None if m is None else m["config"]


def latest_checkpoint(directory: str) -> tuple[int, str] | None:
    """(step, path) of the newest checkpoint the manifest names, unverified;
    None when there is none or the manifest cannot be read (for a message)."""
    try:
        m = _read_manifest(directory)
    except CheckpointError:
        return None
    if m is None:
        return None
    e = m["checkpoints"][-1]
    return e["step"], os.path.join(directory, e["file"])


# ------------------------------------------------------------------ save / load
def save_checkpoint(directory: str, step: int, state: dict, config: dict, *, keep: int = 2, ignore=()) -> str:
    """Write a checkpoint of ``step`` completed steps atomically; call it on one rank.

    Args:
        directory: an existing, writable folder (see the module's layout).
        step: completed training steps, >= 1.
        state: what resumes training exactly, e.g. ``model`` and ``optimizer``
            (``state_dict()``), ``data`` (:meth:`.data.TokenStream.state_dict`),
            ``rng`` (:func:`rng_state`), losses so far; tensors, numbers, str,
            lists, tuples and dicts only (``bytes`` would not load back when
            empty: store a uint8 tensor).
        config: a dict of JSON values that a resume must match
            (:func:`training_config`).
        keep: how many checkpoints to keep (the newest ones), >= 1.
        ignore: configuration keys that may differ from the directory's
            (``("steps",)``: a resumed run that extends ``--steps``); the
            manifest then holds ``config``.

    Returns:
        str: the new checkpoint file's path.

    Raises:
        CheckpointError: the directory is missing, not writable, holds a
            checkpoint of another configuration, or a write failed (disk full,
            say); nothing written stays, the previous checkpoint is untouched.
        TypeError, ValueError: ``state``, ``config``, ``step`` or ``keep`` are
            not of the kinds above (a caller's mistake).
    """
    if type(step) is not int or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    if type(keep) is not int or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__qualname__}")
    cfg = _plain_config(config)
    _check_state(state, "state")
    problem = check_checkpoint_dir(directory, for_write=True, config=cfg, ignore=ignore)
    if problem:
        raise CheckpointError(problem + "; nothing written")
    import torch  # noqa: PLC0415

    try:
        stale = [n for n in os.listdir(directory) if n.startswith(_TMP_PREFIX) and n.endswith((".pt", ".json"))]
    except OSError:
        stale = []
    for name in stale:  # left by a writer that died in a save (one writer at a time)
        _unlink_quietly(os.path.join(directory, name))
    old = _read_manifest(directory)
    old_entries = old["checkpoints"] if old else []
    old_names = {e["file"] for e in old_entries}
    payload = dict(format=FORMAT, version=VERSION, step=step, config=cfg, state=state)
    tmp = placed = None
    try:
        fd, tmp = _create_temp(directory, ".pt")
        with os.fdopen(fd, "wb") as fh:
            w = _HashingWriter(fh)
            torch.save(payload, w)
            fh.flush()
            os.fsync(fh.fileno())
        digest = w.sha256.hexdigest()
        name = f"step-{step:08d}-{digest[:12]}.pt"
        final = os.path.join(directory, name)
        os.replace(tmp, final)  # a name the manifest holds is the same bytes (the name carries the hash)
        tmp = None
        if name not in old_names:
            placed = final  # removed again unless the manifest comes to name it
        _fsync_dir(directory)
        entry = dict(file=name, step=step, sha256=digest, bytes=w.bytes)
        kept = ([e for e in old_entries if e["step"] != step] + [entry])[-keep:]
        _write_json_atomic(os.path.join(directory, MANIFEST),
                           dict(format=FORMAT, version=VERSION, config=cfg, checkpoints=kept))
        placed = None  # the manifest names it now
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint in {directory}: {exc.strerror or exc}; "
                              "the previous checkpoint is kept") from None
    finally:
        _unlink_quietly(tmp)
        _unlink_quietly(placed)
    try:
        _fsync_dir(directory)  # the manifest's rename made durable (in place already: an error here changes nothing)
    except OSError:
        pass
    names = {e["file"] for e in kept}
    for e in old_entries:  # only files the old manifest named: never a file of the user's
        if e["file"] not in names:
            _unlink_quietly(os.path.join(directory, e["file"]))
    return final


def load_checkpoint(directory: str, config: dict, *, step: int | None = None,
                    map_location="cpu", ignore=()) -> tuple[int, dict]:
    """Read the newest checkpoint (or the kept one of ``step``) of ``directory``.

    Args:
        directory: a folder :func:`save_checkpoint` wrote.
        config: the run's configuration; it must equal the one saved.
        step: None for the newest checkpoint, else the step of a kept one.
        map_location: where the tensors go (``torch.load``'s argument).
        ignore: configuration keys that may differ (``("steps",)``: a resume
            that extends the run).

    Returns:
        (step, state): the completed steps and the ``state`` dict saved.

    Raises:
        CheckpointError: no directory, no checkpoint (of that step), a file
            missing, truncated or corrupted (size or SHA-256 differ from the
            manifest's), objects ``torch.load(weights_only=True)`` refuses, or
            another configuration (every differing key with both values).
    """
    cfg = _plain_config(config)
    problem = check_checkpoint_dir(directory, for_write=False)
    if problem:
        raise CheckpointError(problem)
    import torch  # noqa: PLC0415

    entries = _read_manifest(directory)["checkpoints"]
    if step is None:
        entry = entries[-1]
    else:
        found = [e for e in entries if e["step"] == step]
        if not found:
            raise CheckpointError(f"no checkpoint of step {step} in {directory} (kept: steps "
                                  f"{', '.join(str(e['step']) for e in entries)})")
        entry = found[-1]
    path = os.path.join(directory, entry["file"])
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} named by {MANIFEST} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    if len(raw) < entry["bytes"]:
        raise CheckpointError(f"checkpoint {path} is truncated: {len(raw)} bytes of {entry['bytes']}")
    if len(raw) != entry["bytes"] or hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupted: its SHA-256 differs from the one in {MANIFEST}")
    try:
        payload = torch.load(io.BytesIO(raw), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        what = re.search(r"GLOBAL (\S+)", str(exc))
        raise CheckpointError(f"checkpoint {path} holds "
                              f"{what.group(1) if what else 'an object'} beyond tensors and plain values; "
                              "refused (read with torch.load(weights_only=True))") from None
    except Exception as exc:  # noqa: BLE001 - a damaged archive with a matching checksum: one line
        raise CheckpointError(f"checkpoint {path} is not readable: {' '.join(str(exc).split())[:200]}") from None
    if (not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("step") != entry["step"]
            or not isinstance(payload.get("config"), dict) or not isinstance(payload.get("state"), dict)):
        raise CheckpointError(f"checkpoint {path} is not a checkpoint of this app (or not of step {entry['step']})")
    diff = _config_diff(payload["config"], cfg, ignore)
    if diff:
        raise CheckpointError(f"checkpoint {path} is of another configuration: " + "; ".join(diff))
    return payload["step"], payload["state"]


# ------------------------------------------------------------------ RNG
def rng_state() -> dict:
    """The random number generators' states, in types a checkpoint stores:
    ``torch`` (the CPU generator, uint8 tensor), ``numpy`` (the legacy global
    generator ``numpy.random``'s functions use), ``python`` (:mod:`random`)
    and, once CUDA is initialized, ``cuda`` (one uint8 tensor per device)."""
    import torch  # noqa: PLC0415

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    s = dict(torch=torch.get_rng_state(),
             numpy=dict(kind=str(kind), keys=torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos=int(pos),
                        has_gauss=int(has_gauss), gauss=float(gauss)),
             python=dict(version=int(version), state=[int(x) for x in words],
                         gauss=None if gauss_next is None else float(gauss_next)))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = [t.cpu() for t in torch.cuda.get_rng_state_all()]
    return s


def set_rng_state(s: dict) -> None:
    """Restore :func:`rng_state`'s ``s``.  CUDA states are restored on the
    devices both the state and this process have (device ``i`` from entry
    ``i``); without CUDA they are ignored.

    Raises:
        CheckpointError: ``s`` is not such a state.
    """
    import torch  # noqa: PLC0415

    try:
        torch.set_rng_state(s["torch"].to("cpu", torch.uint8))
        if "numpy" in s:
            n = s["numpy"]
            keys = np.asarray(n["keys"].cpu().numpy(), dtype=np.uint32)
            np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["gauss"])))
        if "python" in s:
            p = s["python"]
            random.setstate((int(p["version"]), tuple(int(x) for x in p["state"]), p["gauss"]))
        if "cuda" in s and torch.cuda.is_available():
            for i, t in enumerate(s["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(t.to("cpu", torch.uint8), i)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"not a random-number-generator state: {' '.join(str(exc).split())[:200]}") from None
