"""The LM app's tests' oracle: the single-process training with plain torch attention on whole
sequences (``commlib.apps.lm.train.oracle_losses``: dense SDPA with the document mask, no
commlib communication), and the comparison of an app report's losses with it."""
from __future__ import annotations

_CACHE: dict = {}


def oracle(argv, size: int = 1):
    """(train loss per step, {1-based step: val loss}) of the model and data ``argv`` describes
    (``size``: the rank count the command line is checked against; the oracle runs alone)."""
    from commlib.apps import lm as app  # noqa: PLC0415
    from commlib.apps.lm.train import oracle_losses  # noqa: PLC0415

    key = (tuple(argv), size)
    if key not in _CACHE:
        train, val = oracle_losses(app.parse_args(list(argv), size=size))
        _CACHE[key] = (train, {s + 1: v for s, v in val.items()})
    return _CACHE[key]


def assert_losses(rep, expected, rel: float, what: str) -> None:
    """Every training and validation loss of the report ``rep`` within ``rel`` (relative) of
    ``expected`` (an :func:`oracle` pair); ``what`` (with the seed) names the case."""
    o_train, o_val = expected
    train = [s["train_loss"] for s in rep["steps"]]
    val = {s["step"]: s["val_loss"] for s in rep["steps"] if s["val_loss"] is not None}
    assert len(train) == len(o_train) and set(val) == set(o_val), what
    for i, (a, b) in enumerate(zip(train, o_train)):
        assert abs(a - b) <= rel * abs(b), f"{what}: step {i + 1} train loss {a} vs {b}"
    for s in o_val:
        assert abs(val[s] - o_val[s]) <= rel * abs(o_val[s]), f"{what}: val loss at step {s}: {val[s]} vs {o_val[s]}"
