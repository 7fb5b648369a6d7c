"""What the fault-injection harnesses share about launching ``mpiexec`` jobs.

Open MPI's launcher (prterun) can fail to start a job before any rank runs,
for reasons outside the program: on a loaded machine it printed, about once in
a few hundred launches, "The PMIx server's listener thread failed to start. We
cannot continue." and started no process.  A job that ends that way never ran
commlib, so it tests nothing: the harnesses launch it again (at most
``LAUNCH_ATTEMPTS`` times) instead of reporting a commlib failure.  Only
messages printed before any rank starts are listed, and a relaunch happens
only when no rank wrote a result.
"""
import os

LAUNCH_ATTEMPTS = 3

# prterun's messages for a job it could not start (no rank ran)
LAUNCHER_FAILURES = (
    "The PMIx server's listener thread failed to start",
)


def launcher_failed(text: str, results) -> bool:
    """True when ``mpiexec``'s output ``text`` says the launcher itself failed
    before starting the job and no rank wrote a result (``results`` empty)."""
    return not results and any(m in text for m in LAUNCHER_FAILURES)


# COMMLIB_FINALIZE_TIMEOUT of the fault-injection jobs (unless the environment sets it).
# After a failure, a survivor's MPI_Finalize under Open MPI 5.0's ULFM nearly always
# hangs until that bound ends the process (measured: 4-rank kill jobs took 2.2-4.2 s
# with 1 s against 4.3-6.9 s with the default 3 s, the results and recovery times
# the same), so the suite's ~100 kill jobs bound it at 1 s: the shortest alarm(2) takes.
FINALIZE_TIMEOUT = "1"

# Open MPI's TCP BTL flags without RDMA put (the default is
# "send,put,inplace,need-ack,need-csum,hetero-rdma"): large messages go as
# pipelined sends and ob1 sends no FIN, whose path wedged survivors under ULFM
# (docs/faults-and-security.md, "The Open MPI defect and its flag").  The same value as
# commlib.transports.mpi_process.TCP_FLAGS_WITHOUT_PUT.
TCP_FLAGS_WITHOUT_PUT = "send,inplace,need-ack,need-csum"


# COMMLIB_TEST_FT_TCP_FLAGS overrides the flags of the harnesses' ULFM jobs
# ("default": Open MPI's own, RDMA put on: the setting before issue 22)
FT_TCP_FLAGS = os.environ.get("COMMLIB_TEST_FT_TCP_FLAGS") or TCP_FLAGS_WITHOUT_PUT
FT_TCP_FLAGS = None if FT_TCP_FLAGS == "default" else FT_TCP_FLAGS


def ft_args(btl="tcp,self", tcp_flags=FT_TCP_FLAGS):
    """``mpiexec`` arguments of a ULFM job over the BTLs ``btl``, with the TCP
    BTL's flags ``tcp_flags`` (None: Open MPI's default, RDMA put on)."""
    args = ["--with-ft", "ulfm", "--mca", "btl", btl]
    if tcp_flags:
        args += ["--mca", "btl_tcp_flags", tcp_flags]
    return args + ["--prtemca", "state_base_error_non_zero_exit", "0"]


# mpiexec arguments of every fault-tolerant (ULFM) job the harnesses launch:
# survivors are told about failures (--with-ft ulfm), the TCP BTL (the
# shared-memory one did not report a killed rank), without RDMA put, and a
# rank that exits non-zero does not make prterun end the whole job.
FT_ARGS = ft_args()
# the same with Open MPI's default TCP flags (RDMA put on): the soak's other arm
FT_PUT_ARGS = ft_args(tcp_flags=None)


def run_job(cmd, env, timeout, started=None):
    """Run the ``mpiexec`` command ``cmd`` in a session of its own, bounded by ``timeout``
    seconds, launched again (at most ``LAUNCH_ATTEMPTS`` times) when the launcher itself
    failed before any rank ran (``started(text)`` False: no rank wrote a result; default:
    judged from the output alone).

    Returns:
        (returncode or None when it was killed at ``timeout``, stdout and stderr as text).
    """
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    rc, text = None, ""
    for _ in range(LAUNCH_ATTEMPTS):
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            text = p.communicate(timeout=timeout)[0].decode(errors="replace")
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text = p.communicate()[0].decode(errors="replace")
            return None, text
        if not launcher_failed(text, [1] if started is not None and started(text) else []):
            break
    return rc, text
