"""Elastic DiLoCo training: ``python -m commlib.apps.diloco``.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", arXiv 2311.08455) on scikit-learn's digits (8x8 images, 10
classes, 1797 samples; ships with scikit-learn, no download), with peers that
join and leave while it runs (``commlib.elastic``).

Every peer holds the same *global* parameters ``theta`` (one flat float32
vector of the MLP's weights and biases). An outer step ``t``:

1. ``peer.update_topology()`` at the step boundary admits pending peers; when
   the membership epoch changed since the last step (a join, a death, a leave),
   every peer calls ``peer.sync_shared_state(state, revision=t)``: a joiner
   receives ``theta``, the outer momentum, ``t`` and the run's history from a
   donor; peers already in sync receive 0 bytes.
2. Inner steps: the peer loads ``theta`` into its local ``MLPClassifier`` and
   runs ``--inner-steps`` (H) ``partial_fit`` calls (Adam, the inner optimizer,
   whose moments stay local as in the paper) on minibatches of its own shard
   of the training set: shard ``r`` of ``P`` is every ``P``-th sample of a
   fixed permutation, recomputed from the current rank and size, so the data
   are re-sharded whenever membership changes.  Before the first outer step
   every member takes rank 0's initial ``theta`` (``peer.bcast``).
3. Outer step: pseudo-gradient ``delta = theta - theta_local`` (float32),
   ``peer.allreduce(delta, op="avg", quantize=...)`` (bit-identical on every
   peer; a peer that dies mid-operation is dropped and the average is retried
   over the survivors), then Nesterov momentum, the outer optimizer of the
   paper (lr 0.7, momentum 0.9), the same float32 ufuncs on every peer::

       m     = mu * m + delta
       theta = theta - lr * (delta + mu * m)

   so ``theta`` stays bit-identical everywhere without another exchange.
4. Held-out accuracy of ``theta`` on a fixed stratified 25 % test split.

The shared state is ``{"theta", "momentum", "step", "acc", "peers", "epoch",
"config"}`` (``acc``, ``peers``, ``epoch``: per outer step, so any surviving
peer can report and plot the whole run; ``config``: the job's flags as JSON
bytes); its revision is the outer step count. Every peer of one job must run
with the same job flags (--outer-steps, --inner-steps, --batch, --hidden,
--inner-lr, --outer-lr, --outer-momentum, --quantize, --seed): a peer whose
flags differ from the job's is refused by the master before admission (the
flags travel as ``connect(job=...)``; the job's peers see nothing of it), by
name (``diloco: error: this peer's flags differ from the job's: --hidden 32
here, 64 in the job ...``, exit status 2); the job goes on without it.  (A peer
connected with no job, through the library, is refused the same way at its
first sync, before its first outer step.)

Peers end when the shared step count reaches ``--outer-steps`` (all at the
same boundary), or leave gracefully (``peer.close()`` at a step boundary)
after ``--leave-after`` of their own outer steps or on SIGTERM.

Examples::

    commlib master --bind 127.0.0.1:29500 --secret-file secret &
    python -P -m commlib.apps.diloco --master 127.0.0.1:29500 --secret-file secret \\
        --min-peers 2 --json peer0.json --plot peer0.png &
    python -P -m commlib.apps.diloco --master 127.0.0.1:29500 --secret-file secret

    python jobs/elastic/launch_local.py --peers 3 --churn "8:kill:1,12:join" -- --quantize int8
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import sys
import time
import warnings

import numpy as np

from commlib.core.config import config  # light (the standard library only), unlike commlib.elastic

QUANTIZE = ("none", "fp16", "int8")
MAX_STREAMS = 64  # commlib.elastic.connect's limit on TCP connections per peer pair
NUM_CLASSES = 10
TEST_FRACTION = 0.25
SPLIT_SEED = 0  # the held-out split is fixed, whatever --seed is
#: the keyword arguments of :func:`run` that define a job (shared by every peer), with their flags
JOB_FLAGS = {"outer_steps": "--outer-steps", "inner_steps": "--inner-steps", "batch": "--batch",
             "hidden": "--hidden", "inner_lr": "--inner-lr", "outer_lr": "--outer-lr",
             "momentum": "--outer-momentum", "quantize": "--quantize", "seed": "--seed"}


# ----------------------------------------------------------------- the math
def outer_step(theta: np.ndarray, momentum: np.ndarray, delta: np.ndarray, lr: float, mu: float) -> None:
    """Nesterov outer update, in place (DiLoCo's outer optimizer; PyTorch SGD with nesterov=True).

    ``momentum = mu * momentum + delta``; ``theta -= lr * (delta + mu * momentum)``.

    Args:
        theta: global parameters, float32 (D,), updated in place.
        momentum: outer momentum buffer, float32 (D,), updated in place.
        delta: the averaged pseudo-gradient (global minus local parameters), float32 (D,).
        lr: outer learning rate; mu: momentum coefficient.

    Only elementwise float32 ufuncs, one rounding each and no fused multiply-add, so peers
    with bit-identical inputs end with bit-identical outputs on any machine.
    """
    dt = theta.dtype
    lr32, mu32 = dt.type(lr), dt.type(mu)
    np.multiply(momentum, mu32, out=momentum)
    np.add(momentum, delta, out=momentum)
    step = np.multiply(momentum, mu32)
    np.add(step, delta, out=step)
    np.multiply(step, lr32, out=step)
    np.subtract(theta, step, out=theta)


def shard_indices(n: int, rank: int, size: int, seed: int) -> np.ndarray:
    """Training-sample indices of shard ``rank`` of ``size``: every ``size``-th entry of a fixed permutation."""
    perm = np.random.default_rng([seed, 0xD1]).permutation(n)
    return np.sort(perm[rank::size])


def layer_shapes(n_features: int, hidden: tuple[int, ...], n_out: int) -> list[tuple[tuple[int, int], tuple[int]]]:
    """(coef shape, intercept shape) per layer, as ``MLPClassifier.coefs_`` / ``intercepts_`` hold them."""
    sizes = [n_features, *hidden, n_out]
    return [((a, b), (b,)) for a, b in zip(sizes[:-1], sizes[1:])]


def init_params(shapes, seed: int) -> np.ndarray:
    """Initial global parameters, flat float32: Glorot-uniform weights (scikit-learn's MLP
    initialization), zero biases, from numpy's platform-independent generator, so every
    peer starts from the same bits whatever its BLAS."""
    rng = np.random.default_rng([seed, 0x1417])
    parts = []
    for i, (cs, bs) in enumerate(shapes):
        factor = 2.0 if i == len(shapes) - 1 else 6.0  # sklearn: 2 for a logistic output, 6 otherwise
        bound = math.sqrt(factor / (cs[0] + cs[1]))
        parts.append(rng.uniform(-bound, bound, cs).astype(np.float32).ravel())
        parts.append(np.zeros(bs, np.float32))
    return np.concatenate(parts)


def n_params(shapes) -> int:
    return sum(a * b + b for (a, b), _ in shapes)


def load_into(model, flat: np.ndarray) -> None:
    """Write a flat parameter vector into ``model.coefs_`` / ``intercepts_`` in place (the
    Adam optimizer holds references to those arrays)."""
    off = 0
    for c, b in zip(model.coefs_, model.intercepts_):
        c[...] = flat[off:off + c.size].reshape(c.shape)
        off += c.size
        b[...] = flat[off:off + b.size]
        off += b.size


def flatten(model) -> np.ndarray:
    parts = []
    for c, b in zip(model.coefs_, model.intercepts_):
        parts += [c.ravel(), b.ravel()]
    return np.concatenate(parts).astype(np.float32, copy=False)


def ring_allreduce_bytes(nbytes: int, size: int, quantize: str | None) -> int:
    """Estimated payload bytes one peer sends in a ring all-reduce of ``nbytes`` float32 bytes
    (reduce-scatter + all-gather: ``2 (P-1)/P`` of the buffer), with fp16 halving and int8
    quartering the element bytes (per-chunk scales left out); headers left out."""
    if size <= 1:
        return 0
    per = {None: 1.0, "fp16": 0.5, "int8": 0.25}[quantize]
    return int(round(2 * (size - 1) / size * nbytes * per))


# ----------------------------------------------------------------- data
def load_data(seed: int = 0):
    """Digits as float32 in [0, 1]; a fixed stratified split (25 % held out)."""
    from sklearn.datasets import load_digits  # noqa: PLC0415
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    return train_test_split(X, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED)


def make_model(hidden, batch: int, inner_lr: float, seed: int):
    from sklearn.neural_network import MLPClassifier  # noqa: PLC0415

    return MLPClassifier(hidden_layer_sizes=hidden, solver="adam", learning_rate_init=inner_lr, batch_size=batch,
                         alpha=1e-4, shuffle=False, random_state=seed, max_iter=1 << 30)


def accuracy(model, X, y) -> float:
    return float(np.mean(model.predict(X) == y))


# ----------------------------------------------------------------- the run
def job_config(*, outer_steps: int, inner_steps: int, batch: int, hidden, inner_lr: float, outer_lr: float,
               momentum: float, quantize: str | None, seed: int) -> np.ndarray:
    """The job's flags (:data:`JOB_FLAGS`) as canonical JSON bytes in a uint8 array: the shared
    state's ``config`` entry, equal on every peer of one job, byte for byte."""
    cfg = {"outer_steps": int(outer_steps), "inner_steps": int(inner_steps), "batch": int(batch),
           "hidden": [int(h) for h in hidden], "inner_lr": float(inner_lr), "outer_lr": float(outer_lr),
           "momentum": float(momentum), "quantize": quantize if quantize not in (None, "none") else "none",
           "seed": int(seed)}
    return np.frombuffer(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode(), np.uint8).copy()


def _spelled(value) -> str:
    """A job flag's value as the command line spells it (``--hidden 32 16``, ``--quantize int8``)."""
    return " ".join(str(v) for v in value) if isinstance(value, list) else str(value)


def config_mismatch(own: bytes, job) -> str:
    """The message that refuses a peer whose job flags ``own`` (:func:`job_config`'s bytes)
    differ from the job's ``job`` (bytes from the master or a peer: JSON, never pickle;
    nothing trusted beyond the comparison; anything unreadable is said so):
    ``"this peer's flags differ from the job's: --hidden 32 here, 16 in the job; ..."``."""
    mine = json.loads(own)
    try:
        theirs = json.loads(job) if isinstance(job, (bytes, bytearray)) else None
    except (ValueError, UnicodeDecodeError):
        theirs = None
    if not isinstance(theirs, dict):
        diffs = "the job carries no readable DiLoCo flags (another app's job, or a peer of another version?)"
    else:
        diffs = "; ".join(f"{flag} {_spelled(mine.get(k))} here, {_spelled(theirs.get(k))} in the job"
                          for k, flag in JOB_FLAGS.items() if mine.get(k) != theirs.get(k))
        diffs = diffs or "the job's flags are written differently (a peer of another version?)"
    return f"this peer's flags differ from the job's: {diffs} (every peer of one job must run with the same job flags)"


def check_config(state: dict, own: np.ndarray, rank=None) -> None:
    """Refuse a peer whose job flags differ from those of the state it holds after a sync.

    The second line of defence: a peer that joins with ``connect(job=job_config(...).tobytes())``
    (as the command line does) is refused by the master before admission when its flags
    differ (:class:`commlib.core.errors.JobMismatch`); this check covers peers connected
    with no job (``job=None``, e.g. :func:`run` on a peer made by the library) and a master
    that admitted only such peers.

    Args:
        state: the shared state after ``sync_shared_state`` (its ``config``: the job's).
        own: this peer's :func:`job_config`.
        rank: this peer's rank, for the message.

    Raises:
        commlib.InvalidArgument: the job's ``config`` differs from ``own`` (or is missing);
            the message names every differing flag with both values (:func:`config_mismatch`).
    """
    job = state.get("config")
    if isinstance(job, np.ndarray) and job.dtype == np.uint8 and job.tobytes() == own.tobytes():
        return
    from commlib import InvalidArgument  # noqa: PLC0415

    job = job.tobytes() if isinstance(job, np.ndarray) and job.dtype == np.uint8 else None
    raise InvalidArgument(config_mismatch(own.tobytes(), job), rank=rank, op="diloco")


def new_state(shapes, seed: int, outer_steps: int, config: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A fresh shared state at revision 0 (``config``: :func:`job_config`, added when given)."""
    theta = init_params(shapes, seed)
    state = {
        "theta": theta,
        "momentum": np.zeros_like(theta),
        "step": np.zeros(1, np.int64),
        "acc": np.full(outer_steps, np.nan, np.float32),
        "peers": np.zeros(outer_steps, np.int32),
        "epoch": np.zeros(outer_steps, np.int64),
    }
    if config is not None:
        state["config"] = config.copy()
    return state


def prepare(hidden=(64,), batch: int = 32, inner_lr: float = 3e-3, seed: int = 0):
    """Data and a ready local model (before connecting: the slow imports and the first
    ``partial_fit``, which builds the layers, the label binarizer and Adam; the global
    parameters are written over whatever it did). Returns what ``run(prepared=...)`` takes."""
    import sklearn  # noqa: PLC0415
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    X_train, X_test, y_train, y_test = load_data()
    shapes = layer_shapes(X_train.shape[1], tuple(hidden), NUM_CLASSES)
    model = make_model(tuple(hidden), batch, inner_lr, seed)
    warnings.filterwarnings("ignore", module="sklearn")
    with threadpool_limits(1), sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
        model.partial_fit(X_train[:batch], y_train[:batch], classes=np.arange(NUM_CLASSES))
        accuracy(model, X_test[:8], y_test[:8])
    if [c.shape for c in model.coefs_] != [cs for cs, _ in shapes]:
        raise RuntimeError(f"unexpected MLP layout {[c.shape for c in model.coefs_]}")
    return X_train, X_test, y_train, y_test, model, shapes


def _counters(peer):
    """(all-reduce retries, payload bytes sent) from ``peer.stats``, or None where the peer
    keeps no such counters. ``commlib.elastic.Peer.stats`` counts the data plane's payload
    bytes (after fp16/int8 encoding, frame headers left out) over every epoch's transport."""
    st = getattr(peer, "stats", None)
    if not isinstance(st, dict) or not isinstance(st.get("bytes_sent"), (int, np.integer)):
        return None
    return st.get("retries"), int(st["bytes_sent"])


def run(peer, **kw) -> dict:
    """Train with DiLoCo on ``peer`` (a ``commlib.elastic`` peer, or anything with its API).

    Keyword arguments: see :func:`_run`. Returns the report ``--json`` writes. Raises whatever
    the peer raises (``PeerFailure``, ``CommError``), TimeoutError when ``min_peers`` never came.
    BLAS runs one thread (peers often share a machine's cores) and scikit-learn skips its
    per-call input validation (the inputs are ours), which is most of a small ``partial_fit``.
    """
    import sklearn  # noqa: PLC0415
    from threadpoolctl import threadpool_limits  # noqa: PLC0415 (a scikit-learn dependency)

    with threadpool_limits(1), sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
        return _run(peer, **kw)


def _run(peer, *, outer_steps: int = 30, inner_steps: int = 20, batch: int = 32, hidden=(64,),
        inner_lr: float = 3e-3, outer_lr: float = 0.7, momentum: float = 0.9, quantize: str | None = None,
        seed: int = 0, min_peers: int = 1, wait_s: float = 60.0, leave_after: int | None = None,
        should_leave=None, progress: bool = False, log=None, prepared=None, state=None) -> dict:
    X_train, X_test, y_train, y_test, model, shapes = prepared or prepare(hidden, batch, inner_lr, seed)
    own_config = job_config(outer_steps=outer_steps, inner_steps=inner_steps, batch=batch, hidden=hidden,
                            inner_lr=inner_lr, outer_lr=outer_lr, momentum=momentum, quantize=quantize, seed=seed)
    if state is None:  # a peer that rejoins passes the state it had (its revision decides the sync)
        state = new_state(shapes, seed, outer_steps)
    if "config" not in state:
        state["config"] = own_config.copy()

    t0 = time.perf_counter()
    deadline = time.monotonic() + wait_s
    events, steps_done, step_times, wire = [], 0, [], []
    last_epoch = None
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=outer_steps, desc="diloco", unit="outer", leave=True, dynamic_ncols=True)
    qz = None if quantize in (None, "none") else quantize
    while True:
        ts = time.perf_counter()
        changed = peer.update_topology()
        # Every boundary syncs the shared state: a SHA-256 check that every peer holds the same bits
        # (0 bytes move when they do); a joiner, or a peer left behind, fetches from a donor. Calling
        # it at every boundary, not only after a change, keeps the sequence of collectives the same
        # on every peer even when a death races with the vote.
        before = int(state["step"][0])
        info = peer.sync_shared_state(state, before)
        check_config(state, own_config, peer.rank)  # before any array of the state is used
        got = int(info.get("bytes_received", 0) or 0)
        if changed or got or peer.epoch != last_epoch:
            events.append({"at_step": int(state["step"][0]), "step_before_sync": before, "epoch": int(peer.epoch),
                           "rank": int(peer.rank), "size": int(peer.size), "bytes_received": got,
                           "donor": info.get("donor"), "sync_s": info.get("seconds"),
                           "time_s": time.perf_counter() - t0})
            if log:
                donor = info.get("donor")
                sync = (f"fetched the shared state ({got} B) from peer id {donor}" if donor is not None
                        else "shared state already current here (nothing fetched)")
                log(f"epoch {peer.epoch}: rank {peer.rank}/{peer.size}, step {int(state['step'][0])}, {sync}")
            last_epoch = peer.epoch
        t = int(state["step"][0])
        if bar is not None:
            bar.n = t
            bar.refresh()
        if (t >= outer_steps or (leave_after is not None and steps_done >= leave_after)
                or (should_leave is not None and should_leave())):
            break
        if t == 0:  # before step 1, wait for --min-peers: the largest asked for by any peer, agreed on by all
            need = peer.allreduce(np.array([min_peers], np.float32), op="max")
            if peer.size < int(need[0]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {peer.size} peer(s) after {wait_s:g} s, --min-peers {int(need[0])}")
                time.sleep(0.05)
                continue
            # the job's initial weights are rank 0's, broadcast to every member (each peer made its
            # own from --seed; the broadcast makes the start the same bits whatever made them)
            peer.bcast(state["theta"], root=0)
        theta, mom = state["theta"], state["momentum"]
        load_into(model, theta)
        shard = shard_indices(len(y_train), peer.rank, peer.size, seed)
        rng = np.random.default_rng([seed, t, peer.rank, peer.size])
        for _ in range(inner_steps):
            idx = rng.choice(shard, size=min(batch, len(shard)), replace=False)
            model.partial_fit(X_train[idx], y_train[idx])
        delta = np.subtract(theta, flatten(model), dtype=np.float32)
        c0 = _counters(peer)
        peer.allreduce(delta, op="avg", quantize=qz)
        c1 = _counters(peer)
        if c0 is None or c1 is None or c1[0] != c0[0]:
            counted = None  # no counter, or bytes went over an aborted attempt too
        else:
            counted = c1[1] - c0[1]
        last_epoch = peer.epoch  # a death during the all-reduce moves every survivor to the same epoch
        outer_step(theta, mom, delta, outer_lr, momentum)
        load_into(model, theta)
        acc = accuracy(model, X_test, y_test)
        state["acc"][t] = acc
        state["peers"][t] = peer.size
        state["epoch"][t] = peer.epoch
        state["step"][0] = t + 1
        steps_done += 1
        step_times.append(time.perf_counter() - ts)
        wire.append({"step": t, "peers": int(peer.size),
                     "estimated_bytes_sent": ring_allreduce_bytes(delta.nbytes, peer.size, qz),
                     "counted_bytes_sent": counted})
        if bar is not None:
            bar.set_postfix(acc=f"{acc:.3f}", peers=peer.size, rank=peer.rank, refresh=False)
            bar.update(0)
        elif log:
            log(f"step {t + 1}/{outer_steps} acc {acc:.4f} peers {peer.size}")
    if bar is not None:
        bar.close()
    t_final = int(state["step"][0])
    accs = state["acc"][:t_final]
    done = [i for i in range(t_final) if np.isfinite(accs[i])]
    counted = [w["counted_bytes_sent"] for w in wire if w["counted_bytes_sent"] is not None]
    return {
        "app": "diloco",
        "dataset": "sklearn digits (1797 x 64, 10 classes), stratified 25% held out",
        "config": {"outer_steps": outer_steps, "inner_steps": inner_steps, "batch": batch, "hidden": list(hidden),
                   "inner_lr": inner_lr, "outer_lr": outer_lr, "momentum": momentum,
                   "quantize": qz or "none", "seed": seed, "params": int(state["theta"].size)},
        "finished": t_final >= outer_steps,
        "outer_steps_done": t_final,
        "own_outer_steps": steps_done,
        "final_accuracy": float(accs[done[-1]]) if done else None,
        "history": [{"step": i + 1, "accuracy": float(accs[i]), "peers": int(state["peers"][i]),
                     "epoch": int(state["epoch"][i])} for i in done],
        "membership_events": events,
        "wire": wire,
        "mean_estimated_bytes_per_outer_step": float(np.mean([w["estimated_bytes_sent"] for w in wire])) if wire else 0.0,
        "mean_counted_bytes_per_outer_step": float(np.mean(counted)) if counted else None,
        "theta_sha256": __import__("hashlib").sha256(state["theta"].tobytes()).hexdigest(),
        "wall_s": time.perf_counter() - t0,
        "mean_outer_step_s": float(np.mean(step_times)) if step_times else None,
    }


def plot(report: dict, path: str) -> None:
    """Held-out accuracy against outer step, peers per step beneath, membership changes marked."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    h = report["history"]
    steps = [r["step"] for r in h]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    a1.plot(steps, [r["accuracy"] for r in h], ".-", label="held-out accuracy")
    a1.axhline(0.95, color="grey", ls=":", label="target 0.95")
    changes = [h[i]["step"] for i in range(1, len(h)) if (h[i]["peers"], h[i]["epoch"]) != (h[i - 1]["peers"],
                                                                                          h[i - 1]["epoch"])]
    for k, s in enumerate(changes):
        for ax in (a1, a2):
            ax.axvline(s - 0.5, color="C3", ls="--", lw=0.8, label="membership change" if (k == 0 and ax is a1) else None)
    a2.step(steps, [r["peers"] for r in h], where="mid", color="C2")
    c = report["config"]
    a1.set(ylabel="accuracy", ylim=(0, 1.01),
           title=f"DiLoCo on digits: H={c['inner_steps']}, quantize={c['quantize']}, "
                 f"final {report['final_accuracy']:.3f}" if report["final_accuracy"] is not None else "DiLoCo")
    a2.set(xlabel="outer step", ylabel="peers")
    a2.yaxis.get_major_locator().set_params(integer=True)
    a1.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    from commlib.apps._cli import OneLineParser  # noqa: PLC0415 (the standard library only)

    p = OneLineParser("diloco", prog="python -m commlib.apps.diloco",
                description="\n\n".join(doc[1:7]),
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="The shared secret: --secret-file, else the environment variable COMMLIB_ELASTIC_SECRET.\n"
                       "Progress: a bar on stderr (outer steps, accuracy, peers); --no-progress: one log line per\n"
                       "step. At the end one line on stdout: job outer steps done (this peer's own), final held-out\n"
                       "accuracy, estimated bytes this peer sent per outer step, wall seconds, and the first 16 hex\n"
                       "digits of SHA-256 of theta (the same on every peer that finished).\n"
                       "Exit status: 0 finished or left as asked (--leave-after, SIGTERM, a first Ctrl-C);\n"
                       "1 the job failed (master unreachable, wrong secret, --min-peers not reached, dropped more\n"
                       "than --rejoin times); 2 a bad value (flags, the secret, job flags unlike the job's);\n"
                       "130 a second Ctrl-C.\n"
                       "Local job with churn: python jobs/elastic/launch_local.py --help")
    p.add_argument("--master", metavar="HOST:PORT", required=True, help="address of the master (commlib master)")
    p.add_argument("--secret-file", metavar="PATH", help="file holding the job's shared secret "
                   "(default: the environment variable COMMLIB_ELASTIC_SECRET)")
    p.add_argument("--outer-steps", type=int, default=30, help="outer steps of the job (default 30)")
    p.add_argument("--inner-steps", type=int, default=20, help="inner steps H per outer step (default 20)")
    p.add_argument("--batch", type=int, default=32, help="inner minibatch size (default 32)")
    p.add_argument("--hidden", type=int, nargs="+", default=[64], metavar="N",
                   help="hidden layer widths of the MLP (default 64)")
    p.add_argument("--inner-lr", type=float, default=3e-3, help="Adam learning rate of the inner steps (default 3e-3)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="Nesterov outer learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov outer momentum (default 0.9)")
    p.add_argument("--quantize", choices=QUANTIZE, default="none",
                   help="compression of the pseudo-gradient all-reduce (default none)")
    p.add_argument("--streams", type=int, default=None,
                   help="TCP connections per peer pair (default: commlib.elastic.connect's, 1 on loopback, 4 elsewhere)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and the shards (default 0)")
    p.add_argument("--min-peers", type=int, default=1,
                   help="wait (calling update_topology) until this many peers are in before step 1 (default 1)")
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="seconds --min-peers may wait before step 1; then this peer exits with status 1 (default 60)")
    p.add_argument("--leave-after", type=int, default=None, metavar="K",
                   help="leave gracefully after K outer steps of this peer (churn)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="the deadline in seconds of each whole call: connecting, and every update_topology, "
                        "state sync and collective, retries included (the peer's timeout; default 30)")
    p.add_argument("--rejoin", type=int, default=3, metavar="N",
                   help="when the master drops this peer (or a wait times out), reconnect with the state it "
                        "holds, up to N times (default 3)")
    p.add_argument("--encrypt", action="store_true",
                   help="seal data frames with AES-GCM (the master must run with --encrypt too)")
    p.add_argument("--json", metavar="PATH", help="write this peer's report as JSON")
    p.add_argument("--plot", metavar="PATH", help="PNG: accuracy against outer step, membership changes marked")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one log line per step instead)")
    return p


def _finite_positive(v) -> bool:
    return math.isfinite(v) and v > 0


def parse_args(argv=None):
    """Parse and check the command line; a bad value exits with status 2 after one line on stderr
    (``diloco: error: ...``)."""
    from commlib.apps._cli import unwritable  # noqa: PLC0415 (the standard library only)

    p = build_parser()
    a = p.parse_args(argv)
    for name in ("outer_steps", "inner_steps", "batch", "streams", "min_peers"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.streams is not None and a.streams > MAX_STREAMS:
        p.error(f"--streams must be 1..{MAX_STREAMS}, got {a.streams}")
    if not 0 <= a.seed < 1 << 32:  # numpy's and scikit-learn's seeds
        p.error(f"--seed must be in 0..{(1 << 32) - 1}, got {a.seed}")
    if any(h < 1 for h in a.hidden):
        p.error(f"--hidden widths must be >= 1, got {a.hidden}")
    for name in ("inner_lr", "outer_lr"):
        v = getattr(a, name)
        if not _finite_positive(v):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if not (0.0 <= a.outer_momentum < 1.0):
        p.error(f"--outer-momentum must be in [0, 1), got {a.outer_momentum}")
    if a.rejoin < 0:
        p.error(f"--rejoin must be >= 0, got {a.rejoin}")
    if a.leave_after is not None and a.leave_after < 0:
        p.error(f"--leave-after must be >= 0, got {a.leave_after}")
    for name in ("wait", "timeout"):
        if not _finite_positive(getattr(a, name)):
            p.error(f"--{name} must be a positive, finite number of seconds, got {getattr(a, name)}")
    host, _, port = a.master.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        p.error(f"--master must be HOST:PORT with a port in 1..65535, got {a.master!r}")
    if a.secret_file is None and config.elastic_secret is None:
        p.error("no secret: pass --secret-file or set COMMLIB_ELASTIC_SECRET")
    if a.secret_file is not None and not (os.path.isfile(a.secret_file) and os.access(a.secret_file, os.R_OK)):
        p.error(f"--secret-file {a.secret_file!r} is not a readable file")
    for name in ("json", "plot"):
        path = getattr(a, name)
        why = unwritable(path) if path is not None else None
        if why:
            p.error(f"--{name} {path!r}: {why}")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib)")
    return a


def main(argv=None) -> int:
    """The command line (see ``--help``). Exit status: 0 done (finished, or left as asked: --leave-after,
    SIGTERM, a first Ctrl-C), 1 the job failed (master unreachable, wrong secret, dropped more than
    --rejoin times), 2 a bad value (a command-line value, the secret, flags that differ from the
    job's), 128 + the signal's number when SIGTERM or Ctrl-C came before the peer joined, 130 a
    second Ctrl-C."""
    leave = []

    def log(msg):
        print(f"[diloco pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)

    def on_signal(signum, _frame):
        if signum == signal.SIGINT and leave:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        leave.append(signum)
        if signum == signal.SIGINT:
            log("Ctrl-C: leaving at the next step boundary (Ctrl-C again to stop at once)")

    args = parse_args(argv)
    if importlib.util.find_spec("sklearn") is None:
        print("diloco: error: needs scikit-learn (pip install 'commlib[apps]')", file=sys.stderr)
        return 2
    # leave gracefully at the next boundary on SIGTERM (a scheduler, launch_local.py's leave) or Ctrl-C
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, on_signal)
    if saved[signal.SIGINT] is signal.default_int_handler:  # not where SIGINT is ignored (nohup, &)
        signal.signal(signal.SIGINT, on_signal)
    try:
        return _main(args, leave, log)
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _main(args, leave, log) -> int:
    import commlib  # noqa: PLC0415
    import commlib.elastic as el  # noqa: PLC0415
    from commlib.core.errors import JobMismatch  # noqa: PLC0415

    prepared = prepare(tuple(args.hidden), args.batch, args.inner_lr, args.seed)  # before joining: slow imports
    # the job's flags go with the join: a master serving a job with other flags refuses this peer at the door
    job = job_config(outer_steps=args.outer_steps, inner_steps=args.inner_steps, batch=args.batch,
                     hidden=tuple(args.hidden), inner_lr=args.inner_lr, outer_lr=args.outer_lr,
                     momentum=args.outer_momentum, quantize=args.quantize, seed=args.seed).tobytes()
    state = new_state(prepared[5], args.seed, args.outer_steps)
    kw = {"secret_file": args.secret_file} if args.secret_file else {}
    report = None
    for attempt in range(args.rejoin + 1):
        if leave:  # SIGTERM or Ctrl-C before (re)joining: nothing to leave gracefully
            print(f"diloco: stopped by {signal.Signals(leave[0]).name} before joining", file=sys.stderr, flush=True)
            return 128 + leave[0]
        try:
            peer = el.connect(args.master, streams=args.streams, timeout=args.timeout, encrypt=args.encrypt,
                              job=job, **kw)
        except JobMismatch as exc:  # refused before admission: rejoining would not change that
            print(f"diloco: error: {config_mismatch(job, exc.job)}", file=sys.stderr)
            return 2
        except el.SecretError as exc:
            print(f"diloco: error: {exc.detail}", file=sys.stderr)
            return 2
        except el.AuthError:
            print("diloco: error: the master refused this peer (authentication: is the secret the master's?)",
                  file=sys.stderr)
            return 1
        except (commlib.CommError, OSError, TimeoutError) as exc:
            what = getattr(exc, "detail", None) or str(exc)  # connect's own errors already name the master
            if not what.startswith("cannot reach the master"):
                what = f"cannot reach the master at {args.master}: {what}"
            print(f"diloco: error: {what}", file=sys.stderr)
            return 1
        try:
            report = run(peer, outer_steps=args.outer_steps, inner_steps=args.inner_steps, batch=args.batch,
                         hidden=tuple(args.hidden), inner_lr=args.inner_lr, outer_lr=args.outer_lr,
                         momentum=args.outer_momentum, quantize=args.quantize, seed=args.seed,
                         min_peers=args.min_peers if attempt == 0 else 1, wait_s=args.wait,
                         leave_after=args.leave_after,
                         should_leave=lambda: bool(leave), prepared=prepared, state=state,
                         progress=not args.no_progress, log=log)
            break
        except commlib.InvalidArgument as exc:
            # this peer's call differs from the others' (its flags): rejoining would not change that;
            # the app's own refusal without its "rank N: diloco:" prefix (the line names the app already)
            print(f"diloco: error: {exc.detail if exc.op == 'diloco' else exc}", file=sys.stderr)
            return 2
        except commlib.CommError as exc:  # CommTimeout included
            # The master dropped this peer (declared dead: e.g. starved of CPU past the heartbeat
            # timeout) or gave up on it. Its state is intact at the revision it last completed
            # (an aborted all-reduce restores its input): rejoin as a new peer, and the sync at
            # the next boundary decides who holds the newest state.
            if attempt == args.rejoin:
                print(f"diloco: error: {exc}", file=sys.stderr)
                return 1
            log(f"{type(exc).__name__}: {exc}; rejoining ({attempt + 1}/{args.rejoin}) at step {int(state['step'][0])}")
        except TimeoutError as exc:  # --min-peers never came: not a reason to train with fewer
            print(f"diloco: error: {exc}", file=sys.stderr)
            return 1
        finally:  # a finished job releases its flags at the master (the next job may differ)
            peer.close(finished=bool(report and report.get("finished")))
        time.sleep(0.5)
    report["rejoins"] = attempt
    fa = report["final_accuracy"]
    print(f"diloco: {report['outer_steps_done']}/{args.outer_steps} outer steps ({report['own_outer_steps']} here), "
          f"final held-out accuracy {fa if fa is None else round(fa, 4)}, quantize {report['config']['quantize']}, "
          f"~{report['mean_estimated_bytes_per_outer_step']:.0f} B sent per outer step (estimate), "
          f"wall {report['wall_s']:.1f} s, theta sha256 {report['theta_sha256'][:16]}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
