"""Pure RL math over tensors: advantages, KL, losses, aggregation, corrections, filtering, MoE routing stats.

Imports only torch. Nothing here touches ``torch.distributed``: functions
take counts (global token count, dp size) as arguments instead.
"""

from hpc_rlhf.algos.advantages import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    dr_grpo_rewards,
    gae_advantages,
    group_norm_rewards,
    last_action_index,
    reinforce_baseline_rewards,
    rloo_rewards,
    token_level_rewards,
)
from hpc_rlhf.algos.aggregation import AGGREGATION_MODES, aggregate_loss, count_tokens_and_seqs, token_share
from hpc_rlhf.algos.controllers import (
    AdaptiveKLController,
    FixedKLController,
    RunningRewardNormalizer,
)
from hpc_rlhf.algos.corrections import CORRECTION_MODES, rollout_importance_weights, rollout_mismatch_kl
from hpc_rlhf.algos.distillation import distill_advantages, reverse_kl_metrics
from hpc_rlhf.algos.episodes import (
    check_episode_index,
    episode_index_from_branches,
    episode_means,
    expand_to_rows,
)
from hpc_rlhf.algos.filtering import dynamic_filter_mask, overlong_penalty
from hpc_rlhf.algos.kl import KL_ESTIMATORS, kl_estimate
from hpc_rlhf.algos.losses import (
    POLICY_LOSS_TYPES,
    entropy_from_logits,
    policy_loss,
    total_loss,
    value_loss,
)
from hpc_rlhf.algos.masking import fill_masked, masked_mean, masked_sum, masked_whiten
from hpc_rlhf.algos.moe import route_mismatch, routing_stats
from hpc_rlhf.algos.pass_at_k import pass_at_k, powers_of_two_up_to

__all__ = [
    "AGGREGATION_MODES",
    "CORRECTION_MODES",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSS_TYPES",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningRewardNormalizer",
    "aggregate_loss",
    "check_episode_index",
    "compute_advantages",
    "count_tokens_and_seqs",
    "discounted_returns",
    "distill_advantages",
    "dr_grpo_rewards",
    "dynamic_filter_mask",
    "entropy_from_logits",
    "episode_index_from_branches",
    "episode_means",
    "expand_to_rows",
    "fill_masked",
    "gae_advantages",
    "group_norm_rewards",
    "kl_estimate",
    "last_action_index",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "pass_at_k",
    "policy_loss",
    "powers_of_two_up_to",
    "reinforce_baseline_rewards",
    "reverse_kl_metrics",
    "rloo_rewards",
    "rollout_importance_weights",
    "rollout_mismatch_kl",
    "route_mismatch",
    "routing_stats",
    "token_level_rewards",
    "token_share",
    "total_loss",
    "value_loss",
]
