#!/usr/bin/env bash
# A real two-node SLURM cluster on one Debian machine, for the tests of the sbatch example
# (tests/test_slurm_cluster.py, the "real SLURM" stage of .ci/run).
#
#   sudo bash tools/slurm_test_cluster.sh up       install (once), configure, start, wait for idle
#   sudo bash tools/slurm_test_cluster.sh down     cancel jobs, stop the daemons, undo /etc/hosts
#   bash tools/slurm_test_cluster.sh status        sinfo, or why the cluster is not up
#
# What it builds: Debian's slurm-wlm (22.05 on bookworm) and munge; one slurmctld and two slurmd
# daemons, `slurmd -N node1` and `slurmd -N node2`, each node with its own port on 127.0.0.1, its
# own spool directory, pid file and log. Each slurmd starts in a UTS namespace of its own
# (`unshare --uts`) whose hostname is the node's name, so a job step sees `hostname` ==
# $SLURMD_NODENAME as on a cluster; where namespaces are not allowed (an unprivileged container)
# the daemons start without one and every node keeps the host's name. /etc/hosts maps both names
# to 127.0.0.1 (the sbatch script's rendezvous address is the first node's name). No systemd:
# the daemons are started here and stopped by their pid files, never by name.
#
# Exit status of `up`: 0 the cluster is up and both nodes idle; 3 it cannot run on this machine
# (not root, no apt-get, the packages cannot be installed, a daemon does not start), with one line
# saying why, so CI skips its stage; anything else is a failure.
#
# Knobs: SLURM_TEST_DIR (state and logs, default /tmp/megaloop-slurm), NODE_CPUS (CPUs each node
# offers, default nproc), NODE_MEM_MB (default 8000).
set -euo pipefail

NODES=(node1 node2)
FIRST_PORT=17001
DIR=${SLURM_TEST_DIR:-/tmp/megaloop-slurm}
LOGS=$DIR/logs
CONF=/etc/slurm/slurm.conf
MARK="# megaloop-slurm-test"
UNAVAILABLE=3

say() { echo "slurm_test_cluster: $*" >&2; }
unavailable() { say "unavailable: $*"; exit "$UNAVAILABLE"; }

running() {  # running PIDFILE PROGRAM: the pid file names a live process of PROGRAM
    local pid
    [[ -s "$1" ]] || return 1
    pid=$(cat "$1")
    kill -0 "$pid" 2> /dev/null && grep -qa "$2" "/proc/$pid/cmdline" 2> /dev/null
}

stop_pidfile() {  # stop_pidfile PIDFILE PROGRAM: TERM, up to 15 s, then KILL
    local pid
    if ! running "$1" "$2"; then rm -f "$1"; return 0; fi
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 75); do kill -0 "$pid" 2> /dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2> /dev/null; then kill -KILL "$pid"; fi
    rm -f "$1"
    say "stopped $2 (pid $pid)"
}

install_packages() {
    local missing=() p
    for p in munge slurmctld slurmd slurm-client util-linux procps; do
        dpkg -s "$p" > /dev/null 2>&1 || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    say "installing ${missing[*]} (Debian packages)"
    # policy-rc.d keeps the packages' postinst from starting services (no systemd here, and the
    # daemons are started below with this cluster's configuration).
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added_policy=1
    fi
    local ok=0
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } > "$DIR/apt.log" 2>&1 || ok=$?
    [[ $added_policy -eq 1 ]] && rm -f "$policy"
    if [[ $ok -ne 0 ]]; then
        tail -n 5 "$DIR/apt.log" >&2
        unavailable "apt-get could not install ${missing[*]} (log: $DIR/apt.log)"
    fi
}

write_config() {  # prints "changed" when the configuration file changed
    local new=$CONF.megaloop-new port=$FIRST_PORT cpus=${NODE_CPUS:-$(nproc)} mem=${NODE_MEM_MB:-8000}
    mkdir -p /etc/slurm /var/spool/slurmctld "$LOGS"
    {
        echo "$MARK: written by tools/slurm_test_cluster.sh"
        echo "ClusterName=megaloop-test"
        echo "SlurmctldHost=localhost(127.0.0.1)"
        echo "SlurmctldPort=6817"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "MpiDefault=none"
        echo "MailProg=/bin/true"
        # linuxproc tracks a step's processes by parentage: enough for signals and kills here.
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "SchedulerType=sched/backfill"
        echo "ReturnToService=2"
        echo "StateSaveLocation=/var/spool/slurmctld"
        echo "SlurmdSpoolDir=/var/spool/slurmd/%n"
        echo "SlurmctldPidFile=/run/slurmctld.pid"
        echo "SlurmdPidFile=/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$LOGS/slurmctld.log"
        echo "SlurmdLogFile=$LOGS/slurmd-%n.log"
        echo "SlurmctldDebug=info"
        echo "SlurmdDebug=info"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "JobCompType=jobcomp/none"
        # SLURM's defaults, written out because the tests depend on them: SIGKILL 30 s after the
        # SIGTERM that ends a job; ended jobs stay visible to scontrol for an hour.
        echo "KillWait=30"
        echo "MinJobAge=3600"
        echo "InactiveLimit=0"
        echo "Waittime=0"
        for n in "${NODES[@]}"; do
            echo "NodeName=$n NodeHostname=$n NodeAddr=127.0.0.1 Port=$port CPUs=$cpus" \
                 "Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN"
            port=$((port + 1))
        done
        echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES" \
             "MaxTime=INFINITE State=UP"
    } > "$new"
    echo "ConstrainCores=no" > /etc/slurm/cgroup.conf  # read even with task/none
    if cmp -s "$new" "$CONF"; then
        rm -f "$new"
    else
        mv "$new" "$CONF"
        echo changed
    fi
}

add_hosts() {
    local n
    for n in "${NODES[@]}"; do
        grep -qE "^127\.0\.0\.1[[:space:]]+$n([[:space:]]|$)" /etc/hosts \
            || echo "127.0.0.1 $n $MARK" >> /etc/hosts
    done
}

start_slurmd() {  # start_slurmd NODE
    if [[ "${SLURM_TEST_NO_UTS:-0}" != 1 ]] && unshare --uts true 2> /dev/null; then
        unshare --uts sh -c "hostname $1 && exec slurmd -N $1"
    else
        say "no UTS namespace here: node $1 keeps the hostname $(hostname)"
        slurmd -N "$1"
    fi
}

wait_idle() {
    local states n
    for _ in $(seq 100); do
        states=$(sinfo -h -N -o '%N %T' 2> /dev/null | sort -u)
        if [[ $(grep -cE ' (idle|mixed|allocated)$' <<< "$states") -eq ${#NODES[@]} ]]; then
            return 0
        fi
        for n in "${NODES[@]}"; do  # drained or down by an earlier run: back in service
            if grep -qE "^$n (down|drain)" <<< "$states"; then
                scontrol update nodename="$n" state=resume 2> /dev/null || true
            fi
        done
        sleep 0.3
    done
    sinfo >&2 || true
    return 1
}

up() {
    [[ $(id -u) -eq 0 ]] || unavailable "needs root (it installs packages and starts daemons)"
    command -v apt-get > /dev/null || unavailable "no apt-get (a Debian machine is needed)"
    mkdir -p "$DIR" "$LOGS"
    install_packages
    local changed n
    changed=$(write_config)
    add_hosts
    for n in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$n"; done

    mkdir -p /run/munge && chown munge:munge /run/munge
    if ! running /run/munge/munged.pid munged; then
        runuser -u munge -- /usr/sbin/munged || unavailable "munged does not start"
    fi
    munge -n | unmunge > /dev/null || unavailable "munge cannot encode and decode a credential"

    if [[ -n "$changed" ]]; then  # daemons of another configuration: restart them
        for n in "${NODES[@]}"; do stop_pidfile "/run/slurmd-$n.pid" slurmd; done
        stop_pidfile /run/slurmctld.pid slurmctld
    fi
    if ! running /run/slurmctld.pid slurmctld; then
        slurmctld || unavailable "slurmctld does not start (log: $LOGS/slurmctld.log)"
    fi
    for _ in $(seq 50); do scontrol ping 2> /dev/null | grep -q UP && break; sleep 0.2; done
    scontrol ping 2> /dev/null | grep -q UP \
        || unavailable "slurmctld does not answer (log: $LOGS/slurmctld.log)"
    for n in "${NODES[@]}"; do
        running "/run/slurmd-$n.pid" slurmd || start_slurmd "$n" \
            || unavailable "slurmd $n does not start (log: $LOGS/slurmd-$n.log)"
    done
    wait_idle || unavailable "the nodes did not become idle (logs: $LOGS)"
    say "up: ${NODES[*]} idle ($(sinfo -h -o '%c' | head -n 1) CPUs each); logs in $LOGS"
}

down() {
    local jobs n left
    if [[ $(id -u) -ne 0 ]]; then say "not root: nothing of this script's to stop"; return 0; fi
    if running /run/slurmctld.pid slurmctld; then
        jobs=$(squeue -h -o %i 2> /dev/null | paste -sd ' ')
        if [[ -n "$jobs" ]]; then
            say "cancelling jobs $jobs"
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs || true
            for _ in $(seq 120); do [[ -z "$(squeue -h -o %i 2> /dev/null)" ]] && break; sleep 0.5; done
        fi
    fi
    for n in "${NODES[@]}"; do stop_pidfile "/run/slurmd-$n.pid" slurmd; done
    stop_pidfile /run/slurmctld.pid slurmctld
    stop_pidfile /run/munge/munged.pid munged
    left=$(pgrep -x slurmstepd 2> /dev/null | paste -sd ' ' || true)
    [[ -z "$left" ]] || say "warning: job steps outlived their slurmd: slurmstepd pids $left"
    if grep -q "$MARK\$" /etc/hosts; then sed -i "/$MARK\$/d" /etc/hosts; fi
    rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
    say "down"
}

status() {
    if scontrol ping 2> /dev/null | grep -q UP; then
        sinfo
    else
        say "not up (start it with: sudo bash tools/slurm_test_cluster.sh up)"
        return 1
    fi
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
