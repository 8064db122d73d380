#!/usr/bin/env bash
# local_slurm.sh - a real SLURM cluster on this machine, for the tests/launch suite and for trying
# `setdiff launch --slurm` by hand: this host as one node, plus two more nodes, each a slurmd in
# its own network and hostname namespaces (its own address on a bridge), for multi-node jobs.
# Debian 12 (slurm 22.05) as root, without systemd.
#
#   tools/local_slurm.sh start     install munge/slurm if missing, start munged + slurmctld + the
#                                  slurmds, wait until the nodes are idle (about 15 s from nothing)
#   tools/local_slurm.sh status    are our daemons alive, and what sinfo says
#   tools/local_slurm.sh stop      cancel jobs, stop exactly the daemons `start` started (by pid)
#
# What it touches: /etc/slurm/slurm.conf (written with a marker line; a file without the marker,
# i.e. a real cluster's, is never overwritten and makes `start` refuse), /etc/munge/munge.key (only
# created if missing), /run/munge, its state directory $SETDIFF_SLURM_DIR (default
# /tmp/setdiff-local-slurm: spool directories, daemon logs, and `pids` with "name pid exe" lines),
# and for the extra nodes a bridge `sdslurm0` ($SUBNET.1/24), network namespaces `sdnode1`,
# `sdnode2` ($SUBNET.2, .3) and their lines in /etc/hosts (marked; `stop` removes all three).
# Knobs: SETDIFF_SLURM_DIR, SETDIFF_SLURM_WAIT_S (default 60), SETDIFF_SLURM_NODES (namespace nodes,
# default 2; 0 for this host alone), SETDIFF_SLURM_SUBNET (default 10.77.0).
#
# Nodes: this host with NodeAddr 127.0.0.1, all its CPUs and 95% of its memory, alone in partition
# `debug` (the default); sdnode1 and sdnode2 in partition `multi`, each with all CPUs and a quarter
# of the memory, sharing this host's filesystem (so a run directory is shared, as on a cluster with
# a network filesystem) but nothing else. Without the rights to make namespaces, `start` says so
# and brings up `debug` alone; with CI=true in the environment it fails instead (CI runs the
# two-node tests, and tests/launch/slurm_cluster.py fails them there rather than skipping them). No accounting (sacct does not work; use `scontrol show job`). Facts
# worth knowing:
# a job requeued with `scontrol requeue` waits about 120 s before it may start again (its BeginTime)
# unless released with `scontrol update jobid=ID StartTime=now`; `scancel --signal=USR1 --batch ID`
# delivers USR1 to the batch shell within about a second.
set -euo pipefail

STATE=${SETDIFF_SLURM_DIR:-/tmp/setdiff-local-slurm}
PIDS=$STATE/pids
CONF=/etc/slurm/slurm.conf
MARK="# written by setdiff-megatron tools/local_slurm.sh"
WAIT_S=${SETDIFF_SLURM_WAIT_S:-60}
NODES=${SETDIFF_SLURM_NODES:-2}
SUBNET=${SETDIFF_SLURM_SUBNET:-10.77.0}
BRIDGE=sdslurm0
HOSTS_MARK="# setdiff-local-slurm node"

say() { echo "[local_slurm] $*"; }
die() { echo "[local_slurm] error: $*" >&2; exit 1; }

# A recorded daemon is ours only while its pid still runs the recorded binary (pids get reused).
alive() { [ -d "/proc/$1" ] && [ "$(readlink "/proc/$1/exe" 2>/dev/null)" = "$2" ]; }
recorded() { [ -f "$PIDS" ] && awk -v n="$1" '$1 == n' "$PIDS" | tail -n1; }
running() { local line; line=$(recorded "$1"); [ -n "$line" ] && alive $(echo "$line" | cut -d' ' -f2-); }

wait_pidfile() { # name pidfile exe: wait for the daemon's pid file, then record it
  local pid=""
  for _ in $(seq 1 50); do
    pid=$({ tr -dc '0-9' < "$2"; } 2>/dev/null || true)
    [ -n "$pid" ] && alive "$pid" "$3" && { echo "$1 $pid $3" >> "$PIDS"; say "$1 started (pid $pid)"; return 0; }
    sleep 0.2
  done
  return 1
}

install_packages() {
  local need=() p
  for p in munge slurmctld slurmd slurm-client; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing packages ${need[*]} and no apt-get to install them"
  say "installing ${need[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The packages' own services are not started: there is no systemd here, and we start the daemons.
  apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold "${need[@]}" >/dev/null
}

# The namespace nodes: sdnode<i> at $SUBNET.<i+1>, a veth pair from the bridge to its eth0.
net_up() {
  local i n
  command -v ip >/dev/null || { say "no ip command"; return 1; }
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge 2>/dev/null && ip addr add "$SUBNET.1/24" dev "$BRIDGE" && ip link set "$BRIDGE" up \
      || { ip link del "$BRIDGE" 2>/dev/null; return 1; }
  fi
  for i in $(seq 1 "$NODES"); do
    n=sdnode$i
    ip netns list | grep -qw "$n" || ip netns add "$n" || return 1
    if ! ip netns exec "$n" ip link show eth0 >/dev/null 2>&1; then
      ip link add "v$n" type veth peer name eth0 netns "$n" && ip link set "v$n" master "$BRIDGE" up \
        && ip netns exec "$n" ip addr add "$SUBNET.$((i + 1))/24" dev eth0 && ip netns exec "$n" ip link set eth0 up \
        && ip netns exec "$n" ip link set lo up || return 1
    fi
    grep -q "^$SUBNET.$((i + 1)) $n " /etc/hosts || echo "$SUBNET.$((i + 1)) $n $HOSTS_MARK" >> /etc/hosts
  done
}

net_down() {
  local n
  for n in $(ip netns list 2>/dev/null | awk '$1 ~ /^sdnode[0-9]+$/ {print $1}'); do ip netns del "$n"; done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
  if grep -qF "$HOSTS_MARK" /etc/hosts 2>/dev/null; then # rewritten in place: /etc/hosts may be a mount
    grep -vF "$HOSTS_MARK" /etc/hosts > "$STATE/hosts.tmp"; cat "$STATE/hosts.tmp" > /etc/hosts; rm -f "$STATE/hosts.tmp"
  fi
}

write_conf() {
  local node=$1 multi=$2 cpus mem ctld=127.0.0.1 i
  cpus=$(nproc)
  # 5% below MemTotal: slurmd drains a node that reports less memory than configured.
  mem=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)
  if [ -f "$CONF" ] && ! grep -qxF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script (a real cluster's?); not touching it"
  fi
  install -d -m 0755 /etc/slurm "$STATE/ctld" "$STATE/d" "$STATE/log"
  if [ "$multi" -gt 0 ]; then ctld=$SUBNET.1; fi # reachable from the namespaces too
  # SlurmdTimeout=30: a lost node is marked down within about 40 s (the node-loss test waits for
  # it); slurmd answers slurmctld's pings (every 10 s) at once on a loaded machine too.
  cat > "$CONF.tmp" <<EOF
$MARK
ClusterName=setdiff-local
SlurmctldHost=$node($ctld)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=15
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d/%n
SlurmctldPidFile=$STATE/ctld/slurmctld.pid
SlurmdPidFile=$STATE/d/%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$multi" -gt 0 ]; then
    for i in $(seq 1 "$multi"); do
      echo "NodeName=sdnode$i NodeAddr=$SUBNET.$((i + 1)) CPUs=$cpus RealMemory=$((mem / 4)) State=UNKNOWN" >> "$CONF.tmp"
    done
    echo "PartitionName=multi Nodes=sdnode[1-$multi] MaxTime=INFINITE State=UP" >> "$CONF.tmp"
  fi
  mv -f "$CONF.tmp" "$CONF"
  chmod 0644 "$CONF"
}

start_munge() {
  install -d -m 0700 -o munge -g munge /etc/munge
  install -d -m 0755 -o munge -g munge /run/munge /var/lib/munge /var/log/munge
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged already answers; using it"
    return 0
  fi
  local exe; exe=$(readlink -f /usr/sbin/munged)
  rm -f /run/munge/munged.pid
  runuser -u munge -- "$exe" || die "munged did not start (see /var/log/munge/munged.log)"
  wait_pidfile munged /run/munge/munged.pid "$exe" || die "munged did not write its pid file"
}

start_daemon() { # name pidfile port args...
  local name=$1 pidfile=$2 port=$3 exe; shift 3
  exe=$(readlink -f "/usr/sbin/$name")
  if running "$name"; then say "$name already running (ours)"; return 0; fi
  if ss -ltn 2>/dev/null | awk '{print $4}' | grep -qE ":$port\$"; then
    die "port $port is taken by another process (another $name?)"
  fi
  rm -f "$pidfile"
  "$exe" "$@" || die "$name did not start; see $STATE/log/$name.log"
  wait_pidfile "$name" "$pidfile" "$exe" || { tail -n 20 "$STATE/log/$name.log" >&2; die "$name did not stay up"; }
}

start_node() { # a slurmd in network namespace $1 (nsenter: `ip netns exec` would hide the cgroup mounts),
  # under hostname $1, so that its jobs resolve and bind its address
  local exe; exe=$(readlink -f /usr/sbin/slurmd)
  if running "slurmd-$1"; then say "slurmd-$1 already running (ours)"; return 0; fi
  install -d -m 0755 "$STATE/d/$1"
  rm -f "$STATE/d/$1.pid"
  nsenter --net="/run/netns/$1" unshare --uts sh -c "hostname $1 && exec $exe -N $1" \
    || die "slurmd of $1 did not start; see $STATE/log/slurmd-$1.log"
  wait_pidfile "slurmd-$1" "$STATE/d/$1.pid" "$exe" \
    || { tail -n 20 "$STATE/log/slurmd-$1.log" >&2; die "slurmd of $1 did not stay up"; }
}

wait_idle() { # node
  local deadline=$(( $(date +%s) + WAIT_S )) state="" resumed=0
  while [ "$(date +%s)" -lt "$deadline" ]; do
    state=$(timeout 10 sinfo -h -n "$1" -o %T 2>/dev/null | head -n1 || true)
    case "$state" in
      idle|mixed|allocated|completing) return 0 ;;
      down*|drain*)
        [ $resumed -eq 0 ] && { scontrol update nodename="$1" state=resume 2>/dev/null || true; resumed=1; } ;;
    esac
    sleep 0.5
  done
  sinfo -R >&2 || true
  tail -n 15 "$STATE/log/slurmctld.log" "$STATE/log/slurmd-$1.log" >&2 || true
  die "node $1 not idle after ${WAIT_S}s (state '${state:-no answer}'); daemons left up, stop them with $0 stop"
}

cmd_start() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (it starts system daemons)"
  local t0 node; t0=$(date +%s)
  install_packages
  mkdir -p "$STATE"
  if [ -f "$PIDS" ]; then # forget daemons of an earlier start that are gone
    while read -r n p e; do alive "$p" "$e" && echo "$n $p $e"; done < "$PIDS" > "$PIDS.tmp" || true
    mv -f "$PIDS.tmp" "$PIDS"
  fi
  node=$(hostname -s 2>/dev/null || true); node=${node:-localhost}
  local multi=0 i where
  if [ "$NODES" -gt 0 ]; then
    if net_up; then multi=$NODES; else
      net_down
      # In CI (CI=true) the two-node tests must run: one node there hides a broken set-up.
      [ "${CI:-}" = true ] && die "could not make network namespaces for partition multi's $NODES nodes; CI=true, so no fallback to one node (SETDIFF_SLURM_NODES=0 asks for this host alone)"
      say "could not make network namespaces here; partition debug only, no multi-node jobs"
    fi
  fi
  write_conf "$node" "$multi"
  start_munge
  start_daemon slurmctld "$STATE/ctld/slurmctld.pid" 6817
  start_daemon slurmd "$STATE/d/$node.pid" 6818 -N "$node"
  for i in $(seq 1 "$multi"); do start_node "sdnode$i"; done
  wait_idle "$node"
  for i in $(seq 1 "$multi"); do wait_idle "sdnode$i"; done
  sinfo
  where="node $node in partition debug"
  if [ "$multi" -gt 0 ]; then where="$where, sdnode[1-$multi] in partition multi"; fi
  say "up in $(( $(date +%s) - t0 )) s: $where; stop with: $0 stop"
}

cmd_stop() {
  if [ ! -s "$PIDS" ]; then say "nothing recorded in $PIDS; nothing to stop"; return 0; fi
  if running slurmctld; then
    local jobs; jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      say "cancelling jobs $jobs"
      timeout 10 scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 40); do [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  local rc=0 name line pid exe
  for name in $(awk '{print $1}' "$PIDS" | tac | awk '!seen[$0]++'); do # reverse start order
    line=$(recorded "$name"); [ -n "$line" ] || continue
    read -r _ pid exe <<<"$line"
    alive "$pid" "$exe" || continue
    say "stopping $name (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 1 30); do alive "$pid" "$exe" || break; sleep 0.5; done
    if alive "$pid" "$exe"; then kill -KILL "$pid"; sleep 1; fi
    alive "$pid" "$exe" && { say "$name (pid $pid) is still alive"; rc=1; }
  done
  if [ $rc -eq 0 ]; then
    rm -f "$PIDS"
    [ -f "$CONF" ] && grep -qxF "$MARK" "$CONF" && rm -f "$CONF"
    net_down
    say "stopped"
  fi
  return $rc
}

cmd_status() {
  local name down=0
  for name in munged slurmctld slurmd $([ -f "$PIDS" ] && awk '$1 ~ /^slurmd-/ {print $1}' "$PIDS" | sort -u); do
    if running "$name"; then say "$name: running ($(recorded "$name" | cut -d' ' -f2))"
    else say "$name: not running (as started by this script)"; down=$((down + 1)); fi
  done
  command -v sinfo >/dev/null && timeout 10 sinfo 2>/dev/null || true
  [ $down -eq 0 ]
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
