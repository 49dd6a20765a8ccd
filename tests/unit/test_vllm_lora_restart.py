"""A vLLM engine in processes of its own restarted under ``ds.lora.sync=adapter``, without vLLM: the restarted engine
loads the base and then the last synced adapter again from its node-local folder, before it generates, and its
requests carry that adapter; an engine that dies before the first sync restarts on the base alone; one that dies
while loading an adapter, or is found dead at a sync, comes back with the adapter of that sync; a folder that lost
the adapter ends the job with an error naming it.

The fake engine (vLLM's ``AsyncLLMEngine`` surface, as in ``test_vllm_server.py``) reads the adapter's folder as vLLM
does, at ``add_lora`` and, for a request whose adapter it has not loaded, lazily at the request (vLLM's LRU worker
manager); every token it samples names the adapter it sampled with (``TOKEN_BASE + sync``, the base alone
``TOKEN_BASE``). A real engine killed mid-run is not covered here (see docs/lora.md)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import ClassVar

import pytest
import torch

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.engine_restart import EngineRestartLimitError
from hpc_rlhf.rollout.vllm_lora import ADAPTER_ID, ADAPTER_NAME, AdapterFolderLostError
from hpc_rlhf.rollout.vllm_server import VllmServerEngine
from tests.unit.test_vllm_external_launcher_contract import FakeRequestOutput, completion
from tests.unit.test_vllm_server import FakeAsyncEngine, FakeEngineDead, install_fake_vllm

TOKEN_BASE = 100
LORA = LoraConfig(rank=4, alpha=8)
A_NAME = "model.layers.0.self_attn.q_proj.lora_A.weight"


def adapter(sync: int) -> list[tuple[str, torch.Tensor]]:
    """The adapter of the ``sync``-th sync: its factors hold ``sync`` (what the fake engine reads back)."""
    return [(A_NAME, torch.full((4, 16), float(sync))),
            ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(16, 4))]


def read_sync(folder: str) -> int:
    """The sync whose adapter ``folder`` holds, read as vLLM would (raises when the files are gone)."""
    from safetensors.torch import load_file

    return int(load_file(os.path.join(folder, "adapter_model.safetensors"))["base_model.model." + A_NAME][0, 0])


class LoraEngine(FakeAsyncEngine):
    """Serves LoRA adapters from folders; ``LoraEngine.deaths`` lists where engines die, in start order: per engine,
    None (never), ``"generate"`` (after one token of each sample) or ``"add_lora"`` (in its first adapter load: the
    engine-dead flag set and the call left pending, as vLLM 0.32 leaves it); ``"refuse"`` fails its next adapter
    load without dying. A dead engine refuses further calls with ``EngineDeadError``, as vLLM's client does."""

    started: ClassVar[list[LoraEngine]] = []
    deaths: ClassVar[list[str | None]] = []

    def __init__(self, args):
        super().__init__(args)
        index = len(LoraEngine.started)
        self.death = LoraEngine.deaths[index] if index < len(LoraEngine.deaths) else None
        self.adapters: dict[int, int] = {}  # lora id -> the sync whose adapter it loaded
        self.requests = []  # (prompt, max_tokens, the request's LoRARequest keywords or None)
        self.dead = asyncio.Event()
        LoraEngine.started.append(self)

    def _alive(self):
        if self.errored:
            raise FakeEngineDead("EngineCore encountered an issue.")

    def _load(self, request, how):
        self.adapters[request.kwargs["lora_int_id"]] = read_sync(request.kwargs["lora_path"])
        self.calls.append((how, self.adapters[request.kwargs["lora_int_id"]], request.kwargs["load_inplace"]))

    def _die(self):
        self.errored = True
        self.dead.set()

    async def add_lora(self, request):
        self._alive()
        if self.death == "refuse":
            self.death = None
            raise ValueError("LoRA rank 64 is greater than max_lora_rank 8")
        if self.death == "add_lora":
            self.death = None
            self.calls.append(("dies", "add_lora"))
            self._die()
            await asyncio.sleep(3600)
        self._load(request, "add_lora")
        return True

    async def pause_generation(self, *, mode, clear_cache):
        self._alive()
        await super().pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume_generation(self):
        self._alive()
        await super().resume_generation()

    async def generate(self, prompt, sampling_params, request_id, lora_request=None):
        self._alive()
        self.calls.append(("generate", request_id))
        kwargs = sampling_params.kwargs
        self.requests.append((list(prompt["prompt_token_ids"]), kwargs["max_tokens"],
                              None if lora_request is None else dict(lora_request.kwargs)))
        if lora_request is not None and lora_request.kwargs["lora_int_id"] not in self.adapters:
            self._load(lora_request, "lazy_load")  # vLLM loads a request's adapter it does not hold yet
        token = TOKEN_BASE + (self.adapters[lora_request.kwargs["lora_int_id"]] if lora_request else 0)
        n = kwargs["n"]
        if self.death == "generate":
            self.death = None
            yield FakeRequestOutput(request_id, prompt["prompt_token_ids"],
                                    [completion(j, [token], [-0.5], None) for j in range(n)])
            await self.held()
            self._die()
            raise FakeEngineDead("EngineCore encountered an issue.")
        count = kwargs["max_tokens"]
        yield FakeRequestOutput(request_id, prompt["prompt_token_ids"],
                                [completion(j, [token] * count, [-0.125] * count, "length") for j in range(n)])

    async def held(self):
        """Where a dying generation waits before it dies (a test may hold it in flight)."""


@pytest.fixture()
def lora_vllm(monkeypatch, tmp_path):
    from types import ModuleType

    install_fake_vllm(monkeypatch)
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path))  # where the engine's adapter folder goes

    class LoRARequest:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    module = ModuleType("vllm.lora.request")
    module.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora.request", module)
    monkeypatch.setattr(sys.modules["vllm"], "AsyncLLMEngine", LoraEngine)
    monkeypatch.setattr(LoraEngine, "started", [])
    monkeypatch.setattr(LoraEngine, "deaths", [])
    return LoraEngine


def _engine(tmp_path, max_restarts=1):
    engine = VllmServerEngine("/models/tiny", lora=LORA, max_restarts=max_restarts, name="rank 1's engine")
    assert os.path.dirname(engine.adapter.folder) == str(tmp_path)  # the test's node-local storage
    return engine


def _generate(engine):
    return engine.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=4, seed=3), n=2)])


def _in_thread(call, timeout_s=30.0):
    """``call()`` on a thread; fails the test (instead of hanging it) when it does not return in ``timeout_s``."""
    outcome = {}

    def run():
        try:
            outcome["result"] = call()
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{call} did not return within {timeout_s} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


POLICY = {"lora_name": ADAPTER_NAME, "lora_int_id": ADAPTER_ID, "load_inplace": False}


def _carried(engine_requests):
    """The adapter each request carried: (name, id, in-place) or None."""
    return [None if lora is None else {k: lora[k] for k in POLICY} for _, _, lora in engine_requests]


def test_a_restarted_engine_loads_the_latest_adapter_before_it_generates(lora_vllm, tmp_path):
    lora_vllm.deaths = ["generate"]
    engine = _engine(tmp_path)
    folder = engine.adapter.folder
    try:
        engine.update_adapter(adapter(1))
        engine.update_adapter(adapter(2))
        results = _generate(engine)
        assert engine.restarts == 1
        assert read_sync(folder) == 2  # the dead engine's stop left the folder alone
    finally:
        engine.close()
    assert not os.path.exists(folder)  # removed at close
    dead, new = lora_vllm.started
    assert [c for c in dead.calls if c[0] == "add_lora"] == [("add_lora", 1, True), ("add_lora", 2, True)]
    # the new engine: the latest adapter loaded in place from the folder, before its first request
    assert new.calls[0] == ("add_lora", 2, True) and new.calls[1][0] == "generate"
    assert not [c for c in new.calls if c[0] == "lazy_load"]
    # its requests (the continuations of both samples) carry that adapter, under the name and id it was loaded as
    assert _carried(new.requests) == [POLICY, POLICY]
    assert all(lora["lora_path"] == folder for _, _, lora in new.requests)
    # one token sampled with adapter 2 before the death, the rest with adapter 2 after the restart
    assert [r.output_ids for r in results] == [[TOKEN_BASE + 2] * 4] * 2


def test_an_engine_that_dies_before_the_first_sync_restarts_on_the_base(lora_vllm, tmp_path):
    lora_vllm.deaths = ["generate"]
    engine = _engine(tmp_path)
    try:
        results = _generate(engine)
        new = lora_vllm.started[1]
        assert engine.restarts == 1 and not [c for c in new.calls if c[0] == "add_lora"]
        assert _carried(new.requests) == [None, None]  # no adapter yet: the base is the policy
        assert [r.output_ids for r in results] == [[TOKEN_BASE] * 4] * 2
        engine.update_adapter(adapter(1))  # the first sync reaches the new engine
        assert [r.output_ids for r in _generate(engine)] == [[TOKEN_BASE + 1] * 4] * 2
    finally:
        engine.close()
    assert [c for c in new.calls if c[0] != "generate"] == [("pause", "keep", True), ("add_lora", 1, True),
                                                             ("resume",), ("shutdown",)]


@pytest.mark.parametrize("syncs_before", [0, 1])
def test_an_engine_that_dies_loading_an_adapter_comes_back_with_that_adapter(lora_vllm, tmp_path, syncs_before):
    """The first sync's load (no adapter yet) or a later one: vLLM leaves the load pending for good; the sync
    returns, the engine restarted with the adapter of that sync."""
    engine = _engine(tmp_path)
    latest = syncs_before + 1
    try:
        for sync in range(1, latest):
            engine.update_adapter(adapter(sync))
        lora_vllm.started[0].death = "add_lora"
        assert _in_thread(lambda: engine.update_adapter(adapter(latest))) == 2 * 64 * 4
        assert engine.restarts == 1 and engine.alive()
        results = _generate(engine)
    finally:
        engine.close()
    dead, new = lora_vllm.started
    assert dead.calls[-3:] == [("pause", "keep", True), ("dies", "add_lora"), ("shutdown",)]  # no resume: dead
    assert new.calls[0] == ("add_lora", latest, True)
    assert _carried(new.requests) == [POLICY]
    assert [r.output_ids for r in results] == [[TOKEN_BASE + latest] * 4] * 2


def test_an_engine_found_dead_at_a_sync_is_restarted_with_the_new_adapter(lora_vllm, tmp_path):
    """Adapter sync has no service point: an engine that died while idle is noticed by the next sync."""
    engine = _engine(tmp_path)
    try:
        engine.update_adapter(adapter(1))
        dead = lora_vllm.started[0]
        dead.errored = True  # its engine core exited after the last generation
        engine.update_adapter(adapter(2))
        assert engine.restarts == 1
        results = _generate(engine)
    finally:
        engine.close()
    # its one sync, then only the stop: the second sync found it dead and asked it nothing
    assert dead.calls == [("pause", "keep", True), ("add_lora", 1, True), ("resume",), ("shutdown",)]
    new = lora_vllm.started[1]
    assert new.calls[0] == ("add_lora", 2, True)
    assert [r.output_ids for r in results] == [[TOKEN_BASE + 2] * 4] * 2


def test_a_new_engine_that_dies_reloading_the_adapter_is_restarted_again(lora_vllm, tmp_path):
    lora_vllm.deaths = ["generate", "add_lora"]
    engine = _engine(tmp_path, max_restarts=2)
    try:
        engine.update_adapter(adapter(1))
        results = _generate(engine)
    finally:
        engine.close()
    assert engine.restarts == 2 and len(lora_vllm.started) == 3
    assert lora_vllm.started[1].calls == [("dies", "add_lora"), ("shutdown",)]
    assert lora_vllm.started[2].calls[0] == ("add_lora", 1, True)
    assert [r.output_ids for r in results] == [[TOKEN_BASE + 1] * 4] * 2


def test_a_death_in_an_adapter_load_past_the_bound_names_the_engine_and_the_load(lora_vllm, tmp_path):
    lora_vllm.deaths = ["add_lora"]
    engine = _engine(tmp_path, max_restarts=0)
    try:
        with pytest.raises(EngineRestartLimitError, match=r"rank 1's engine failed: at a LoRA adapter load, "
                           r"vLLM's engine-core process exited; it was restarted 0 time\(s\)"):
            _in_thread(lambda: engine.update_adapter(adapter(1)))
    finally:
        engine.close()


def test_an_adapter_the_engine_refuses_is_reported_and_restarts_nothing(lora_vllm, tmp_path):
    engine = _engine(tmp_path)
    try:
        engine.update_adapter(adapter(1))
        lora_vllm.started[0].death = "refuse"
        with pytest.raises(ValueError, match="greater than max_lora_rank"):
            engine.update_adapter(adapter(2))
        assert engine.restarts == 0 and engine.alive()
    finally:
        engine.close()
    assert lora_vllm.started[0].calls[-3:] == [("pause", "keep", True), ("resume",), ("shutdown",)]  # resumed


def test_a_restart_whose_adapter_folder_is_gone_ends_with_an_error_naming_it(lora_vllm, tmp_path):
    lora_vllm.deaths = ["generate"]
    engine = _engine(tmp_path)
    folder = engine.adapter.folder
    try:
        engine.update_adapter(adapter(1))
        os.remove(os.path.join(folder, "adapter_model.safetensors"))  # e.g. a cleaner of the temporary directory
        with pytest.raises(AdapterFolderLostError, match=rf"rank 1's engine was restarted, but the folder of its LoRA "
                           rf"adapter {folder} lost adapter_model.safetensors \(ds.lora.sync=adapter\)"):
            _generate(engine)
    finally:
        engine.close()
    assert not [c for c in lora_vllm.started[1].calls if c[0] in ("generate", "lazy_load")]  # nothing generated


def test_a_load_that_kills_the_engine_under_a_generation_in_flight_restarts_it_once(lora_vllm, tmp_path):
    """The asynchronous trainer syncs while requests are in flight: both the sync and the generation see the death;
    the engine is restarted once, with the new adapter, and the requests continue on it."""
    engine = _engine(tmp_path)
    try:
        engine.update_adapter(adapter(1))
        first = lora_vllm.started[0]
        first.death = "generate"
        in_flight = threading.Event()

        async def held():  # the generation stays in flight until the engine dies
            in_flight.set()
            await first.dead.wait()

        first.held = held
        pending = engine.submit([GenerationRequest([1, 2], SamplingParams(max_new_tokens=4, seed=3), n=2)])
        assert in_flight.wait(timeout=30)
        first.death = "add_lora"
        _in_thread(lambda: engine.update_adapter(adapter(2)))
        results = pending.result(timeout=30)
    finally:
        engine.close()
    assert engine.restarts == 1 and len(lora_vllm.started) == 2
    new = lora_vllm.started[1]
    assert new.calls[0] == ("add_lora", 2, True) and _carried(new.requests) == [POLICY, POLICY]
    # a token of adapter 1 came back before the death; the continuation sampled with adapter 2
    assert [r.output_ids for r in results] == [[TOKEN_BASE + 1] + [TOKEN_BASE + 2] * 3] * 2
