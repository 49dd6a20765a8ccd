"""OpenRLHF-style agent and reward files on 2 gloo ranks: every accepted shape runs, what they log reaches
metrics.jsonl, and failures (raising agents, hung agents, hung reward functions) end the run in bounded time."""

from __future__ import annotations

import logging
import time

import pytest
import torch.multiprocessing as mp

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
FILES = ROOT / "tests/multiproc/agent_files"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _small(assets, tmp_path, *extra):
    return grpo_overrides(
        assets, tmp_path, "rollout.n_samples_per_prompt=4", "rollout.rollout_batch_size=4",
        "train.train_batch_size=16", "train.micro_train_batch_size=8", "train.max_steps=2", *extra)


def _agent(assets, tmp_path, name, *extra):
    return _small(assets, tmp_path, "reward.reward_func_path=null", f"train.agent_func_path={FILES / name}", *extra)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _fit_with_warnings(rank, world_size, overrides):
    records = _Records()
    logging.getLogger("hpc_rlhf").addHandler(records)
    run_trainer(rank, world_size, overrides).fit()
    return records.messages


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()


def test_unchanged_openrlhf_executor_base_file_trains_with_kwargs_logs_and_truncation_warning(assets, tmp_path):
    overrides = _agent(assets, tmp_path, "openrlhf_import_agent.py", "train.agent_kwargs.bonus=7",
                       "train.agent_max_turns=3", "data.max_len=28")
    warnings = run_on_ranks(_fit_with_warnings, 2, overrides)[0]
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert row["extra/bonus_seen"] == 7.0  # train.agent_kwargs reached the AgentInstance constructor
        assert row["extra/wrapped_by_execute"] == 1.0  # the execute override ran around super().execute
        assert 1.0 <= row["agent/num_turns"] <= 2.0
        assert row["agent/error_fraction"] == 0.0
    assert any(row["agent/max_len_fraction"] > 0 for row in rows)
    assert any("were cut at data.max_len=28" in m for m in warnings), warnings


def test_function_style_step_file(assets, tmp_path):
    overrides = _agent(assets, tmp_path, "function_step_agent.py", "train.agent_kwargs.scale=2.5",
                       "train.agent_max_turns=3", "data.max_len=64")
    run_on_ranks(_fit, 2, overrides)
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    assert all(row["extra/step_scale"] == 2.5 and row["agent/error_fraction"] == 0.0 for row in rows)
    assert any(row["agent/num_turns"] > 1.0 for row in rows)  # the "\nA: " feedback led to a second turn


def _fit_capturing_the_error(rank, world_size, overrides):
    try:
        run_trainer(rank, world_size, overrides).fit()
    except BaseException as err:  # noqa: BLE001 - SystemExit included: the test compares what each rank says
        return type(err).__name__, str(err)
    return None


def test_agent_load_error_is_reported_once_by_rank_0(assets, tmp_path):
    overrides = _agent(assets, tmp_path, "broken_import_agent.py")
    (kind0, message0), (kind1, message1) = run_on_ranks(_fit_capturing_the_error, 2, overrides)
    assert kind0 == "AgentLoadError" and "my_lab_env" in message0 and "Traceback" in message0
    # The other rank points at rank 0 in one line instead of repeating the traceback.
    assert kind1 == "SystemExit" and "rank 0 printed the error" in message1
    assert "\n" not in message1 and "Traceback" not in message1


def test_always_raising_agent_stops_the_run_within_the_window(assets, tmp_path):
    overrides = _agent(assets, tmp_path, "raising_agent.py", "train.agent_failure_window_steps=2",
                       "train.max_steps=5", "data.max_len=64")
    with pytest.raises(mp.ProcessRaisedException, match="max_agent_failure_fraction") as info:
        run_on_ranks(_fit, 2, overrides)
    assert "KeyError" in str(info.value) and "sample prompt" in str(info.value)
    assert len(read_metrics(tmp_path)) == 2  # stopped at the end of the window, not after 5 steps


def test_blocking_async_and_hanging_sync_agents_time_out_and_exit(assets, tmp_path):
    overrides = _agent(assets, tmp_path, "hanging_agent.py", "train.agent_step_timeout_s=2",
                       "train.max_agent_failure_fraction=1.0", "train.max_steps=1", "data.max_len=64")
    start = time.monotonic()
    run_on_ranks(_fit, 2, overrides)  # returns only once both processes exited
    assert time.monotonic() - start < 90
    row = read_metrics(tmp_path)[0]
    assert row["agent/timeout_fraction"] == 1.0


def test_hanging_reward_function_times_out(assets, tmp_path):
    overrides = _small(assets, tmp_path, f"reward.reward_func_path={FILES / 'hanging_reward.py'}",
                       "reward.reward_func_timeout_s=2", "train.max_steps=1")
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="reward_func_timeout_s"):
        run_on_ranks(_fit, 2, overrides)
    assert time.monotonic() - start < 90


def test_dapo_refill_fills_the_batch_when_most_groups_are_uniform(assets, tmp_path):
    overrides = _small(assets, tmp_path, f"reward.reward_func_path={FILES / 'mostly_uniform_reward.py'}",
                       "algo.dynamic_filtering=true", "algo.dynamic_filtering_reward_range=[0.01,0.99]",
                       "rollout.dynamic_filtering_max_rounds=12", "rollout.generate_max_len=6",
                       "train.max_steps=1")
    run_on_ranks(_fit, 2, overrides)
    row = read_metrics(tmp_path)[0]
    assert row["dynamic_filtering/refill_rounds"] >= 1
    assert row["num_trained_samples"] == 16  # a full step's batch despite most groups being uniform
