"""``COMMLIB_DATATYPE_STRATEGY`` is read at each use (config's contract), through
a memo of the raw environment value: every way a program or a test changes the
environment must show at the next read."""
import os

from commlib.core.config import Config, _env_str

NAME = "COMMLIB_DATATYPE_STRATEGY"


def test_strategy_follows_every_environment_change(monkeypatch):
    cfg = Config()
    monkeypatch.delenv(NAME, raising=False)
    assert cfg.datatype_strategy == ""
    monkeypatch.setenv(NAME, " Pack ")
    assert cfg.datatype_strategy == "pack"
    assert cfg.datatype_strategy == "pack"  # the memo's answer
    os.environ[NAME] = "mpi"
    assert cfg.datatype_strategy == "mpi"
    os.environ[NAME] = "mpi"  # the same value, set again (a new object)
    assert cfg.datatype_strategy == "mpi"
    os.environ.pop(NAME)
    assert cfg.datatype_strategy == ""
    os.environ.update({NAME: "STAGED"})
    assert cfg.datatype_strategy == "staged"
    cfg.forced_strategy = "device"  # the attribute overrides the environment
    assert cfg.datatype_strategy == "device"
    cfg.forced_strategy = None
    assert cfg.datatype_strategy == "staged"


def test_env_str_memo_keeps_defaults_apart(monkeypatch):
    monkeypatch.delenv("COMMLIB_TEST_UNSET_VARIABLE", raising=False)
    assert _env_str("COMMLIB_TEST_UNSET_VARIABLE", "a") == "a"
    assert _env_str("COMMLIB_TEST_UNSET_VARIABLE", "B") == "b"
    monkeypatch.setenv("COMMLIB_TEST_UNSET_VARIABLE", "x")
    assert _env_str("COMMLIB_TEST_UNSET_VARIABLE", "a") == "x"
