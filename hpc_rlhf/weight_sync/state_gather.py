"""Full-weight views of a DeepSpeed-wrapped model: gathering its state dict and writing it as a HF folder.

The weights of an engine may be partitioned by ZeRO-3 over the dp group, sharded by AutoTP over the tp group,
or split into a frozen base plus LoRA factors. ``iter_gathered_state_dict`` and ``iter_merged_lora_state_dict``
yield them back as buckets of (name, full detached tensor) -- what the rollout engine and the HF export
need -- gathering one bucket (about ``bucket_bytes`` of full tensors) at a time; both are collective over the
role's groups. ``write_hf_folder`` writes such buckets from the role's first rank.
deepspeed is imported lazily inside the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from transformers import PreTrainedTokenizerBase

from hpc_rlhf.models.checkpoint_names import to_checkpoint_names
from hpc_rlhf.models.lora import (  # peft itself: lazily, inside
    adapter_state_dict,
    lora_factors,
    merge_lora_entries,
    save_adapter,
)
from hpc_rlhf.models.quantization import is_quantized, plain_config, plain_copy, quant_state
from hpc_rlhf.models.vision import copy_processor_files
from hpc_rlhf.weight_sync.plan import pack_consecutive


def _state_dict_entries(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (each tensor once, first name wins for tied weights) then persistent buffers."""
    seen: set[int] = set()
    entries: list[tuple[str, torch.Tensor]] = []
    for name, param in module.named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            entries.append((name, param))
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is None or buf_name in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            entries.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    return entries


def _numel_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the full tensor as gathered: a ZeRO-3 partition counts whole, a 4-bit weight dequantised."""
    if is_quantized(tensor):
        state = quant_state(tensor)
        return state.shape.numel() * state.dtype.itemsize
    return getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size()


def state_dict_sizes(module: torch.nn.Module) -> list[tuple[str, int]]:
    """(name, bytes of the full tensor) of every state-dict entry, in the order the buckets take them."""
    return [(name, _numel_bytes(t)) for name, t in _state_dict_entries(module)]


def _buckets(entries: list[tuple[str, torch.Tensor]], bucket_bytes: int,
             names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``entries`` of about ``bucket_bytes`` (full, unpartitioned sizes), or the runs
    ``names`` asks for (a weight-sync plan's buckets, in its order)."""
    if names is not None:
        by_name = dict(entries)
        for bucket in names:
            yield [(n, by_name[n]) for n in bucket]
        return
    for run in pack_consecutive([_numel_bytes(t) for _, t in entries], bucket_bytes):
        yield [entries[i] for i in run]


def _gathered(params: list[torch.Tensor], zero_stage: int):
    """Context in which ZeRO-3 ``params`` hold their full values (collective over their dp group)."""
    import contextlib

    import deepspeed

    if zero_stage != 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters([p for p in params if hasattr(p, "ds_id")], modifier_rank=None)


@torch.no_grad()
def _full_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor; an AutoTP shard is all-gathered over its tp group (collective).

    AutoTP tags each sharded parameter with its layer's ``gather_params``, which knows the layout (column
    parallel: weight and bias along dim 0; row parallel: weight along dim 1, the bias is replicated and not
    tagged; fused sub-parameters). It gathers by rebinding ``.data``, which would detach the parameter from
    ZeRO's flat buffers, so the shard is put back right after (DeepSpeed's own ``GatherReplacedLayerParams``
    re-splits into a *new* tensor instead, breaking that aliasing). A QLoRA 4-bit weight is dequantised.
    """
    gather = getattr(tensor, "gather_params", None)
    if gather is None:
        return plain_copy(tensor)
    shard = tensor.data
    try:
        gather([tensor])
        return tensor.data.detach().clone()
    finally:
        tensor.data = shard


def iter_gathered_state_dict(module: torch.nn.Module, zero_stage: int, bucket_bytes: int,
                             names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (name, full detached copy); ``names``: only these buckets of state-dict names, in this order.
    Under ZeRO-3 every rank of the dp group must iterate, with tensor parallelism every rank of the tp group
    too (with the same ``names``)."""
    for bucket in _buckets(_state_dict_entries(module), bucket_bytes, names):
        with _gathered([t for _, t in bucket], zero_stage):
            yield [(n, _full_copy(t)) for n, t in bucket]


class ModuleWeights:
    """A plain module's weights behind the two methods a weight sync reads from an engine (``state_dict_sizes``,
    ``gathered_state_dict_items``): full tensors, as a ZeRO 0-2 replica holds them. For benchmarks and tests of
    the sync without DeepSpeed."""

    zero_stage = 0  # full tensors on every rank, as under ZeRO 0-2

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def state_dict_sizes(self) -> list[tuple[str, int]]:
        return state_dict_sizes(self.module)

    def gathered_state_dict_items(self, bucket_bytes: int = 256 << 20,
                                  names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return iter_gathered_state_dict(self.module, 0, bucket_bytes, names)


def iter_merged_lora_state_dict(module: torch.nn.Module, zero_stage: int, bucket_bytes: int,
                                names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (plain HF name, LoRA-merged copy): what the model without LoRA would hold.

    Under ZeRO-3 each bucket gathers its base weights together with the LoRA factors of their layers; a
    collective over the dp group like ``iter_gathered_state_dict``; ``names`` as there.
    """
    factors = lora_factors(module)  # base weight name -> LoRA parameters of its layer
    for bucket in _buckets(_state_dict_entries(module), bucket_bytes, names):
        params = {id(t): t for n, t in bucket for t in (t, *factors.get(n, ()))}
        with _gathered(list(params.values()), zero_stage):
            yield list(merge_lora_entries(module, bucket))


def adapter_state_sizes(module: torch.nn.Module, zero_stage: int) -> list[tuple[str, int]]:
    """(peft's saved name, bytes) of every tensor of the LoRA adapter of ``module``, in the order
    ``iter_adapter_state_dict`` buckets them. ZeRO 0-2 only (the tensors are whole on every rank: no collective)."""
    if zero_stage == 3:
        raise ValueError("adapter_state_sizes reads whole tensors; under ZeRO-3 gather them "
                         "(iter_adapter_state_dict)")
    return [(name, _numel_bytes(t)) for name, t in adapter_state_dict(module).items()]


def iter_adapter_state_dict(module: torch.nn.Module, zero_stage: int, bucket_bytes: int,
                            names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (peft's saved name, detached copy) of the LoRA adapter alone (``ds.lora.sync=adapter``: what the
    rollout engine needs besides the base it keeps). The adapter is small (~0.1-1 % of the model), so under ZeRO-3
    every trainable parameter is gathered at once, collectively over the dp group; ``names`` as in
    ``iter_gathered_state_dict``."""
    trainable: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    with _gathered(trainable, zero_stage):
        entries = [(name, plain_copy(t)) for name, t in adapter_state_dict(module).items()]
    yield from _buckets(entries, bucket_bytes, names)


def is_first_rank_of_role(dp_group: ProcessGroup | None, tp_group: ProcessGroup | None = None) -> bool:
    """The one rank of the role that writes files: dp rank 0 and tp rank 0."""
    return dist.get_rank(dp_group) == 0 and (tp_group is None or dist.get_rank(tp_group) == 0)


def _role_barrier(dp_group: ProcessGroup | None, tp_group: ProcessGroup | None) -> None:
    """Wait for every rank of the role: a barrier over dp then over tp orders each rank after all others."""
    dist.barrier(group=dp_group)
    if tp_group is not None:
        dist.barrier(group=tp_group)


def write_hf_folder(module: torch.nn.Module, buckets: Iterator[list[tuple[str, torch.Tensor]]], zero_stage: int,
                    dp_group, output_dir: str, tokenizer: PreTrainedTokenizerBase | None = None, lora: bool = False,
                    tp_group=None) -> None:
    """Rank 0 of the role writes ``buckets`` as a HF folder (safetensors); collective for all ranks of the role.

    Every rank must pass its own ``buckets`` (exhausting them may be collective); with ``lora`` the adapter alone
    goes to ``output_dir/adapter`` too. Returns once every rank of the role is done.
    """
    state_dict: dict[str, torch.Tensor] = {}
    first = is_first_rank_of_role(dp_group, tp_group)
    if first:  # under the checkpoint names (split experts) that vLLM and other readers load; copied to the host
        # inside each bucket's gather (under ZeRO-3 a gathered tensor is released when its bucket ends)
        state_dict.update(to_checkpoint_names(module, ((name, tensor.cpu()) for bucket in buckets
                                                       for name, tensor in bucket)))
    else:
        collections.deque(buckets, maxlen=0)  # exhausted on every rank: the gathers are collective
    if first:
        # Written without module.save_pretrained: under ZeRO-3 transformers would try to gather the
        # (already gathered) parameters collectively from this one rank and hang.
        from huggingface_hub import save_torch_state_dict

        os.makedirs(output_dir, exist_ok=True)
        plain_config(module.config).save_pretrained(output_dir)  # the weights above are never 4-bit
        generation_config = getattr(module, "generation_config", None)  # None on models that do not generate
        if generation_config is not None:
            generation_config.save_pretrained(output_dir)
        save_torch_state_dict(state_dict, output_dir, max_shard_size="5GB")
        if tokenizer is not None:  # transformers' type, not the Tokenizer protocol: only it writes its own files
            tokenizer.save_pretrained(output_dir)
        copy_processor_files(module.config, output_dir)  # a vision-language model's processor beside its weights
    if lora:  # the merged weights above, plus the adapter alone for peft / `hpc-rlhf lora-merge`
        import deepspeed

        trainable = [p for p in module.parameters() if p.requires_grad and hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None, enabled=zero_stage == 3):
            if first:
                save_adapter(module, os.path.join(output_dir, "adapter"))
    _role_barrier(dp_group, tp_group)
