import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.trainers.ppo_setup import SetupError, check_supported, optimizer_steps


@pytest.mark.parametrize("override", ["ds.tensor_parallel_size=2", "ds.ring_attn_size=2", "train.packing_samples=true",
                                      "train.use_dynamic_batch=true"])
def test_features_not_in_the_rl_trainer_fail_naming_the_key(override):
    with pytest.raises(SetupError, match=override.split("=")[0]):
        check_supported(load_config(None, [override]))


def test_default_config_is_supported_and_lr_horizon_counts_optimizer_steps():
    cfg = load_config(None, ["rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
                             "train.train_batch_size=16", "train.max_epochs=2"])
    check_supported(cfg)
    assert optimizer_steps(cfg, num_steps=10) == 10 * 2 * (32 // 16)
