"""Which Adam each trained role steps with (``hpc_rlhf.training.optimizer_choice``) and how the DeepSpeed
config carries it. Pure: no process group, no deepspeed engine."""

from __future__ import annotations

import pytest

from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig
from hpc_rlhf.training.deepspeed_engine import build_ds_config
from hpc_rlhf.training.optimizer_choice import adam_implementation, arch_list_for_deepspeed, optimizer_offloaded


@pytest.mark.parametrize(("on_gpu", "offloaded", "stage", "name", "params"), [
    (True, False, 0, "torch.optim.AdamW(fused=True)", {"torch_adam": True, "fused": True}),
    (True, False, 2, "torch.optim.AdamW(fused=True)", {"torch_adam": True, "fused": True}),
    (True, False, 3, "DeepSpeed FusedAdam", {}),  # ZeRO-3's offload_states moves only FusedAdam's states
    (False, False, 3, "torch.optim.AdamW(fused=True)", {"torch_adam": True, "fused": True}),
    (False, False, 0, "torch.optim.AdamW(fused=True)", {"torch_adam": True, "fused": True}),
    (True, True, 3, "DeepSpeedCPUAdam", {}),
    (True, True, 2, "DeepSpeedCPUAdam", {}),
    (False, True, 2, "DeepSpeedCPUAdam", {}),
])
def test_adam_implementation(on_gpu, offloaded, stage, name, params):
    adam = adam_implementation(on_gpu=on_gpu, offloaded=offloaded, zero_stage=stage)
    assert (adam.name, adam.ds_params) == (name, params)
    assert adam.name in adam.describe() and adam.reason in adam.describe()


def test_offload_needs_a_zero_optimizer():
    assert optimizer_offloaded(True, 1) and optimizer_offloaded(True, 3)
    assert not optimizer_offloaded(True, 0) and not optimizer_offloaded(False, 2)


def _ds_config(on_gpu: bool, stage: int, adam_offload: bool, dp_size: int = 2, param_dtype: str = "auto") -> dict:
    return build_ds_config(DeepSpeedConfig(zero_stage=stage, adam_offload=adam_offload, param_dtype=param_dtype),
                           ActorConfig(), train_batch_size=8, micro_train_batch_size=1, dp_size=dp_size, on_gpu=on_gpu)


def _optimizer_params(on_gpu: bool, stage: int, adam_offload: bool, dp_size: int = 2, param_dtype: str = "auto") -> dict:
    return _ds_config(on_gpu, stage, adam_offload, dp_size, param_dtype)["optimizer"]["params"]


def test_ds_config_uses_torch_fused_adamw_on_gpu_unless_offloaded_or_zero3():
    for stage in (0, 1, 2):
        params = _optimizer_params(True, stage, adam_offload=False)
        assert params["torch_adam"] is True and params["fused"] is True, stage
    zero3 = _optimizer_params(True, 3, adam_offload=False)
    assert "torch_adam" not in zero3 and "fused" not in zero3  # DeepSpeed then picks its FusedAdam
    offloaded = _optimizer_params(True, 2, adam_offload=True)
    assert "torch_adam" not in offloaded and "fused" not in offloaded  # DeepSpeed then picks DeepSpeedCPUAdam
    # adam_offload at stage 0 in fp32 offloads nothing (no ZeRO optimizer): torch's fused AdamW again.
    assert _optimizer_params(True, 0, adam_offload=True, param_dtype="fp32")["fused"] is True
    cpu = _optimizer_params(False, 2, adam_offload=False)
    assert cpu["torch_adam"] is True and cpu["fused"] is True  # torch has a fused CPU kernel too


@pytest.mark.parametrize("dp_size", [1, 2])
def test_bf16_training_runs_a_zero_optimizer(dp_size):
    """DeepSpeed 0.19 refuses bf16 weights with fp32 gradient accumulation at stage 0 (NotImplementedError "unsupported
    mix of model_dtype", on an H200) and has no offload_states at stage 1 (BF16_Optimizer): bf16 runs stages 0-2 as 2,
    on one replica too; fp32 keeps the one-replica fallback to 0."""
    for stage in (0, 1, 2):
        config = _ds_config(True, stage, adam_offload=False, dp_size=dp_size)
        assert config["bf16"] == {"enabled": True} and config["zero_optimization"]["stage"] == 2, stage
    assert _ds_config(True, 3, adam_offload=False, dp_size=dp_size)["zero_optimization"]["stage"] == 3
    fp32 = _ds_config(True, 2, adam_offload=False, dp_size=dp_size, param_dtype="fp32")
    assert fp32["zero_optimization"]["stage"] == (0 if dp_size == 1 else 2)
    assert _ds_config(False, 2, adam_offload=False, dp_size=1)["zero_optimization"]["stage"] == 0  # CPU: auto is fp32


@pytest.mark.parametrize(("given", "readable"), [
    ("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("8.0 9.0", "8.0;9.0"), ("10.0f", "10.0"),
    ("9.0+PTX", "9.0+PTX"), ("7.5", "7.5"),
])
def test_arch_list_for_deepspeed_drops_architecture_suffixes(given, readable):
    assert arch_list_for_deepspeed(given) == readable
    # What DeepSpeed 0.19's builder does with each entry (ops/op_builder/builder.py, compute_capability_args).
    for entry in arch_list_for_deepspeed(given).split(";"):
        tuple(int(part.split("+")[0]) for part in entry.split("."))
