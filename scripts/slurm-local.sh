#!/usr/bin/env bash
# A real single-node SLURM on this machine, for the tests and for trying `--executor slurm`.
#
#   scripts/slurm-local.sh start DIR    # installs Debian's slurmctld/slurmd/slurm-client/munge if
#                                       # absent (root), writes DIR/slurm.conf, starts munged,
#                                       # slurmctld and slurmd, waits until `sinfo` says idle
#   export SLURM_CONF=DIR/slurm.conf    # then sbatch/squeue/sinfo/spar-bench use this cluster
#   scripts/slurm-local.sh stop DIR     # stops the three daemons by the PIDs in DIR
#   scripts/slurm-local.sh install DIR  # only the packages (.ci/run; apt's log in DIR)
#
# Everything (config, munge key and socket, state, spool, logs, PID files) lives in DIR; the
# daemons listen on 127.0.0.1 only, on two free ports. Node CPUs and memory are detected
# (`slurmd -C`). ProctrackType=proctrack/linuxproc and TaskPlugin=task/none: no cgroups needed.
# Needs root (the daemons run as root, jobs run as the submitting user). Exit status 3: cannot
# run here (not root, or the packages cannot be installed); the reason is the last line.
set -euo pipefail

usage() { echo "usage: $0 start|stop|install DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
mkdir -p "$2"
dir=$(cd "$2" && pwd)
WAIT_S=${SLURM_LOCAL_WAIT_S:-60}

cannot() { echo "slurm-local: cannot run here: $*" >&2; exit 3; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return 0
    [ "$(id -u)" -eq 0 ] || cannot "not root and the SLURM packages are not installed"
    command -v apt-get >/dev/null || cannot "no apt-get to install slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    local pkgs="slurmctld slurmd slurm-client munge"
    apt-get install -y --no-install-recommends $pkgs >"$dir/apt.log" 2>&1 \
        || { apt-get update >>"$dir/apt.log" 2>&1 && apt-get install -y --no-install-recommends $pkgs >>"$dir/apt.log" 2>&1; } \
        || cannot "apt-get install $pkgs failed (see $dir/apt.log)"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

write_conf() {
    local node cpus mem
    node=$(slurmd -C 2>/dev/null | head -1)
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$node")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
    cpus=${cpus:-$(nproc)}
    mem=$(( ${mem:-2048} * 9 / 10 ))  # a margin: slurmd refuses a node configured above what it finds
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 700 "$dir/munge"
    cat >"$dir/slurm.conf" <<EOF
# written by scripts/slurm-local.sh: a one-node cluster on 127.0.0.1, everything under this folder
ClusterName=sparlocal
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
DependencyParameters=kill_invalid_depend
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
DefMemPerCPU=1024
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    [ -s "$dir/munge/munge.key" ] || { head -c 1024 /dev/urandom >"$dir/munge/munge.key"; }
    chmod 400 "$dir/munge/munge.key"
}

start() {
    [ "$(id -u)" -eq 0 ] || cannot "not root (the daemons run as root)"
    install_packages
    [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null \
        && { echo "slurm-local: already running in $dir" >&2; return 0; }
    write_conf
    export SLURM_CONF=$dir/slurm.conf
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munge.seed"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N localhost
    local deadline=$(( $(date +%s) + WAIT_S ))
    until sinfo -h -o %T 2>/dev/null | grep -qx idle; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "slurm-local: the node is not idle after ${WAIT_S}s: $(sinfo -h -o %T 2>&1 | head -1)" >&2
            tail -5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
            stop
            exit 1
        fi
        sleep 0.5
    done
    echo "slurm-local: idle; export SLURM_CONF=$SLURM_CONF"
}

stop() {
    local name pid
    if [ -f "$dir/slurmctld.pid" ] && [ -f "$dir/slurm.conf" ]; then  # this cluster's jobs first
        SLURM_CONF=$dir/slurm.conf timeout 10 scancel --quiet --user "$(id -un)" 2>/dev/null || true
    fi
    for name in slurmd slurmctld munged; do  # by the PIDs the daemons wrote, never by name
        [ -f "$dir/$name.pid" ] || continue
        pid=$(cat "$dir/$name.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$dir/$name.pid"
    done
}

case $cmd in
    start) start ;;
    stop) stop ;;
    install) install_packages ;;
    *) usage ;;
esac
