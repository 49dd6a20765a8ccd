"""On-policy distillation: a frozen teacher's log-probs of the student's own samples as per-token advantages.

The student samples a response; the teacher scores each sampled token; the advantage of token ``t`` is

    A_t = coef * (log p_teacher(y_t) - log p_student(y_t))

(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
arXiv:2306.13649, GKD with the reverse KL; the per-token form used by Tinker's on-policy distillation, NeMo-RL's
``opd`` and slime's OPD).

Sign: ``log p_student(y_t) - log p_teacher(y_t)`` is the one-sample estimate of the reverse KL
``KL(student || teacher)`` at step ``t`` (``y_t`` drawn from the student), so the advantage is its negative: a
token the teacher finds likelier than the student does is pushed up, one the teacher finds unlikely is pushed
down, and the policy gradient with this advantage descends the reverse KL (mode-seeking: the student learns
to do what the teacher would, where the student goes).

Normalisation: none. Each token's advantage is its own log-ratio, not a sum over the later tokens (discount 0):
the full sequence-level reverse KL's gradient would give token ``t`` the sum of the log-ratios from ``t`` on;
dropping the future terms is what the implementations above do, for a much lower variance. No group baseline
and no whitening either: the log-ratio is already centred where it matters (it is 0 where student and teacher
agree, and its expectation under the student is minus the KL), its scale is the natural unit of a KL in nats, and
whitening over the batch would turn "agrees with the teacher everywhere" (all near 0) into noise of unit size.
``coef`` weighs it against the task reward's advantage when both are used.

Only generated tokens get an advantage: ``action_mask`` is false on prompt, padding and the environment's or
tool's tokens of a multi-turn episode, whose teacher scores are ignored.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.masking import as_bool_mask, fill_masked, masked_mean


def distill_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, action_mask: torch.Tensor,
                       coef: float = 1.0) -> torch.Tensor:
    """Per-token distillation advantages.

    Args:
        teacher_logprobs: (B, T) log p_teacher of each sampled token (same temperature as the student's).
        student_logprobs: (B, T) log p_student of the same tokens (the policy that sampled them).
        action_mask: (B, T) bool: the tokens the student generated.
        coef: weight of the term.
    Returns:
        (B, T) fp32 ``coef * (teacher - student)`` on action tokens, exactly 0 elsewhere.
    """
    if teacher_logprobs.shape != student_logprobs.shape or teacher_logprobs.shape != action_mask.shape:
        raise ValueError(f"teacher_logprobs {tuple(teacher_logprobs.shape)}, student_logprobs "
                         f"{tuple(student_logprobs.shape)} and action_mask {tuple(action_mask.shape)} must be (B, T)")
    mask = as_bool_mask(action_mask)
    gap = fill_masked(teacher_logprobs.float(), mask) - fill_masked(student_logprobs.float(), mask)
    return fill_masked(coef * gap, mask)


def reverse_kl_metrics(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
                       action_mask: torch.Tensor) -> dict[str, float]:
    """What a user watches in a distillation run, token means over action tokens of (B, T) inputs:
    ``reverse_kl`` (the one-sample estimate of KL(student || teacher), falls as the student learns) and
    ``teacher_logprob`` (the teacher's log-prob of the student's tokens, rises toward 0)."""
    mask = as_bool_mask(action_mask)
    gap = fill_masked(student_logprobs.float(), mask) - fill_masked(teacher_logprobs.float(), mask)
    return {"reverse_kl": float(masked_mean(gap, mask)),
            "teacher_logprob": float(masked_mean(teacher_logprobs.float(), mask))}
