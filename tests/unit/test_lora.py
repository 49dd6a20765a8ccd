"""LoRA helpers: merged weights equal peft's merge, plain HF names, adapter round trip, lora-merge CLI."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")

from hpc_rlhf.config.schema import LoraConfig  # noqa: E402
from hpc_rlhf.models.lora import apply_lora, hf_name, merged_named_tensors, save_adapter  # noqa: E402
from hpc_rlhf.models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", seed=0))


def _randomize_lora(model: torch.nn.Module, seed: int = 1) -> None:
    """lora_B starts at zero (merge == base); give every trainable tensor a random value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _causal(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _lora_actor(path: str, **kw):
    model = apply_lora(_causal(path), LoraConfig(rank=4, alpha=8, **kw))
    _randomize_lora(model)
    return model


def test_hf_name_mapping():
    assert hf_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert hf_name("base_model.model.model.norm.weight") == "model.norm.weight"
    assert hf_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert hf_name("score.modules_to_save.default.weight") == "score.weight"
    assert hf_name("score.original_module.weight") is None
    # peft nests one ParamWrapper per adapted parameter of an MoE experts module
    nested = "model.layers.0.mlp.experts.base_layer.base_layer.down_proj"
    assert hf_name(nested) == "model.layers.0.mlp.experts.down_proj"


def test_only_lora_trainable_and_model_type_kept(tiny_path):
    model = apply_lora(_causal(tiny_path), LoraConfig(rank=4, alpha=8))
    assert type(model).__name__ == "LlamaForCausalLM"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)  # all-linear leaves the output layer alone


def test_target_modules_list(tiny_path):
    model = apply_lora(_causal(tiny_path), LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "v_proj"]))
    trainable = {n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"q_proj", "v_proj"}


def test_merged_equals_peft_merge_and_names_match_base(tiny_path):
    model = _lora_actor(tiny_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = dict(merged_named_tensors(model))
    # training weights untouched
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    plain_keys = set(_causal(tiny_path).state_dict())
    assert set(merged) == plain_keys
    reference = copy.deepcopy(model)
    from peft.tuners.lora import LoraLayer

    for module in reference.modules():
        if isinstance(module, LoraLayer):
            module.merge()  # peft's in-place merge, on a copy
    ref_state = {hf_name(k): v for k, v in reference.state_dict().items() if hf_name(k) is not None}
    assert set(ref_state) == plain_keys
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, ref_state[name], rtol=1e-5, atol=1e-6, msg=name)
    base_q = before["model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base_q)


def test_merged_equals_peft_model_merge_and_unload(tiny_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_model = get_peft_model(_causal(tiny_path), PeftLoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                                                                   task_type="CAUSAL_LM"))
    _randomize_lora(peft_model, seed=3)
    merged = dict(merged_named_tensors(peft_model))
    ref = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(merged) == set(ref)
    for name in ref:
        torch.testing.assert_close(merged[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_value_model_keeps_score_trainable(tiny_path):
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(tiny_path, num_labels=1, dtype=torch.float32)
    plain_keys = set(base.state_dict())
    model = apply_lora(base, LoraConfig(rank=4, alpha=8))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(n.startswith("score.") for n in trainable)
    assert not any("score" in n and "lora_" in n for n in trainable)
    _randomize_lora(model)
    merged = dict(merged_named_tensors(model))
    assert set(merged) == plain_keys
    torch.testing.assert_close(merged["score.weight"], model.score.modules_to_save["default"].weight.detach())


def test_tied_lm_head_target_rejected(tiny_path):
    with pytest.raises(ValueError, match="lm_head"):
        apply_lora(_causal(tiny_path), LoraConfig(rank=2, target_modules=["q_proj", "lm_head"]))


def test_lora_merge_cli_matches_peft_logits(tiny_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.cli.lora_merge import main

    model = _lora_actor(tiny_path)
    adapter = tmp_path / "adapter"
    save_adapter(model, str(adapter))
    out = tmp_path / "merged"
    main(["--base", tiny_path, "--adapter", str(adapter), "--output", str(out)])
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    ids = torch.randint(4, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(_causal(tiny_path), str(adapter)).eval()
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        torch.testing.assert_close(peft_model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_lora_merges_the_expert_and_router_adapters(tmp_path, family):
    """peft's all-linear also adapts an MoE block's fused 3-D experts and its router weight (``ParamWrapper``):
    the merged plain weights must carry those deltas, or exports and weight sync drop them silently."""
    from hpc_rlhf.models.tiny import build_tiny_moe_model

    path = str(build_tiny_moe_model(tmp_path / family, family=family, seed=0))
    model = _lora_actor(path)
    adapted = [n for n, p in model.named_parameters() if p.requires_grad and ".mlp." in n]
    assert any(".experts." in n for n in adapted) and any(".gate." in n for n in adapted), adapted
    merged = dict(merged_named_tensors(model))
    plain = _causal(path)
    assert set(merged) == set(plain.state_dict())
    base_experts = plain.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert not torch.equal(merged["model.layers.0.mlp.experts.gate_up_proj"], base_experts)
    plain.load_state_dict(merged)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_moe_lora_with_dropout_names_the_key(tmp_path):
    from hpc_rlhf.models.tiny import build_tiny_moe_model

    path = str(build_tiny_moe_model(tmp_path / "moe", family="qwen3_moe", seed=0))
    with pytest.raises(ValueError, match=r"ds.lora.dropout=0.1: peft adapts this mixture-of-experts model"):
        apply_lora(_causal(path), LoraConfig(rank=4, dropout=0.1))
    attention_only = apply_lora(_causal(path), LoraConfig(rank=4, dropout=0.1, target_modules=["q_proj", "v_proj"]))
    assert not any(".mlp." in n for n, p in attention_only.named_parameters() if p.requires_grad)
