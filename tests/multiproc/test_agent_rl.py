"""Multi-turn agent RL on 2 gloo ranks: environment feedback tokens never reach the loss."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
AGENT = str(ROOT / "examples/agents/math_retry_agent.py")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _agent_step(rank, world_size, overrides):
    trainer = run_trainer(rank, world_size, overrides)
    prompts = trainer.data.next_prompts() if rank == 0 else None
    trajectories = trainer.score(trainer.generate(prompts, step=1))
    trains, batch = trainer.make_experience(trajectories)
    assert trains
    trainer.train(batch)
    if rank != 0:
        return None
    feedback_ids = trainer.tokenizer("\nWrong. Try again.\nA: ", add_special_tokens=False)["input_ids"]
    return {
        "trajectories": [(t.response_ids, t.action_mask, t.rollout_logprobs, t.extra_logs.get("num_turns"))
                         for t in trajectories],
        "batch_action_mask": batch.action_mask, "feedback_ids": feedback_ids,
        "advantages": batch.advantages,
    }


def _find(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


def test_feedback_tokens_are_masked_out_of_the_loss(assets, tmp_path):
    overrides = grpo_overrides(
        assets, tmp_path, "reward.reward_func_path=null", f"train.agent_func_path={AGENT}", "train.agent_max_turns=3",
        "data.max_len=64", "rollout.n_samples_per_prompt=4", "train.train_batch_size=32",
        "train.micro_train_batch_size=16", "train.max_steps=1")
    result = run_on_ranks(_agent_step, 2, overrides)[0]
    multi_turn = [t for t in result["trajectories"] if t[3] and t[3] > 1]
    assert multi_turn, "no episode took a second turn"
    for row, (response, mask, logprobs, _) in enumerate(result["trajectories"]):
        assert len(mask) == len(response) == len(logprobs)
        for start in _find(response, result["feedback_ids"]):
            span = range(start, start + len(result["feedback_ids"]))
            assert all(mask[i] == 0 for i in span), "feedback token inside the action mask"
            assert all(logprobs[i] == 0.0 for i in span)
        # The trained batch uses exactly this mask; masked positions carry no advantage.
        batch_mask = result["batch_action_mask"][row, : len(mask)]
        assert batch_mask.tolist() == [bool(m) for m in mask]
        assert torch.all(result["advantages"][row][~result["batch_action_mask"][row]] == 0)
    assert any(0 in t[1] and 1 in t[1] for t in multi_turn)


def test_agent_recipe_runs_end_to_end(assets, tmp_path):
    overrides = grpo_overrides(
        assets, tmp_path, "reward.reward_func_path=null", f"train.agent_func_path={AGENT}", "train.agent_max_turns=2",
        "data.max_len=48", "rollout.n_samples_per_prompt=4", "train.train_batch_size=32",
        "train.micro_train_batch_size=16", "train.max_steps=3")

    run_on_ranks(_fit, 2, overrides)
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["response_length"] > 4 for r in rows)


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()
