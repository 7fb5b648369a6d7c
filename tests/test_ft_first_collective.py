"""A fault-tolerant communicator's first collective call, made on one rank alone,
must raise within the timeout, not wait for ever inside ``MPI_Comm_dup``.

A fault-tolerant communicator's collectives' transport (a duplicate) is made
when the communicator is made (``init``, ``dup``, ``split``, ``cart_create``);
``dup`` itself is an ``MPI_Comm_idup`` waited for at most the timeout, and a
transport still missing is made the same way.  Before, ``dup``/``split``/
``cart_create`` of a fault-tolerant communicator returned one that was not
fault tolerant, whose first collective on one rank waited in ``MPI_Comm_dup``
for ever.

Each test launches one 2-rank job running this file (``__main__`` below), in
plain timeout mode and, where Open MPI has ULFM, under ``--with-ft ulfm``;
rank 1 lets rank 0 time out alone, then both ranks check the results against
numpy and MPI's own ``Allreduce``.  Run: ``python -m pytest -q
tests/test_ft_first_collective.py`` (with either venv's python).
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

if __name__ != "__main__":
    import pytest

    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    from launch import FINALIZE_TIMEOUT, ft_args  # tests/launch.py

    LIB = MPI.Get_library_version()
    IS_OMPI = "Open MPI" in LIB
    BIN = Path(sys.executable).parent

    def _ulfm():
        from commlib.core.device import ulfm_available

        return IS_OMPI and ulfm_available()

T = 1.0  # the fault-tolerant timeout of the jobs (seconds)


def _job(case: str, ulfm: bool, tmp):
    env = dict(os.environ, FT_OUT_DIR=str(tmp), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
               COMMLIB_FINALIZE_TIMEOUT=FINALIZE_TIMEOUT)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    cmd = [str(BIN / "mpiexec")]
    cmd += (["--oversubscribe"] + (ft_args() if ulfm else [])) if IS_OMPI else ["-disable-auto-cleanup"]
    cmd += ["-n", "2", sys.executable, "-P", __file__, case]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"the job hung (a rank waits for ever):\n{out.decode(errors='replace')[-3000:]}")
    text = out.decode(errors="replace")
    res = {}
    for f in Path(tmp).glob("rank*.json"):  # files: two ranks' lines can interleave (MPICH's hydra)
        r = json.loads(f.read_text())
        res[r["rank"]] = r
    assert sorted(res) == [0, 1], text[-3000:]
    return res


CASES = ["dup", "split", "cart", "lazy", "init"]


def _params():
    marks = [] if _ulfm() else [pytest.mark.skip(reason="needs Open MPI with ULFM")]
    # under ULFM a lone *collective* ends with the watchdog failing the lone rank
    # (docs/faults-and-security.md: a late peer and a wedged one look the same); the duplications are bounded
    return ([pytest.param(c, False, id=f"{c}-timeout") for c in CASES]
            + [pytest.param(c, True, id=f"{c}-ulfm", marks=marks) for c in ("dup", "lazy")])


if __name__ != "__main__":
    @pytest.mark.timeout(90)
    @pytest.mark.parametrize("case,ulfm", _params())
    def test_first_collective_on_one_rank_raises_and_the_communicator_stays_usable(case, ulfm, tmp_path):
        res = _job(case, ulfm, tmp_path)
        r0, r1 = res[0], res[1]
        assert r0["fault_tolerant"] == r1["fault_tolerant"] == ("ulfm" if ulfm else "timeout"), res
        # rank 0's lone call raised CommTimeout naming rank 0 and the operation
        assert r0["error"] == "CommTimeout", res
        assert r0["message"].startswith("rank 0: "), res
        ops = {"dup": "dup", "split": "split", "cart": "allreduce", "lazy": "allreduce", "init": "allreduce"}
        # (under ULFM the lazy duplicate's error names collective_transport: collectives/ulfm.py's start)
        assert r0["op"] in ((ops[case], "collective_transport") if ulfm and case == "lazy" else (ops[case],)), res
        # afterwards (where the case leaves it usable) both ranks get the right sums
        for r in (r0, r1):
            assert r["after"] == r["oracle"], res


if __name__ != "__main__":
    @pytest.mark.timeout(90)
    def test_first_attention_call_with_a_timeout_on_one_rank_raises(tmp_path):
        """A communicator that is NOT fault tolerant makes its collectives' transport
        on first use; an attention call given ``timeout`` bounds that too: rank 0's
        lone first ``ring_attention(timeout=T)`` raises CommTimeout naming rank 0
        and the call (it used to wait for ever in MPI_Comm_dup), and once rank 1
        calls, both get the dense attention's rows."""
        res = _job("plain-attention", False, tmp_path)
        r0, r1 = res[0], res[1]
        assert r0["fault_tolerant"] is None and r0["error"] == "CommTimeout", res
        assert r0["message"].startswith("rank 0: ") and r0["op"] == "ring_attention", res
        for r in (r0, r1):
            assert r["after"] == r["oracle"], res


# ------------------------------------------------------------------ the job
def _attention_case(c, rank, out, lone) -> None:
    """Rank 0's lone first ring attention with a timeout on a plain communicator,
    then both ranks' call against dense attention (rows of this rank's shard)."""
    import numpy as np

    from commlib.collectives import attention as A

    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 8, 2, 4)) for _ in range(3))  # (batch, seq, heads, head_dim)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    p = np.exp(s - s.max(-1, keepdims=True))
    dense = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)
    part = slice(4 * rank, 4 * rank + 4)
    mine = [x[:, part].copy() for x in (q, k, v)]
    lone(lambda: A.ring_attention(*mine, c, timeout=T))
    got, _ = A.ring_attention(*mine, c, timeout=30)  # rank 0 completes the duplicate it left posted
    out["after"] = bool(np.allclose(got, dense[:, part], rtol=1e-12, atol=1e-12))
    out["oracle"] = True


def main(case: str) -> None:
    import numpy as np
    from mpi4py import MPI

    import commlib
    from commlib import CommError

    world = MPI.COMM_WORLD
    c = commlib.init() if case.startswith("plain") else commlib.init(fault_tolerant=True, timeout=T)
    rank = c.rank
    out = {"rank": rank, "fault_tolerant": c.fault_tolerant, "error": None, "op": None, "after": None,
           "oracle": None}
    x = np.arange(5, dtype=np.float64) + 10 * rank
    oracle = np.empty_like(x)
    world.Allreduce(x, oracle)
    out["oracle"] = oracle.tolist()
    go = np.zeros(1, np.int32)

    def lone(fn):
        """Rank 0 calls ``fn`` alone; rank 1 waits for rank 0's word that it returned."""
        if rank == 0:
            try:
                fn()
            except CommError as exc:
                out.update(error=type(exc).__name__, op=exc.op, message=str(exc))
            world.Send(go, dest=1)
        else:
            world.Recv(go, source=0)

    if case == "plain-attention":
        _attention_case(c, rank, out, lone)
    elif case == "dup":
        lone(c.dup)
        c.send(np.ones(1), dest=1 - rank) if rank == 0 else c.recv(np.empty(1), source=0)  # still usable
        d = c.dup()  # rank 0 completes the dup it left posted
        out["after"] = d.allreduce(x.copy()).tolist()
        out["fault_tolerant"] = d.fault_tolerant
    elif case in ("split", "cart"):
        if case == "split":
            lone(lambda: c.split(0))
            s = c  # the split's barrier timed out: in "timeout" mode the communicator is broken now
            out["after"] = oracle.tolist()
        else:
            s = c.cart_create([2])
            out["fault_tolerant"] = s.fault_tolerant
            lone(lambda: s.allreduce(x.copy()))
            out["after"] = oracle.tolist()
    elif case == "lazy":
        # a fault-tolerant communicator without its collectives' transport (made on
        # first use, as before): the first collective on rank 0 alone is bounded
        d = c.dup()
        d._coll_tp.close()
        d._coll_tp = None
        lone(lambda: d.allreduce(x.copy()))
        out["after"] = d.allreduce(x.copy()).tolist()  # rank 0 completes the posted duplicate
    elif case == "init":
        lone(lambda: c.allreduce(x.copy()))
        out["after"] = oracle.tolist()
    Path(os.environ["FT_OUT_DIR"], f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
