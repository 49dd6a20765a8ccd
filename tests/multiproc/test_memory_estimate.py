"""``hpc-rlhf plan``'s memory model against measured peak memory: a 56M-parameter Llama trained by
``TrainEngine`` (DeepSpeed, fp32, gloo) on CPU, ZeRO-0 on one rank and ZeRO-3 on two.

Tolerance: the estimate (``role_memory(..., on_gpu=False).total_gib``: model states, DeepSpeed buffers,
gathered ZeRO-3 parameters, activations of one micro-batch) is within ``REL_TOL`` = 10% of the measured
peak of every rank. Measured on DeepSpeed 0.19.8 / transformers 5.23 / torch 2.13: within 1.1% (see
docs/memory.md for the numbers).

How the peak is measured, and why this way. Each rank is a fresh spawned process. It first trains a
tiny model of the same architecture through the same engine, so torch / DeepSpeed code pages and the
JIT-built comm op are already resident (they would otherwise count as the run's memory). Then it resets
the kernel's high-water mark (``/proc/self/clear_refs`` = 5), takes ``VmRSS`` as the baseline, builds
and trains the measured model, and reads ``VmHWM``: the true peak resident set of the process, however
short-lived, which a sampling thread can miss. glibc's dynamic mmap threshold would keep freed tensors
in the heap and make the peak depend on the order of allocations; ``mallopt`` fixes the thresholds so
every tensor above 64 KiB is its own mapping, returned on free, and RSS follows live tensor bytes (what a
GPU's ``max_memory_allocated`` reports). Two optimizer steps of two micro-batches each: the second step
is the steady state (Adam states exist, gradients accumulate while activations live).
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
NUM_ACTIONS = 128  # response tokens: the LM head runs on these only, as in experience.action_logits
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


def _train(shape: dict, stage: int, micro: int, checkpointing: bool, dp: int):
    from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig
    from hpc_rlhf.engines.deepspeed_engine import TrainEngine
    from hpc_rlhf.models.logprobs import logprobs_from_logits

    ds = DeepSpeedConfig(zero_stage=stage, param_dtype="fp32", gradient_checkpointing=checkpointing)
    engine = TrainEngine.create(lambda: _llama(shape), ds, ActorConfig(learning_rate=1e-4),
                                train_batch_size=micro * dp * GRAD_ACCUM, micro_train_batch_size=micro,
                                num_training_steps=10, on_gpu=False)
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
    return engine


def _measure(rank: int, world_size: int, stage: int, micro: int, checkpointing: bool) -> int:
    import torch.distributed as dist

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 << 10)
    libc.mallopt(M_TRIM_THRESHOLD, 64 << 10)
    warm = _train(WARMUP_SHAPE, stage, 1, checkpointing, world_size)
    del warm
    gc.collect()
    dist.barrier()
    _reset_peak()
    baseline = _status_bytes("VmRSS")
    engine = _train(SHAPE, stage, micro, checkpointing, world_size)
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
@pytest.mark.parametrize("world_size,stage,micro,checkpointing", [
    (1, 0, 4, False),
    (2, 3, 4, False),
    (2, 3, 2, True),
], ids=["zero0-1rank", "zero3-2ranks", "zero3-2ranks-checkpointing"])
def test_plan_estimate_matches_measured_peak(tmp_path, world_size, stage, micro, checkpointing):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.dist.memory_estimate import role_memory
    from hpc_rlhf.dist.placement import build_placement

    (tmp_path / "config.json").write_text(json.dumps(SHAPE))  # what `plan` reads from actor.pretrain
    cfg = load_config(None, [
        f"actor.pretrain={tmp_path}", f"ds.zero_stage={stage}", "ds.param_dtype=fp32",
        "ds.attn_implementation=sdpa", f"ds.gradient_checkpointing={str(checkpointing).lower()}",
        f"train.micro_train_batch_size={micro}", f"data.max_len={SEQ_LEN}",
        f"rollout.generate_max_len={NUM_ACTIONS}",
    ])
    estimate = role_memory(cfg, build_placement(cfg, world_size), "actor", on_gpu=False).total_gib * 1024**3
    peaks = run_on_ranks(_measure, world_size, stage, micro, checkpointing)
    for rank, peak in enumerate(peaks):
        err = (estimate - peak) / peak
        print(f"rank {rank}: measured {peak / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB ({err:+.1%})")
        assert abs(err) <= REL_TOL, (f"rank {rank}: estimate {estimate / 2**20:.0f} MiB vs measured peak "
                                     f"{peak / 2**20:.0f} MiB ({err:+.1%}, tolerance {REL_TOL:.0%})")
