"""Adapter-only weight sync (``ds.lora.sync=adapter``): a LoRA actor sends the rollout engine its adapter alone.

With LoRA the trainer changes only the adapter, yet a merged sync sends every weight (``W + scale * B @ A``; a 70B
model: ~141 GB of bf16 per step) and makes vLLM reload them all. Under adapter sync the rollout engine keeps the base
weights it loaded once and applies the adapter to every request: peft's LoRA layers in the transformers engine,
vLLM's LoRA support (punica kernels) in both vLLM engines. A sync moves ``rank x (in + out)`` numbers per adapted
linear (SmolLM2-135M at rank 16, every linear: 4.9 M parameters, 3.6 % of the model; a 70B model ~0.3 %).

The paths are the merged ones with other tensors:

- colocated: the actor's gathered adapter goes in-process into the engine (``weight_sync.colocated``);
- rollout ranks a subset of the world: ``ShardedWeightSync`` broadcasts the adapter's buckets over the main world
  (for ``rollout.vllm_mode=server_process`` too: the adapter is small, and vLLM loads it from a folder the rollout
  rank writes on its own node, so vLLM's weight channel is not needed), read from the actor through
  :class:`AdapterWeights` and collected on each rollout rank by :class:`AdapterCollector`, which loads the whole
  adapter once the round is in.

Whether a run can sync its adapter is decided at start-up (:func:`adapter_sync_refusal`,
``hpc_rlhf.trainers.rl.setup.lora_sync_mode``): the engine's base must be exactly the one the adapter trains on, and
the engine must apply every adapted module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch-free at run time: plan reads adapter_sync_refusal
    import torch

# Module names LoRA may adapt on a mixture-of-experts model and still be served by vLLM: attention only (vLLM's
# fused-MoE LoRA is not used here; peft adapts fused experts and the router through ParamWrapper).
ATTENTION_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


def adapter_sync_refusal(*, backend: str, load_in_4bit: bool, moe: bool, target_modules: Iterable[str],
                         vision_language: bool, discards_weights_in_sleep: bool) -> str | None:
    """Why the rollout engine cannot take the adapter alone (one sentence naming the key at fault), or None.

    ``backend``: ``rollout.backend``; ``moe`` / ``vision_language``: what ``actor.pretrain`` is;
    ``discards_weights_in_sleep``: vLLM sleeps at level 2 (``vllm.sleep_level=2`` with sleep on), which drops the
    base weights that an adapter sync never sends again."""
    if load_in_4bit:
        return ("ds.lora.load_in_4bit=true: the adapter trains on the dequantised 4-bit base, while the rollout engine "
                "loads the full-precision one, so it would sample from another policy")
    if backend != "vllm":
        return None
    targets = set(target_modules)
    if moe and not targets <= ATTENTION_TARGETS:
        return (f"ds.lora.target_modules={sorted(targets)} on a mixture-of-experts actor: peft adapts the fused "
                "experts and the router (ParamWrapper), which vLLM's LoRA does not load; adapter sync with vLLM "
                f"needs attention targets only ({sorted(ATTENTION_TARGETS)})")
    if vision_language:
        return ("a vision-language actor: its adapter covers the language model only, under names vLLM's LoRA "
                "loader does not map here (not tried)")
    if discards_weights_in_sleep:
        return "vllm.sleep_level=2 discards vLLM's base weights at every sleep, and an adapter sync never sends them"
    return None


def resolve_lora_sync(setting: str, refusal: str | None) -> str:
    """``ds.lora.sync`` resolved: ``adapter`` or ``merged``. ``auto`` is adapter unless ``refusal``; an explicit
    ``adapter`` with a refusal raises ``ValueError`` naming the key."""
    if setting == "merged":
        return "merged"
    if refusal is None:
        return "adapter"
    if setting == "adapter":
        raise ValueError(f"ds.lora.sync=adapter: {refusal}; set ds.lora.sync=merged (or auto)")
    return "merged"


class AdapterSource(Protocol):
    """What :class:`AdapterWeights` reads from the actor (a ``TrainEngine`` with LoRA)."""

    zero_stage: int

    def adapter_state_sizes(self) -> list[tuple[str, int]]: ...

    def gathered_adapter_items(self, bucket_bytes: int = ...,
                               names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]: ...


class AdapterWeights:
    """The actor's adapter behind the interface a weight sync reads weights through (``sharded.ActorWeights``:
    ``state_dict_sizes``, ``gathered_state_dict_items``), so the sharded sync plans and sends the adapter's
    buckets exactly as it does the model's."""

    def __init__(self, actor: AdapterSource) -> None:
        self.actor = actor
        self.zero_stage = actor.zero_stage

    def state_dict_sizes(self) -> list[tuple[str, int]]:
        return self.actor.adapter_state_sizes()

    def gathered_state_dict_items(self, bucket_bytes: int = 256 << 20,
                                  names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return self.actor.gathered_adapter_items(bucket_bytes, names)


class AdapterCollector:
    """A rollout rank's sink for one adapter round (``transport.BucketSink``): keeps every bucket's tensors; the
    engine loads them in one ``update_adapter`` call once the round is in (an adapter is applied whole)."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tensors.extend(named_tensors)  # views into the received flat buffer, which nothing else holds


def tensor_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Payload bytes of ``(name, tensor)`` pairs."""
    return sum(t.numel() * t.element_size() for _, t in named_tensors)
