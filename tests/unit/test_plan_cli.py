import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.cli.plan import plan
from hpc_rlhf.config import load_config
from hpc_rlhf.dist.memory_estimate import count_params_from_hf_config, role_memory
from hpc_rlhf.dist.placement import build_placement

ROOT = Path(__file__).resolve().parents[2]


def test_ppo_70b_plan_fits_on_8x8(capsys):
    assert plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "64 ranks" in out and "critic" in out and "8 engines" in out and "yes" in out


def test_plan_rejects_layout_that_does_not_fit(capsys):
    assert plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "1", "--gpus-per-node", "8"]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_plan_rejects_impossible_layout(capsys):
    assert plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "1", "--gpus-per-node", "6"]) == 1
    assert "rollout.tensor_parallel_size=8" in capsys.readouterr().err


def test_console_script_and_module_entry():
    for cmd in (["hpc-rlhf", "plan"], [sys.executable, "-m", "hpc_rlhf.cli.plan"]):
        out = subprocess.run([*cmd, "--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8",
                              "--gpus-per-node", "8"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "actor" in out.stdout


def test_param_count_matches_llama_8b():
    llama3_8b = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "intermediate_size": 14336,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}
    assert abs(count_params_from_hf_config(llama3_8b) - 8.03e9) / 8.03e9 < 0.01


def test_size_from_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128,
         "num_attention_heads": 4, "tie_word_embeddings": True}))
    cfg = load_config(None, [f"actor.pretrain={tmp_path}", "ds.zero_stage=0"])
    mem = role_memory(cfg, build_placement(cfg, 2), "actor")
    n = 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 100 * 64 + 64
    assert mem.weights_gib * 1024**3 == pytest.approx(n * 2)  # bf16 on GPU
    assert mem.optim_gib * 1024**3 == pytest.approx(n * 12)


@pytest.mark.parametrize("stage,divisors", [(0, (1, 1, 1)), (1, (1, 1, 4)), (2, (1, 4, 4)), (3, (4, 4, 4))])
def test_zero_stage_sharding(stage, divisors):
    cfg = load_config(None, ["actor.num_params_b=1", f"ds.zero_stage={stage}"])
    mem = role_memory(cfg, build_placement(cfg, 4), "actor")
    gib = 1e9 / 1024**3
    assert mem.weights_gib == pytest.approx(2 * gib / divisors[0])
    assert mem.grads_gib == pytest.approx(2 * gib / divisors[1])
    assert mem.optim_gib == pytest.approx(12 * gib / divisors[2])


RL_RECIPES = [p for p in sorted((ROOT / "configs").glob("*.yaml")) if p.name.split("_")[0] in ("ppo", "grpo")]
GPU_RECIPES = [p for p in RL_RECIPES if load_config(p).rollout.backend == "vllm"]


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipes_pass_plan_on_their_slurm_request(recipe):
    cfg = load_config(recipe)
    assert plan(["--config", str(recipe), "--nodes", str(cfg.slurm.nodes),
                 "--gpus-per-node", str(cfg.slurm.gpus_per_node)]) == 0
