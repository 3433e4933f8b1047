#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (Debian/Ubuntu, as root), for tests
# and CI: munge + slurmctld + slurmd, no cgroups, no accounting.
#
#   bash scripts/slurm/local_cluster.sh install   # apt-get install slurm-wlm munge (skipped if present)
#   bash scripts/slurm/local_cluster.sh start     # write /etc/slurm/slurm.conf, start the daemons, wait for the node
#   bash scripts/slurm/local_cluster.sh status    # sinfo
#   bash scripts/slurm/local_cluster.sh stop      # stop the daemons this script started
#
# `start` is idempotent: daemons that already answer are left alone. It
# writes slurm.conf only if there is none or the existing one was written by
# this script (first line below), so it never touches a real cluster's file.
# The node is this host (`hostname -s`, address 127.0.0.1) with all its CPUs
# and one partition "debug"; ProctrackType=proctrack/linuxproc and
# TaskPlugin=task/none, so it runs in containers without systemd or cgroups.
set -euo pipefail

MARK="# written by torchtitan-grpo scripts/slurm/local_cluster.sh"
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm
RUN_DIR=/run/torchtitan-grpo-slurm
NODE=$(hostname -s)

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root (it writes $CONF and starts daemons)"; }

do_install() {
    need_root
    if command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null; then
        echo "slurm and munge already installed"; return
    fi
    command -v apt-get >/dev/null || die "no apt-get: install slurm-wlm and munge with your package manager"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
}

write_conf() {
    if [[ -f $CONF ]] && ! head -n1 "$CONF" | grep -qF "$MARK"; then
        echo "keeping the existing $CONF (not written by this script)"; return
    fi
    local cpus mem
    cpus=$(nproc --all)
    # RealMemory as slurmd measures it (MB), minus a little so the node is never "invalid".
    mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    mem=$(( ${mem:-2048} > 1024 ? ${mem:-2048} - 512 : ${mem:-2048} ))
    mkdir -p "$CONF_DIR"
    cat >"$CONF" <<EOF
$MARK
ClusterName=grpo-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
MinJobAge=3600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    echo "wrote $CONF (node $NODE, $cpus CPUs)"
}

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    [[ -f /etc/munge/munge.key ]] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 600 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.2
    done
    die "munged did not start (see /var/log/munge/munged.log)"
}

start() {
    need_root
    command -v slurmctld >/dev/null || die "slurm is not installed: run '$0 install' first"
    write_conf
    mkdir -p "$LOG_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$RUN_DIR"
    start_munge
    if ! scontrol ping 2>/dev/null | grep -q "UP"; then
        alive "$RUN_DIR/slurmctld.pid" || slurmctld
        for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q "UP" && break; sleep 0.2; done
        scontrol ping 2>/dev/null | grep -q "UP" || die "slurmctld did not answer; tail of $LOG_DIR/slurmctld.log:
$(tail -n 20 $LOG_DIR/slurmctld.log 2>/dev/null)"
    fi
    alive "$RUN_DIR/slurmd.pid" || slurmd
    local state=""
    for _ in $(seq 150); do
        state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null | head -n1)
        case $state in
            idle|mix|alloc|comp) echo "slurm is up: node $NODE $state"; return ;;
            down*|drain*|drng*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
        esac
        sleep 0.2
    done
    die "node $NODE not ready (state '${state}'); tail of $LOG_DIR/slurmd.log:
$(tail -n 20 $LOG_DIR/slurmd.log 2>/dev/null)"
}

stop() {
    local f pid
    for f in slurmd slurmctld; do
        if alive "$RUN_DIR/$f.pid"; then
            pid=$(cat "$RUN_DIR/$f.pid"); kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        fi
    done
    if [[ -f /run/munge/munged.pid ]] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
        kill "$(cat /run/munge/munged.pid)"
    fi
    echo "slurm stopped"
}

case ${1:-} in
    install) do_install ;;
    start) start ;;
    stop) stop ;;
    status) sinfo; squeue ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
