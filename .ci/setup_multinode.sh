#!/usr/bin/env bash
# A SLURM cluster of several nodes on this machine, for tests/slurm/multinode (CI and laptops), as root:
#
#   sudo bash .ci/setup_multinode.sh          # up (idempotent: a second run checks and returns)
#   sudo bash .ci/setup_multinode.sh down     # tear down (idempotent)
#   SLURM_CONF=/etc/slurm-multinode/slurm.conf sinfo    # talk to it from this "login node"
#
# Each node is a network namespace with its own address on a bridge, its own host name (UTS namespace) and its own
# mount namespace running `slurmd -N <node>`: a private /tmp (tmpfs), its own /run and slurmd spool (directories of
# this machine under $NODE_STATE/<node> that no other node mounts), its own /etc/hosts view. slurmctld runs in the root
# namespace, which is also the login node: sbatch, srun, `hpc-rlhf submit` and `plan` run there. This cluster is
# separate from the one-node cluster of .ci/setup_slurm.sh (its own slurm.conf, ports, state and pid files), whose
# munged it shares (run setup_slurm.sh first); both may run at once.
#
#   hpcmn1 10.77.0.11   each node resolves its own name to 127.0.1.1 (only), as Debian/Ubuntu images do,
#   hpcmn2 10.77.0.12   and the other nodes' names to their addresses
#   hpcmnx 10.77.0.13   no slurmd: "another user's node" on the same network (tests/slurm/multinode security test)
#
# The kernel here has no sch_netem (no tc delay or loss): faults are a link down (`ip link set hpcmn2-br down`),
# killed or stopped processes. Daemons are tracked by pid files; nothing is killed by name.
# Environment: MULTINODE_WAIT_S (default 60).
set -euo pipefail

NODES=(hpcmn1 hpcmn2)
OUTSIDER=hpcmnx
declare -A ADDR=([hpcmn1]=10.77.0.11 [hpcmn2]=10.77.0.12 [hpcmnx]=10.77.0.13)
BRIDGE=hpcmnbr0
BRIDGE_ADDR=10.77.0.1
PREFIX=24
CONF_DIR=/etc/slurm-multinode
CONF="$CONF_DIR/slurm.conf"
STATE_DIR=/var/spool/slurmctld-multinode
# The slurmd spool path every node has, each its own directory of $NODE_STATE mounted there (node-local, as on a
# cluster). $NODE_STATE/<node>/run is the node's /run: its slurmd pid file is read from here through a link
# (RUN_DIR/slurmd-multinode-<node>.pid) that the tests and tear-down use.
SPOOL_DIR=/var/spool/slurmd-multinode
NODE_STATE=/var/lib/hpc-rlhf-multinode
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
CTLD_PID="$RUN_DIR/slurmctld-multinode.pid"
CTLD_PORT=6917
SLURMD_PORT=6918
HOSTS_MARKER="# hpc_rlhf multinode cluster (.ci/setup_multinode.sh)"
WAIT_S="${MULTINODE_WAIT_S:-60}"
export PATH="$PATH:/usr/sbin:/sbin"
export SLURM_CONF="$CONF"

log() { echo "setup_multinode: $*"; }
die() {
    echo "setup_multinode: ERROR: $*" >&2
    for f in "$LOG_DIR/slurmctld-multinode.log" "$LOG_DIR"/slurmd-multinode-*.log; do
        [ -r "$f" ] && { echo "--- last lines of $f" >&2; tail -n 15 "$f" >&2; }
    done
    exit 1
}
[ "$(id -u)" -eq 0 ] || die "run as root: network namespaces and slurmd need it"

# shellcheck source=daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"  # alive, stop_by_pidfile
slurmd_pid() { echo "$RUN_DIR/slurmd-multinode-$1.pid"; }  # in the root namespace: a link into the node's /run
stop_daemons() {
    local node
    for node in "${NODES[@]}"; do stop_by_pidfile "$(slurmd_pid "$node")" slurmd || die "slurmd on $node would not stop"; done
    stop_by_pidfile "$CTLD_PID" slurmctld || die "slurmctld would not stop"
}

down() {
    stop_daemons
    for node in "${NODES[@]}" "$OUTSIDER"; do
        ip link del "$node-br" 2>/dev/null || true
        ip netns del "$node" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    if grep -qF "$HOSTS_MARKER" /etc/hosts; then
        # /etc/hosts may be a bind mount (containers): rewrite in place rather than replace the file
        grep -vF "$HOSTS_MARKER" /etc/hosts >/etc/hosts.multinode.tmp && cat /etc/hosts.multinode.tmp >/etc/hosts
        rm -f /etc/hosts.multinode.tmp
    fi
    log "down"
}

if [ "${1:-up}" = down ]; then down; exit 0; fi
[ "${1:-up}" = up ] || die "usage: $0 [up|down]"

for bin in slurmctld slurmd munge ip nsenter unshare; do
    command -v "$bin" >/dev/null 2>&1 || die "$bin not found: run .ci/setup_slurm.sh first (slurm-wlm, munge), iproute2"
done
munge -n | unmunge >/dev/null 2>&1 || die "munged is not running: run .ci/setup_slurm.sh first"

# --- 1. network: a bridge in the root namespace, one namespace + veth per node -------------------------------
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_ADDR/$PREFIX" dev "$BRIDGE"
fi
ip link set "$BRIDGE" up
for node in "${NODES[@]}" "$OUTSIDER"; do
    [ -e "/run/netns/$node" ] || ip netns add "$node"
    if ! ip link show "$node-br" >/dev/null 2>&1; then
        ip link add "$node-br" type veth peer name eth0 netns "$node"
        ip link set "$node-br" master "$BRIDGE"
        ip -n "$node" addr add "${ADDR[$node]}/$PREFIX" dev eth0
    fi
    ip link set "$node-br" up
    ip -n "$node" link set lo up
    ip -n "$node" link set eth0 up
done

# --- 2. names: every node's name resolves to its address for everyone ----------------------------------------
if ! grep -qF "$HOSTS_MARKER" /etc/hosts; then
    for node in "${NODES[@]}" "$OUTSIDER"; do echo "${ADDR[$node]} $node $HOSTS_MARKER"; done >>/etc/hosts
fi
mkdir -p "$CONF_DIR"
for node in "${NODES[@]}"; do
    # The node's own view of /etc/hosts (bind-mounted in its mount namespace): its own name resolves to 127.0.1.1
    # only, as on Debian/Ubuntu images, and the other nodes' names to their addresses (as a cluster's DNS would).
    # gloo, left to itself, then binds to 127.0.1.1 and tells the other nodes to connect there: the job hangs at its
    # first collective between nodes.
    {
        echo "127.0.0.1 localhost"
        echo "127.0.1.1 $node"
        grep -F "$HOSTS_MARKER" /etc/hosts | awk -v self="$node" '$2 != self {print $1, $2}'
    } >"$CONF_DIR/hosts.$node"
done

# --- 3. slurm.conf --------------------------------------------------------------------------------------------
mkdir -p "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR" "$RUN_DIR"
new_conf="$(mktemp)"
trap 'rm -f "$new_conf"' EXIT
{
cat <<EOF
# written by hpc_rlhf .ci/setup_multinode.sh
ClusterName=multinode
SlurmctldHost=$(hostname)($BRIDGE_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUN_DIR/slurmd-multinode-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld-multinode.log
SlurmdLogFile=$LOG_DIR/slurmd-multinode-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# Pending jobs are looked at every 2 s (defaults: the main loop every 60 s, backfill every 30 s, besides
# event-driven passes): a requeued job otherwise waited up to a minute after its cred_expire delay.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node that comes back after a failure returns to service by itself (the node-loss tests bring links back).
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
JobRequeue=1
AuthInfo=cred_expire=10
KillWait=30
MinJobAge=300
# A node that stops answering is marked DOWN after this many seconds (default 300): the node-loss tests wait on it.
SlurmdTimeout=20
EOF
for node in "${NODES[@]}"; do
    echo "NodeName=$node NodeAddr=${ADDR[$node]} NodeHostname=$node CPUs=2 RealMemory=8000 State=UNKNOWN"
done
echo "PartitionName=nodes Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
} >"$new_conf"
conf_changed=0
if ! cmp -s "$new_conf" "$CONF" 2>/dev/null; then
    install -m 0644 "$new_conf" "$CONF"
    conf_changed=1
    log "wrote $CONF"
fi

# --- 4. daemons -----------------------------------------------------------------------------------------------
if [ "$conf_changed" -eq 1 ]; then stop_daemons; fi
if ! alive "$CTLD_PID" slurmctld; then
    log "starting slurmctld (port $CTLD_PORT)"
    slurmctld -f "$CONF" || die "slurmctld failed to start"
fi
for node in "${NODES[@]}"; do
    pidfile="$(slurmd_pid "$node")"
    alive "$pidfile" slurmd && continue
    log "starting slurmd on $node (${ADDR[$node]})"
    # The node's own /run: munged's socket directory is this machine's (one munged stands for every node's, as nodes
    # share the key), /run/shm the shared memory of its kernel; everything else there is the node's alone.
    node_run="$NODE_STATE/$node/run"
    mkdir -p "$node_run/slurm" "$node_run/munge" "$node_run/lock" "$NODE_STATE/$node/spool"
    ln -sfn /dev/shm "$node_run/shm"
    # slurmd writes its pid file into the node's /run; the root namespace reads it through this link
    ln -sfn "$node_run/slurm/slurmd-multinode-$node.pid" "$pidfile"
    # `ip netns exec` is not used: it remounts /sys and slurmd then cannot initialise its cgroup plugin.
    # slurmd daemonizes and its jobs inherit the node's network, host name and mounts.
    nsenter --net="/run/netns/$node" unshare --uts --mount --propagation private bash -c "
        set -e
        hostname $node
        mount -t tmpfs -o mode=1777,size=2g tmpfs /tmp
        mount --bind /run/munge $node_run/munge
        mount --rbind $node_run /run
        mount --bind $NODE_STATE/$node/spool $SPOOL_DIR
        mount --bind $CONF_DIR/hosts.$node /etc/hosts
        exec slurmd -f $CONF -N $node" || die "slurmd on $node failed to start"
done

# --- 5. wait for the nodes ------------------------------------------------------------------------------------
deadline=$(( SECONDS + WAIT_S ))
while :; do
    states="$(sinfo -h -N -o '%N %T' 2>/dev/null || true)"
    ready=0
    for node in "${NODES[@]}"; do
        state="$(awk -v n="$node" '$1 == n {print $2}' <<<"$states")"
        case "$state" in
            idle|mixed|allocated|completing) ready=$(( ready + 1 )) ;;
            down*|drain*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
        esac
    done
    [ "$ready" -eq "${#NODES[@]}" ] && break
    [ "$SECONDS" -lt "$deadline" ] || die "nodes not ready after ${WAIT_S}s (sinfo: $(tr '\n' ' ' <<<"$states"))"
    sleep 1
done
log "ready: partition nodes, ${NODES[*]} (SLURM_CONF=$CONF); outsider namespace $OUTSIDER at ${ADDR[$OUTSIDER]}"
