"""The lines the apps print, in their own words: what a new user reads must not
contradict itself or the numbers beside it (a window longer than the sequence,
"1 ranks").  No MPI: the report is a function of the run's report dict."""
import pytest

pytest.importorskip("numpy")

from commlib.apps.lm.report import print_report, window_line  # noqa: E402


def _rep(**config):
    """A finished LM run's report, as small as print_report reads it."""
    c = dict(attention="ring", layout="zigzag", ulysses_degree=None, dtype="float32", d_model=64, layers=2,
             heads=4, kv_heads=2, pos="rope", batch=4, seq_len=256, steps=6, window=None, window_every=None)
    c.update(config)
    return dict(config=c, ranks=3, ranks_final=2, device="cpu", threads_per_rank=1, parameters=1000,
                sequence=dict(tokens_per_step=1024, packed=True, tokens_per_rank=512),
                data=dict(train_files=10, val_files=2), steps=[dict(step=1, train_loss=5.0, val_loss=None)],
                final_train_loss=4.0, final_val_loss=4.1, tokens_per_s=100.0, step_time_s=0.1,
                parameters_identical_across_ranks=True, memory_kind="max RSS", peak_memory_bytes_per_rank=[1, 1],
                failures=[], notes=[])


@pytest.mark.parametrize("layers,every", [(2, 1), (2, 2), (1, 3), (12, 5)])
def test_a_window_over_the_whole_sequence_says_it_masks_nothing(layers, every):
    """--window 1000 on a 256-token sequence: the line says the window covers the
    sequence (every layer then attends globally), with no "in the others"."""
    line = window_line(dict(window=1000, window_every=every, layers=layers, seq_len=256))
    assert line == ("  sliding-window attention: the window (1000 tokens) covers the whole 256-token sequence, "
                    "so it masks nothing: every layer attends globally (causal)"), line
    assert window_line(dict(window=256, window_every=1, layers=2, seq_len=256)).count("covers the whole") == 1


@pytest.mark.parametrize("layers,every,which", [
    (2, 1, "in every layer"),
    (1, 2, "in every layer"),  # the one layer is layer 0: local
    (2, 2, "in layer 0; global attention in the other layer"),
    (3, 2, "in layers 0, 2; global attention in the other layer"),
    (4, 5, "in layer 0; global attention in the other layers"),
    (12, 2, "in layers 0, 2, 4, 6, ...; global attention in the other layers"),
])
def test_the_window_line_names_the_local_layers_that_exist(layers, every, which):
    line = window_line(dict(window=7, window_every=every, layers=layers, seq_len=48))
    assert line == f"  sliding-window attention: 7 tokens (window_size (6, 0), causal) {which}", line


def test_print_report_carries_the_window_line_and_counts_ranks(capsys):
    rep = _rep(window=1000, window_every=1)
    rep["failures"] = [dict(world_rank=1, step=3, phase="backward", recovery_s=0.07, ranks_after=1),
                       dict(world_rank=2, step=4, phase="forward", recovery_s=0.05, ranks_after=2)]
    print_report(rep)
    out = capsys.readouterr().out
    assert "covers the whole 256-token sequence" in out and "in the others" not in out, out
    assert "the step redone on 1 rank\n" in out and "the step redone on 2 ranks\n" in out, out
    assert "1 ranks" not in out, out


def test_allreduce_says_it_reduces_in_place_unlike_mpi4py():
    """``comm.allreduce(x)`` overwrites and returns ``x`` (mpi4py's lowercase
    returns a new object): the docstring says so first thing, and it does."""
    import numpy as np  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    import commlib  # noqa: PLC0415

    doc = commlib.Communicator.allreduce.__doc__
    head = doc[:doc.index("Args:")]
    assert "In place by default" in head and "mpi4py" in head and "x.copy()" in head, head
    comm = commlib.init(MPI.COMM_SELF)
    x = np.arange(4.0)
    assert comm.allreduce(x) is x
    y = np.empty_like(x)
    assert comm.allreduce(x.copy(), y) is y


class _FakeUlfmComm:
    """TEST DOUBLE of a fault-tolerant communicator under ULFM for ResilientRunner:
    ``recover()`` loses COMM_WORLD rank 2 (the size drops by one)."""

    fault_tolerant = "ulfm"
    ft = None

    def __init__(self, rank=0, size=3):
        self.rank, self.size, self.failed_ranks = rank, size, ()

    def recover(self):
        self.failed_ranks, self.size = (2,), self.size - 1
        return (2,)

    def barrier(self):
        pass


def _one_failure(comm, **kw):
    import commlib  # noqa: PLC0415

    runner = commlib.ResilientRunner(comm, **kw)
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise commlib.ProcessFailed("a peer died", failed=(2,), rank=comm.rank, op="allreduce")
        return "done"

    assert runner.run(step) == "done" and len(runner.failures) == 1
    return runner


def test_a_recovery_is_said_in_one_line_with_what_open_mpis_nbc_lines_mean(capsys):
    """Rank 0 of the survivors says each recovery on stderr, one line: the lost rank,
    the time, the ranks left ("1 rank", not "1 ranks") and, under Open MPI, what
    the NBC_Progress lines it printed with the failure mean; other ranks say nothing;
    log=None nothing, a callable gets the line."""
    from commlib.resilient import recovery_line  # noqa: PLC0415

    _one_failure(_FakeUlfmComm(rank=0))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("commlib: lost COMM_WORLD rank 2; recovered in "), err
    assert err[0].split(" s, ", 1)[1].startswith("2 ranks redo the interrupted step from its last saved state"), err
    _one_failure(_FakeUlfmComm(rank=1))
    _one_failure(_FakeUlfmComm(rank=0), log=None)
    assert capsys.readouterr().err == ""
    got = []
    runner = _one_failure(_FakeUlfmComm(rank=0, size=2), log=got.append)
    assert got == [recovery_line(runner.failures[0], open_mpi="Open MPI" in _mpi_library())]
    assert " s, 1 rank redoes the interrupted step" in got[0] and "1 ranks" not in got[0]
    line = recovery_line(runner.failures[0], open_mpi=True)
    assert line.count("NBC_Progress: an error 75") == 1 and "MPI_ERR_PROC_FAILED" in line and "\n" not in line
    assert "NBC_Progress" not in recovery_line(runner.failures[0], open_mpi=False)


def _mpi_library() -> str:
    from mpi4py import MPI  # noqa: PLC0415

    return MPI.Get_library_version()


def test_resilient_runner_refuses_a_log_it_cannot_write_to():
    import commlib  # noqa: PLC0415

    with pytest.raises(commlib.InvalidArgument, match="log must be a file, \"stderr\", a callable or None"):
        commlib.ResilientRunner(_FakeUlfmComm(), log="recovery.log")  # a path is not a stream


def test_the_default_log_is_the_stderr_of_the_moment_it_speaks():
    """The default log follows ``sys.stderr`` as it is at the recovery, not as it was when
    commlib was imported or the runner made (a redirection made in between is honoured)."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    import commlib  # noqa: PLC0415

    runner = commlib.ResilientRunner(_FakeUlfmComm(rank=0))
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        calls = []

        def step():
            calls.append(1)
            if len(calls) == 1:
                raise commlib.ProcessFailed("a peer died", failed=(2,), rank=0, op="allreduce")
            return "done"

        assert runner.run(step) == "done"
    assert buf.getvalue().startswith("commlib: lost COMM_WORLD rank 2; recovered in "), buf.getvalue()
