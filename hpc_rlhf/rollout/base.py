"""The rollout interface: token ids in, token ids and per-token logprobs out.

Every rollout backend (vLLM on GPU, the hand-written transformers engine anywhere) implements
:class:`RolloutEngine`. The controller and agent executors only ever see these types; no backend
object leaks out. What an agent executor makes of the results, one :class:`Trajectory` per sample, is
defined here too: it is what the trainer consumes. This module imports no torch at runtime so that the
controller can build requests on a process that never loads a model.

Conventions shared by all engines (tests hold both engines to them):

* ``GenerationRequest`` ``i`` with ``n`` samples yields ``n`` consecutive ``GenerationResult`` with
  ``request_index == i``, in request order.
* ``output_logprobs[t]`` is the logprob of ``output_ids[t]`` under the *temperature-scaled* full
  distribution ``log_softmax(logits / temperature)`` - the same quantity the trainer recomputes for
  the importance ratio. ``top_p`` / ``top_k`` change which tokens can be *sampled*, not the reported
  logprob (see each engine for the exact vLLM caveat). With ``temperature == 0`` (greedy) the logprob
  is taken from the unscaled distribution (temperature treated as 1).
* A generation ends when a token of ``stop_token_ids`` (or the engine's eos) is produced - that token
  *is* included in ``output_ids`` with its logprob, ``finish_reason == "stop"`` - or when
  ``max_new_tokens`` tokens were produced without one, ``finish_reason == "length"``. A stop token that
  is also the last allowed token counts as ``"stop"``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from hpc_rlhf.config.rollout import RolloutConfig
    from hpc_rlhf.rollout.visual import PromptVisual

# "placeholder": cut before a vision placeholder token the engine sampled (hpc_rlhf.rollout.placeholder_tokens)
FinishReason = Literal["stop", "length", "placeholder"]
# What ``RolloutEngine.wake_up`` can restore separately (vLLM's sleep-mode tags).
WAKE_TAGS = ("weights", "kv_cache")


@dataclass
class SamplingParams:
    """Per-request sampling parameters (a subset of vLLM's, same meaning).

    ``top_k == -1`` and ``top_p == 1.0`` disable truncation; ``temperature == 0`` is greedy.
    ``stop_token_ids`` should include eos (the caller knows the tokenizer; engines also stop on their
    own eos). ``seed`` makes sampling reproducible (see each engine for its granularity).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")

    @classmethod
    def from_rollout_config(
        cls, rollout: RolloutConfig, stop_token_ids: list[int], seed: int | None = None
    ) -> SamplingParams:
        """Sampling parameters of the ``rollout`` config section (``generate_max_len`` new tokens)."""
        return cls(
            max_new_tokens=rollout.generate_max_len,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            stop_token_ids=list(stop_token_ids),
            seed=seed,
        )


@dataclass
class GenerationRequest:
    """One prompt (token ids) sampled ``n`` times with ``params``; ``visual``: its images (vision-language
    models), whose image tokens ``prompt_ids`` holds; the ``n`` samples share one encoding of them."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    visual: PromptVisual | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("GenerationRequest.prompt_ids is empty: every prompt needs at least one token")
        if self.n < 1:
            raise ValueError(f"GenerationRequest.n must be >= 1, got {self.n}")


@dataclass
class GenerationResult:
    """One sample. Request ``i`` produces ``n`` consecutive results with ``request_index == i``."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    request_index: int
    # (P + O, L, k) integer tensor: the experts of each prompt and output position in each of the L MoE layers,
    # when the engine records routes (``hpc_rlhf.models.routing_replay``, which marks unrecorded positions).
    routed_experts: torch.Tensor | None = None


class RolloutEngine(ABC):
    """A generation backend. All methods are collective over the engine's ranks (tensor parallel)."""

    # True when the engine generates with the trained actor's own module (its weights are always current):
    # the colocated weight sync then loads nothing and leaves the actor's weights where they are.
    shares_trained_model: bool = False
    # Prompt + output tokens one sequence may hold (vLLM's max_model_len, a transformers model's
    # max_position_embeddings); None when unknown. The agents' endpoint refuses longer requests one by one
    # (a 400), where the engine would fail the whole batch.
    max_context_len: int | None = None

    @abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate every request in one batched call; results in request order, ``n`` per request."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load weights by HF parameter name (``*ForCausalLM.state_dict()`` names); ``named_tensors`` may be a lazy
        iterator (consumed once, in order).

        Colocated syncs pass the whole model in one call, and vLLM engines need that: they process a layer again
        only once all its tensors arrived in the same call. The transformers engine also takes buckets of a state
        dict in separate calls (sharded sync). An unknown name or a shape mismatch raises, naming the parameter.
        Cached prefixes computed with the old weights are invalidated before the next ``generate``.
        """

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """``ds.lora.sync=adapter``: replace the LoRA adapter this engine applies to every request by
        ``named_tensors`` (peft's saved names, ``hpc_rlhf.models.lora.adapter_state_dict``: the whole adapter, in one
        call), keeping the base weights it loaded. Cached prefixes are invalidated before the next ``generate``.
        Returns the adapter's bytes. Only engines built with a LoRA adapter take it."""
        raise NotImplementedError(f"{type(self).__name__} takes no LoRA adapter; set ds.lora.sync=merged")

    @abstractmethod
    def sleep(self) -> None:
        """Free accelerator memory (weights and caches) until :meth:`wake_up`; no-op where nothing to free."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed: ``tags=None`` everything, else the named parts of
        :data:`WAKE_TAGS` (``["weights"]`` first, then ``["kv_cache"]`` after a weight sync, so that the
        cache is allocated only once the training states have left the device). ``generate`` needs both."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget cached prompt prefixes (needed after a weight update); no-op without a prefix cache."""

    def open_weight_channel(self, rendezvous: Mapping[str, Any]) -> None:
        """Join the communicator of the actor rank that sends this engine its weights (engines in processes of
        their own, ``hpc_rlhf.weight_sync.sharded.EngineChannelWeightSync``; ``rendezvous``: the sender channel's).
        In-process engines take weights
        through :meth:`update_weights` and have no channel."""
        raise NotImplementedError(f"{type(self).__name__} loads weights in-process (update_weights); it has no "
                                  "weight channel to open")

    def receive_weights(self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        """One weight round given as buckets of ``(name, tensor)`` pairs. In-process engines load the round as one
        :meth:`update_weights` call (vLLM processes a layer again only once all its tensors came in one call);
        engines behind a weight channel receive the tensors there and take only their descriptions here."""
        self.update_weights(itertools.chain.from_iterable(buckets))

    def close(self) -> None:  # noqa: B027 - a no-op hook by default, overridden by engines that start something
        """Release what the engine started (processes, executors); the engine is not used afterwards. No-op for
        engines that started nothing."""


@dataclass
class Trajectory:
    """One sample: a prompt and everything after it, token-level.

    ``response_ids`` holds every token after the prompt: generated tokens and (multi-turn)
    environment feedback. ``action_mask[i]`` is 1 where the model generated token i (trained) and
    0 for feedback. ``rollout_logprobs[i]`` is the engine's sampling logprob of token i (0.0 where
    the mask is 0), used for importance-sampling corrections.
    """

    prompt: str
    label: Any  # the prompt row's label, whatever the data file holds (the reward function reads it)
    prompt_ids: list[int]
    response_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    reward: float | None = None
    score: float | None = None
    truncated: bool = False
    finish_reason: str = ""
    extra_logs: dict[str, Any] = field(default_factory=dict)
    group_index: int = 0  # the prompt's index within the step; samples of one prompt share it
    policy_version: int = 0  # weight syncs the rollout engine had received when this sample started
    token_versions: list[int] | None = None  # per response token, when generation spanned a weight update
    failure: str | None = None  # why user code ended the episode ("step: ValueError: ..."), None if it did not
    # An episode may give several rows (the branches of an OpenAI-client agent's calls): they are consecutive,
    # share the episode's reward and group, and are numbered 0, 1, ... here. Group statistics, filtering and
    # metrics count episodes (``hpc_rlhf.algos.episodes``); every row trains.
    branch_index: int = 0
    # The prompt's data source as evaluation names it (``hpc_rlhf.data.prompts.source_name``: the row's
    # ``data_source`` column, else its file's stem), for the per-source training metrics (``reward/<source>``).
    # Executors set it from the prompt; None (an executor that does not) is reported as
    # ``hpc_rlhf.agents.executor.UNKNOWN_SOURCE``.
    data_source: str | None = None
    # (P + R, L, k) integer tensor: the experts the rollout engine routed each token position to in each MoE layer,
    # when it recorded them (``hpc_rlhf.models.routing_replay``); None otherwise.
    routed_experts: torch.Tensor | None = None
    # The prompt's images (vision-language models), shared by the samples of one prompt; the training forwards
    # embed them again into the prompt's image tokens.
    visual: PromptVisual | None = None

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def sequence_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def check(self) -> None:
        """Raise ``ValueError`` if the token-level fields disagree (for executor implementers)."""
        n = len(self.response_ids)
        if len(self.action_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"trajectory of group {self.group_index}: response_ids has {n} tokens but action_mask has "
                f"{len(self.action_mask)} and rollout_logprobs {len(self.rollout_logprobs)}")
        if any(m not in (0, 1) for m in self.action_mask):
            raise ValueError(f"trajectory of group {self.group_index}: action_mask must hold only 0 and 1")
        if not self.prompt_ids:
            raise ValueError(f"trajectory of group {self.group_index}: empty prompt_ids")
        if self.routed_experts is not None and len(self.routed_experts) != len(self.prompt_ids) + n:
            raise ValueError(f"trajectory of group {self.group_index}: routed_experts covers "
                             f"{len(self.routed_experts)} positions, the sequence has {len(self.prompt_ids) + n}")


def num_results(requests: list[GenerationRequest]) -> int:
    """How many results ``generate(requests)`` returns."""
    return sum(request.n for request in requests)
