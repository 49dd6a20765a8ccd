"""Per-rank seeding of every RNG a rank uses (python, numpy, torch CPU and CUDA)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def seed_rank(seed: int, rank: int) -> None:
    """Give ``rank`` its own streams derived from the run's ``seed`` (dropout masks, sampling, shuffles differ
    between ranks; a rerun repeats them). Called at start-up, and again after anything that seeds the global
    RNGs itself: vLLM's worker seeds every rank with the same engine seed."""
    seed_everything(seed + rank)
