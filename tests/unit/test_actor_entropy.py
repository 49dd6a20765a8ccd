"""The actor update logs the policy entropy every step (the exact token mean of each mini-batch), and keeps it out
of the loss and its gradient unless ``algo.entropy_loss_coef`` > 0."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_rlhf.config import load_config
from hpc_rlhf.models.forward import policy_logprobs
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.step_batch import StepBatch, TrainShard
from hpc_rlhf.trainers.rl.workers import TRAIN_FIELDS, UpdateSettings, train_actor

PROMPT_AND_RESPONSE_LENGTHS = [(2, 3), (4, 1), (1, 5), (3, 2)]


class _Engine:
    """What ``train_actor`` uses of a training engine, around a plain model: one rank, backward accumulates
    gradients, the step changes nothing (so every micro-batch sees the same weights)."""

    dp_group = None
    device = torch.device("cpu")

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self) -> dict:
        return {"lr": 0.0, "grad_norm": None}


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5)
    return LlamaForCausalLM(config).float()


def _shard() -> TrainShard:
    """Two mini-batches of two rows; zero advantages, so the policy loss has exactly zero gradient."""
    trajectories = [Trajectory(prompt="p", label=None, prompt_ids=list(range(1, 1 + p)),
                               response_ids=list(range(10, 10 + r)), action_mask=[1] * r, rollout_logprobs=[0.0] * r)
                    for p, r in PROMPT_AND_RESPONSE_LENGTHS]
    batch = StepBatch.from_trajectories(trajectories, 0, scored=False)
    batch.advantages = torch.zeros(batch.action_mask.shape)
    tokens = batch.action_mask.sum(dim=1).tolist()
    return TrainShard(batch.select(*TRAIN_FIELDS["actor"]), rows_per_minibatch=2,
                      num_tokens=[tokens[0] + tokens[1], tokens[2] + tokens[3]], num_seqs=[2, 2])


def _expected_entropy(model: torch.nn.Module, shard: TrainShard) -> float:
    """Mean over the mini-batches of the token-mean entropy of their action tokens, from one unsplit forward."""
    rows = shard.rows
    with torch.no_grad():
        _, entropy = policy_logprobs(model, rows.sequences, rows.attention_mask, rows.action_mask.shape[1],
                                     with_entropy=True)
    means = [entropy[shard.minibatch(k)][rows.action_mask[shard.minibatch(k)]].mean() for k in range(2)]
    return float(sum(means) / 2)


# The logged entropy is a token mean whatever the loss aggregation (rows of unequal lengths tell them apart).
@pytest.mark.parametrize("coef,loss_agg_mode", [(0.0, "token_mean"), (0.5, "seq_mean_token_mean")])
def test_entropy_is_logged_every_step_and_enters_the_gradient_only_with_a_coefficient(coef, loss_agg_mode):
    cfg = load_config(None, ["train.micro_train_batch_size=1", f"algo.entropy_loss_coef={coef}",
                             f"algo.loss_agg_mode={loss_agg_mode}"])
    settings = UpdateSettings.from_sections(cfg.train, cfg.rollout, cfg.ds)
    model, shard = _model(), _shard()
    expected = _expected_entropy(model, shard)
    stats = train_actor(_Engine(model), shard, cfg.algo, settings, dp_size=1)
    # Four micro-batches of one row: their shares add up to each mini-batch's exact token mean.
    assert stats["entropy"] == pytest.approx(expected, rel=1e-5)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if coef == 0.0:  # zero advantages and no entropy term: nothing to back-propagate
        assert all(not g.any() for g in grads)
    else:  # the entropy bonus is the only term with a gradient
        assert grads and any(g.any() for g in grads)
