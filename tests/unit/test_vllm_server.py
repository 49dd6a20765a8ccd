"""The out-of-process vLLM engine without vLLM: environment isolation, payloads, mode and backend choice, a weight
round that runs while a generation is in flight (fake ``AsyncLLMEngine`` with vLLM's method names), and the gloo
backend's wire format between two threads. The real engine on CPU: ``tests/multiproc/test_vllm_server_cpu.py``."""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import threading
import time
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import pytest
import torch

from hpc_rlhf.config.rollout import resolved_vllm_mode
from hpc_rlhf.rollout import vllm_server
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.vllm_server import VllmServerEngine
from hpc_rlhf.rollout.vllm_server_launch import LAUNCH_ENV_VARS, isolated_environ, server_process_env
from hpc_rlhf.weight_sync import vllm_gloo_transfer
from hpc_rlhf.weight_sync.vllm_gloo_transfer import (
    GlooGroup,
    GlooSenderChannel,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    bucket_layout,
    empty_buffers,
    pack_by_dtype,
    unpack_by_dtype,
    worker_group_rank,
)
from hpc_rlhf.weight_sync.vllm_transfer_info import bucket_update_info, transfer_backend, worker_init_info
from tests.unit.test_vllm_external_launcher_contract import FakeRequestOutput, completion

# What a sender's channel hands the engine's rank: NCCL's unique id (128 bytes, base64); the gloo store's place.
NCCL_RENDEZVOUS = {"nccl_unique_id_b64": base64.b64encode(bytes(range(128))).decode()}
CHANNEL = "c" * 32
GLOO_RENDEZVOUS = {"master_address": "10.0.0.1", "master_port": 31000, "channel": CHANNEL}
RENDEZVOUS = {"nccl": NCCL_RENDEZVOUS, "gloo": GLOO_RENDEZVOUS}


def test_server_processes_do_not_see_our_world():
    env = server_process_env({"RANK": "5", "WORLD_SIZE": "64", "MASTER_PORT": "29500", "LOCAL_RANK": "5",
                              "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, devices=[4, 5])
    assert not set(LAUNCH_ENV_VARS) & set(env)
    assert env["PATH"] == "/bin" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_cpu_server_processes_keep_the_visible_devices_as_they_are():
    assert "CUDA_VISIBLE_DEVICES" not in server_process_env({"RANK": "1", "PATH": "/bin"}, devices=None)
    assert server_process_env({"CUDA_VISIBLE_DEVICES": "3"}, devices=None)["CUDA_VISIBLE_DEVICES"] == "3"


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
    info = worker_init_info(NCCL_RENDEZVOUS, num_workers=4)
    assert info["rank_offset"] == 1 and info["world_size"] == 5 and info["packed"] is True
    assert info["nccl_unique_id_b64"] == NCCL_RENDEZVOUS["nccl_unique_id_b64"] and "master_port" not in info
    # The gloo backend's payload builds its init info (what vLLM's worker does with it) and has no NCCL packing.
    gloo = worker_init_info(GLOO_RENDEZVOUS, num_workers=4, backend="gloo")
    assert GlooWeightTransferInitInfo(**gloo).world_size == 5 and "packed" not in gloo
    with pytest.raises(ValueError, match="unknown weight-transfer backend 'rdma'"):
        worker_init_info(NCCL_RENDEZVOUS, num_workers=1, backend="rdma")
    with pytest.raises(ValueError, match=r"lacks \['channel'\]"):
        worker_init_info({"master_address": "h", "master_port": 31000}, num_workers=1, backend="gloo")


def test_transfer_backend_follows_the_hardware():
    assert transfer_backend(on_gpu=True) == "nccl"
    assert transfer_backend(on_gpu=False) == "gloo"


@pytest.mark.parametrize("mode, colocate_all, expected", [
    ("auto", True, "external_launcher"), ("auto", False, "server_process"),
    ("server_process", True, "server_process"), ("external_launcher", False, "external_launcher")])
def test_vllm_mode_auto_follows_the_layout(mode, colocate_all, expected):
    assert resolved_vllm_mode(mode, colocate_all) == expected


class FakeEngineDead(Exception):
    """vLLM's EngineDeadError."""


class FakeAsyncEngine:
    """vLLM's AsyncLLMEngine surface as the engine uses it; ``generate`` blocks until ``release`` is set."""

    errored = False  # vLLM's engine-dead flag

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
    return install_fake_vllm(monkeypatch)


def install_fake_vllm(monkeypatch):
    """vLLM's modules as the engine resolves them, with :class:`FakeAsyncEngine` (also used by
    ``test_vllm_lora_restart.py``)."""

    class Recording:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    modules = {
        "vllm": SimpleNamespace(AsyncEngineArgs=Recording, AsyncLLMEngine=FakeAsyncEngine, SamplingParams=Recording,
                                TokensPrompt=dict),
        "vllm.config": SimpleNamespace(WeightTransferConfig=Recording),
        "vllm.sampling_params": SimpleNamespace(RequestOutputKind=SimpleNamespace(FINAL_ONLY="final_only",
                                                                                  DELTA="delta")),
        "vllm.v1.engine.exceptions": SimpleNamespace(EngineDeadError=FakeEngineDead),
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
    engine = VllmServerEngine("/models/tiny", tensor_parallel_size=2, devices=[2, 3], seed=3,
                              weight_transfer_backend="nccl")
    fake = engine.engine
    try:
        args = engine.engine.args.kwargs
        assert args["distributed_executor_backend"] == "mp" and args["tensor_parallel_size"] == 2
        assert args["weight_transfer_config"].kwargs == {"backend": "nccl"}
        engine.open_weight_channel(RENDEZVOUS[engine.weight_transfer_backend])
        pending = engine.submit([GenerationRequest([1, 2], SamplingParams(max_new_tokens=4, seed=1), n=2)])
        assert engine.engine.generating.wait(timeout=60)
        assert not pending.done()
        meta = torch.empty(4, device="meta")
        engine.receive_weights([[("a", meta), ("b", meta)], [], [("c", meta)]])
        results = pending.result(timeout=60)
    finally:
        engine.close()
    assert [(r.request_index, r.output_ids, r.output_logprobs) for r in results] == [(0, [7], [-0.25])] * 2
    rounds = [c for c in fake.calls if c[0] != "generate"]
    assert rounds == [("init", 3), ("pause", "keep", True), ("start",), ("update", ["a", "b"]), ("update", ["c"]),
                      ("finish",), ("resume",), ("shutdown",)]


def test_failed_round_still_resumes_generation(fake_vllm):
    engine = VllmServerEngine("/models/tiny")
    fake = engine.engine
    with pytest.raises(RuntimeError, match="no weight channel"):  # nobody could send: refuse instead of hanging
        engine.update_weights([("a", torch.empty(1, device="meta"))])
    engine.open_weight_channel(RENDEZVOUS[engine.weight_transfer_backend])

    async def broken(request):
        raise RuntimeError("NCCL peer gone")

    engine.engine.update_weights = broken
    try:
        with pytest.raises(RuntimeError, match="NCCL peer gone"):
            engine.update_weights([("a", torch.empty(1, device="meta"))])
    finally:
        engine.close()
    assert fake.calls[-2:] == [("resume",), ("shutdown",)]


def test_close_aborts_generations_in_flight(fake_vllm):
    engine = VllmServerEngine("/models/tiny")
    fake = engine.engine
    pending = engine.submit([GenerationRequest([1], SamplingParams(max_new_tokens=2))])
    assert fake.generating.wait(timeout=60)
    engine.close()
    pending.result(timeout=60)  # released by the abort, not left waiting
    engine.close()  # idempotent: nothing is shut down twice
    assert [c for c in fake.calls if c[0] != "generate"] == [("abort", ["hpc-rlhf-0"]), ("shutdown",)]


def _answers_nothing_once_dead(fake: FakeAsyncEngine, name: str):
    """A call to ``fake`` as vLLM 0.32 leaves it when its engine core has just died: it never returns, and its
    engine-dead flag rises a moment after the call was sent. Records the call and its cancellation."""

    async def call(*args, **kwargs):
        fake.calls.append((name,))
        threading.Timer(0.2, lambda: setattr(fake, "errored", True)).start()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            fake.calls.append((f"{name} cancelled",))
            raise

    return call


def _wait_for_call(fake: FakeAsyncEngine, call: tuple, timeout_s: float = 5.0) -> None:
    """Until ``call`` is among the fake's calls (a cancellation reaches the loop in milliseconds)."""
    deadline = time.monotonic() + timeout_s
    while call not in fake.calls:
        assert time.monotonic() < deadline, f"{call} never came: {fake.calls}"
        time.sleep(0.05)


@pytest.mark.parametrize("call", ["resume", "abort"])
def test_a_best_effort_call_to_an_engine_that_just_died_is_dropped_once_vllm_flags_it(fake_vllm, monkeypatch, call):
    """Resuming held requests (fault hooks) and aborting the requests of a failed engine (restart): sent just as the
    engine core died, the call would never return; it is cancelled once vLLM flags the engine dead, not after a
    fixed wait (made 600 s here, so that only the flag can end it), and the restart goes on at once."""
    monkeypatch.setattr(vllm_server, "BEST_EFFORT_CALL_S", 600.0)
    engine = VllmServerEngine("/models/tiny")
    fake = engine.engine
    if call == "resume":
        fake.resume_generation = _answers_nothing_once_dead(fake, call)
        caller = threading.Thread(target=engine._resume_after_fault, daemon=True)
    else:
        engine._in_flight.add("hpc-rlhf-0")  # a request of the engine that died
        fake.abort = _answers_nothing_once_dead(fake, call)
        caller = threading.Thread(target=engine._stop_engine, daemon=True)
    try:
        caller.start()
        _wait_for_call(fake, (f"{call} cancelled",))
        caller.join(timeout=30)
        assert not caller.is_alive()
        if call == "abort":
            assert engine.engine is None and ("shutdown",) in fake.calls
    finally:
        monkeypatch.setattr(vllm_server, "BEST_EFFORT_CALL_S", 1.0)  # a failed test ends, whatever the call does
        if engine.engine is not None:
            engine.close()
        else:
            engine._loop.call_soon_threadsafe(engine._loop.stop)
            engine._thread.join(timeout=30)


def test_from_spec_refuses_tensor_parallel_engines_per_rank(fake_vllm):
    from hpc_rlhf.config.schema import RunConfig
    from hpc_rlhf.trainers.rl.setup import vllm_engine_spec

    cfg = RunConfig.model_validate({"actor": {"pretrain": "/models/tiny"}, "rollout": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2"):
        VllmServerEngine.from_spec(vllm_engine_spec(cfg), local_rank=0)
    engine = VllmServerEngine.from_spec(vllm_engine_spec(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
        update={"tensor_parallel_size": 1})})), local_rank=3)
    try:
        args = engine.engine.args.kwargs
        assert args["tensor_parallel_size"] == 1 and args["weight_transfer_config"].kwargs == {"backend": "nccl"}
        assert args["dtype"] == "bfloat16"  # the trainer's ds.param_dtype=auto on GPU
    finally:
        engine.close()


def _model_dir(tmp_path, hidden_size: int, heads: int):
    (tmp_path / "config.json").write_text(
        f'{{"hidden_size": {hidden_size}, "num_attention_heads": {heads}, "model_type": "llama"}}')
    return str(tmp_path)


def test_from_spec_on_cpu_uses_gloo_and_the_trainers_keywords(fake_vllm, tmp_path, monkeypatch):
    from hpc_rlhf.config.schema import RunConfig
    from hpc_rlhf.rollout import vllm_external_launcher as vllm_rollout
    from hpc_rlhf.trainers.rl.setup import vllm_engine_spec

    monkeypatch.setattr(vllm_rollout, "resolve_cpu_attention_head_sizes", lambda: [32, 64, 128])
    cfg = RunConfig.model_validate({"actor": {"pretrain": _model_dir(tmp_path, 128, 2)},
                                    "vllm": {"kv_cache_memory_gib": 0.25, "enforce_eager": True},
                                    "data": {"prompt_max_len": 16}, "rollout": {"generate_max_len": 4}})
    engine = VllmServerEngine.from_spec(vllm_engine_spec(cfg), local_rank=None, max_model_len=64)
    try:
        args = engine.engine.args.kwargs
    finally:
        engine.close()
    assert engine.weight_transfer_backend == "gloo"
    assert args["weight_transfer_config"].kwargs == {"backend": "gloo"}
    assert args["dtype"] == "float32" and args["kv_cache_memory_bytes"] == 1 << 28
    assert args["max_model_len"] == 64 and args["enforce_eager"] is True  # keywords given override the config's


def test_from_spec_on_cpu_refuses_a_head_size_vllm_cannot_run(fake_vllm, tmp_path, monkeypatch):
    from hpc_rlhf.config.schema import RunConfig
    from hpc_rlhf.rollout import vllm_external_launcher as vllm_rollout
    from hpc_rlhf.trainers.rl.setup import vllm_engine_spec

    monkeypatch.setattr(vllm_rollout, "resolve_cpu_attention_head_sizes", lambda: [32, 64, 128])
    cfg = RunConfig.model_validate({"actor": {"pretrain": _model_dir(tmp_path, 64, 4)}})
    with pytest.raises(ValueError, match="actor.pretrain=.*head size 16"):
        VllmServerEngine.from_spec(vllm_engine_spec(cfg), local_rank=None)


def test_unknown_transfer_backend_is_refused(fake_vllm):
    with pytest.raises(ValueError, match="weight_transfer_backend='tcp'"):
        VllmServerEngine("/models/tiny", weight_transfer_backend="tcp")


def test_bucket_descriptions_are_read_on_the_calling_thread(fake_vllm):
    """The weight sync's descriptions may wait on the control plane: they must not be read on the engine's loop."""
    engine = VllmServerEngine("/models/tiny")
    fake = engine.engine
    engine.open_weight_channel(RENDEZVOUS[engine.weight_transfer_backend])
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
    assert [c for c in fake.calls if c[0] == "update"] == [("update", ["a"]), ("update", ["b"])]


# ---------------------------------------------------------------------------- the gloo backend without vLLM


def _mixed_bucket():
    """Three dtypes, interleaved, with a 0-d tensor: what a mixed-precision state dict may hold."""
    generator = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 4, generator=generator)),
            ("b", torch.randn(5, generator=generator).to(torch.bfloat16)),
            ("c", torch.arange(6, dtype=torch.int64).view(2, 3)),
            ("d", torch.randn(2, 2, generator=generator)),
            ("e", torch.tensor(1.5, dtype=torch.bfloat16))]


def test_a_bucket_travels_as_one_buffer_per_dtype():
    bucket = _mixed_bucket()
    tensors = [t for _, t in bucket]
    layout = bucket_layout([t.dtype for t in tensors])
    assert layout == [(torch.float32, [0, 3]), (torch.bfloat16, [1, 4]), (torch.int64, [2])]
    buffers = pack_by_dtype(tensors)
    assert [(b.dtype, b.numel()) for b in buffers] == [(torch.float32, 16), (torch.bfloat16, 6), (torch.int64, 6)]
    shapes, dtypes = [list(t.shape) for t in tensors], [t.dtype for t in tensors]
    assert [(b.dtype, b.numel()) for b in empty_buffers(shapes, dtypes)] == [(b.dtype, b.numel()) for b in buffers]
    for got, sent in zip(unpack_by_dtype(buffers, shapes, dtypes), tensors, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_unpacking_refuses_buffers_that_do_not_match_the_description():
    tensors = [t for _, t in _mixed_bucket()]
    shapes, dtypes = [list(t.shape) for t in tensors], [t.dtype for t in tensors]
    buffers = pack_by_dtype(tensors)
    with pytest.raises(ValueError, match="2 buffers for 3 dtypes"):
        unpack_by_dtype(buffers[:2], shapes, dtypes)
    with pytest.raises(ValueError, match="torch.float32 buffer of 16 elements"):
        unpack_by_dtype([buffers[0][:-1], *buffers[1:]], shapes, dtypes)
    with pytest.raises(ValueError, match="4 shapes for 5 dtypes"):
        unpack_by_dtype(buffers, shapes[:-1], dtypes)


def test_gloo_payloads_fail_naming_what_is_wrong():
    info = GlooWeightTransferUpdateInfo(**bucket_update_info(_mixed_bucket()))
    assert info.dtypes == [torch.float32, torch.bfloat16, torch.int64, torch.float32, torch.bfloat16]
    with pytest.raises(ValueError, match="'w' has dtype name 'float99'"):
        GlooWeightTransferUpdateInfo(names=["w"], dtype_names=["float99"], shapes=[[1]])
    with pytest.raises(ValueError, match="differ in length"):
        GlooWeightTransferUpdateInfo(names=["w", "v"], dtype_names=["float32"], shapes=[[1]])
    with pytest.raises(ValueError, match="rank_offset=0"):
        GlooWeightTransferInitInfo("h", 31000, CHANNEL, rank_offset=0, world_size=2)
    with pytest.raises(ValueError, match="world_size=1 leaves no rank"):
        GlooWeightTransferInitInfo("h", 31000, CHANNEL, rank_offset=1, world_size=1)
    with pytest.raises(ValueError, match="master_port=0"):
        GlooWeightTransferInitInfo("h", 0, CHANNEL, rank_offset=1, world_size=2)
    with pytest.raises(ValueError, match="channel='x' is shorter"):
        GlooWeightTransferInitInfo("h", 31000, "x", rank_offset=1, world_size=2)


def test_worker_ranks_are_unique_over_vllms_data_parallel_replicas():
    def config(dp, rank):
        return SimpleNamespace(data_parallel_index=dp, world_size=2, rank=rank)

    ranks = [worker_group_rank(config(dp, r), rank_offset=1) for dp in range(2) for r in range(2)]
    assert ranks == [1, 2, 3, 4]


def test_the_gloo_module_imports_no_vllm_until_vllm_asks_for_its_engine():
    """Actor ranks import it to send; vLLM's factory gets GlooWeightTransferEngine by attribute, built then."""
    import subprocess

    code = ("import sys, hpc_rlhf.weight_sync.vllm_gloo_transfer as m, hpc_rlhf.weight_sync.sharded\n"
            "assert 'vllm' not in sys.modules, 'vllm imported'\n"
            "assert 'GlooWeightTransferEngine' not in vars(m)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        vllm_gloo_transfer.Missing  # noqa: B018 - the access is the test


def test_a_bucket_crosses_a_gloo_group_between_sender_and_worker(monkeypatch):
    """Both ends of the wire in one process (two threads); no default process group exists or is needed (the job's
    secret, which init_world would export, is set by hand)."""
    monkeypatch.setenv("HPC_RLHF_JOB_SECRET", "a" * 64)
    channel = GlooSenderChannel(num_workers=1, timeout_s=60)
    where = channel.rendezvous
    bucket = _mixed_bucket()
    info = GlooWeightTransferUpdateInfo(**bucket_update_info(bucket))
    received = {}

    def worker():
        group = GlooGroup(where["master_address"], where["master_port"], rank=1, world_size=2, timeout_s=60,
                          channel=where["channel"])
        group.connect()
        for round_index in range(2):
            buffers = empty_buffers(info.shapes, info.dtypes)
            for buffer in buffers:
                group.broadcast(buffer, src=0)
            received[round_index] = unpack_by_dtype(buffers, info.shapes, info.dtypes)
        group.close()

    thread = threading.Thread(target=worker)
    thread.start()
    channel.connect()
    channel.send(bucket)
    channel.send([(name, tensor * 2) for name, tensor in bucket])
    thread.join(timeout=60)
    channel.close()
    assert not thread.is_alive()
    for round_index, scale in ((0, 1), (1, 2)):
        for got, (_, sent) in zip(received[round_index], bucket, strict=True):
            assert got.dtype == sent.dtype and torch.equal(got, sent * scale)


def test_channels_follow_the_hardware(monkeypatch):
    from hpc_rlhf.weight_sync import sharded as weight_sync

    opened = []
    monkeypatch.setattr(weight_sync, "GlooSenderChannel", lambda *a: opened.append(("gloo", a)))
    monkeypatch.setattr(weight_sync, "SenderChannel", lambda *a: opened.append(("nccl", a)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(weight_sync, "host_address", lambda: "h")
    weight_sync._open_vllm_channel(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    weight_sync._open_vllm_channel(2)
    assert opened == [("gloo", (1, "h")), ("nccl", (2,))]


# ---------------------------------------------------------------------------- restarts (engine_restart)


class DyingAsyncEngine(FakeAsyncEngine):
    """Streams one token per sample (logprob -0.5), then its engine core "dies" (``die=True``), or hangs
    (``hang=True``); an engine built later (a restart) generates every request to its length with token 9."""

    started: ClassVar[list[DyingAsyncEngine]] = []
    die = True
    hang = False

    def __init__(self, args):
        super().__init__(args)
        self.requests = []
        self.errored = False
        self.first = not DyingAsyncEngine.started
        DyingAsyncEngine.started.append(self)

    async def generate(self, prompt, sampling_params, request_id):
        kwargs = sampling_params.kwargs
        self.requests.append((list(prompt["prompt_token_ids"]), kwargs["max_tokens"], kwargs["n"], kwargs["seed"]))
        assert kwargs["output_kind"] == "delta"
        if self.first or DyingAsyncEngine.die == "always":
            yield FakeRequestOutput(request_id, prompt["prompt_token_ids"],
                                    [completion(j, [5], [-0.5], None) for j in range(kwargs["n"])])
            if DyingAsyncEngine.hang:
                await asyncio.sleep(3600)
            self.errored = True
            raise FakeEngineDead("EngineCore encountered an issue.")
        for j in range(kwargs["n"]):
            count = kwargs["max_tokens"]
            yield FakeRequestOutput(request_id, prompt["prompt_token_ids"],
                                    [completion(j, [9] * count, [-0.125] * count, "length")])


class RecordingRejoin:
    def __init__(self):
        self.calls = []

    def rejoin(self, engine, cause):
        self.calls.append(("rejoin", cause))
        engine.open_weight_channel(RENDEZVOUS[engine.weight_transfer_backend])

    def give_up(self, error):
        self.calls.append(("give_up", error))


@pytest.fixture()
def dying_vllm(fake_vllm, monkeypatch):
    DyingAsyncEngine.started = []
    monkeypatch.setattr(DyingAsyncEngine, "die", True)
    monkeypatch.setattr(DyingAsyncEngine, "hang", False)
    fake_vllm["vllm"].AsyncLLMEngine = DyingAsyncEngine
    monkeypatch.setattr(sys.modules["vllm"], "AsyncLLMEngine", DyingAsyncEngine)
    return DyingAsyncEngine


def test_a_dead_engine_is_restarted_and_its_requests_continue(dying_vllm):
    engine = VllmServerEngine("/models/tiny", max_restarts=1, name="rank 1's engine")
    hook = engine.rejoin = RecordingRejoin()
    try:
        results = engine.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=4, seed=10), n=2),
                                   GenerationRequest([3], SamplingParams(max_new_tokens=3, seed=None))])
    finally:
        engine.close()
    first, second = dying_vllm.started
    assert engine.restarts == 1 and first.calls[-1] == ("shutdown",)
    assert [c[0] for c in hook.calls] == ["rejoin"] and "engine-core process exited" in hook.calls[0][1]
    assert second.calls[0] == ("init", 2)  # the channel was opened again, before any request
    # each unfinished sample continues from the token that came back, asks for the rest, with its own seed
    assert sorted(second.requests) == [([1, 2, 5], 3, 1, 10), ([1, 2, 5], 3, 1, 11), ([3, 5], 2, 1, None)]
    assert [(r.request_index, r.output_ids, r.output_logprobs, r.finish_reason) for r in results] == [
        (0, [5, 9, 9, 9], [-0.5, -0.125, -0.125, -0.125], "length")] * 2 + [
        (1, [5, 9, 9], [-0.5, -0.125, -0.125], "length")]


def test_past_the_bound_the_engine_error_ends_the_call(dying_vllm, monkeypatch):
    from hpc_rlhf.rollout.engine_restart import EngineRestartLimitError

    monkeypatch.setattr(DyingAsyncEngine, "die", "always")
    engine = VllmServerEngine("/models/tiny", max_restarts=2, name="rank 1's engine")
    hook = engine.rejoin = RecordingRejoin()
    try:
        with pytest.raises(EngineRestartLimitError, match=r"rank 1's engine failed: vLLM's engine-core process exited"
                           r".*restarted 2 time\(s\), the bound rollout.max_engine_restarts=2") as err:
            engine.generate([GenerationRequest([1], SamplingParams(max_new_tokens=4))])
    finally:
        engine.close()
    assert isinstance(err.value.__cause__.__cause__, FakeEngineDead)  # the engine's own error stays attached
    assert [c[0] for c in hook.calls] == ["rejoin", "rejoin", "give_up"]
    assert len(dying_vllm.started) == 3


def test_a_silent_engine_counts_as_hung(dying_vllm, monkeypatch):
    monkeypatch.setattr(DyingAsyncEngine, "hang", True)
    engine = VllmServerEngine("/models/tiny", max_restarts=1, timeout_s=0.2)
    hook = engine.rejoin = RecordingRejoin()
    try:
        results = engine.generate([GenerationRequest([1], SamplingParams(max_new_tokens=2))])
    finally:
        engine.close()
    assert "no token for" in hook.calls[0][1] and "rollout.engine_timeout_s=0.2" in hook.calls[0][1]
    assert results[0].output_ids == [5, 9]


# ---------------------------------------------------------------------------- a death during a weight round


class RoundDyingEngine(FakeAsyncEngine):
    """Dies in its first ``update_weights`` while ``RoundDyingEngine.deaths`` is above 0: vLLM's engine-dead flag
    set, the call left pending (vLLM fails no pending call when its engine core dies)."""

    started: ClassVar[list[RoundDyingEngine]] = []
    deaths = 1

    def __init__(self, args):
        super().__init__(args)
        RoundDyingEngine.started.append(self)

    async def update_weights(self, request):
        if RoundDyingEngine.deaths > 0:
            RoundDyingEngine.deaths -= 1
            self.calls.append(("dies", request.update_info["names"]))
            self.errored = True
            await asyncio.sleep(3600)
        await super().update_weights(request)

    async def reset_prefix_cache(self):
        self.calls.append(("reset",))


ROUND = [[("a", torch.empty(2, device="meta"))], [("b", torch.empty(3, device="meta"))]]
WHOLE_ROUND = [("pause", "keep", True), ("start",), ("update", ["a"]), ("update", ["b"]), ("finish",), ("resume",)]


class RoundRejoin(RecordingRejoin):
    """The sender's side of a rejoin: the channel reopened and the whole current round sent."""

    def rejoin(self, engine, cause):
        super().rejoin(engine, cause)
        engine.receive_weights(ROUND)


@pytest.fixture()
def round_dying_vllm(fake_vllm, monkeypatch):
    RoundDyingEngine.started = []
    monkeypatch.setattr(RoundDyingEngine, "deaths", 1)
    monkeypatch.setattr(sys.modules["vllm"], "AsyncLLMEngine", RoundDyingEngine)
    return RoundDyingEngine


def _taken(drawn):
    """ROUND, each bucket's first name noted in ``drawn`` as the engine takes it (the sender's descriptions)."""
    for bucket in ROUND:
        drawn.append(bucket[0][0])
        yield bucket


def test_an_engine_lost_in_a_weight_round_generates_only_after_a_restart_with_the_whole_round(round_dying_vllm):
    engine = VllmServerEngine("/models/tiny", max_restarts=1, weight_transfer_backend="gloo", name="rank 1's engine")
    hook = engine.rejoin = RoundRejoin()
    try:
        engine.open_weight_channel(RENDEZVOUS[engine.weight_transfer_backend])
        drawn = []
        engine.receive_weights(_taken(drawn))  # returns although the engine died in it
        cause = "during a weight round (0 of 2 bucket(s) loaded), vLLM's engine-core process exited"
        assert drawn == ["a", "b"]  # the rest of the round went by: the sender finishes it
        assert not engine.alive() and engine.round_failure().cause == cause
        engine.reset_prefix_cache()  # nothing to reset on a dead engine
        results = engine.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=4, seed=1), n=2)])
        assert engine.alive() and engine.round_failure() is None
    finally:
        engine.close()
    first, second = round_dying_vllm.started
    assert first.calls == [("init", 2), ("pause", "keep", True), ("start",), ("dies", ["a"]), ("shutdown",)]
    assert engine.restarts == 1 and hook.calls == [("rejoin", cause)]
    # the new engine: channel, the whole round, and only then its requests
    assert second.calls[:7] == [("init", 2), *WHOLE_ROUND] and second.calls[7][0] == "generate"
    assert [r.output_ids for r in results] == [[7], [7]]


def test_an_engine_lost_again_while_it_rejoins_is_restarted_again_within_the_bound(round_dying_vllm, monkeypatch):
    monkeypatch.setattr(RoundDyingEngine, "deaths", 2)
    engine = VllmServerEngine("/models/tiny", max_restarts=2, weight_transfer_backend="gloo", name="rank 1's engine")
    hook = engine.rejoin = RoundRejoin()
    try:
        engine.open_weight_channel(RENDEZVOUS[engine.weight_transfer_backend])
        engine.receive_weights(ROUND)
        engine.generate([GenerationRequest([1], SamplingParams(max_new_tokens=2))])
    finally:
        engine.close()
    assert engine.restarts == 2 and len(round_dying_vllm.started) == 3
    assert [c[0] for c in hook.calls] == ["rejoin", "rejoin"]
    assert round_dying_vllm.started[1].calls[-2:] == [("dies", ["a"]), ("shutdown",)]
    assert round_dying_vllm.started[2].calls[1:7] == WHOLE_ROUND


def test_over_nccl_an_engine_lost_mid_round_ends_the_job_at_once(round_dying_vllm):
    from hpc_rlhf.rollout.weight_round_failure import WeightRoundError

    engine = VllmServerEngine("/models/tiny", max_restarts=3, weight_transfer_backend="nccl", name="rank 1's engine")
    engine.rejoin = RoundRejoin()
    try:
        engine.open_weight_channel(RENDEZVOUS[engine.weight_transfer_backend])
        drawn = []
        with pytest.raises(WeightRoundError, match=r"rank 1's engine died during a weight round, after 0 bucket\(s\) "
                           r"were loaded: vLLM's engine-core process exited\. Its workers share a nccl communicator"):
            engine.receive_weights(_taken(drawn))
    finally:
        engine.close()
    assert drawn == ["a"]  # nothing more is waited for from a sender left in its broadcast
    assert engine.restarts == 0 and len(round_dying_vllm.started) == 1


@pytest.mark.parametrize("backend, mode, colocate_all, expected", [
    ("transformers", "server_process", False, "transformers"), ("vllm", "auto", True, "vllm_external_launcher"),
    ("vllm", "auto", False, "vllm_server_process"), ("vllm", "server_process", True, "vllm_server_process")])
def test_one_engine_kind_decision(backend, mode, colocate_all, expected):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.rollout import rollout_engine_kind

    cfg = load_config(None, [f"rollout.backend={backend}", f"rollout.vllm_mode={mode}"])
    assert rollout_engine_kind(cfg.rollout, colocate_all) == expected
