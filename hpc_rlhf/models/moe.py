"""Mixture-of-experts models (transformers' Qwen3-MoE, Mixtral, ...): what the trainers need to know of them.

* :func:`moe_spec`: whether a model (or its config) routes tokens to experts, and how many of them (``None``
  for a dense model);
* :func:`sparse_moe_block_classes`: the module classes that hold one layer's router and experts, which
  ZeRO-3 must fetch as one leaf (``hpc_rlhf.training.deepspeed_engine``);
* :class:`RouterLogits` and :func:`load_balancing_loss`: the router logits of one forward (asked for with
  transformers' ``output_router_logits``) and the Switch-Transformer load-balancing loss over them, computed by
  the model's own ``load_balancing_loss_func`` (the one its ``aux_loss`` uses).

The routing statistics that are logged are pure math in ``hpc_rlhf.algos.moe``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpc_rlhf.algos.moe import (
    route_mismatch_from_sums,
    route_mismatch_sums,
    routing_stats_from_sums,
    routing_sums,
    switch_loss,
    switch_loss_sums,
)


@dataclass(frozen=True)
class MoESpec:
    """A model's routing: ``num_experts`` experts per MoE layer, ``top_k`` of them run per token."""

    num_experts: int
    top_k: int


def moe_spec(config: Any) -> MoESpec | None:
    """The routing of a transformers config (object or ``config.json`` dict); None for a dense model.

    Qwen3-MoE's ``num_experts`` is an alias of Mixtral's ``num_local_experts`` in transformers' config classes,
    and a saved ``config.json`` holds either name. DeepSeek-V2/V3's ``n_routed_experts`` is not read on purpose:
    their sigmoid, group-limited routers have no ``load_balancing_loss_func`` in transformers, and the trainers'
    softmax routing statistics and replay do not describe them (``plan`` sizes them through ``ModelShape``).
    """
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    experts = get("num_local_experts") or get("num_experts")
    top_k = get("num_experts_per_tok")
    if not experts or not top_k:
        return None
    return MoESpec(int(experts), int(top_k))


def trained_moe_spec(module: torch.nn.Module, aux_loss_coef: float, key: str) -> MoESpec | None:
    """The routing of a model being trained, whose router logits are then read for the load-balancing loss and the
    routing statistics; None for a dense model.

    Raises:
        ValueError: ``aux_loss_coef`` (the config option ``key``) > 0 for a dense model.
    """
    spec = moe_spec(_transformers_model(module).config)
    if spec is None and aux_loss_coef > 0:
        raise ValueError(f"{key}={aux_loss_coef}: {type(module).__name__} is not a mixture-of-experts model, so it "
                         f"has no load-balancing loss; set {key}=0")
    return spec


def _transformers_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (or ``module`` itself)."""
    get_base = getattr(module, "get_base_model", None)
    return get_base() if callable(get_base) else module


def router_class(module: torch.nn.Module) -> type[torch.nn.Module] | None:
    """The router module class transformers records ``router_logits`` from (``_can_record_outputs``)."""
    model = _transformers_model(module)
    recorder = getattr(type(model), "_can_record_outputs", None) or {}
    target = recorder.get("router_logits")
    return getattr(target, "target_class", None)


def sparse_moe_block_classes(module: torch.nn.Module) -> list[type]:
    """Classes of the modules that hold a router as a direct child: one layer's sparse MoE block.

    A micro-batch reaches only some experts; DeepSpeed's ZeRO-3 fetches parameters per module as the forward
    enters it, so expert modules that no token of a rank reaches would leave that rank's fetch out of step
    with the other ranks'. Marking the block as a leaf (``deepspeed.utils.set_z3_leaf_modules``) fetches all
    of its parameters on entry on every rank.
    """
    router = router_class(module)
    if router is None:
        return []
    classes = []
    for parent in module.modules():
        if any(isinstance(child, router) for child in parent.children()) and type(parent) not in classes:
            classes.append(type(parent))
    return classes


@dataclass
class RouterLogits:
    """The router logits of one forward, each MoE layer's over the same N flattened token positions.

    ``layers``: one (N, E) tensor per MoE layer, in model order (carry the gradient). ``token_mask`` (N,)
    bool: real tokens (not padding). ``action_mask`` (N,) bool: the positions whose output predicts a response
    (action) token, the ones routed when the rollout engine sampled that token.
    """

    layers: tuple[torch.Tensor, ...]
    token_mask: torch.Tensor
    action_mask: torch.Tensor


def _load_balancing_loss_func(module: torch.nn.Module):
    model = _transformers_model(module)
    fn = getattr(importlib.import_module(type(model).__module__), "load_balancing_loss_func", None)
    if fn is None:
        raise TypeError(f"{type(model).__name__}'s modeling module has no load_balancing_loss_func: cannot compute "
                        "the MoE load-balancing loss (algo.aux_loss_coef / loss.aux_loss_coef)")
    return fn


def load_balancing_loss(module: torch.nn.Module, router: RouterLogits, sp_group: Any = None) -> torch.Tensor:
    """The model's Switch-Transformer load-balancing loss over the real tokens of one forward: 0-dim fp32.

    transformers' ``load_balancing_loss_func`` (what the model's own ``aux_loss`` returns for this batch):
    ``E * sum_e f_e * P_e``, with ``f_e`` the fraction of top-k assignments that went to expert ``e`` and
    ``P_e`` the mean router probability of ``e``, both pooled over the MoE layers and the tokens of
    ``router.token_mask``. A mean over this forward's tokens.

    ``sp_group``: the forward is one chunk of a sequence-parallel forward (``router`` holds this rank's tokens):
    the loss is that of the whole forward, from the chunks' summed assignments and probabilities
    (``hpc_rlhf.algos.moe.switch_loss``, the same formula), identical on every rank of the group; its gradient
    reaches this rank's router logits only, so the group's gradients add up to the whole forward's.
    """
    spec = moe_spec(_transformers_model(module).config)
    if spec is None:
        raise TypeError(f"{type(module).__name__} is not a mixture-of-experts model")
    if sp_group is None:
        fn = _load_balancing_loss_func(module)
        return fn(tuple(router.layers), spec.num_experts, spec.top_k, router.token_mask.long().unsqueeze(0)).float()
    assigned, probability_sum, rows = switch_loss_sums(router.layers, router.token_mask, spec.top_k)
    local = torch.cat([assigned, probability_sum.detach(), rows[None]])
    total = local.clone()
    dist.all_reduce(total, group=sp_group)
    num_experts = assigned.shape[0]
    others = (total - local)[num_experts:2 * num_experts]  # the other chunks' probability sums, no gradient here
    return switch_loss(total[:num_experts], probability_sum + others, total[-1])


def routing_statistics(router: RouterLogits, top_k: int, recorded: torch.Tensor | None = None,
                       sp_group: Any = None) -> dict[str, float]:
    """``hpc_rlhf.algos.moe.routing_stats`` of a forward's action positions (``router.action_mask``), and with
    ``recorded`` (N, L, k) routes of the same positions, ``route_mismatch``. With ``sp_group``, those of the
    whole sequence-parallel forward whose chunk ``router`` (and ``recorded``) hold: the same on every rank."""
    load, entropy_sum, tokens = routing_sums(router.layers, router.action_mask, top_k)
    parts = [load.flatten(), entropy_sum, tokens[None]]
    if recorded is not None:
        parts.append(route_mismatch_sums(router.layers, recorded, router.action_mask, top_k).to(load.device))
    flat = torch.cat(parts)
    if sp_group is not None:
        dist.all_reduce(flat, group=sp_group)
    end = load.numel() + entropy_sum.numel() + 1
    stats = routing_stats_from_sums(flat[:load.numel()].view_as(load), flat[load.numel():end - 1], flat[end - 1])
    if recorded is not None:
        stats.update(route_mismatch_from_sums(flat[end:]))
    return stats
