"""LoRA and QLoRA through TrainEngine on 2 gloo ranks (CPU fp32): training, merged weights, rollout sync, HF
export, checkpoint round trip. QLoRA (4-bit NF4 base, bitsandbytes' torch backend) runs under ZeRO-2."""

from __future__ import annotations

import importlib.util
import os
from functools import partial

import pytest
import torch

pytest.importorskip("peft")

from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig, LoraConfig  # noqa: E402
from hpc_rlhf.models.tiny import build_tiny_model  # noqa: E402
from tests.multiproc.spawn import run_each_on_ranks  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

PROMPT = "Q: 7+5\nA: "
TARGET = "12;12;12"  # what SFT teaches the adapter to answer
NUM_STEPS = 30


def _load(path: str, load_in_4bit: bool = False):
    from hpc_rlhf.models.loading import load_causal_lm

    return load_causal_lm(path, torch.float32, load_in_4bit=load_in_4bit)


def _lora_engine(path: str, zero_stage: int = 2, load_in_4bit: bool = False):
    from hpc_rlhf.training.deepspeed_engine import TrainEngine

    ds = DeepSpeedConfig(zero_stage=zero_stage,
                         lora=LoraConfig(rank=8, alpha=16, dropout=0.0, load_in_4bit=load_in_4bit))
    # ZeRO-3 keeps params below the persistence threshold whole; 0 makes the tiny model really shard.
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero_stage == 3 else None
    return TrainEngine.create(partial(_load, path, load_in_4bit), ds,
                              ActorConfig(learning_rate=1e-2, lr_warmup_ratio=0.0, min_lr_ratio=1.0),
                              train_batch_size=2, micro_train_batch_size=1, num_training_steps=NUM_STEPS,
                              on_gpu=False, extra_ds_config=extra)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's copy: the ZeRO-3 partition, else the parameter itself."""
    return getattr(param, "ds_tensor", param).detach()


def _greedy_rollout(model, tok, prompt_ids: list[int], max_new: int) -> list[int]:
    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    engine = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, "cpu")
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return engine.generate([GenerationRequest(prompt_ids, params)])[0].output_ids


def _train_and_check(rank: int, world_size: int, model_path: str, out_dir: str, zero_stage: int,
                     load_in_4bit: bool) -> dict:
    from peft import PeftModel
    from transformers import AutoTokenizer

    from hpc_rlhf.models.lora import merged_named_tensors
    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    tok = AutoTokenizer.from_pretrained(model_path)
    engine = _lora_engine(model_path, zero_stage, load_in_4bit)
    module = engine.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
    # ZeRO hands the optimizer flat fp32 partitions of the trainable parameters: no bigger than the LoRA ones
    optimizer = engine.engine.optimizer
    flat = getattr(optimizer, "fp32_partitioned_groups_flat", None) or [
        p for g in optimizer.param_groups for p in g["params"]]
    num_opt = sum(t.numel() for t in flat)
    num_lora = sum(getattr(p, "ds_numel", p.numel()) for n, p in module.named_parameters() if n in trainable)
    assert 0 < num_opt <= num_lora, (num_opt, num_lora)
    before = {n: _local(p).clone() for n, p in module.named_parameters()}

    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + tok(TARGET, add_special_tokens=False)["input_ids"]])
    labels = ids.clone()
    labels[:, :len(prompt_ids)] = -100
    engine.train()
    losses = []
    for _ in range(NUM_STEPS):  # one micro batch per rank = one optimizer step (no accumulation)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.eval()

    after = {n: _local(p) for n, p in module.named_parameters()}
    changed = {n for n in after if not torch.equal(before[n], after[n])}
    assert changed == trainable, sorted(changed ^ trainable)[:4]

    gathered: dict[str, torch.Tensor] = {}
    for bucket in engine.gathered_state_dict_items(bucket_bytes=64 << 10):  # collective under ZeRO-3
        for name, tensor in bucket:
            assert name not in gathered, f"{name} yielded twice"
            gathered[name] = tensor
    engine.save_hf(out_dir, tokenizer=tok)  # merged weights + adapter/
    result = {"losses": losses, "resumed_equal": _checkpoint_round_trip(engine, model_path, out_dir, zero_stage,
                                                                         load_in_4bit, ids, labels)}
    if rank == 0:
        # peft over the same (4-bit or plain) base the adapter was trained on is the trained policy
        peft_model = PeftModel.from_pretrained(_load(model_path, load_in_4bit), os.path.join(out_dir, "adapter"))
        peft_model = peft_model.eval()
        max_new = len(tok(TARGET, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            peft_greedy = peft_model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(
                1, len(prompt_ids), dtype=torch.long), max_new_tokens=max_new, do_sample=False,
                pad_token_id=tok.pad_token_id, eos_token_id=None)[0, len(prompt_ids):].tolist()
        # (peft's merge_and_unload would re-quantise a 4-bit merge: the reference is our merge of its model)
        reference = dict(merged_named_tensors(peft_model)) if load_in_4bit else \
            peft_model.merge_and_unload().state_dict()
        plain = _load(model_path)
        plain_keys = set(plain.state_dict())
        # tied weights (lm_head = embed_tokens) appear once, like the engine without LoRA
        assert set(gathered) <= plain_keys and plain_keys - set(gathered) <= {"lm_head.weight"}
        max_diff = max(float((gathered[n] - reference[n]).abs().max()) for n in gathered)
        assert max_diff < 1e-5, max_diff
        base_greedy = _greedy_rollout(_load(model_path), tok, prompt_ids, max_new)
        with open(os.path.join(out_dir, "config.json")) as f:
            assert "quantization_config" not in f.read()  # the export holds plain (dequantised) weights

        rollout = TransformersRolloutEngine(plain, tok.eos_token_id, tok.pad_token_id, "cpu")
        rollout.update_weights(gathered.items())
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        synced_greedy = rollout.generate([GenerationRequest(prompt_ids, params)])[0].output_ids
        exported_greedy = _greedy_rollout(_load(out_dir), tok, prompt_ids, max_new)
        result.update(peft=tok.decode(peft_greedy), synced=tok.decode(synced_greedy),
                      exported=tok.decode(exported_greedy), base=tok.decode(base_greedy))
    return result


def _checkpoint_round_trip(engine, model_path: str, out_dir: str, zero_stage: int, load_in_4bit: bool,
                           ids: torch.Tensor, labels: torch.Tensor) -> bool:
    """Save, load into a fresh engine: same trainable weights, same loss. LoRA checkpoints hold no frozen base."""
    ckpt = os.path.join(out_dir, "ckpt")
    engine.save_checkpoint(ckpt, "step")
    module_file = os.path.join(ckpt, "step", "mp_rank_00_model_states.pt")
    if load_in_4bit and os.path.exists(module_file):
        saved = torch.load(module_file, map_location="cpu", weights_only=False)["module"]
        # the packed 4-bit weights stay out (bitsandbytes' small quantisation state, ~1/64 byte per weight, not)
        assert not any(k.endswith(".base_layer.weight") for k in saved), [k for k in saved if "base_layer" in k][:3]
    fresh = _lora_engine(model_path, zero_stage, load_in_4bit)
    fresh.load_checkpoint(ckpt, "step")
    trained = dict(engine.module.named_parameters())
    same = all(torch.equal(_local(p), _local(trained[n])) for n, p in fresh.module.named_parameters()
               if p.requires_grad)
    engine.eval(), fresh.eval()
    with torch.no_grad():
        same = same and torch.equal(engine(input_ids=ids, labels=labels).loss, fresh(input_ids=ids, labels=labels).loss)
    return bool(same)


HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
RUNS = {"lora-zero2": (2, False), "lora-zero3": (3, False), **({"qlora-zero2": (2, True)} if HAS_BNB else {})}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every RUNS run in one spawn (importing deepspeed + transformers + peft dominates a spawn's cost), each on
    a model and an export folder of its own; ``{id: (per-rank results, export folder)}``."""
    base = tmp_path_factory.mktemp("lora")
    args = {}
    for run_id, (zero_stage, load_in_4bit) in RUNS.items():
        # init std 0.1: the frozen tied embeddings then allow confident logits, so the learned answer wins greedy
        # decoding by a wide margin (~4.5 logits at every position) rather than by CPU-dependent rounding (~0.9
        # at 0.02)
        model_path = str(build_tiny_model(base / run_id / "tiny", seed=0, initializer_range=0.1))
        args[run_id] = (model_path, str(base / run_id / "export"), zero_stage, load_in_4bit)
    results = run_each_on_ranks(_train_and_check, 2, args)
    return {run_id: (results[run_id], base / run_id / "export") for run_id in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("run_id", [
    "lora-zero2", "lora-zero3",
    pytest.param("qlora-zero2", marks=pytest.mark.skipif(
        not HAS_BNB, reason="QLoRA needs bitsandbytes (pip install bitsandbytes)")),
])
def test_lora_train_merge_sync_export(trained, run_id):
    results, export = trained[run_id]
    losses = results[0]["losses"]
    assert losses[-1] < 0.5 < losses[0] and losses[-1] < losses[NUM_STEPS // 2], losses  # ~5.1 -> ~0.16
    r0 = results[0]
    assert r0["synced"] == r0["peft"], r0  # the rollout engine generates what the trained policy does
    assert r0["exported"] == r0["peft"], r0
    assert r0["peft"] == TARGET and r0["base"] != TARGET, r0  # ... and that is the trained behaviour
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    assert all(r["resumed_equal"] for r in results), [r["resumed_equal"] for r in results]
