"""Fixtures of the security tier: a tiny tokenizer and rollout engine built locally (no hub)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer_and_engine(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    engine = TransformersRolloutEngine(model, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id, device="cpu", seed=3)
    return tokenizer, engine
