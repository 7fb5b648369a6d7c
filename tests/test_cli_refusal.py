"""A refused command line costs no MPI, numba or CuPy (issue 13).

The heat and attention command lines are parsed and checked before anything
imports ``mpi4py.MPI`` (loading the MPI library), ``numba`` or ``cupy``: a bad
value exits with status 2 after one line on stderr, and those modules are
still absent from ``sys.modules``.  Each case runs in a fresh interpreter
(``python -P -c``), so nothing imported by pytest or another test counts.
The property is checked, not a time (shared cores vary).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("mpi4py.MPI", "numba", "cupy")

# run one app's main(argv) and report its status and which heavy modules it imported
PROBE = """
import json, sys
from commlib.apps.{app} import main
rc = main({argv!r})
sys.stdout.write(json.dumps({{"rc": rc, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""

UNWRITABLE = "{blocker}/x.json"  # under a regular file: unwritable for every user, root included

HEAT_BAD = [
    ["--steps", "-5"], ["--steps", "abc"], ["--alpha", "nan"], ["--t-final", "-1"], ["--cfl", "1.5"],
    ["--grid", "0"], ["--kill", "0:2"], ["--fault-tolerant", "--kill", "abc"],
    ["--fault-tolerant", "--kill", "9:1"], ["--json", UNWRITABLE], ["--plot", "/nonexistent/x.png"],
    ["--backend", "fortran"],
]
ATTENTION_BAD = [
    ["--seq", "0"], ["--seq", "abc"], ["--heads", "6", "--kv-heads", "4"], ["--timeout", "nan"],
    ["--warmup", "-1"], ["--layout", "diagonal"], ["--algo", "tree"], ["--json", UNWRITABLE],
]


def _env(**extra):
    """This environment without the launcher's variables (a test may run on an
    MPI rank), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_", "MV2_"))}
    env.update(extra)
    return env


def _refuse(app, argv, tmp_path, env=None):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [a.format(blocker=blocker) for a in argv]
    p = subprocess.run([sys.executable, "-P", "-c", PROBE.format(app=app, argv=argv, heavy=HEAVY)],
                       capture_output=True, text=True, timeout=120, env=env or _env(), cwd=str(tmp_path))
    assert p.stdout, p.stderr
    return json.loads(p.stdout), p.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("app,argv", [("heat", a) for a in HEAT_BAD] + [("attention", a) for a in ATTENTION_BAD],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_refusal_exits_2_in_one_line_without_mpi_numba_cupy(app, argv, tmp_path):
    got, err = _refuse(app, argv, tmp_path)
    assert got["rc"] == 2, (got, err)
    assert err.count("\n") == 1 and err.startswith(f"{app}: error: "), err
    assert got["heavy"] == [], f"a refusal imported {got['heavy']}"


@pytest.mark.timeout(150)
def test_world_size_and_rank_come_from_the_launchers_environment(tmp_path):
    """Under a launcher (Open MPI's variables here), the job's size bounds --kill
    and the grid, and only rank 0 prints the line, all before MPI is loaded."""
    for rank, lines in (("0", 1), ("3", 0)):
        env = _env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK=rank)
        got, err = _refuse("heat", ["--fault-tolerant", "--kill", "4:1"], tmp_path, env)
        assert got == {"rc": 2, "heavy": []} and err.count("\n") == lines, (got, err)
        if lines:
            assert "rank 4 is not a rank of this job [0, 4)" in err, err
        got, err = _refuse("heat", ["--dims", "2", "--grid", "1", "3"], tmp_path, env)
        assert got == {"rc": 2, "heavy": []} and err.count("\n") == lines, (got, err)
        if lines:
            assert "fewer points than the job has ranks (4)" in err, err
        # every rank of the 4 killed: none would finish; a step past the run's last one
        for argv, why in ((["--kill", "0:1", "--kill", "1:1", "--kill", "2:5", "--kill", "3:1"], "every rank"),
                          (["--steps", "20", "--kill", "1:20"], "past the run's last step (19)")):
            got, err = _refuse("heat", ["--fault-tolerant"] + argv, tmp_path, env)
            assert got == {"rc": 2, "heavy": []} and err.count("\n") == lines, (got, err)
            if lines:
                assert why in err, err


@pytest.mark.timeout(150)
def test_import_commlib_is_light_and_names_load_on_first_use():
    code = """
import sys
heavy = %r
import commlib, commlib.collectives
import commlib.apps.heat, commlib.apps.attention
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
assert set(commlib.__all__) <= set(dir(commlib)) and set(commlib.collectives.__all__) <= set(dir(commlib.collectives))
# an algorithm is imported from its module (no package-level alias to shadow)
from commlib.collectives.allreduce_ring import allreduce_ring
from commlib.collectives.allgather_ring import allgather_ring
from commlib import init, Communicator, ring_attention, Buffer
from commlib.collectives import HaloExchange, LAYOUTS
assert callable(init) and callable(allreduce_ring) and callable(allgather_ring), (allreduce_ring, allgather_ring)
assert commlib.apps.heat.HaloExchange is HaloExchange and LAYOUTS == commlib.collectives.attention.LAYOUTS
for name in commlib.__all__:
    getattr(commlib, name)
for name in commlib.collectives.__all__:
    getattr(commlib.collectives, name)
print("ok")
""" % (HEAVY,)
    p = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


# ------------------------------------------------------------------ the commlib command line
def _commlib_main(argv, capsys):
    """commlib.cli.main in this process: (exit status, stderr)."""
    from commlib.cli import main  # noqa: PLC0415

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.timeout(60)  # a master that wrongly started would serve until stopped
@pytest.mark.parametrize("argv", [
    ["bogus"], [],
    ["master", "--bind", "127.0.0.1:99999"], ["master", "--bind", "nohostport"], ["master", "--bind", ":29500"],
    ["master", "--heartbeat-timeout", "nan"], ["master", "--probe-timeout", "0"],
    ["master", "--secret-file", "{tmp}/missing"], ["master", "--secret-file", "{tmp}/short"],
    ["master", "--secret-file", "{tmp}"],
    ["calibrate", "--repeat", "0"], ["calibrate", "--sizes", "-5"], ["calibrate", "--blocks", "0"],
    ["calibrate", "--out", "{tmp}/short/x.json"], ["calibrate", "--out", "{tmp}"],
    ["info", "--kernel-timeout", "-1"],
], ids=lambda a: " ".join(a) or "(none)")
def test_commlib_cli_refuses_bad_values_in_one_line(argv, tmp_path, capsys, monkeypatch):
    """Every bad value of `commlib ...`: exit status 2 and one line `commlib[ SUB]: error: ...` (no
    usage block, no traceback), before anything is measured or any socket listens."""
    monkeypatch.delenv("COMMLIB_ELASTIC_SECRET", raising=False)
    (tmp_path / "short").write_bytes(b"x" * 4)
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[:1] == ["master"] and "--secret-file" not in argv:
        good = tmp_path / "good"
        good.write_bytes(os.urandom(32))
        argv += ["--secret-file", str(good)]
    rc, err = _commlib_main(argv, capsys)
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and err.startswith("commlib") and ": error: " in err, err


@pytest.mark.timeout(60)
def test_commlib_master_on_a_port_in_use_exits_2_in_one_line(tmp_path, capsys):
    import socket  # noqa: PLC0415

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, err = _commlib_main(["master", "--bind", f"127.0.0.1:{port}", "--secret-file", str(secret)], capsys)
    assert rc == 2 and err.count("\n") == 1, (rc, err)
    assert err.startswith(f"commlib master: error: cannot listen on 127.0.0.1:{port}: "), err


@pytest.mark.timeout(60)
def test_commlib_master_stops_cleanly_on_sigterm(tmp_path):
    """SIGTERM (a scheduler, a launcher) stops the master as Ctrl-C does: status 0, a last line."""
    import signal  # noqa: PLC0415

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    p = subprocess.Popen([sys.executable, "-P", "-m", "commlib.cli", "master", "--bind", "127.0.0.1:0",
                          "--secret-file", str(secret)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(), cwd=str(tmp_path))
    try:
        first = p.stdout.readline()
        assert first.startswith("commlib master listening on 127.0.0.1:"), first
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and out.strip() == "commlib master stopped" and err == "", (p.returncode, out, err)
