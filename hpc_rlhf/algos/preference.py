"""Losses of the offline trainers: SFT, pairwise reward model, DPO / cDPO / IPO, KTO. Pure tensor math.

Every function returns *per-unit* losses (per token, per pair or per sample) or a scalar built from
explicit global counts, never calling ``torch.distributed``: the trainers reduce with
:func:`global_mean` (the same exact micro-batch / data-parallel contract as
``hpc_rlhf.algos.aggregation``: ``sum(units of this micro-batch) * dp_size / global_count``; summed over
micro-batches and averaged over ranks it is the mean over the whole step batch).

Conventions: ``*_logps`` are *summed* log-probabilities of the response tokens of each sequence, shape
(B,), fp32; rewards are the implicit rewards ``beta * (logp - ref_logp)`` of DPO / KTO, detached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RM_LOSS_TYPES = ("sigmoid", "logexp")


def global_mean(values: torch.Tensor, global_count: int | float | torch.Tensor, dp_size: int = 1) -> torch.Tensor:
    """Share of a step-mean carried by one micro-batch: ``values.sum() * dp_size / global_count``.

    Args:
        values: (N,) per-unit losses of this micro-batch (units: pairs, samples or masked tokens).
        global_count: units in the whole step batch over all ranks and micro-batches.
        dp_size: ranks whose gradients the engine averages.
    """
    count = torch.as_tensor(global_count, dtype=torch.float32, device=values.device).clamp(min=1)
    return values.float().sum() * dp_size / count


def sft_loss(token_logprobs: torch.Tensor, loss_mask: torch.Tensor, *, global_num_tokens: int | float | None = None,
             dp_size: int = 1) -> torch.Tensor:
    """Token-mean negative log-likelihood (the SFT / pretraining objective).

    Args:
        token_logprobs: (R, T) log-probability of each target token.
        loss_mask: (R, T) bool, True on the tokens trained on (responses; every token in pretraining mode).
        global_num_tokens: trained tokens of the whole step batch; default the local count (one
            micro-batch on one rank only).
    Returns:
        0-dim: ``-sum(logprobs * mask) * dp_size / global_num_tokens``.
    """
    mask = loss_mask.bool()
    nll = torch.where(mask, -token_logprobs.float(), torch.zeros((), device=token_logprobs.device))
    count = mask.sum() if global_num_tokens is None else global_num_tokens
    if global_num_tokens is None and dp_size != 1:
        raise ValueError("sft_loss with dp_size > 1 needs global_num_tokens summed over the dp group")
    return global_mean(nll[mask], count, dp_size) if mask.any() else nll.sum() * 0.0


def pairwise_reward_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                         margin: torch.Tensor | None = None, loss_type: str = "sigmoid") -> torch.Tensor:
    """Bradley-Terry loss of a reward model on preference pairs, per pair: (P,) -> (P,).

    ``sigmoid``: ``-log sigmoid(r_c - r_r - margin)`` (InstructGPT, Ouyang et al. 2022, arXiv:2203.02155;
    the margin as in Llama 2, Touvron et al. 2023, arXiv:2307.09288).
    ``logexp``: ``log(1 + exp(r_r - r_c + margin))``, OpenRLHF's ``LogExpLoss``; the same function written
    as a softplus (kept so recipes ported from OpenRLHF's ``--loss logexp`` run unchanged).
    """
    if loss_type not in RM_LOSS_TYPES:
        raise ValueError(f"unknown reward-model loss {loss_type!r}; choose one of {RM_LOSS_TYPES}")
    diff = chosen_rewards.float() - rejected_rewards.float()
    if margin is not None:
        diff = diff - margin.float()
    if loss_type == "sigmoid":
        return -F.logsigmoid(diff)
    return F.softplus(-diff)


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, *, beta: float,
             label_smoothing: float = 0.0, ipo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290), conservative DPO and IPO, per pair.

    With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (log-ratio difference):

    * DPO: ``-log sigmoid(beta h)``;
    * cDPO (Mitchell 2023, "A note on DPO with noisy preferences"): labels flipped with probability
      ``label_smoothing = eps``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
    * IPO (Azar et al. 2023, arXiv:2310.12036): ``(h - 1 / (2 beta))^2``. IPO is defined on
      *length-averaged* log-probabilities: pass token-mean logps (the DPO trainer does when ``ipo``).

    Args: four (P,) tensors of per-sequence log-probabilities.
    Returns:
        ``(losses (P,), chosen_rewards (P,), rejected_rewards (P,))``; rewards ``beta * (pi - ref)``, detached.
    """
    if ipo and label_smoothing:
        raise ValueError("label_smoothing (cDPO) does not apply to IPO; set one of them")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen_logps.float() - ref_chosen_logps.float()
    rejected_ratio = policy_rejected_logps.float() - ref_rejected_logps.float()
    h = chosen_ratio - rejected_ratio
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * h) * (1.0 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def kto_reference_point(kl_sum: torch.Tensor | float, kl_count: torch.Tensor | float) -> torch.Tensor:
    """KTO's reference point ``z_ref = max(0, mean KL)``, detached.

    ``kl_sum`` / ``kl_count`` are the sum and number of ``logp(y'|x) - ref_logp(y'|x)`` over the step's
    KL pairs, summed over all ranks by the caller (KTO estimates the KL from *mismatched* pairs
    ``(x_i, y_{i+1})`` of the batch, as TRL and OpenRLHF; or, with ``kl_mode=batch_mean``, from the matched
    pairs' own log-ratios).
    """
    kl_sum = torch.as_tensor(kl_sum, dtype=torch.float32)
    count = torch.as_tensor(kl_count, dtype=torch.float32).clamp(min=1)
    return (kl_sum / count).clamp(min=0).detach()


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
             reference_point: torch.Tensor | float, *, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306), per sample.

    With ``r = logp - ref_logp`` and the reference point ``z`` (:func:`kto_reference_point`):
    desirable ``w_d * (1 - sigmoid(beta (r - z)))``, undesirable ``w_u * (1 - sigmoid(beta (z - r)))``.

    Args:
        policy_logps, ref_logps: (N,) summed response log-probabilities.
        desirable: (N,) bool label.
        reference_point: scalar ``z``, detached.
    Returns:
        ``(losses (N,), rewards (N,))`` with ``rewards = beta * r`` detached.
    """
    ratio = policy_logps.float() - ref_logps.float()
    z = torch.as_tensor(reference_point, dtype=ratio.dtype, device=ratio.device)
    desirable = desirable.bool()
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (ratio - z)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (z - ratio)))
    return torch.where(desirable, good, bad), (beta * ratio).detach()
