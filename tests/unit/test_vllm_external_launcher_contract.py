"""VllmRolloutEngine contract without vLLM: parameter translation, output conversion, lazy import.

The fakes mirror vLLM's documented shapes: ``RequestOutput.outputs`` is a list of
``CompletionOutput(index, token_ids, logprobs, finish_reason)`` and ``logprobs`` is, per generated
position, a ``dict[token_id, Logprob]`` (with ``logprobs=0`` it holds just the sampled token).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.vllm_external_launcher import (
    VLLM_INSTALL_HINT,
    VllmRolloutEngine,
    import_vllm,
    results_from_vllm_outputs,
    to_vllm_sampling_params,
    vllm_sampling_kwargs,
)


@dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion] = field(default_factory=list)


class RecordingSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def completion(index, tokens, logprobs, reason, distractor=None):
    entries = []
    for t, lp in zip(tokens, logprobs):
        entry = {t: FakeLogprob(lp, rank=1)}
        if distractor is not None and distractor != t:  # vLLM may add top-k entries besides the sampled one
            entry[distractor] = FakeLogprob(-0.01, rank=1)
        entries.append(entry)
    return FakeCompletion(index, tokens, entries, reason)


def test_sampling_params_translation():
    params = SamplingParams(max_new_tokens=17, temperature=0.7, top_p=0.9, top_k=40, stop_token_ids=[2, 5], seed=11)
    sp = to_vllm_sampling_params(params, 4, sampling_params_cls=RecordingSamplingParams)
    assert sp.kwargs == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_tokens": 17, "stop_token_ids": [2, 5],
        "logprobs": 0, "seed": 11, "detokenize": False,
    }
    defaults = vllm_sampling_kwargs(SamplingParams(max_new_tokens=3), 1)
    assert defaults["top_k"] == -1 and defaults["top_p"] == 1.0 and defaults["seed"] is None
    # the caller's list is copied, not aliased
    assert vllm_sampling_kwargs(params, 1)["stop_token_ids"] is not params.stop_token_ids


def test_outputs_to_results_order_and_logprobs():
    requests = [GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=3, stop_token_ids=[9]), n=3),
                GenerationRequest([4], SamplingParams(max_new_tokens=2), n=1)]
    outputs = [
        FakeRequestOutput("0", [1, 2, 3], [  # deliberately out of index order
            completion(2, [7, 9], [-0.5, -0.25], "stop"),
            completion(0, [5, 6, 7], [-1.0, -2.0, -3.0], "length", distractor=6),
            completion(1, [8, 8, 9], [-0.1, -0.2, -0.3], "length"),  # stop token on the last slot
        ]),
        FakeRequestOutput("1", [4], [completion(0, [3, 3], [-0.7, -0.8], "length")]),
    ]
    results = results_from_vllm_outputs(outputs, requests)
    assert [r.request_index for r in results] == [0, 0, 0, 1]
    assert [r.output_ids for r in results] == [[5, 6, 7], [8, 8, 9], [7, 9], [3, 3]]
    assert [r.output_logprobs for r in results] == [[-1.0, -2.0, -3.0], [-0.1, -0.2, -0.3], [-0.5, -0.25],
                                                    [-0.7, -0.8]]
    assert [r.finish_reason for r in results] == ["length", "stop", "stop", "length"]
    assert results[0].prompt_ids == [1, 2, 3] and results[3].prompt_ids == [4]
    assert results[0].prompt_ids is not requests[0].prompt_ids


def test_outputs_to_results_rejects_malformed():
    request = GenerationRequest([1], SamplingParams(max_new_tokens=2), n=2)
    one_sample = FakeRequestOutput("0", [1], [completion(0, [3], [-0.1], "length")])
    with pytest.raises(ValueError, match="n=2"):
        results_from_vllm_outputs([one_sample], [request])
    with pytest.raises(ValueError, match="2 requests"):
        results_from_vllm_outputs([one_sample], [request, request])
    single = GenerationRequest([1], SamplingParams(max_new_tokens=2))
    no_logprobs = FakeRequestOutput("0", [1], [FakeCompletion(0, [3], None, "length")])
    with pytest.raises(ValueError, match="no logprobs"):
        results_from_vllm_outputs([no_logprobs], [single])
    missing = FakeRequestOutput("0", [1], [FakeCompletion(0, [3], [{4: FakeLogprob(-1.0)}], "length")])
    with pytest.raises(ValueError, match="sampled token 3"):
        results_from_vllm_outputs([missing], [single])
    aborted = FakeRequestOutput("0", [1], [completion(0, [3], [-0.1], "abort")])
    with pytest.raises(RuntimeError, match="abort"):
        results_from_vllm_outputs([aborted], [single])


def test_missing_vllm_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install hpc-rlhf\[gpu\]"):
        import_vllm()
    with pytest.raises(ImportError, match=r"pip install hpc-rlhf\[gpu\]"):
        VllmRolloutEngine("/nonexistent/model")
    with pytest.raises(ImportError, match=r"pip install hpc-rlhf\[gpu\]"):
        to_vllm_sampling_params(SamplingParams(max_new_tokens=1))
    assert "rollout.backend=transformers" in VLLM_INSTALL_HINT


def test_module_import_is_light():
    code = ("import sys, hpc_rlhf.rollout.vllm_external_launcher, hpc_rlhf.rollout.base; "
            "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class FakeLLM:
    """Records the calls VllmRolloutEngine makes on ``vllm.LLM``."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        self.loaded = []

    def generate(self, prompts, sampling_params, use_tqdm):
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts]))
        return [FakeRequestOutput(str(i), p["prompt_token_ids"],
                                  [completion(j, [1], [-0.5], "length") for j in range(sp.kwargs["n"])])
                for i, (p, sp) in enumerate(zip(prompts, sampling_params))]

    def collective_rpc(self, method, args=(), kwargs=None):
        """Records the call and consumes the weights; the worker-side function itself runs against a real engine
        (tests/multiproc/test_vllm_colocated.py)."""
        self.calls.append(("collective_rpc",))
        self.loaded.extend(args[0])
        return [None]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture()
def fake_vllm_engine(monkeypatch):
    fake = SimpleNamespace(LLM=FakeLLM, SamplingParams=RecordingSamplingParams, TokensPrompt=dict)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    return VllmRolloutEngine("/models/tiny", tensor_parallel_size=2, seed=5, gpu_memory_utilization=0.4)


def test_engine_wiring_with_fake_vllm(fake_vllm_engine):
    engine = fake_vllm_engine
    llm = engine.llm
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.kwargs["tensor_parallel_size"] == 2 and llm.kwargs["seed"] == 5
    assert llm.kwargs["enable_sleep_mode"] is True and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    results = engine.generate([GenerationRequest([3, 4], SamplingParams(max_new_tokens=1), n=2)])
    assert [r.request_index for r in results] == [0, 0] and results[0].output_logprobs == [-0.5]

    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=1))])
    engine.wake_up(tags=["weights"])
    engine.wake_up(tags=["kv_cache"])
    engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=1))])
    names = [c[0] for c in llm.calls]
    assert names == ["generate", "sleep", "wake_up", "wake_up", "generate"]
    # What update_weights loads, and that vLLM then samples with it, is checked against a real engine:
    # tests/multiproc/test_vllm_colocated.py.


def _model_folder(path, hidden_size: int, heads: int):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden_size, "num_attention_heads": heads}))
    return str(path)


def test_from_spec_maps_sections(monkeypatch, tmp_path):
    from hpc_rlhf.config.schema import RunConfig
    from hpc_rlhf.rollout import vllm_external_launcher as vllm_rollout
    from hpc_rlhf.trainers.rl.setup import vllm_engine_spec

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(vllm_rollout, "resolve_cpu_attention_head_sizes", lambda: [32, 64])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    model = _model_folder(tmp_path / "tiny", 128, 2)
    cfg = RunConfig.model_validate({
        "actor": {"pretrain": model},
        "rollout": {"backend": "vllm", "tensor_parallel_size": 2, "generate_max_len": 64},
        "vllm": {"gpu_memory_utilization": 0.3, "enforce_eager": True, "enable_prefix_caching": False},
        "data": {"prompt_max_len": 100},
        "train": {"seed": 9},
    })
    kwargs = VllmRolloutEngine.from_spec(vllm_engine_spec(cfg)).llm.kwargs
    assert kwargs["model"] == model and kwargs["tensor_parallel_size"] == 2 and kwargs["seed"] == 9
    assert kwargs["gpu_memory_utilization"] == 0.3 and kwargs["enforce_eager"] is True
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_model_len"] == 164
    # CPU: the trainer's fp32 (vLLM would pick the model's bf16), and no sleep mode (vLLM refuses it off CUDA)
    assert kwargs["dtype"] == "float32" and kwargs["enable_sleep_mode"] is False
    # CPU: prompts prefilled whole (a seeded request cut by chunked prefill kills vLLM's CPU worker)
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 2048
    assert "kv_cache_memory_bytes" not in kwargs
    cfg.vllm.kv_cache_memory_gib = 0.25
    assert VllmRolloutEngine.from_spec(vllm_engine_spec(cfg)).llm.kwargs["kv_cache_memory_bytes"] == 1 << 28
    with pytest.raises(ValueError, match="actor.pretrain"):
        VllmRolloutEngine.from_spec(vllm_engine_spec(RunConfig()))


def test_cpu_head_size_is_checked_before_the_engine_starts(monkeypatch, tmp_path):
    from hpc_rlhf.config.schema import RunConfig
    from hpc_rlhf.rollout import vllm_external_launcher as vllm_rollout
    from hpc_rlhf.trainers.rl.setup import vllm_engine_spec

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(vllm_rollout, "resolve_cpu_attention_head_sizes", lambda: [32, 64])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    model = _model_folder(tmp_path / "tiny16", 64, 4)  # the default tiny model: head size 16
    cfg = RunConfig.model_validate({"actor": {"pretrain": model}, "rollout": {"backend": "vllm"}})
    with pytest.raises(ValueError, match=r"actor.pretrain=.*tiny16: attention head size 16 .*supported: 32, 64"):
        VllmRolloutEngine.from_spec(vllm_engine_spec(cfg))


def test_engine_dtype_follows_the_trainer():
    from hpc_rlhf.rollout.vllm_external_launcher import engine_dtype

    assert engine_dtype("auto", on_gpu=False) == "float32" and engine_dtype("auto", on_gpu=True) == "bfloat16"
    assert engine_dtype("fp32", on_gpu=True) == "float32"
