#!/usr/bin/env python3
"""Start an elastic job on this machine: a master plus N peers on loopback, with churn.

Every process writes its own log under --logdir (master.log, peer0.log, ...); each
peer of the default app (``python -m commlib.apps.diloco``) also writes peerK.json.
A random secret (32 bytes, mode 0600) is made in --logdir unless --secret-file is given.

Churn schedule (--churn): comma-separated events, times in seconds since training started
(the first outer step in a peer's log, for the DiLoCo app; see --ready-pattern):

    T:kill:I    SIGKILL peer I (launch order, 0-based); T:kill picks a random live peer
    T:leave:I   SIGTERM peer I: the DiLoCo app leaves gracefully at its next step boundary
    T:join      start one more peer

Examples::

    python jobs/elastic/launch_local.py --peers 3
    python jobs/elastic/launch_local.py --peers 3 --churn "6:kill:1,9:join,14:leave:0,16:join" \\
        --logdir /tmp/diloco -- --outer-steps 40 --quantize int8

Arguments after ``--`` go to every peer. With the DiLoCo app, the first --peers peers wait
for each other (--min-peers N) before step 1; joiners do not wait. At the end the launcher
prints each peer's outcome and checks that every peer that finished holds the same
parameters (SHA-256 of theta); exit status 0 when at least one finished and all agree.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_churn(text: str):
    """``"6:kill:1,9:join"`` → ``[(6.0, "kill", 1), (9.0, "join", None)]`` sorted by time; ValueError if malformed."""
    events = []
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        parts = item.split(":")
        try:
            t = float(parts[0])
        except ValueError:
            raise ValueError(f"bad churn event {item!r}: time must be a number of seconds") from None
        if not math.isfinite(t):
            raise ValueError(f"bad churn event {item!r}: time must be a finite number of seconds")
        if t < 0 or len(parts) < 2 or parts[1] not in ("kill", "leave", "join"):
            raise ValueError(f"bad churn event {item!r}: expected T:kill[:I], T:leave:I or T:join")
        what = parts[1]
        idx = None
        if len(parts) > 2:
            if what == "join" or len(parts) > 3 or not parts[2].isdigit():
                raise ValueError(f"bad churn event {item!r}: peer index must be a non-negative integer")
            idx = int(parts[2])
        elif what == "leave":
            raise ValueError(f"bad churn event {item!r}: leave needs a peer index")
        events.append((t, what, idx))
    return sorted(events, key=lambda e: e[0])


LISTENING = "commlib master listening on "


def wait_listening(log_path: str, proc, timeout: float) -> str | None:
    """The address the master printed (``commlib master listening on HOST:PORT``) once it listens;
    None when ``proc`` exits first or ``timeout`` seconds pass. Reading the master's own line, not
    dialling the port, so another program listening there is never taken for the master."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.startswith(LISTENING):
                        return line[len(LISTENING):].strip()
        except OSError:
            pass
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


class Job:
    def __init__(self, args, peer_args):
        self.args, self.peer_args = args, peer_args
        self.logdir = os.path.abspath(args.logdir)
        os.makedirs(self.logdir, exist_ok=True)
        self.secret = args.secret_file
        if self.secret is None:
            self.secret = os.path.join(self.logdir, "secret")
            fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(secrets.token_bytes(32))
        self.address = f"127.0.0.1:{args.port}"  # port 0: the master picks a free one and prints it
        self.master = None
        self.peers: list[dict] = []
        self.t0 = time.monotonic()
        self.rng = random.Random(args.seed)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def log(self, msg):
        print(f"[launch {time.monotonic() - self.t0:7.2f} s] {msg}", flush=True)

    def start_master(self):
        fh = open(os.path.join(self.logdir, "master.log"), "wb")
        cmd = [sys.executable, "-P", "-m", "commlib.cli", "master", "--bind", self.address,
               "--secret-file", self.secret, *self.args.master_arg]
        self.master = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=self.env)
        address = wait_listening(fh.name, self.master, 60)
        if address is None:
            rc = self.master.poll()
            if rc is None:
                self.master.kill()
                self.master.wait()
            fh.close()
            with open(fh.name, encoding="utf-8", errors="replace") as log:
                last = (log.read().strip().splitlines() or ["(no output)"])[-1]
            print(f"launch_local.py: error: the master did not listen on {self.address}"
                  + (f" (exit status {rc})" if rc is not None else " within 60 s") + f": {last}", file=sys.stderr)
            raise SystemExit(2 if rc == 2 else 1)
        self.address = address
        self.log(f"master at {self.address} (pid {self.master.pid})")

    def start_peer(self, initial: bool):
        k = len(self.peers)
        log = open(os.path.join(self.logdir, f"peer{k}.log"), "wb")
        cmd = [sys.executable, "-P", "-m", self.args.module, "--master", self.address, "--secret-file", self.secret]
        if self.args.module == "commlib.apps.diloco":
            cmd += ["--json", os.path.join(self.logdir, f"peer{k}.json"), "--no-progress"]
            if initial:
                cmd += ["--min-peers", str(self.args.peers)]
        cmd += self.peer_args
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=self.env)
        self.peers.append({"index": k, "proc": p, "log": log.name, "started_s": time.monotonic() - self.t0,
                           "fate": None})
        self.log(f"peer {k} started (pid {p.pid}){' as a joiner' if not initial else ''}")

    def _any_log_has(self, pattern: str) -> bool:
        for q in self.peers:
            try:
                with open(q["log"], "rb") as fh:
                    if pattern.encode() in fh.read():
                        return True
            except OSError:
                pass
        return False

    def live(self):
        return [q for q in self.peers if q["proc"].poll() is None]

    def apply(self, what, idx):
        if what == "join":
            self.start_peer(initial=False)
            return
        live = self.live()
        if idx is None:
            if not live:
                self.log(f"{what}: no live peer")
                return
            q = self.rng.choice(live)
        else:
            if idx >= len(self.peers) or self.peers[idx]["proc"].poll() is not None:
                self.log(f"{what}:{idx}: peer {idx} is not running, skipped")
                return
            q = self.peers[idx]
        sig = signal.SIGKILL if what == "kill" else signal.SIGTERM
        q["proc"].send_signal(sig)
        q["fate"] = "killed" if what == "kill" else "asked to leave"
        self.log(f"{what}: peer {q['index']} (pid {q['proc'].pid}) {sig.name}")

    def run(self, churn):
        self.start_master()
        for _ in range(self.args.peers):
            self.start_peer(initial=True)
        deadline = time.monotonic() + self.args.timeout
        pattern = self.args.ready_pattern
        if pattern is None and self.args.module == "commlib.apps.diloco":
            pattern = "step 1/"
        if pattern and churn:  # the churn clock starts when training does (start-up can take seconds)
            while time.monotonic() < deadline and not self._any_log_has(pattern) and self.live():
                time.sleep(0.1)
            self.log(f"churn clock starts ({pattern!r} seen)")
        t_start = time.monotonic()
        pending = list(churn)
        while time.monotonic() < deadline:
            now = time.monotonic() - t_start
            while pending and pending[0][0] <= now and self.live():
                _, what, idx = pending.pop(0)
                self.apply(what, idx)
            if not self.live():
                # the job is over (finished, left or died): a joiner now would find no peer
                # holding the state, so what is left of the schedule is skipped
                if pending:
                    self.log(f"no live peer: skipped {len(pending)} churn event(s) from "
                             f"{pending[0][0]:g} s on (the job ended first; lengthen it, e.g. --outer-steps)")
                break
            time.sleep(0.05)
        else:
            self.log(f"timeout after {self.args.timeout:g} s: killing what is left")
            for q in self.live():
                q["proc"].kill()
                q["fate"] = "timed out"
        for q in self.peers:
            q["proc"].wait()
        self.master.terminate()
        try:
            self.master.wait(10)
        except subprocess.TimeoutExpired:
            self.master.kill()
        return self.summary()

    def summary(self):
        rows, hashes, ok = [], set(), True
        for q in self.peers:
            rc = q["proc"].returncode
            row = {"peer": q["index"], "rc": rc, "fate": q["fate"] or ("finished" if rc == 0 else "failed"),
                   "log": q["log"]}
            path = os.path.join(self.logdir, f"peer{q['index']}.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    rep = json.load(fh)
                row.update({k: rep.get(k) for k in ("finished", "own_outer_steps", "outer_steps_done",
                                                     "final_accuracy", "theta_sha256")})
                if rep.get("finished"):
                    hashes.add(rep["theta_sha256"])
            if q["fate"] is None and rc != 0:
                ok = False
            rows.append(row)
        for r in rows:
            acc = r.get("final_accuracy")
            self.log(f"peer {r['peer']}: {r['fate']} (rc {r['rc']})"
                     + (f", {r.get('own_outer_steps')} own steps, job step {r.get('outer_steps_done')}, "
                        f"accuracy {acc:.4f}, theta {str(r.get('theta_sha256'))[:16]}" if acc is not None else "")
                     + f"  [{r['log']}]")
        if self.args.module == "commlib.apps.diloco":
            if not hashes:
                self.log("no peer finished the job")
                ok = False
            elif len(hashes) > 1:
                self.log(f"MISMATCH: finished peers hold {len(hashes)} different parameter vectors")
                ok = False
            else:
                self.log("every finished peer holds the same parameters (SHA-256 of theta)")
        with open(os.path.join(self.logdir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump({"address": self.address, "peers": rows, "ok": ok}, fh, indent=2)
        return ok


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    peer_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, peer_args = argv[:i], argv[i + 1:]
    from commlib.cli import OneLineParser  # noqa: PLC0415 - a bad value: one line, exit status 2

    p = OneLineParser(prog="launch_local.py", description=__doc__.split("\n\n")[0],
                      epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=3, help="peers started at once (default 3)")
    p.add_argument("--churn", default="", help="churn schedule, e.g. '6:kill:1,9:join' (see above)")
    p.add_argument("--logdir", default="elastic_logs", help="folder for logs, reports and the secret "
                   "(default elastic_logs, made if missing)")
    p.add_argument("--secret-file", default=None, help="use this secret (at least 16 bytes) instead of a fresh one")
    p.add_argument("--port", type=int, default=0, help="master port on 127.0.0.1 (default 0: a free one)")
    p.add_argument("--module", default="commlib.apps.diloco", help="peer program (python -m MODULE; "
                   "default commlib.apps.diloco)")
    p.add_argument("--master-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for commlib master, repeatable; one that starts with - is given as "
                        "--master-arg=--heartbeat-timeout=5")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before everything left is killed "
                   "(default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of random kill targets (default 0)")
    p.add_argument("--ready-pattern", default=None, help="churn times count from the moment a peer's log shows "
                   "this text (default for the DiLoCo app: 'step 1/', its first completed outer step)")
    args = p.parse_args(argv)
    if args.peers < 1:
        p.error(f"--peers must be >= 1, got {args.peers}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error(f"--timeout must be a positive, finite number of seconds, got {args.timeout}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in 0..65535, got {args.port}")
    if args.secret_file is not None and not (os.path.isfile(args.secret_file)
                                             and os.access(args.secret_file, os.R_OK)):
        p.error(f"--secret-file {args.secret_file!r} is not a readable file")
    try:
        churn = parse_churn(args.churn)
    except ValueError as exc:
        p.error(f"--churn: {exc}")
    try:
        os.makedirs(args.logdir, exist_ok=True)
    except OSError as exc:
        p.error(f"--logdir {args.logdir!r}: {exc.strerror or exc}")
    if not os.access(args.logdir, os.W_OK | os.X_OK):
        p.error(f"--logdir {args.logdir!r} is not writable")
    job = Job(args, peer_args)
    try:
        return 0 if job.run(churn) else 1
    except KeyboardInterrupt:
        for q in job.live():
            q["proc"].kill()
        if job.master is not None:
            job.master.kill()
        return 130


if __name__ == "__main__":
    sys.exit(main())
