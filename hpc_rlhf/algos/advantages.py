"""Advantage estimators: GAE, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO, Dr. GRPO.

Shapes: ``B`` rows (= num_prompts * n_samples_per_prompt), ``T`` token positions.
Rows are grouped as consecutive blocks: row ``i`` answers prompt ``i // n``. When an agent episode has
several rows (branches), ``compute_advantages(..., episode_index=...)`` groups episodes instead of rows
(``hpc_rlhf.algos.episodes``).

Conventions shared by every function here:

* ``action_mask`` (B, T) is true on tokens the policy generated. Everything else
  (prompt, padding, tool/environment observations inside a multi-turn sample)
  is *transparent*: it carries no reward, does not discount, does not bootstrap,
  and its output is exactly 0 with zero gradient.
* The scalar reward of a row is credited on its last action token. The per-token
  KL penalty (when folded into the reward) is ``-kl_coef * kl_t`` on every action token.
* Statistics are computed in fp32.
* A prompt group whose rewards are all equal gets a shaped reward of exactly 0 from every group
  estimator (no fp32 residue of ``r - mean``; see ``_zero_constant_groups``).
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.episodes import episode_means, expand_to_rows
from hpc_rlhf.algos.masking import as_bool_mask, fill_masked, masked_whiten

ESTIMATORS = ("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo")

# Which estimators whiten advantages over the batch by default. Follows
# OpenRLHF: PPO/GAE and the REINFORCE++ family whiten; group estimators are
# already normalised within their group.
_WHITEN_BY_DEFAULT = {"gae": True, "reinforce": True, "reinforce_baseline": True}

# Estimators whose baseline is the other samples of the prompt group.
GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")


def _check_group_size(estimator: str, n_samples_per_prompt: int) -> None:
    """A group baseline of one sample is the sample itself: the advantage would be 0 (or 0 / 0)."""
    if n_samples_per_prompt < 2:
        raise ValueError(
            f"{estimator} needs n_samples_per_prompt >= 2 (a baseline from the other samples of the prompt), "
            f"got {n_samples_per_prompt}"
        )


def _grouped(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if n_samples_per_prompt < 1 or rewards.shape[0] % n_samples_per_prompt != 0:
        raise ValueError(
            f"batch size {rewards.shape[0]} is not a multiple of "
            f"n_samples_per_prompt={n_samples_per_prompt}"
        )
    return rewards.float().view(-1, n_samples_per_prompt)


def _zero_constant_groups(shaped: torch.Tensor, grouped: torch.Tensor) -> torch.Tensor:
    """Set the shaped rewards of every constant group to exactly 0.

    A group whose samples all got the same reward carries no signal, but its fp32 mean is rarely
    exactly that reward (0.1, 0.3, 0.7 are not representable), so ``r - mean`` leaves a residue of a few
    ulps, and the std division of ``group_norm`` amplifies it (by ``1 / (std + eps)`` with std ~ 0) into
    advantages of several hundredths. Compare the raw rewards, not the centred ones, so the test is exact.

    Args:
        shaped: (G, n) shaped rewards of G groups of n samples.
        grouped: (G, n) the raw rewards they were computed from.
    Returns:
        (G, n) ``shaped`` with the rows of constant groups replaced by 0.
    """
    constant = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(shaped), shaped)


def last_action_index(action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last action token per row.

    Args:
        action_mask: (B, T) bool.
    Returns:
        ``(index (B,) int64, has_action (B,) bool)``; index is 0 where a row has no action.
    """
    mask = as_bool_mask(action_mask)
    num_positions = mask.shape[1]
    from_end = torch.flip(mask, dims=[1]).to(torch.int64).argmax(dim=1)
    has_action = mask.any(dim=1)
    index = torch.where(has_action, num_positions - 1 - from_end, torch.zeros_like(from_end))
    return index, has_action


def token_level_rewards(
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Spread scalar rewards over tokens, optionally with the KL penalty folded in.

    ``r_t = -kl_coef * kl_t`` on every action token, plus ``rewards[b]`` on the last
    action token (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences";
    Ouyang et al. 2022, InstructGPT).

    Args:
        rewards: (B,) scalar sequence rewards.
        action_mask: (B, T) bool.
        kl: (B, T) per-token KL estimate (see ``hpc_rlhf.algos.kl``), or None.
        kl_coef: penalty coefficient (beta). Ignored when ``kl`` is None.
    Returns:
        (B, T) fp32 per-token rewards, 0 on masked positions.
    """
    mask = as_bool_mask(action_mask)
    index, has_action = last_action_index(mask)
    positions = torch.arange(mask.shape[1], device=mask.device)
    is_last = (positions.unsqueeze(0) == index.unsqueeze(1)) & has_action.unsqueeze(1)
    token_rewards = torch.where(is_last, rewards.float().unsqueeze(1), 0.0)
    if kl is not None and kl_coef != 0.0:
        token_rewards = token_rewards - kl_coef * fill_masked(kl.float(), mask)
    return fill_masked(token_rewards, mask)


def discounted_returns(
    token_rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t'}`` over action tokens (t' = next action token).

    Masked positions are skipped (no discount across them), so an environment
    observation between two turns does not shrink the return.

    Args:
        token_rewards: (B, T).
        action_mask: (B, T) bool.
        gamma: discount factor.
    Returns:
        (B, T) fp32 returns, 0 on masked positions.
    """
    mask = as_bool_mask(action_mask)
    token_rewards = fill_masked(token_rewards.float(), mask)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    returns: list[torch.Tensor] = []  # filled from the last position backwards
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns.append(torch.where(mask[:, t], running, 0.0))
    if not returns:
        return token_rewards
    return torch.stack(returns[::-1], dim=1)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lambd: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_{t'} - V_t`` with ``t'`` the next action token
    (``V = 0`` after the last one), ``A_t = delta_t + gamma * lambd * A_{t'}``.
    With ``gamma = lambd = 1``: ``A_t = sum_{s >= t} r_s - V_t`` (Monte-Carlo minus value).

    Args:
        token_rewards: (B, T), e.g. from :func:`token_level_rewards`.
        values: (B, T) critic values of the rollout (treated as constants by callers).
        action_mask: (B, T) bool.
    Returns:
        ``(advantages, returns)`` both (B, T) fp32; ``returns = advantages + values``
        on action tokens (the critic's regression target), 0 elsewhere.
    """
    mask = as_bool_mask(action_mask)
    token_rewards = fill_masked(token_rewards.float(), mask)
    values = fill_masked(values.float(), mask)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    advantages: list[torch.Tensor] = []  # filled from the last position backwards
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        next_advantage = torch.where(m, advantage, next_advantage)
        next_value = torch.where(m, values[:, t], next_value)
        advantages.append(torch.where(m, advantage, 0.0))
    if not advantages:
        return values, values
    advantages_t = torch.stack(advantages[::-1], dim=1)
    returns = fill_masked(advantages_t + values, mask)
    return advantages_t, returns


def reinforce_baseline_rewards(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """REINFORCE++-baseline shaping: ``r - mean(r of the prompt group)``.

    Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262). (B,) -> (B,) fp32. Needs
    ``n_samples_per_prompt >= 2``.
    """
    _check_group_size("reinforce_baseline", n_samples_per_prompt)
    grouped = _grouped(rewards, n_samples_per_prompt)
    return _zero_constant_groups(grouped - grouped.mean(dim=1, keepdim=True), grouped).view(-1)


def rloo_rewards(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """RLOO shaping: ``r_i - mean_{j != i} r_j`` within each prompt group.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback" (arXiv:2402.14740); Kool et al. 2019.
    (B,) -> (B,) fp32. Needs ``n_samples_per_prompt >= 2``.
    """
    _check_group_size("rloo", n_samples_per_prompt)
    grouped = _grouped(rewards, n_samples_per_prompt)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (n_samples_per_prompt - 1)
    return _zero_constant_groups(grouped - baseline, grouped).view(-1)


def group_norm_rewards(
    rewards: torch.Tensor,
    n_samples_per_prompt: int,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO shaping: ``(r - mean_group) / (std_group + eps)``.

    Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300). The std is the unbiased
    sample std (as in TRL and OpenRLHF). ``norm_by_std=False`` gives Dr. GRPO.
    (B,) -> (B,) fp32. Needs ``n_samples_per_prompt >= 2``.
    """
    _check_group_size("group_norm" if norm_by_std else "dr_grpo", n_samples_per_prompt)
    grouped = _grouped(rewards, n_samples_per_prompt)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return _zero_constant_groups(centred, grouped).view(-1)


def dr_grpo_rewards(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """Dr. GRPO shaping: ``r - mean_group`` (no std division).

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783). Pair with the ``seq_mean_token_sum_norm`` aggregation.
    (B,) -> (B,) fp32. Needs ``n_samples_per_prompt >= 2``.
    """
    return group_norm_rewards(rewards, n_samples_per_prompt, norm_by_std=False)


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    n_samples_per_prompt: int = 1,
    *,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 0.95,
    reward_clip_range: tuple[float, float] | None = None,
    norm_adv_by_std: bool = True,
    whiten: bool | None = None,
    eps: float = 1e-6,
    episode_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns for the whole rollout batch, estimator chosen by name.

    Pipeline: estimator-specific scalar shaping (group baselines) -> clip the
    (shaped) scalar rewards -> per-token rewards (scalar on the last action token, ``-kl_coef * kl``
    on every action token when ``kl`` is given) -> GAE (``gae``) or discounted
    reward-to-go (all others) -> optional batch whitening.

    The clip comes after shaping, as in OpenRLHF (``compute_reward`` clamps the
    reward its group shaping produced); for ``gae`` / ``reinforce`` there is no
    shaping and it clips the raw reward.

    Group estimators need ``n_samples_per_prompt >= 2`` and ``gamma = 1``: their
    baseline is a sequence-level reward, which a discount would shrink toward the
    start of the response (OpenRLHF forces gamma to 1 for them; this refuses instead).
    With ``kl=None`` (KL as a separate loss term) they give every action token of a
    row the same, sequence-level advantage.

    Args:
        estimator: one of ``ESTIMATORS``.
        rewards: (B,) scalar rewards, B = num_prompts * n_samples_per_prompt,
            rows of one prompt consecutive.
        action_mask: (B, T) bool.
        n_samples_per_prompt: group size n.
        values: (B, T) critic values, required for ``gae``.
        kl: (B, T) per-token KL to fold into the reward; None keeps it out.
        kl_coef: beta for the folded KL.
        gamma, lambd: discount and GAE lambda.
        reward_clip_range: ``(low, high)`` clamp on scalar rewards, after group shaping.
        norm_adv_by_std: ``group_norm`` only; False gives Dr. GRPO.
        whiten: batch-whiten advantages; default True for gae / reinforce /
            reinforce_baseline, False otherwise. Whitening is over the batch
            passed in, so pass the global rollout batch, not a dp shard.
        eps: std epsilon for ``group_norm``.
        episode_index: (B,) episode of each row when an episode has several rows (a branching agent, see
            ``hpc_rlhf.algos.episodes``); episodes of one prompt consecutive, ``n_samples_per_prompt`` of them
            per prompt. The scalar shaping and clip run on one reward per episode (the mean of its rows), and
            every row gets its episode's shaped reward; the per-token part (KL, GAE, discounting, whitening)
            then runs per row, each row a sequence ending with that reward. None: one row per episode.
    Returns:
        ``(advantages, returns)``: (B, T) fp32, 0 on masked positions. For ``gae``
        ``returns = raw advantages + values`` (the value target); for the others
        the un-whitened discounted returns.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage_estimator {estimator!r}; choose one of {ESTIMATORS}")
    mask = as_bool_mask(action_mask)
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"action_mask must be (B, T) with B = len(rewards) = {rewards.shape[0]}, "
            f"got {tuple(mask.shape)}"
        )
    rewards = rewards.float()
    if estimator in GROUP_ESTIMATORS and gamma != 1.0:
        raise ValueError(f"{estimator} needs gamma = 1 (a sequence-level group baseline), got gamma={gamma}")

    if episode_index is None:
        rewards = _shaped_rewards(estimator, rewards, n_samples_per_prompt, norm_adv_by_std, eps, reward_clip_range)
    else:
        per_episode = episode_means(rewards, episode_index)
        rewards = expand_to_rows(_shaped_rewards(estimator, per_episode, n_samples_per_prompt, norm_adv_by_std,
                                                 eps, reward_clip_range), episode_index)

    token_rewards = token_level_rewards(rewards, mask, kl, kl_coef)
    if estimator == "gae":
        if values is None:
            raise ValueError("advantage_estimator 'gae' needs critic values")
        advantages, returns = gae_advantages(token_rewards, values, mask, gamma, lambd)
    else:
        returns = discounted_returns(token_rewards, mask, gamma)
        advantages = returns

    if whiten is None:
        whiten = _WHITEN_BY_DEFAULT.get(estimator, False)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _shaped_rewards(estimator: str, rewards: torch.Tensor, n_samples_per_prompt: int, norm_adv_by_std: bool,
                    eps: float, reward_clip_range: tuple[float, float] | None) -> torch.Tensor:
    """The estimator's scalar shaping (group baselines), then the clip: (N,) -> (N,) fp32, N = groups x n."""
    if estimator == "reinforce_baseline":
        rewards = reinforce_baseline_rewards(rewards, n_samples_per_prompt)
    elif estimator == "rloo":
        rewards = rloo_rewards(rewards, n_samples_per_prompt)
    elif estimator == "group_norm":
        rewards = group_norm_rewards(rewards, n_samples_per_prompt, norm_adv_by_std, eps)
    elif estimator == "dr_grpo":
        rewards = dr_grpo_rewards(rewards, n_samples_per_prompt)
    else:
        _grouped(rewards, n_samples_per_prompt)  # validates the batch shape only
    if reward_clip_range is not None:
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    return rewards
