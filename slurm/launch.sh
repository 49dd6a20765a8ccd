#!/usr/bin/env bash
# Body shared by every sbatch recipe in slurm/: environment, resume after a requeue, the `plan` guard and
# the one srun step. Each slurm/<recipe>.sbatch keeps its own #SBATCH lines (sbatch reads directives only
# from the submitted file) and sources this file with its arguments. It is never submitted itself.
#
# The recipe sets (all of them, so that a stray variable in the user's environment cannot change a recipe):
#   RECIPE               the recipe's file name, used in messages
#   ENTRY                python -m hpc_rlhf.cli.<ENTRY>: train_ppo (RL), train_sft, train_rm, train_dpo, train_kto
#   CONFIG               the YAML recipe, keeping a CONFIG=... given by the user
#   DEFAULT_OMP_THREADS  OMP_NUM_THREADS unless the user set it
#   GPU_JOB              1: NCCL ranks (NCCL settings below); 0: CPU ranks over gloo
#   PREPARE_ASSETS       1: build a CPU recipe's tiny model and synthetic data before the guard
# Arguments are dotted overrides, given to the guard and to every rank. User environment: CONFIG, PYTHON,
# PLAN_ARGS (extra `plan` flags, e.g. "--gpu-mem-gb 141 --gpu h200" on H200, "--fs-gbps 20" for the site's
# filesystem), OMP_NUM_THREADS, NCCL_DEBUG,
# MAX_STALL_REQUEUES (how many times a hung job is requeued, counted over the job's life; default 2),
# CONTAINER_IMAGE / CONTAINER_RUNTIME / CONTAINER_MOUNTS / APPTAINER_BIN (every step in a container image:
# slurm/container.sh; unset, everything runs on the host).
set -euo pipefail

: "${RECIPE:?slurm/launch.sh is sourced by a slurm/*.sbatch recipe, not run on its own}"
: "${ENTRY:?$RECIPE: ENTRY is not set}" "${CONFIG:?$RECIPE: CONFIG is not set}"
: "${DEFAULT_OMP_THREADS:?$RECIPE: DEFAULT_OMP_THREADS is not set}"
: "${GPU_JOB:?$RECIPE: GPU_JOB is not set}" "${PREPARE_ASSETS:?$RECIPE: PREPARE_ASSETS is not set}"

# plan's own detection of the trainer goes by the config's file name; CONFIG=my_run.yaml must still be
# checked as the trainer that this recipe starts.
case "$ENTRY" in
    train_ppo) PLAN_KIND=rl ;;
    train_sft | train_rm | train_dpo | train_kto) PLAN_KIND="${ENTRY#train_}" ;;
    *) echo "$RECIPE: unknown ENTRY=$ENTRY (train_ppo, train_sft, train_rm, train_dpo or train_kto)" >&2; exit 1 ;;
esac

PYTHON="${PYTHON:-python}"

export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$DEFAULT_OMP_THREADS}"
export TOKENIZERS_PARALLELISM=false
if [ "$GPU_JOB" = 1 ]; then
    # A dead or stuck peer aborts the collective (error on every rank) instead of hanging to the time limit.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    # Site-specific (ask your admins; see docs/slurm.md "Troubleshooting"). Uncomment here for every GPU
    # recipe, or export them before sbatch, which passes the submitting environment on to the job:
    # export NCCL_SOCKET_IFNAME=ib0         # interface for NCCL's bootstrap / socket transport
    # export NCCL_IB_HCA=mlx5               # InfiniBand adapters to use
    # export NCCL_IB_GID_INDEX=3            # RoCE
    # export NCCL_IB_TIMEOUT=22             # large clusters: tolerate slow fabric recovery
fi

# The job's secret (docs/reliability.md, "Shared clusters"): the ranks seal their rendezvous stores with it, so that
# another user who reaches the master port can neither read nor change what they exchange there. Fresh at every
# start of the job, generated here and handed to the ranks by srun in their environment (readable by this user and
# root only); it is written to no file and to no job record, and a value set before sbatch is replaced.
HPC_RLHF_JOB_SECRET="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
[ "${#HPC_RLHF_JOB_SECRET}" -eq 64 ] || { echo "$RECIPE: could not read 32 random bytes from /dev/urandom" >&2; exit 1; }
export HPC_RLHF_JOB_SECRET

# A requeued run (preemption, time limit, node failure) resumes from the checkpoint LATEST.
RESUME=()
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME=(ckpt.load=true); fi

# A job resized while it was pending (requeued and held, then `scontrol update JobId=<job> NumTasks=3
# TasksPerNode=3`, then released: resume on another number of ranks) keeps the SLURM_NTASKS, SLURM_NPROCS and
# SLURM_NTASKS_PER_NODE that sbatch stored in its environment at submission: srun would start the old number of
# ranks and the guard would check the old layout. SLURM_TASKS_PER_NODE ("3", "8(x2)", "8,4") is set anew at each
# start from the allocation: the counts that are set are taken from it.
refresh_task_counts() {
    local part total=0 per_node="" uniform=1 count
    local -a parts
    IFS=, read -ra parts <<<"$1"
    for part in "${parts[@]}"; do
        [[ "$part" =~ ^([0-9]+)(\(x([0-9]+)\))?$ ]] || return 0  # not a layout this reads: keep what sbatch set
        count="${BASH_REMATCH[1]}"
        total=$(( total + count * ${BASH_REMATCH[3]:-1} ))
        per_node="${per_node:-$count}"
        [ "$count" = "$per_node" ] || uniform=0
    done
    [ "$total" -gt 0 ] || return 0
    if [ -n "${SLURM_NTASKS:-}" ] && [ "$SLURM_NTASKS" != "$total" ]; then
        echo "$RECIPE: the allocation has $total tasks (SLURM_TASKS_PER_NODE=$1), the job was submitted with" \
             "$SLURM_NTASKS: starting $total ranks"
        export SLURM_NTASKS="$total"
        if [ -n "${SLURM_NPROCS:-}" ]; then export SLURM_NPROCS="$total"; fi
    fi
    if [ "$uniform" = 1 ] && [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then export SLURM_NTASKS_PER_NODE="$per_node"; fi
}
if [ -n "${SLURM_TASKS_PER_NODE:-}" ]; then refresh_task_counts "$SLURM_TASKS_PER_NODE"; fi
echo "[$(date -Is)] job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0}: ${SLURM_NTASKS} ranks on" \
     "${SLURM_JOB_NODELIST}, config ${CONFIG} ${RESUME[*]-} $*"

# The recipe's own file (the spooled copy sbatch runs, which keeps its #SBATCH lines), for the guard below, and
# where this job keeps its state across requeues (see the hang handling before srun).
RECIPE_FILE="${BASH_SOURCE[1]:-}"
JOB_REF="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
JOB_REF="${JOB_REF:-$SLURM_JOB_ID}"
JOB_STATE_DIR="${SLURM_SUBMIT_DIR:-$PWD}/.hpc-rlhf/job-${JOB_REF}"

# Containers (docs/slurm.md, "Containers"): with CONTAINER_IMAGE set, slurm/container.sh fills these so that the
# asset step, the guard and the ranks run in that image; unset, they stay empty and every step runs on the host.
# CONTAINER_ONCE runs one command once in the image (pyxis: a one-task srun step; apptainer: exec), CONTAINER_SRUN
# holds the srun flags that start each rank in it (pyxis), CONTAINER_EXEC what each rank's command runs under
# (apptainer exec ... IMAGE).
CONTAINER_ONCE=()
CONTAINER_SRUN=()
CONTAINER_EXEC=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    # shellcheck source=container.sh
    source "$(dirname "${BASH_SOURCE[0]}")/container.sh"
    container_setup
elif [ -n "${CONTAINER_RUNTIME:-}" ]; then
    echo "$RECIPE: CONTAINER_RUNTIME=$CONTAINER_RUNTIME is set but CONTAINER_IMAGE is not; running on the host" >&2
fi

if [ "$PREPARE_ASSETS" = 1 ]; then
    # A CPU recipe builds its tiny model and data on first use; build them here, once, so that `plan`
    # sizes the model the ranks will load.
    ${CONTAINER_ONCE[@]+"${CONTAINER_ONCE[@]}"} "$PYTHON" - "$PLAN_KIND" "$CONFIG" "$@" <<'PY'
import sys
from hpc_rlhf.cli.startup import prepare_local_assets
from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.config.supervised import load_supervised_config
kind, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    cfg = load_config(config, overrides) if kind == "rl" else load_supervised_config(kind, config, overrides)
except ConfigError:
    sys.exit(0)  # the guard below names the error and stops the job
prepare_local_assets(cfg)
PY
fi

# Guard: a config error (unknown key, bad value), an invalid layout, one that does not fit in GPU memory, or a
# --signal=USR1@<grace> shorter than one predicted step plus one checkpoint save stops the job here, before
# any rank starts and holds the nodes. The recipe's own file gives plan the time limit and the grace; CPU
# recipes are timed with the CPU description.
TIME_ARGS=()
if [ -n "$RECIPE_FILE" ] && [ -r "$RECIPE_FILE" ]; then TIME_ARGS+=(--sbatch "$RECIPE_FILE"); fi
if [ "$GPU_JOB" = 0 ]; then TIME_ARGS+=(--gpu cpu); fi
# A requeued job may run on another allocation: plan --resume says how it loads the checkpoint (resharded when the
# layout differs) and stops the job here if it cannot (another model, LoRA adapter, ...). So does a new job told to
# resume (ckpt.load=true among its overrides: a resubmission on fewer or more nodes).
RESUMING=${#RESUME[@]}
for arg in "$@"; do if [ "$arg" = "ckpt.load=true" ]; then RESUMING=1; fi; done
if [ "$RESUMING" -gt 0 ]; then TIME_ARGS+=(--resume auto); fi
# shellcheck disable=SC2086  # PLAN_ARGS is a list of flags
${CONTAINER_ONCE[@]+"${CONTAINER_ONCE[@]}"} "$PYTHON" -m hpc_rlhf.cli.plan --config "$CONFIG" --kind "$PLAN_KIND" \
    --nodes "$SLURM_JOB_NUM_NODES" --gpus-per-node "$SLURM_NTASKS_PER_NODE" ${TIME_ARGS[@]+"${TIME_ARGS[@]}"} \
    ${PLAN_ARGS:-} "$@" \
    || { echo "$RECIPE: hpc-rlhf plan rejected this layout${CONTAINER_IMAGE:+ or the image did not start}" \
              "(see above); not starting" >&2; exit 1; }

# One rank per task (per GPU on GPU recipes), rank order = node order: rank 0, on the first node, logs,
# writes the HF export and, in RL, is the controller. The master address is the first host of SLURM_JOB_NODELIST
# and the port is derived from the job id, outside the node's ephemeral port range (hpc_rlhf.world.launch_env; a
# port in use stops rank 0 with an error naming it: export MASTER_PORT=<free port> before sbatch then): no
# torchrun, no Ray, no waiting for services. --kill-on-bad-exit: one failing rank ends the whole step at once, with its error in this log.
# --cpus-per-task is repeated because not every SLURM version passes the job's value on to srun.
#
# A hang: the trainers' watchdog (train.watchdog_timeout_s, on by default) dumps every rank's stacks to
# <train.output_dir>/hang/ and exits 124, touching HPC_RLHF_STALL_FILE first (srun's own status is that of
# the rank it killed last, so it cannot tell a hang from a crash). Then this job requeues itself and resumes
# from the last checkpoint, at most MAX_STALL_REQUEUES times in the job's life (the count is kept in a file
# named after the job id, which a requeue keeps), and fails after that: a hang that repeats needs a person.
export HPC_RLHF_STALL_FILE="$JOB_STATE_DIR/stalled"
mkdir -p "$JOB_STATE_DIR"
rm -f "$HPC_RLHF_STALL_FILE"
if [ -n "${CONTAINER_IMAGE:-}" ]; then container_ranks "$@"; fi
status=0
srun --kill-on-bad-exit=1 --label --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    ${CONTAINER_SRUN[@]+"${CONTAINER_SRUN[@]}"} ${CONTAINER_EXEC[@]+"${CONTAINER_EXEC[@]}"} \
    "$PYTHON" -m "hpc_rlhf.cli.$ENTRY" --config "$CONFIG" ${RESUME[@]+"${RESUME[@]}"} "$@" || status=$?
if [ -f "$HPC_RLHF_STALL_FILE" ]; then
    stalls=$(( $(cat "$JOB_STATE_DIR/stall_requeues" 2>/dev/null || echo 0) + 1 ))
    echo "[$(date -Is)] job ${JOB_REF}: hang detected ($(cat "$HPC_RLHF_STALL_FILE")); stacks in" \
         "<train.output_dir>/hang/" >&2
    if [ "$stalls" -le "${MAX_STALL_REQUEUES:-2}" ]; then
        echo "$stalls" > "$JOB_STATE_DIR/stall_requeues"
        echo "[$(date -Is)] job ${JOB_REF}: requeue ${stalls} of ${MAX_STALL_REQUEUES:-2} after a hang;" \
             "it resumes from the last checkpoint" >&2
        scontrol requeue "$JOB_REF" && exit 0
        echo "$RECIPE: scontrol requeue $JOB_REF failed; resubmit with ckpt.load=true" >&2
    else
        echo "$RECIPE: the job hung $stalls times (MAX_STALL_REQUEUES=${MAX_STALL_REQUEUES:-2}); not requeueing" >&2
    fi
    exit 124
fi
[ "$status" -eq 0 ] || exit "$status"
echo "[$(date -Is)] job ${SLURM_JOB_ID}: training finished"
