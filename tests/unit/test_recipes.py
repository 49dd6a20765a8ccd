"""The sbatch recipes without a cluster: thin wrappers over slurm/launch.sh, #SBATCH contract, guard, srun line.

Each ``slurm/<recipe>.sbatch`` holds its #SBATCH lines and a few parameters, then sources the shared body
``slurm/launch.sh``. The recipes run here with ``srun`` stubbed by a shell function; the guard
(``hpc-rlhf plan``) runs for real. ``tests/slurm`` submits ``cpu_debug.sbatch`` to a real cluster.
"""

import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "slurm/launch.sh"
CONTAINER = ROOT / "slurm/container.sh"  # sourced by launch.sh for CONTAINER_IMAGE: tests/unit/test_containers.py
# recipe: (entry point, nodes, tasks per node, cpus per task)
RECIPES = {"ppo_70b": ("train_ppo", 8, 8, 12), "grpo_7b": ("train_ppo", 1, 8, 12),
           "grpo_longctx_7b": ("train_ppo", 2, 8, 12), "sft": ("train_sft", 1, 8, 12),
           "dpo": ("train_dpo", 1, 8, 12), "cpu_debug": ("train_ppo", 1, 2, 1)}
GPU_RECIPES = [name for name in RECIPES if name != "cpu_debug"]
PARAMS = {"RECIPE", "ENTRY", "CONFIG", "DEFAULT_OMP_THREADS", "GPU_JOB", "PREPARE_ASSETS"}
ENTRIES = {"train_ppo", "train_sft", "train_rm", "train_dpo", "train_kto"}
# srun stand-in: the command line and what the ranks would inherit
SRUN_STUB = ('srun() { echo "SRUN $*"; echo "ENV OMP_NUM_THREADS=$OMP_NUM_THREADS '
             'NCCL_DEBUG=${NCCL_DEBUG-unset}"; }; export -f srun; ')


def _path(name: str) -> Path:
    return ROOT / f"slurm/{name}.sbatch"


def _directives(name: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", _path(name).read_text(), flags=re.MULTILINE))


def _code(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _params(name: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+)=(.*)$", _path(name).read_text(), flags=re.MULTILINE))


def _default_config(name: str) -> str:
    return re.fullmatch(r'"\$\{CONFIG:-(\S+)\}"', _params(name)["CONFIG"]).group(1)


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without SLURM or recipe knobs of its own (pytest may itself run in a job)."""
    knobs = {"CONFIG", "PYTHON", "PLAN_ARGS", "OMP_NUM_THREADS", "NCCL_DEBUG", *PARAMS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in knobs}
    return {**env, "PYTHON": sys.executable, **extra}


def _job_env(name: str, restart: int = 1) -> dict[str, str]:
    _, nodes, tasks, cpus = RECIPES[name]
    return _env(SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS_PER_NODE=str(tasks), SLURM_JOB_ID="7",
                SLURM_NTASKS=str(nodes * tasks), SLURM_JOB_NODELIST="gpu[01-08]", SLURM_CPUS_PER_TASK=str(cpus),
                SLURM_RESTART_COUNT=str(restart), SLURM_SUBMIT_DIR=str(ROOT))


def _run(script: Path, *args: str, env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", SRUN_STUB + 'bash "$0" "$@"', str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def _srun_lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stdout.splitlines() if line.startswith("SRUN ")]


def test_every_recipe_is_listed():
    assert {p.stem for p in (ROOT / "slurm").glob("*.sbatch")} == set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_sbatch_contract(name):
    d = _directives(name)
    assert re.fullmatch(r"USR1@\d+", d["signal"])  # to every task (rank), not "B:" (the shell only)
    assert "requeue" in d and d["open-mode"] == "append" and d["output"] == "slurm-%x-%j.out"
    assert d["job-name"].startswith("hpc-rlhf-")
    # sbatch stops reading #SBATCH lines at the first command: every directive must come before it
    lines = _path(name).read_text().splitlines()
    first_code = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_code:])
    if name in GPU_RECIPES:
        assert d["ntasks-per-node"] == d["gpus-per-node"] == "8"  # one rank per GPU


@pytest.mark.parametrize("name", RECIPES)
def test_wrapper_only_sets_parameters_and_sources_the_shared_body(name):
    params = _params(name)
    assert set(params) == PARAMS | {"LAUNCH"}, "a wrapper sets every parameter (none leaks in from the env)"
    assert params["RECIPE"] == f"{name}.sbatch"
    entry = params["ENTRY"]
    assert entry == RECIPES[name][0] and entry in ENTRIES and find_spec(f"hpc_rlhf.cli.{entry}") is not None
    assert (ROOT / _default_config(name)).is_file()
    assert params["GPU_JOB"] == ("1" if name in GPU_RECIPES else "0")
    assert params["PREPARE_ASSETS"] in {"0", "1"}
    code = "\n".join(_code(_path(name)))
    assert code.splitlines()[0] == "set -euo pipefail" and code.splitlines()[-1] == 'source "$LAUNCH" "$@"'
    assert "SLURM_SUBMIT_DIR" in code and "not found" in code  # the spooled copy finds the body, or says why
    for body_only in ("srun", "hpc_rlhf.cli", "RESUME", "export "):  # the body is not copied back in
        assert body_only not in code


def test_shared_body():
    code = "\n".join(_code(LAUNCH))
    assert not re.search(r"^#SBATCH", LAUNCH.read_text(), flags=re.MULTILINE)  # sbatch would never read them here
    assert '-m hpc_rlhf.cli.plan --config "$CONFIG" --kind "$PLAN_KIND"' in code
    assert "${PLAN_ARGS:-}" in code and "not starting" in code
    assert code.count("srun ") == 1
    assert 'srun --kill-on-bad-exit=1 --label --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"' in code
    assert '-m "hpc_rlhf.cli.$ENTRY" --config "$CONFIG"' in code
    assert "SLURM_RESTART_COUNT" in code and "ckpt.load=true" in code
    assert "torchrun" not in code and "ray" not in code.lower().split() and "sleep" not in code
    # every entry point a wrapper may name maps to a trainer kind that plan knows
    from hpc_rlhf.cli.plan import KINDS

    kinds = {"rl" if e == "train_ppo" else e.removeprefix("train_") for e in ENTRIES}
    assert kinds <= set(KINDS)
    assert all(e in code for e in ENTRIES)


@pytest.mark.parametrize("path", sorted((ROOT / "slurm").glob("*.sbatch")) + [LAUNCH, CONTAINER],
                         ids=lambda p: p.name)
def test_bash_syntax(path):
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck():
    # slurm/.shellcheckrc follows the sourced body, so a parameter the body does not read is reported
    files = [str(p) for p in sorted((ROOT / "slurm").glob("*.sbatch"))] + [str(LAUNCH), str(CONTAINER)]
    out = subprocess.run(["shellcheck", *files], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_guard_and_srun_line(name, tmp_path):
    entry, *_ = RECIPES[name]
    env = _job_env(name)
    # the CPU recipe builds its tiny model and prompts before the guard: keep them out of the checkout
    local = ([f"actor.pretrain={tmp_path / 'tiny'}", f"data.prompt_data=[{tmp_path / 'prompts.jsonl'}]"]
             if name == "cpu_debug" else [])
    out = _run(_path(name), *local, "logger.logging_steps=2", env=env)
    assert out.returncode == 0, out.stderr
    overrides = " ".join([*local, "logger.logging_steps=2"])
    expected = (f"SRUN --kill-on-bad-exit=1 --label --cpus-per-task={RECIPES[name][3]} "
                f"{sys.executable} -m hpc_rlhf.cli.{entry} --config {_default_config(name)} ckpt.load=true {overrides}")
    assert _srun_lines(out) == [expected]
    nccl = "WARN" if name in GPU_RECIPES else "unset"
    omp = "8" if name in GPU_RECIPES else "1"
    assert f"ENV OMP_NUM_THREADS={omp} NCCL_DEBUG={nccl}" in out.stdout
    if name == "cpu_debug":
        assert (tmp_path / "tiny/config.json").is_file() and (tmp_path / "prompts.jsonl").is_file()
    bad = _run(_path(name), *local, "no_such_section.x=1", env=env)
    assert bad.returncode == 1 and "not starting" in bad.stderr and not _srun_lines(bad)
    assert "no_such_section" in bad.stderr  # the reason is in the job log


def test_no_resume_on_first_start_and_user_knobs_kept():
    env = {**_job_env("grpo_7b", restart=0), "OMP_NUM_THREADS": "3", "NCCL_DEBUG": "INFO",
           "CONFIG": "configs/grpo_qwen2.5_7b.yaml", "PLAN_ARGS": "--gpu-mem-gb 141"}
    out = _run(_path("grpo_7b"), env=env)
    assert out.returncode == 0, out.stderr
    assert _srun_lines(out)[0].endswith("--config configs/grpo_qwen2.5_7b.yaml")  # no ckpt.load=true
    assert "ENV OMP_NUM_THREADS=3 NCCL_DEBUG=INFO" in out.stdout
    assert "127 GiB" in out.stdout  # PLAN_ARGS reached plan: 141 GiB less 10% headroom
    tight = _run(_path("grpo_7b"), env={**env, "PLAN_ARGS": "--gpu-mem-gb 8"})
    assert tight.returncode == 1 and "not starting" in tight.stderr and not _srun_lines(tight)



def test_task_counts_follow_a_resized_allocation(tmp_path):
    # A job resized while pending (scontrol update NumTasks=3 TasksPerNode=3) keeps sbatch's SLURM_NTASKS=2 and
    # SLURM_NTASKS_PER_NODE=2 in its environment; SLURM_TASKS_PER_NODE is the allocation's. The SLURM test of this
    # is tests/slurm/test_slurm_jobs.py::test_requeued_with_another_number_of_tasks_resumes_and_finishes.
    local = [f"actor.pretrain={tmp_path / 'tiny'}", f"data.prompt_data=[{tmp_path / 'prompts.jsonl'}]"]
    env = {**_job_env("cpu_debug"), "SLURM_NPROCS": "2", "SLURM_TASKS_PER_NODE": "3"}
    out = _run(_path("cpu_debug"), *local, env=env)
    assert out.returncode == 0, out.stderr
    assert "the allocation has 3 tasks (SLURM_TASKS_PER_NODE=3), the job was submitted with 2" in out.stdout
    assert "restart 1: 3 ranks on" in out.stdout and "1 nodes x 3 GPUs = 3 ranks" in out.stdout  # and the guard
    same = _run(_path("grpo_longctx_7b"), env={**_job_env("grpo_longctx_7b"), "SLURM_TASKS_PER_NODE": "8(x2)"})
    assert same.returncode == 0, same.stderr
    assert "the allocation has" not in same.stdout and "restart 1: 16 ranks on" in same.stdout

def test_offline_guard_checks_the_recipe_trainer(tmp_path):
    # plan alone infers the trainer from the file name; the recipe must check any CONFIG as its own trainer
    config = tmp_path / "my_run.yaml"
    config.write_text((ROOT / "configs/sft_llama3_8b.yaml").read_text())
    out = _run(_path("sft"), env={**_job_env("sft"), "CONFIG": str(config)})
    assert out.returncode == 0, out.stderr
    assert f"-m hpc_rlhf.cli.train_sft --config {config} " in _srun_lines(out)[0]
    wrong = _run(_path("dpo"), env={**_job_env("dpo"), "CONFIG": str(config)})  # an SFT config under DPO
    assert wrong.returncode == 1 and "not starting" in wrong.stderr and not _srun_lines(wrong)


def test_spooled_copy_finds_the_shared_body(tmp_path):
    # sbatch runs a copy of the script from its spool directory; the body comes from the checkout
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(_path("grpo_7b"), spool / "slurm_script")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = str(ROOT / "configs/grpo_qwen2.5_7b.yaml")
    # job directory = the repository (sbatch run from there, or --chdir to it)
    env = _job_env("grpo_7b")
    assert len(_srun_lines(_run(spool / "slurm_script", env={**env, "SLURM_SUBMIT_DIR": str(elsewhere)}))) == 1
    # --chdir elsewhere, sbatch run from the repository: found through SLURM_SUBMIT_DIR
    out = _run(spool / "slurm_script", env={**env, "CONFIG": config}, cwd=elsewhere)
    assert len(_srun_lines(out)) == 1, out.stderr
    # neither: a clear message, nothing started
    lost = _run(spool / "slurm_script", env={**env, "SLURM_SUBMIT_DIR": str(elsewhere)}, cwd=elsewhere)
    assert lost.returncode == 1 and not _srun_lines(lost)
    assert "grpo_7b.sbatch: slurm/launch.sh not found" in lost.stderr and "repository root" in lost.stderr


def test_shared_body_is_not_a_job_script():
    out = subprocess.run(["bash", str(LAUNCH)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode != 0 and "sourced by a slurm/*.sbatch recipe" in out.stderr


def _rl_recipe_worlds() -> dict[str, int]:
    """Every RL recipe (configs/*.yaml with no model: section) -> the world it is meant for: each sbatch recipe's
    default config at the recipe's node x task count, each other config at its slurm: section's size (or the
    torchrun line its header gives)."""
    import yaml

    worlds = {}
    for name, (entry, nodes, tasks, _) in RECIPES.items():
        if entry == "train_ppo":
            worlds[_default_config(name)] = nodes * tasks
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        sections = yaml.safe_load(path.read_text()) or {}
        rel = f"configs/{path.name}"
        if "model" in sections or rel in worlds:
            continue
        slurm = sections.get("slurm", {})
        nproc = re.search(r"--nproc_per_node (\d+)", path.read_text())
        assert slurm or nproc, f"{rel}: neither a slurm: section nor a torchrun --nproc_per_node line says its size"
        worlds[rel] = slurm.get("nodes", 1) * slurm.get("gpus_per_node", 8) if slurm else int(nproc.group(1))
    return worlds


@pytest.mark.parametrize(("config", "world"), sorted(_rl_recipe_worlds().items()))
def test_every_rl_recipe_is_a_layout_the_engines_run(config, world):
    """No shipped recipe describes a layout the engines cannot run: placement, ZeRO-3 on a subset and the vLLM
    placement rule (external launcher only when every rank hosts rollout) pass at the recipe's own world size,
    and the rule does bite: the same recipe moved to a layout it does not fit is refused, naming the key."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.rollout import resolved_vllm_mode
    from hpc_rlhf.world.placement import PlacementError, build_placement

    cfg = load_config(ROOT / config)
    placement = build_placement(cfg, world)
    rollout_on_subset = len(placement.roles["rollout"].ranks) < world
    if cfg.rollout.backend == "vllm":
        expected = "server_process" if rollout_on_subset else "external_launcher"
        mode = resolved_vllm_mode(cfg.rollout.vllm_mode, cfg.train.colocate_all)
        assert mode == expected, f"{config}: rollout.vllm_mode resolves to {mode}, should be {expected}"
        other = "external_launcher" if expected == "server_process" else "server_process"
        with pytest.raises(PlacementError, match=f"rollout.vllm_mode={other}"):
            build_placement(load_config(ROOT / config, [f"rollout.vllm_mode={other}"]), world)
    if cfg.ds.zero_stage == 3:
        assert placement.layout == "colocated", f"{config}: ZeRO-3 runs in the colocated layout only"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_grace_covers_a_step_and_a_checkpoint(name, tmp_path):
    """The guard checks the recipe's own #SBATCH --signal grace; with a grace too short it names both numbers."""
    local = ([f"actor.pretrain={tmp_path / 'tiny'}", f"data.prompt_data=[{tmp_path / 'prompts.jsonl'}]"]
             if name == "cpu_debug" else [])
    out = _run(_path(name), *local, env=_job_env(name))
    assert out.returncode == 0, out.stderr
    grace = _directives(name)["signal"].split("@")[1]
    assert f"signal grace {grace} s (--signal in {name}.sbatch" in out.stdout
    assert ("CPU node" in out.stdout) == (name == "cpu_debug")  # CPU recipes are timed as the CPU they run on
    if name == "cpu_debug":
        return  # its step and checkpoint take well under the shortest grace (1 s)
    short = tmp_path / f"{name}.sbatch"
    short.write_text(re.sub(r"--signal=USR1@\d+", "--signal=USR1@1", _path(name).read_text()))
    (tmp_path / "slurm").symlink_to(ROOT / "slurm")  # the copy finds slurm/launch.sh from its directory
    bad = _run(short, *local, env={**_job_env(name), "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert bad.returncode == 1 and "not starting" in bad.stderr and not _srun_lines(bad)
    assert f"1 s before the time limit (--signal in {name}.sbatch)" in bad.stderr
    assert re.search(r"one step \([\d.]+ s\) plus one checkpoint save \([\d.]+ s\)", bad.stderr), bad.stderr
