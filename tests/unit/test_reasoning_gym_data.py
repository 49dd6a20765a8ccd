"""data.reasoning_gym: prompt file rows, the score_answer reward, and the message when the package is missing."""

from __future__ import annotations

import builtins
import json

import pytest

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.data import reasoning_gym as rg_data


def test_missing_package_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "reasoning_gym":
            raise ImportError("no module")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    rg_data.task_dataset.cache_clear()
    with pytest.raises(ImportError, match=r"hpc-rlhf\[tasks\]"):
        rg_data.task_dataset("chain_sum", 4, 0)


def test_prompt_data_and_reasoning_gym_exclude_each_other():
    with pytest.raises(ConfigError, match="data.prompt_data empty"):
        load_config(None, ["data.reasoning_gym.task=chain_sum", "data.prompt_data=[x.jsonl]"])


def test_prompt_file_and_reward(tmp_path):
    pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (extra `tasks`)")
    rg_data.task_dataset.cache_clear()
    path = rg_data.write_prompt_file("chain_sum", 4, 3, tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["data_source"] == "chain_sum"
    assert rows[2]["label"] == {"task": "chain_sum", "size": 4, "seed": 3, "index": 2}
    dataset = rg_data.task_dataset("chain_sum", 4, 3)
    assert rows[2]["question"] == dataset[2]["question"]
    labels = [rows[0]["label"], rows[1]["label"]]
    out = rg_data.reasoning_gym_reward(["q", "q"], ["q", "q"], labels, responses=[f" {dataset[0]['answer']}\n", "x"])
    assert out["rewards"].tolist() == [1.0, 0.0] and out["scores"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a data.reasoning_gym label"):
        rg_data.reasoning_gym_reward(["q"], ["q"], ["7"], responses=["7"])
