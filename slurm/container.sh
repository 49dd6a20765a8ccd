#!/usr/bin/env bash
# Containers for slurm/launch.sh, which sources this file only when CONTAINER_IMAGE is set (unset, nothing here
# runs and every step runs on the host). Then every step of a recipe runs in that image: the CPU recipes' asset
# step, the `plan` guard (so that it checks with the image's Python and packages, the ones the ranks use) and the
# ranks. docs/slurm.md, "Containers". It is never run on its own.
#
# User environment:
#   CONTAINER_IMAGE    pyxis: a squashfs file (`enroot import`) or an image URI enroot can pull; apptainer: a .sif
#                      file (or any image `apptainer exec` takes). A file is checked here and given as an absolute
#                      path.
#   CONTAINER_RUNTIME  pyxis (srun --container-image, enroot) or apptainer (Apptainer or SingularityCE; `singularity`
#                      is accepted as a name for it)
#   CONTAINER_MOUNTS   extra mounts, comma-separated SRC[:DST[:FLAGS]], DST defaulting to SRC: models, data sets and
#                      caches outside the repository
#   APPTAINER_BIN      apptainer only: the command to run (default: `apptainer`, else `singularity`, from PATH)
#
# Mounted at the same path inside, for every step: the repository (the job's working directory, also the working
# directory inside), the job's state directory where it lies outside the repository (the watchdog's stall file, which
# this shell reads after srun, and a copy of the recipe file, whose #SBATCH lines plan reads: sbatch's spooled copy
# exists on the first node only),
# and, for the ranks, train.output_dir and ckpt.path where they lie outside the repository and the read-write mounts
# (read from the config by the image's Python once the guard has passed; created here first, as a mount needs its
# source).
# GPUs: pyxis gives the step's GPUs to the container itself; apptainer gets --nv on GPU recipes.
# Environment: both runtimes pass the job's environment in, but a variable the image also sets keeps the image's
# value; the variables launch.sh exports (the job's secret HPC_RLHF_JOB_SECRET among them, passed by name, never on a
# command line), the user's NCCL_* / TORCH_NCCL_* / HF_* and MASTER_ADDR / MASTER_PORT are therefore forced (pyxis --container-env, apptainer APPTAINERENV_*). PYTHONPATH is the repository, so that the
# checkout, not the copy installed in the image, is what runs; the host's own PYTHONPATH (host packages) is not
# carried in, and PYTHONNOUSERSITE=1 keeps packages pip-installed into ~/.local on the host (a mounted home) out of
# the image's Python.

: "${RECIPE:?slurm/container.sh is sourced by slurm/launch.sh}"

container_fail() {
    echo "$RECIPE: $*" >&2
    exit 1
}

# Inside the repository, which is mounted whole.
container_in_repo() {
    case "$1/" in
        "$PWD"/*) return 0 ;;
        *) return 1 ;;
    esac
}

# Already reachable, writable, at the same path: inside the repository or inside a read-write mount at its own path.
container_covered() {
    local bind src dst flags
    container_in_repo "$1" && return 0
    local binds=()
    IFS=, read -r -a binds <<< "$CONTAINER_BINDS"
    for bind in ${binds[@]+"${binds[@]}"}; do
        IFS=: read -r src dst flags <<< "$bind"
        if [ "$src" = "$dst" ] && [ -z "$flags" ]; then
            case "$1/" in
                "$src"/*) return 0 ;;
            esac
        fi
    done
    return 1
}

# Add SRC:DST[:FLAGS] to CONTAINER_BINDS; WHAT says where the mount comes from, for the error messages.
container_bind() {
    local src=$1 dst=$2 flags=$3 what=$4 path
    for path in "$src" "$dst"; do
        case "$path" in
            /*) ;;
            *) container_fail "$what: '$path' is not an absolute path" ;;
        esac
        case "$path" in
            *,* | *:*) container_fail "$what: cannot mount '$path': ',' and ':' separate mounts" ;;
        esac
    done
    [ -e "$src" ] || container_fail "$what: '$src' does not exist on $(hostname)"
    CONTAINER_BINDS="${CONTAINER_BINDS:+$CONTAINER_BINDS,}$src:$dst${flags:+:$flags}"
}

# Rebuild CONTAINER_ONCE / CONTAINER_SRUN / CONTAINER_EXEC from CONTAINER_BINDS and the environment now exported.
# shellcheck disable=SC2034  # the arrays are read by slurm/launch.sh, which sources this file
container_flags() {
    local names=() name
    for name in PYTHONUNBUFFERED OMP_NUM_THREADS TOKENIZERS_PARALLELISM PYTHONPATH PYTHONNOUSERSITE \
                HPC_RLHF_STALL_FILE HPC_RLHF_JOB_SECRET MASTER_ADDR MASTER_PORT; do
        if [ -n "${!name+x}" ]; then names+=("$name"); fi
    done
    while read -r name; do
        case "$name" in
            NCCL_* | TORCH_NCCL_* | HF_*) names+=("$name") ;;
        esac
    done < <(compgen -e | sort)
    if [ "$CONTAINER_KIND" = pyxis ]; then
        local flags=(--container-image="$CONTAINER_REF" --container-mounts="$CONTAINER_BINDS"
                     --container-workdir="$PWD" --container-env="$(IFS=,; echo "${names[*]}")")
        # One task on one node; given explicitly, as srun would otherwise take the job's task and node counts
        # from the environment sbatch sets.
        CONTAINER_ONCE=(srun --nodes=1 --ntasks=1 "${flags[@]}")
        CONTAINER_SRUN=("${flags[@]}")
        CONTAINER_EXEC=()
    else
        for name in "${names[@]}"; do export "${CONTAINER_ENV_PREFIX}${name}=${!name}"; done
        local exec=("$CONTAINER_BIN" exec)
        if [ "$GPU_JOB" = 1 ]; then exec+=(--nv); fi
        exec+=(--bind "$CONTAINER_BINDS" --pwd "$PWD" "$CONTAINER_REF")
        CONTAINER_ONCE=("${exec[@]}")
        CONTAINER_SRUN=()
        CONTAINER_EXEC=("${exec[@]}")
    fi
}

# Before the asset step and the guard: runtime, image, the mounts every step gets, the environment.
container_setup() {
    case "${CONTAINER_RUNTIME:-}" in
        pyxis)
            CONTAINER_KIND=pyxis ;;
        apptainer | singularity)
            CONTAINER_KIND=apptainer
            if [ -n "${APPTAINER_BIN:-}" ]; then
                command -v "$APPTAINER_BIN" >/dev/null \
                    || container_fail "APPTAINER_BIN=$APPTAINER_BIN is not a command on $(hostname)"
                CONTAINER_BIN=$APPTAINER_BIN
            else
                local candidates=(apptainer singularity) bin
                if [ "$CONTAINER_RUNTIME" = singularity ]; then candidates=(singularity apptainer); fi
                CONTAINER_BIN=
                for bin in "${candidates[@]}"; do
                    if command -v "$bin" >/dev/null; then CONTAINER_BIN=$bin; break; fi
                done
                [ -n "$CONTAINER_BIN" ] || container_fail "CONTAINER_RUNTIME=$CONTAINER_RUNTIME: neither apptainer" \
                    "nor singularity is on PATH on $(hostname); load its module or set APPTAINER_BIN"
            fi
            # SingularityCE reads SINGULARITYENV_*; Apptainer reads APPTAINERENV_* (and the older name too).
            case "$(basename "$CONTAINER_BIN")" in
                singularity*) CONTAINER_ENV_PREFIX=SINGULARITYENV_ ;;
                *) CONTAINER_ENV_PREFIX=APPTAINERENV_ ;;
            esac ;;
        "")
            container_fail "CONTAINER_IMAGE=$CONTAINER_IMAGE is set but CONTAINER_RUNTIME is not: set" \
                "CONTAINER_RUNTIME=pyxis (srun --container-image) or CONTAINER_RUNTIME=apptainer" ;;
        *)
            container_fail "unknown CONTAINER_RUNTIME=$CONTAINER_RUNTIME: use pyxis (srun --container-image," \
                "enroot) or apptainer (apptainer or singularity exec)" ;;
    esac

    CONTAINER_REF=$CONTAINER_IMAGE
    if [ -f "$CONTAINER_IMAGE" ]; then
        CONTAINER_REF="$(cd "$(dirname "$CONTAINER_IMAGE")" && pwd)/$(basename "$CONTAINER_IMAGE")"
    else
        case "$CONTAINER_IMAGE" in
            /* | ./* | ../* | *.sqsh | *.squashfs | *.sif)
                container_fail "CONTAINER_IMAGE=$CONTAINER_IMAGE: no such file on $(hostname)" ;;
        esac
    fi

    CONTAINER_BINDS=
    container_bind "$PWD" "$PWD" "" "the repository (job working directory)"
    mkdir -p "$JOB_STATE_DIR"
    if ! container_in_repo "$JOB_STATE_DIR"; then
        container_bind "$JOB_STATE_DIR" "$JOB_STATE_DIR" "" "the job state directory"
    fi
    if [ -n "$RECIPE_FILE" ] && [ -r "$RECIPE_FILE" ] \
            && ! container_in_repo "$(cd "$(dirname "$RECIPE_FILE")" && pwd)/$(basename "$RECIPE_FILE")"; then
        cp "$RECIPE_FILE" "$JOB_STATE_DIR/$(basename "$RECIPE_FILE")"
        RECIPE_FILE="$JOB_STATE_DIR/$(basename "$RECIPE_FILE")"
    fi
    local entry src dst flags rest
    local entries=()
    IFS=, read -r -a entries <<< "${CONTAINER_MOUNTS:-}"
    for entry in ${entries[@]+"${entries[@]}"}; do
        [ -n "$entry" ] || continue
        IFS=: read -r src dst flags rest <<< "$entry"
        [ -z "$rest" ] || container_fail "CONTAINER_MOUNTS: '$entry' is not SRC[:DST[:FLAGS]]"
        container_bind "$src" "${dst:-$src}" "$flags" "CONTAINER_MOUNTS"
    done

    export PYTHONPATH="$PWD" PYTHONNOUSERSITE=1
    container_flags
}

# After the guard, before srun: the output directories (from the config, by the image's Python) and the stall file.
container_ranks() {
    local found word dir
    found=$("${CONTAINER_ONCE[@]}" "$PYTHON" - "$PLAN_KIND" "$CONFIG" "$@" <<'PY'
import os
import sys

from hpc_rlhf.config import load_config
from hpc_rlhf.config.supervised import load_supervised_config

kind, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
cfg = load_config(config, overrides) if kind == "rl" else load_supervised_config(kind, config, overrides)
for path in (cfg.train.output_dir, cfg.ckpt.path):
    if path:
        print("output", os.path.abspath(path))
PY
    ) || container_fail "could not read train.output_dir and ckpt.path from $CONFIG in $CONTAINER_IMAGE (see above)"
    while read -r word dir; do
        if [ "$word" != output ] || container_covered "$dir"; then continue; fi
        mkdir -p "$dir"
        container_bind "$dir" "$dir" "" "train.output_dir / ckpt.path"
    done <<< "$found"
    container_flags
    echo "[$(date -Is)] job ${SLURM_JOB_ID}: ranks run in $CONTAINER_REF ($CONTAINER_RUNTIME), mounts $CONTAINER_BINDS"
}
