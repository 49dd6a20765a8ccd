"""``hpc-rlhf plan``'s memory model against measured peak memory: a 56M-parameter Llama trained by
``TrainEngine`` (DeepSpeed, fp32, gloo) on CPU, ZeRO-0 on one rank and ZeRO-3 on two; and with LoRA (r=16,
all-linear) and QLoRA (r=16 on an NF4 base loaded by ``load_causal_lm(..., load_in_4bit=True)`` from a saved
folder, bitsandbytes' CPU backend) on one rank.

Tolerance: the estimate (``role_memory(..., on_gpu=False).total_gib``: model states, DeepSpeed buffers,
gathered ZeRO-3 parameters, activations of one micro-batch, a 4-bit layer's dequantised weight) is within
``REL_TOL`` = 10% of the measured peak of every rank. Measured on DeepSpeed 0.19.8 / transformers 5.23 /
torch 2.13 / peft 0.21 / bitsandbytes 0.50: within 1.6% (see docs/memory.md for the numbers).

How the peak is measured, and why this way. Each rank is a fresh process (tests/multiproc/spawn.py). It first
trains a tiny model of the same architecture through the same engine (for QLoRA a tiny 4-bit one), so torch /
DeepSpeed / bitsandbytes code pages and the JIT-built comm op are already resident (they would otherwise
count as the run's memory). It takes ``VmRSS`` as the baseline and builds the measured engine; then it
resets the kernel's high-water mark (``/proc/self/clear_refs`` = 5: ``VmHWM`` restarts from the current
``VmRSS``, which holds the built model states), trains, and reads ``VmHWM``: the true peak resident set of
the process during training, however short-lived, which a sampling thread can miss. The peak counts from the
baseline, so the model states are in it; what building alone needs (a QLoRA load maps the fp32 checkpoint
before quantising it) is not: plan models training, and on a GPU those load transients are host memory.
glibc's dynamic mmap threshold would keep freed tensors in the heap and make the peak depend on the order of
allocations; ``mallopt`` fixes the thresholds so every tensor above 64 KiB is its own mapping, returned on
free, and RSS follows live tensor bytes (what a GPU's ``max_memory_allocated`` reports). Two optimizer steps
of two micro-batches each: the second step is the steady state (Adam states exist, gradients accumulate
while activations live).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re

import pytest
import torch

from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow

REL_TOL = 0.10
SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1408, "vocab_size": 32000,
         "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": False}
WARMUP_SHAPE = {**SHAPE, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 1}
SEQ_LEN = 256
NUM_ACTIONS = 128  # response tokens: the LM head runs on these only, as in models.forward.action_logits
GRAD_ACCUM = 2
STEPS = 2
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _llama(shape: dict):  # module level: pickled into the spawned ranks
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


def _load_4bit(folder: str):
    """``load_causal_lm(folder, fp32, load_in_4bit=True)``, with its full-precision parameters copied out of the
    checkpoint. transformers leaves them (embeddings, LM head, norms) as views into the mmapped safetensors file,
    which keeps the whole mapping alive, and with it the fp32 pages of every layer the loader read to quantise:
    +90 MiB of file-backed RSS here that a GPU run does not have (its weights are copied to the device)."""
    from hpc_rlhf.models.loading import load_causal_lm
    from hpc_rlhf.models.quantization import is_quantized

    model = load_causal_lm(folder, torch.float32, "sdpa", load_in_4bit=True)
    for param in model.parameters():
        if not is_quantized(param):
            param.data = param.data.clone()
    return model


def _engine(shape: dict, stage: int, micro: int, checkpointing: bool, dp: int, lora_rank: int, folder: str | None):
    """``folder``: load a 4-bit (QLoRA) base from this saved model instead of building ``shape`` in memory."""
    from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig, LoraConfig
    from hpc_rlhf.training.deepspeed_engine import TrainEngine

    ds = DeepSpeedConfig(zero_stage=stage, param_dtype="fp32", gradient_checkpointing=checkpointing,
                         lora=LoraConfig(rank=lora_rank, load_in_4bit=folder is not None))
    factory = (lambda: _load_4bit(folder)) if folder else (lambda: _llama(shape))
    return TrainEngine.create(factory, ds, ActorConfig(learning_rate=1e-4),
                              train_batch_size=micro * dp * GRAD_ACCUM, micro_train_batch_size=micro,
                              num_training_steps=10, on_gpu=False)


def _train(engine, shape: dict, micro: int) -> None:
    from hpc_rlhf.models.logprobs import logprobs_from_logits

    engine.train()
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS * GRAD_ACCUM):
        ids = torch.randint(0, shape["vocab_size"], (micro, SEQ_LEN), generator=gen)
        logits = engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                        logits_to_keep=NUM_ACTIONS + 1).logits[:, -NUM_ACTIONS - 1:-1]
        loss = -logprobs_from_logits(logits, ids[:, -NUM_ACTIONS:]).mean()
        del logits
        engine.backward(loss)
        engine.step()


def _measure(rank: int, world_size: int, stage: int, micro: int, checkpointing: bool, lora_rank: int,
             folders: tuple[str, str] | None) -> int:
    import torch.distributed as dist

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 << 10)
    libc.mallopt(M_TRIM_THRESHOLD, 64 << 10)
    warmup_folder, folder = folders or (None, None)
    warm = _engine(WARMUP_SHAPE, stage, 1, checkpointing, world_size, lora_rank, warmup_folder)
    _train(warm, WARMUP_SHAPE, 1)
    del warm
    gc.collect()
    dist.barrier()
    baseline = _status_bytes("VmRSS")
    engine = _engine(SHAPE, stage, micro, checkpointing, world_size, lora_rank, folder)
    gc.collect()
    _reset_peak()
    _train(engine, SHAPE, micro)
    peak = _status_bytes("VmHWM") - baseline
    del engine
    return peak


def _clear_refs_works() -> bool:
    try:
        _reset_peak()
        return _status_bytes("VmHWM") > 0
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs") or not _clear_refs_works(),
                    reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
@pytest.mark.parametrize("world_size,stage,micro,checkpointing,lora_rank,load_in_4bit", [
    (1, 0, 4, False, 0, False),
    (2, 3, 4, False, 0, False),
    (2, 3, 2, True, 0, False),
    (1, 0, 4, False, 16, False),
    (1, 0, 2, False, 16, True),
], ids=["zero0-1rank", "zero3-2ranks", "zero3-2ranks-checkpointing", "lora-1rank", "qlora-1rank"])
def test_plan_estimate_matches_measured_peak(tmp_path, world_size, stage, micro, checkpointing, lora_rank,
                                             load_in_4bit):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.planning.memory_estimate import role_memory
    from hpc_rlhf.world.placement import build_placement

    (tmp_path / "config.json").write_text(json.dumps(SHAPE))  # what `plan` reads from actor.pretrain
    folders = None
    if load_in_4bit:  # a 4-bit base is quantised while loading: the ranks load saved models
        pytest.importorskip("bitsandbytes")
        folders = (str(tmp_path / "warmup"), str(tmp_path / "model"))
        _llama(WARMUP_SHAPE).save_pretrained(folders[0])
        _llama(SHAPE).save_pretrained(folders[1])
    cfg = load_config(None, [
        f"actor.pretrain={tmp_path}", f"ds.zero_stage={stage}", "ds.param_dtype=fp32",
        "ds.attn_implementation=sdpa", f"ds.gradient_checkpointing={str(checkpointing).lower()}",
        f"train.micro_train_batch_size={micro}", f"data.max_len={SEQ_LEN}",
        f"rollout.generate_max_len={NUM_ACTIONS}", f"ds.lora.rank={lora_rank}",
        f"ds.lora.load_in_4bit={str(load_in_4bit).lower()}",
    ])
    estimate = role_memory(cfg, build_placement(cfg, world_size), "actor", on_gpu=False).total_gib * 1024**3
    peaks = run_on_ranks(_measure, world_size, stage, micro, checkpointing, lora_rank, folders)
    for rank, peak in enumerate(peaks):
        err = (estimate - peak) / peak
        print(f"rank {rank}: measured {peak / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB ({err:+.1%})")
        assert abs(err) <= REL_TOL, (f"rank {rank}: estimate {estimate / 2**20:.0f} MiB vs measured peak "
                                     f"{peak / 2**20:.0f} MiB ({err:+.1%}, tolerance {REL_TOL:.0%})")
