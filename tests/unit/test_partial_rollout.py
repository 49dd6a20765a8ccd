"""Partial rollouts keep the tokens generated before a weight update and record both versions."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc_rlhf.agents.executor import SingleTurnExecutor
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.logprobs import logprobs_from_logits
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.rollout.base import SamplingParams
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine
from hpc_rlhf.trainers.rl.partial_rollout import continue_generation, stamp_versions


def test_generation_continues_after_a_weight_update(tmp_path):
    old_dir, new_dir = build_tiny_model(tmp_path / "old", seed=0), build_tiny_model(tmp_path / "new", seed=1)
    tok = AutoTokenizer.from_pretrained(old_dir)
    old = AutoModelForCausalLM.from_pretrained(old_dir).eval()
    new = AutoModelForCausalLM.from_pretrained(new_dir).eval()
    engine = TransformersRolloutEngine(AutoModelForCausalLM.from_pretrained(old_dir).eval(), tok.eos_token_id,
                                       tok.pad_token_id)
    executor = SingleTurnExecutor(tok, prompt_max_len=16)
    prompts = [Prompt(text="3+4=", label="7", source="t", index=0), Prompt(text="12+9=", label="21", source="t",
                                                                          index=1)]
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)  # no eos stop: every sample is cut
    chunk = executor.run(prompts, engine.generate, SamplingParams(max_new_tokens=3, temperature=1.0, seed=3), 2)
    stamp_versions(chunk, 5)
    engine.update_weights(new.state_dict().items())
    done = continue_generation(chunk, engine.generate, sampling, 6, max_new_tokens=8)

    assert len(done) == 4
    for before, after in zip(chunk, done, strict=True):
        assert after.response_ids[:3] == before.response_ids  # tokens from before the update are kept
        assert after.token_versions == [5] * 3 + [6] * (len(after.response_ids) - 3)
        assert after.policy_version == 5
        assert len(after.action_mask) == len(after.rollout_logprobs) == len(after.response_ids)
        # Each token's logprob is the one its own generator gave it.
        ids = torch.tensor([after.prompt_ids + after.response_ids])
        n = len(after.response_ids)
        with torch.no_grad():
            lp_old = logprobs_from_logits(old(ids).logits[:, -n - 1 : -1], ids[:, -n:])[0]
            lp_new = logprobs_from_logits(new(ids).logits[:, -n - 1 : -1], ids[:, -n:])[0]
        assert torch.allclose(torch.tensor(after.rollout_logprobs[:3]), lp_old[:3], atol=1e-4)
        assert torch.allclose(torch.tensor(after.rollout_logprobs[3:]), lp_new[3:], atol=1e-4)
    assert any(len(t.response_ids) > 3 for t in done)
