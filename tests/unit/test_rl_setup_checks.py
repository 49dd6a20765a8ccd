import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.trainers.rl.setup import SetupError, check_supported, optimizer_steps


def test_ring_attention_with_tensor_parallelism_fails_naming_both_keys():
    check_supported(load_config(None, ["ds.ring_attn_size=2"]))
    check_supported(load_config(None, ["ds.tensor_parallel_size=2"]))
    with pytest.raises(SetupError, match="ds.ring_attn_size together with ds.tensor_parallel_size"):
        check_supported(load_config(None, ["ds.ring_attn_size=2", "ds.tensor_parallel_size=2"]))


def test_dynamic_batch_without_a_token_budget_fails_naming_the_key():
    with pytest.raises(ValueError, match="train.max_tokens_per_gpu"):
        load_config(None, ["train.use_dynamic_batch=true"])
    check_supported(load_config(None, ["train.use_dynamic_batch=true", "train.max_tokens_per_gpu=256",
                                       "train.packing_samples=true"]))


def test_default_config_is_supported_and_lr_horizon_counts_optimizer_steps():
    cfg = load_config(None, ["rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
                             "train.train_batch_size=16", "train.max_epochs=2"])
    check_supported(cfg)
    assert optimizer_steps(cfg, num_steps=10) == 10 * 2 * (32 // 16)


def test_trim_padding_keeps_the_forward_identical():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.models.forward import action_logprobs
    from hpc_rlhf.trainers.rl.step_batch import StepBatch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    # Two rows in a batch whose prompt area has 2 all-pad columns and whose response area 3.
    seq = torch.randint(1, 32, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 3:9] = 1  # prompt cols 3..5 (P=6), response 6..8
    mask[1, 2:8] = 1
    action = mask[:, 6:].bool()
    rows = StepBatch(sequences=seq, attention_mask=mask, action_mask=action, advantages=torch.randn(2, 6))
    trimmed = rows.trim_padding()
    assert trimmed.sequences.shape == (2, 7) and trimmed.action_mask.shape == (2, 3)
    assert torch.equal(trimmed.advantages, rows.advantages[:, :3])
    with torch.no_grad():
        full = action_logprobs(model, seq, mask, 6)
        short = action_logprobs(model, trimmed.sequences, trimmed.attention_mask, 3)
    assert torch.allclose(full[:, :3][action[:, :3]], short[trimmed.action_mask], atol=1e-5)


def test_missing_model_folders_fail_naming_the_key(tmp_path):
    from hpc_rlhf.models.loading import load_tokenizer
    from hpc_rlhf.trainers.rl.setup import check_model_paths

    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=f"model.pretrain={missing}: the local path does not exist"):
        load_tokenizer(str(missing), key="model.pretrain")
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(FileNotFoundError, match=f"actor.pretrain={missing}: the local path does not exist"):
        check_model_paths(load_config(None, [f"actor.pretrain={missing}"]))
    with pytest.raises(FileNotFoundError, match=f"ref.pretrain={missing}: the local path does not exist"):
        check_model_paths(load_config(None, [f"actor.pretrain={model}", f"ref.pretrain={missing}"]))
    check_model_paths(load_config(None, [f"actor.pretrain={model}"]))


class _HostsEverything:
    """A colocated rank's view of the world: it hosts every role."""

    @staticmethod
    def has_role(role: str) -> bool:
        return True


@pytest.mark.parametrize("overrides, shares", [
    ([], True),
    (["ds.zero_stage=3"], False),  # partitioned parameters
    (["ds.lora.rank=8"], False),  # generation runs on merged weights
    (["ds.tensor_parallel_size=2"], False),  # AutoTP shards the module
    (["train.colocate_all=false"], False),
    (["rollout.backend=vllm"], False),
])
def test_colocated_transformers_rollout_shares_the_actor_module_only_when_it_is_whole(overrides, shares):
    from hpc_rlhf.trainers.rl.setup import rollout_shares_actor

    assert rollout_shares_actor(load_config(None, overrides), _HostsEverything()) is shares
