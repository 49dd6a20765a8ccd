"""OpenRLHF's example reward function: a random 0/1 reward per sample (for smoke tests)."""

import torch


def reward_func(queries, prompts, labels):
    # queries: prompt + response texts; prompts: prompt texts; labels: dataset labels
    reward = torch.randint(0, 2, (len(queries),)).float()
    return {
        "rewards": reward,  # the training signal
        "scores": reward,  # used for dynamic filtering (0-1)
        "extra_logs": {"dummy_scores": reward},  # logged
    }
