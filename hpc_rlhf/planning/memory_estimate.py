"""Per-rank memory estimate of a placement, without loading any model. Pure Python.

What one rank of a role holds, in bytes per parameter ``N`` (after tensor parallelism) and per token:

Model states (DeepSpeed 0.19 as ``hpc_rlhf.training.deepspeed_engine.build_ds_config`` configures it;
ZeRO paper accounting, Rajbhandari et al., 2020, with what DeepSpeed really allocates):

- weights: ``p`` bytes (2 in bf16, 4 in fp32), divided over the ZeRO ranks (dp x sp) at stage 3;
- gradients: 4 bytes, fp32 accumulation (bf16 runs set ``data_types.grad_accum_dtype=fp32``; stage 1
  then uses DeepSpeed's BF16 optimizer, whose fp32 gradient buffer is *not* sharded), divided at stage >= 2;
- optimizer: Adam ``exp_avg`` + ``exp_avg_sq`` (8 bytes) plus an fp32 master copy (4 bytes) when the
  weights are bf16 or a ZeRO optimizer runs (stages 1-3 clone their partition even in fp32); only fp32
  stage 0 updates the weights in place. Divided at stage >= 1; zero with ``ds.adam_offload``;
- buffers: the gradient reduce bucket of ZeRO-2/3 (``reduce_bucket_size``, 5e8 elements by default,
  allocated whole on a GPU), and under ZeRO-3 the gathered full parameters: DeepSpeed keeps up to
  ``stage3_max_live_parameters`` (1e9) of them between forward and backward. At the end of a ZeRO-3
  backward the reduce-scatter flattens a bucket into a new tensor next to the largest weight's full
  gradient; that transient replaces the (by then freed) activations when it is the larger.

Activations (one micro-batch, what autograd saves, counted on transformers' Llama with SDPA):

- per layer and token: ``6h`` replicated (two RMSNorms: input, normalised input, output) plus
  ``2 q_dim + 2 kv_dim + 4 i`` split by tensor parallelism (roped q and k, v, attention output; SwiGLU
  gate, activation, up, product), in the parameter dtype; eager attention adds ``heads x seq`` probabilities;
- mixture-of-experts layers (``moe_mlp_elements``): the dense MLP's ``4 i`` becomes, per token, ``2h + 4 moe_i`` for
  each of its ``top_k`` experts, ``4 shared_i`` for the shared experts (``+ h + 1`` when gated), and the router's
  fp32 probabilities (``E x 4`` bytes); a trained MoE model's forward also returns its router logits (``E`` a
  sparse layer, activation dtype), kept until the loss;
- with gradient checkpointing only each layer's input (``h``) is kept, plus one layer recomputed (the largest);
- logits of the LM head, on the response positions only (``logits_to_keep``; every local token under
  ring attention), in fp32 (``logprobs_from_logits`` upcasts) are saved, and the backward of the
  log-softmax holds about three more logits-sized tensors at its peak; a no-grad forward (ref) holds
  the logits, their fp32 copy and one fp32 temporary;
- sequence parallelism (ring attention) divides the tokens of a micro-batch over ``ds.ring_attn_size``.

LoRA and QLoRA (``ds.lora``) change these terms as ``hpc_rlhf.planning.lora_memory`` says; model shapes and
parameter counts come from ``hpc_rlhf.planning.model_shape``.

A value model (critic, reward model; the RM trainer's model) has no LM head: ``AutoModelForSequenceClassification``
drops it and adds a ``score`` head of ``h`` parameters, so its weights are counted without ``V x h`` when the
embeddings are untied.

A rank's peak sums the model states of every role it hosts plus the largest working set (activations
and gathered parameters) among them: colocated roles run their phases one after the other.

Validated against measured peak memory on CPU (fp32, gloo) by ``tests/multiproc/test_memory_estimate.py``;
see ``docs/memory.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpc_rlhf.config.schema import DeepSpeedConfig, RunConfig, resolved_param_dtype
from hpc_rlhf.config.supervised import ReferenceRunConfig, SupervisedRunConfig
from hpc_rlhf.planning.lora_memory import (
    ROUTER_PROB_BYTES,
    LoraSpec,
    dequantize_transient_bytes,
    expert_targets,
    largest_lora_tensor,
    lora_layer_elements,
    lora_merged_elements,
    lora_params,
    lora_sparse_layer_elements,
    nf4_bytes,
    quantized_linear_count,
    quantized_linear_params,
)
from hpc_rlhf.planning.model_shape import (
    ModelShape,
    ModelSizeError,
    local_hf_config,
    nearest_reference_shape,
    role_num_params,
    role_shape,
    section_num_params,
)
from hpc_rlhf.world.placement import POLICY_ROLES, TRAINED_ROLES, Placement

GIB = 1024**3
ADAM_MOMENTS_BYTES = 8  # exp_avg + exp_avg_sq in fp32
MASTER_BYTES = 4  # fp32 master copy of bf16 weights
GRAD_BYTES = 4  # fp32 gradient accumulation
LOGITS_BYTES = 4  # logprobs are computed from fp32 logits
LOGITS_BACKWARD_COPIES = 3  # log-softmax backward: softmax, scattered gather grad, grad of the logits
# DeepSpeed 0.19 defaults that build_ds_config leaves as they are.
DS_REDUCE_BUCKET_SIZE = 500_000_000
DS_STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000


@dataclass(frozen=True)
class RoleMemory:
    """One rank's share of a role, in GiB. ``states`` stay resident; ``working`` exists during its phase."""

    role: str
    weights_gib: float
    grads_gib: float
    optim_gib: float
    buffers_gib: float = 0.0
    gathered_gib: float = 0.0
    activations_gib: float = 0.0
    reduce_gib: float = 0.0
    tokens_per_rank: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def states_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optim_gib + self.buffers_gib

    @property
    def working_gib(self) -> float:
        """Gathered ZeRO-3 parameters + the larger of the activations and the end-of-backward reduce."""
        return self.gathered_gib + max(self.activations_gib, self.reduce_gib)

    @property
    def total_gib(self) -> float:
        return self.states_gib + self.working_gib


def _bytes_per_weight(param_dtype: str, on_gpu: bool) -> int:
    return 2 if resolved_param_dtype(param_dtype, on_gpu) == "bf16" else 4


def effective_zero_stage(zero_stage: int, dp: int, trainable: bool, adam_offload: bool, *, bf16: bool) -> int:
    """The stage DeepSpeed really runs (mirrors ``build_ds_config``): frozen roles use only stage 3. A trained
    role in fp32 falls back from stages 1-2 to 0 on one data-parallel rank (nothing to shard). A trained role in
    bf16 (``bf16``: the weights' dtype as resolved) runs stages 0-2 as stage 2: DeepSpeed 0.19 refuses bf16
    weights with fp32 gradient accumulation without a ZeRO optimizer ("unsupported mix of model_dtype" at stage 0,
    seen on an H200), and at stage 1 it steps them with its BF16_Optimizer, which has no ``offload_states``."""
    stage = zero_stage if trainable or zero_stage == 3 else 0
    if trainable and bf16 and stage < 3:
        return 2
    if dp == 1 and stage in (1, 2) and not adam_offload:
        stage = 0
    return stage


def model_state_bytes(num_params: float, *, param_bytes: int, zero_stage: int, dp: int, trainable: bool,
                      adam_offload: bool = False, on_gpu: bool = True,
                      largest_tensor_params: float = 0.0, lora_params: float | None = None,
                      quantized_params: float = 0.0, quantized_tensors: int = 0) -> dict[str, float]:
    """Bytes of weights, grads, optimizer states, persistent buffers, gathered ZeRO-3 parameters and the
    ZeRO-3 gradient reduce-scatter transient on one rank holding ``num_params`` (already divided by tensor
    parallelism), ``zero_stage`` as DeepSpeed runs it.

    ``lora_params`` (LoRA): ``num_params`` is the frozen base and these adapter parameters, stored next to it in
    the parameter dtype, are the only trainable ones: gradients, optimizer states and buffers count them alone,
    and the frozen base is partitioned only at stage 3. ``quantized_params`` of the base are NF4 in
    ``quantized_tensors`` weights (QLoRA, stages 0-2: never partitioned). ``largest_tensor_params``: the
    largest trainable tensor (the ZeRO-3 reduce transient holds its full gradient).
    """
    stage = zero_stage
    plain = num_params - quantized_params + (lora_params or 0.0)
    trained = num_params if lora_params is None else lora_params
    out = {"weights": plain * param_bytes / (dp if stage >= 3 else 1) + nf4_bytes(quantized_params, quantized_tensors),
           "grads": 0.0, "optim": 0.0, "buffers": 0.0, "gathered": 0.0, "reduce": 0.0}
    if trainable:
        out["grads"] = trained * GRAD_BYTES / (dp if stage >= 2 else 1)
        if not adam_offload:
            # Every ZeRO optimizer (1-3) keeps its own fp32 copy of the partition, even of fp32 weights
            # (checked on DeepSpeed 0.19.8); only plain fp32 training (stage 0) updates the weights in place.
            master = MASTER_BYTES if param_bytes != 4 or stage >= 1 else 0
            out["optim"] = trained * (ADAM_MOMENTS_BYTES + master) / (dp if stage >= 1 else 1)
        if stage >= 2:
            # torch.empty(reduce_bucket_size): a GPU allocator reserves all of it, host memory only what is used.
            bucket = (DS_REDUCE_BUCKET_SIZE if on_gpu else min(DS_REDUCE_BUCKET_SIZE, trained)) * param_bytes
            out["buffers"] = bucket
            if stage == 3:
                # reduce_scatter_coalesced flattens a full bucket into a new tensor, while autograd has just
                # produced a full-size gradient of the largest weight; at the end of the backward, when the
                # activations are gone (measured on CPU: the checkpointed case peaks here).
                out["reduce"] = bucket + largest_tensor_params * param_bytes
    if stage == 3 and dp > 1:
        out["gathered"] = min(plain, DS_STAGE3_MAX_LIVE_PARAMETERS) * param_bytes
    return out


def moe_mlp_elements(shape: ModelShape, act_bytes: int) -> float:
    """Elements (of the activation dtype) autograd saves per token in the MLP of one sparse layer.

    A token runs only its ``top_k`` routed experts, so those count, not all ``E``: for each, transformers'
    default ``grouped_mm`` experts path (and its eager loop) keeps the gathered copy of the token's input (``h``),
    the fused gate-up output (``2 moe_i``, gate and up), the activation and the SwiGLU product (``2 moe_i``) and the
    expert's output, saved for the routing-weight multiply (``h``). The shared experts run on every token: a dense
    SwiGLU MLP ``shared_i`` wide (``4 shared_i``; its input is the normalised hidden state, already counted), plus
    for Qwen2-MoE's sigmoid gate the gate value and the shared output (``h + 1``). The router saves its
    probabilities in fp32 (``E`` of them, ``ROUTER_PROB_BYTES`` each). Index tensors (about ``10 top_k`` int32
    elements a token) are left out. Checked with ``torch.autograd.graph.saved_tensors_hooks`` on transformers'
    Mixtral and Qwen2-MoE in ``tests/unit/test_plan_moe.py``.
    """
    h = shape.hidden_size
    routed = shape.experts_per_token * (2 * h + 4 * shape.moe_intermediate_size)
    shared = 4 * shape.shared_expert_intermediate_size + (h + 1 if shape.shared_expert_gate else 0)
    return routed + shared + shape.num_experts * ROUTER_PROB_BYTES / act_bytes


def activation_bytes(shape: ModelShape, *, tokens: int, logit_tokens: int, act_bytes: int, tp: int = 1,
                     gradient_checkpointing: bool = False, eager_seq_len: int | None = None,
                     trainable: bool = True, lora: LoraSpec | None = None, on_gpu: bool = True) -> float:
    """Peak activation bytes of one micro-batch on one rank (``tokens`` after sequence-parallel splitting).

    ``logit_tokens``: tokens whose LM-head logits are computed (0 for value models). ``eager_seq_len``:
    attention probabilities are materialised (eager attention) for rows of this length. ``trainable=False``
    is a no-grad forward: one layer's tensors and the logits, nothing saved. ``lora``: only LoRA adapters
    train (``lora_layer_elements`` per layer; the frozen final norm keeps its input only); ``on_gpu`` then
    sizes the dropout mask.

    An MoE model's sparse layers save :func:`moe_mlp_elements` instead of the dense MLP's ``4 i``; trained, its
    forward also returns the router logits of every sparse layer (``E`` a token each, in the activation dtype;
    the trainers ask for them: routing metrics, load-balancing loss), kept until the loss whether or not the
    layers are checkpointed. The load-balancing loss's own softmax over them (``algo.aux_loss_coef > 0``) is not
    counted. Under LoRA the dense layers save :func:`lora_layer_elements`, the sparse ones
    :func:`lora_sparse_layer_elements`, and the merged copies of adapted fused experts (peft's ``ParamWrapper``)
    are saved per sparse layer whatever the token count, plus one of their gradients (:func:`lora_merged_elements`).
    """
    h = shape.hidden_size
    eager = shape.num_heads / tp * eager_seq_len if eager_seq_len else 0
    attention = 6 * h + (2 * shape.q_dim + 2 * shape.kv_dim) / tp + eager
    dense_layer = attention + 4 * shape.intermediate_size / tp
    sparse_layer = attention + moe_mlp_elements(shape, act_bytes) if shape.is_moe else dense_layer
    sparse = shape.num_sparse_layers if shape.is_moe else 0
    largest_layer = max(dense_layer if sparse < shape.num_layers else 0.0, sparse_layer if sparse else 0.0)
    if not trainable:
        logits = logit_tokens * shape.vocab_size * (act_bytes + 2 * LOGITS_BYTES)
        return tokens * largest_layer * act_bytes + logits
    final_norm = 3 * h
    head_input = 0.0
    router_logits = sparse * shape.num_experts
    layers = (shape.num_layers - sparse) * dense_layer + sparse * sparse_layer
    merged = 0.0
    if lora is not None:
        mask = 1 / act_bytes if on_gpu else 1.0
        dense_layer = lora_layer_elements(shape, lora, tp=tp, dropout_mask_elems=mask) + eager
        if sparse:
            sparse_layer = lora_sparse_layer_elements(shape, lora, act_bytes, dropout_mask_elems=mask) + eager
        largest_layer = max(dense_layer if sparse < shape.num_layers else 0.0, sparse_layer if sparse else 0.0)
        layers = (shape.num_layers - sparse) * dense_layer + sparse * sparse_layer
        final_norm = h
        if "lm_head" in lora.targets:  # the LM head's (kept positions') input and lora_A output
            head_input = logit_tokens * (h + lora.rank) * act_bytes
        per_layer, largest_merged = lora_merged_elements(shape, lora)
        if per_layer:  # merged expert weights: every sparse layer's, or the recomputed one's; one gradient
            merged = (per_layer * (1 if gradient_checkpointing else sparse) + largest_merged) * act_bytes
    saved_per_token = h * shape.num_layers + largest_layer if gradient_checkpointing else layers
    saved_per_token += final_norm + router_logits
    upcast = LOGITS_BYTES + (act_bytes if act_bytes != LOGITS_BYTES else 0)
    logits = logit_tokens * shape.vocab_size * (upcast + LOGITS_BACKWARD_COPIES * LOGITS_BYTES)
    return tokens * saved_per_token * act_bytes + logits + head_input + merged


def micro_batch_tokens(cfg: RunConfig, role: str) -> int:
    """Tokens of one micro-batch of ``role`` before sequence-parallel splitting.

    Trained roles: ``train.max_tokens_per_gpu x ds.ring_attn_size`` with ``train.use_dynamic_batch`` (a
    sample longer than the budget runs alone), else ``train.micro_train_batch_size`` rows of
    ``data.max_len`` (default prompt + generation budget). Frozen roles score
    ``rollout.micro_rollout_batch_size`` rows (or ``rollout.max_tokens_per_gpu x ds.ring_attn_size``).
    """
    seq_len = _rl_seq_len(cfg)
    sp = cfg.ds.ring_attn_size  # token budgets are per GPU; a micro-batch spans the sp group
    if role in TRAINED_ROLES:
        if cfg.train.use_dynamic_batch and cfg.train.max_tokens_per_gpu:
            return max(cfg.train.max_tokens_per_gpu * sp, seq_len)
        return cfg.train.micro_train_batch_size * seq_len
    budget = cfg.rollout.max_tokens_per_gpu or cfg.train.max_tokens_per_gpu
    if cfg.train.use_dynamic_batch and budget:
        return max(budget * sp, seq_len)
    return cfg.rollout.micro_rollout_batch_size * seq_len


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def estimate_role(role: str, shape: ModelShape, num_params: int, ds: DeepSpeedConfig, *, trainable: bool,
                  tokens: int, logit_tokens: int, seq_len: int, dp: int, tp: int = 1, sp: int = 1,
                  on_gpu: bool = True, offload: bool = False, lora: LoraSpec | None = None,
                  quantized: bool = False, value_model: bool = False) -> RoleMemory:
    """Memory of one rank of a role in GiB: its model states under ``ds`` and one micro-batch of ``tokens``
    (before the sequence-parallel split; ``logit_tokens`` of them get LM-head logits). ``dp``: data-parallel
    replicas; ZeRO shards over ``dp x sp`` ranks. ``on_gpu=False``: the same run on CPU (fp32 under auto).

    ``lora``: the role trains LoRA adapters only (``trainable`` must be true). ``quantized``: its layer
    projections are NF4 (QLoRA). ``value_model``: a critic / reward model (no LM head, an ``h`` score head);
    ``num_params`` is still the checkpoint's size."""
    zero_ranks = dp * sp
    p = _bytes_per_weight(ds.param_dtype, on_gpu)
    params = shape.params_per_tp_rank(num_params, tp)
    if value_model:
        params += shape.hidden_size - shape.lm_head_params
    lora = lora if trainable else None
    adapters = lora_params(shape, lora, value_model) if lora is not None else None
    # QLoRA runs without tensor parallelism (the config refuses it): the checkpoint's share of layer projections.
    q_params = num_params * quantized_linear_params(shape) / shape.num_params if quantized else 0.0
    stage = effective_zero_stage(ds.zero_stage, zero_ranks, trainable, ds.adam_offload, bf16=p == 2)
    largest = largest_lora_tensor(shape, lora, value_model) if lora is not None else shape.largest_tensor_params(tp)
    states = model_state_bytes(params, param_bytes=p, zero_stage=stage, dp=zero_ranks, trainable=trainable,
                               adam_offload=ds.adam_offload, on_gpu=on_gpu, largest_tensor_params=largest,
                               lora_params=adapters, quantized_params=q_params,
                               quantized_tensors=quantized_linear_count(shape) if quantized else 0)
    if not trainable and offload:
        states["weights"] = 0.0
    local_tokens = math.ceil(tokens / sp)
    eager = math.ceil(seq_len / sp) if ds.attn_implementation == "eager" else None
    act = activation_bytes(shape, tokens=local_tokens, logit_tokens=math.ceil(logit_tokens / sp), act_bytes=p,
                           tp=tp, gradient_checkpointing=ds.gradient_checkpointing, eager_seq_len=eager,
                           trainable=trainable, lora=lora, on_gpu=on_gpu)
    if quantized:
        act += dequantize_transient_bytes(shape, p)
    notes = [f"ZeRO-{stage} over {zero_ranks} ranks" if zero_ranks > 1 and stage > 0 else f"ZeRO-{stage}"]
    if lora is not None and adapters is not None:
        notes.append(f"LoRA r={lora.rank}: {_count(adapters)} trainable")
        if lora.ignored:
            notes.append(f"LoRA targets not counted: {', '.join(lora.ignored)}")
        if lora.dropout > 0 and expert_targets(shape, lora):
            # peft's ParamWrapper (the fused experts and router) raises for lora_dropout != 0.
            notes.append("peft refuses ds.lora.dropout > 0 on the fused MoE experts: set ds.lora.dropout=0")
    if quantized:
        notes.append(f"4-bit base: {_count(q_params)} params NF4")
    if value_model and shape.lm_head_params:
        notes.append("value model: no LM head")
    if sp > 1:
        notes.append(f"ring attention: {tokens} tokens / {sp} ranks")
    return RoleMemory(role, states["weights"] / GIB, states["grads"] / GIB, states["optim"] / GIB,
                      states["buffers"] / GIB, states["gathered"] / GIB, act / GIB, states["reduce"] / GIB,
                      local_tokens, tuple(notes))


def _rl_seq_len(cfg: RunConfig) -> int:
    return cfg.data.max_len or cfg.data.prompt_max_len + cfg.rollout.generate_max_len


def role_memory(cfg: RunConfig, placement: Placement, role: str, on_gpu: bool = True) -> RoleMemory:
    """Memory of one rank of RL ``role`` in GiB (``on_gpu=False``: the same run on CPU, fp32 under ``auto``)."""
    grid = placement.roles[role]
    trainable = role in TRAINED_ROLES
    tokens = micro_batch_tokens(cfg, role)
    logit_tokens = 0
    if role in POLICY_ROLES:
        # The LM head runs on the response positions only (``logits_to_keep``), except under ring
        # attention, where each rank computes the logits of its whole chunk.
        share = 1.0 if grid.sp_size > 1 else min(1.0, cfg.rollout.generate_max_len / _rl_seq_len(cfg))
        logit_tokens = math.ceil(tokens * share)
    lora = LoraSpec.from_config(cfg.ds.lora)
    # LoRA trains the actor's and critic's adapters; QLoRA loads actor, critic and reference in 4 bit, not the
    # reward model (hpc_rlhf.trainers.rl.setup.build_roles).
    return estimate_role(role, role_shape(cfg, role), role_num_params(cfg, role), cfg.ds, trainable=trainable,
                         tokens=tokens, logit_tokens=logit_tokens, seq_len=_rl_seq_len(cfg), dp=grid.dp_size,
                         tp=grid.tp_size, sp=grid.sp_size, on_gpu=on_gpu,
                         offload=not trainable and getattr(cfg, role).offload,
                         lora=lora,
                         quantized=lora is not None and lora.load_in_4bit and role in ("actor", "critic", "ref"),
                         value_model=role in ("critic", "reward"))


# Rows per sample in the offline trainers' forwards: pairs (RM, DPO), sample + mismatched KL sample (KTO).
SUPERVISED_ROWS_PER_SAMPLE = {"sft": 1, "rm": 2, "dpo": 2, "kto": 2}


def supervised_memory(cfg: SupervisedRunConfig, kind: str, world_size: int,
                      on_gpu: bool = True) -> dict[str, RoleMemory]:
    """Per-rank memory of an offline trainer (``kind`` in sft, rm, dpo, kto): every rank hosts the trained
    ``model`` (data parallel over ``world_size / ds.tensor_parallel_size`` replicas) and, for DPO / KTO, the
    frozen reference."""
    tp = cfg.ds.tensor_parallel_size
    if world_size % tp:
        raise ModelSizeError(f"ds.tensor_parallel_size={tp} does not divide the {world_size} ranks")
    dp = world_size // tp
    seq_len = cfg.data.max_len
    tokens = cfg.train.micro_train_batch_size * SUPERVISED_ROWS_PER_SAMPLE[kind] * seq_len
    num_params = section_num_params(cfg.model)
    if num_params is None:
        raise ModelSizeError("cannot size the model: set model.pretrain to a local model folder with config.json "
                             "or set model.num_params_b")
    hf = local_hf_config(cfg.model)
    shape = ModelShape.from_hf_config(hf) if hf is not None else nearest_reference_shape(num_params)
    logits = 0 if kind == "rm" else tokens  # the LM head runs on every position
    lora = LoraSpec.from_config(cfg.ds.lora)
    q4 = lora is not None and lora.load_in_4bit  # the trained model and the DPO / KTO reference
    out = {"model": estimate_role("model", shape, num_params, cfg.ds, trainable=True, tokens=tokens,
                                  logit_tokens=logits, seq_len=seq_len, dp=dp, tp=tp, on_gpu=on_gpu,
                                  lora=lora, quantized=q4, value_model=kind == "rm")}
    if isinstance(cfg, ReferenceRunConfig):  # DPO, KTO
        out["ref"] = estimate_role("ref", shape, num_params, cfg.ds, trainable=False, tokens=tokens,
                                   logit_tokens=logits, seq_len=seq_len, dp=dp, tp=tp, on_gpu=on_gpu,
                                   offload=cfg.ref.offload, quantized=q4)
    return out


def peak_gib(roles: list[RoleMemory]) -> float:
    """Resident states of every role + the largest working set: colocated roles run one phase at a time."""
    return sum(m.states_gib for m in roles) + max((m.working_gib for m in roles), default=0.0)


@dataclass(frozen=True)
class RankMemory:
    rank: int
    roles: tuple[str, ...]
    training_gib: float
    rollout_gib: float
    peak_gib: float
    sync_gib: float = 0.0  # colocated weight sync (hpc_rlhf.weight_sync.colocated); 0 when not colocated


SYNC_BUCKET_GIB = (256 << 20) / GIB  # one gathered bucket of TrainEngine.gathered_state_dict_items


def leaves_device(cfg: RunConfig, placement: Placement, role: str) -> bool:
    """Whether a colocated ``role``'s states leave the GPU for the weight sync and generation (mirrors
    ``TrainEngine.offload_states`` / ``FrozenEngine.offload_states``): DeepSpeed's ZeRO-1/2/3 optimizers move
    theirs (with ``ds.adam_offload`` only weights and gradients are on the GPU to move); a frozen stage-0
    model moves whole; ZeRO-0 training and frozen ZeRO-3 partitions stay (a frozen role's ``offload: true``
    keeps its partitions on the host anyway)."""
    grid = placement.roles[role]
    trainable = role in TRAINED_ROLES
    stage = effective_zero_stage(cfg.ds.zero_stage, grid.dp_size * grid.sp_size, trainable, cfg.ds.adam_offload,
                                 bf16=resolved_param_dtype(cfg.ds.param_dtype, True) == "bf16")
    if trainable:
        return stage >= 1
    return stage == 0


def colocated_phase_gib(cfg: RunConfig, placement: Placement, roles: tuple[str, ...],
                        per_role: dict[str, RoleMemory], gpu_mem_gb: float) -> tuple[float, float]:
    """(weight-sync peak, generation peak) of a colocated rank hosting ``roles``, in GiB.

    Sync: the states that cannot leave + the actor's bf16 weights (its gradients and Adam states left) + one
    gathered bucket + the rollout engine's weights (``wake_up(["weights"])``, actor-sized, split by the
    rollout tensor parallelism). Generation: the states that cannot leave + vLLM's whole budget
    (``vllm.gpu_memory_utilization`` x GPU memory, weights and KV cache)."""
    trained = [r for r in roles if r != "rollout"]
    resident = sum(per_role[r].states_gib for r in trained if not leaves_device(cfg, placement, r))
    actor = per_role["actor"]
    actor_sync = actor.weights_gib if leaves_device(cfg, placement, "actor") else 0.0  # else counted as resident
    p = _bytes_per_weight(cfg.ds.param_dtype, True)
    rollout_weights = role_num_params(cfg, "actor") * p / placement.roles["rollout"].tp_size / GIB
    sync = resident + actor_sync + SYNC_BUCKET_GIB + rollout_weights
    generation = resident + cfg.vllm.gpu_memory_utilization * gpu_mem_gb
    return sync, generation


def rank_memory(cfg: RunConfig, placement: Placement, gpu_mem_gb: float) -> list[RankMemory]:
    """Peak estimate per rank: resident states of every role it hosts + the largest working set.

    Colocated with vLLM sleep mode, rollout and training time-share the GPU and the peak is the largest of
    the training phase, the weight sync and generation (:func:`colocated_phase_gib`).
    """
    per_role = {r: role_memory(cfg, placement, r) for r in placement.roles if r != "rollout"}
    out = []
    for rank in range(placement.world_size):
        roles = tuple(placement.roles_of(rank))
        training = peak_gib([per_role[r] for r in roles if r != "rollout"])
        rollout = cfg.vllm.gpu_memory_utilization * gpu_mem_gb if "rollout" in roles else 0.0
        time_shared = cfg.train.colocate_all and cfg.vllm.enable_sleep and "rollout" in roles and "actor" in roles
        if time_shared:
            sync, generation = colocated_phase_gib(cfg, placement, roles, per_role, gpu_mem_gb)
            out.append(RankMemory(rank, roles, training, rollout, max(training, sync, generation), sync))
        else:
            out.append(RankMemory(rank, roles, training, rollout, training + rollout))
    return out
