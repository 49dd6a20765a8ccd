"""Per-GPU memory estimate of a placement, without loading any model. Pure Python.

Model states follow the ZeRO paper's accounting (Rajbhandari et al., 2020): with mixed precision,
2 bytes of weights + 2 bytes of gradients + 12 bytes of Adam states (fp32 master, m, v) per parameter;
stage 1 shards the optimizer states over data-parallel ranks, stage 2 also the gradients, stage 3 also
the weights. Tensor parallelism divides every term by ``tp``. Frozen roles (ref, reward) hold weights
only. Activations are not modelled; ``headroom_frac`` of the GPU is kept free for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.dist.placement import Placement

GIB = 1024**3
ADAM_BYTES_PER_PARAM = 12  # fp32 master weights + exp_avg + exp_avg_sq


class ModelSizeError(ValueError):
    """No way to know a role's model size."""


def count_params_from_hf_config(cfg: dict) -> int:
    """Parameter count of a decoder-only transformer from its ``config.json`` (Llama/Qwen/Mistral shape)."""
    try:
        hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
        inter = cfg.get("intermediate_size", 4 * hidden)
        heads = cfg["num_attention_heads"]
    except KeyError as err:
        raise ModelSizeError(f"config.json lacks {err.args[0]!r}; set <role>.num_params_b instead") from None
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    per_layer = attn + mlp + 2 * hidden
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + hidden


def role_num_params(cfg: RunConfig, role: str) -> int:
    """Parameter count of a role's model: the recipe's ``num_params_b``, else the local config.json.

    The critic, ref and reward default to the actor's size when they name no model of their own.
    """
    section = getattr(cfg, role)
    if section.num_params_b is not None:
        return int(section.num_params_b * 1e9)
    if section.pretrain is not None:
        path = Path(section.pretrain) / "config.json"
        if path.is_file():
            return count_params_from_hf_config(json.loads(path.read_text()))
    if role != "actor":
        return role_num_params(cfg, "actor")
    raise ModelSizeError(
        "cannot size the actor: set actor.pretrain to a local model folder with config.json "
        "or set actor.num_params_b"
    )


@dataclass(frozen=True)
class RoleMemory:
    role: str
    weights_gib: float
    grads_gib: float
    optim_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optim_gib


def _bytes_per_weight(cfg: RunConfig, on_gpu: bool) -> int:
    dtype = cfg.ds.param_dtype
    if dtype == "auto":
        dtype = "bf16" if on_gpu else "fp32"
    return 2 if dtype == "bf16" else 4


def role_memory(cfg: RunConfig, placement: Placement, role: str, on_gpu: bool = True) -> RoleMemory:
    """GPU-resident model states of one rank of ``role`` in GiB."""
    grid = placement.roles[role]
    params = role_num_params(cfg, role)
    w_bytes = _bytes_per_weight(cfg, on_gpu)
    tp, dp = grid.tp_size, grid.dp_size * grid.sp_size  # ZeRO shards over dp x sp ranks
    stage = cfg.ds.zero_stage
    shard_params = params / tp
    if role in ("actor", "critic"):
        weights = shard_params * w_bytes / (dp if stage >= 3 else 1)
        grads = shard_params * w_bytes / (dp if stage >= 2 else 1)
        optim = 0.0 if cfg.ds.adam_offload else shard_params * ADAM_BYTES_PER_PARAM / (dp if stage >= 1 else 1)
        return RoleMemory(role, weights / GIB, grads / GIB, optim / GIB)
    offloaded = getattr(cfg, role).offload
    weights = 0.0 if offloaded else shard_params * w_bytes / (dp if stage >= 3 else 1)
    return RoleMemory(role, weights / GIB, 0.0, 0.0)


@dataclass(frozen=True)
class RankMemory:
    rank: int
    roles: tuple[str, ...]
    training_gib: float
    rollout_gib: float
    peak_gib: float


def rank_memory(cfg: RunConfig, placement: Placement, gpu_mem_gb: float) -> list[RankMemory]:
    """Peak estimate per rank. With vLLM sleep mode, rollout and training time-share the GPU."""
    per_role = {r: role_memory(cfg, placement, r) for r in placement.roles if r != "rollout"}
    out = []
    for rank in range(placement.world_size):
        roles = tuple(placement.roles_of(rank))
        training = sum(per_role[r].total_gib for r in roles if r != "rollout")
        rollout = cfg.vllm.gpu_memory_utilization * gpu_mem_gb if "rollout" in roles else 0.0
        time_shared = cfg.train.colocate_all and cfg.vllm.enable_sleep
        peak = max(training, rollout) if time_shared else training + rollout
        out.append(RankMemory(rank, roles, training, rollout, peak))
    return out
