"""Per-token policy / value losses, entropy, and the total-loss combiner.

Losses here are per token, shape (B, T), 0 on masked positions; turn them
into a scalar with :func:`hpc_rlhf.algos.aggregation.aggregate_loss` so the
micro-batch / data-parallel contract holds. Sign convention: losses are
minimised, so a positive advantage makes ``logprobs`` go up.

Stats are detached scalars over the *local* micro-batch, for logging only.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.masking import as_bool_mask, fill_masked, masked_mean

POLICY_LOSS_TYPES = ("ppo", "gspo", "cispo", "sapo")
# SAPO's gate counts a token as gated when its gradient weight 4 s (1 - s) (1 at r = 1) fell below this.
SAPO_GATED_BELOW = 0.5

# OpenRLHF's PolicyLoss clamps the PPO log-ratio to +-20 before exp: exp(20) ~ 5e8 is far outside any clip
# band, so a clamped token's surrogate is clipped (or dual-clipped, or multiplied by A = 0) and gets zero
# gradient, whereas exp(100) = inf turns that same token's gradient into inf * 0 = nan.
MAX_ABS_LOG_RATIO = 20.0


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1): masked mean of the log-ratio per row (0 for empty rows)."""
    return masked_mean(log_ratio, mask, dim=1).unsqueeze(1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    loss_type: str = "ppo",
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped (or gated) surrogate policy loss, per token.

    ``ppo``: token ratio ``r_t = exp(logprobs - old_logprobs)``,
    ``loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)``
    (Schulman et al. 2017, arXiv:1707.06347). ``clip_eps_high > clip_eps_low`` is
    DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476).

    ``gspo``: sequence ratio ``s_i = exp(mean_t (logprobs - old_logprobs))`` used
    for every token of row i, with GSPO-token's gradient
    ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (Zheng et al. 2025,
    arXiv:2507.18071). Aggregate with ``seq_mean_token_mean`` to get the paper's
    objective; the GSPO paper uses eps of order 3e-4 / 4e-4.

    ``cispo`` (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the clipped importance ratio, stop-gradient:
    ``loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)``. Unlike PPO's clip, a token whose
    ratio left the band keeps its gradient ``clip(r_t) A_t`` (only its weight is capped), so rare tokens that
    move fast still learn. MiniMax-M1 keeps no lower bound (``eps_low`` 1 or more) and tunes ``eps_high``.

    ``sapo`` (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv:2511.20347): a smooth, temperature-gated
    trust region instead of the hard clip: ``loss_t = -(4 / tau) sigmoid(tau (r_t - 1)) A_t`` with
    ``tau = sapo_tau_pos`` where ``A_t > 0`` and ``sapo_tau_neg`` elsewhere (paper: 1.0 and 1.05). Its gradient is
    ``-4 s (1 - s) r_t A_t grad log pi`` with ``s = sigmoid(tau (r_t - 1))``: the policy gradient itself at
    ``r_t = 1``, smoothly fading as the ratio moves away (faster for negative advantages). The clip band is not
    used.

    Dual clip (``ppo`` / ``gspo`` only; Ye et al. 2020, arXiv:1912.09729): for ``A_t < 0`` the loss is capped
    at ``-dual_clip * A_t`` so a huge ratio on a bad token cannot dominate.

    The token log-ratio (``ppo``) and the sequence log-ratio (``gspo``) are clamped to
    ``[-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO]`` before ``exp``, as OpenRLHF does for ``ppo`` (its
    ``gspo`` does not clamp; the same bound is used here so one diverged row cannot give NaN either).
    Inside the bound nothing changes; a token beyond it contributes a finite loss and zero gradient.

    Args:
        logprobs: (B, T) current policy log-probs (carries the gradient).
        old_logprobs: (B, T) log-probs of the rollout policy, recomputed by the trainer.
        advantages: (B, T).
        action_mask: (B, T) bool.
        loss_type: ``ppo`` | ``gspo`` | ``cispo`` | ``sapo``.
        clip_eps_low, clip_eps_high: ratio band ``[1 - low, 1 + high]``; high defaults to low.
        dual_clip: constant c > 1, or None.
        importance_weights: (B, T) rollout/trainer mismatch weights (see
            ``hpc_rlhf.algos.corrections``) multiplied into the loss; detached here.
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for positive / other advantages.
    Returns:
        ``(loss (B, T) fp32, stats)`` with stats ``clip_fraction`` (fraction of
        action tokens whose surrogate is clipped; ``cispo``: whose weight is capped), ``dual_clip_fraction``,
        ``sapo``: ``gate_fraction`` (tokens whose gradient weight ``4 s (1 - s)`` fell below
        :data:`SAPO_GATED_BELOW`) and ``gate_weight_mean``,
        ``ppo_kl_k1`` (masked mean of ``old_logprobs - logprobs``: OpenRLHF's ``ppo_kl``),
        ``ppo_kl_k3`` (k3 of the same, on the clamped log-ratio), ``ratio_mean``.
    """
    if loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(
            f"unknown policy loss_type {loss_type!r}; choose one of {POLICY_LOSS_TYPES}"
        )
    if clip_eps_high is None:
        clip_eps_high = clip_eps_low
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if dual_clip is not None and loss_type in ("cispo", "sapo"):
        raise ValueError(f"algo.dual_clip applies to the ppo and gspo losses, not to {loss_type}")
    if loss_type == "sapo" and min(sapo_tau_pos, sapo_tau_neg) <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got {sapo_tau_pos} and {sapo_tau_neg}")
    mask = as_bool_mask(action_mask)
    logprobs = fill_masked(logprobs.float(), mask)
    old_logprobs = fill_masked(old_logprobs.float(), mask)
    advantages = fill_masked(advantages.float(), mask)
    raw_log_ratio = logprobs - old_logprobs
    log_ratio = raw_log_ratio.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    if loss_type in ("cispo", "sapo"):
        loss, stats = _cispo_or_sapo(loss_type, logprobs, log_ratio, advantages, mask, clip_eps_low, clip_eps_high,
                                     sapo_tau_pos, sapo_tau_neg)
        if importance_weights is not None:
            loss = loss * fill_masked(importance_weights.detach().float(), mask)
        with torch.no_grad():
            stats.update(_ratio_stats(raw_log_ratio, log_ratio, mask))
        return fill_masked(loss, mask), stats

    if loss_type == "ppo":
        ratio = torch.exp(log_ratio)
    else:
        seq_log_ratio = _sequence_log_ratio(raw_log_ratio, mask).detach()
        seq_log_ratio = seq_log_ratio.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
        # Value equals s_i; d/dlogprobs_t = s_i (token-level gradient of GSPO-token).
        ratio = torch.exp(seq_log_ratio + logprobs - logprobs.detach())

    surrogate = ratio * advantages
    clipped_surrogate = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    objective = torch.minimum(surrogate, clipped_surrogate)
    is_dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        is_dual_clipped = (advantages < 0) & (dual_clip * advantages > objective)
        capped = torch.maximum(objective, dual_clip * advantages)
        objective = torch.where(advantages < 0, capped, objective)
    loss = -objective
    if importance_weights is not None:
        loss = loss * fill_masked(importance_weights.detach().float(), mask)
    loss = fill_masked(loss, mask)

    with torch.no_grad():
        is_clipped = clipped_surrogate < surrogate
        stats = {
            "clip_fraction": masked_mean(is_clipped.float(), mask),
            "dual_clip_fraction": masked_mean(is_dual_clipped.float(), mask),
            **_ratio_stats(raw_log_ratio, log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def _ratio_stats(raw_log_ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL of the update so far, by estimator: OpenRLHF logs k1 as ``ppo_kl``; k3 is the lower-variance one."""
    return {"ppo_kl_k1": masked_mean(-raw_log_ratio, mask),
            "ppo_kl_k3": masked_mean(torch.expm1(-log_ratio) + log_ratio, mask)}


def _cispo_or_sapo(loss_type: str, logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, clip_eps_low: float, clip_eps_high: float, tau_pos: float, tau_neg: float,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token CISPO or SAPO loss (B, T) (:func:`policy_loss` has the formulas) and its own stats.
    ``log_ratio``: the clamped ``logprobs - old_logprobs``, carrying the gradient."""
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        weight = ratio.detach().clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
        loss = -weight * advantages * logprobs
        with torch.no_grad():
            capped = (ratio < 1.0 - clip_eps_low) | (ratio > 1.0 + clip_eps_high)
            stats = {"clip_fraction": masked_mean(capped.float(), mask), "ratio_mean": masked_mean(ratio, mask)}
        return loss, stats
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * advantages
    with torch.no_grad():
        weight = 4.0 * gate * (1.0 - gate)  # d loss / d r = -weight * A: 1 at r = 1
        stats = {"gate_fraction": masked_mean((weight < SAPO_GATED_BELOW).float(), mask),
                 "gate_weight_mean": masked_mean(weight, mask), "ratio_mean": masked_mean(ratio, mask)}
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    value_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token critic loss ``0.5 * (V - R)^2``, optionally PPO-clipped.

    With ``value_clip = c``: ``V_clip = old_V + clamp(V - old_V, -c, c)`` and
    ``loss = 0.5 * max((V - R)^2, (V_clip - R)^2)`` (the pessimistic PPO2 value
    clipping of OpenAI baselines; Andrychowicz et al. 2020, arXiv:2006.05990, §3.2).

    Args:
        values: (B, T) current critic values (carries the gradient).
        old_values: (B, T) values at rollout time.
        returns: (B, T) value targets (from GAE).
        action_mask: (B, T) bool.
        value_clip: c, or None for the unclipped loss.
    Returns:
        ``(loss (B, T) fp32, stats)`` with ``value_clip_fraction``.
    """
    mask = as_bool_mask(action_mask)
    values = fill_masked(values.float(), mask)
    old_values = fill_masked(old_values.float(), mask)
    returns = fill_masked(returns.float(), mask)
    squared_error = (values - returns).square()
    is_clipped = torch.zeros_like(mask)
    if value_clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (clipped_values - returns).square()
        is_clipped = clipped_error > squared_error
        squared_error = torch.maximum(squared_error, clipped_error)
    loss = fill_masked(0.5 * squared_error, mask)
    stats = {"value_clip_fraction": masked_mean(is_clipped.float(), mask).detach()}
    return loss, stats


def entropy_from_logits(logits: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the policy's next-token distribution, in fp32.

    ``H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_{t,v}``.

    Args:
        logits: (B, T, V), already aligned so ``logits[:, t]`` predicts action token t.
        action_mask: (B, T) bool.
    Returns:
        (B, T) fp32 entropy, 0 on masked positions. Maximise it (an entropy bonus)
        by subtracting ``entropy_coef * aggregate_loss(entropy, ...)`` from the loss,
        see :func:`total_loss`.
    """
    mask = as_bool_mask(action_mask)
    logits = fill_masked(logits.float(), mask.unsqueeze(-1))
    log_z = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(dim=-1)
    return fill_masked(entropy, mask)


def total_loss(
    pg_loss: torch.Tensor,
    *,
    kl_loss: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    aux_loss: torch.Tensor | None = None,
    aux_loss_coef: float = 0.0,
    aux_weight: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Scalar actor loss = policy + kl_coef * KL - entropy_coef * H + aux_loss_coef * w * aux.

    ``pg_loss`` (policy-gradient loss), ``kl_loss`` and ``entropy`` are scalars already produced by
    :func:`aggregate_loss` for this micro-batch, so they obey its sum-over-micro-batches contract.
    ``aux_loss`` is the MoE router load-balancing loss (Fedus et al. 2021, Switch Transformer,
    arXiv:2101.03961), which the model returns as a *mean* over this micro-batch's tokens; ``aux_weight`` =
    ``w`` is the micro-batch's share of its mini-batch (:func:`hpc_rlhf.algos.aggregation.token_share`), so
    that the shares summed over micro-batches and averaged over ranks are the token-weighted mean, as for
    the other terms.
    """
    loss = pg_loss
    if kl_loss is not None and kl_coef != 0.0:
        loss = loss + kl_coef * kl_loss
    if entropy is not None and entropy_coef != 0.0:
        loss = loss - entropy_coef * entropy
    if aux_loss is not None and aux_loss_coef != 0.0:
        loss = loss + aux_loss_coef * aux_weight * aux_loss
    return loss
