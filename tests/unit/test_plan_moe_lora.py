"""``hpc-rlhf plan`` under LoRA / QLoRA for mixture-of-experts models: which parts peft adapts (the fused experts
and router through ``ParamWrapper`` in the families its transformers-5 conversion knows, the shared experts and
dense MLPs as ``nn.Linear`` elsewhere), what bitsandbytes quantises (``nn.Linear`` only: the fused experts and the
router stay in the parameter dtype) and what autograd saves. Checked against peft, bitsandbytes and autograd."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hpc_rlhf.config import load_config
from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.planning.lora_memory import (
    LoraSpec,
    expert_targets,
    largest_lora_tensor,
    lora_merged_elements,
    lora_params,
    lora_sparse_layer_elements,
    nf4_bytes,
    peft_fused_moe_types,
    quantized_linear_count,
    quantized_linear_params,
)
from hpc_rlhf.planning.memory_estimate import GIB, activation_bytes, role_memory
from hpc_rlhf.planning.model_shape import ModelShape
from hpc_rlhf.world.placement import build_placement
from tests.unit.saved_activations import saved_elements_per_layer
from tests.unit.test_plan_moe import QWEN3_30B_A3B, TINY_MOE


def _spec(rank=4, targets=("all-linear",), dropout=0.0) -> LoraSpec:
    return LoraSpec.from_config(LoraConfig(rank=rank, target_modules=list(targets), dropout=dropout))


def _model(family: str, layers: int | None = None, value_model: bool = False) -> tuple[torch.nn.Module, dict]:
    import transformers

    class_name, kwargs = TINY_MOE[family]
    kwargs = {**kwargs, "num_labels": 1} if layers is None else {**kwargs, "num_hidden_layers": layers, "num_labels": 1}
    config = getattr(transformers, class_name)(**kwargs)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    auto = transformers.AutoModelForSequenceClassification if value_model else transformers.AutoModelForCausalLM
    return auto.from_config(config).float(), json.loads(config.to_json_string())


def _lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    from hpc_rlhf.models.lora import apply_lora

    targets = ["all-linear"] if "w1" in spec.targets else sorted(spec.targets)
    return apply_lora(model, LoraConfig(rank=spec.rank, target_modules=targets, dropout=spec.dropout))


def test_peft_table_is_read_from_peft():
    """The MoE families peft converts, and which v4 names stand for the fused experts, come from peft 0.17+."""
    conversion = pytest.importorskip("peft.utils.transformers_weight_conversion")
    names = conversion._MOE_TARGET_MODULE_MAPPING
    expected = {t: base for t, base in conversion._MODEL_TO_CONVERSION_PATTERN.items() if base in names}
    table = peft_fused_moe_types()
    assert set(table) == set(expected) and "qwen2_moe" not in table
    assert table["mixtral"] == (("w1", "w3"), "w2")
    assert table["qwen3_moe"] == table["deepseek_v3"] == (("gate_proj", "up_proj"), "down_proj")
    for model_type, ((gate, up), down) in table.items():
        mapping = names[expected[model_type]]
        assert mapping[gate] == mapping[up] == "gate_up_proj" and mapping[down] == "down_proj"
        assert mapping["gate"] == "gate.weight"


def test_peft_table_without_the_conversion_module_is_empty(monkeypatch):
    """transformers 4 (or a peft before 0.17): no conversion module, so no family's experts are fused."""
    monkeypatch.setitem(sys.modules, "peft.utils.transformers_weight_conversion", None)  # import raises
    peft_fused_moe_types.cache_clear()
    try:
        assert peft_fused_moe_types() == {}
    finally:
        peft_fused_moe_types.cache_clear()


def test_peft_table_renamed_in_peft_is_a_clear_error(monkeypatch):
    conversion = pytest.importorskip("peft.utils.transformers_weight_conversion")
    monkeypatch.delattr(conversion, "_MOE_FUSED_TARGETS")
    peft_fused_moe_types.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="has no _MOE_FUSED_TARGETS"):
            peft_fused_moe_types()
    finally:
        monkeypatch.undo()
        peft_fused_moe_types.cache_clear()


CASES = [("qwen3_moe", ["all-linear"]), ("qwen3_moe", ["q_proj", "v_proj"]),
         ("qwen3_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"]), ("qwen3_moe", ["o_proj", "down_proj"]),
         ("mixtral", ["all-linear"]), ("mixtral", ["k_proj", "w2"]),
         ("qwen2_moe", ["all-linear"]), ("qwen2_moe", ["gate_proj", "up_proj", "down_proj"]),
         ("qwen2_moe_no_bias", ["all-linear"]),
         ("deepseek_v3", ["all-linear"]), ("deepseek_v3_q_proj_bias", ["all-linear"]),
         ("deepseek_v2", ["all-linear"]), ("deepseek_v3", ["kv_b_proj", "down_proj"])]


@pytest.mark.parametrize("family,targets", CASES, ids=[f"{f}-{'+'.join(t)}" for f, t in CASES])
def test_trainable_params_match_peft(family, targets):
    """Exact: attention (MLA's projections too), dense MLPs and shared experts where peft adapts them as
    nn.Linear, the fused experts (gate-up at twice the rank) and router in the families peft converts."""
    model, cfg = _model(family)
    shape = ModelShape.from_hf_config(cfg)
    spec = _spec(targets=targets)
    model = _lora(model, spec)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora_params(shape, spec) == sum(p.numel() for p in trainable.values())
    assert largest_lora_tensor(shape, spec) == max(p.numel() for p in trainable.values())


def test_fused_expert_factor_shapes():
    """peft's ParamWrapper on an (E, a, b) expert parameter: lora_A (rank x E, in), lora_B (out, rank x E); the
    router weight (E, h) is an ordinary (h -> E) pair; Qwen3-MoE's dense layer (mlp_only_layers) keeps no adapters."""
    model, cfg = _model("qwen3_moe")
    shape, spec = ModelShape.from_hf_config(cfg), _spec(rank=4)
    model = _lora(model, spec)
    shapes = {n.removeprefix("model.layers.0.mlp."): tuple(p.shape) for n, p in model.named_parameters()
              if p.requires_grad and n.startswith("model.layers.0.mlp.")}
    e, h, i = 6, 64, 40
    assert shapes == {"experts.base_layer.lora_A.default.weight": (2 * 4 * e, h),  # gate_up_proj, rank 2 x 4
                      "experts.base_layer.lora_B.default.weight": (2 * i, 2 * 4 * e),
                      "experts.lora_A.default.weight": (4 * e, i),  # down_proj
                      "experts.lora_B.default.weight": (h, 4 * e),
                      "gate.lora_A.default.weight": (4, h), "gate.lora_B.default.weight": (e, 4)}
    assert {t.name: t.params for t in expert_targets(shape, spec)} == {
        "gate_up_proj": 8 * e * (h + 2 * i), "down_proj": 4 * e * (i + h), "gate.weight": 4 * (h + e)}
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.layers.1.mlp."))
    assert expert_targets(ModelShape.from_hf_config(_model("qwen2_moe")[1]), spec) == ()


def test_value_model_counts_the_score_head():
    model, cfg = _model("qwen3_moe", value_model=True)
    shape, spec = ModelShape.from_hf_config(cfg), _spec()
    trainable = sum(p.numel() for p in _lora(model, spec).parameters() if p.requires_grad)
    assert lora_params(shape, spec, value_model=True) == trainable


def test_dropout_is_refused_by_peft_on_the_fused_experts_and_noted(tmp_path):
    with pytest.raises(ValueError, match=r"ds.lora.dropout=0.1: peft adapts this mixture-of-experts model"):
        _lora(_model("mixtral")[0], _spec(dropout=0.1))
    (tmp_path / "config.json").write_text(json.dumps(_model("mixtral")[1]))
    cfg = load_config(None, [f"actor.pretrain={tmp_path}", "ds.lora.rank=4", "ds.lora.dropout=0.1"])
    assert any("ds.lora.dropout=0" in n for n in role_memory(cfg, build_placement(cfg, 1), "actor").notes)


def _saved_per_token_and_fixed(family: str, spec: LoraSpec) -> tuple[float, float]:
    """Autograd's saved elements of one more sparse layer: per token and independent of the tokens."""
    def build(layers: int) -> torch.nn.Module:
        return _lora(_model(family, layers)[0], spec)

    short, long = saved_elements_per_layer(build, tokens=32), saved_elements_per_layer(build, tokens=64)
    return 2 * long - short, (short - long) * 64


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe_no_bias"])
def test_lora_sparse_layer_activations_match_autograd(family):
    """Mixtral: adapted experts and router, whose merged copies are saved whatever the tokens; Qwen2-MoE: frozen
    experts and router, adapted shared expert and gate. Per token as for the full-training count: two rsqrt
    scalars and a logsumexp a head, plus the routing's index tensors (at most 10 top_k + 2)."""
    shape, spec = ModelShape.from_hf_config(_model(family)[1]), _spec()
    per_token, fixed = _saved_per_token_and_fixed(family, spec)
    extra = per_token - lora_sparse_layer_elements(shape, spec, act_bytes=4) - 2 - shape.num_heads
    assert 0 <= extra <= 10 * shape.experts_per_token + 2
    merged, _ = lora_merged_elements(shape, spec)
    assert fixed == pytest.approx(merged + 4, abs=2)  # a few scalars of the routing
    if family == "mixtral":
        e, h, i = 4, 64, 96
        assert merged == e * 2 * i * h + e * i * h + e * h
    else:
        assert merged == 0


def test_merged_expert_copies_dominate_lora_activations_of_a_large_moe():
    """Qwen3-30B-A3B, all-linear: every sparse layer keeps a bf16 copy of its 128 merged experts (1.2 GB), 48 of
    them without gradient checkpointing; checkpointed, only the recomputed layer's, plus one gradient."""
    shape, spec = ModelShape.from_hf_config(QWEN3_30B_A3B), _spec(rank=16)
    per_layer, largest = lora_merged_elements(shape, spec)
    assert per_layer == 128 * 3 * 2048 * 768 + 128 * 2048 and largest == 128 * 2 * 768 * 2048
    kw = {"tokens": 0, "logit_tokens": 0, "act_bytes": 2, "lora": spec}
    assert activation_bytes(shape, **kw) == (48 * per_layer + largest) * 2
    assert activation_bytes(shape, **kw, gradient_checkpointing=True) == (per_layer + largest) * 2
    assert activation_bytes(shape, **kw) / GIB > 50


# QLoRA: bitsandbytes replaces nn.Linear modules only.
QWEN3 = {"hidden_size": 64, "intermediate_size": 96, "vocab_size": 100, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 64, "mlp_only_layers": [1], "tie_word_embeddings": False, "model_type": "qwen3_moe"}


def test_qlora_quantises_the_linears_not_the_fused_experts_by_hand():
    h, q, kv, i, moe_i, e = 64, 64, 32, 96, 64, 4
    shape = ModelShape.from_hf_config(QWEN3)
    attention = 2 * h * q + 2 * h * kv
    assert quantized_linear_params(shape) == 3 * attention + 1 * 3 * h * i  # 3 layers' q/k/v/o, 1 dense MLP
    assert quantized_linear_count(shape) == 3 * 4 + 3
    experts_and_router = 2 * (e * 3 * h * moe_i + e * h)  # 2 sparse layers, kept in the parameter dtype
    assert shape.num_params - quantized_linear_params(shape) == experts_and_router + 2 * 100 * h \
        + 3 * (2 * h + 2 * 16) + h


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_qlora_weight_bytes_match_a_loaded_4bit_model(tmp_path, family):
    """Storage of a 4-bit loaded tiny MoE model: Params4bit + quantisation state of every nn.Linear (shared
    experts and Qwen2-MoE's shared-expert gate included) = nf4_bytes up to partial blocks; every other parameter
    (the fused experts, the router, norms, embeddings, biases) is fp32: ``num_params - quantized_linear_params``."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Params4bit

    from hpc_rlhf.models.loading import load_causal_lm

    model, cfg = _model(family)
    model.save_pretrained(tmp_path)
    shape = ModelShape.from_hf_config(cfg)
    loaded = load_causal_lm(str(tmp_path), torch.float32, load_in_4bit=True)
    nf4 = plain = tensors = 0
    for p in loaded.parameters():
        if isinstance(p, Params4bit):
            s = p.quant_state
            parts = (p, s.absmax, s.code, s.offset, s.state2.absmax, s.state2.code)
            nf4 += sum(t.numel() * t.element_size() for t in parts)
            tensors += 1
        else:
            assert p.dtype == torch.float32
            plain += p.numel()
    assert tensors == quantized_linear_count(shape)
    # nf4_bytes averages the absmax blocks; these weights are not whole 64 x 256 blocks: under 5 bytes a weight off.
    assert 0 <= nf4 - nf4_bytes(quantized_linear_params(shape), tensors) < 5 * tensors
    assert plain == shape.num_params - quantized_linear_params(shape)


def test_qlora_role_memory_of_an_moe_actor(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    cfg = load_config(None, [f"actor.pretrain={tmp_path}", "ds.zero_stage=2", "ds.lora.rank=4",
                             "ds.lora.load_in_4bit=true"])
    shape, spec = ModelShape.from_hf_config(QWEN3), _spec()
    mem = role_memory(cfg, build_placement(cfg, 1), "actor")  # bf16 on GPU
    quant = quantized_linear_params(shape)
    expected = (shape.num_params - quant + lora_params(shape, spec)) * 2 + nf4_bytes(quant, 15)
    assert mem.weights_gib * GIB == pytest.approx(expected)
    assert mem.grads_gib * GIB == pytest.approx(lora_params(shape, spec) * 4)
