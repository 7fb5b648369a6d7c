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
