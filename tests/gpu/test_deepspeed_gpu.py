"""The training engine on a GPU steps with torch's fused AdamW (no DeepSpeed op compiled, no nvcc needed), except
at ZeRO-3, whose offload_states moves Adam states off the GPU only from DeepSpeed's FusedAdam (built by nvcc)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.multiproc.spawn import _free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's fused AdamW CUDA kernel)"),
]


def _full_state(engine) -> dict[str, torch.Tensor]:
    return {name: t.float().cpu() for bucket in engine.gathered_state_dict_items() for name, t in bucket}


def _fused_adamw_step(rank: int, world_size: int, port: int, stage: int, results) -> None:
    import os

    import torch.distributed as dist
    from deepspeed.ops.op_builder.builder import OpBuilder

    from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig
    from hpc_rlhf.training.deepspeed_engine import TrainEngine
    from tests.multiproc.test_deepspeed_engine import VOCAB, tiny_llama

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed reads it; the launchers set it (world/launch_env.py)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        engine = TrainEngine.create(tiny_llama, DeepSpeedConfig(zero_stage=stage),
                                    ActorConfig(learning_rate=1e-2, lr_warmup_ratio=0.0), train_batch_size=1,
                                    micro_train_batch_size=1, num_training_steps=2, on_gpu=True)
        before = _full_state(engine)
        ids = torch.randint(0, VOCAB, (1, 16), device=engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        optimizer = engine.engine.basic_optimizer
        results[rank] = {
            "optimizer": (type(optimizer).__name__, optimizer.defaults.get("fused")),
            "compiled_ops": sorted(OpBuilder._loaded_ops),
            "changed": sum(not torch.equal(before[n], t) for n, t in _full_state(engine).items()),
            "total": len(before),
        }
    finally:
        dist.destroy_process_group()


def _one_step(stage: int) -> dict:
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_fused_adamw_step, args=(1, _free_port(), stage, results), nprocs=1, join=True)
    return dict(results[0])


def test_train_engine_steps_with_torch_fused_adamw():
    result = _one_step(0)  # on one rank ZeRO 1-2 run as 0
    assert result["optimizer"] == ("AdamW", True)
    assert "fused_adam" not in result["compiled_ops"], result["compiled_ops"]
    assert result["changed"] == result["total"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="ZeRO-3 steps with DeepSpeed's FusedAdam, JIT-built by nvcc")
def test_zero3_engine_steps_with_deepspeed_fused_adam():
    result = _one_step(3)
    assert result["optimizer"][0] == "FusedAdam"
    assert result["changed"] == result["total"]
