#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for CI and laptops: munge + slurmctld + slurmd.
#
#   sudo bash .ci/setup_slurm.sh        # idempotent: a second run checks and returns
#   sudo bash .ci/setup_slurm.sh down   # stops slurmd and slurmctld (munged stays: setup_multinode.sh uses it)
#
# The node is called `localhost` (NodeHostname = this machine's hostname) so SLURM_JOB_NODELIST
# resolves to an address every rank can reach. The daemons are tracked by their pidfiles; nothing is
# ever killed by name. Environment knobs: SLURM_SETUP_WAIT_S (default 60), SLURM_SETUP_FORCE_RESTART=1.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
MUNGE_RUN=/run/munge
MUNGE_PID="$MUNGE_RUN/munged.pid"
CTLD_PID="$RUN_DIR/slurmctld.pid"
SLURMD_PID="$RUN_DIR/slurmd.pid"
WAIT_S="${SLURM_SETUP_WAIT_S:-60}"
MARKER="# written by hpc_rlhf .ci/setup_slurm.sh"

log() { echo "setup_slurm: $*"; }
die() {
    echo "setup_slurm: ERROR: $*" >&2
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        [ -r "$f" ] && { echo "--- last lines of $f" >&2; tail -n 25 "$f" >&2; }
    done
    exit 1
}

[ "$(id -u)" -eq 0 ] || die "run as root (sudo bash $0): slurmd and munged need it"
# shellcheck source=daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"  # alive, stop_by_pidfile

if [ "${1:-up}" = down ]; then
    stop_by_pidfile "$SLURMD_PID" slurmd || die "slurmd would not stop"
    stop_by_pidfile "$CTLD_PID" slurmctld || die "slurmctld would not stop"
    log "down (munged left running)"
    exit 0
fi
[ "${1:-up}" = up ] || die "usage: $0 [up|down]"

# --- 1. packages -------------------------------------------------------------------------------
need_install=0
for bin in slurmctld slurmd sbatch srun scontrol sinfo munged; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || need_install=1
done
if [ "$need_install" -eq 1 ]; then
    log "installing slurm-wlm and munge"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge
else
    log "slurm-wlm and munge already installed"
fi
export PATH="$PATH:/usr/sbin:/sbin"

# --- 2. slurm.conf ------------------------------------------------------------------------------
host="$(hostname)"
# `slurmd -C` prints e.g. "NodeName=vm CPUs=2 ... RealMemory=24105"; fall back to nproc / meminfo.
probe="$(slurmd -C 2>/dev/null | head -n 1 || true)"
cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$probe")"
mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$probe")"
[ -n "$cpus" ] || cpus="$(nproc)"
[ -n "$mem" ] || mem="$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)"
real_mem=$(( mem * 9 / 10 ))  # a bit below the machine's so slurmd never marks the node invalid
# The node declares at least 4 CPUs, even on a 2-core machine: a job requeued with 3 or 4 tasks (resume on
# another number of ranks, tests/slurm) must fit on it, and a job's own tasks cannot overcommit past its
# node's CPUs (sbatch --overcommit refuses --ntasks-per-node=3 on 2 CPUs). Its ranks then share cores: slower,
# still correct. config_overrides: slurmd reports this configured count instead of the probed one, which would
# otherwise drain the node ("Low CPUs").
node_cpus=$(( cpus > 4 ? cpus : 4 ))

mkdir -p "$CONF_DIR" "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR" "$RUN_DIR"
new_conf="$(mktemp)"
trap 'rm -f "$new_conf"' EXIT
cat >"$new_conf" <<EOF
$MARKER
ClusterName=local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
# linuxproc tracks a job's processes by parent pid: works in containers without cgroup access.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# Pending jobs are looked at every 2 s (defaults: the main loop every 60 s, backfill every 30 s, besides
# event-driven passes): a requeued job otherwise waited up to a minute after its cred_expire delay.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
# slurmd reports the node's configured CPUs, not the probed ones (at least 4: see node_cpus above).
SlurmdParameters=config_overrides
# Requeue: batch jobs may be requeued (scontrol requeue, node failure); 0 would forbid it.
# A requeued job waits cred_expire seconds before it may start again (default 120): keep it short here.
JobRequeue=1
AuthInfo=cred_expire=10
# SIGTERM -> SIGKILL grace for a job's tasks (preemption checkpoint on CPU fits easily).
KillWait=30
# Finished jobs stay visible to 'scontrol show job' for 5 minutes (there is no slurmdbd / sacct here).
MinJobAge=300
NodeName=localhost NodeHostname=$host CPUs=$node_cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

conf_changed=0
if ! cmp -s "$new_conf" "$CONF" 2>/dev/null; then
    if [ -f "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
        backup="$CONF.bak.$(date +%s)"
        log "keeping the existing $CONF as $backup"
        cp "$CONF" "$backup"
    fi
    install -m 0644 "$new_conf" "$CONF"
    conf_changed=1
    log "wrote $CONF (node localhost -> $host, CPUs=$node_cpus on $cpus cores, RealMemory=$real_mem)"
fi

# --- 3. daemons (tracked by pidfile: .ci/daemons.sh) --------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null 2>&1; then mungekey --create --force; else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    id munge >/dev/null 2>&1 && chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
mkdir -p "$MUNGE_RUN" /var/log/munge /var/lib/munge
if ! alive "$MUNGE_PID" munged; then
    log "starting munged"
    if id munge >/dev/null 2>&1; then
        chown munge:munge "$MUNGE_RUN" /var/log/munge /var/lib/munge
        runuser -u munge -- munged --pid-file="$MUNGE_PID" || munged --force --pid-file="$MUNGE_PID"
    else
        munged --force --pid-file="$MUNGE_PID"
    fi
fi
munge -n | unmunge >/dev/null || die "munge round trip failed"

if [ "$conf_changed" -eq 1 ] || [ "${SLURM_SETUP_FORCE_RESTART:-0}" = 1 ]; then
    stop_by_pidfile "$SLURMD_PID" slurmd || die "slurmd would not stop"
    stop_by_pidfile "$CTLD_PID" slurmctld || die "slurmctld would not stop"
fi
if ! alive "$CTLD_PID" slurmctld; then
    log "starting slurmctld"
    slurmctld || die "slurmctld failed to start"
fi
if ! alive "$SLURMD_PID" slurmd; then
    log "starting slurmd"
    slurmd || die "slurmd failed to start"
fi

# --- 4. wait for the node -----------------------------------------------------------------------
deadline=$(( SECONDS + WAIT_S ))
state=""
while :; do
    state="$(sinfo -h -n localhost -o '%T' 2>/dev/null | head -n 1 || true)"
    case "$state" in
        idle|mixed|allocated|completing) break ;;
        down*|drain*|fail*|unknown*|"")
            # A node left down by an earlier run (e.g. a restarted slurmd): give it back.
            [[ "$state" == down* || "$state" == drain* ]] && scontrol update nodename=localhost state=resume 2>/dev/null || true ;;
    esac
    [ "$SECONDS" -lt "$deadline" ] || die "node localhost not ready after ${WAIT_S}s (sinfo state: '${state:-no answer}')"
    sleep 1
done
log "ready: partition debug, node localhost is $state ($(sinfo -h -o '%C' | tr / ' ' | awk '{print $4}') CPUs)"
