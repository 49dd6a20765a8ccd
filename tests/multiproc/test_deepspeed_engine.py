"""TrainEngine / FrozenEngine over DeepSpeed on 2 gloo ranks with a tiny fp32 Llama (CPU)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig, RefConfig
from tests.multiproc.spawn import run_on_ranks

os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB = 64
SEQ = 16
# ZeRO-3 keeps params below this many elements unpartitioned; 0 makes the tiny model really shard.
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_llama():
    """Module-level (picklable) factory; same seed on every rank."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config()).float()


def _batch(seed: int, batch_size: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)


def _loss(engine, input_ids: torch.Tensor) -> torch.Tensor:
    return engine(input_ids=input_ids, labels=input_ids).loss


def _gathered(engine) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in engine.gathered_state_dict_items(bucket_bytes=16 << 10):  # small: several buckets
        for name, tensor in bucket:
            assert name not in out, f"{name} yielded twice"
            out[name] = tensor
    return out


def _numpy(state: dict[str, torch.Tensor]) -> dict:
    return {k: v.float().numpy() for k, v in state.items()}  # plain pickles through the Manager


def _train_engine(stage: int, *, train_batch_size: int, micro: int = 1, steps: int = 8, lr: float = 1e-2,
                  min_lr_ratio: float = 1.0, warmup_ratio: float = 0.0, dp_group=None,
                  gradient_checkpointing: bool = False, extra: dict | None = None):
    from hpc_rlhf.training.deepspeed_engine import TrainEngine

    return TrainEngine.create(
        tiny_llama, DeepSpeedConfig(zero_stage=stage, gradient_checkpointing=gradient_checkpointing),
        ActorConfig(learning_rate=lr, lr_warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio),
        train_batch_size=train_batch_size, micro_train_batch_size=micro, num_training_steps=steps,
        dp_group=dp_group, on_gpu=False, extra_ds_config=SHARD_ALL if stage == 3 else extra,
    )


# --------------------------------------------------------------------------------------------------
# pure


def test_build_ds_config_cpu_fp32_and_gpu_bf16():
    from hpc_rlhf.training.deepspeed_engine import build_ds_config

    actor = ActorConfig(learning_rate=1e-5, max_norm=0.5)
    cpu = build_ds_config(DeepSpeedConfig(zero_stage=3), actor, train_batch_size=8, micro_train_batch_size=2,
                          dp_size=2, on_gpu=False)
    assert cpu["gradient_accumulation_steps"] == 2 and cpu["train_batch_size"] == 8
    assert "bf16" not in cpu and "fp16" not in cpu
    assert cpu["optimizer"]["type"] == "AdamW" and cpu["optimizer"]["params"]["torch_adam"] is True
    assert cpu["gradient_clipping"] == 0.5 and cpu["zero_optimization"]["stage"] == 3
    gpu = build_ds_config(DeepSpeedConfig(zero_stage=2, adam_offload=True), actor, train_batch_size=8,
                          micro_train_batch_size=4, dp_size=2, on_gpu=True)
    assert gpu["bf16"] == {"enabled": True} and gpu["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "torch_adam" not in gpu["optimizer"]["params"]  # ZeRO-Offload: DeepSpeedCPUAdam
    frozen = build_ds_config(DeepSpeedConfig(zero_stage=2), None, train_batch_size=4, micro_train_batch_size=2,
                             dp_size=2, on_gpu=False)
    assert "optimizer" not in frozen and frozen["zero_optimization"]["stage"] == 0
    with pytest.raises(ValueError, match="train_batch_size=6"):
        build_ds_config(DeepSpeedConfig(), actor, train_batch_size=6, micro_train_batch_size=2, dp_size=2,
                        on_gpu=False)


# --------------------------------------------------------------------------------------------------
# 2 ranks


def _train_worker(rank: int, world_size: int, stage: int) -> dict:
    # dp=2 -> 2 micro batches per step; ZeRO-2 also runs with gradient checkpointing on.
    # Every stage steps with torch's fused AdamW on CPU (engines.optimizer_choice), as stages 0-2 do on GPU.
    engine = _train_engine(stage, train_batch_size=4, micro=1, gradient_checkpointing=stage == 2)
    optimizer = engine.engine.basic_optimizer
    checkpointing = getattr(engine.module, "is_gradient_checkpointing", False)
    engine.offload_states()  # no accelerator: both must be harmless no-ops
    engine.reload_states()
    engine.train()
    before = _gathered(engine)
    data = [_batch(100 * rank + i) for i in range(2)]  # fixed per-rank data, reused every step
    losses, boundaries, grad_norms = [], [], []
    for opt_step in range(6):
        step_loss = 0.0
        for input_ids in data:
            loss = _loss(engine, input_ids)
            engine.backward(loss)
            boundaries.append(engine.is_gradient_accumulation_boundary())
            info = engine.step()
            grad_norms.append(info["grad_norm"])
            step_loss += loss.item() / len(data)
        losses.append(step_loss)
        if opt_step == 0:
            after_one = _gathered(engine)
            changed = [n for n in before if not torch.equal(before[n], after_one[n])]
    return {"optimizer": (type(optimizer), optimizer.defaults.get("fused")), "checkpointing": checkpointing,
            "losses": losses, "boundaries": boundaries, "grad_norms": grad_norms, "changed": changed,
            "names": list(before), "global_steps": engine.global_steps, "final": _numpy(_gathered(engine))}


def _train_worker_every_stage(rank: int, world_size: int) -> dict:
    """ZeRO-0, -2 and -3 one after another in one spawn (importing deepspeed + transformers dominates a spawn's
    cost); each engine is built afresh from the same seed (tiny_llama), so each stage runs as it would alone."""
    return {stage: _train_worker(rank, world_size, stage) for stage in (0, 2, 3)}


@pytest.fixture(scope="module")
def every_stage_trained():
    return run_on_ranks(_train_worker_every_stage, 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2, 0])
def test_train_engine_learns_and_accumulates(every_stage_trained, stage):
    results = [per_stage[stage] for per_stage in every_stage_trained]
    for res in results:
        assert res["optimizer"] == (torch.optim.AdamW, True)
        assert res["checkpointing"] == (stage == 2)
        assert res["losses"][-1] < 0.8 * res["losses"][0], res["losses"]
        assert sorted(res["changed"]) == sorted(res["names"])  # every trainable tensor moved in one step
        assert res["boundaries"] == [False, True] * 6  # train 4 / (micro 1 x dp 2) = 2 micro batches
        assert all((g is None) == (not b) for g, b in zip(res["grad_norms"], res["boundaries"]))
        assert all(g > 0 for g in res["grad_norms"] if g is not None)
        assert res["global_steps"] == 6
    first, second = (r["final"] for r in results)
    assert first.keys() == second.keys()
    for name in first:
        assert (first[name] == second[name]).all(), f"ranks disagree on {name}"


def _hf_worker(rank: int, world_size: int, out_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    engine = _train_engine(3, train_batch_size=2)
    state = _gathered(engine)
    reference = tiny_llama().state_dict()
    keys_ok = sorted(state) == sorted(reference)
    shapes_ok = all(state[k].shape == reference[k].shape for k in reference if k in state)
    engine.save_hf(out_dir)
    engine.eval()
    input_ids = _batch(7, batch_size=2)
    with torch.no_grad():
        logits = engine(input_ids=input_ids).logits  # ZeRO-3 forward: every rank takes part
    max_diff = None
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            max_diff = (loaded(input_ids=input_ids).logits - logits).abs().max().item()
    return {"keys_ok": keys_ok, "shapes_ok": shapes_ok, "keys": sorted(state), "ref_keys": sorted(reference),
            "max_diff": max_diff, "files": sorted(os.listdir(out_dir))}


def _zero3_suite_worker(rank: int, world_size: int, out_dir: str) -> dict:
    """The ZeRO-3 scenarios share one spawn: importing deepspeed + transformers dominates their cost."""
    import traceback

    results = {}
    for name, worker, args in (("hf", _hf_worker, (os.path.join(out_dir, "hf"),)),
                               ("checkpoint", _checkpoint_worker, (os.path.join(out_dir, "ckpt"),)),
                               ("frozen", _frozen_worker, ()),
                               ("lr", _lr_worker, ())):
        try:
            results[name] = worker(rank, world_size, *args)
        except Exception:  # report per scenario; a failure inside a collective still times out the run
            results[name] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def zero3_suite(tmp_path_factory):
    return run_on_ranks(_zero3_suite_worker, 2, str(tmp_path_factory.mktemp("zero3")))


def _scenario(suite: list[dict], name: str) -> list[dict]:
    for rank, res in enumerate(suite):
        if "error" in res[name]:
            pytest.fail(f"rank {rank} failed in {name}:\n{res[name]['error']}")
    return [res[name] for res in suite]


@pytest.mark.slow
def test_gathered_state_dict_and_save_hf(zero3_suite):
    results = _scenario(zero3_suite, "hf")
    for res in results:
        assert res["keys_ok"], (res["keys"], res["ref_keys"])
        assert res["shapes_ok"]
    assert "model.safetensors" in results[0]["files"] and "config.json" in results[0]["files"]
    assert results[0]["max_diff"] < 1e-5


def _checkpoint_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    def one_step(engine, seed):
        engine.backward(_loss(engine, _batch(seed + rank)))
        return engine.step()

    # min_lr_ratio < 1 makes the LR differ per step, so the scheduler state must be restored too.
    first = _train_engine(3, train_batch_size=2, steps=4, min_lr_ratio=0.1)
    one_step(first, 1)
    first.save_checkpoint(ckpt_dir, tag="step1", client_state={"step": 1, "rank": rank})
    lr_expected = one_step(first, 2)["lr"]
    expected = _gathered(first)

    second = _train_engine(3, train_batch_size=2, steps=4, min_lr_ratio=0.1)
    client_state = second.load_checkpoint(ckpt_dir, tag="step1")
    lr_resumed = one_step(second, 2)["lr"]
    resumed = _gathered(second)
    max_diff = max((expected[k] - resumed[k]).abs().max().item() for k in expected)
    return {"client_state": dict(client_state), "max_diff": max_diff, "lr": (lr_expected, lr_resumed),
            "global_steps": second.global_steps}


@pytest.mark.slow
def test_checkpoint_round_trip_restores_weights_optimizer_and_schedule(zero3_suite):
    results = _scenario(zero3_suite, "checkpoint")
    for rank, res in enumerate(results):
        assert res["client_state"]["step"] == 1 and res["client_state"]["rank"] == rank
        assert res["lr"][0] == pytest.approx(res["lr"][1]) and res["lr"][0] < 1e-2
        assert res["max_diff"] < 1e-6, res["max_diff"]
        assert res["global_steps"] == 2


LR_PEAK, LR_TOTAL, LR_WARMUP_RATIO, LR_FLOOR = 1e-2, 10, 0.25, 0.1


def _lr_worker(rank: int, world_size: int) -> dict:
    engine = _train_engine(3, train_batch_size=2, steps=LR_TOTAL, lr=LR_PEAK, min_lr_ratio=LR_FLOOR,
                           warmup_ratio=LR_WARMUP_RATIO)
    used = []
    for step in range(LR_TOTAL):  # train 2 / (micro 1 x dp 2): every step() is an optimizer step
        engine.backward(_loss(engine, _batch(step + 10 * rank)))
        used.append(engine.step()["lr"])
    return {"used": used, "after_last": float(engine.engine.get_lr()[0])}


@pytest.mark.slow
def test_lr_schedule_warmup_then_cosine_to_floor(zero3_suite):
    warmup = math.ceil(LR_TOTAL * LR_WARMUP_RATIO)  # 3: the ceiling, not 2.5 rounded down

    def expected(step: int) -> float:
        if step < warmup:
            return LR_PEAK * step / warmup  # linear from 0: the first step runs at LR 0
        progress = (step - warmup) / (LR_TOTAL - warmup)
        return LR_PEAK * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))

    for res in _scenario(zero3_suite, "lr"):
        assert res["used"] == pytest.approx([expected(s) for s in range(LR_TOTAL)], rel=1e-9, abs=1e-15)
        assert res["used"][0] == 0.0 and res["used"][warmup] == pytest.approx(LR_PEAK)
        assert res["after_last"] == pytest.approx(LR_FLOOR * LR_PEAK)  # the floor at the horizon


def _frozen_worker(rank: int, world_size: int) -> dict:
    from hpc_rlhf.training.deepspeed_engine import FrozenEngine

    frozen = FrozenEngine.create(tiny_llama, DeepSpeedConfig(zero_stage=3), RefConfig(offload=True),
                                 micro_batch_size=2, on_gpu=False, extra_ds_config=SHARD_ALL)
    partitioned = all(p.ds_tensor.numel() < p.ds_numel for p in frozen.module.parameters())
    no_grad = not any(p.requires_grad for p in frozen.module.parameters())
    state = _gathered(frozen)
    plain = tiny_llama()
    plain.load_state_dict(state)
    plain.eval()
    input_ids = _batch(11 + rank, batch_size=2)
    out = frozen(input_ids=input_ids).logits
    with torch.no_grad():
        ref = plain(input_ids=input_ids).logits
    return {"partitioned": partitioned, "no_grad": no_grad, "requires_grad_out": out.requires_grad,
            "max_diff": (out - ref).abs().max().item()}


@pytest.mark.slow
def test_frozen_engine_zero3_matches_plain_forward(zero3_suite):
    for res in _scenario(zero3_suite, "frozen"):
        assert res["partitioned"] and res["no_grad"] and not res["requires_grad_out"]
        assert res["max_diff"] < 1e-5, res["max_diff"]


def _subgroup_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    import deepspeed
    import torch.distributed as dist

    world = dist.group.WORLD
    singletons = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    engine = _train_engine(3, train_batch_size=1, dp_group=singletons[rank])  # one dp rank per role
    before = _gathered(engine)
    engine.backward(_loss(engine, _batch(rank)))
    info = engine.step()
    after = _gathered(engine)
    engine.save_checkpoint(ckpt_dir, tag=f"rank{rank}")  # deepspeed barriers on the world: all ranks call
    engine.load_checkpoint(ckpt_dir, tag=f"rank{rank}")
    return {"world_reused": dist.group.WORLD is world and deepspeed.comm.get_world_size() == world_size,
            "dp_world_size": engine.engine.dp_world_size, "grad_norm": info["grad_norm"],
            "changed": all(not torch.equal(before[k], after[k]) for k in before),
            "checksum": sum(v.double().sum().item() for v in after.values())}


@pytest.mark.slow
def test_train_engine_on_a_dp_subgroup(tmp_path):
    """A dp_group smaller than the world goes to DeepSpeed through an mpu; init_distributed reuses our world."""
    results = run_on_ranks(_subgroup_worker, 2, str(tmp_path / "ckpt"))
    for res in results:
        assert res["world_reused"] and res["dp_world_size"] == 1
        assert res["changed"] and res["grad_norm"] > 0
    assert results[0]["checksum"] != results[1]["checksum"]  # independent replicas saw different data


def _one_replica_worker(rank: int, world_size: int) -> dict:
    """ZeRO-2 asked for on one rank: collapsed to stage 0 with no gradient all-reduce at all; two micro-batches
    accumulate, and two optimizer steps must equal plain torch autograd + AdamW on the same data."""
    from hpc_rlhf.training.deepspeed_engine import TrainEngine

    actor = ActorConfig(learning_rate=1e-2, lr_warmup_ratio=0.0, min_lr_ratio=1.0, max_norm=1e6)
    engine = TrainEngine.create(tiny_llama, DeepSpeedConfig(zero_stage=2), actor, train_batch_size=2,
                                micro_train_batch_size=1, num_training_steps=2, on_gpu=False)
    reference = tiny_llama()
    betas = tuple(engine.engine.optimizer.defaults["betas"])
    eps = engine.engine.optimizer.defaults["eps"]
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=betas, eps=eps, weight_decay=0.0)
    engine.train()
    norms, reference_norms = [], []
    for step in range(2):
        batches = [_batch(10 * step + i) for i in range(2)]
        for input_ids in batches:
            # A loss computed from the outputs, as every trainer's is: DeepSpeed 0.19.8 divides by the
            # accumulation steps anyway when the tensor passed to backward() is itself a forward output.
            engine.backward(_loss(engine, input_ids) * 1.0)
            info = engine.step()
        norms.append(info["grad_norm"])
        sum(reference(input_ids=ids, labels=ids).loss for ids in batches).backward()
        reference_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])))
        plain.step()
        plain.zero_grad()
    ours = _gathered(engine)
    theirs = reference.state_dict()
    return {"allreduce": engine.engine.enable_backward_allreduce, "zero_stage": engine.zero_stage,
            "norms": norms, "reference_norms": reference_norms,
            "max_diff": max(float((ours[k] - theirs[k]).abs().max()) for k in ours)}


@pytest.mark.slow
def test_one_replica_skips_the_gradient_allreduce_and_matches_plain_torch():
    (res,) = run_on_ranks(_one_replica_worker, 1)
    assert res["zero_stage"] == 0 and res["allreduce"] is False
    assert res["max_diff"] < 1e-5, res
    assert res["norms"] == pytest.approx(res["reference_norms"], rel=1e-5)
