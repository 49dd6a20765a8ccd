"""``hpc-rlhf plan``'s memory model under LoRA / QLoRA (``ds.lora``): trainable parameters, 4-bit bytes, what
ZeRO partitions, saved activations. The pure functions are checked against what peft, bitsandbytes and autograd
really build; tests/multiproc/test_memory_estimate.py checks the totals against measured peaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_rlhf.cli.plan import plan
from hpc_rlhf.config import load_config
from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.planning.lora_memory import (
    NF4_BYTES_PER_PARAM,
    NF4_BYTES_PER_TENSOR,
    LoraSpec,
    lora_layer_elements,
    lora_params,
    lora_target_names,
    nf4_bytes,
    quantized_linear_params,
)
from hpc_rlhf.planning.memory_estimate import GIB, activation_bytes, role_memory
from hpc_rlhf.planning.model_shape import ModelShape
from hpc_rlhf.world.placement import build_placement
from tests.unit.saved_activations import saved_elements_per_layer

ROOT = Path(__file__).resolve().parents[2]
# h 64, q 64, kv 32, i 128, V 100: small enough to build with transformers in milliseconds.
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
SHAPE = ModelShape.from_hf_config(TINY)


def _spec(rank=16, targets=("all-linear",), dropout=0.0, load_in_4bit=False) -> LoraSpec:
    return LoraSpec.from_config(LoraConfig(rank=rank, target_modules=list(targets), dropout=dropout,
                                           load_in_4bit=load_in_4bit))


def test_target_names():
    # all-linear: the Llama projections, MLA's, and the MoE router / shared-expert gate / Mixtral's v4 expert names
    assert lora_target_names(["all-linear"])[0] == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                     "kv_b_proj", "gate", "shared_expert_gate", "w1", "w2", "w3"}
    assert lora_target_names(["q_proj", "self_attn.v_proj", "lm_head", "qkv"]) == (
        frozenset({"q_proj", "v_proj", "lm_head"}), ("qkv",))
    assert LoraSpec.from_config(LoraConfig(rank=0)) is None


def test_trainable_params_all_linear_vs_list():
    h, q, kv, i = 64, 64, 32, 128
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    assert lora_params(SHAPE, _spec()) == 2 * 16 * per_layer
    assert lora_params(SHAPE, _spec(targets=["q_proj", "v_proj"])) == 2 * 16 * ((h + q) + (h + kv))
    assert lora_params(SHAPE, _spec(targets=["q_proj", "lm_head"])) == 2 * 16 * (h + q) + 16 * (100 + h)
    # A value model also trains its score head (h); it has no LM head to adapt.
    assert lora_params(SHAPE, _spec(), value_model=True) == 2 * 16 * per_layer + h


def _llama(value_model: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(**TINY, num_labels=1)
    config._attn_implementation = "sdpa"
    return (LlamaForSequenceClassification if value_model else LlamaForCausalLM)(config).float()


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["down_proj", "lm_head"]])
@pytest.mark.parametrize("value_model", [False, True], ids=["causal-lm", "value-model"])
def test_trainable_params_match_peft(targets, value_model):
    from hpc_rlhf.models.lora import apply_lora

    if value_model and "lm_head" in targets:
        targets = ["down_proj"]
    model = apply_lora(_llama(value_model), LoraConfig(rank=8, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(SHAPE, _spec(8, targets), value_model=value_model) == trainable


def test_nf4_bytes_per_param():
    # 4 bits + a uint8 absmax per 64 + an fp32 absmax per 64 x 256 parameters.
    assert NF4_BYTES_PER_PARAM == pytest.approx(0.5 + 1 / 64 + 4 / 16384) == pytest.approx(0.515869140625)
    assert nf4_bytes(1e9, 0) / 1e9 == pytest.approx(0.5159, abs=1e-4)  # ~3.9x less than bf16
    assert quantized_linear_params(SHAPE) == 2 * SHAPE.layer_linear_params


def test_nf4_bytes_match_bitsandbytes():
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(128, 64 * 256 // 128 * 3)  # 3 nested blocks
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    tensors = (packed, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code)
    stored = sum(t.numel() * t.element_size() for t in tensors)
    assert stored == nf4_bytes(weight.numel(), 1)
    assert NF4_BYTES_PER_TENSOR == (state.code.numel() + state.state2.code.numel() + 1) * 4


def _cfg(tmp_path, *overrides):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return load_config(None, [f"actor.pretrain={tmp_path}", *overrides])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lora_states_and_frozen_base_partitioned_only_at_stage3(tmp_path, stage):
    cfg = _cfg(tmp_path, f"ds.zero_stage={stage}", "ds.lora.rank=16")
    mem = role_memory(cfg, build_placement(cfg, 4), "actor")  # bf16 on GPU, 4 ZeRO ranks
    base, adapters = SHAPE.num_params, lora_params(SHAPE, _spec())
    assert mem.weights_gib * GIB == pytest.approx((base + adapters) * 2 / (4 if stage == 3 else 1))
    # only the adapters; bf16 runs stage 1 as 2 (effective_zero_stage), so gradients are sharded at every stage
    assert mem.grads_gib * GIB == pytest.approx(adapters * 4 / 4)
    assert mem.optim_gib * GIB == pytest.approx(adapters * 12 / 4)
    assert "LoRA r=16: 33K trainable" in mem.notes


def test_lora_buffers_and_reduce_count_adapters_on_cpu(tmp_path):
    cfg = _cfg(tmp_path, "ds.zero_stage=3", "ds.lora.rank=16")
    mem = role_memory(cfg, build_placement(cfg, 2), "actor", on_gpu=False)
    adapters = lora_params(SHAPE, _spec())
    assert mem.buffers_gib * GIB == pytest.approx(adapters * 4)  # host memory: the bucket as used
    # The reduce transient holds the largest trainable tensor's gradient: a LoRA factor, not the LM head.
    assert mem.reduce_gib * GIB == pytest.approx(adapters * 4 + 16 * 128 * 4)


def test_qlora_weights(tmp_path):
    cfg = _cfg(tmp_path, "ds.zero_stage=2", "ds.lora.rank=16", "ds.lora.load_in_4bit=true",
               "algo.advantage_estimator=gae", "algo.kl.init_coef=0.01",  # actor, ref, critic, reward
               f"critic.pretrain={tmp_path}", f"reward.pretrain={tmp_path}")
    placement = build_placement(cfg, 2)
    quant = quantized_linear_params(SHAPE)
    nf4 = nf4_bytes(quant, 7 * 2)
    actor = role_memory(cfg, placement, "actor")
    assert actor.weights_gib * GIB == pytest.approx(
        (SHAPE.num_params - quant + lora_params(SHAPE, _spec())) * 2 + nf4)
    assert any("4-bit base" in n for n in actor.notes)
    ref = role_memory(cfg, placement, "ref")  # the reference loads the same 4-bit base
    assert ref.weights_gib * GIB == pytest.approx((SHAPE.num_params - quant) * 2 + nf4)
    # Value models: no LM head (V x h), a score head (h); the critic is 4-bit, the reward model is not.
    value_base = SHAPE.num_params - 100 * 64 + 64
    critic = role_memory(cfg, placement, "critic")
    critic_adapters = lora_params(SHAPE, _spec(), value_model=True)
    assert critic.weights_gib * GIB == pytest.approx((value_base - quant + critic_adapters) * 2 + nf4)
    assert critic.grads_gib * GIB == pytest.approx(critic_adapters * 4 / 2)
    reward = role_memory(cfg, placement, "reward")
    assert reward.weights_gib * GIB == pytest.approx(value_base * 2)
    assert not any("4-bit" in n for n in reward.notes)


def test_qlora_adds_one_dequantised_layer_to_the_working_set(tmp_path):
    def actor(*overrides):
        cfg = _cfg(tmp_path, "ds.zero_stage=2", "ds.lora.rank=16", *overrides)
        return role_memory(cfg, build_placement(cfg, 1), "actor", on_gpu=False)

    lora, qlora = actor(), actor("ds.lora.load_in_4bit=true")
    largest = 64 * 128  # gate / up / down projection
    assert (qlora.activations_gib - lora.activations_gib) * GIB == pytest.approx(largest * 4 + largest / 64 * 4)


def _saved_elements_per_layer(spec: LoraSpec | None) -> float:
    """Elements autograd saves per token for one more decoder layer, fp32, training mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.models.lora import apply_lora

    def build(layers: int) -> torch.nn.Module:
        config = LlamaConfig(**{**TINY, "num_hidden_layers": layers})
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config).float()
        if spec is None:
            return model
        return apply_lora(model, LoraConfig(rank=spec.rank, target_modules=sorted(spec.targets), dropout=spec.dropout))

    return saved_elements_per_layer(build)


@pytest.mark.parametrize("targets,dropout", [
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 0.0),
    (["q_proj", "v_proj"], 0.0),
    (["o_proj", "down_proj"], 0.0),
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 0.1),
], ids=["all-linear", "q-v", "o-down", "all-linear-dropout"])
def test_lora_layer_activations_match_autograd(targets, dropout):
    """Per layer and token; autograd also keeps two rsqrt scalars and the attention's logsumexp (one per head)."""
    spec = _spec(rank=8, targets=targets, dropout=dropout)
    scalars = 2 + SHAPE.num_heads
    assert _saved_elements_per_layer(spec) == lora_layer_elements(SHAPE, spec) + scalars  # CPU: fp32 noise
    full = 6 * 64 + 2 * 64 + 2 * 32 + 4 * 128
    assert _saved_elements_per_layer(None) == full + scalars  # the full fine-tuning formula, same method


def test_lora_activations_in_activation_bytes():
    spec = _spec()
    full = activation_bytes(SHAPE, tokens=10, logit_tokens=0, act_bytes=4)
    lora = activation_bytes(SHAPE, tokens=10, logit_tokens=0, act_bytes=4, lora=spec)
    per_layer_full = 6 * 64 + 2 * 64 + 2 * 32 + 4 * 128
    # the frozen norms drop their normalised inputs (2h a layer, 2h of the final norm), each projection adds r
    assert full - lora == 10 * 4 * (2 * (per_layer_full - lora_layer_elements(SHAPE, spec)) + 2 * 64)
    assert lora_layer_elements(SHAPE, spec) == per_layer_full - 2 * 64 + 7 * 16
    # On GPU the dropout mask is a bool tensor: 1 byte an element, not the activation dtype.
    drop = _spec(dropout=0.1)
    inputs = 3 * 64 + 64 + 2 * 64 + 128
    base = lora_layer_elements(SHAPE, drop, dropout_mask_elems=0) - inputs
    assert lora_layer_elements(SHAPE, drop, dropout_mask_elems=0.5) == base + inputs * 1.5


def test_plan_prints_lora_notes(capsys):
    recipe = ROOT / "configs/ppo_llama3_8b.yaml"
    assert plan(["--config", str(recipe), "--nodes", "1", "--gpus-per-node", "8", "ds.zero_stage=2",
                 "ds.lora.rank=16", "ds.lora.load_in_4bit=true"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=16: 41.9M trainable" in out and "4-bit base: 6.95B params NF4" in out


def test_plan_refuses_lora_with_tensor_parallelism(capsys):
    recipe = ROOT / "configs/ppo_70b.yaml"
    assert plan(["--config", str(recipe), "--nodes", "8", "--gpus-per-node", "8", "ds.tensor_parallel_size=8",
                 "ds.lora.rank=16"]) == 1
    assert "AutoTP cannot shard peft's LoRA layers" in capsys.readouterr().err
