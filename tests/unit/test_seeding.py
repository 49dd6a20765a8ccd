"""Per-rank seeding: each rank its own python / numpy / torch streams, restored after an engine reseeds them."""

from __future__ import annotations

import random

import numpy as np
import torch

from hpc_rlhf.utils.seeding import seed_everything, seed_rank


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_rank_gives_each_rank_its_own_reproducible_streams():
    seed_rank(42, 0)
    rank0 = _draws()
    seed_rank(42, 1)
    rank1 = _draws()
    assert all(a != b for a, b in zip(rank0, rank1, strict=True))  # python, numpy and torch all differ
    seed_everything(7)  # what an engine does on every rank alike (vLLM: set_random_seed(engine seed))
    same_on_all_ranks = _draws()
    seed_rank(42, 1)
    assert _draws() == rank1 != same_on_all_ranks
