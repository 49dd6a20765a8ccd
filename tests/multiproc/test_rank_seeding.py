"""After the RL roles are built, ranks draw different random numbers even when the rollout engine seeded every
rank alike (vLLM's worker calls ``set_random_seed(engine seed)``; simulated here on the transformers engine)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow

ENGINE_SEED = 1234


def _draws_after_setup(rank: int, world_size: int, overrides: list[str]) -> dict:
    from hpc_rlhf.trainers.rl import setup as rl_setup
    from hpc_rlhf.utils.seeding import seed_everything

    build = rl_setup._rollout_engine

    def engine_that_seeds_every_rank_alike(*args, **kwargs):
        engine = build(*args, **kwargs)
        seed_everything(ENGINE_SEED)  # what vLLM's worker does inside the engine's construction
        return engine

    rl_setup._rollout_engine = engine_that_seeds_every_rank_alike
    run_trainer(rank, world_size, overrides)
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(4).tolist()}


def test_ranks_sample_differently_after_an_engine_seeds_them_alike(tmp_path):
    assets = make_assets(tmp_path / "assets")
    rank0, rank1 = run_on_ranks(_draws_after_setup, 2, grpo_overrides(assets, tmp_path / "run"))
    for stream in ("python", "numpy", "torch"):
        assert rank0[stream] != rank1[stream], stream
