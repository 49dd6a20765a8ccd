"""Adapter-only weight sync (``ds.lora.sync``): the start-up decision, vLLM's adapter folder, and the transformers
engine taking an adapter through peft with the base untouched (equal to the merged model's outputs)."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.rollout.vllm_lora import node_local_dir, vllm_max_lora_rank
from hpc_rlhf.weight_sync.adapter import AdapterCollector, adapter_sync_refusal, resolve_lora_sync

pytest.importorskip("peft")

DENSE = {"backend": "vllm", "load_in_4bit": False, "moe": False, "target_modules": ["all-linear"],
         "vision_language": False, "discards_weights_in_sleep": False}


@pytest.mark.parametrize(("change", "needle"), [
    ({"load_in_4bit": True}, "ds.lora.load_in_4bit"),
    ({"moe": True}, "ParamWrapper"),
    ({"vision_language": True}, "vision-language"),
    ({"discards_weights_in_sleep": True}, "vllm.sleep_level=2"),
])
def test_what_an_engine_cannot_take_is_named(change, needle):
    assert adapter_sync_refusal(**DENSE) is None
    refusal = adapter_sync_refusal(**{**DENSE, **change})
    assert refusal is not None and needle in refusal
    assert resolve_lora_sync("auto", refusal) == "merged"
    with pytest.raises(ValueError, match=r"ds.lora.sync=adapter"):
        resolve_lora_sync("adapter", refusal)


def test_the_transformers_engine_takes_moe_and_vision_adapters_and_vllm_attention_only_moe():
    transformers = {**DENSE, "backend": "transformers", "moe": True, "vision_language": True}
    assert adapter_sync_refusal(**transformers) is None
    assert adapter_sync_refusal(**{**DENSE, "moe": True, "target_modules": ["q_proj", "v_proj"]}) is None
    assert resolve_lora_sync("auto", None) == "adapter"
    assert resolve_lora_sync("merged", None) == "merged"


def test_config_refuses_an_adapter_sync_without_adapter_or_on_a_4bit_base():
    with pytest.raises(ValueError, match=r"ds.lora.rank > 0"):
        LoraConfig(sync="adapter")
    with pytest.raises(ValueError, match=r"ds.lora.load_in_4bit"):
        LoraConfig(rank=8, sync="adapter", load_in_4bit=True)
    assert LoraConfig(rank=8, sync="auto", load_in_4bit=True).sync == "auto"


def test_start_up_decision_names_the_key(tmp_path):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.setup import SetupError, lora_sync_mode

    assert lora_sync_mode(load_config(None, [])) is None
    assert lora_sync_mode(load_config(None, ["ds.lora.rank=8"])) == "adapter"
    assert lora_sync_mode(load_config(None, ["ds.lora.rank=8", "ds.lora.load_in_4bit=true"])) == "merged"
    assert lora_sync_mode(load_config(None, ["ds.lora.rank=8", "ds.lora.sync=merged"])) == "merged"
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                       "num_experts_per_tok": 2}))
    vllm_moe = [f"actor.pretrain={moe}", "rollout.backend=vllm", "ds.lora.rank=8"]
    assert lora_sync_mode(load_config(None, vllm_moe)) == "merged"
    with pytest.raises(SetupError, match=r"ds.lora.sync=adapter.*ParamWrapper"):
        lora_sync_mode(load_config(None, [*vllm_moe, "ds.lora.sync=adapter"]))


@pytest.mark.parametrize(("rank", "allowed"), [(1, 1), (4, 8), (8, 8), (9, 16), (64, 64), (300, 320)])
def test_vllm_max_lora_rank(rank, allowed):
    assert vllm_max_lora_rank(rank) == allowed


def test_vllm_max_lora_rank_refuses_beyond_vllm():
    with pytest.raises(ValueError, match=r"ds.lora.rank=600"):
        vllm_max_lora_rank(600)


def test_adapter_folder_goes_to_node_local_storage(tmp_path):
    assert node_local_dir({"SLURM_TMPDIR": str(tmp_path)}) == str(tmp_path)
    assert node_local_dir({"SLURM_TMPDIR": str(tmp_path / "absent")}) != str(tmp_path / "absent")


def test_adapter_slot_writes_a_peft_folder_and_removes_it(tmp_path):
    from safetensors.torch import load_file

    from hpc_rlhf.rollout.vllm_lora import VllmAdapterSlot

    slot = VllmAdapterSlot(LoraConfig(rank=4, alpha=8), parent=str(tmp_path))
    assert slot.request is None  # no adapter before the first sync: the engine samples from the base
    tensors = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(4, 16)),
               ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(16, 4))]
    assert slot.write(tensors) == 2 * 64 * 4
    saved = load_file(f"{slot.folder}/adapter_model.safetensors")
    assert set(saved) == {"base_model.model." + n for n, _ in tensors}
    with open(f"{slot.folder}/adapter_config.json") as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    slot.remove()
    assert not list(tmp_path.iterdir())


def _peft_pair(path: str, cfg: LoraConfig):
    """(trained LoRA model with random factors, its merged plain copy)."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.lora import apply_lora, merged_named_tensors

    trained = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trained.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    merged.load_state_dict(dict(merged_named_tensors(trained)), strict=False)
    return trained, merged.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_transformers_engine_with_the_adapter_generates_what_the_merged_model_does(tmp_path, family):
    """Dense, and a mixture-of-experts model whose fused experts and router peft adapts (ParamWrapper)."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.lora import adapter_state_dict, hf_name
    from hpc_rlhf.models.tiny import build_tiny_model, build_tiny_moe_model
    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    path = str(build_tiny_model(tmp_path / "m", seed=0, initializer_range=0.1) if family == "llama"
               else build_tiny_moe_model(tmp_path / "m", family))
    cfg = LoraConfig(rank=4, alpha=8)
    trained, merged = _peft_pair(path, cfg)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = TransformersRolloutEngine(base, eos_token_id=None, pad_token_id=0, device="cpu", lora=cfg)
    reference = TransformersRolloutEngine(merged, eos_token_id=None, pad_token_id=0, device="cpu")
    requests = [GenerationRequest([1, 5, 7, 9], SamplingParams(max_new_tokens=8, seed=3), n=2)]
    before = engine.generate(requests)
    sent = [(n, t.detach().clone()) for n, t in adapter_state_dict(trained).items()]
    assert engine.update_adapter(sent) == sum(t.numel() * t.element_size() for _, t in sent)
    after, expected = engine.generate(requests), reference.generate(requests)
    for got, want in zip(after, expected, strict=True):
        assert got.output_ids == want.output_ids
        assert max(abs(a - b) for a, b in zip(got.output_logprobs, want.output_logprobs, strict=True)) < 1e-5
    assert any(a.output_logprobs != b.output_logprobs for a, b in zip(before, after, strict=True))
    base_now = {hf_name(n): t for n, t in engine.model.state_dict().items() if ".base_layer." in n and hf_name(n)}
    initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert base_now and all(torch.equal(t, initial[n]) for n, t in base_now.items())  # never merged


def test_an_adapter_of_another_shape_is_refused_naming_the_tensor(tmp_path):
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.lora import adapter_state_dict
    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    path = str(build_tiny_model(tmp_path / "m", seed=0))
    trained, _ = _peft_pair(path, LoraConfig(rank=8, alpha=16))
    engine = TransformersRolloutEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), None, 0,
                                       "cpu", lora=LoraConfig(rank=4, alpha=8))
    with pytest.raises(ValueError, match=r"lora_A.weight has shape"):
        engine.update_adapter(adapter_state_dict(trained).items())
    with pytest.raises(KeyError, match=r"missing"):
        engine.update_adapter(list(adapter_state_dict(trained).items())[:-1])
    plain = TransformersRolloutEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), None, 0, "cpu")
    with pytest.raises(NotImplementedError, match=r"ds.lora.sync"):
        super(TransformersRolloutEngine, plain).update_adapter([])
    with pytest.raises(RuntimeError, match=r"merged"):
        plain.update_adapter([])


def test_collector_keeps_every_bucket_of_a_round():
    collector = AdapterCollector()
    collector.update_weights([("a", torch.ones(2))])
    collector.update_weights([("b", torch.zeros(3)), ("c", torch.ones(1))])
    assert [n for n, _ in collector.tensors] == ["a", "b", "c"]
