"""DeepSpeed behind one facade: the only module of hpc_rlhf that imports deepspeed.

``TrainEngine`` wraps a trainable role (actor, critic): ZeRO 0-3, AdamW, cosine LR with warmup,
gradient clipping and accumulation. ``FrozenEngine`` wraps an inference-only role (reference model,
reward model): ZeRO-3 partitioning when asked, no optimizer. Trainers call ``backward`` / ``step`` /
``gathered_state_dict_items`` / ``save_checkpoint``; they never see deepspeed.

The deepspeed JSON config is built by the pure function ``build_ds_config`` (unit-testable without a
process group). deepspeed itself is imported lazily inside ``create`` so that importing this module is
cheap and the light-import rule of the package holds for everything that does not build an engine.

Process groups: ``dp_group=None`` means the role spans the whole world. A smaller ``dp_group`` is handed
to DeepSpeed through a Megatron-style ``mpu`` object (and to ``zero.Init``). Limitations of DeepSpeed
0.19.8 that then apply: ``save_checkpoint`` / ``load_checkpoint`` call ``dist.barrier()`` on the WORLD
group, so every rank of the world must take part in them; and ``deepspeed.utils.groups.mpu`` is process
global, so two engines with *different* dp groups must not live in one process (colocated layouts use
the same group for every role, which is fine).

Tensor parallelism (``ds.tensor_parallel_size > 1``) is DeepSpeed AutoTP: ``deepspeed.initialize`` swaps the
Linear layers of the model for column/row-parallel ones sharded over the role's ``tp_group``, and ZeRO then
runs over the role's ``dp_group``: stages 0-2 everywhere, stage 3 only for roles on every rank of the world
(see ``_zero_init_group``). Left alone, DeepSpeed builds its TP/DP groups as a device mesh over the whole
world, which is wrong and hangs when a role holds only some of the ranks; ``_install_tp_groups`` hands it
our groups instead. Those groups live in process-global variables of ``deepspeed.utils.groups``, so every
TP engine of one process must use the same tp/dp groups (true for colocated layouts). The LM head always
returns full-vocabulary logits (our losses compute log-probs from them), and ``gathered_state_dict_items``
all-gathers the shards back into full tensors. LoRA with TP is refused.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hpc_rlhf.config.schema import DeepSpeedConfig, ModelRole, TrainedRole
from hpc_rlhf.engines.lr_schedule import make_lr_lambda

log = logging.getLogger(__name__)

ADAM_EPS = 1e-8
NO_PRINT_STEPS = 10**9  # deepspeed prints a progress line every `steps_per_print`; our logger does that


# --------------------------------------------------------------------------------------------------
# pure config building


def resolve_dtype(ds_cfg: DeepSpeedConfig, on_gpu: bool) -> torch.dtype:
    """``param_dtype=auto`` is bf16 on GPU and fp32 on CPU (bf16 matmul is ~500x slower on our CPUs)."""
    if ds_cfg.param_dtype == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return torch.bfloat16 if ds_cfg.param_dtype == "bf16" else torch.float32


def gradient_accumulation_steps(train_batch_size: int, micro_train_batch_size: int, dp_size: int) -> int:
    """``train_batch_size // (micro x dp)``; fails loudly when the global batch does not split evenly."""
    per_step = micro_train_batch_size * dp_size
    if train_batch_size % per_step != 0:
        raise ValueError(
            f"train_batch_size={train_batch_size} is not a multiple of micro_train_batch_size="
            f"{micro_train_batch_size} x dp_size={dp_size} = {per_step}; change train.train_batch_size or "
            "train.micro_train_batch_size"
        )
    return train_batch_size // per_step


def build_ds_config(ds_cfg: DeepSpeedConfig, role_cfg: TrainedRole | None, *, train_batch_size: int,
                    micro_train_batch_size: int, dp_size: int, on_gpu: bool, offload_params: bool = False,
                    tp_size: int = 1, extra: dict | None = None) -> dict:
    """The deepspeed JSON config of one role.

    ``role_cfg=None`` builds an inference (frozen) config: no optimizer, no clipping; ZeRO stages 1-2
    shard only optimizer state and gradients, so they collapse to stage 0 there. ``offload_params`` keeps
    ZeRO-3 parameters on CPU (frozen roles with ``offload: true``; GPU only, it means nothing on CPU).
    ``tp_size > 1`` turns on AutoTP; ``dp_size`` then counts data-parallel replicas (ranks / tp_size).
    ``extra`` is deep-merged last (tests use it to force ZeRO-3 to partition tiny parameters).
    """
    trainable = role_cfg is not None
    dtype = resolve_dtype(ds_cfg, on_gpu)
    stage = ds_cfg.zero_stage if trainable or ds_cfg.zero_stage == 3 else 0
    if dp_size == 1 and stage in (1, 2) and not ds_cfg.adam_offload:
        # Nothing to shard over one rank; stages 1-2 only add bucketing work (-14% step time measured
        # in benchmarks/grpo_vs_trl.py on 1 rank).
        stage = 0
    gas = gradient_accumulation_steps(train_batch_size, micro_train_batch_size, dp_size) if trainable else 1
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False, contiguous_gradients=True)
    if trainable and ds_cfg.adam_offload and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if offload_params and stage == 3 and on_gpu:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": micro_train_batch_size * dp_size * gas,
        "train_micro_batch_size_per_gpu": micro_train_batch_size,
        "gradient_accumulation_steps": gas,
        "steps_per_print": NO_PRINT_STEPS,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        "prescale_gradients": False,
        # The tag check is an all_reduce over the whole world; roles on disjoint ranks save separately.
        "checkpoint": {"tag_validation": "Ignore"},
    }
    if dtype == torch.bfloat16:
        # fp32 is the default; do not add fp16/bf16 sections on CPU fp32 runs.
        config["bf16"] = {"enabled": True}
        if trainable:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    if trainable:
        params: dict[str, Any] = {
            "lr": role_cfg.learning_rate, "betas": list(role_cfg.adam_betas), "eps": ADAM_EPS,
            "weight_decay": role_cfg.weight_decay,
        }
        if not on_gpu and "offload_optimizer" not in zero:
            # torch.optim.AdamW instead of FusedAdam: no JIT-built op needed on CPU.
            params["torch_adam"] = True
        config["optimizer"] = {"type": "AdamW", "params": params}
        config["gradient_clipping"] = role_cfg.max_norm
        config["zero_allow_untested_optimizer"] = True
    if tp_size > 1:
        # vocab_parallel_lm_head=False: left to DeepSpeed, a tied LM head becomes vocabulary-parallel and the
        # model returns this rank's slice of the logits, but our losses take log-probs of full logits.
        config["tensor_parallel"] = {"autotp_size": tp_size, "vocab_parallel_lm_head": False}
    if extra:
        _deep_merge(config, extra)
    return config


def _deep_merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


# --------------------------------------------------------------------------------------------------
# process groups


class _RoleMpu:
    """Megatron-style mpu telling DeepSpeed: data parallel over ``dp_group``, tensor parallel over ``tp_group``.

    DeepSpeed all-reduces gradient norms over ``get_model_parallel_group()`` whenever an mpu is set, so without
    tensor parallelism the model-parallel group must be a real group containing only this rank (created with
    local synchronization: the other ranks need not call anything).
    """

    _singletons: dict[int, ProcessGroup] = {}

    def __init__(self, dp_group: ProcessGroup, tp_group: ProcessGroup | None = None):
        self._dp_group = dp_group
        if tp_group is None:
            rank = dist.get_rank()
            if rank not in self._singletons:
                self._singletons[rank] = dist.new_group([rank], use_local_synchronization=True)
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


def _init_deepspeed_dist() -> None:
    """Make deepspeed.comm reuse our already initialised torch.distributed world (no new init)."""
    import deepspeed

    if not dist.is_initialized():
        raise RuntimeError("call hpc_rlhf.dist.world.init_world() before building a DeepSpeed engine")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)


def _dp_setup(dp_group: ProcessGroup | None, tp_group: ProcessGroup | None = None) -> tuple[int, Any]:
    """(dp_size, mpu or None). A dp group spanning the world (and no tensor parallelism) is the same as none.

    DeepSpeed keeps the mpu in the process-global ``deepspeed.utils.groups.mpu`` and only ever *sets* it
    (``if self.mpu is not None: groups.mpu = self.mpu``), so a stale mpu from an earlier engine would
    leak into a later world-spanning one; reset it here for every new engine.
    """
    from deepspeed.utils import groups

    if tp_group is None and (dp_group is None or dist.get_world_size(dp_group) == dist.get_world_size()):
        mpu = None
    else:
        mpu = _RoleMpu(dp_group, tp_group)
    groups.mpu = mpu
    return dist.get_world_size(dp_group), mpu


def _tp_group_for(ds_cfg: DeepSpeedConfig, tp_group: ProcessGroup | None, dp_group: ProcessGroup | None,
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
                         "(hpc_rlhf.dist.world.RoleGroups) passed to the engine")
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


def _install_tp_groups(tp_group: ProcessGroup, dp_group: ProcessGroup) -> None:
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


def _zero_init_group(config: dict, dp_group: ProcessGroup | None,
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


def _build_model(model_factory: Callable[[], torch.nn.Module], config: dict, dp_group, mpu) -> torch.nn.Module:
    """Call the factory, inside ``zero.Init`` under ZeRO-3 so no rank ever holds the full model."""
    import deepspeed

    if config["zero_optimization"]["stage"] != 3:
        return model_factory()
    # zero.Init patches torch.Tensor.__new__; a first import of torch._dynamo inside the context (e.g. a
    # factory that imports transformers lazily) then dies with "TypeError: Signature mismatch between
    # <function get_new_tensor_fn_for_dtype.<locals>.new_tensor ...> and <function tensor_pynew ...>".
    import torch._dynamo  # noqa: F401

    # dtype is left for zero.Init to infer from the config on purpose: in 0.19.8 an explicit
    # dtype=torch.float32 is overridden to bf16 on the CPU accelerator (operator precedence in
    # InsertPostInitMethodToModuleSubClasses._set_dtype), silently rounding weights and rotary buffers.
    # transformers' from_pretrained must know ZeRO-3 is on (HfDeepSpeedConfig alive) so it initialises
    # and loads the checkpoint into the partitioned parameters shard by shard; without it it writes
    # into the empty local shards and fails ("index 0 is out of bounds for dimension 0 with size 0").
    # It is unset right after: left alive it makes every later from_pretrained in the process (a
    # rollout engine, an evaluation model on one rank) collective and partitioned.
    # transformers sees a copy without the tensor_parallel section: the full model is loaded here and AutoTP
    # shards it later, in deepspeed.initialize, but transformers refuses its checkpoint key conversions
    # whenever that section is present ("Weight conversions ... with DeepSpeed Tensor Parallelism are not yet
    # implemented"). from_pretrained also opens a nested zero.Init from that copy, without our group or mpu:
    # the outer context below still decides the partitioning, but DeepSpeed checks train_batch_size against
    # the WORLD size there. Partitioned over the world (dp_group None) under AutoTP, our train_batch_size
    # counts only world / tp replicas, so the copy lets DeepSpeed derive it. On a smaller dp group the check
    # is left to fail loudly: transformers would fill the weights on global rank 0 only (see _zero_init_group).
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    dropped = ("tensor_parallel", "train_batch_size") if dp_group is None else ("tensor_parallel",)
    hf_view = {k: v for k, v in config.items() if k not in dropped}
    hf_ds_config = HfDeepSpeedConfig(hf_view)  # noqa: F841  (transformers holds a weak reference)
    try:
        with deepspeed.zero.Init(config_dict_or_path=config, data_parallel_group=dp_group, mpu=mpu):
            return model_factory()
    finally:
        unset_hf_deepspeed_config()


@torch.no_grad()
def _copy_from_tp_leader(model: torch.nn.Module, tp_group: ProcessGroup | None, zero_stage: int) -> None:
    """Give every tp rank tp rank 0's weights before AutoTP shards them (ZeRO 0-2; collective over tp).

    Each rank built its own full copy, and what the factory initialised at random instead of loading (a value
    model's new ``score`` head) differs between ranks seeded apart. A parameter AutoTP leaves replicated must be
    identical on every tp rank, and DeepSpeed broadcasts only over the dp group. Under ZeRO-3 the copy is one
    model partitioned over the world and transformers initialises it on rank 0, so it is already consistent.
    """
    if tp_group is None or zero_stage == 3:
        return
    from hpc_rlhf.dist.world import comm_device

    src, device = dist.get_global_rank(tp_group, 0), comm_device()
    for tensor in (*model.parameters(), *model.buffers()):
        staged = tensor.data.to(device)
        dist.broadcast(staged, src=src, group=tp_group)
        tensor.data.copy_(staged)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D tensors), as in OpenRLHF / nanoGPT."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 params are flattened partitions
        (decay if len(shape) >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


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
    return getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size()


def _buckets(entries: list[tuple[str, torch.Tensor]],
             bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``entries`` of about ``bucket_bytes`` (full, unpartitioned sizes)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in entries:
        bucket.append((name, tensor))
        size += _numel_bytes(tensor)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


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
    re-splits into a *new* tensor instead, breaking that aliasing).
    """
    gather = getattr(tensor, "gather_params", None)
    if gather is None:
        return tensor.data.detach().clone()
    shard = tensor.data
    try:
        gather([tensor])
        return tensor.data.detach().clone()
    finally:
        tensor.data = shard


def iter_gathered_state_dict(module: torch.nn.Module, zero_stage: int,
                             bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (name, full detached copy). Under ZeRO-3 every rank of the dp group must iterate, with
    tensor parallelism every rank of the tp group too."""
    for bucket in _buckets(_state_dict_entries(module), bucket_bytes):
        with _gathered([t for _, t in bucket], zero_stage):
            yield [(n, _full_copy(t)) for n, t in bucket]


def iter_merged_lora_state_dict(module: torch.nn.Module, zero_stage: int,
                                bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (plain HF name, LoRA-merged copy): what the model without LoRA would hold.

    Under ZeRO-3 each bucket gathers its base weights together with the LoRA factors of their layers; a
    collective over the dp group like ``iter_gathered_state_dict``.
    """
    from hpc_rlhf.models.lora import lora_factors, merge_lora_entries

    factors = lora_factors(module)  # base weight name -> LoRA parameters of its layer
    for bucket in _buckets(_state_dict_entries(module), bucket_bytes):
        params = {id(t): t for n, t in bucket for t in (t, *factors.get(n, ()))}
        with _gathered(list(params.values()), zero_stage):
            yield list(merge_lora_entries(module, bucket))


def _is_first(dp_group: ProcessGroup | None, tp_group: ProcessGroup | None = None) -> bool:
    """The one rank of the role that writes files: dp rank 0 and tp rank 0."""
    return dist.get_rank(dp_group) == 0 and (tp_group is None or dist.get_rank(tp_group) == 0)


def _role_barrier(dp_group: ProcessGroup | None, tp_group: ProcessGroup | None) -> None:
    """Wait for every rank of the role: a barrier over dp then over tp orders each rank after all others."""
    dist.barrier(group=dp_group)
    if tp_group is not None:
        dist.barrier(group=tp_group)


def _save_hf(module: torch.nn.Module, buckets: Iterator[list[tuple[str, torch.Tensor]]], zero_stage: int, dp_group,
             output_dir: str, tokenizer=None, lora: bool = False, tp_group=None) -> None:
    state_dict: dict[str, torch.Tensor] = {}
    first = _is_first(dp_group, tp_group)
    for bucket in buckets:
        if first:
            state_dict.update((name, tensor.cpu()) for name, tensor in bucket)
    if first:
        # Written without module.save_pretrained: under ZeRO-3 transformers would try to gather the
        # (already gathered) parameters collectively from this one rank and hang.
        from huggingface_hub import save_torch_state_dict

        os.makedirs(output_dir, exist_ok=True)
        module.config.save_pretrained(output_dir)
        if getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(output_dir)
        save_torch_state_dict(state_dict, output_dir, max_shard_size="5GB")
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
    if lora:  # the merged weights above, plus the adapter alone for peft / `hpc-rlhf lora-merge`
        import deepspeed

        from hpc_rlhf.models.lora import save_adapter

        trainable = [p for p in module.parameters() if p.requires_grad and hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None, enabled=zero_stage == 3):
            if first:
                save_adapter(module, os.path.join(output_dir, "adapter"))
    _role_barrier(dp_group, tp_group)


# --------------------------------------------------------------------------------------------------
# engines


class TrainEngine:
    """A model wrapped by DeepSpeed for one trainable role (actor, critic)."""

    def __init__(self, engine, *, zero_stage: int, dp_group: ProcessGroup | None, on_gpu: bool,
                 adam_offload: bool, lora: bool = False, tp_group: ProcessGroup | None = None):
        self.engine = engine
        self.lora = lora
        self.zero_stage = zero_stage
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.on_gpu = on_gpu
        self._adam_offload = adam_offload
        self._offloaded = False

    @classmethod
    def create(cls, model_factory: Callable[[], torch.nn.Module], ds_cfg: DeepSpeedConfig, role_cfg: TrainedRole,
               *, train_batch_size: int, micro_train_batch_size: int, num_training_steps: int,
               dp_group: ProcessGroup | None = None, tp_group: ProcessGroup | None = None,
               on_gpu: bool | None = None, extra_ds_config: dict | None = None) -> TrainEngine:
        """Build the model (inside ``zero.Init`` for ZeRO-3), the optimizer, the LR schedule and the engine.

        Collective over ``dp_group`` (default: the world) and ``tp_group``, which ``ds.tensor_parallel_size > 1``
        requires (the role's groups from ``hpc_rlhf.dist.world``). ``num_training_steps`` counts optimizer steps.
        ``ds_cfg.lora.rank > 0`` injects LoRA (peft) into the factory's model before DeepSpeed sees it: only
        the adapters (and a value model's ``score`` head) train. Under ZeRO-3 the adapters are created outside
        ``zero.Init`` and partitioned by ``deepspeed.initialize``.
        """
        import deepspeed

        _init_deepspeed_dist()
        on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        lora = ds_cfg.lora.rank > 0
        tp_group = _tp_group_for(ds_cfg, tp_group, dp_group, lora)
        dp_size, mpu = _dp_setup(dp_group, tp_group)
        config = build_ds_config(ds_cfg, role_cfg, train_batch_size=train_batch_size,
                                 micro_train_batch_size=micro_train_batch_size, dp_size=dp_size, on_gpu=on_gpu,
                                 tp_size=ds_cfg.tensor_parallel_size, extra=extra_ds_config)
        init_group = _zero_init_group(config, dp_group, tp_group)
        if tp_group is not None:
            _install_tp_groups(tp_group, dp_group)
        model = _build_model(model_factory, config, init_group, mpu)
        _copy_from_tp_leader(model, tp_group, config["zero_optimization"]["stage"])
        if lora:
            from hpc_rlhf.models.lora import apply_lora

            model = apply_lora(model, ds_cfg.lora)
        if ds_cfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lr_lambda = make_lr_lambda(num_training_steps, role_cfg.lr_warmup_ratio, role_cfg.min_lr_ratio)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=_param_groups(model, role_cfg.weight_decay), config=config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda),
            mpu=mpu, dist_init_required=False,
        )
        return cls(engine, zero_stage=config["zero_optimization"]["stage"], dp_group=dp_group, on_gpu=on_gpu,
                   adam_offload=ds_cfg.adam_offload, lora=lora, tp_group=tp_group)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, boundary: bool | None = None) -> None:
        """Accumulate gradients of ``loss``, which is already this micro-batch's share of the step loss.

        Our losses are normalised by global counts (``hpc_rlhf.algos.aggregation``), so DeepSpeed must not
        divide them by the accumulation steps again. ``boundary``: whether this micro-batch is the last
        before the optimizer step; ``None`` leaves it to DeepSpeed's fixed count
        (``gradient_accumulation_steps``). Token-budgeted batches vary the count, so they say it here.
        """
        if boundary is not None:
            self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies the optimizer (call after ``backward``)."""
        return bool(self.engine.is_gradient_accumulation_boundary())

    def step(self) -> dict:
        """End of a micro batch; the optimizer and LR schedule advance at the accumulation boundary.

        Returns ``grad_norm`` (pre-clipping global norm; None between boundaries) and ``lr`` (the LR the
        optimizer step used, or would use).
        """
        boundary = self.is_gradient_accumulation_boundary()
        lr = float(self.engine.get_lr()[0])
        fallback_norm = self._local_grad_norm() if boundary and self.zero_stage == 0 else None
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if boundary else None
        if grad_norm is None:
            grad_norm = fallback_norm
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()
        return {"grad_norm": None if grad_norm is None else float(grad_norm), "lr": lr}

    def _local_grad_norm(self) -> float:
        # ZeRO-0 fp32 clips through deepspeed.runtime.utils.clip_grad_norm_ and drops the norm
        # (get_global_grad_norm() stays None). Gradients are already all-reduced at the boundary, so the
        # local norm is the global one -- except for tensor-parallel shards, whose squares add up over the
        # tp group (replicated parameters hold the same gradient on every tp rank and count once).
        sharded, replicated = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for p in self.module.parameters():
            if p.grad is not None:
                square = torch.linalg.vector_norm(p.grad.double()) ** 2
                if hasattr(p, "gather_params"):
                    sharded += square.cpu()
                else:
                    replicated += square.cpu()
        if self.tp_group is not None:
            sharded = sharded.to(self.device)
            dist.all_reduce(sharded, group=self.tp_group)
        return float((sharded.cpu() + replicated) ** 0.5)

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (restored by ``load_checkpoint``)."""
        return int(self.engine.global_steps)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def _can_offload(self) -> bool:
        # DeepSpeed 0.19 offload_states moves ZeRO-3 params, grads and optimizer state to host memory; it
        # asserts against param offload and needs an accelerator to free. On CPU there is nothing to free.
        return (self.on_gpu and self.zero_stage == 3 and not self._adam_offload
                and hasattr(self.engine, "offload_states"))

    def offload_states(self) -> None:
        """Free accelerator memory between phases (colocated hybrid engine). No-op on CPU."""
        if self._can_offload() and not self._offloaded:
            self.engine.offload_states()
            self._offloaded = True

    def reload_states(self) -> None:
        if self._offloaded:
            self.engine.reload_states()
            self._offloaded = False

    def gathered_state_dict_items(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (name, full detached copy) covering each parameter once plus persistent buffers.

        Tied weights appear once, under their first name. Under ZeRO-3 this is a collective over the dp
        group, with tensor parallelism over the tp group (each shard is all-gathered into the full tensor): every
        rank of the role must then exhaust the iterator. With LoRA the names are the plain HF ones and
        the tensors the merged ``W + scale * B @ A`` (what the rollout engine and the HF export need).
        """
        if self.lora:
            yield from iter_merged_lora_state_dict(self.module, self.zero_stage, bucket_bytes)
        else:
            yield from iter_gathered_state_dict(self.module, self.zero_stage, bucket_bytes)

    def save_checkpoint(self, path: str, tag: str, client_state: dict | None = None) -> None:
        """Weights, optimizer, LR schedule and ``client_state`` (collective; see module doc for subgroups)."""
        self.engine.save_checkpoint(path, tag=tag, client_state=client_state or {}, save_latest=False)

    @staticmethod
    def mirror_save_collectives() -> None:
        """What a rank that hosts no copy of a trained role runs while that role saves.

        DeepSpeed's ``save_checkpoint`` (0.19) calls ``dist.barrier()`` on the whole world twice (tag
        validation is off, see ``build_ds_config``). In a disaggregated layout the ranks of other roles
        must take part in those barriers, or the saving ranks wait for them forever.
        ``tests/multiproc/test_resume.py`` runs a disaggregated save to keep this honest.
        """
        dist.barrier()
        dist.barrier()

    def load_checkpoint(self, path: str, tag: str) -> dict:
        """Restore what ``save_checkpoint`` wrote; returns its ``client_state``."""
        load_path, client_state = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {tag!r} under {path}")
        return client_state or {}

    def save_hf(self, output_dir: str, tokenizer=None) -> None:
        """Rank 0 of the role writes a HF folder (safetensors); collective for all ranks of the role.

        With LoRA: merged weights under plain HF names, plus the adapter in ``output_dir/adapter``.
        """
        # ZeRO 0-2 hold full weights on every rank: only the writing rank needs to merge them (LoRA never
        # runs with tensor parallelism, whose gather is collective).
        needed = not self.lora or self.zero_stage == 3 or _is_first(self.dp_group)
        buckets = self.gathered_state_dict_items(256 << 20) if needed else iter(())
        _save_hf(self.module, buckets, self.zero_stage, self.dp_group, output_dir, tokenizer, lora=self.lora,
                 tp_group=self.tp_group)


class FrozenEngine:
    """Inference-only role (reference model, reward model): ZeRO-3 partitioning when ``ds.zero_stage == 3``,
    optional CPU parameter offload (``role_cfg.offload``, GPU only), eval mode, no optimizer."""

    def __init__(self, engine, *, zero_stage: int, dp_group: ProcessGroup | None,
                 tp_group: ProcessGroup | None = None):
        self.engine = engine
        self.zero_stage = zero_stage
        self.dp_group = dp_group
        self.tp_group = tp_group

    @classmethod
    def create(cls, model_factory: Callable[[], torch.nn.Module], ds_cfg: DeepSpeedConfig, role_cfg: ModelRole,
               *, micro_batch_size: int, dp_group: ProcessGroup | None = None,
               tp_group: ProcessGroup | None = None, on_gpu: bool | None = None,
               extra_ds_config: dict | None = None) -> FrozenEngine:
        """Collective over ``dp_group`` and ``tp_group`` (needed when ``ds.tensor_parallel_size > 1``)."""
        import deepspeed

        _init_deepspeed_dist()
        on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        tp_group = _tp_group_for(ds_cfg, tp_group, dp_group, lora=False)  # frozen roles never get LoRA
        dp_size, mpu = _dp_setup(dp_group, tp_group)
        config = build_ds_config(ds_cfg, None, train_batch_size=micro_batch_size * dp_size,
                                 micro_train_batch_size=micro_batch_size, dp_size=dp_size, on_gpu=on_gpu,
                                 offload_params=role_cfg.offload, tp_size=ds_cfg.tensor_parallel_size,
                                 extra=extra_ds_config)
        init_group = _zero_init_group(config, dp_group, tp_group)
        if tp_group is not None:
            _install_tp_groups(tp_group, dp_group)
        model = _build_model(model_factory, config, init_group, mpu)
        _copy_from_tp_leader(model, tp_group, config["zero_optimization"]["stage"])
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu, dist_init_required=False)
        engine.eval()
        return cls(engine, zero_stage=config["zero_optimization"]["stage"], dp_group=dp_group, tp_group=tp_group)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    __call__ = forward

    def eval(self) -> None:
        self.engine.eval()

    def offload_states(self) -> None:
        """No-op: frozen roles keep parameters where ``role_cfg.offload`` put them."""

    def reload_states(self) -> None:
        """No-op, for symmetry with ``TrainEngine``."""

    def gathered_state_dict_items(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield from iter_gathered_state_dict(self.module, self.zero_stage, bucket_bytes)
