"""Per-token log-probabilities and entropy from logits. Pure tensor functions."""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``.

    Args:
        logits: (B, T, V) any float dtype; computed in fp32.
        labels: (B, T) token ids.
    Returns:
        (B, T) fp32 logprobs.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)

