"""One RL micro-batch's forwards, padded, packed or split along the sequence (ring attention).

The trainers' role workers call :func:`forward_scope` and ask the :class:`MicroForward` it yields for
log-probs, values or scores; whether the batch is packed or sequence-parallel is decided here, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpc_rlhf.models.forward import (
    critic_values,
    logits_entropy,
    pack_actions,
    policy_logprobs,
    predicting_actions,
    score_at_last_token,
    sequence_scores,
)
from hpc_rlhf.models.hf_module import ModelOrEngine, hf_model
from hpc_rlhf.models.logprobs import logprobs_from_logits
from hpc_rlhf.models.moe import RouterLogits
from hpc_rlhf.models.routing_replay import not_recorded, replay_routes
from hpc_rlhf.models.sequence_parallel import (
    gather_from_sp,
    sequence_parallel_attention,
    shard_for_sp,
    sp_token_logits,
    sp_token_values,
)
from hpc_rlhf.models.vision import VISUAL_FIELDS
from hpc_rlhf.models.vision_forward import vision_critic_values


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel subgroup (``ds.ring_attn_size``): its ring attention peers."""

    group: Any
    rank: int
    size: int
    head_stride: int = 1


def _device_of(model: ModelOrEngine) -> torch.device:
    """Where the model computes: a DeepSpeed facade's or HF model's ``device`` (a ZeRO-3 engine whose parameters
    live on the host still computes on its accelerator), else its first parameter's."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(iter(hf_model(model).parameters())).device


class MicroForward:
    """The forwards of one micro-batch (B, P+R), padded, packed or split along the sequence.

    Use it through :func:`forward_scope`, and call ``backward`` inside the ``with`` block: under
    sequence parallelism, ring attention must also run when checkpointed layers are recomputed.
    """

    def __init__(self, model: ModelOrEngine, rows: dict[str, torch.Tensor], packed: bool,
                 sp: SequenceParallel | None = None, shard: Any = None) -> None:
        self.model, self.packed, self.sp, self.shard = model, packed, sp, shard
        device = _device_of(model)
        rows = {k: v.to(device) for k, v in rows.items()}  # no-op where the caller moved them already
        self.sequences, self.attention_mask = rows["sequences"], rows["attention_mask"]
        self.num_actions = rows["action_mask"].shape[1] if "action_mask" in rows else None  # None: RM scoring
        # the rows' images (vision-language models): every forward of this micro-batch embeds them
        self.visual = {k: rows[k] for k in VISUAL_FIELDS if k in rows} or None
        if self.visual is not None and sp is not None:
            raise NotImplementedError("sequence parallelism (ds.ring_attn_size > 1) with images is not supported yet")
        # set by policy_logprobs(with_router=True): the forward's RouterLogits
        self.router_logits: RouterLogits | None = None
        routes = rows.get("routed_experts")
        # (N, L, k): the rollout's routes of the forward's N token positions (this rank's chunk under sequence
        # parallelism), aligned with router_logits
        self.recorded_routes: torch.Tensor | None = None
        if routes is not None and sp is None:
            self.recorded_routes = routes_in_forward_order(routes, self.sequences, self.attention_mask,
                                                           self.num_actions, packed)
        elif routes is not None:
            chunk = shard.local(routes, pad_value=not_recorded(routes.dtype))  # (B, S_local, L, k) or (1, N_local..)
            self.recorded_routes = chunk.reshape(-1, *routes.shape[2:])

    @property
    def loss_scale(self) -> float:
        """Factor for the loss before ``backward``: each sp rank back-propagates only its own chunk and
        ZeRO averages gradients over dp x sp ranks, so scaling by sp turns the sp part into the sum."""
        return float(self.sp.size) if self.sp else 1.0

    @property
    def _num_actions(self) -> int:
        """R, the response (action) columns; a reward-model scoring batch (no ``action_mask``) has none."""
        if self.num_actions is None:
            raise ValueError("this micro-batch has no response columns (rows['action_mask']): it can only be scored")
        return self.num_actions

    def policy_logprobs(self, temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True,
                        with_router: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) fp32 log-probs of the response tokens, and their entropy when asked (detached when
        ``entropy_grad`` is False: an entropy that is only logged costs no backward). ``with_router`` (MoE
        models) also keeps the forward's router logits in ``self.router_logits`` (under sequence parallelism,
        those of this rank's chunk: reduce over ``self.sp.group``, ``hpc_rlhf.models.moe``)."""
        if self.sp is None:
            router: list[RouterLogits] | None = [] if with_router else None
            out = policy_logprobs(self.model, self.sequences, self.attention_mask, self._num_actions, temperature,
                                  packed=self.packed, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                  router=router, visual=self.visual)
            self.router_logits = router[0] if router else None
            return out
        chunk_router: list[tuple[torch.Tensor, ...]] | None = [] if with_router else None
        logits = sp_token_logits(self.model, self.shard, chunk_router)  # (B, S_local, V), or (1, N_local, V) packed
        if chunk_router:
            self.router_logits = self._chunk_router(chunk_router[0])
        logprobs = self._gather(logprobs_from_logits(logits, self.shard.labels, temperature))
        entropy = None
        if with_entropy:
            everywhere = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)
            entropy = self._gather(logits_entropy(logits, temperature, everywhere, entropy_grad))
        return logprobs, entropy

    def critic_values(self) -> torch.Tensor:
        """(B, R) fp32 value of the state before each response token."""
        if self.visual is not None:
            return vision_critic_values(self.model, self.sequences, self.attention_mask, self.visual,
                                        self._num_actions, packed=self.packed)
        if self.sp is None:
            return critic_values(self.model, self.sequences, self.attention_mask, self._num_actions,
                                 packed=self.packed)
        return self._gather(sp_token_values(self.model, self.shard))

    def sequence_scores(self) -> torch.Tensor:
        """(B,) fp32 reward-model score of each row: the ``score`` head at its last real token."""
        self._text_only("reward-model scores")
        if self.sp is None:
            return sequence_scores(self.model, self.sequences, self.attention_mask)
        values = gather_from_sp(sp_token_values(self.model, self.shard), self.shard, self.sp.group)  # (B, T)
        return score_at_last_token(values, self.attention_mask)

    def _text_only(self, what: str) -> None:
        if self.visual is not None:
            raise NotImplementedError(f"{what} of rows with images are not supported yet (use a reward function with "
                                      "vision-language models)")

    def _chunk_router(self, layers: tuple[torch.Tensor, ...]) -> RouterLogits:
        """:class:`RouterLogits` of this rank's chunk: its real tokens, and the positions that predict a response
        token (cut from the full rows like the chunk)."""
        predicting = predicting_actions(self.attention_mask, self._num_actions)
        device = layers[0].device
        real = (self.shard.segment_ids >= 0).reshape(-1).to(device)
        return RouterLogits(layers, real, self.shard.local(predicting, pad_value=False).reshape(-1).to(device))

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token outputs of this chunk -> (B, R) action columns of the full rows (differentiable)."""
        assert self.sp is not None  # only the sequence-parallel forwards gather
        full = gather_from_sp(local, self.shard, self.sp.group)  # column t: output for token t+1
        return full[:, -self._num_actions - 1 : -1]


def routes_in_forward_order(routes: torch.Tensor, sequences: torch.Tensor, attention_mask: torch.Tensor,
                            num_actions: int | None, packed: bool) -> torch.Tensor:
    """Recorded routes (B, T, L, k) of the padded rows -> (N, L, k) in the order the forward's routers see the
    tokens: every position row-major (padded), or the packed row's tokens (:func:`pack_actions`, which orders
    the samples as its bin packing does): each from its sample's row at its position in the sample.
    ``num_actions`` (the response columns) is needed only ``packed``."""
    if not packed:
        return routes.reshape(-1, *routes.shape[2:])
    if num_actions is None:
        raise ValueError("routes of a packed micro-batch need its response columns (rows['action_mask'])")
    pack = pack_actions(sequences, attention_mask, num_actions).inputs
    real = attention_mask.bool()
    offsets = torch.cumsum(real.sum(dim=1), 0) - real.sum(dim=1)  # where each row's real tokens start in routes[real]
    segment, position = pack["segment_ids"][0], pack["position_ids"][0]
    source = offsets[segment.clamp(min=0)] + position
    out = routes[real][source.clamp(max=int(real.sum()) - 1)]
    return torch.where((segment >= 0)[:, None, None], out, torch.full_like(out, not_recorded(routes.dtype)))


@contextlib.contextmanager
def forward_scope(model: ModelOrEngine, rows: dict[str, torch.Tensor], *, packed: bool = False,
                  sp: SequenceParallel | None = None, replay: bool = False) -> Iterator[MicroForward]:
    """Forwards of one micro-batch; under ``sp`` the model's attention is ring attention in the block.

    Every rank of the sp group calls this with the same ``rows``; each runs the model on its chunk of
    the sequence (packed into one row of real tokens when ``packed``) and gathers the per-token outputs.
    ``replay``: an MoE model routes each token to the experts the rollout recorded (``rows["routed_experts"]``,
    ``hpc_rlhf.models.routing_replay``) for the whole block, so a backward that recomputes checkpointed layers
    routes them the same way.
    """
    if sp is None:
        fwd = MicroForward(model, rows, packed)
        if not replay:
            yield fwd
            return
        if fwd.recorded_routes is None:
            raise ValueError("routing replay: this micro-batch carries no recorded routes (rows['routed_experts'])")
        with replay_routes(model, fwd.recorded_routes):
            yield fwd
        return
    shard = shard_for_sp(rows["sequences"], rows["attention_mask"], sp_rank=sp.rank, sp_size=sp.size, pack=packed)
    with sequence_parallel_attention(model, sp.group, shard, head_stride=sp.head_stride):
        fwd = MicroForward(model, rows, packed, sp, shard)
        if not replay:
            yield fwd
            return
        if fwd.recorded_routes is None:
            raise ValueError("routing replay: this micro-batch carries no recorded routes (rows['routed_experts'])")
        with replay_routes(model, fwd.recorded_routes):  # each rank's routers see only its chunk's tokens
            yield fwd
