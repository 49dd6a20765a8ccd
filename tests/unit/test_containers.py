"""The recipes in a container image (slurm/container.sh), without a cluster or a container runtime.

``srun``, ``apptainer`` and ``singularity`` are stand-ins on PATH that print their command line (to stderr:
the output-path query's stdout is read by the script). The ``srun``
stand-in runs a one-task step (how pyxis runs the asset step, the guard and the output-path query in the image)
without its container flags, and prints what the ranks would inherit for the rank step; the ``apptainer`` one
runs the command after the image. So the guard (``hpc-rlhf plan``) runs for real, through the runtime's command.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_recipes import RECIPES, ROOT, _default_config, _directives, _job_env, _path

CONTAINER_SH = ROOT / "slurm/container.sh"
PY = sys.executable
SRUN = """#!/usr/bin/env bash
echo "SRUN $*" >&2
if [ "${1:-} ${2:-}" = "--nodes=1 --ntasks=1" ]; then
    shift 2
    while [ "${1#--}" != "$1" ]; do shift; done
    exec "$@"
fi
env | grep -E '^(OMP_NUM_THREADS|NCCL_DEBUG|PYTHON(PATH|NOUSERSITE)|HPC_RLHF_STALL_FILE|(APPTAINER|SINGULARITY)ENV_)' \\
    | sort | sed 's/^/ENV /' >&2
"""
APPTAINER = """#!/usr/bin/env bash
echo "$(basename "$0" | tr a-z A-Z) $*" >&2
[ "$1" = exec ] || exit 2
shift
while :; do
    case "$1" in
        --nv) shift ;;
        --bind | --pwd) shift 2 ;;
        *) break ;;
    esac
done
shift
exec "$@"
"""
# the environment variables launch.sh forces into the image, before the user's NCCL_* ones
FORCED = "PYTHONUNBUFFERED,OMP_NUM_THREADS,TOKENIZERS_PARALLELISM,PYTHONPATH,PYTHONNOUSERSITE"
GPU_FORCED = "NCCL_DEBUG,TORCH_NCCL_ASYNC_ERROR_HANDLING"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write(bin_dir / "srun", SRUN)
    _write(bin_dir / "apptainer", APPTAINER)
    return bin_dir


def _run(name: str, *args: str, stubs: Path, cwd: Path = ROOT, script: Path | None = None,
         **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in _job_env(name).items()
           if not re.match(r"(NCCL_|TORCH_NCCL_|HF_|MASTER_|CONTAINER_|APPTAINER|SINGULARITY)", k)}
    env = {**env, "PATH": f"{stubs}:{os.environ['PATH']}", **extra}
    return subprocess.run(["bash", str(script or _path(name)), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def _lines(out: subprocess.CompletedProcess, prefix: str) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.startswith(prefix)]


def _image(tmp_path: Path, suffix: str) -> Path:
    image = tmp_path / f"hpc-rlhf{suffix}"
    image.write_bytes(b"")
    return image


def _grace(name: str) -> str:
    return _directives(name)["signal"].split("@")[1]


def _local(name: str, tmp_path: Path) -> list[str]:
    # the CPU recipe builds its tiny model and prompts before the guard: keep them out of the checkout
    return ([f"actor.pretrain={tmp_path / 'tiny'}", f"data.prompt_data=[{tmp_path / 'prompts.jsonl'}]"]
            if name == "cpu_debug" else [])


@pytest.mark.parametrize("name", ["grpo_7b", "cpu_debug"])
def test_pyxis(name, tmp_path, stubs):
    entry, _, tasks, cpus = RECIPES[name]
    image = _image(tmp_path, ".sqsh")
    local = _local(name, tmp_path)
    out = _run(name, *local, "logger.logging_steps=2", stubs=stubs, CONTAINER_IMAGE=str(image),
               CONTAINER_RUNTIME="pyxis")
    assert out.returncode == 0, out.stderr
    config, overrides = _default_config(name), " ".join([*local, "logger.logging_steps=2"])
    gpu = name != "cpu_debug"
    # launch.sh exports the job's secret before the first srun, so every container step gets it by name.
    forced = FORCED + ",HPC_RLHF_JOB_SECRET" + (f",{GPU_FORCED}" if gpu else "")
    once = (f"SRUN --nodes=1 --ntasks=1 --container-image={image} --container-mounts={ROOT}:{ROOT} "
            f"--container-workdir={ROOT} --container-env={forced}")
    ranks = (f"--container-image={image} --container-mounts={ROOT}:{ROOT} --container-workdir={ROOT} "
             f"--container-env={FORCED},HPC_RLHF_STALL_FILE,HPC_RLHF_JOB_SECRET{f',{GPU_FORCED}' if gpu else ''}")
    plan = (f"{PY} -m hpc_rlhf.cli.plan --config {config} --kind rl --nodes 1 --gpus-per-node {tasks} "
            f"--sbatch {_path(name)}{'' if gpu else ' --gpu cpu'} --resume auto {overrides}")  # a restart
    expected = ([] if gpu else [f"{once} {PY} - rl {config} {overrides}"]) + [
        f"{once} {plan}",
        f"{once} {PY} - rl {config} {overrides}",
        f"SRUN --kill-on-bad-exit=1 --label --cpus-per-task={cpus} {ranks} "
        f"{PY} -m hpc_rlhf.cli.{entry} --config {config} ckpt.load=true {overrides}",
    ]
    assert _lines(out, "SRUN ") == expected
    # the guard ran (inside the image, through srun), and so did the asset step of the CPU recipe
    assert f"signal grace {_grace(name)} s (--signal in {name}.sbatch" in out.stdout
    if not gpu:
        assert (tmp_path / "tiny/config.json").is_file()
    env = _lines(out, "ENV ")
    assert f"ENV PYTHONPATH={ROOT}" in env and "ENV PYTHONNOUSERSITE=1" in env
    assert f"ENV OMP_NUM_THREADS={8 if gpu else 1}" in env
    assert f"ENV HPC_RLHF_STALL_FILE={ROOT}/.hpc-rlhf/job-7/stalled" in env
    assert ("ENV NCCL_DEBUG=WARN" in env) == gpu
    assert f"ranks run in {image} (pyxis), mounts {ROOT}:{ROOT}" in out.stdout


@pytest.mark.parametrize("name", ["grpo_7b", "cpu_debug"])
def test_apptainer(name, tmp_path, stubs):
    entry, _, tasks, cpus = RECIPES[name]
    image = _image(tmp_path, ".sif")
    local = _local(name, tmp_path)
    out = _run(name, *local, "logger.logging_steps=2", stubs=stubs, CONTAINER_IMAGE=str(image),
               CONTAINER_RUNTIME="apptainer")
    assert out.returncode == 0, out.stderr
    config, overrides = _default_config(name), " ".join([*local, "logger.logging_steps=2"])
    gpu = name != "cpu_debug"
    exec_ = f"apptainer exec {'--nv ' if gpu else ''}--bind {ROOT}:{ROOT} --pwd {ROOT} {image}"
    plan = (f"{PY} -m hpc_rlhf.cli.plan --config {config} --kind rl --nodes 1 --gpus-per-node {tasks} "
            f"--sbatch {_path(name)}{'' if gpu else ' --gpu cpu'} --resume auto {overrides}")  # a restart
    expected = ([] if gpu else [f"APPTAINER {exec_.removeprefix('apptainer ')} {PY} - rl {config} {overrides}"]) + [
        f"APPTAINER {exec_.removeprefix('apptainer ')} {plan}",
        f"APPTAINER {exec_.removeprefix('apptainer ')} {PY} - rl {config} {overrides}",
    ]
    assert _lines(out, "APPTAINER ") == expected
    assert _lines(out, "SRUN ") == [f"SRUN --kill-on-bad-exit=1 --label --cpus-per-task={cpus} {exec_} "
                                    f"{PY} -m hpc_rlhf.cli.{entry} --config {config} ckpt.load=true {overrides}"]
    assert f"signal grace {_grace(name)} s (--signal in {name}.sbatch" in out.stdout
    if not gpu:
        assert (tmp_path / "tiny/config.json").is_file()
    # the image's own values of these would win over the host's: they are forced
    env = _lines(out, "ENV ")
    assert f"ENV APPTAINERENV_PYTHONPATH={ROOT}" in env and "ENV APPTAINERENV_PYTHONNOUSERSITE=1" in env
    assert f"ENV APPTAINERENV_OMP_NUM_THREADS={8 if gpu else 1}" in env
    assert f"ENV APPTAINERENV_HPC_RLHF_STALL_FILE={ROOT}/.hpc-rlhf/job-7/stalled" in env
    assert ("ENV APPTAINERENV_NCCL_DEBUG=WARN" in env) == gpu
    assert ("ENV APPTAINERENV_TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in env) == gpu


def test_without_an_image_nothing_changes(tmp_path, stubs):
    config = _default_config("grpo_7b")
    expected = [f"SRUN --kill-on-bad-exit=1 --label --cpus-per-task=12 {PY} -m hpc_rlhf.cli.train_ppo "
                f"--config {config} ckpt.load=true logger.logging_steps=2"]
    out = _run("grpo_7b", "logger.logging_steps=2", stubs=stubs)
    assert out.returncode == 0, out.stderr
    assert _lines(out, "SRUN ") == expected and not _lines(out, "APPTAINER ")
    assert not [line for line in _lines(out, "ENV ") if "APPTAINERENV_" in line]
    inherited = os.environ.get("PYTHONPATH")  # the host's own, untouched
    assert [line for line in _lines(out, "ENV ") if "PYTHONPATH" in line] == (
        [f"ENV PYTHONPATH={inherited}"] if inherited is not None else [])
    assert "ranks run in" not in out.stdout and "CONTAINER_" not in out.stderr
    # a runtime or mounts alone start no container; the runtime alone is noted in the log
    alone = _run("grpo_7b", "logger.logging_steps=2", stubs=stubs, CONTAINER_RUNTIME="pyxis",
                 CONTAINER_MOUNTS="/nonexistent")
    assert alone.returncode == 0, alone.stderr
    assert _lines(alone, "SRUN ") == expected
    assert "CONTAINER_RUNTIME=pyxis is set but CONTAINER_IMAGE is not; running on the host" in alone.stderr


@pytest.mark.parametrize(("extra", "message"), [
    ({"CONTAINER_RUNTIME": "docker"}, "unknown CONTAINER_RUNTIME=docker: use pyxis"),
    ({}, "CONTAINER_IMAGE={image} is set but CONTAINER_RUNTIME is not"),
    ({"CONTAINER_RUNTIME": "pyxis", "CONTAINER_IMAGE": "/no/such.sqsh"},
     "CONTAINER_IMAGE=/no/such.sqsh: no such file"),
    ({"CONTAINER_RUNTIME": "apptainer", "APPTAINER_BIN": "/no/such/apptainer"},
     "APPTAINER_BIN=/no/such/apptainer is not a command"),
    ({"CONTAINER_RUNTIME": "pyxis", "CONTAINER_MOUNTS": "/no/such/dir:/models"},
     "CONTAINER_MOUNTS: '/no/such/dir' does not exist"),
    ({"CONTAINER_RUNTIME": "pyxis", "CONTAINER_MOUNTS": "models:/models"},
     "CONTAINER_MOUNTS: 'models' is not an absolute path"),
    ({"CONTAINER_RUNTIME": "apptainer", "CONTAINER_MOUNTS": "{tmp}:/m:ro:x"},
     "CONTAINER_MOUNTS: '{tmp}:/m:ro:x' is not SRC[:DST[:FLAGS]]"),
])
def test_refused_before_anything_runs(extra, message, tmp_path, stubs):
    image = _image(tmp_path, ".sif")
    extra = {k: v.format(tmp=tmp_path) for k, v in extra.items()}
    out = _run("grpo_7b", stubs=stubs, **{"CONTAINER_IMAGE": str(image), **extra})
    assert out.returncode == 1
    assert f"grpo_7b.sbatch: {message.format(image=image, tmp=tmp_path)}" in out.stderr
    assert not _lines(out, "SRUN ") and not _lines(out, "APPTAINER ") and "signal grace" not in out.stdout


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_guard_rejection_in_the_image_starts_no_rank(runtime, tmp_path, stubs):
    image = _image(tmp_path, ".sif")
    out = _run("grpo_7b", "no_such_section.x=1", stubs=stubs, CONTAINER_IMAGE=str(image), CONTAINER_RUNTIME=runtime)
    assert out.returncode == 1 and "no_such_section" in out.stderr
    assert "plan rejected this layout or the image did not start (see above); not starting" in out.stderr
    assert not [line for line in _lines(out, "SRUN ") if "--kill-on-bad-exit" in line]


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_mounts_outside_the_repository(runtime, tmp_path, stubs):
    """Extra mounts, output and checkpoint directories outside the checkout, a job state directory elsewhere and
    sbatch's spooled copy of the recipe (which exists on the first node only: plan reads a copy in the state
    directory)."""
    image = _image(tmp_path, ".sif")
    models, data = tmp_path / "models", tmp_path / "data"
    models.mkdir()
    data.mkdir()
    submit = tmp_path / "submit"
    submit.mkdir()
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(_path("grpo_7b"), spool / "slurm_script")
    output, ckpt = tmp_path / "out/run1", tmp_path / "ckpt"
    out = _run("grpo_7b", f"train.output_dir={output}", f"ckpt.path={ckpt}", stubs=stubs,
               script=spool / "slurm_script", CONTAINER_IMAGE=str(image), CONTAINER_RUNTIME=runtime,
               CONTAINER_MOUNTS=f"{models}:/models:ro,{data},", SLURM_SUBMIT_DIR=str(submit))
    assert out.returncode == 0, out.stderr
    state = submit / ".hpc-rlhf/job-7"
    every_step = f"{ROOT}:{ROOT},{state}:{state},{models}:/models:ro,{data}:{data}"
    ranks = f"{every_step},{output}:{output},{ckpt}:{ckpt}"
    assert output.is_dir() and ckpt.is_dir()  # a mount needs its source
    assert (state / "slurm_script").read_text() == _path("grpo_7b").read_text()
    assert "signal grace 600 s (--signal in slurm_script" in out.stdout
    flag = "--container-mounts=" if runtime == "pyxis" else "--bind "
    steps = _lines(out, "SRUN --nodes=1") if runtime == "pyxis" else _lines(out, "APPTAINER ")
    assert len(steps) == 2 and all(f"{flag}{every_step} " in step for step in steps)
    assert f"--sbatch {state}/slurm_script " in steps[0]
    (rank_line,) = [line for line in _lines(out, "SRUN ") if "--kill-on-bad-exit" in line]
    assert f"{flag}{ranks} " in rank_line
    assert f"train.output_dir={output} ckpt.path={ckpt}" in rank_line
    # a directory inside a read-write mount at its own path is reachable already; inside a read-only one it is not
    nested = _run("grpo_7b", f"train.output_dir={data}/run", f"ckpt.path={models}/ckpt", stubs=stubs,
                  CONTAINER_IMAGE=str(image), CONTAINER_RUNTIME=runtime,
                  CONTAINER_MOUNTS=f"{models}:{models}:ro,{data}")
    assert nested.returncode == 0, nested.stderr
    (rank_line,) = [line for line in _lines(nested, "SRUN ") if "--kill-on-bad-exit" in line]
    assert f"{flag}{ROOT}:{ROOT},{models}:{models}:ro,{data}:{data},{models}/ckpt:{models}/ckpt " in rank_line


def test_image_uri_passes_through(tmp_path, stubs):
    # pyxis pulls a registry image itself (enroot URI); only file paths are checked here
    uri = "nvcr.io#nvidia/pytorch:25.01-py3"
    # the recipe run by a relative path (bash slurm/grpo_7b.sbatch inside salloc) is in the mounted checkout
    out = _run("grpo_7b", stubs=stubs, script=Path("slurm/grpo_7b.sbatch"), CONTAINER_IMAGE=uri,
               CONTAINER_RUNTIME="pyxis")
    assert out.returncode == 0, out.stderr
    assert len(_lines(out, "SRUN ")) == 3
    assert all(f"--container-image={uri} " in line for line in _lines(out, "SRUN "))
    assert " --sbatch slurm/grpo_7b.sbatch" in _lines(out, "SRUN ")[0]


def test_singularity_and_apptainer_bin(tmp_path, stubs):
    image = _image(tmp_path, ".sif")
    # CONTAINER_RUNTIME=singularity takes singularity first; its variables are SINGULARITYENV_*
    _write(stubs / "singularity", APPTAINER)
    out = _run("grpo_7b", stubs=stubs, CONTAINER_IMAGE=str(image), CONTAINER_RUNTIME="singularity")
    assert out.returncode == 0, out.stderr
    assert len(_lines(out, "SINGULARITY exec --nv ")) == 2 and not _lines(out, "APPTAINER ")
    assert f" singularity exec --nv --bind {ROOT}:{ROOT} " in _lines(out, "SRUN ")[0]
    assert "ENV SINGULARITYENV_OMP_NUM_THREADS=8" in out.stderr and "APPTAINERENV_" not in out.stderr
    # APPTAINER_BIN names the command, anywhere
    elsewhere = tmp_path / "opt/bin"
    elsewhere.mkdir(parents=True)
    custom = _write(elsewhere / "apptainer", APPTAINER)
    out = _run("grpo_7b", stubs=stubs, CONTAINER_IMAGE=str(image), CONTAINER_RUNTIME="apptainer",
               APPTAINER_BIN=str(custom))
    assert out.returncode == 0, out.stderr
    assert f" {custom} exec --nv " in _lines(out, "SRUN ")[0]


@pytest.mark.skipif(bool(shutil.which("apptainer") or shutil.which("singularity")),
                    reason="an apptainer or singularity is installed on this machine")
def test_apptainer_runtime_without_a_command(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write(bin_dir / "srun", SRUN)
    out = _run("grpo_7b", stubs=bin_dir, CONTAINER_IMAGE=str(_image(tmp_path, ".sif")),
               CONTAINER_RUNTIME="apptainer")
    assert out.returncode == 1 and not _lines(out, "SRUN ")
    assert "CONTAINER_RUNTIME=apptainer: neither apptainer nor singularity is on PATH" in out.stderr


def test_container_body_is_not_run_on_its_own():
    out = subprocess.run(["bash", str(CONTAINER_SH)], cwd=ROOT, capture_output=True, text=True, timeout=30,
                         check=False, env={k: v for k, v in os.environ.items() if k != "RECIPE"})
    assert out.returncode != 0 and "sourced by slurm/launch.sh" in out.stderr
