"""DeepSpeed behind one facade: ``TrainEngine`` and ``FrozenEngine``, built from our config.

``TrainEngine`` wraps a trainable role (actor, critic): ZeRO 0-3, AdamW (torch's, fused on GPU; DeepSpeed's
CPU Adam under ZeRO-Offload: ``hpc_rlhf.training.optimizer_choice``), cosine LR with warmup,
gradient clipping and accumulation. ``FrozenEngine`` wraps an inference-only role (reference model,
reward model): ZeRO-3 partitioning when asked, no optimizer. Trainers call ``backward`` / ``step`` /
``gathered_state_dict_items`` / ``save_checkpoint``; they never see deepspeed. deepspeed is imported only
here and by the two helpers of this package the engines build on: ``hpc_rlhf.training.topology`` (how
the role's dp/tp groups reach DeepSpeed, AutoTP setup) and ``hpc_rlhf.weight_sync.state_gather`` (full state
dicts out of ZeRO-3 / AutoTP / LoRA, HF export).

The deepspeed JSON config is built by the pure function ``build_ds_config`` (unit-testable without a
process group). deepspeed itself is imported lazily inside ``create`` so that importing this module is
cheap and the light-import rule of the package holds for everything that does not build an engine.

Process groups: ``dp_group=None`` means the role spans the whole world; a smaller one is handed to
DeepSpeed as described in ``hpc_rlhf.training.topology`` (where its limits are listed). A limitation of
DeepSpeed 0.19.8 that then applies to the engines: ``save_checkpoint`` / ``load_checkpoint`` call
``dist.barrier()`` on the WORLD group, so every rank of the world must take part in them.

Tensor parallelism (``ds.tensor_parallel_size > 1``) is DeepSpeed AutoTP, set up by
``hpc_rlhf.training.topology``. The LM head always returns full-vocabulary logits (our losses compute
log-probs from them), and ``gathered_state_dict_items`` all-gathers the shards back into full tensors. LoRA
with TP is refused.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed import ProcessGroup
from transformers import PreTrainedTokenizerBase

from hpc_rlhf.config.schema import DeepSpeedConfig, ModelRole, TrainedRole
from hpc_rlhf.models.hf_compat import enable_activation_checkpointing
from hpc_rlhf.models.lora import apply_lora, load_trainable_state  # peft itself: lazily, inside
from hpc_rlhf.models.moe import sparse_moe_block_classes
from hpc_rlhf.models.precision import resolve_dtype
from hpc_rlhf.planning.memory_estimate import effective_zero_stage
from hpc_rlhf.training.optimizer_choice import adam_implementation, arch_list_for_deepspeed, optimizer_offloaded
from hpc_rlhf.training.topology import (
    copy_from_tp_leader,
    dp_setup,
    init_deepspeed_dist,
    install_tp_groups,
    tp_group_for,
    zero_init_group,
)
from hpc_rlhf.weight_sync.state_gather import (
    adapter_state_sizes,
    is_first_rank_of_role,
    iter_adapter_state_dict,
    iter_gathered_state_dict,
    iter_merged_lora_state_dict,
    state_dict_sizes,
    write_hf_folder,
)

log = logging.getLogger(__name__)

ADAM_EPS = 1e-8
NO_PRINT_STEPS = 10**9  # deepspeed prints a progress line every `steps_per_print`; our logger does that


# --------------------------------------------------------------------------------------------------
# pure config building


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
    dtype = resolve_dtype(ds_cfg.param_dtype, on_gpu)
    # fp32 on one rank: nothing to shard, stages 1-2 only add bucketing work (-14% step time measured in
    # benchmarks/grpo_vs_trl.py on 1 rank), so they run as 0. bf16 training needs a ZeRO optimizer: stages 0-2 run
    # as 2 (effective_zero_stage says why).
    stage = effective_zero_stage(ds_cfg.zero_stage, dp_size, trainable, ds_cfg.adam_offload,
                                 bf16=dtype == torch.bfloat16)
    gas = gradient_accumulation_steps(train_batch_size, micro_train_batch_size, dp_size) if trainable else 1
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False, contiguous_gradients=True)
    if trainable and optimizer_offloaded(ds_cfg.adam_offload, stage):
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
    if role_cfg is not None:  # trainable
        params: dict[str, Any] = {
            "lr": role_cfg.learning_rate, "betas": list(role_cfg.adam_betas), "eps": ADAM_EPS,
            "weight_decay": role_cfg.weight_decay,
        }
        # torch's AdamW (fused on GPU) unless ZeRO-Offload needs DeepSpeedCPUAdam or ZeRO-3's offload_states
        # needs DeepSpeed's FusedAdam: see engines.optimizer_choice.
        params.update(adam_implementation(on_gpu=on_gpu, offloaded="offload_optimizer" in zero,
                                          zero_stage=stage).ds_params)
        config["optimizer"] = {"type": "AdamW", "params": params}
        config["gradient_clipping"] = role_cfg.max_norm
        config["zero_allow_untested_optimizer"] = True
    if tp_size > 1:
        # vocab_parallel_lm_head=False: left to DeepSpeed, a tied LM head becomes vocabulary-parallel and the
        # model returns this rank's slice of the logits, but our losses take log-probs of full logits.
        config["tensor_parallel"] = {"autotp_size": tp_size, "vocab_parallel_lm_head": False}
    if extra:
        merged = OmegaConf.to_container(OmegaConf.merge(config, extra))
        assert isinstance(merged, dict)  # a merge of two dicts
        config = {str(k): v for k, v in merged.items()}
    return config


@contextlib.contextmanager
def _arch_list_deepspeed_can_read() -> Iterator[None]:
    """``TORCH_CUDA_ARCH_LIST`` rewritten by ``arch_list_for_deepspeed`` while DeepSpeed builds its ops, then
    restored (the user's value stays what torch's own extension builds see)."""
    original = os.environ.get("TORCH_CUDA_ARCH_LIST")
    readable = arch_list_for_deepspeed(original) if original else original
    if readable != original:
        log.info("TORCH_CUDA_ARCH_LIST=%s is read as %s while DeepSpeed builds its ops", original, readable)
        os.environ["TORCH_CUDA_ARCH_LIST"] = readable or ""
    try:
        yield
    finally:
        if original is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = original


# --------------------------------------------------------------------------------------------------
# model building and optimizer parameter groups


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
    # is left to fail loudly: transformers would fill the weights on global rank 0 only (see
    # deepspeed_topology.zero_init_group).
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    dropped = ("tensor_parallel", "train_batch_size") if dp_group is None else ("tensor_parallel",)
    hf_view = {k: v for k, v in config.items() if k not in dropped}
    hf_ds_config = HfDeepSpeedConfig(hf_view)  # noqa: F841  (transformers holds a weak reference)
    try:
        with deepspeed.zero.Init(config_dict_or_path=config, data_parallel_group=dp_group, mpu=mpu):
            return model_factory()
    finally:
        unset_hf_deepspeed_config()


def _fetch_moe_blocks_whole(model: torch.nn.Module) -> None:
    """ZeRO-3 with a mixture-of-experts model: fetch each sparse MoE block's parameters as one leaf.

    ZeRO-3 gathers parameters per submodule as the forward enters it and prefetches along the order it
    traced; which experts a micro-batch reaches differs between ranks and steps, so per-expert fetches can
    fall out of step between ranks (a hang) or off the traced order. ``set_z3_leaf_modules`` makes the block
    fetch all its router and expert parameters on entry, on every rank. Before ``deepspeed.initialize``, which
    installs the hooks. No-op for a dense model.
    """
    classes = sparse_moe_block_classes(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
        log.info("ZeRO-3: %s fetched whole (leaf modules)", ", ".join(c.__name__ for c in classes))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D tensors), as in OpenRLHF / nanoGPT.

    Without weight decay the two groups would be the same, so there is one: DeepSpeed 0.19.8's ZeRO-3 universal
    checkpoint load (a resume on another layout, ``hpc_rlhf.ckpt.universal``) restores the Adam moments of the
    second group wrongly (tests/multiproc/test_resume_resize.py caught it), and one group avoids that for the
    usual RL setting of no weight decay."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if weight_decay == 0.0:
        return [{"params": trainable, "weight_decay": 0.0}]
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in trainable:
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 params are flattened partitions
        (decay if len(shape) >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, num_training_steps: int, role_cfg: TrainedRole):
    """Linear warmup from 0 over ``ceil(total x lr_warmup_ratio)`` steps, then half a cosine down to
    ``min_lr_ratio`` x the peak LR at ``num_training_steps`` (OpenRLHF's ``cosine_with_min_lr``)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    # transformers does not clamp the cosine's progress at 1 (past the horizon the LR would climb back),
    # which no run reaches: offline trainers take exactly num_steps optimizer steps, and RL's
    # setup.optimizer_steps is exact or an upper bound (filtering and stale-sample drops only remove
    # samples, and every step trains on at most rollout_batch_size x n_samples_per_prompt of them).
    # The LambdaLR holds a functools.partial whose state_dict part is empty: a resumed run rebuilds the
    # schedule from the config here and DeepSpeed restores last_epoch from the checkpoint.
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=math.ceil(num_training_steps * role_cfg.lr_warmup_ratio),
        num_training_steps=num_training_steps, min_lr_rate=role_cfg.min_lr_ratio)


# --------------------------------------------------------------------------------------------------
# engines


class _DeepSpeedRole:
    """What both engines share: the DeepSpeed engine of one role, its ZeRO stage and process groups, the wrapped
    module and its forward."""

    def __init__(self, engine, *, zero_stage: int, dp_group: ProcessGroup | None, tp_group: ProcessGroup | None,
                 on_gpu: bool):
        self.engine = engine
        self.zero_stage = zero_stage
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.on_gpu = on_gpu

    @staticmethod
    def _partitioned_model(model_factory: Callable[[], torch.nn.Module], ds_cfg: DeepSpeedConfig,
                           role_cfg: TrainedRole | None, *, train_batch_size: int | None, micro_train_batch_size: int,
                           dp_group: ProcessGroup | None, tp_group: ProcessGroup | None, on_gpu: bool, lora: bool,
                           offload_params: bool = False, extra_ds_config: dict | None = None):
        """The steps both ``create`` share: the role's groups handed to DeepSpeed, its JSON config
        (``role_cfg=None``: frozen), the factory's model (inside ``zero.Init`` under ZeRO-3) with AutoTP shards
        copied from the tp leader. ``train_batch_size=None``: one micro-batch per data-parallel replica. Returns
        ``(model, config, dp_size, mpu, tp_group)``. Collective."""
        init_deepspeed_dist()
        tp_group = tp_group_for(ds_cfg, tp_group, dp_group, lora)
        dp_size, mpu = dp_setup(dp_group, tp_group)
        if train_batch_size is None:
            train_batch_size = micro_train_batch_size * dp_size
        config = build_ds_config(ds_cfg, role_cfg, train_batch_size=train_batch_size,
                                 micro_train_batch_size=micro_train_batch_size, dp_size=dp_size, on_gpu=on_gpu,
                                 offload_params=offload_params, tp_size=ds_cfg.tensor_parallel_size,
                                 extra=extra_ds_config)
        init_group = zero_init_group(config, dp_group, tp_group)
        if tp_group is not None:
            if dp_group is None:
                raise ValueError("tensor parallelism needs the role's data-parallel group (dp_group)")
            install_tp_groups(tp_group, dp_group)
        model = _build_model(model_factory, config, init_group, mpu)
        copy_from_tp_leader(model, tp_group, config["zero_optimization"]["stage"])
        if config["zero_optimization"]["stage"] == 3:
            _fetch_moe_blocks_whole(model)
        return model, config, dp_size, mpu, tp_group

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def eval(self) -> None:
        self.engine.eval()


class TrainEngine(_DeepSpeedRole):
    """A model wrapped by DeepSpeed for one trainable role (actor, critic)."""

    def __init__(self, engine, *, zero_stage: int, dp_group: ProcessGroup | None, on_gpu: bool,
                 adam_offload: bool, lora: bool = False, tp_group: ProcessGroup | None = None):
        super().__init__(engine, zero_stage=zero_stage, dp_group=dp_group, tp_group=tp_group, on_gpu=on_gpu)
        self.lora = lora
        self._adam_offload = adam_offload
        self._offloaded_states: set = set()  # DeepSpeed OffloadStateTypeEnum members now on the host
        self._warned_optimizer_stays = False

    @classmethod
    def create(cls, model_factory: Callable[[], torch.nn.Module], ds_cfg: DeepSpeedConfig, role_cfg: TrainedRole,
               *, train_batch_size: int, micro_train_batch_size: int, num_training_steps: int,
               dp_group: ProcessGroup | None = None, tp_group: ProcessGroup | None = None,
               on_gpu: bool | None = None, extra_ds_config: dict | None = None) -> TrainEngine:
        """Build the model (inside ``zero.Init`` for ZeRO-3), the optimizer, the LR schedule and the engine.

        Collective over ``dp_group`` (default: the world) and ``tp_group``, which ``ds.tensor_parallel_size > 1``
        requires (the role's groups from ``hpc_rlhf.world.groups``). ``num_training_steps`` counts optimizer steps.
        ``ds_cfg.lora.rank > 0`` injects LoRA (peft) into the factory's model before DeepSpeed sees it: only
        the adapters (and a value model's ``score`` head) train. Under ZeRO-3 the adapters are created outside
        ``zero.Init`` and partitioned by ``deepspeed.initialize``.
        """
        import deepspeed  # lazily: importing the facade must not pull in deepspeed

        on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        lora = ds_cfg.lora.rank > 0
        model, config, dp_size, mpu, tp_group = cls._partitioned_model(
            model_factory, ds_cfg, role_cfg, train_batch_size=train_batch_size,
            micro_train_batch_size=micro_train_batch_size, dp_group=dp_group, tp_group=tp_group, on_gpu=on_gpu,
            lora=lora, extra_ds_config=extra_ds_config)
        if lora:
            model = apply_lora(model, ds_cfg.lora)
        if ds_cfg.gradient_checkpointing:
            enable_activation_checkpointing(model, use_reentrant=False)
        with _arch_list_deepspeed_can_read():  # FusedAdam / cpu_adam are JIT-built here, on first use
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=_param_groups(model, role_cfg.weight_decay), config=config,
                lr_scheduler=lambda optimizer: _warmup_cosine_scheduler(optimizer, num_training_steps, role_cfg),
                mpu=mpu, dist_init_required=False,
            )
        if config["zero_optimization"]["stage"] == 0 and dp_size == 1 and tp_group is None:
            # One replica: DeepSpeed would still flatten every gradient into a bucket, "all-reduce" it over
            # one rank and copy it back at each boundary (0.44 s of a 7.9 s step at 135M parameters on CPU).
            engine.enable_backward_allreduce = False
        if is_first_rank_of_role(dp_group):
            zero = config["zero_optimization"]
            adam = adam_implementation(on_gpu=on_gpu, offloaded="offload_optimizer" in zero, zero_stage=zero["stage"])
            log.info("optimizer: %s", adam.describe())
        return cls(engine, zero_stage=config["zero_optimization"]["stage"], dp_group=dp_group, on_gpu=on_gpu,
                   adam_offload=ds_cfg.adam_offload, lora=lora, tp_group=tp_group)

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
                # fp32 sum of squares (pairwise on CPU: ~1e-7 relative) accumulated in fp64; no fp64 copy of
                # the gradient. (fp32 vector_norm is off by ~1e-3 on a 28M-element CPU tensor.)
                square = p.grad.float().pow(2).sum().double()
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

    def _can_offload(self) -> bool:
        # DeepSpeed 0.19's ZeRO optimizers (stages 1-3) move their states to host memory and back; stage 0 has
        # no ZeRO optimizer to do it (its states stay resident: plan counts them). DeepSpeed asserts against
        # parameter offload and needs an accelerator to free. On CPU there is nothing to free.
        return self.on_gpu and self.zero_stage >= 1 and hasattr(self.engine, "offload_states")

    def offload_states(self, keep_weights: bool = False) -> None:
        """Free accelerator memory between phases (colocated hybrid engine). No-op on CPU and at ZeRO-0.

        ``keep_weights``: move gradients, Adam moments and fp32 master weights only, keeping the bf16
        weights for a following ``gathered_state_dict_items``; a later plain call moves those too. With
        ``ds.adam_offload`` the optimizer states and master weights live on the host already (and ZeRO-3's
        offload_states accepts them only from DeepSpeed's FusedAdam): weights and gradients move."""
        if not self._can_offload():
            return
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        wanted = set(State)
        if self._adam_offload or not self._optimizer_movable():
            wanted -= {State.optim_states, State.hp_params}
        if keep_weights:
            wanted -= {State.lp_params}
        if not wanted <= self._offloaded_states:
            self.engine.offload_states(include=wanted)  # DeepSpeed skips what is already on the host
            self._offloaded_states |= wanted

    def _optimizer_movable(self) -> bool:
        """DeepSpeed 0.19's ZeRO-3 offload_states moves optimizer states and master weights only from its own
        FusedAdam (it asserts so); with another optimizer they stay on the GPU (logged once)."""
        if self.zero_stage < 3:
            return True
        inner = getattr(getattr(self.engine, "optimizer", None), "optimizer", None)
        movable = type(inner).__name__ == "FusedAdam"
        if not movable and not self._warned_optimizer_stays:
            self._warned_optimizer_stays = True
            log.warning("ZeRO-3 with %s: DeepSpeed moves optimizer states only from its FusedAdam, so Adam states "
                        "and fp32 master weights stay on the GPU between phases", type(inner).__name__)
        return movable

    def reload_states(self) -> None:
        if self._offloaded_states:
            self.engine.reload_states()
            self._offloaded_states = set()

    def gathered_state_dict_items(self, bucket_bytes: int = 256 << 20,
                                  names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (name, full detached copy) covering each parameter once plus persistent buffers.

        Tied weights appear once, under their first name. Under ZeRO-3 this is a collective over the dp
        group, with tensor parallelism over the tp group (each shard is all-gathered into the full tensor): every
        rank of the role must then exhaust the iterator. With LoRA the names are the plain HF ones and
        the tensors the merged ``W + scale * B @ A`` (what the rollout engine and the HF export need).
        ``names``: only these buckets of ``state_dict_sizes`` names (a weight-sync plan's share of this rank).
        """
        if self.lora:
            yield from iter_merged_lora_state_dict(self.module, self.zero_stage, bucket_bytes, names)
        else:
            yield from iter_gathered_state_dict(self.module, self.zero_stage, bucket_bytes, names)

    def state_dict_sizes(self) -> list[tuple[str, int]]:
        """(name, full bytes) of the entries ``gathered_state_dict_items`` buckets, in its order."""
        return state_dict_sizes(self.module)

    def gathered_adapter_items(self, bucket_bytes: int = 256 << 20,
                               names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (peft's saved name, detached copy) of the LoRA adapter alone (``ds.lora.sync=adapter``);
        collective over the dp group under ZeRO-3. ``names``: only these buckets of ``adapter_state_sizes`` names."""
        if not self.lora:
            raise RuntimeError("gathered_adapter_items: this engine trains no LoRA adapter (ds.lora.rank=0)")
        yield from iter_adapter_state_dict(self.module, self.zero_stage, bucket_bytes, names)

    def adapter_state_sizes(self) -> list[tuple[str, int]]:
        """(name, bytes) of the entries ``gathered_adapter_items`` buckets, in its order (ZeRO 0-2)."""
        return adapter_state_sizes(self.module, self.zero_stage)

    def save_checkpoint(self, path: str, tag: str, client_state: dict | None = None) -> None:
        """Weights, optimizer, LR schedule and ``client_state`` (collective; see module doc for subgroups).

        With LoRA the frozen base is left out (it is reloaded from ``pretrain``): see ``load_trainable_state``.
        """
        self.engine.save_checkpoint(path, tag=tag, client_state=client_state or {}, save_latest=False,
                                    exclude_frozen_parameters=self.lora)

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

    def load_checkpoint(self, path: str, tag: str, universal: bool = False) -> dict:
        """Restore what ``save_checkpoint`` wrote; returns its ``client_state``. ``universal``: ``path`` holds the
        universal copy of a checkpoint saved with another layout (``hpc_rlhf.ckpt.universal``), which this engine
        re-partitions for its own data-parallel size, ZeRO stage and tensor-parallel size."""
        custom_load_fn = load_trainable_state if self.lora else None
        # DeepSpeed reads this flag from its config at load time only; set it for this load and restore it, so a
        # later native load of this engine is unaffected.
        saved_flag = self.engine._config.load_universal_checkpoint
        self.engine._config.load_universal_checkpoint = universal
        try:
            load_path, client_state = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                                  load_lr_scheduler_states=True,
                                                                  custom_load_fn=custom_load_fn)
        finally:
            self.engine._config.load_universal_checkpoint = saved_flag
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {tag!r} under {path}")
        return client_state or {}

    def save_hf(self, output_dir: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """Rank 0 of the role writes a HF folder (safetensors); collective for all ranks of the role.

        With LoRA: merged weights under plain HF names, plus the adapter in ``output_dir/adapter``.
        """
        # ZeRO 0-2 hold full weights on every rank: only the writing rank needs to merge them (LoRA never
        # runs with tensor parallelism, whose gather is collective).
        needed = not self.lora or self.zero_stage == 3 or is_first_rank_of_role(self.dp_group)
        buckets = self.gathered_state_dict_items(256 << 20) if needed else iter(())
        write_hf_folder(self.module, buckets, self.zero_stage, self.dp_group, output_dir, tokenizer, lora=self.lora,
                        tp_group=self.tp_group)


class FrozenEngine(_DeepSpeedRole):
    """Inference-only role (reference model, reward model): ZeRO-3 partitioning when ``ds.zero_stage == 3``,
    optional CPU parameter offload (``role_cfg.offload``, GPU only), eval mode, no optimizer."""

    def __init__(self, engine, *, zero_stage: int, dp_group: ProcessGroup | None,
                 tp_group: ProcessGroup | None = None, on_gpu: bool = False):
        super().__init__(engine, zero_stage=zero_stage, dp_group=dp_group, tp_group=tp_group, on_gpu=on_gpu)
        self._offloaded = False

    @classmethod
    def create(cls, model_factory: Callable[[], torch.nn.Module], ds_cfg: DeepSpeedConfig, role_cfg: ModelRole,
               *, micro_batch_size: int, dp_group: ProcessGroup | None = None,
               tp_group: ProcessGroup | None = None, on_gpu: bool | None = None,
               extra_ds_config: dict | None = None) -> FrozenEngine:
        """Collective over ``dp_group`` and ``tp_group`` (needed when ``ds.tensor_parallel_size > 1``)."""
        import deepspeed  # lazily: importing the facade must not pull in deepspeed

        on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        model, config, _, mpu, tp_group = cls._partitioned_model(
            model_factory, ds_cfg, None, train_batch_size=None, micro_train_batch_size=micro_batch_size,
            dp_group=dp_group, tp_group=tp_group, on_gpu=on_gpu, lora=False,  # frozen roles never get LoRA
            offload_params=role_cfg.offload, extra_ds_config=extra_ds_config)
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu, dist_init_required=False)
        engine.eval()
        return cls(engine, zero_stage=config["zero_optimization"]["stage"], dp_group=dp_group, tp_group=tp_group,
                   on_gpu=on_gpu)

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def offload_states(self) -> None:
        """Move the whole (stage-0) model to host memory on GPU. ZeRO-3 partitions stay where ``role_cfg.offload``
        put them: DeepSpeed moves ZeRO-3 states only with an optimizer, which a frozen role lacks."""
        if self.on_gpu and self.zero_stage == 0 and not self._offloaded:
            self.engine.module.to("cpu")
            self._offloaded = True

    def reload_states(self) -> None:
        if self._offloaded:
            self.engine.module.to(self.engine.device)
            self._offloaded = False

    def gathered_state_dict_items(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield from iter_gathered_state_dict(self.module, self.zero_stage, bucket_bytes)
