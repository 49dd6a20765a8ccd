"""Every vLLM name, keyword and attribute path the engines use, in one table.

The engines resolve vLLM objects through :func:`resolve`, which refuses a path missing from
:data:`VLLM_NAMES`, and call instance methods listed here (``tests/unit/test_vllm_api.py`` scans the
engine sources for method calls on vLLM objects and fails on one the table lacks). Keyword sets that
the engines build at run time (``LLM`` / ``AsyncEngineArgs`` keywords, ``SamplingParams`` fields,
weight-transfer payloads) are not copied here: the contract script computes them by calling the
engines' own pure helpers. ``python -m hpc_rlhf.rollout.vllm_contract`` checks the table against an
installed vLLM.

Path syntax: ``"module:Attr.attr"``; ``params`` are the keyword / positional names our calls pass,
``fields`` the attributes we read on objects vLLM returns.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmName:
    path: str
    params: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    why: str = ""


_NAMES = (
    # ---- in-process engine (external launcher, colocated): hpc_rlhf.rollout.vllm_external_launcher
    VllmName("vllm:LLM", why="in-process engine; keywords: vllm_external_launcher.llm_kwargs"),
    VllmName("vllm:LLM.generate", ("prompts", "sampling_params", "use_tqdm", "lora_request")),
    VllmName("vllm:LLM.collective_rpc", ("method", "args")),
    VllmName("vllm:LLM.sleep", ("level",)),
    VllmName("vllm:LLM.wake_up", ("tags",)),
    VllmName("vllm:LLM.reset_prefix_cache"),
    VllmName("vllm:SamplingParams", why="fields: vllm_external_launcher.vllm_sampling_kwargs"),
    VllmName("vllm:TokensPrompt", ("prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"),
             fields=("prompt_token_ids",), why="keywords: vllm_images.tokens_prompt_kwargs"),
    VllmName("vllm.outputs:RequestOutput", fields=("outputs", "finished", "request_id")),
    VllmName("vllm.outputs:CompletionOutput", fields=("index", "token_ids", "logprobs", "finish_reason",
                                                      "routed_experts")),
    VllmName("vllm.config:AuxOutputConfig", fields=("enable_return_routed_experts",),
             why="routing replay: EngineArgs.enable_return_routed_experts sets it (vllm_external_launcher."
                 "routed_experts_kwargs)"),
    VllmName("vllm.logprobs:Logprob", fields=("logprob",)),
    VllmName("vllm.v1.engine.llm_engine:LLMEngine", fields=("engine_core",), why="LLM.llm_engine: close()"),
    VllmName("vllm.v1.engine.core_client:InprocClient.shutdown"),
    # ds.lora.sync=adapter (both engines, hpc_rlhf.rollout.vllm_lora): the adapter loaded again in place from a folder
    VllmName("vllm.v1.engine.llm_engine:LLMEngine.add_lora", ("lora_request",), why="LLM.llm_engine.add_lora"),
    VllmName("vllm.lora.request:LoRARequest", ("lora_name", "lora_int_id", "lora_path", "load_inplace")),
    # the weight round collective_rpc runs on each worker: worker.reload_weights (layerwise reload), then the tied
    # LM head processed again (vllm_external_launcher.refresh_tied_layers)
    VllmName("vllm.v1.worker.gpu_worker:Worker", fields=("model_runner",)),
    VllmName("vllm.v1.worker.gpu_worker:Worker.reload_weights", why="passes weights_iterator= to the runner's"),
    VllmName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", fields=("model",)),
    VllmName("vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights", ("weights_iterator",)),
    VllmName("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod",
             why="isinstance: the tied LM head's method"),
    VllmName("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.process_weights_after_loading",
             ("layer",)),
    # CPU mixture-of-experts layers packed again after a reload (vllm_external_launcher.repack_cpu_experts)
    VllmName("vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase", fields=("moe_kernel",)),
    VllmName("vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEKernel", fields=("fused_experts",)),
    VllmName("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts",
             why="isinstance: the experts kernel whose packed weights a reload leaves stale"),
    VllmName("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.process_weights_after_loading",
             ("layer",)),
    VllmName("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_supported_head_sizes",
             why="CPU runs: the head sizes vLLM's CPU attention runs, checked before the engine starts"),
    # ---- out-of-process engine (server_process: disaggregated, async, partial): hpc_rlhf.rollout.vllm_server
    VllmName("vllm:AsyncEngineArgs", why="keywords: vllm_server_launch.server_engine_kwargs"),
    VllmName("vllm:AsyncLLMEngine.from_engine_args", ("engine_args",)),
    VllmName("vllm:AsyncLLMEngine.generate", ("prompt", "sampling_params", "request_id", "lora_request")),
    VllmName("vllm:AsyncLLMEngine.add_lora", ("lora_request",)),
    VllmName("vllm:AsyncLLMEngine.abort", ("request_id",)),
    VllmName("vllm:AsyncLLMEngine.pause_generation", ("mode", "clear_cache")),
    VllmName("vllm:AsyncLLMEngine.resume_generation"),
    VllmName("vllm:AsyncLLMEngine.init_weight_transfer_engine", ("request",)),
    VllmName("vllm:AsyncLLMEngine.start_weight_update"),
    VllmName("vllm:AsyncLLMEngine.update_weights", ("request",)),
    VllmName("vllm:AsyncLLMEngine.finish_weight_update"),
    VllmName("vllm:AsyncLLMEngine.reset_prefix_cache"),
    VllmName("vllm:AsyncLLMEngine.shutdown"),
    VllmName("vllm:AsyncLLMEngine", fields=("errored",), why="server_process: whether the engine-core process died"),
    VllmName("vllm.sampling_params:RequestOutputKind.FINAL_ONLY"),
    VllmName("vllm.sampling_params:RequestOutputKind.DELTA",
             why="server_process: tokens stream back as sampled, so an engine restart keeps them (engine_restart)"),
    VllmName("vllm.v1.engine.exceptions:EngineDeadError", why="server_process: the engine-core process died"),
    VllmName("vllm.config:WeightTransferConfig", ("backend",)),
    VllmName("vllm.distributed.weight_transfer.base:WeightTransferInitRequest", ("init_info",)),
    VllmName("vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest", ("update_info",)),
    VllmName("vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferInitInfo",
             why="fields: vllm_transfer_info.worker_init_info"),
    VllmName("vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferUpdateInfo",
             why="fields: vllm_transfer_info.bucket_update_info"),
    VllmName("vllm.distributed.device_communicators.pynccl_wrapper:NCCLLibrary",
             why="vllm_nccl_transfer.mint_unique_id: the sender mints the channel's NCCL unique id"),
    VllmName("vllm.distributed.device_communicators.pynccl_wrapper:NCCLLibrary.ncclGetUniqueId"),
    VllmName("vllm.distributed.device_communicators.pynccl:PyNcclCommunicator",
             why="vllm_nccl_transfer.SenderChannel: joins by unique id, no TCP store (its workers would unpickle it)"),
    VllmName("vllm.distributed.device_communicators.pynccl:PyNcclCommunicator.from_unique_id_bytes",
             ("unique_id_bytes", "rank", "world_size", "device")),
    VllmName("vllm.distributed.weight_transfer.packed_tensor:packed_nccl_broadcast_producer",
             ("iterator", "group", "src", "post_iter_func", "buffer_size_bytes", "num_buffers")),
    # ---- the gloo weight-transfer backend (CPU server_process engines): hpc_rlhf.weight_sync.vllm_gloo_transfer, built
    # in vLLM's workers through hpc_rlhf.rollout.vllm_plugin
    VllmName("vllm.distributed.weight_transfer.base:WeightTransferEngine",
             fields=("model", "model_config", "parallel_config", "device", "parse_update_info"),
             why="base class of GlooWeightTransferEngine; vLLM sets these fields before calling it"),
    VllmName("vllm.config:ParallelConfig", fields=("data_parallel_index", "world_size", "rank"),
             why="gloo worker: its rank in the transfer group (vllm_gloo_transfer.worker_group_rank)"),
    VllmName("vllm.model_executor.model_loader.reload:initialize_layerwise_reload", ("model",)),
    VllmName("vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
             why="called as (model, model_config); it forwards them to finalize_layerwise_processing"),
    VllmName("vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check",
             why="gloo worker: a bucket is a partial checkpoint"),
    VllmName("vllm.model_executor.models.llama:LlamaForCausalLM.load_weights", ("weights",),
             why="gloo worker: model.load_weights(weights=...) per bucket (any model's; Llama checked)"),
)

VLLM_NAMES: dict[str, VllmName] = {name.path: name for name in _NAMES}

# Sleep-mode tags the engines pass to wake_up (rollout.base.WAKE_TAGS), and the pause mode of in-flight
# weight updates (vllm_server): both are string literals of vLLM's API, checked by the contract.
SLEEP_TAGS = ("weights", "kv_cache")
PAUSE_MODE = "keep"


def resolve(path: str) -> Any:
    """The vLLM object at ``path`` (``"module:Attr.attr"``); the path must be declared in :data:`VLLM_NAMES`."""
    if path not in VLLM_NAMES:
        raise KeyError(f"{path!r} is not declared in hpc_rlhf.rollout.vllm_api.VLLM_NAMES; declare it there so "
                       "that python -m hpc_rlhf.rollout.vllm_contract checks it against vLLM")
    module_name, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj
