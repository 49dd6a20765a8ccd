"""Colocated memory order: what leaves the device, and when, around the weight sync; the plan models its peak.

The order is checked here on recording fakes; ``tests/multiproc/test_rl_end_to_end.py`` runs the real
transformers engine and DeepSpeed facade through the same ``colocated_weight_sync`` in a training step.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.planning.memory_estimate import SYNC_BUCKET_GIB, rank_memory, role_memory
from hpc_rlhf.training.deepspeed_engine import FrozenEngine, TrainEngine
from hpc_rlhf.weight_sync import colocated as colocation
from hpc_rlhf.world.placement import build_placement


class Recorder:
    shares_trained_model = False

    def __init__(self, name, calls, buckets=()):
        self.name, self.calls, self.buckets = name, calls, buckets

    def offload_states(self, keep_weights=False):
        self.calls.append((self.name, "offload", keep_weights))

    def gathered_state_dict_items(self):
        self.calls.append((self.name, "gather"))
        yield from self.buckets

    def wake_up(self, tags=None):
        self.calls.append((self.name, "wake_up", tags))

    def update_weights(self, bucket):
        self.calls.append((self.name, "update", [n for n, _ in bucket]))

    def reset_prefix_cache(self):
        self.calls.append((self.name, "reset_prefix_cache"))


def test_weight_sync_order_frees_training_states_before_vllm_wakes(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "free_device_cache", lambda: calls.append(("device", "free_cache")))
    actor = Recorder("actor", calls, buckets=[[("a", 0), ("b", 0)], [("c", 0)]])
    colocation.colocated_weight_sync(Recorder("rollout", calls), actor,
                                     [Recorder("critic", calls), Recorder("ref", calls)])
    assert calls == [
        ("actor", "offload", True), ("critic", "offload", False), ("ref", "offload", False),
        ("device", "free_cache"),
        ("rollout", "wake_up", ["weights"]),
        # one update with every bucket: vLLM processes a layer again only within one update
        ("actor", "gather"), ("rollout", "update", ["a", "b", "c"]),
        ("actor", "offload", False), ("device", "free_cache"),
        ("rollout", "wake_up", ["kv_cache"]), ("rollout", "reset_prefix_cache"),
    ]


def test_weight_sync_into_an_engine_sharing_the_actor_module_loads_nothing_and_keeps_its_weights(monkeypatch):
    calls = []
    monkeypatch.setattr(colocation, "free_device_cache", lambda: calls.append(("device", "free_cache")))
    rollout = Recorder("rollout", calls)
    rollout.shares_trained_model = True
    colocation.colocated_weight_sync(rollout, Recorder("actor", calls, buckets=[[("a", 0)]]), [Recorder("ref", calls)])
    assert calls == [("actor", "offload", True), ("ref", "offload", False), ("device", "free_cache"),
                     ("rollout", "reset_prefix_cache")]


class FusedAdam:  # the class name DeepSpeed's ZeRO-3 offload_states insists on
    pass


class FakeDeepSpeed:
    def __init__(self, inner_optimizer=None):
        self.calls = []
        self.optimizer = SimpleNamespace(optimizer=inner_optimizer or FusedAdam())
        self.module = SimpleNamespace(to=lambda device: self.calls.append(("to", str(device))))
        self.device = "cuda:0"

    def offload_states(self, include=None):
        self.calls.append(("offload", sorted(s.value for s in include)))

    def reload_states(self):
        self.calls.append(("reload",))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_train_engine_offloads_in_two_parts_at_zero_1_to_3(stage):
    ds = FakeDeepSpeed()
    engine = TrainEngine(ds, zero_stage=stage, dp_group=None, on_gpu=True, adam_offload=False)
    engine.offload_states(keep_weights=True)
    engine.offload_states(keep_weights=True)  # already on the host: no second call
    engine.offload_states()
    engine.reload_states()
    engine.reload_states()  # nothing left to reload
    everything = ["contiguous_grad_buffer", "hp_params", "lp_grads", "lp_params", "optim_states"]
    assert ds.calls == [("offload", [s for s in everything if s != "lp_params"]), ("offload", everything),
                        ("reload",)]


@pytest.mark.parametrize("stage, on_gpu", [(0, True), (2, False)])
def test_train_engine_keeps_states_where_deepspeed_cannot_move_them(stage, on_gpu):
    ds = FakeDeepSpeed()
    engine = TrainEngine(ds, zero_stage=stage, dp_group=None, on_gpu=on_gpu, adam_offload=False)
    engine.offload_states()
    engine.reload_states()
    assert ds.calls == []


def test_zero3_with_another_optimizer_keeps_its_states_on_the_device(caplog):
    ds = FakeDeepSpeed(inner_optimizer=object())  # e.g. torch.optim.AdamW
    engine = TrainEngine(ds, zero_stage=3, dp_group=None, on_gpu=True, adam_offload=False)
    engine.offload_states()
    assert ds.calls == [("offload", ["contiguous_grad_buffer", "lp_grads", "lp_params"])]
    assert "stay on the GPU" in caplog.text


def test_train_engine_with_adam_offload_moves_weights_and_gradients_only():
    ds = FakeDeepSpeed()
    engine = TrainEngine(ds, zero_stage=3, dp_group=None, on_gpu=True, adam_offload=True)
    engine.offload_states(keep_weights=True)
    engine.offload_states()
    assert ds.calls == [("offload", ["contiguous_grad_buffer", "lp_grads"]),
                        ("offload", ["contiguous_grad_buffer", "lp_grads", "lp_params"])]


def test_frozen_engine_moves_a_stage0_model_but_not_zero3_partitions():
    ds = FakeDeepSpeed()
    frozen = FrozenEngine(ds, zero_stage=0, dp_group=None, on_gpu=True)
    frozen.offload_states()
    frozen.offload_states()
    frozen.reload_states()
    assert ds.calls == [("to", "cpu"), ("to", "cuda:0")]
    ds3 = FakeDeepSpeed()
    FrozenEngine(ds3, zero_stage=3, dp_group=None, on_gpu=True).offload_states()
    assert ds3.calls == []


def _colocated(*overrides: str) -> RunConfig:
    from hpc_rlhf.config import load_config

    return load_config(None, ["actor.num_params_b=7", "train.colocate_all=true", "ds.zero_stage=3",
                              "algo.advantage_estimator=gae", "critic.num_params_b=7", *overrides])


def test_plan_peak_models_the_weight_sync_phase():
    """The sync phase holds the actor's bf16 shard + a bucket + vLLM's weights; over 64 ZeRO-3 ranks with a small
    vLLM budget it is the peak (the old max(training, vLLM budget) missed it), and rollout tensor parallelism
    shrinks it."""
    small_batches = ("vllm.gpu_memory_utilization=0.05", "train.micro_train_batch_size=1",
                     "rollout.micro_rollout_batch_size=1", "data.prompt_max_len=64", "rollout.generate_max_len=64")
    cfg = _colocated(*small_batches)
    placement = build_placement(cfg, 64)
    rank = rank_memory(cfg, placement, 80)[0]
    actor = role_memory(cfg, placement, "actor")
    expected_sync = actor.weights_gib + SYNC_BUCKET_GIB + 7e9 * 2 / 1024**3
    assert rank.sync_gib == pytest.approx(expected_sync, rel=1e-6)
    assert rank.peak_gib == pytest.approx(expected_sync) and expected_sync > max(rank.training_gib, 0.05 * 80)
    tp2 = _colocated(*small_batches, "rollout.tensor_parallel_size=2")
    assert rank_memory(tp2, build_placement(tp2, 64), 80)[0].sync_gib == pytest.approx(
        expected_sync - 7e9 / 1024**3, rel=1e-6)


def test_plan_counts_zero0_training_states_as_resident_during_generation():
    """ZeRO-0 has no ZeRO optimizer to move its states: they stay next to vLLM's whole budget."""
    cfg = _colocated("ds.zero_stage=0")
    placement = build_placement(cfg, 8)
    actor = role_memory(cfg, placement, "actor")
    rank = rank_memory(cfg, placement, 80)[0]
    assert rank.peak_gib >= actor.states_gib + cfg.vllm.gpu_memory_utilization * 80 - 1e-9


def test_vllm_engine_wakes_each_part_once_and_guards_level2(monkeypatch):
    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
    from hpc_rlhf.rollout.vllm_external_launcher import VllmRolloutEngine
    from tests.unit.test_vllm_external_launcher_contract import FakeLLM, RecordingSamplingParams

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM, SamplingParams=RecordingSamplingParams,
                                                              TokensPrompt=dict))
    engine = VllmRolloutEngine("/models/tiny", sleep_level=2)
    request = [GenerationRequest([3], SamplingParams(max_new_tokens=1))]
    engine.wake_up()  # awake already: nothing to do
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.update_weights([("lm_head.weight", "w")])
    engine.wake_up(["weights"])
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="discarded"):
        engine.generate(request)  # level 2 dropped the weights and none were loaded
    engine.update_weights([("lm_head.weight", "w")])
    engine.generate(request)
    with pytest.raises(ValueError, match="unknown tags"):
        engine.wake_up(["weight"])
    assert [c for c in engine.llm.calls if c[0] in ("sleep", "wake_up")] == [
        ("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]


@pytest.mark.parametrize("extra", [["algo.dynamic_filtering=true"], ["eval.data=[prompts.jsonl]"]])
def test_sleep_level_2_is_refused_where_generation_follows_a_wake_without_a_sync(extra):
    from hpc_rlhf.config import ConfigError, load_config

    assert load_config(None, ["vllm.sleep_level=2"]).vllm.sleep_level == 2
    with pytest.raises(ConfigError, match="vllm.sleep_level=1"):
        load_config(None, ["vllm.sleep_level=2", *extra])
