"""What sits on the accelerator at each point of a colocated step (every rank hosts every role).

vLLM's sleep mode lets the weights and the KV cache come back separately, so the weight sync after
training can run while the device holds as little as possible:

1. the actor's gradients, Adam moments and fp32 master weights leave (its bf16 weights stay: the sync
   gathers them), and so do the critic's and the reference's states;
2. the allocator's cache is returned, so vLLM's own allocator can take the freed memory;
3. ``wake_up(["weights"])``: only the rollout weights come back (with ``vllm.sleep_level=2`` as empty
   buffers: the sync below overwrites every one);
4. the actor's weights are gathered bucket by bucket into the rollout engine, as one update;
5. the actor's bf16 weights leave too and the cache is returned again;
6. ``wake_up(["kv_cache"])``: the KV cache is allocated into the memory training gave back.

The peak of this sequence is the larger of (actor bf16 weights + one gathered bucket + rollout weights)
and the rollout engine's whole budget; ``hpc_rlhf.planning.memory_estimate.colocated_sync_gib`` models it.
Training states come back lazily: each role reloads before its next forward or update.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def free_device_cache() -> None:
    """Return cached, unused blocks to the device so another allocator (vLLM's) can take them. Nothing to do
    without CUDA (a full ``gc.collect`` twice a step would buy nothing there)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


class CountedTensors:
    """An iterator over ``(name, tensor)`` pairs that counts the payload bytes it handed out (``num_bytes``)."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._source = iter(named_tensors)
        self.num_bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        name, tensor = next(self._source)
        if isinstance(tensor, torch.Tensor):  # test doubles may pass placeholders
            self.num_bytes += tensor.numel() * tensor.element_size()
        return name, tensor


def colocated_weight_sync(rollout_engine: Any, actor: Any, others: Iterable[Any] = (), adapter: bool = False) -> int:
    """Load the actor's weights into the sleeping rollout engine in the order of the module docstring; returns the
    payload bytes handed to the engine.

    ``actor``: the training-engine facade (``offload_states(keep_weights=...)``,
    ``gathered_state_dict_items()``); ``rollout_engine``: a ``RolloutEngine`` (``shares_trained_model``: nothing
    to load, the actor's weights stay); ``others``: further engines on this rank (critic, reference) whose
    states must leave before the rollout engine wakes; ``adapter`` (``ds.lora.sync=adapter``): only the actor's
    LoRA adapter goes, into ``update_adapter`` (``weight_sync.adapter``). Collective over the actor's ranks (the
    gather).
    """
    actor.offload_states(keep_weights=True)
    for engine in others:
        engine.offload_states()
    free_device_cache()
    if rollout_engine.shares_trained_model:
        # It generates with the actor's own module: the weights are already current, and must stay put.
        rollout_engine.reset_prefix_cache()
        return 0
    rollout_engine.wake_up(["weights"])
    if adapter:
        sent = CountedTensors(itertools.chain.from_iterable(actor.gathered_adapter_items()))
        rollout_engine.update_adapter(sent)
    else:
        # One round, gathered bucket by bucket as the engine consumes it: vLLM processes a layer again only once all
        # of its tensors arrived in the same update (rollout.vllm_external_launcher).
        sent = CountedTensors(itertools.chain.from_iterable(actor.gathered_state_dict_items()))
        rollout_engine.update_weights(sent)
    actor.offload_states()
    free_device_cache()
    rollout_engine.wake_up(["kv_cache"])
    rollout_engine.reset_prefix_cache()
    return sent.num_bytes
