"""The reward-model role: a frozen sequence scorer on the ranks that host ``reward``, built from the ``reward``
section (``reward.pretrain`` with its value head, ``reward.normalize``)."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from hpc_rlhf.config.schema import DeepSpeedConfig, RewardConfig
from hpc_rlhf.models.loading import load_value_model, resolve_attn_implementation
from hpc_rlhf.models.micro_forward import SequenceParallel, forward_scope
from hpc_rlhf.models.precision import resolve_dtype
from hpc_rlhf.models.value_head import read_reward_normalization
from hpc_rlhf.training.deepspeed_engine import FrozenEngine


class RewardModelRole:
    """The reward-model role: a frozen sequence scorer (value head loaded into ``score``).

    ``normalization``: ``(reward_mean, reward_std)`` stored with the reward model (``reward.normalize``, as
    OpenRLHF's ``--normalize_reward``): scores become ``(score - mean) / std``; None keeps raw scores.
    ``engine``: a ``FrozenEngine``, or any module returning what ``forward_scope`` reads (tests pass a plain one).
    """

    def __init__(self, engine: FrozenEngine | torch.nn.Module, micro_batch_size: int,
                 normalization: tuple[float, float] | None = None) -> None:
        self.engine, self.micro, self.normalization = engine, micro_batch_size, normalization

    @torch.no_grad()
    def scores(self, shard: dict[str, torch.Tensor], sp: SequenceParallel | None = None) -> torch.Tensor:
        """(B, T) sequences -> (B,) scores, ``micro_batch_size`` rows per forward. ``sp``: every rank of the
        sequence-parallel group gets the same shard and runs its chunk of each row (ring attention)."""
        num_rows, m = shard["sequences"].shape[0], self.micro
        per_micro = []
        for i in range(0, num_rows, m):
            rows = {k: shard[k][i : i + m] for k in ("sequences", "attention_mask")}
            with forward_scope(self.engine, rows, sp=sp) as fwd:
                per_micro.append(fwd.sequence_scores())
        scores = torch.cat(per_micro)
        if self.normalization is not None:
            mean, std = self.normalization
            scores = (scores - mean) / std
        return scores


def build_reward_model_role(reward: RewardConfig, ds: DeepSpeedConfig, *, micro_batch_size: int,
                            dp_group: ProcessGroup | None, tp_group: ProcessGroup | None,
                            on_gpu: bool) -> RewardModelRole:
    """Load ``reward.pretrain`` as a frozen DeepSpeed engine and wrap it as the role: the training roles' dtype,
    attention and Liger kernels (``ds``), but full precision under QLoRA. Collective over ``dp_group`` and
    ``tp_group``. The stored statistics are read first, so a missing key fails before the weights load."""
    path, head = reward.pretrain_path("reward.pretrain"), reward.value_head_prefix
    normalization = read_reward_normalization(path, "reward.normalize") if reward.normalize else None
    dtype = resolve_dtype(ds.param_dtype, on_gpu)
    attn = resolve_attn_implementation(ds.attn_implementation, on_gpu)
    engine = FrozenEngine.create(
        lambda: load_value_model(path, dtype, attn, ds.use_liger_kernel, value_head_prefix=head,
                                 key="reward.value_head_prefix"),
        ds, reward, micro_batch_size=micro_batch_size, dp_group=dp_group, tp_group=tp_group, on_gpu=on_gpu)
    return RewardModelRole(engine, micro_batch_size, normalization)
