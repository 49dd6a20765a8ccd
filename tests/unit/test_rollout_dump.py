"""Rollout dump records: texts, rewards, policy version, and the turns of a multi-turn sample."""

from __future__ import annotations

import json

from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.rollout_dump import (
    is_dump_step,
    rollout_records,
    turn_segments,
    write_rollouts,
)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def _traj(response, mask, **kw):
    ids = [ord(c) for c in response]
    return Trajectory(prompt="1+1=", label="2", prompt_ids=[ord("1")], response_ids=ids, action_mask=mask,
                      rollout_logprobs=[0.0] * len(ids), **kw)


def test_turn_segments_alternate_model_and_environment():
    assert turn_segments([1, 2, 3, 4, 5], [1, 1, 0, 0, 1]) == [("model", [1, 2]), ("environment", [3, 4]),
                                                               ("model", [5])]
    assert turn_segments([], []) == []


def test_records_and_file(tmp_path):
    single = _traj("2", [1], reward=1.5, score=1.0, policy_version=3, group_index=1)
    agent = _traj("3no2", [1, 0, 0, 1], reward=0.0, score=0.0, extra_logs={"num_turns": 2.0},
                  failure="step: ValueError: x")
    records = rollout_records([single, agent], CharTokenizer(), step=4)
    assert records[0] == {
        "step": 4, "policy_version": 3, "group_index": 1, "branch_index": 0, "prompt": "1+1=", "response": "2",
        "label": "2",
        "reward": 1.5, "score": 1.0, "response_length": 1, "truncated": False, "finish_reason": "",
        "extra_logs": {}}
    assert records[1]["turns"] == [{"role": "model", "text": "3"}, {"role": "environment", "text": "no"},
                                   {"role": "model", "text": "2"}]
    assert records[1]["failure"] == "step: ValueError: x" and records[1]["extra_logs"] == {"num_turns": 2.0}
    path = write_rollouts(tmp_path, 4, records)
    assert path == tmp_path / "rollouts" / "step_4.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    assert [p.name for p in path.parent.iterdir()] == ["step_4.jsonl"]  # no temporary file left


def test_dump_schedule():
    assert [s for s in range(1, 7) if is_dump_step(s, 2)] == [2, 4, 6]
    assert not any(is_dump_step(s, None) for s in range(1, 7))
