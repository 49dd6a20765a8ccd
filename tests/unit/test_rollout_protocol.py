"""Defaults of the rollout-engine protocol and the transformers compatibility helpers."""

import pytest
import torch

from hpc_rlhf.agents.executor import AgentExecutor
from hpc_rlhf.models.hf_compat import cache_kwargs, enable_activation_checkpointing, is_activation_checkpointing
from hpc_rlhf.rollout.base import RolloutEngine


class _RecordingEngine(RolloutEngine):
    def __init__(self):
        self.calls = []

    def generate(self, requests):
        return []

    def update_weights(self, named_tensors):
        self.calls.append([name for name, _ in named_tensors])

    def sleep(self):
        pass

    def wake_up(self, tags=None):
        pass

    def reset_prefix_cache(self):
        pass


def test_an_in_process_engine_receives_a_round_as_one_update_and_has_no_channel():
    engine = _RecordingEngine()
    t = torch.zeros(1)
    engine.receive_weights([[("a", t), ("b", t)], [("c", t)]])
    assert engine.calls == [["a", "b", "c"]]  # one call: vLLM reprocesses a layer only within one update
    with pytest.raises(NotImplementedError, match="_RecordingEngine loads weights in-process"):
        engine.open_weight_channel({"address": "127.0.0.1", "port": 29500})
    assert engine.shares_trained_model is False
    engine.close()  # nothing started, nothing to stop


def test_an_executor_closes_without_serving_anything():
    class Executor(AgentExecutor):
        def run(self, prompts, generate, sampling, n_samples_per_prompt):
            return []

    Executor(tokenizer=None, prompt_max_len=8).close()


class _OldForward(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False):
        return past_key_values


class _NewForward(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False):
        return cache


def test_the_cache_goes_under_the_keyword_the_forward_takes():
    cache = object()
    assert cache_kwargs(_OldForward(), cache) == {"past_key_values": cache}
    assert cache_kwargs(_NewForward(), cache) == {"cache": cache}
    assert _NewForward()(None, **cache_kwargs(_NewForward(), cache)) is cache


def test_activation_checkpointing_uses_the_name_the_model_has():
    class Old(torch.nn.Module):
        is_gradient_checkpointing = False

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.is_gradient_checkpointing, self.kwargs = True, gradient_checkpointing_kwargs

    class New(torch.nn.Module):
        is_activation_checkpointing = False

        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
            self.is_activation_checkpointing, self.kwargs = True, activation_checkpointing_kwargs

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            raise AssertionError("deprecated name called")

    for model in (Old(), New()):
        assert not is_activation_checkpointing(model)
        enable_activation_checkpointing(model, use_reentrant=False)
        assert is_activation_checkpointing(model) and model.kwargs == {"use_reentrant": False}
    plain = torch.nn.Linear(2, 2)
    enable_activation_checkpointing(plain)  # no switch: left as it is
    assert not is_activation_checkpointing(plain)
