#!/usr/bin/env bash
# Interactive run on ONE node (a workstation, or a node from `salloc`): torchrun --standalone starts one
# process per GPU (or NPROC CPU processes) and sets RANK/WORLD_SIZE/MASTER_*; hpc_rlhf reads those.
#
#   launchers/torchrun_local.sh configs/grpo_tiny_cpu.yaml train.max_steps=5
#   NPROC=8 ENTRY=train_sft launchers/torchrun_local.sh configs/sft_llama3_8b.yaml
#
# Env: NPROC (default: the GPU count, else 2), ENTRY (default train_ppo), PYTHON, PLAN_ARGS.
# For several nodes use sbatch (slurm/*.sbatch) or `hpc-rlhf submit`, not torchrun.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CONFIG.yaml [key=value ...]" >&2; exit 2; }
CONFIG="$1"; shift
ENTRY="${ENTRY:-train_ppo}"
PYTHON="${PYTHON:-python}"
NPROC="${NPROC:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')}"
if [ "$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')" = 0 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

# CPU recipes build their tiny model on first use; build it now so `plan` can size it.
"$PYTHON" - "$CONFIG" "$@" <<'PY'
import sys
from hpc_rlhf.cli.startup import prepare_local_assets
from hpc_rlhf.config import load_config
prepare_local_assets(load_config(sys.argv[1], sys.argv[2:]))
PY
# shellcheck disable=SC2086
"$PYTHON" -m hpc_rlhf.cli.plan --config "$CONFIG" --nodes 1 --gpus-per-node "$NPROC" ${PLAN_ARGS:-} "$@" >/dev/null \
    || { echo "torchrun_local.sh: plan rejected $NPROC ranks for $CONFIG (reason above)" >&2; exit 1; }
# The run's secret: the ranks seal their rendezvous store with it (docs/reliability.md, "Shared clusters"); torchrun
# hands it to each rank in the environment.
HPC_RLHF_JOB_SECRET="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
export HPC_RLHF_JOB_SECRET
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    -m "hpc_rlhf.cli.$ENTRY" --config "$CONFIG" "$@"
