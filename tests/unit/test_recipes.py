"""The sbatch recipes without a cluster: #SBATCH contract, guard, and the srun line (srun stubbed)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = {"ppo_70b": ("train_ppo", 8), "grpo_7b": ("train_ppo", 1), "grpo_longctx_7b": ("train_ppo", 2),
               "sft": ("train_sft", 1), "dpo": ("train_dpo", 1)}


def _directives(name: str) -> dict[str, str]:
    text = (ROOT / f"slurm/{name}.sbatch").read_text()
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, flags=re.M))


@pytest.mark.parametrize("name", [*GPU_RECIPES, "cpu_debug"])
def test_sbatch_contract(name):
    d = _directives(name)
    assert re.fullmatch(r"USR1@\d+", d["signal"])  # to every task (rank), not "B:" (the shell only)
    assert "requeue" in d and d["open-mode"] == "append"
    code = "\n".join(line for line in (ROOT / f"slurm/{name}.sbatch").read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    assert "srun --kill-on-bad-exit=1" in code and "torchrun" not in code
    assert "ray" not in code.lower().split() and "sleep" not in code
    if name != "cpu_debug":
        assert d["ntasks-per-node"] == d["gpus-per-node"] == "8"


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_guard_and_srun_line(name, tmp_path):
    entry, nodes = GPU_RECIPES[name]
    env = {**os.environ, "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": "7",
           "SLURM_NTASKS": str(8 * nodes), "SLURM_JOB_NODELIST": "gpu[01-08]", "SLURM_CPUS_PER_TASK": "12",
           "SLURM_RESTART_COUNT": "1"}
    stub = "srun() { echo \"SRUN $*\"; }; export -f srun; "
    run = lambda *args: subprocess.run(["bash", "-c", stub + f"bash slurm/{name}.sbatch \"$@\"", "x", *args],
                                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = run("logger.logging_steps=2")
    assert out.returncode == 0, out.stderr
    srun = [line for line in out.stdout.splitlines() if line.startswith("SRUN ")]
    assert srun == [f"SRUN --kill-on-bad-exit=1 --label --cpus-per-task=12 python -m hpc_rlhf.cli.{entry} "
                    f"--config {_config(name)} ckpt.load=true logger.logging_steps=2"]
    bad = run("no_such_section.x=1")
    assert bad.returncode == 1 and "not starting" in bad.stderr and "SRUN" not in bad.stdout


def _config(name: str) -> str:
    text = (ROOT / f"slurm/{name}.sbatch").read_text()
    return re.search(r'CONFIG="\$\{CONFIG:-(\S+)\}"', text).group(1)
