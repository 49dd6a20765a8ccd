import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc_rlhf.cli.plan import plan
from hpc_rlhf.config import load_config
from hpc_rlhf.planning.memory_estimate import DS_REDUCE_BUCKET_SIZE, activation_bytes, role_memory
from hpc_rlhf.planning.model_shape import ModelShape, count_params_from_hf_config, role_shape
from hpc_rlhf.world.placement import build_placement

ROOT = Path(__file__).resolve().parents[2]


def test_ppo_70b_plan_fits_on_8x8(capsys):
    assert plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "64 ranks" in out and "layout colocated" in out and "8 engines" in out and "yes" in out
    assert "critic: ZeRO-3 over 64 ranks" in out


def test_plan_rejects_layout_that_does_not_fit(capsys):
    assert plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8",
                 "vllm.gpu_memory_utilization=0.95"]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_plan_names_deepspeed_fused_adam_for_zero3_without_offload(capsys):
    plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8",
          "ds.adam_offload=false"])
    assert "optimizer of actor, critic: DeepSpeed FusedAdam -- ZeRO-3" in capsys.readouterr().out


def test_plan_says_which_adam_each_trained_role_uses(capsys):
    plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8"])
    out = capsys.readouterr().out
    assert "optimizer of actor, critic: DeepSpeedCPUAdam -- ds.adam_offload" in out  # the recipe offloads Adam
    # Offline trainers train one model; at ZeRO-0 there is no ZeRO optimizer, so ds.adam_offload offloads nothing.
    sft = ["--config", str(ROOT / "configs/sft_llama3_8b.yaml"), "--nodes", "1", "--gpus-per-node", "1",
           "ds.adam_offload=true"]
    plan([*sft, "ds.zero_stage=0", "ds.param_dtype=fp32"])
    assert "optimizer of model: torch.optim.AdamW(fused=True) -- " in capsys.readouterr().out
    # In bf16 stage 0 runs as 2 (DeepSpeed needs its ZeRO optimizer for bf16 weights): the host Adam again.
    plan([*sft, "ds.zero_stage=0"])
    assert "optimizer of model: DeepSpeedCPUAdam -- " in capsys.readouterr().out
    plan([*sft, "ds.zero_stage=2"])
    assert "optimizer of model: DeepSpeedCPUAdam -- " in capsys.readouterr().out


# ppo_70b's roles on subsets: actor+ref on 24 ranks, critic+reward on 24, vLLM on 16
DISAGGREGATED_70B = ["train.colocate_all=false", "train.colocate_actor_ref=true", "train.colocate_critic_reward=true",
                     "actor.num_ranks=24", "critic.num_ranks=24", "vllm.enable_sleep=false"]


def test_plan_rejects_impossible_layout(capsys):
    assert plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8",
                 *DISAGGREGATED_70B, "ds.zero_stage=2", "ds.tensor_parallel_size=8", "actor.num_ranks=20",
                 "critic.num_ranks=28"]) == 1
    assert "ds.tensor_parallel_size=8" in capsys.readouterr().err


def test_plan_zero3_needs_the_colocated_layout(capsys):
    """DeepSpeed's ZeRO-3 runs world-wide collectives: roles on a subset of the ranks are refused up front, with
    or without AutoTP; the colocated layout (tests/multiproc/test_autotp.py trains it with tp 2) is planned."""
    ppo_70b = ["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8",
               "ds.zero_stage=3"]
    for tp in (8, 1):
        assert plan([*ppo_70b, *DISAGGREGATED_70B, f"ds.tensor_parallel_size={tp}"]) == 1
        err = capsys.readouterr().err
        assert "train.colocate_all=true" in err and "actor, ref, critic, reward" in err, err
    # Colocated, vLLM's budget sits next to what cannot leave the GPU (the frozen roles' ZeRO-3 partitions):
    # the recipe's 0.85 is for rollout-only nodes.
    colocated = [*ppo_70b, "train.colocate_all=true", "actor.num_ranks=null", "critic.num_ranks=null",
                 "vllm.enable_sleep=true", "vllm.gpu_memory_utilization=0.8"]
    code = plan(colocated)
    out, err = capsys.readouterr()
    assert "invalid layout" not in err, err
    assert code == 0 and "colocated" in out, (out, err)


def test_plan_vllm_on_a_subset_needs_its_own_processes(capsys):
    """vLLM's external launcher takes the whole world: on 16 of 64 ranks it is refused, naming the key; engines
    in processes of their own are single-GPU for now."""
    ppo_70b = ["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8",
               *DISAGGREGATED_70B, "ds.zero_stage=2", "ds.tensor_parallel_size=8"]
    assert plan([*ppo_70b, "rollout.vllm_mode=external_launcher"]) == 1
    err = capsys.readouterr().err
    assert "set rollout.vllm_mode=server_process" in err and "16 of 64 ranks" in err, err
    own_processes = [*ppo_70b, "rollout.vllm_mode=server_process"]
    assert plan(own_processes) == 1  # the recipe's rollout TP 8
    assert "set rollout.tensor_parallel_size=1" in capsys.readouterr().err
    code = plan([*own_processes, "rollout.tensor_parallel_size=1"])
    out, err = capsys.readouterr()
    assert "invalid layout" not in err, err
    assert code == 0 and "layout partial" in out and "16 engines" in out, out
    # 70.6B bf16 parameters leave from the 3 tp-8 actor replicas, a third each, their ranks taking turns
    assert "weight sync: 141.2 GB to every rollout rank per step, sent by 3 actor replicas" in out
    assert "about 47.1 GB per replica, 5.9 GB per rank" in out


def test_console_script_and_module_entry():
    for cmd in (["hpc-rlhf", "plan"], [sys.executable, "-m", "hpc_rlhf.cli.plan"]):
        out = subprocess.run([*cmd, "--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8",
                              "--gpus-per-node", "8"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "actor" in out.stdout


LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}


def test_param_count_matches_llama_8b():
    assert abs(count_params_from_hf_config(LLAMA3_8B) - 8.03e9) / 8.03e9 < 0.01


def test_size_from_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128,
         "num_attention_heads": 4, "tie_word_embeddings": True}))
    cfg = load_config(None, [f"actor.pretrain={tmp_path}", "ds.zero_stage=0"])
    mem = role_memory(cfg, build_placement(cfg, 2), "actor")
    n = 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 100 * 64 + 64
    assert mem.weights_gib * 1024**3 == pytest.approx(n * 2)  # bf16 on GPU
    # fp32 accumulation; bf16 runs ZeRO stage 0 as 2 (effective_zero_stage): gradients and Adam sharded over 2
    assert mem.grads_gib * 1024**3 == pytest.approx(n * 4 / 2)
    assert mem.optim_gib * 1024**3 == pytest.approx(n * 12 / 2)


# bf16 training runs stages 0-1 as 2 (DeepSpeed needs its ZeRO optimizer for bf16 weights; effective_zero_stage).
@pytest.mark.parametrize("stage,divisors", [(0, (1, 4, 4)), (1, (1, 4, 4)), (2, (1, 4, 4)), (3, (4, 4, 4))])
def test_zero_stage_sharding(stage, divisors):
    cfg = load_config(None, ["actor.num_params_b=1", f"ds.zero_stage={stage}"])
    mem = role_memory(cfg, build_placement(cfg, 4), "actor")
    gib = 1e9 / 1024**3
    assert mem.weights_gib == pytest.approx(2 * gib / divisors[0])
    assert mem.grads_gib == pytest.approx(4 * gib / divisors[1])
    assert mem.optim_gib == pytest.approx(12 * gib / divisors[2])
    assert mem.buffers_gib == pytest.approx(DS_REDUCE_BUCKET_SIZE * 2 / 1024**3)
    assert mem.gathered_gib == pytest.approx(2 * gib if stage == 3 else 0)


@pytest.mark.parametrize("stage,bytes_per_param", [(0, 16), (1, 20), (2, 20), (3, 20)])
def test_fp32_model_states(stage, bytes_per_param):
    """fp32 (CPU): plain stage 0 updates weights in place; ZeRO optimizers keep an fp32 partition copy."""
    cfg = load_config(None, ["actor.num_params_b=1", f"ds.zero_stage={stage}", "ds.param_dtype=fp32"])
    mem = role_memory(cfg, build_placement(cfg, 1), "actor", on_gpu=False)  # one rank: no sharding
    assert (mem.weights_gib + mem.grads_gib + mem.optim_gib) * 1024**3 == pytest.approx(
        1e9 * (16 if stage in (0, 1, 2) else bytes_per_param))  # stages 1-2 fall back to 0 on one rank


def test_tensor_parallel_splits_layers_not_embeddings():
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    cfg1 = load_config(None, ["actor.num_params_b=8.03", "ds.zero_stage=1"])
    cfg8 = load_config(None, ["actor.num_params_b=8.03", "ds.zero_stage=1", "ds.tensor_parallel_size=8"])
    full = role_memory(cfg1, build_placement(cfg1, 8), "actor")
    split = role_memory(cfg8, build_placement(cfg8, 8), "actor")
    layers = shape.num_layers * shape.layer_linear_params / shape.num_params
    expected = (1 - layers) + layers / 8  # embeddings and LM head stay whole on every tp rank
    assert split.weights_gib / full.weights_gib == pytest.approx(expected, rel=1e-6)
    assert 0.12 < expected < 0.25
    assert split.activations_gib < full.activations_gib


def test_ring_attention_divides_activation_tokens():
    # generate_max_len = max_len: logits on every token with or without the ring (the ring computes the
    # logits of its whole chunk; without it the LM head runs on response positions only).
    # The token budget is per GPU: 32768 on one GPU, 8192 on each of 4 ring ranks is the same micro-batch.
    base = ["actor.num_params_b=7.6", "ds.zero_stage=3", "ds.gradient_checkpointing=true", "data.max_len=32768",
            "rollout.generate_max_len=32768", "train.use_dynamic_batch=true"]
    one = load_config(None, [*base, "train.max_tokens_per_gpu=32768"])
    ring = load_config(None, [*base, "train.max_tokens_per_gpu=8192", "ds.ring_attn_size=4"])
    m1 = role_memory(one, build_placement(one, 8), "actor")
    m4 = role_memory(ring, build_placement(ring, 8), "actor")
    assert (m1.tokens_per_rank, m4.tokens_per_rank) == (32768, 8192)
    assert m4.activations_gib == pytest.approx(m1.activations_gib / 4, rel=1e-6)
    assert m4.reduce_gib == pytest.approx(m1.reduce_gib)


def test_plan_shows_ring_attention_and_tokens(capsys):
    assert plan(["--config", str(ROOT / "configs/grpo_longctx_7b.yaml"), "--nodes", "2", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "ring attention: 32768 tokens / 4 ranks" in out and "8192" in out


def test_activation_formula_counts_what_autograd_saves():
    """Per token: L x (6h + 2 q + 2 kv + 4 i) + 3h saved, plus fp32 logits and 3 backward copies."""
    shape = ModelShape(hidden_size=128, num_layers=2, intermediate_size=256, vocab_size=500, num_heads=4,
                       num_kv_heads=2, head_dim=32)
    got = activation_bytes(shape, tokens=10, logit_tokens=10, act_bytes=4)
    per_token = 2 * (6 * 128 + 2 * 128 + 2 * 64 + 4 * 256) + 3 * 128
    assert got == 10 * per_token * 4 + 10 * 500 * 4 * 4
    ckpt = activation_bytes(shape, tokens=10, logit_tokens=0, act_bytes=4, gradient_checkpointing=True)
    assert ckpt == 10 * (2 * 128 + (6 * 128 + 2 * 128 + 2 * 64 + 4 * 256) + 3 * 128) * 4


def test_reference_shape_when_only_size_is_known():
    cfg = load_config(None, ["actor.num_params_b=70.6"])
    shape = role_shape(cfg, "actor")
    assert shape.hidden_size == 8192 and "Llama-3-70B" in shape.source


ALL_RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
RL_RECIPES = [p for p in ALL_RECIPES if p.name.split("_")[0] in ("ppo", "grpo")]
# vLLM recipes for clusters (the *_cpu.yaml ones run vLLM's CPU build on 2 ranks and are planned with the others)
GPU_RECIPES = [p for p in RL_RECIPES if load_config(p).rollout.backend == "vllm" and not p.stem.endswith("_cpu")]


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipes_pass_plan_on_their_slurm_request(recipe):
    cfg = load_config(recipe)
    assert plan(["--config", str(recipe), "--nodes", str(cfg.slurm.nodes),
                 "--gpus-per-node", str(cfg.slurm.gpus_per_node)]) == 0


def _recipe_world(recipe: Path) -> tuple[int, int]:
    """(nodes, ranks per node) a recipe is meant for: its slurm: section, else its torchrun line."""
    text = recipe.read_text()
    sections = yaml.safe_load(text)
    if "slurm" in sections:
        return sections["slurm"].get("nodes", 1), sections["slurm"].get("gpus_per_node", 8)
    nproc = re.search(r"--nproc_per_node (\d+)", text)
    assert nproc, f"{recipe.name}: neither a slurm: section nor a torchrun --nproc_per_node line says its size"
    return 1, int(nproc.group(1))


def _quickstart_models(run: Path) -> None:
    """Stand-ins of the quickstart's SFT and GRPO models (same shape and tokenizer), which recipes built on the
    quickstart's outputs read."""
    from hpc_rlhf.cli.quickstart import MODEL_SIZES
    from hpc_rlhf.models.tiny import build_tiny_model

    for stage in ("sft", "grpo"):
        build_tiny_model(run / stage / "model", **MODEL_SIZES)


def _code_sft_model(run: Path) -> None:
    """A stand-in of the code recipe's SFT export (the tiny char Llama's shape), which its GRPO half reads."""
    from hpc_rlhf.models.tiny import build_tiny_model

    build_tiny_model(run / "model")


# Recipes that start from another run's outputs: what must exist before plan can size them.
RECIPE_INPUTS = {"distill_tiny_cpu.yaml": lambda cwd: _quickstart_models(cwd / "runs" / "quickstart"),
                 "grpo_code_tiny_cpu.yaml": lambda cwd: _code_sft_model(cwd / "runs" / "sft_code_tiny_cpu")}


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda p: p.name)
def test_every_recipe_passes_plan(recipe, capsys, tmp_path, monkeypatch):
    """Every file in configs/ (RL and offline trainers, CPU and GPU) is a valid layout that fits."""
    monkeypatch.chdir(tmp_path)  # CPU recipes name relative paths; nothing is written under the repository
    prepare = RECIPE_INPUTS.get(recipe.name)
    if prepare:
        prepare(tmp_path)
    nodes, per_node = _recipe_world(recipe)
    code = plan(["--config", str(recipe), "--nodes", str(nodes), "--gpus-per-node", str(per_node)])
    captured = capsys.readouterr()
    assert code == 0, f"plan rejected {recipe.name}:\n{captured.err}"
    assert "per-GPU states" in captured.out
    assert prepare or not (tmp_path / "runs").exists()  # plan writes nothing
