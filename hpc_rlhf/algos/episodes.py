"""Episodes with several training rows: group statistics per episode, values per row.

An agent episode whose model calls branch (an ``n > 1`` call whose choices are each continued, or a call
that does not extend the previous prompt + output) becomes one training row per branch, all sharing the
episode's reward (as AReaL does). Group estimators (GRPO, RLOO, REINFORCE++-baseline, Dr. GRPO) and DAPO's
dynamic filter are defined over the ``n_samples_per_prompt`` *episodes* of a prompt, so their statistics
are computed on one value per episode (:func:`episode_means`) and the result is handed to every row of the
episode (:func:`expand_to_rows`). With one row per episode (``episode_index = arange(B)``) both are the
identity and nothing changes.

Shapes: ``B`` rows, ``E`` episodes; ``episode_index`` (B,) int64 maps a row to its episode, every
episode ``0 .. E-1`` having at least one row (episodes of one prompt consecutive, as rows are today).
"""

from __future__ import annotations

import torch


def check_episode_index(episode_index: torch.Tensor) -> int:
    """Validate ``episode_index`` (B,) and return ``E``: every value in ``0 .. E-1`` and each one present."""
    if episode_index.dim() != 1 or episode_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"episode_index must be a (B,) integer tensor, got {tuple(episode_index.shape)} "
                         f"{episode_index.dtype}")
    if episode_index.numel() == 0:
        return 0
    if int(episode_index.min()) < 0:
        raise ValueError(f"episode_index has a negative entry {int(episode_index.min())}")
    num_episodes = int(episode_index.max()) + 1
    rows = torch.bincount(episode_index.long(), minlength=num_episodes)
    if bool((rows == 0).any()):
        missing = (rows == 0).nonzero().flatten()[:5].tolist()
        raise ValueError(f"episode_index skips episodes {missing}: every episode 0..{num_episodes - 1} needs a row")
    return num_episodes


def episode_index_from_branches(branch_index: torch.Tensor) -> torch.Tensor:
    """Episode of each row from the rows' ``branch_index`` (B,): an episode's rows are consecutive and its
    first row has branch 0, so a new episode starts at every 0. Returns (B,) int64."""
    if branch_index.numel() and int(branch_index[0]) != 0:
        raise ValueError(f"the first row must start an episode (branch_index 0), got {int(branch_index[0])}")
    return torch.cumsum((branch_index == 0).long(), dim=0) - 1


def episode_means(values: torch.Tensor, episode_index: torch.Tensor) -> torch.Tensor:
    """Mean of each episode's rows: (B,) -> (E,) fp32.

    Rows of an episode carry the same reward from the agent, so the mean is that reward; per-row additions
    (the reward function scoring each branch, DAPO's overlong penalty) are averaged over the episode.
    """
    num_episodes = check_episode_index(episode_index)
    if values.shape != episode_index.shape:
        raise ValueError(f"values {tuple(values.shape)} and episode_index {tuple(episode_index.shape)} differ")
    sums = torch.zeros(num_episodes, dtype=torch.float32).index_add_(0, episode_index.long(), values.float())
    counts = torch.bincount(episode_index.long(), minlength=num_episodes).float()
    return sums / counts


def expand_to_rows(episode_values: torch.Tensor, episode_index: torch.Tensor) -> torch.Tensor:
    """Each row gets its episode's value: (E, ...) -> (B, ...)."""
    num_episodes = check_episode_index(episode_index)
    if episode_values.shape[0] != num_episodes:
        raise ValueError(f"{episode_values.shape[0]} episode values for {num_episodes} episodes")
    return episode_values[episode_index.long()]
