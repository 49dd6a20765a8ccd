"""Hand-computed values of the offline losses (SFT, RM, DPO / cDPO / IPO, KTO) and their config tree."""

from __future__ import annotations

import math

import pytest
import torch

from hpc_rlhf.algos.preference import (
    dpo_loss,
    global_mean,
    kto_loss,
    kto_reference_point,
    pairwise_reward_loss,
    sft_loss,
)
from hpc_rlhf.config import ConfigError
from hpc_rlhf.config.supervised import load_supervised_config

LOG1P_EXP_M1 = math.log1p(math.exp(-1.0))  # -log sigmoid(1) = 0.313262
LOG1P_EXP_1 = math.log1p(math.exp(1.0))  # -log sigmoid(-1) = 1.313262


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_global_mean_is_exact_over_micro_batches_and_ranks():
    values = torch.arange(12, dtype=torch.float32)
    dp = 2
    shards = values.view(dp, 3, 2)  # 2 ranks x 3 micro-batches x 2 units
    per_rank = [sum(global_mean(mb, 12, dp) for mb in shards[r]) for r in range(dp)]
    assert sum(per_rank) / dp == pytest.approx(values.mean().item())


def test_sft_loss_is_token_mean_nll_of_masked_tokens():
    logps = t(-1.0, -2.0, -100.0, -3.0).view(1, 4)
    mask = torch.tensor([[True, True, False, True]])
    assert sft_loss(logps, mask).item() == pytest.approx(2.0)
    # The global normaliser counts tokens on other micro-batches / ranks too.
    assert sft_loss(logps, mask, global_num_tokens=6, dp_size=2).item() == pytest.approx(6.0 * 2 / 6)
    with pytest.raises(ValueError, match="global_num_tokens"):
        sft_loss(logps, mask, dp_size=2)


def test_pairwise_reward_loss_sigmoid_margin_and_logexp():
    chosen, rejected = t(1.0, 0.0), t(0.0, 0.0)
    assert pairwise_reward_loss(chosen, rejected).tolist() == pytest.approx([LOG1P_EXP_M1, math.log(2)])
    assert pairwise_reward_loss(chosen, rejected, margin=t(1.0, -1.0)).tolist() == pytest.approx(
        [math.log(2), LOG1P_EXP_M1])
    assert pairwise_reward_loss(chosen, rejected, loss_type="logexp").tolist() == pytest.approx(
        pairwise_reward_loss(chosen, rejected).tolist())
    with pytest.raises(ValueError, match="unknown reward-model loss"):
        pairwise_reward_loss(chosen, rejected, loss_type="hinge")


def test_dpo_cdpo_ipo_hand_values():
    # h = (pi_c - ref_c) - (pi_r - ref_r) = (-1 + 2) - (-3 + 2) = 2; beta = 0.5 -> beta h = 1.
    args = (t(-1.0), t(-3.0), t(-2.0), t(-2.0))
    losses, chosen, rejected = dpo_loss(*args, beta=0.5)
    assert losses.item() == pytest.approx(LOG1P_EXP_M1)
    assert (chosen.item(), rejected.item()) == pytest.approx((0.5, -0.5))
    smoothed, _, _ = dpo_loss(*args, beta=0.5, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * LOG1P_EXP_M1 + 0.1 * LOG1P_EXP_1)
    ipo, _, _ = dpo_loss(*args, beta=0.5, ipo=True)
    assert ipo.item() == pytest.approx((2.0 - 1.0) ** 2)
    with pytest.raises(ValueError, match="IPO"):
        dpo_loss(*args, beta=0.5, ipo=True, label_smoothing=0.1)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    losses, _, _ = dpo_loss(chosen, rejected, t(-2.0), t(-2.0), beta=0.1)
    losses.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()  # descent raises chosen, lowers rejected
    assert losses.item() == pytest.approx(math.log(2))  # policy == reference


def test_kto_hand_values_and_reference_point():
    policy, ref = t(0.0, 0.0), t(-1.0, -1.0)  # log-ratio 1 for both
    losses, rewards = kto_loss(policy, ref, torch.tensor([True, False]), 0.5, beta=2.0, desirable_weight=1.0,
                               undesirable_weight=3.0)
    sig1 = 1 / (1 + math.exp(-1.0))
    assert losses.tolist() == pytest.approx([1 - sig1, 3.0 * (1 - (1 - sig1))])
    assert rewards.tolist() == pytest.approx([2.0, 2.0])
    assert kto_reference_point(t(-4.0).sum(), 2).item() == 0.0  # KL estimate clamped at 0
    assert kto_reference_point(3.0, 2).item() == pytest.approx(1.5)


def test_kto_gradient_direction_follows_the_label():
    policy = torch.zeros(2, requires_grad=True)
    losses, _ = kto_loss(policy, torch.zeros(2), torch.tensor([True, False]), 0.0, beta=0.1)
    losses.sum().backward()
    assert policy.grad[0] < 0 < policy.grad[1]


def test_config_tree_rejects_unknown_keys_and_bad_combinations():
    base = ["model.pretrain=/m", "data.train_data=[/d.jsonl]"]
    cfg = load_supervised_config("dpo", None, [*base, "loss.beta=0.2"])
    assert cfg.loss.beta == 0.2 and cfg.ref.pretrain is None
    with pytest.raises(ConfigError, match=r"loss\.bta: unknown key; allowed here: aux_loss_coef, beta"):
        load_supervised_config("dpo", None, [*base, "loss.bta=0.2"])
    with pytest.raises(ConfigError, match="loss.beta"):
        load_supervised_config("sft", None, [*base, "loss.beta=0.2"])  # SFT has no loss options
    with pytest.raises(ConfigError, match="label_smoothing"):
        load_supervised_config("dpo", None, [*base, "loss.ipo=true", "loss.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="micro_train_batch_size"):
        load_supervised_config("sft", None, [*base, "train.train_batch_size=10", "train.micro_train_batch_size=4"])
    with pytest.raises(ConfigError, match="kl_mode"):
        load_supervised_config("kto", None, [*base, "loss.kl_mode=none"])


@pytest.mark.parametrize("kind,recipe", [("sft", "sft_tiny_cpu"), ("rm", "rm_tiny_cpu"), ("dpo", "dpo_tiny_cpu"),
                                         ("kto", "kto_tiny_cpu"), ("sft", "sft_llama3_8b"), ("dpo", "dpo_llama3_8b")])
def test_recipes_validate(kind, recipe):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = load_supervised_config(kind, root / f"configs/{recipe}.yaml")
    assert cfg.train.packing_samples
    assert bool(cfg.model.build_tiny and cfg.data.synthetic_task) == recipe.endswith("tiny_cpu")
