"""How a role's process groups reach DeepSpeed: its data-parallel group and, with AutoTP, its tensor-parallel group.

Called by the engines of ``hpc_rlhf.training.deepspeed_engine`` while they build a DeepSpeed engine; deepspeed is
imported lazily inside the functions that need it, so importing this module stays cheap.

Process groups: ``dp_group=None`` means the role spans the whole world. A smaller ``dp_group`` is handed
to DeepSpeed through a Megatron-style ``mpu`` object (``_RoleMpu``, and to ``zero.Init``). Limitation of
DeepSpeed 0.19.8 that then applies: ``deepspeed.utils.groups.mpu`` is process global, so two engines with
*different* dp groups must not live in one process (colocated layouts use the same group for every role,
which is fine).

Tensor parallelism (``ds.tensor_parallel_size > 1``) is DeepSpeed AutoTP: ``deepspeed.initialize`` swaps the
Linear layers of the model for column/row-parallel ones sharded over the role's ``tp_group``, and ZeRO then
runs over the role's ``dp_group``: stages 0-2 everywhere, stage 3 only for roles on every rank of the world
(see ``zero_init_group``). Left alone, DeepSpeed builds its TP/DP groups as a device mesh over the whole
world, which is wrong and hangs when a role holds only some of the ranks; ``install_tp_groups`` hands it
our groups instead. Those groups live in process-global variables of ``deepspeed.utils.groups``, so every
TP engine of one process must use the same tp/dp groups (true for colocated layouts). LoRA with TP is
refused (``tp_group_for``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hpc_rlhf.config.schema import DeepSpeedConfig
from hpc_rlhf.world.groups import comm_device, new_group


def _require_group(group: ProcessGroup | None, rank: int) -> ProcessGroup:
    """``new_group``'s result on a member rank (None means this rank is not in the group)."""
    if group is None:
        raise RuntimeError(f"rank {rank}: new_group returned no group for a group containing this rank")
    return group


class _RoleMpu:
    """Megatron-style mpu telling DeepSpeed: data parallel over ``dp_group``, tensor parallel over ``tp_group``.

    DeepSpeed all-reduces gradient norms over ``get_model_parallel_group()`` whenever an mpu is set, so without
    tensor parallelism the model-parallel group must be a real group containing only this rank (created with
    local synchronization: the other ranks need not call anything).
    """

    _singletons: ClassVar[dict[int, ProcessGroup]] = {}  # one per process: each rank's own one-rank group

    def __init__(self, dp_group: ProcessGroup | None, tp_group: ProcessGroup | None = None) -> None:  # None: world
        self._dp_group = dp_group
        if tp_group is None:
            rank = dist.get_rank()
            if rank not in self._singletons:
                self._singletons[rank] = _require_group(new_group([rank], use_local_synchronization=True), rank)
            tp_group = self._singletons[rank]
        self._mp_group = tp_group

    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self._dp_group)

    def get_model_parallel_group(self):
        return self._mp_group

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._mp_group)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._mp_group)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


def init_deepspeed_dist() -> None:
    """Make deepspeed.comm reuse our already initialised torch.distributed world (no new init)."""
    import deepspeed

    if not dist.is_initialized():
        raise RuntimeError("call hpc_rlhf.world.groups.init_world() before building a DeepSpeed engine")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)


def dp_setup(dp_group: ProcessGroup | None, tp_group: ProcessGroup | None = None) -> tuple[int, Any]:
    """(dp_size, mpu or None). A dp group spanning the world (and no tensor parallelism) is the same as none.

    DeepSpeed keeps the mpu in the process-global ``deepspeed.utils.groups.mpu`` and only ever *sets* it
    (``if self.mpu is not None: groups.mpu = self.mpu``), so a stale mpu from an earlier engine would
    leak into a later world-spanning one; reset it here for every new engine.
    """
    from deepspeed.utils import groups

    if tp_group is None and (dp_group is None or dist.get_world_size(dp_group) == dist.get_world_size()):
        mpu = None
        # Without an mpu DeepSpeed runs ZeRO on its own clone of the world group (groups._clone_world_group),
        # made by a bare dist.new_group with torch's 30-minute default; make the clone here, with the world's
        # timeout. Every rank builds a world-spanning engine, so every rank gets here (the call is collective).
        if groups._WORLD_GROUP is None:
            groups._WORLD_GROUP = new_group(range(dist.get_world_size()))
    else:
        mpu = _RoleMpu(dp_group, tp_group)
    groups.mpu = mpu
    return dist.get_world_size(dp_group), mpu


def tp_group_for(ds_cfg: DeepSpeedConfig, tp_group: ProcessGroup | None, dp_group: ProcessGroup | None,
                  lora: bool) -> ProcessGroup | None:
    """The tp group to shard over (None: no tensor parallelism); fails early on what AutoTP cannot do."""
    tp_size = ds_cfg.tensor_parallel_size
    if tp_size == 1:
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            raise ValueError(f"a tp_group of {dist.get_world_size(tp_group)} ranks was given but "
                             "ds.tensor_parallel_size=1; the placement and the engine disagree")
        return None
    if tp_group is None or dp_group is None:
        raise ValueError(f"ds.tensor_parallel_size={tp_size} needs the role's tp_group and dp_group "
                         "(hpc_rlhf.world.groups.RoleGroups) passed to the engine")
    if lora:
        raise ValueError(f"ds.lora.rank > 0 with ds.tensor_parallel_size={tp_size}: AutoTP cannot shard peft's "
                         "LoRA layers; use ds.tensor_parallel_size=1 with LoRA (or full fine-tuning with TP)")
    ranks = dist.get_process_group_ranks(tp_group)
    if len(ranks) != tp_size:
        raise ValueError(f"tp_group has {len(ranks)} ranks but ds.tensor_parallel_size={tp_size}")
    # DeepSpeed 0.19.8 computes a tp group's source rank as (rank // tp_size) * tp_size
    # (groups.get_tensor_model_parallel_src_rank), i.e. it assumes groups of consecutive, aligned ranks.
    if ranks != list(range(ranks[0], ranks[0] + tp_size)) or ranks[0] % tp_size:
        raise ValueError(f"tp_group ranks {ranks} are not {tp_size} consecutive ranks starting at a multiple of "
                         f"ds.tensor_parallel_size={tp_size}, which DeepSpeed AutoTP assumes; give the roles "
                         "before this one rank counts that are multiples of ds.tensor_parallel_size")
    return tp_group


def install_tp_groups(tp_group: ProcessGroup, dp_group: ProcessGroup) -> None:
    """Make DeepSpeed's AutoTP use the role's tp/dp groups instead of a mesh over the whole world.

    With AutoTP on, ``DeepSpeedEngine`` replaces any mpu we pass with the ``deepspeed.utils.groups`` module and
    calls ``groups._init_tp_mesh_device``, which builds a (world / tp, tp) device mesh over EVERY rank -- a
    collective the ranks of other roles never join -- unless a tp group is already recorded there. Recording
    ours first makes it return early; ZeRO and gradient clipping then read our groups back from the module.
    The variables are process-global, hence the conflict check.
    """
    from deepspeed.utils import groups

    for name, ours in (("_TENSOR_MODEL_PARALLEL_GROUP", tp_group), ("_MODEL_PARALLEL_GROUP", tp_group),
                       ("_DATA_PARALLEL_GROUP", dp_group)):
        current = getattr(groups, name)
        if current is not None and current is not ours:
            raise RuntimeError(f"deepspeed.utils.groups.{name} already holds another group: two tensor-parallel "
                               "engines with different tp/dp groups cannot live in one process (DeepSpeed keeps "
                               "them process-global); colocate roles with identical placements")
        setattr(groups, name, ours)


def zero_init_group(config: dict, dp_group: ProcessGroup | None,
                     tp_group: ProcessGroup | None) -> ProcessGroup | None:
    """The group ``zero.Init`` partitions the freshly built model over (ZeRO-3): the dp group, or with AutoTP
    the whole world (None).

    transformers' ZeRO-3 loader (``_load_state_dict_into_zero3_model``, 5.x) copies the checkpoint into the
    gathered parameters on *global* rank 0 only and broadcasts buffers over the world, so a checkpoint lands
    correctly only in a model partitioned over the world; on a dp group without rank 0 the weights stay
    uninitialised memory. With AutoTP every dp group misses some ranks, so the model is built over the world
    and AutoTP then gathers each layer it shards and hands its shard to ZeRO, which partitions it over the dp
    group (the order DeepSpeed expects: zero.Init first, AutoTP in ``deepspeed.initialize``).
    """
    if tp_group is None or config["zero_optimization"]["stage"] != 3:
        return dp_group
    tp_size = dist.get_world_size(tp_group)
    if dist.get_world_size(dp_group) * tp_size != dist.get_world_size():
        raise ValueError(f"ds.zero_stage=3 with ds.tensor_parallel_size={tp_size} needs the role on every rank of "
                         "the world (train.colocate_all=true): transformers loads ZeRO-3 checkpoints over the whole "
                         "world; use ds.zero_stage 0-2 for roles on a subset of the ranks")
    return None


@torch.no_grad()
def copy_from_tp_leader(model: torch.nn.Module, tp_group: ProcessGroup | None, zero_stage: int) -> None:
    """Give every tp rank tp rank 0's weights before AutoTP shards them (ZeRO 0-2; collective over tp).

    Each rank built its own full copy, and what the factory initialised at random instead of loading (a value
    model's new ``score`` head) differs between ranks seeded apart. A parameter AutoTP leaves replicated must be
    identical on every tp rank, and DeepSpeed broadcasts only over the dp group. Under ZeRO-3 the copy is one
    model partitioned over the world and transformers initialises it on rank 0, so it is already consistent.
    """
    if tp_group is None or zero_stage == 3:
        return
    src, device = dist.get_global_rank(tp_group, 0), comm_device()
    for tensor in (*model.parameters(), *model.buffers()):
        staged = tensor.data.to(device)
        dist.broadcast(staged, src=src, group=tp_group)
        tensor.data.copy_(staged)
