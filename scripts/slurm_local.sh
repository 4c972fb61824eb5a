#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the `slurm` tests and for trying
# `nemo-orch launch --executor slurm` without a cluster.
#
#   scripts/slurm_local.sh up     install (root + apt, if missing), configure, start, wait for the node
#   scripts/slurm_local.sh down   stop the daemons this script started
#   scripts/slurm_local.sh env    print `export SLURM_CONF=...` for the client commands
#   scripts/slurm_local.sh status exit 0 if its daemons run
#
# Everything lives in $NEMO_ORCH_SLURM_DIR (default /tmp/nemo-orch-slurm): slurm.conf, state,
# spool, logs, pid files. This host is the only node, reached on 127.0.0.1; the daemons listen
# on ports of their own ($NEMO_ORCH_SLURM_PORT and the next one; default 16817). No slurmdbd:
# `sacct` has no records, `scontrol show job` keeps finished jobs for an hour (MinJobAge), and
# jobcomp/filetxt logs every job's end in $NEMO_ORCH_SLURM_DIR/jobcomp.log.
# Exit status of `up`: 0 when the node is idle; 3 when SLURM is absent and cannot be installed
# here (not root, or no apt-get); 1 on any other failure (the daemons' logs are printed).
set -euo pipefail

DIR="${NEMO_ORCH_SLURM_DIR:-/tmp/nemo-orch-slurm}"
PORT="${NEMO_ORCH_SLURM_PORT:-16817}"
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"

log() { echo "slurm_local: $*" >&2; }

alive() {  # alive PIDFILE: the process it names is running
  [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  if command -v sbatch >/dev/null && command -v slurmctld >/dev/null \
      && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    log "SLURM is not installed and cannot be installed here (needs root and apt-get:" \
        "apt-get install slurm-wlm munge)"
    exit 3
  fi
  log "installing slurm-wlm and munge with apt-get"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >/dev/null
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  cat > "$CONF" <<EOF
ClusterName=nemo-orch-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits this long before it starts again (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=3600
KillWait=30
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
AccountingStorageType=accounting_storage/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  if pgrep -x munged >/dev/null; then return 0; fi
  install -d -o munge -g munge -m 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
  fi
  runuser -u munge -- munged
}

wait_idle() {
  local deadline=$((SECONDS + 60)) state
  while ((SECONDS < deadline)); do
    state="$(SLURM_CONF="$CONF" sinfo -h -n "$HOST" -o %t 2>/dev/null || true)"
    if [[ "$state" == idle* || "$state" == mix* || "$state" == alloc* ]]; then
      return 0
    fi
    sleep 0.5
  done
  log "the node did not become idle within 60 s (state: ${state:-none}); the daemons' logs:"
  tail -n 20 "$DIR"/log/*.log >&2 || true
  return 1
}

up() {
  install_packages
  if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid"; then
    wait_idle
    log "already up ($CONF)"
    return 0
  fi
  down_daemons
  write_conf
  start_munge
  slurmctld -f "$CONF"
  slurmd -f "$CONF"
  wait_idle
  log "up: node $HOST idle ($CONF)"
}

down_daemons() {
  local pidfile
  for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
    if alive "$pidfile"; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
  done
}

case "${1:-}" in
  up) up ;;
  down) down_daemons; log "down" ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  status) alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" ;;
  *) echo "usage: $0 up|down|env|status" >&2; exit 2 ;;
esac
