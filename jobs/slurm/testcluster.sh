#!/usr/bin/env bash
# A throw-away Slurm cluster on this host, for the tests (tests/test_slurm.py) and for trying
# the job scripts by hand: Debian's slurmctld and slurmd (installed here when missing; root
# only), one node or two (two slurmd on this host with their own ports and spool folders),
# started in the background without systemd, each node claiming CPUS CPUs whatever the machine
# has (SlurmdParameters=config_overrides). Everything (config, state, logs, PIDs) lives in one
# folder; the ports are free ones picked at start, so two clusters side by side do not meet.
# No munge: auth/none and cred/none (a cluster of one host, for tests only).
#
#   bash jobs/slurm/testcluster.sh run [CMD...]   # start, run CMD with SLURM_CONF set (default:
#                                                 # sinfo), stop: also when CMD or the start fails
#   bash jobs/slurm/testcluster.sh start          # start, print SLURM_CONF=...; stop it yourself:
#   bash jobs/slurm/testcluster.sh stop
#
# Environment: DIR (the cluster's folder; default /tmp/commlib-slurm), NODES (1 or 2; default 1),
# CPUS (per node; default 4), OWNER (start: a PID; when it ends, the cluster is stopped: a test
# run killed on its time limit leaves no daemon behind), START_TIMEOUT (seconds; default 30).
# Stops exactly the daemons it started, by the PIDs it recorded (after cancelling the jobs).
set -euo pipefail
DIR=${DIR:-/tmp/commlib-slurm}
NODES=${NODES:-1}
CPUS=${CPUS:-4}
OWNER=${OWNER:-}
START_TIMEOUT=${START_TIMEOUT:-30}
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
CONF=$DIR/slurm.conf
say() { echo "testcluster: $*"; }
die() { echo "testcluster: error: $*" >&2; exit "${2:-1}"; }

case "$NODES" in 1 | 2) ;; *) die "NODES must be 1 or 2, got '$NODES'" 2 ;; esac
case "$CPUS" in '' | *[!0-9]* | 0) die "CPUS must be a whole number > 0, got '$CPUS'" 2 ;; esac

# install Debian's packages where missing; the pmix plugin loads the unversioned libpmix.so
install_slurm() {
  local missing=() p
  for p in slurmctld slurmd slurm-client libpmix2; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "not root: cannot install ${missing[*]}" 3
    say "installing ${missing[*]} (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >"$DIR/apt.log" 2>&1 ||
      { apt-get update -q >>"$DIR/apt.log" 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$DIR/apt.log" 2>&1; } ||
      die "apt-get install ${missing[*]} failed (log: $DIR/apt.log)" 3
  fi
  local lib
  for lib in /usr/lib/*-linux-gnu/libpmix.so.2 /usr/lib/*-linux-gnu/pmix2/lib/libpmix.so.2; do
    [ -e "$lib" ] && [ ! -e "${lib%.2}" ] && ln -s "$(basename "$lib")" "${lib%.2}"
  done
  return 0
}

free_ports() {  # N free TCP ports on this host, below the kernel's ephemeral range
  # (ip_local_port_range, 32768 and up by default): a port the kernel hands out for
  # bind(0) or connect() could be taken by another job's socket (an MPI job's TCP
  # transport) between this check and the daemons' start
  python3 - "$1" <<'EOF'
import random, socket, sys
lo = 20000
try:
    hi = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    hi = 32768
hi = max(hi, lo + 1000)
socks = []
for port in random.sample(range(lo, hi), 200):
    s = socket.socket()
    try:
        s.bind(("", port))
    except OSError:
        s.close()
        continue
    socks.append(s)
    if len(socks) == int(sys.argv[1]):
        break
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_conf() {
  local host ports i
  host=$(hostname -s)
  read -r -a ports <<<"$(free_ports $((NODES + 1)))"
  mkdir -p "$DIR/state" "$DIR/log" "$DIR/tmp"
  cat >"$CONF" <<EOF
# written by $SELF
ClusterName=commlibtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdSpoolDir=$DIR/spool-%n
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=5
PlugStackConfig=$DIR/plugstack.conf
TmpFS=$DIR/tmp
DebugFlags=NO_CONF_HASH
EOF
  : >"$DIR/plugstack.conf"
  for i in $(seq 1 "$NODES"); do
    mkdir -p "$DIR/spool-c$i"
    echo "NodeName=c$i NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[$i]} CPUs=$CPUS State=UNKNOWN" >>"$CONF"
  done
  echo "PartitionName=debug Nodes=c[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$CONF"
  # every node its own TmpFS (the pmix plugin makes its step folders there, by job and step
  # only: two nodes on one host would collide): a copy of the config for each slurmd
  for i in $(seq 1 "$NODES"); do
    mkdir -p "$DIR/tmp-c$i"
    sed "s|^TmpFS=.*|TmpFS=$DIR/tmp-c$i|" "$CONF" >"$DIR/slurm-c$i.conf"
  done
}

# a recorded PID is ours while its command line still names our config (not a reused PID)
ours() { [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- " $DIR/slurm"; }
# a child started by this script is running (a zombie or a gone PID is not): during the
# start a daemon's PID can still be the forked shell before its exec (a loaded machine
# widens that window), whose command line is not yet the daemon's, so not ours yet
running() { [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

# the step daemons of this cluster's jobs (their SLURM_CONF is one of ours), and the tasks under them
stepds() {
  local p
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] &&
      { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -q "^SLURM_CONF=$DIR/slurm" && echo "${p#/proc/}"
  done
  return 0
}
tree() { local c; for c in $(pgrep -P "$1" || true); do tree "$c"; done; echo "$1"; }

stop() {
  [ -f "$DIR/pids" ] || return 0
  local name pid alive t left
  if [ -x "$(command -v scancel)" ] && [ -f "$CONF" ] && [ -n "$(SLURM_CONF=$CONF timeout 5 squeue -h 2>/dev/null)" ]; then
    say "cancelling the jobs still queued or running"
    SLURM_CONF=$CONF timeout 5 scancel --full --quiet --user=root 2>/dev/null || true
    for t in $(seq 1 50); do  # their steps end (up to KillWait) before the daemons go
      [ -z "$(stepds)" ] && break
      sleep 0.2
    done
  fi
  # slurmd first (its steps end with it), then slurmctld
  for name in slurmd slurmctld; do
    while read -r n pid; do
      [ "${n%%:*}" = "$name" ] && ours "$pid" && kill -TERM "$pid" 2>/dev/null && say "stopping $n (PID $pid)"
    done <"$DIR/pids"
  done
  for t in $(seq 1 50); do
    alive=""
    while read -r n pid; do ours "$pid" && alive="$alive $n:$pid"; done <"$DIR/pids"
    [ -z "$alive" ] && break
    [ "$t" = 50 ] && { say "killing$alive (still up after 5 s)"; for p in $alive; do kill -KILL "${p##*:}" 2>/dev/null || true; done; }
    sleep 0.1
  done
  left=$(stepds)
  if [ -n "$left" ]; then
    say "killing the steps left behind: slurmstepd PID(s)" $left "and their tasks"
    for pid in $left; do kill -KILL $(tree "$pid") 2>/dev/null || true; done
  fi
  rm -f "$DIR/pids"
  if [ -f "$DIR/watch.pid" ]; then
    pid=$(cat "$DIR/watch.pid")
    rm -f "$DIR/watch.pid"
    [ "$pid" != "$$" ] && kill -TERM "$pid" 2>/dev/null || true
  fi
  say "stopped (folder $DIR)"
}

start() {
  local t0=$SECONDS i pid n idle
  mkdir -p "$DIR"
  [ -f "$DIR/pids" ] && { say "a cluster from an earlier start is in $DIR: stopping it first"; stop; }
  install_slurm
  [ "$(id -u)" = 0 ] || die "not root: slurmd must run as root" 3
  rm -rf "$DIR/state" "$DIR"/spool-* "$DIR/tmp" "$DIR"/tmp-* "$DIR/log" "$DIR"/slurm-c*.conf
  write_conf
  : >"$DIR/pids"
  setsid slurmctld -D -i -f "$CONF" </dev/null >"$DIR/log/slurmctld.out" 2>&1 &
  echo "slurmctld $!" >>"$DIR/pids"
  say "slurmctld PID $!"
  for i in $(seq 1 "$NODES"); do
    setsid slurmd -D -N "c$i" -f "$DIR/slurm-c$i.conf" </dev/null >"$DIR/log/slurmd-c$i.out" 2>&1 &
    echo "slurmd:c$i $!" >>"$DIR/pids"
    say "slurmd c$i PID $!"
  done
  if [ -n "$OWNER" ]; then  # stop the cluster when the owner ends, however it ends
    setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$2/pids" ]; do sleep 1; done
                    [ -f "$2/pids" ] && DIR=$2 OWNER= bash "$3" stop' _ "$OWNER" "$DIR" "$SELF" </dev/null >>"$DIR/log/watch.out" 2>&1 &
    echo $! >"$DIR/watch.pid"
  fi
  while :; do
    while read -r n pid; do
      running "$pid" || { say "$n (PID $pid) exited during start; its log:"; tail -n 15 "$DIR/log/${n/:/-}.log" "$DIR/log/${n/:/-}.out" 2>/dev/null; stop; exit 1; }
    done <"$DIR/pids"
    idle=$(SLURM_CONF=$CONF timeout 5 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l) || idle=0
    [ "$idle" -ge "$NODES" ] && break
    if [ $((SECONDS - t0)) -ge "$START_TIMEOUT" ]; then
      say "the nodes are not idle after $START_TIMEOUT s:"
      SLURM_CONF=$CONF timeout 5 sinfo -N -l 2>&1 || true
      tail -n 15 "$DIR/log/slurmctld.log" 2>/dev/null || true
      stop
      exit 1
    fi
    sleep 0.3
  done
  say "$NODES node(s) idle, $CPUS CPUs each, after $((SECONDS - t0)) s"
  echo "SLURM_CONF=$CONF"
}

cmd=${1:-run}
[ $# -gt 0 ] && shift
case "$cmd" in
  start) start ;;
  stop) stop ;;
  run)
    trap 'rc=$?; trap - EXIT INT TERM; stop; exit $rc' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    start
    export SLURM_CONF=$CONF
    if [ $# -eq 0 ]; then sinfo -N; else "$@"; fi
    ;;
  -h | --help) sed -n '2,18p' "$SELF" | sed 's/^# \{0,1\}//' ;;
  *) die "unknown command '$cmd' (start, stop, run)" 2 ;;
esac
