"""Evaluation during GRPO on 2 gloo ranks: eval rows at eval.steps and the last step, one set of metrics per data
source, greedy eval deterministic on fixed weights, and no effect on the training prompt stream or RNG."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow


def _eval_then_fit(rank, world_size, overrides):
    trainer = run_trainer(rank, world_size, overrides)
    stream = trainer.data.stream.state_dict() if rank == 0 else None
    rng = torch.get_rng_state()
    first, second = trainer.evaluate(0), trainer.evaluate(0)
    assert torch.equal(rng, torch.get_rng_state()), "evaluation consumed the training RNG"
    if rank == 0:
        assert trainer.data.stream.state_dict() == stream, "evaluation moved the training prompt stream"
    trainer.fit()
    return {"first": first, "second": second}


def test_grpo_eval_rows_per_source(tmp_path):
    assets = make_assets(tmp_path / "assets")
    rows = [json.loads(line) for line in open(assets["data"])]
    (tmp_path / "add_a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    # A second file whose rows name their source: reported under it, not under the file name.
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps({**r, "data_source": "add_b"}) + "\n" for r in rows[5:]))
    out = tmp_path / "run"
    overrides = grpo_overrides(
        assets, out, "train.max_steps=3", "logger.logging_steps=10",
        f"eval.data=[{tmp_path / 'add_a.jsonl'},{tmp_path / 'mixed.jsonl'}]", "eval.steps=2",
        "eval.max_samples=3", "eval.n_samples_per_prompt=2", "eval.temperature=0")
    results = run_on_ranks(_eval_then_fit, 2, overrides)
    first, second = results[0]["first"], results[0]["second"]
    assert first == second, "greedy eval on the same weights differs"
    metrics = read_metrics(out)
    assert [r["step"] for r in metrics] == [2, 3]  # eval steps are logged even off logging_steps
    for row in metrics:
        for source, prompts in (("add_a", 3), ("add_b", 3), ("all", 6)):
            assert row[f"eval/{source}/num_prompts"] == prompts
            for key in ("mean@2", "pass@1", "pass@2", "response_length", "truncated_fraction"):
                assert 0 <= row[f"eval/{source}/{key}"] <= (4 if key == "response_length" else 1), key
        # Greedy: both samples of a prompt are the same, so pass@2 equals pass@1.
        assert row["eval/all/pass@2"] == row["eval/all/pass@1"]
        assert "timing/eval" in row
    assert not any(k.startswith("eval/mixed") for k in metrics[0])
