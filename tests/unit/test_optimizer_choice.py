"""Which Adam each trained role steps with (``hpc_rlhf.training.optimizer_choice``) and how the DeepSpeed
config carries it. Pure: no process group, no deepspeed engine."""

from __future__ import annotations

import pytest

from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig
from hpc_rlhf.training.deepspeed_engine import build_ds_config
from hpc_rlhf.training.optimizer_choice import adam_implementation, optimizer_offloaded


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


def _optimizer_params(on_gpu: bool, stage: int, adam_offload: bool, dp_size: int = 2) -> dict:
    config = build_ds_config(DeepSpeedConfig(zero_stage=stage, adam_offload=adam_offload), ActorConfig(),
                             train_batch_size=8, micro_train_batch_size=1, dp_size=dp_size, on_gpu=on_gpu)
    return config["optimizer"]["params"]


def test_ds_config_uses_torch_fused_adamw_on_gpu_unless_offloaded_or_zero3():
    for stage in (0, 1, 2):
        params = _optimizer_params(True, stage, adam_offload=False)
        assert params["torch_adam"] is True and params["fused"] is True, stage
    zero3 = _optimizer_params(True, 3, adam_offload=False)
    assert "torch_adam" not in zero3 and "fused" not in zero3  # DeepSpeed then picks its FusedAdam
    offloaded = _optimizer_params(True, 2, adam_offload=True)
    assert "torch_adam" not in offloaded and "fused" not in offloaded  # DeepSpeed then picks DeepSpeedCPUAdam
    # adam_offload at stage 0 offloads nothing (no ZeRO optimizer): torch's fused AdamW again.
    assert _optimizer_params(True, 0, adam_offload=True)["fused"] is True
    cpu = _optimizer_params(False, 2, adam_offload=False)
    assert cpu["torch_adam"] is True and cpu["fused"] is True  # torch has a fused CPU kernel too
