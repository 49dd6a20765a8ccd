"""plan sizes mixture-of-experts models: memory from the total parameters, FLOPs from the active ones (shared
experts in both), activations from the experts a token runs, and refuses AutoTP for them (DeepSpeed 0.19.8 cannot
shard the experts of transformers' MoE models). Counts are checked against transformers' own models."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_rlhf.cli.plan import plan
from hpc_rlhf.planning.memory_estimate import activation_bytes, moe_mlp_elements
from hpc_rlhf.planning.model_shape import ModelShape, ModelSizeError, check_moe_tensor_parallel
from hpc_rlhf.planning.step_time import forward_flops
from tests.unit.saved_activations import saved_elements_per_layer

# Public config.json values (the keys that sizing reads).
QWEN3_30B_A3B = {"hidden_size": 2048, "num_hidden_layers": 48, "intermediate_size": 6144, "vocab_size": 151936,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False, "model_type": "qwen3_moe"}
MIXTRAL_8X7B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 32000,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "tie_word_embeddings": False, "model_type": "mixtral"}
QWEN15_MOE_A27B = {"hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 5632, "vocab_size": 151936,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
                   "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "tie_word_embeddings": False, "model_type": "qwen2_moe"}
DEEPSEEK_V3 = {"hidden_size": 7168, "num_hidden_layers": 61, "intermediate_size": 18432, "vocab_size": 129280,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
               "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False, "tie_word_embeddings": False,
               "model_type": "deepseek_v3"}


# DeepSeek-V3: 671B without the multi-token-prediction layer (685B with it), 37B active.
@pytest.mark.parametrize("cfg,total_b,active_b", [(QWEN3_30B_A3B, 30.5, 3.3), (MIXTRAL_8X7B, 46.7, 12.9),
                                                  (QWEN15_MOE_A27B, 14.3, 2.7), (DEEPSEEK_V3, 671, 37)])
def test_total_and_active_parameters_match_the_published_sizes(cfg, total_b, active_b):
    shape = ModelShape.from_hf_config(cfg)
    assert shape.is_moe
    assert shape.num_params / 1e9 == pytest.approx(total_b, rel=0.01)
    assert shape.active_params / 1e9 == pytest.approx(active_b, rel=0.02)
    assert "total" in shape.describe() and "active" in shape.describe()


def test_flops_count_active_parameters_and_dense_layers_stay_dense():
    shape = ModelShape.from_hf_config(MIXTRAL_8X7B)
    body_active = shape.active_params - shape.embedding_params
    assert forward_flops(shape, shape.num_params, tokens=10, logit_tokens=0) == pytest.approx(2 * body_active * 10)
    # Qwen3-MoE's mlp_only_layers are dense MLPs intermediate_size wide.
    two_dense = ModelShape.from_hf_config({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]})
    assert two_dense.num_sparse_layers == 46
    dense = ModelShape.from_hf_config({k: v for k, v in MIXTRAL_8X7B.items() if "expert" not in k})
    assert not dense.is_moe and dense.active_params == dense.num_params and dense.active_fraction == 1.0


def test_autotp_is_refused_for_moe_naming_the_key():
    check_moe_tensor_parallel(MIXTRAL_8X7B, 1, "actor.pretrain")
    check_moe_tensor_parallel({**MIXTRAL_8X7B, "num_local_experts": 0}, 4, "actor.pretrain")
    with pytest.raises(ModelSizeError, match="ds.tensor_parallel_size=2 with a mixture-of-experts model "
                                             r"\(actor.pretrain\)"):
        check_moe_tensor_parallel(QWEN3_30B_A3B, 2, "actor.pretrain")


def test_deepspeed_autotp_rejects_the_moe_tp_plans(tmp_path):
    """Why AutoTP is refused: DeepSpeed 0.19.8 turns the HF tp_plan into layer specs and rejects the MoE
    styles of Qwen3-MoE and Mixtral (should a later DeepSpeed accept them, this fails and the refusal can go)."""
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import build_tiny_moe_model

    for family in ("qwen3_moe", "mixtral"):
        model = AutoModelForCausalLM.from_pretrained(build_tiny_moe_model(tmp_path / family, family=family))
        with pytest.raises(ValueError, match="moe_tp_experts"):
            TPPlanConverter.convert(_get_hf_tp_plan(model))


def test_plan_prints_total_and_active_and_refuses_tp(tmp_path, capsys):
    model = tmp_path / "qwen3-30b-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    common = ["--config", "configs/grpo_qwen2.5_7b.yaml", "--nodes", "1", "--gpus-per-node", "8",
              f"actor.pretrain={model}", "actor.num_params_b=null"]
    code = plan([*common, "ds.tensor_parallel_size=1"])
    out = capsys.readouterr().out
    assert "MoE 128 experts (top-8" in out and "30.53B total / 3.35B active" in out, (code, out)
    assert plan([*common, "ds.tensor_parallel_size=2"]) == 1
    assert "ds.tensor_parallel_size=2 with a mixture-of-experts model (actor.pretrain)" in capsys.readouterr().err


# Tiny configs of each MoE layout transformers builds (sizes all different, so a misplaced width shows).
_TINY = {"hidden_size": 64, "intermediate_size": 96, "vocab_size": 100, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": False}
_MLA = {**_TINY, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 24, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 10}
TINY_MOE = {
    # sparse layers 0 and 2 (decoder_sparse_step=2 makes 1 and 3 the candidates; mlp_only_layers drops 3)
    "qwen2_moe": ("Qwen2MoeConfig", {**_TINY, "num_hidden_layers": 4, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 40, "shared_expert_intermediate_size": 72,
                                     "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    "qwen2_moe_no_bias": ("Qwen2MoeConfig", {**_TINY, "num_hidden_layers": 2, "num_experts": 6,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                                             "shared_expert_intermediate_size": 72, "qkv_bias": False}),
    "qwen3_moe": ("Qwen3MoeConfig", {**_TINY, "num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 40, "head_dim": 24, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", {**_TINY, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", {**_MLA, "num_hidden_layers": 4, "n_shared_experts": 2,
                                         "first_k_dense_replace": 1, "q_lora_rank": 16, "n_group": 2,
                                         "topk_group": 1, "attention_bias": True}),
    "deepseek_v3_q_proj_bias": ("DeepseekV3Config", {**_MLA, "num_hidden_layers": 2, "n_shared_experts": 1,
                                                     "first_k_dense_replace": 0, "q_lora_rank": None, "n_group": 2,
                                                     "topk_group": 1, "attention_bias": True}),
    "deepseek_v2": ("DeepseekV2Config", {**_MLA, "num_hidden_layers": 3, "n_shared_experts": 2,
                                         "first_k_dense_replace": 1, "q_lora_rank": None}),
}


def _meta_model(family: str):
    """``(model on the meta device, its config.json dict)``: what transformers builds and what plan reads."""
    import transformers

    class_name, kwargs = TINY_MOE[family]
    config = getattr(transformers, class_name)(**kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model, json.loads(config.to_json_string())


@pytest.mark.parametrize("family", sorted(TINY_MOE))
def test_counts_match_transformers_models(family):
    """Total parameters exactly as transformers allocates them (shared experts, shared-expert gate, MLA
    projections and norms, q/k norms, biases, dense layers); active = total less the routed experts a token skips,
    read off the model's own expert tensors (shared experts stay active)."""
    model, cfg = _meta_model(family)
    shape = ModelShape.from_hf_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    shared = sum(p.numel() for n, p in model.named_parameters() if ".shared_expert" in n)
    assert shape.num_params == total
    skipped = routed * (shape.num_experts - shape.experts_per_token) // shape.num_experts
    assert shape.active_params == total - skipped
    assert shape.num_sparse_layers * shape.shared_expert_params == shared
    assert shape.largest_tensor_params() == max(p.numel() for p in model.parameters())  # the fused experts
    if shared:
        assert f"shared expert i={shape.shared_expert_intermediate_size}" in shape.describe()
        assert "shared_expert_intermediate_size" in repr(shape)


def test_shared_experts_count_in_total_and_active():
    shape = ModelShape.from_hf_config(QWEN15_MOE_A27B)
    without = ModelShape.from_hf_config({k: v for k, v in QWEN15_MOE_A27B.items() if "shared" not in k})
    per_layer = 3 * 2048 * 5632 + 2048  # SwiGLU 5632 wide + the 1-output sigmoid gate
    assert shape.num_params - without.num_params == 24 * per_layer
    assert shape.active_params - without.active_params == 24 * per_layer
    assert "shared expert i=5632" in shape.describe() and "shared expert" not in without.describe()
    deepseek = ModelShape.from_hf_config(DEEPSEEK_V3)
    assert deepseek.num_sparse_layers == 58 and deepseek.shared_expert_intermediate_size == 2048
    assert not deepseek.shared_expert_gate and "MLA(q_lora=1536, kv_lora=512)" in deepseek.describe()


def test_unreadable_moe_configs_are_refused_naming_the_key():
    mla = {k: v for k, v in DEEPSEEK_V3.items() if k != "v_head_dim"}
    with pytest.raises(ModelSizeError, match="kv_lora_rank .* lacks v_head_dim"):
        ModelShape.from_hf_config(mla)
    with pytest.raises(ModelSizeError, match="first_k_dense_replace=62"):
        ModelShape.from_hf_config({**DEEPSEEK_V3, "first_k_dense_replace": 62})


def _saved_elements_per_sparse_layer(family: str) -> float:
    """Elements autograd saves per token for one more sparse decoder layer, fp32, training mode, transformers'
    default ``grouped_mm`` experts, router logits not asked for (they are outputs, not saved)."""
    import transformers

    class_name, kwargs = TINY_MOE[family]

    def build(layers: int) -> torch.nn.Module:
        config = getattr(transformers, class_name)(**{**kwargs, "num_hidden_layers": layers})
        config._attn_implementation = "sdpa"
        config._experts_implementation = "grouped_mm"
        return transformers.AutoModelForCausalLM.from_config(config).float()

    return saved_elements_per_layer(build)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe_no_bias"])
def test_moe_layer_activations_match_autograd(family):
    """The attention part is the dense formula's (plus two rsqrt scalars and a logsumexp a head, as for dense
    layers); the MoE MLP saves what :func:`moe_mlp_elements` says, plus the routing's index tensors (int64
    expert ids and permutations: about 10 top_k int32-sized elements a token)."""
    shape = ModelShape.from_hf_config(_meta_model(family)[1])
    h, k = shape.hidden_size, shape.experts_per_token
    attention = 6 * h + 2 * shape.q_dim + 2 * shape.kv_dim + 2 + shape.num_heads
    extra = _saved_elements_per_sparse_layer(family) - attention - moe_mlp_elements(shape, act_bytes=4)
    assert 0 <= extra <= 10 * k + 2


def test_moe_activations_count_the_experts_a_token_runs():
    """Against a dense model of the same attention and intermediate size: each sparse layer's ``4 i`` becomes
    top_k x (2h + 4 moe_i) + 4 shared_i (+ h + 1 for the gate) + E fp32 probabilities, and its E router logits
    are kept (bf16, 2 bytes)."""
    moe = ModelShape.from_hf_config(QWEN15_MOE_A27B)
    dense = ModelShape.from_hf_config({k: v for k, v in QWEN15_MOE_A27B.items() if "expert" not in k})
    h, tokens = 2048, 100
    kw = {"tokens": tokens, "logit_tokens": 10, "act_bytes": 2}
    per_layer = 4 * (2 * h + 4 * 1408) + 4 * 5632 + h + 1 + 60 * 4 / 2 - 4 * 5632
    assert moe_mlp_elements(moe, 2) - 4 * 5632 == per_layer
    diff = activation_bytes(moe, **kw) - activation_bytes(dense, **kw)
    assert diff == tokens * 2 * 24 * (per_layer + 60)
    assert diff > 0  # 4 experts of 1408 plus a 5632-wide shared expert outweigh one 5632-wide MLP
    # Checkpointed: layer inputs as before, one (sparse) layer recomputed, the router logits of all 24 kept.
    ckpt = activation_bytes(moe, **kw, gradient_checkpointing=True) \
        - activation_bytes(dense, **kw, gradient_checkpointing=True)
    assert ckpt == tokens * 2 * (per_layer + 24 * 60)
    # A no-grad forward holds one layer, the largest, and no router logits.
    frozen = activation_bytes(moe, **kw, trainable=False) - activation_bytes(dense, **kw, trainable=False)
    assert frozen == tokens * 2 * per_layer
    # Mixtral-style, no shared experts: top-2 of 14336-wide experts save more than one 14336-wide MLP.
    mixtral = ModelShape.from_hf_config(MIXTRAL_8X7B)
    assert moe_mlp_elements(mixtral, 2) == 2 * (2 * 4096 + 4 * 14336) + 8 * 2
