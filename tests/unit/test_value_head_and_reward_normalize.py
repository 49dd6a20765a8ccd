"""critic/reward.value_head_prefix and reward.normalize reach the loaded models; config refusals name the key."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.models.loading import load_value_model
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.models.value_head import ValueHeadError, read_reward_normalization
from hpc_rlhf.rewards.reward_model import RewardModelRole


@pytest.fixture(scope="module")
def openrlhf_rm(tmp_path_factory):
    """A reward model saved with OpenRLHF's head name ``value_head`` and its reward statistics."""
    root = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(build_tiny_model(root / "tiny"), num_labels=1)
    rm.config.pad_token_id = rm.config.eos_token_id
    path = root / "rm"
    rm.save_pretrained(path)
    (weights_file,) = path.glob("*.safetensors")
    weights = load_file(weights_file)
    head = weights.pop("score.weight")
    weights["value_head.weight"] = head
    save_file(weights, weights_file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "reward_mean": 0.5, "reward_std": 2.0}))
    return path, head


def test_value_head_prefix_loads_the_named_head(openrlhf_rm):
    path, head = openrlhf_rm
    model = load_value_model(str(path), torch.float32, "eager", value_head_prefix="value_head")
    torch.testing.assert_close(model.score.weight, head)
    fresh = load_value_model(str(path), torch.float32, "eager")  # "score": absent, so a fresh head
    assert not torch.equal(fresh.score.weight, head)
    with pytest.raises(ValueHeadError, match=r"no value head head\.weight.*critic\.value_head_prefix"):
        load_value_model(str(path), torch.float32, "eager", value_head_prefix="head", key="critic.value_head_prefix")


def test_reward_model_role_applies_the_stored_statistics(openrlhf_rm):
    path, _ = openrlhf_rm
    model = load_value_model(str(path), torch.float32, "eager", value_head_prefix="value_head").eval()
    shard = {"sequences": torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])}
    raw = RewardModelRole(model, 1).scores(shard)
    normalization = read_reward_normalization(path, "reward.normalize")
    assert normalization == (0.5, 2.0)
    torch.testing.assert_close(RewardModelRole(model, 1, normalization).scores(shard), (raw - 0.5) / 2.0)


def test_missing_statistics_name_the_key(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueHeadError, match="reward.normalize needs reward_mean and reward_std"):
        read_reward_normalization(tmp_path, "reward.normalize")


@pytest.mark.parametrize("overrides,match", [
    (["reward.normalize=true", "reward.reward_func_path=f.py"], "reward.normalize=true"),
    (["reward.normalize=true"], "reward.normalize=true"),
    (["algo.advantage_estimator=rloo", "algo.gamma=0.9"], "algo.gamma=1"),
    (["algo.advantage_estimator=dr_grpo", "rollout.n_samples_per_prompt=1", "rollout.rollout_batch_size=8"],
     "rollout.n_samples_per_prompt >= 2"),
])
def test_config_refuses_keys_that_would_do_nothing(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_discounting_stays_allowed_where_it_means_something():
    assert load_config(None, ["algo.advantage_estimator=reinforce", "algo.gamma=0.9"]).algo.gamma == 0.9
    assert load_config(None, ["algo.advantage_estimator=gae", "algo.gamma=0.9"]).algo.gamma == 0.9
    assert load_config(None, ["reward.normalize=true", "reward.pretrain=/rm"]).reward.normalize


def test_algos_and_config_agree_on_the_group_estimators():
    from hpc_rlhf.algos import GROUP_ESTIMATORS as ALGOS_GROUP
    from hpc_rlhf.config import GROUP_ESTIMATORS as CONFIG_GROUP

    assert set(ALGOS_GROUP) == set(CONFIG_GROUP)
