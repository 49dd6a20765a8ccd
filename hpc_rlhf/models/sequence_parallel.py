"""Sequence parallelism (``ds.ring_attn_size``) for HF causal LMs: shard a batch along the sequence,
run the model with ring attention, gather per-token outputs back.

Per micro-batch, on every rank of one sp group (``RoleGroups.sp_group``; all of them must hold the same
full batch, e.g. broadcast from the sp-rank-0 dp leader):

    shard = shard_for_sp(sequences, attention_mask, sp_rank=r, sp_size=n, pack=...)
    with sequence_parallel_attention(model, sp_group, shard, head_stride=cfg.ds.ring_head_stride):
        local = sp_token_logprobs(model, shard)            # (B, S_local) or (1, N_local) when packed
    full = gather_from_sp(local, shard, sp_group)           # (B, T): column t = logprob of token t+1
    logprobs = full[:, -num_actions - 1 : -1]               # == forward.action_logprobs(...)

The same holds for critic values (``sp_token_values``).

Gradients. Every rank's backward computes the gradient of the loss through *its* chunk (ring attention
sends K/V gradients back to the chunk that produced them), so the full gradient of one replica is the
SUM of the parameter gradients over the sp group. Two equivalent ways to form the loss:
- local: each rank sums its own tokens' loss terms, normalised by counts of the FULL batch (global token
  count, number of sequences: count them on the full tensors before sharding, or cut per-token weights
  with ``shard.local``), never by the local count;
- replicated: ``gather_from_sp`` (differentiable; its backward keeps this rank's slice of the gradient,
  no reduction) and every sp rank computes the identical full loss.
Then reduce: a DeepSpeed engine whose data-parallel group spans all ranks of the role (dp x sp) AVERAGES
gradients over dp*sp ranks, so scale the loss by ``sp_size`` (``sp_loss_scale``) to turn the sp part of
the average into a sum; with a dp-only reduction group, all-reduce SUM over ``sp_group`` first. Metrics
(loss, token counts) must be taken once per replica, not summed over its sp ranks.

Backends. ``ring`` (any device, gloo or NCCL): ``hpc_rlhf.models.ring_attention``, exact, handles padded
(B, T) batches and packed rows, fp32 accumulation, not a fast kernel. ``ring_flash`` (GPU): the
``ring-flash-attn`` package's ``llama3_flash_attn_varlen_func`` over a packed row (``pack=True``), with
``heads_k_stride = ds.ring_head_stride`` (kv heads all-gathered at a time: memory vs. messages); needs
ring-flash-attn (the ``gpu`` extra) and flash-attn (installed on its own, docs/gpu.md), imported only when
used (``hpc_rlhf.models.ring_flash_import``, which also makes ring-flash-attn 0.1.8 import under
transformers 5). Both plug into transformers 5 through
``AttentionInterface`` (names ``hpc_ring`` / ``hpc_ring_flash``); the model's own mask is skipped (those
names have no mask function) and padding / packing comes from the shard, set for the ``with`` block
(module state, like ring-flash-attn's ``update_ring_flash_attn_params``: not thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AttentionInterface

from hpc_rlhf.models.hf_module import ModelOrEngine, base_model, child_module, hf_model
from hpc_rlhf.models.logprobs import logprobs_from_logits
from hpc_rlhf.models.ring_attention import ring_attention
from hpc_rlhf.models.ring_flash_import import load_ring_flash_attn, ring_flash_attn_status

log = logging.getLogger(__name__)

RING = "hpc_ring"
RING_FLASH = "hpc_ring_flash"


# ------------------------------------------------------------------------------------------ sharding
@dataclass
class SPShard:
    """This sp rank's piece of a batch. Token tensors are (B, S_local), or (1, N_local) when packed.

    ``segment_ids``: id of the sample each token belongs to (0 for every real token of an unpacked row,
    the row index when packed), -1 for padding. ``labels``: the next token of the *full* row (so the
    last local token's label comes from the next chunk). ``cu_seqlens``: packed only, int32 boundaries
    of the samples in the whole padded row (the tail padding is one extra segment), for varlen kernels.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    labels: torch.Tensor
    sp_rank: int
    sp_size: int
    batch_shape: tuple[int, int]  # (B, T) of the full, unsharded batch
    total_len: int  # tokens per row before the tail padding (T, or N real tokens when packed)
    pad_len: int  # tail padding added so that sp_size divides the row
    packed: bool = False
    cu_seqlens: torch.Tensor | None = None
    token_index: torch.Tensor | None = None  # packed: flat (B*T) index of each real token

    @property
    def local_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def packed_token_index(self) -> torch.Tensor:
        """``token_index`` of a packed shard: the flat (B*T) index of each real token of the full batch."""
        if self.token_index is None:
            raise ValueError("token_index exists only for a packed shard (shard_for_sp(..., pack=True))")
        return self.token_index

    def local(self, full: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """Cut any (B, T, ...) tensor of the full batch the same way as ``input_ids``."""
        if tuple(full.shape[:2]) != self.batch_shape:
            raise ValueError(f"expected a tensor of shape {self.batch_shape} + ..., got {tuple(full.shape)}")
        if self.packed:
            full = full.flatten(0, 1)[self.packed_token_index.to(full.device)].unsqueeze(0)
        if self.pad_len:
            pad = full.new_full((full.shape[0], self.pad_len, *full.shape[2:]), pad_value)
            full = torch.cat([full, pad], dim=1)
        start = self.sp_rank * self.local_len
        return full[:, start : start + self.local_len]


def shard_for_sp(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, sp_rank: int,
                 sp_size: int, pack: bool = False, pad_token_id: int = 0) -> SPShard:
    """Split a (B, T) batch along the sequence into ``sp_size`` contiguous chunks; keep chunk ``sp_rank``.

    Rows are right-padded to a multiple of ``sp_size`` (padding is masked). Positions count real tokens
    only (``position_ids_from_mask``), as in the unsplit forward. ``pack=True`` first drops all padding
    and concatenates the rows into one (1, N) row of samples (required by the ``ring_flash`` backend;
    no compute wasted on padding).
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} outside [0, {sp_size})")
    b, t = input_ids.shape
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    labels[:, -1] = pad_token_id
    if pack:
        token_index = mask.flatten().nonzero().squeeze(1)
        total = token_index.numel()
        rows = torch.arange(b, device=input_ids.device)[:, None].expand(b, t)
        streams = [x.flatten()[token_index].unsqueeze(0) for x in (input_ids, position_ids, rows, labels)]
        lengths = mask.sum(1)
        bounds = [0, *torch.cumsum(lengths[lengths > 0], 0).tolist()]
    else:
        token_index = None
        total = t
        streams = [input_ids, position_ids, torch.where(mask, 0, -1), labels]
    pad_len = (-total) % sp_size
    if pad_len:
        rows_n = streams[0].shape[0]
        tail_pos = torch.arange(pad_len, device=input_ids.device).expand(rows_n, pad_len)
        tails = [torch.full((rows_n, pad_len), pad_token_id, dtype=input_ids.dtype, device=input_ids.device),
                 tail_pos.to(position_ids.dtype),
                 torch.full((rows_n, pad_len), -1, dtype=torch.long, device=input_ids.device),
                 torch.full((rows_n, pad_len), pad_token_id, dtype=labels.dtype, device=input_ids.device)]
        streams = [torch.cat([s.to(tail.dtype), tail], 1) for s, tail in zip(streams, tails, strict=True)]
    local_len = (total + pad_len) // sp_size
    start = sp_rank * local_len
    ids, pos, seg, lab = (s[:, start : start + local_len].contiguous() for s in streams)
    cu_seqlens = None
    if pack:
        if pad_len:
            bounds.append(total + pad_len)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    return SPShard(input_ids=ids, position_ids=pos, segment_ids=seg.long(), labels=lab, sp_rank=sp_rank,
                   sp_size=sp_size, batch_shape=(b, t), total_len=total, pad_len=pad_len, packed=pack,
                   cu_seqlens=cu_seqlens, token_index=token_index)


# ------------------------------------------------------------------------------------------ gathering
class _GatherSequence(torch.autograd.Function):
    """all_gather along dim 1; backward keeps this rank's slice (the loss is replicated on the sp ranks)."""

    @staticmethod
    def forward(ctx, local, group):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(chunks, local.contiguous(), group=group)
        ctx.rank, ctx.local_len = rank, local.shape[1]
        return torch.cat(chunks, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(1, ctx.rank * ctx.local_len, ctx.local_len).contiguous(), None


def gather_from_sp(local: torch.Tensor, shard: SPShard, sp_group: dist.ProcessGroup | None,
                   fill: float = 0.0) -> torch.Tensor:
    """Per-token outputs of every chunk -> the full (B, T, ...) tensor, on every sp rank.

    Differentiable: the backward keeps this rank's slice of the incoming gradient, which is right when
    every sp rank computes the same loss from the gathered tensor (sum parameter gradients over the sp
    group afterwards; see the module docstring). Positions that were padding before packing get ``fill``.
    """
    full = local if shard.sp_size == 1 else _GatherSequence.apply(local, sp_group)
    full = full[:, : shard.total_len]
    if not shard.packed:
        return full
    b, t = shard.batch_shape
    out = full.new_full((b * t, *full.shape[2:]), fill)
    return out.index_copy(0, shard.packed_token_index.to(full.device), full[0]).view(b, t, *full.shape[2:])


def sp_loss_scale(sp_size: int, engine_averages_over_sp: bool = True) -> float:
    """Factor for the local loss so that the engine's gradient reduction sums over the sp group."""
    return float(sp_size) if engine_averages_over_sp else 1.0


# ------------------------------------------------------------------------------------------ attention
@dataclass
class _SPState:
    group: dist.ProcessGroup | None
    shard: SPShard
    head_stride: int = 1
    varlen: dict | None = None  # ring_flash: cu_seqlens / max_seqlen / local_k_slice of this rank
    graph_calls: int = 0  # attention calls that built an autograd graph
    backward_calls: int = 0  # gradients that flowed back through them inside the block

    def track(self, out: torch.Tensor) -> torch.Tensor:
        if out.requires_grad:
            self.graph_calls += 1
            out.register_hook(self._count_backward)
        return out

    def _count_backward(self, grad: torch.Tensor) -> None:
        self.backward_calls += 1


_STATE: _SPState | None = None


def _active_state(name: str) -> _SPState:
    if _STATE is None:
        raise RuntimeError(f"attention implementation {name!r} runs only inside sequence_parallel_attention(...)")
    return _STATE


def _check_module(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    if dropout:
        raise NotImplementedError("ring attention does not implement attention dropout; set it to 0")
    if getattr(module, "sliding_window", None) or kwargs.get("sliding_window"):
        raise NotImplementedError("ring attention does not implement sliding-window attention")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("ring attention does not implement logit soft-capping")


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface``): (B, H, S, D) in, (B, S, H, D) out."""
    state = _active_state(RING)
    _check_module(module, dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = ring_attention(query, key, value, state.group, causal=causal, softmax_scale=scaling,
                         segment_ids=state.shard.segment_ids)
    return state.track(out).transpose(1, 2).contiguous(), None


def ring_flash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                 scaling: float | None = None, is_causal: bool | None = None,
                                 **kwargs) -> tuple[torch.Tensor, None]:
    """GPU path: ring-flash-attn's Llama-3 style varlen attention over this rank's packed chunk."""
    state = _active_state(RING_FLASH)
    _check_module(module, dropout, kwargs)
    if is_causal is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("the ring_flash backend implements causal attention only")
    if query.shape[0] != 1 or state.varlen is None:
        raise ValueError("the ring_flash backend needs a packed shard: shard_for_sp(..., pack=True)")
    rfa = load_ring_flash_attn()
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (S, heads, D)
    out = rfa.llama3_flash_attn_varlen_func(
        q, k, v, state.varlen["cu_seqlens_q"], state.varlen["cu_seqlens_k"], state.varlen["max_seqlen_q"],
        state.varlen["max_seqlen_k"], heads_k_stride=state.head_stride, local_k_slice=state.varlen["local_k_slice"],
        dropout_p=0.0, softmax_scale=scaling, causal=True, group=state.group,
    )
    return state.track(out).unsqueeze(0), None


_REGISTERED = False


def register_attention_functions() -> None:
    """Register ``hpc_ring`` and ``hpc_ring_flash`` with transformers' ``AttentionInterface`` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    AttentionInterface.register(RING, ring_attention_forward)
    AttentionInterface.register(RING_FLASH, ring_flash_attention_forward)
    _REGISTERED = True


_FALLBACKS_LOGGED: set[str | None] = set()  # one warning per process, not one per micro-batch


def resolve_backend(backend: str, shard: SPShard, device: torch.device) -> str:
    """``auto``: ring_flash on CUDA with a packed shard when ``ring_flash_attn`` imports, else ring.

    The import is really tried (once per process, ``ring_flash_import``): an installed package that fails to
    import makes ``auto`` fall back with one logged line giving the cause; ``ring_flash`` asked for explicitly
    fails inside ``sequence_parallel_attention`` with that cause.
    """
    if backend == "auto":
        if device.type != "cuda" or not shard.packed:
            return "ring"
        status = ring_flash_attn_status()
        if status.usable:
            return "ring_flash"
        if status.reason not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(status.reason)
            log.log(logging.WARNING if status.installed else logging.INFO,
                    "sequence parallelism: using the `ring` backend, not ring_flash: %s", status.reason)
        return "ring"
    if backend not in ("ring", "ring_flash"):
        raise ValueError(f"unknown sequence-parallel backend {backend!r}; use auto, ring or ring_flash")
    return backend


@contextlib.contextmanager
def sequence_parallel_attention(model: ModelOrEngine, sp_group: dist.ProcessGroup | None, shard: SPShard,
                                backend: str = "auto", head_stride: int = 1) -> Iterator[str]:
    """Make ``model``'s attention layers ring attention over ``sp_group`` for the ``with`` block.

    ``model`` may be a training-engine wrapper (its ``module`` is used). Restores the previous attention
    implementation on exit. Yields the backend used (``ring`` or ``ring_flash``).

    With activation (gradient) checkpointing the layers are recomputed during backward, and the
    recomputation must run ring attention too: call ``backward`` INSIDE the block. Outside it the
    recomputed layers would silently use the model's normal attention on the local chunk only; with HF
    gradient checkpointing on, leaving the block with a graph and no backward raises for that reason
    (DeepSpeed's own activation checkpointing cannot be detected: same rule).
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("sequence_parallel_attention is already active (nesting is not supported)")
    if sp_group is not None and dist.get_world_size(sp_group) != shard.sp_size:
        raise ValueError(f"shard is for {shard.sp_size} sp ranks but sp_group has {dist.get_world_size(sp_group)}")
    inner = hf_model(model)
    backend = resolve_backend(backend, shard, shard.input_ids.device)
    register_attention_functions()
    state = _SPState(group=sp_group, shard=shard, head_stride=head_stride)
    if backend == "ring_flash":
        if shard.cu_seqlens is None:
            raise ValueError("the ring_flash backend needs a packed shard (shard_for_sp(..., pack=True))")
        num_kv_heads = getattr(inner.config, "num_key_value_heads", None) or inner.config.num_attention_heads
        if num_kv_heads % head_stride:
            raise ValueError(f"ds.ring_head_stride={head_stride} must divide the {num_kv_heads} kv heads")
        rfa = load_ring_flash_attn()
        cu_q, cu_k, max_q, max_k, k_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(
            shard.cu_seqlens.to(shard.input_ids.device), True, shard.sp_rank, shard.sp_size)
        state.varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q,
                        "max_seqlen_k": max_k, "local_k_slice": k_slice}
    previous = inner.config._attn_implementation
    inner.config._attn_implementation = RING if backend == "ring" else RING_FLASH
    _STATE = state
    try:
        yield backend
    finally:
        _STATE = None
        inner.config._attn_implementation = previous
    recomputes = any(getattr(m, "gradient_checkpointing", False) for m in inner.modules())
    if recomputes and state.graph_calls and not state.backward_calls:
        raise RuntimeError(
            "sequence_parallel_attention: gradient checkpointing is on and the graph built in the block was not "
            "backpropagated inside it; the recomputed layers would not use ring attention. Call backward() "
            "inside the `with` block (or run the forward under torch.no_grad())."
        )


# ------------------------------------------------------------------------------------------ forwards
def sp_token_logits(model: ModelOrEngine, shard: SPShard, router: list | None = None) -> torch.Tensor:
    """Logits of this rank's chunk (inside ``sequence_parallel_attention``): (B, S_local, V).

    ``router``: a list to which an MoE model's router logits of the chunk are appended (a tuple of
    (B * S_local, E) tensors, one per MoE layer, in the chunk's token order).
    """
    kwargs = {"output_router_logits": True} if router is not None else {}
    out = model(input_ids=shard.input_ids, position_ids=shard.position_ids, attention_mask=None, use_cache=False,
                **kwargs)
    if router is not None:
        router.append(out.router_logits)
    return out.logits


def sp_token_logprobs(model: ModelOrEngine, shard: SPShard, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each local token's successor (``shard.labels``): (B, S_local) fp32."""
    return logprobs_from_logits(sp_token_logits(model, shard), shard.labels, temperature)


def sp_token_values(model: ModelOrEngine, shard: SPShard) -> torch.Tensor:
    """Critic values (``score`` head) of this rank's chunk: (B, S_local) fp32. Like ``token_values``."""
    module = hf_model(model)
    hidden = base_model(module)(input_ids=shard.input_ids, position_ids=shard.position_ids, attention_mask=None,
                                use_cache=False).last_hidden_state
    return child_module(module, "score")(hidden).squeeze(-1).float()
