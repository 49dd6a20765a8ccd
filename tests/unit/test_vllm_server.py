"""The out-of-process vLLM engine without vLLM: environment isolation, payloads, mode choice, and a weight
round that runs while a generation is in flight (fake ``AsyncLLMEngine`` with vLLM's method names)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from types import ModuleType, SimpleNamespace

import pytest
import torch

from hpc_rlhf.config.schema import resolved_vllm_mode
from hpc_rlhf.engines.rollout_base import GenerationRequest, SamplingParams
from hpc_rlhf.engines.vllm_server import (
    LAUNCH_ENV_VARS,
    VllmServerEngine,
    bucket_update_info,
    isolated_environ,
    server_process_env,
    worker_init_info,
)
from tests.unit.test_vllm_rollout_contract import FakeRequestOutput, completion


def test_server_processes_do_not_see_our_world():
    env = server_process_env({"RANK": "5", "WORLD_SIZE": "64", "MASTER_PORT": "29500", "LOCAL_RANK": "5",
                              "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, devices=[4, 5])
    assert not set(LAUNCH_ENV_VARS) & set(env)
    assert env["PATH"] == "/bin" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_isolated_environ_restores_ours():
    os.environ["HPC_RLHF_TEST_MARK"] = "ours"
    with isolated_environ({"ONLY": "this"}):
        assert dict(os.environ) == {"ONLY": "this"}
    assert os.environ["HPC_RLHF_TEST_MARK"] == "ours" and "ONLY" not in os.environ
    del os.environ["HPC_RLHF_TEST_MARK"]


def test_weight_payloads_describe_the_bucket_and_the_ranks():
    bucket = [("model.embed_tokens.weight", torch.empty(10, 4, dtype=torch.bfloat16, device="meta")),
              ("model.norm.weight", torch.empty(4, device="meta"))]
    assert bucket_update_info(bucket) == {"names": ["model.embed_tokens.weight", "model.norm.weight"],
                                          "dtype_names": ["bfloat16", "float32"], "shapes": [[10, 4], [4]]}
    info = worker_init_info("10.0.0.1", 31000, num_workers=4)
    assert info["rank_offset"] == 1 and info["world_size"] == 5 and info["packed"] is True


@pytest.mark.parametrize("mode, colocate_all, expected", [
    ("auto", True, "external_launcher"), ("auto", False, "server_process"),
    ("server_process", True, "server_process"), ("external_launcher", False, "external_launcher")])
def test_vllm_mode_auto_follows_the_layout(mode, colocate_all, expected):
    assert resolved_vllm_mode(mode, colocate_all) == expected


class FakeAsyncEngine:
    """vLLM's AsyncLLMEngine surface as the engine uses it; ``generate`` blocks until ``release`` is set."""

    def __init__(self, args):
        self.args = args
        self.calls = []
        self.release = asyncio.Event()
        self.generating = threading.Event()

    @classmethod
    def from_engine_args(cls, engine_args):
        return cls(engine_args)

    async def generate(self, prompt, sampling_params, request_id):
        self.calls.append(("generate", request_id))
        self.generating.set()
        await self.release.wait()
        n = sampling_params.kwargs["n"]
        yield FakeRequestOutput(request_id, prompt["prompt_token_ids"],
                                [completion(j, [7], [-0.25], "stop") for j in range(n)])

    async def abort(self, request_id):
        self.calls.append(("abort", sorted(request_id)))
        self.release.set()

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))
        self.release.set()  # in-flight requests continue only after the round

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request.init_info["world_size"]))

    async def start_weight_update(self):
        self.calls.append(("start",))

    async def update_weights(self, request):
        self.calls.append(("update", request.update_info["names"]))

    async def finish_weight_update(self):
        self.calls.append(("finish",))

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture()
def fake_vllm(monkeypatch):
    class Recording:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    modules = {
        "vllm": SimpleNamespace(AsyncEngineArgs=Recording, AsyncLLMEngine=FakeAsyncEngine, SamplingParams=Recording,
                                TokensPrompt=dict),
        "vllm.config": SimpleNamespace(WeightTransferConfig=Recording),
        "vllm.sampling_params": SimpleNamespace(RequestOutputKind=SimpleNamespace(FINAL_ONLY="final_only")),
        "vllm.distributed.weight_transfer.base": SimpleNamespace(WeightTransferInitRequest=Recording,
                                                                 WeightTransferUpdateRequest=Recording),
    }
    for name, attrs in modules.items():
        module = ModuleType(name)
        module.__dict__.update(vars(attrs))
        monkeypatch.setitem(sys.modules, name, module)
    # Recording stands in for the request dataclasses: give it their attribute names.
    Recording.init_info = property(lambda self: self.kwargs["init_info"])
    Recording.update_info = property(lambda self: self.kwargs["update_info"])
    return modules


def test_weight_round_runs_while_a_generation_is_in_flight(fake_vllm):
    engine = VllmServerEngine("/models/tiny", tensor_parallel_size=2, devices=[2, 3], seed=3)
    try:
        args = engine.engine.args.kwargs
        assert args["distributed_executor_backend"] == "mp" and args["tensor_parallel_size"] == 2
        assert args["weight_transfer_config"].kwargs == {"backend": "nccl"}
        engine.open_weight_channel("10.0.0.1", 31000)
        pending = engine.submit([GenerationRequest([1, 2], SamplingParams(max_new_tokens=4, seed=1), n=2)])
        assert engine.engine.generating.wait(timeout=60)
        assert not pending.done()
        meta = torch.empty(4, device="meta")
        engine.receive_weights([[("a", meta), ("b", meta)], [], [("c", meta)]])
        results = pending.result(timeout=60)
    finally:
        engine.close()
    assert [(r.request_index, r.output_ids, r.output_logprobs) for r in results] == [(0, [7], [-0.25])] * 2
    rounds = [c for c in engine.engine.calls if c[0] != "generate"]
    assert rounds == [("init", 3), ("pause", "keep", True), ("start",), ("update", ["a", "b"]), ("update", ["c"]),
                      ("finish",), ("resume",), ("shutdown",)]


def test_failed_round_still_resumes_generation(fake_vllm):
    engine = VllmServerEngine("/models/tiny")
    with pytest.raises(RuntimeError, match="no weight channel"):  # nobody could send: refuse instead of hanging
        engine.update_weights([("a", torch.empty(1, device="meta"))])
    engine.open_weight_channel("10.0.0.1", 31000)

    async def broken(request):
        raise RuntimeError("NCCL peer gone")

    engine.engine.update_weights = broken
    try:
        with pytest.raises(RuntimeError, match="NCCL peer gone"):
            engine.update_weights([("a", torch.empty(1, device="meta"))])
    finally:
        engine.close()
    assert engine.engine.calls[-2:] == [("resume",), ("shutdown",)]


def test_close_aborts_generations_in_flight(fake_vllm):
    engine = VllmServerEngine("/models/tiny")
    pending = engine.submit([GenerationRequest([1], SamplingParams(max_new_tokens=2))])
    assert engine.engine.generating.wait(timeout=60)
    engine.close()
    pending.result(timeout=60)  # released by the abort, not left waiting
    assert [c for c in engine.engine.calls if c[0] != "generate"] == [("abort", ["hpc-rlhf-0"]), ("shutdown",)]


def test_from_config_refuses_tensor_parallel_engines_per_rank(fake_vllm):
    from hpc_rlhf.config.schema import RunConfig

    cfg = RunConfig.model_validate({"actor": {"pretrain": "/models/tiny"}, "rollout": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2"):
        VllmServerEngine.from_config(cfg, local_rank=0)
    engine = VllmServerEngine.from_config(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
        update={"tensor_parallel_size": 1})}), local_rank=3)
    try:
        assert engine.engine.args.kwargs["tensor_parallel_size"] == 1
    finally:
        engine.close()


def test_bucket_descriptions_are_read_on_the_calling_thread(fake_vllm):
    """The weight sync's descriptions may wait on the control plane: they must not be read on the engine's loop."""
    engine = VllmServerEngine("/models/tiny")
    engine.open_weight_channel("10.0.0.1", 31000)
    readers = []

    def buckets():
        for name in ("a", "b"):
            readers.append(threading.current_thread())
            yield [(name, torch.empty(2, device="meta"))]

    try:
        engine.receive_weights(buckets())
    finally:
        engine.close()
    assert readers == [threading.main_thread()] * 2
    assert [c for c in engine.engine.calls if c[0] == "update"] == [("update", ["a"]), ("update", ["b"])]
