"""Predicted time of one training step, per phase, without loading any model. Pure Python.

A roofline per phase on one rank, with the device's stated efficiencies (``hpc_rlhf.planning.devices``):

- generation, per engine (``rollout.tensor_parallel_size`` ranks): one prefill per prompt, compute-bound
  (``2 N`` FLOPs per prompt token; the prompt's samples share it); then ``generate_max_len`` decode steps,
  each reading the engine's weights and the KV cache of its whole batch (``2 L kv_dim`` values per token at
  the average context), at ``decode_efficiency`` of the memory bandwidth, or compute-bound when the batch
  is large (``2 N`` per sampled token), whichever is slower;
- scoring forwards (reference, reward model, critic values, old actor log-probs): ``2 N`` FLOPs per token
  (the LM head on response tokens only), training: ``6 N`` (``8 N`` with gradient checkpointing), both at
  ``mfu`` of the peak, spread over the role's data- and sequence-parallel ranks and split by its tensor
  parallelism; under ZeRO-3 every micro-batch gathers the weights once per pass (forward, recompute,
  backward) and reduce-scatters its gradients: the longer of compute and communication counts (prefetch
  overlaps them); ``ds.adam_offload`` moves fp32 gradients to the host and weights back, and steps Adam there;
- every forward pass also pays a fixed cost per decoder layer (kernel dispatch) and every optimizer step one;
- weight sync: the actor's weights (parameter dtype) over the path used: in-process (colocated: a ZeRO-3
  gather over the interconnect, else a memory copy), or a broadcast to every rollout rank; colocated with
  sleep mode, the trained states that leave the GPU and vLLM's weights go to the host and back;
- controller traffic: what rank 0 sends and receives to move the step's batches between the roles
  (``hpc_rlhf.world.channel``): prompts out and trajectories back from the rollout engines, each scoring role's
  forward inputs out and its outputs back, each trained role's shards out; the messages are the channel's own
  (``hpc_rlhf.world.traffic``) for the placement's replicas, priced at rank 0's link (NVLink to its own node's
  ranks, the network beyond);
- checkpoint: trained roles' weights + Adam states (+ the HF export) over the filesystem bandwidth.

Phases run one after the other (the controller's step does), except the make-experience forwards (old actor
log-probs, reference, teacher, critic values): the controller starts them together, so roles on disjoint ranks
compute at once and the group costs its busiest rank's forwards (the sum over the roles that rank hosts), not the sum
over all roles; the same for the critic's and actor's updates (``StepTime.overlap_s``, :func:`forwards_overlap`);
the reward model scores in its own phase before them. Calibrated against measured CPU phases and published GPU
numbers in docs/step_time.md; the overlap against benchmarks/experience_overlap.py (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpc_rlhf.config.schema import RunConfig, resolved_param_dtype
from hpc_rlhf.planning.devices import Device
from hpc_rlhf.planning.lora_memory import LoraSpec, lora_params
from hpc_rlhf.planning.memory_estimate import (
    SUPERVISED_ROWS_PER_SAMPLE,
    effective_zero_stage,
    leaves_device,
    role_memory,
)
from hpc_rlhf.planning.model_shape import (
    ModelShape,
    local_hf_config,
    nearest_reference_shape,
    role_num_params,
    role_shape,
    section_num_params,
)
from hpc_rlhf.weight_sync.adapter import adapter_sync_refusal, resolve_lora_sync
from hpc_rlhf.world.placement import POLICY_ROLES, TRAINED_ROLES, Placement
from hpc_rlhf.world.traffic import (
    CONTROLLER,
    Message,
    Payload,
    ReplicaLayout,
    gather_messages,
    per_rank_gather_messages,
    per_rank_scatter_messages,
    scatter_messages,
)

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4
GRAD_BYTES = 4


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    detail: str


@dataclass(frozen=True)
class StepTime:
    """Predicted phases of one step, and the checkpoint's size and save / load times."""

    phases: tuple[Phase, ...]
    checkpoint_bytes: float
    checkpoint_save_s: float
    checkpoint_load_s: float
    overlap: Phase | None = None
    """The seconds the phases above do not cost because they run at once (:func:`forwards_overlap`), if any."""

    @property
    def overlap_s(self) -> float:
        return self.overlap.seconds if self.overlap is not None else 0.0

    @property
    def step_s(self) -> float:
        return sum(p.seconds for p in self.phases) - self.overlap_s


def _flop(x: float) -> str:
    return f"{x / 1e12:.1f} TFLOP" if x >= 1e11 else f"{x / 1e9:.2f} GFLOP"


def _bytes(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB"


# ---- the pieces, by hand-checkable formulas ------------------------------------------------------------

def kv_bytes_per_token(shape: ModelShape, param_bytes: int) -> float:
    """KV cache of one token: a key and a value of ``kv_dim`` per layer."""
    return 2 * shape.num_layers * shape.kv_dim * param_bytes


def decode_bytes_per_step(weight_bytes: float, kv_token_bytes: float, batch: int, context: float, tp: int) -> float:
    """Bytes one GPU of an engine reads per decode step: its share of the weights and of the batch's KV cache."""
    return (weight_bytes + batch * context * kv_token_bytes) / tp


def forward_flops(shape: ModelShape, num_params: float, tokens: float, logit_tokens: float) -> float:
    """``2 N`` per token for the decoder (embedding lookups are free), the LM head on ``logit_tokens`` only.

    ``N`` counts the parameters a token runs: an MoE model's active ones (``ModelShape.active_fraction``).
    """
    head = shape.vocab_size * shape.hidden_size
    body = (num_params - shape.embedding_params) * shape.active_fraction
    return 2 * body * tokens + 2 * head * logit_tokens


def training_flops(shape: ModelShape, num_params: float, tokens: float, logit_tokens: float,
                   gradient_checkpointing: bool) -> float:
    """Forward + backward (2x the forward), plus a recomputed forward under gradient checkpointing."""
    return (4 if gradient_checkpointing else 3) * forward_flops(shape, num_params, tokens, logit_tokens)


def weight_sync_bytes(num_params: float, param_bytes: int) -> float:
    """What one weight sync moves: the actor's weights once, in the parameter dtype."""
    return num_params * param_bytes


def checkpoint_bytes_per_role(trainable_params: float, frozen_params: float, param_bytes: int) -> float:
    """A trained role's checkpoint: every weight in its dtype + fp32 Adam moments (+ an fp32 master copy of
    non-fp32 weights) of the trainable ones (LoRA: the adapters)."""
    master = MASTER_BYTES if param_bytes != 4 else 0
    return (trainable_params + frozen_params) * param_bytes + trainable_params * (ADAM_STATE_BYTES + master)


def zero3_traffic_bytes(weight_bytes: float, zero_ranks: int, passes: int, grad_bytes: float = 0.0) -> float:
    """Bytes one rank receives per micro-batch under ZeRO-3: the other ranks' shards of every weight once per
    pass, and its reduce-scatter share of the gradients."""
    if zero_ranks <= 1:
        return 0.0
    share = (zero_ranks - 1) / zero_ranks
    return weight_bytes * share * passes + grad_bytes * share


# ---- the phases of an RL step -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Ctx:
    cfg: RunConfig
    placement: Placement
    device: Device  # as one rank sees it
    nodes: int
    param_bytes: int
    gpus_per_node: int = 8

    @property
    def samples(self) -> int:
        return self.cfg.rollout.rollout_batch_size * self.cfg.rollout.n_samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.cfg.data.prompt_max_len + self.cfg.rollout.generate_max_len


def _overhead(device: Device, shape: ModelShape, passes: float) -> float:
    return passes * (shape.num_layers + 1) * device.layer_overhead_s


def generation_phase(ctx: _Ctx) -> Phase:
    cfg, device = ctx.cfg, ctx.device
    shape, n = role_shape(cfg, "actor"), role_num_params(cfg, "actor")
    tp = cfg.rollout.tensor_parallel_size
    engines = max(1, len(ctx.placement.roles["rollout"].ranks) // tp)
    prompts = math.ceil(cfg.rollout.rollout_batch_size / engines)
    batch = prompts * cfg.rollout.n_samples_per_prompt
    prompt_len, gen = cfg.data.prompt_max_len, cfg.rollout.generate_max_len
    prefill = forward_flops(shape, n, prompts * prompt_len, prompts) / (tp * device.peak_flops * device.mfu)
    step_bytes = decode_bytes_per_step(n * ctx.param_bytes, kv_bytes_per_token(shape, ctx.param_bytes), batch,
                                       prompt_len + gen / 2, tp)
    memory_s = step_bytes / (device.memory_bw * device.decode_efficiency)
    compute_s = forward_flops(shape, n, batch, batch) / (tp * device.peak_flops * device.mfu)
    decode = gen * max(memory_s, compute_s)
    seconds = prefill + decode + _overhead(device, shape, gen + 1)
    bound = "memory" if memory_s >= compute_s else "compute"
    return Phase("generation", seconds,
                 f"{engines} engine(s) x {batch} samples, {gen} decode steps of {_bytes(step_bytes)}/GPU "
                 f"({bound}-bound), prefill {prompts} x {prompt_len} tokens")


def _role_pass(ctx: _Ctx, role: str, *, train: bool) -> tuple[float, str]:
    """Seconds of one pass of ``role`` over the step's samples on one of its ranks (forward, or training)."""
    cfg, device = ctx.cfg, ctx.device
    grid = ctx.placement.roles[role]
    shape, n = role_shape(cfg, role), role_num_params(cfg, role)
    zero_ranks = grid.dp_size * grid.sp_size
    tokens = ctx.samples * ctx.seq_len / zero_ranks
    logit_tokens = ctx.samples * cfg.rollout.generate_max_len / zero_ranks if role in POLICY_ROLES else 0
    ckpt = cfg.ds.gradient_checkpointing
    flops = (training_flops(shape, n, tokens, logit_tokens, ckpt) if train
             else forward_flops(shape, n, tokens, logit_tokens)) / grid.tp_size
    compute = flops / (device.peak_flops * device.mfu)
    micro_rows = cfg.train.micro_train_batch_size if train else cfg.rollout.micro_rollout_batch_size
    micro_batches = max(1, math.ceil(ctx.samples / zero_ranks / micro_rows))
    passes = (4 if ckpt else 3) if train else 1  # the backward counts as two forward passes of dispatch
    stage = effective_zero_stage(cfg.ds.zero_stage, zero_ranks, train, cfg.ds.adam_offload,
                                 bf16=resolved_param_dtype(cfg.ds.param_dtype, ctx.device.gpu) == "bf16")
    comm = 0.0
    if stage == 3:
        weights = shape.params_per_tp_rank(n, grid.tp_size) * ctx.param_bytes
        gather_passes = (3 if ckpt else 2) if train else 1
        per_micro = zero3_traffic_bytes(weights, zero_ranks, gather_passes,
                                        weights if train else 0.0)
        comm = micro_batches * per_micro / device.collective_bw(ctx.nodes)
    seconds = max(compute, comm) + _overhead(device, shape, passes * micro_batches)
    detail = f"{_flop(flops)}/rank" + (f", ZeRO-3 traffic {comm:.1f} s" if comm else "")
    return seconds, detail


def _optimizer_s(ctx: _Ctx, role: str) -> tuple[float, str]:
    """Optimizer steps of ``role`` per rollout batch: a fixed cost each, plus offload transfers and host Adam."""
    cfg, device = ctx.cfg, ctx.device
    grid = ctx.placement.roles[role]
    steps = max(1, ctx.samples * cfg.train.max_epochs // cfg.train.train_batch_size)
    n = role_num_params(cfg, role)
    trained = _trainable_params(cfg, role, n)
    shard = trained / grid.tp_size / (grid.dp_size * grid.sp_size)
    if cfg.ds.adam_offload:
        transfer = shard * (GRAD_BYTES + ctx.param_bytes) / device.host_link_bw
        per_step = transfer + shard / 1e9 * device.host_adam_s_per_gparam
        note = f"{steps} optimizer step(s), offloaded Adam {per_step:.1f} s each"
    else:
        # Adam reads weights, gradients and both moments and writes three of them back: memory-bound.
        per_step = shard * (ctx.param_bytes + GRAD_BYTES + 2 * ADAM_STATE_BYTES + MASTER_BYTES) / device.memory_bw
        note = f"{steps} optimizer step(s)"
    return steps * (per_step + device.step_overhead_s), note


def _trainable_params(cfg, role: str, num_params: float) -> float:
    lora = LoraSpec.from_config(cfg.ds.lora)
    if lora is None:
        return num_params
    return lora_params(role_shape(cfg, role), lora, role == "critic")


EXPERIENCE_FORWARDS = (("actor", "old logprob"), ("ref", "ref logprob"), ("teacher", "teacher logprob"),
                       ("critic", "values"))  # (role, phase): the forwards the controller starts together


def scoring_phases(ctx: _Ctx, need_old_logprobs: bool) -> list[Phase]:
    roles = ctx.placement.roles
    out = []
    for role, label in (*EXPERIENCE_FORWARDS, ("reward", "reward model")):
        if role not in roles or (role == "actor" and not need_old_logprobs):
            continue
        seconds, detail = _role_pass(ctx, role, train=False)
        out.append(Phase(label, seconds, f"{role} forward, {detail}"))
    return out


TRAINING_UPDATES = (("critic", "train critic"), ("actor", "train actor"))  # the updates started together


def _saving(phases: dict[str, Phase], group: tuple[tuple[str, str], ...],
            role_ranks: dict[str, tuple[int, ...]]) -> tuple[float, float, list[str]]:
    """(sum, busiest rank's share, phase names) of one group of moves started together."""
    moves = [(role, phases[label]) for role, label in group if label in phases]
    load: dict[int, float] = {}
    for role, phase in moves:
        for rank in role_ranks[role]:
            load[rank] = load.get(rank, 0.0) + phase.seconds
    total = sum(phase.seconds for _, phase in moves)
    return total, max(load.values(), default=0.0), [phase.name for _, phase in moves]


def forwards_overlap(phases: list[Phase], role_ranks: dict[str, tuple[int, ...]]) -> Phase | None:
    """What starting the moves of several roles together saves: per group (the make-experience forwards,
    :data:`EXPERIENCE_FORWARDS`; the updates, :data:`TRAINING_UPDATES`), their sum minus their busiest rank's share
    (each rank runs the moves of the roles it hosts one after another; ranks run at once). ``phases``: the step's
    phases, found by name; ``role_ranks``: each role's ranks. None when nothing overlaps (every role on every rank)."""
    by_name = {p.name: p for p in phases}
    saved, notes = 0.0, []
    for group in (EXPERIENCE_FORWARDS, TRAINING_UPDATES):
        total, busiest, names = _saving(by_name, group, role_ranks)
        if total - busiest > 1e-12:
            saved += total - busiest
            notes.append(f"{', '.join(names)}: the busiest rank's {busiest:.3g} s, not their sum {total:.3g} s")
    if not notes:
        return None
    return Phase("moves at once", saved, "; ".join(notes))


def training_phases(ctx: _Ctx) -> list[Phase]:
    out = []
    for role in TRAINED_ROLES:
        if role not in ctx.placement.roles:
            continue
        seconds, detail = _role_pass(ctx, role, train=True)
        seconds *= ctx.cfg.train.max_epochs
        opt, note = _optimizer_s(ctx, role)
        out.append(Phase(f"train {role}", seconds + opt, f"{ctx.cfg.train.max_epochs} epoch(s), {detail}; {note}"))
    return out


def adapter_sync_bytes(cfg: RunConfig, shape: ModelShape, param_bytes: int) -> float | None:
    """What one adapter-only sync moves (``ds.lora.sync`` resolving to adapter: the LoRA factors of
    :func:`lora_params` in the parameter dtype), or None when the run syncs merged weights (no LoRA, or
    ``ds.lora.sync`` resolves to merged for this engine, ``hpc_rlhf.weight_sync.adapter``)."""
    lora = LoraSpec.from_config(cfg.ds.lora)
    if lora is None:
        return None
    refusal = adapter_sync_refusal(backend=cfg.rollout.backend, load_in_4bit=lora.load_in_4bit, moe=shape.is_moe,
                                   target_modules=cfg.ds.lora.target_modules, vision_language=False,
                                   discards_weights_in_sleep=cfg.vllm.enable_sleep and cfg.vllm.sleep_level == 2)
    try:
        adapter = resolve_lora_sync(cfg.ds.lora.sync, refusal) == "adapter"
    except ValueError:
        adapter = False  # the trainer refuses this config at start-up; plan sizes the merged sync
    return lora_params(shape, lora) * param_bytes if adapter else None


def weight_sync_phase(ctx: _Ctx) -> Phase:
    cfg, device, placement = ctx.cfg, ctx.device, ctx.placement
    n = role_num_params(cfg, "actor")
    sync = weight_sync_bytes(n, ctx.param_bytes)
    weights = sync  # what vLLM's sleep moves to the host and back, merged or adapter sync alike
    adapter = adapter_sync_bytes(cfg, role_shape(cfg, "actor"), ctx.param_bytes)
    if adapter is not None:  # the engine keeps its base: only the adapter is gathered and moved
        sync = adapter
    actor = placement.roles["actor"]
    if placement.layout == "colocated":
        zero_ranks = actor.dp_size * actor.sp_size
        stage = effective_zero_stage(cfg.ds.zero_stage, zero_ranks, True, cfg.ds.adam_offload,
                                     bf16=resolved_param_dtype(cfg.ds.param_dtype, device.gpu) == "bf16")
        gather = zero3_traffic_bytes(sync / actor.tp_size, zero_ranks, 1) if stage == 3 else 0.0
        seconds = gather / device.collective_bw(ctx.nodes) + sync / device.memory_bw
        path = "in-process" + (f", ZeRO-3 gather {gather / 1e9:.1f} GB/rank" if gather else "")
        if cfg.train.colocate_all and cfg.vllm.enable_sleep and cfg.rollout.backend == "vllm":
            moved = sum(role_memory(cfg, placement, r).states_gib * 1024**3 for r in placement.roles
                        if r != "rollout" and leaves_device(cfg, placement, r))
            moved += weights / placement.roles["rollout"].tp_size  # vLLM's weights sleep to the host and wake
            seconds += 2 * moved / device.host_link_bw
            path += f"; sleep/wake moves {2 * moved / 1e9:.1f} GB/GPU over the host link"
    else:
        seconds = sync / device.collective_bw(ctx.nodes)
        path = f"broadcast from {len(actor.tp_groups)} actor replica(s) to every rollout rank"
    if adapter is not None:
        path = f"LoRA adapter only (ds.lora.sync; merged would move {_bytes(weights)}), {path}"
    return Phase("weight sync", seconds, f"{_bytes(sync)}, {path}")


# ---- controller traffic: the step's batches through rank 0 ----------------------------------------------------
# Bytes per row of the tensors a role receives (StepBatch fields; W = prompt + response columns, R = response).
_FORWARD_ROW = {"sequences": ("W", 8), "attention_mask": ("W", 8), "action_mask": ("R", 1)}  # long, long, bool
_TRAIN_EXTRA = {"critic": ("values", "returns")}  # fp32 (B, R) fields a trained role receives besides those
# Estimates for what travels pickled (the channel sends its exact size; ``plan`` cannot know it):
SKELETON_BYTES = 96  # the nest around the tensors, plus per tensor:
SKELETON_BYTES_PER_TENSOR = 64  # its key, shape and dtype
TEXT_BYTES_PER_TOKEN = 4  # a prompt travels as text: about 4 characters per token
# A trajectory comes back as Python lists: a token id pickles to 5 bytes (ids above 65535) and a response token
# brings its id, its action-mask int (2 bytes) and its float log-prob (9 bytes); its prompt comes back as text too.
TRAJECTORY_BYTES_PER_PROMPT_TOKEN = 5 + TEXT_BYTES_PER_TOKEN
TRAJECTORY_BYTES_PER_RESPONSE_TOKEN = 5 + 2 + 9
STATS_BYTES = 512  # a trained role's statistics: a dict of floats


@dataclass(frozen=True)
class Transfer:
    """One move of the step between rank 0 and a role: a shard out to each replica and a result back."""

    name: str
    layout: ReplicaLayout
    out: tuple[Payload, ...]
    back: tuple[Payload, ...]

    def messages(self) -> list[Message]:
        return scatter_messages(self.layout, self.out) + gather_messages(self.layout, self.back)

    def per_rank_messages(self) -> list[Message]:
        """The same move with a copy per rank and a message per tensor (the channel before the replica path)."""
        return per_rank_scatter_messages(self.layout, self.out) + per_rank_gather_messages(self.layout, self.back)


def _split_even(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _tensors(rows: int, columns: dict[str, int], fields: dict[str, tuple[str, int]]) -> Payload:
    sizes = tuple(rows * columns[axis] * itemsize for axis, itemsize in fields.values())
    return Payload(SKELETON_BYTES + SKELETON_BYTES_PER_TENSOR * len(sizes), sizes)


def train_fields(cfg: RunConfig, placement: Placement, role: str, need_old: bool) -> dict[str, tuple[str, int]]:
    """The tensors a trained role's shard carries, as in ``trainers.rl.workers.TRAIN_FIELDS`` (forward inputs and
    the fp32 (B, R) fields the update reads that the step sets)."""
    if role == "critic":
        extra = _TRAIN_EXTRA["critic"]
    else:
        extra = ("advantages", "rollout_logprobs", *(("old_logprobs",) if need_old else ()),
                 *(("ref_logprobs",) if "ref" in placement.roles else ()))
    return {**_FORWARD_ROW, **{name: ("R", 4) for name in extra}}


def step_transfers(cfg: RunConfig, placement: Placement, need_old: bool) -> list[Transfer]:
    """Every move of one RL step through rank 0, in the controller's order (``RLController.step``)."""
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    prompt, response = cfg.data.prompt_max_len, cfg.rollout.generate_max_len
    columns = {"W": prompt + response, "R": response, "B": 1}
    out = []

    def layout(role: str) -> ReplicaLayout:
        grid = placement.roles[role]
        return ReplicaLayout.from_ranks({r: grid.dp_rank(r) for r in grid.ranks}, grid.dp_leaders())

    rollout = layout("rollout")
    engines = len(rollout.replicas)
    prompts = _split_even(cfg.rollout.rollout_batch_size, engines)
    trajectory = prompt * TRAJECTORY_BYTES_PER_PROMPT_TOKEN + response * TRAJECTORY_BYTES_PER_RESPONSE_TOKEN
    out.append(Transfer("prompts / trajectories", rollout,
                        tuple(Payload(SKELETON_BYTES + n * prompt * TEXT_BYTES_PER_TOKEN) for n in prompts),
                        tuple(Payload(SKELETON_BYTES + n * cfg.rollout.n_samples_per_prompt * trajectory)
                              for n in prompts)))
    scorers = [("reward", ("B", 4)), ("actor", ("R", 4)), ("ref", ("R", 4)), ("teacher", ("R", 4)),
               ("critic", ("R", 4))]
    for role, result in scorers:
        if role not in placement.roles or (role == "actor" and not need_old):
            continue
        roles = layout(role)
        rows = _split_even(samples, len(roles.replicas))
        out.append(Transfer(f"{role} forward", roles, tuple(_tensors(n, columns, _FORWARD_ROW) for n in rows),
                            tuple(_tensors(n, columns, {"out": result}) for n in rows)))
    for role in ("critic", "actor"):
        if role in placement.roles:
            roles = layout(role)
            rows = _split_even(samples, len(roles.replicas))
            fields = train_fields(cfg, placement, role, need_old)
            out.append(Transfer(f"train {role}", roles, tuple(_tensors(n, columns, fields) for n in rows),
                                tuple(Payload(STATS_BYTES) for _ in rows)))
    return out


def controller_seconds(messages: list[Message], device: Device, nodes: int, gpus_per_node: int) -> float:
    """Seconds rank 0's link spends on ``messages`` (those it sends or receives): one after another, at NVLink
    speed when every other end is on rank 0's node, else at the network's (rank 0's NIC)."""
    seconds = 0.0
    for m in messages:
        if CONTROLLER not in (m.src, *m.dst):
            continue  # between other ranks (a leader's broadcast inside its replica)
        peers = [r for r in (m.src, *m.dst) if r != CONTROLLER]
        local = nodes <= 1 or all(r < gpus_per_node for r in peers)
        seconds += m.num_bytes / (device.intra_node_bw if local else device.inter_node_bw)
    return seconds


def controller_traffic_phase(ctx: _Ctx, need_old: bool) -> Phase:
    transfers = step_transfers(ctx.cfg, ctx.placement, need_old)
    now = [m for t in transfers for m in t.messages()]
    before = [m for t in transfers for m in t.per_rank_messages()]

    def summary(messages: list[Message]) -> tuple[float, float, int, float]:
        sent = sum(m.num_bytes for m in messages if m.src == CONTROLLER)
        received = sum(m.num_bytes for m in messages if m.dst == (CONTROLLER,))
        calls = sum(1 for m in messages if CONTROLLER in (m.src, *m.dst))
        return sent, received, calls, controller_seconds(messages, ctx.device, ctx.nodes, ctx.gpus_per_node)

    sent, received, calls, seconds = summary(now)
    old_sent, _, old_calls, old_seconds = summary(before)
    return Phase("controller traffic", seconds,
                 f"rank 0 sends {_bytes(sent)}, receives {_bytes(received)} in {calls} messages over "
                 f"{len(transfers)} moves; a copy per rank and a message per tensor would be {_bytes(old_sent)} "
                 f"sent, {old_calls} messages, {old_seconds:.2f} s")


def checkpoint_bytes(cfg: RunConfig, placement: Placement, param_bytes: int) -> float:
    total = 0.0
    for role in TRAINED_ROLES:
        if role not in placement.roles:
            continue
        n = role_num_params(cfg, role)
        trained = _trainable_params(cfg, role, n)
        total += checkpoint_bytes_per_role(trained, n - trained if trained < n else 0.0, param_bytes)
    if cfg.ckpt.save_hf:
        total += role_num_params(cfg, "actor") * param_bytes
        if cfg.ckpt.save_critic_hf and "critic" in placement.roles:
            total += role_num_params(cfg, "critic") * param_bytes
    return total


def need_old_logprobs(cfg: RunConfig, placement: Placement) -> bool:
    """Mirrors the trainer: exactly on-policy steps without a KL folded into the rewards skip that forward."""
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    kl_needs_old = "ref" in placement.roles and (not cfg.algo.kl.use_loss or cfg.algo.kl.target is not None)
    return not (cfg.train.max_epochs == 1 and samples == cfg.train.train_batch_size and not kl_needs_old)


def rl_step_time(cfg: RunConfig, placement: Placement, device: Device, *, nodes: int,
                 gpus_per_node: int) -> StepTime:
    """Predicted phases of one RL step and the checkpoint's cost; ``device`` as described (not per rank)."""
    param_bytes = 2 if resolved_param_dtype(cfg.ds.param_dtype, device.gpu) == "bf16" else 4
    ctx = _Ctx(cfg, placement, device.per_rank(gpus_per_node), nodes, param_bytes, gpus_per_node)
    need_old = need_old_logprobs(cfg, placement)
    phases = [generation_phase(ctx), *scoring_phases(ctx, need_old), *training_phases(ctx), weight_sync_phase(ctx),
              controller_traffic_phase(ctx, need_old)]
    ckpt = checkpoint_bytes(cfg, placement, param_bytes)
    overlap = forwards_overlap(phases, {role: grid.ranks for role, grid in placement.roles.items()})
    return StepTime(tuple(phases), ckpt, ckpt / device.fs_bw, ckpt / device.fs_bw, overlap)


def supervised_step_time(cfg, kind: str, device: Device, *, nodes: int, gpus_per_node: int,
                         world_size: int) -> StepTime:
    """One optimizer step of an offline trainer (sft, rm, dpo, kto): the reference forward (DPO / KTO) and the
    trained model's forward and backward over ``train.train_batch_size`` samples of ``data.max_len``, data
    parallel over ``world_size / ds.tensor_parallel_size`` replicas (same roofline as ``rl_step_time``)."""
    param_bytes = 2 if resolved_param_dtype(cfg.ds.param_dtype, device.gpu) == "bf16" else 4
    rank = device.per_rank(gpus_per_node)
    n = section_num_params(cfg.model) or 0
    hf = local_hf_config(cfg.model)
    shape = ModelShape.from_hf_config(hf) if hf is not None else nearest_reference_shape(n)
    tp = cfg.ds.tensor_parallel_size
    dp = max(1, world_size // tp)
    rows = cfg.train.train_batch_size * SUPERVISED_ROWS_PER_SAMPLE[kind] / dp
    tokens = rows * cfg.data.max_len
    logits = 0 if kind == "rm" else tokens
    micro = max(1, math.ceil(cfg.train.train_batch_size / dp / cfg.train.micro_train_batch_size))
    ckpt = cfg.ds.gradient_checkpointing
    stage = effective_zero_stage(cfg.ds.zero_stage, dp, True, cfg.ds.adam_offload, bf16=param_bytes == 2)
    weights = shape.params_per_tp_rank(n, tp) * param_bytes
    bw = rank.collective_bw(nodes)

    def pass_s(train: bool) -> tuple[float, float]:
        flops = (training_flops(shape, n, tokens, logits, ckpt) if train else forward_flops(shape, n, tokens, logits))
        compute = flops / tp / (rank.peak_flops * rank.mfu)
        comm = 0.0
        if stage == 3:
            passes = (3 if ckpt else 2) if train else 1
            comm = micro * zero3_traffic_bytes(weights, dp, passes, weights if train else 0.0) / bw
        dispatch = _overhead(rank, shape, ((4 if ckpt else 3) if train else 1) * micro)
        return max(compute, comm) + dispatch, flops / tp

    phases = []
    if kind in ("dpo", "kto"):
        seconds, flops = pass_s(False)
        phases.append(Phase("ref logprob", seconds, f"reference forward, {_flop(flops)}/rank"))
    trained = n
    lora = LoraSpec.from_config(cfg.ds.lora)
    if lora is not None:
        trained = lora_params(shape, lora, kind == "rm")
    shard = trained / tp / dp
    if cfg.ds.adam_offload:
        opt = shard * (GRAD_BYTES + param_bytes) / rank.host_link_bw + shard / 1e9 * rank.host_adam_s_per_gparam
    else:
        opt = shard * (param_bytes + GRAD_BYTES + 2 * ADAM_STATE_BYTES + MASTER_BYTES) / rank.memory_bw
    seconds, flops = pass_s(True)
    phases.append(Phase("train", seconds + opt + rank.step_overhead_s,
                        f"{_flop(flops)}/rank, {micro} micro-batch(es)/rank"))
    size = checkpoint_bytes_per_role(trained, n - trained if trained < n else 0.0, param_bytes)
    if cfg.ckpt.save_hf:
        size += n * param_bytes
    return StepTime(tuple(phases), size, size / device.fs_bw, size / device.fs_bw)
