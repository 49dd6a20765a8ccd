"""Routing statistics of a mixture-of-experts model, from its router logits.

A top-k router sends each token to the ``k`` experts with the largest router probability
``softmax(router_logits)``. These functions say how evenly one layer's tokens spread over the experts and how
sure the router is, for logging, and the load-balancing loss as sums that chunks of one forward add up (under
sequence parallelism; otherwise the loss is the model's own ``load_balancing_loss_func``, see
``hpc_rlhf.models.moe``). Pure: no model, no process group.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.masking import as_bool_mask


def expert_load(router_logits: torch.Tensor, mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tokens routed to each expert: (N, E) logits of N tokens, (N,) mask -> (E,) fp32 counts.

    Each selected token adds 1 to each of its ``top_k`` experts, so the counts sum to ``top_k`` x the
    selected tokens.
    """
    selected = router_logits.detach().float()[as_bool_mask(mask)]
    chosen = selected.topk(top_k, dim=-1).indices.reshape(-1)  # top-k of the logits = top-k of the softmax
    return torch.bincount(chosen, minlength=router_logits.shape[-1]).float()


def load_max_over_mean(load: torch.Tensor) -> torch.Tensor:
    """(E,) tokens per expert -> 0-dim: busiest expert's tokens / mean tokens per expert.

    1 is perfectly even; ``E`` means every token went to one expert (top-1). 1 when no token was routed.
    """
    mean = load.float().mean()
    return torch.where(mean > 0, load.float().max() / mean.clamp(min=1e-12), torch.ones_like(mean))


def router_entropy(router_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the selected tokens of the entropy (nats) of the routing distribution
    ``softmax(router_logits)``: (N, E), (N,) -> 0-dim fp32; 0 when no token is selected.

    ``log E`` is a router that cannot tell the experts apart; 0 is one that always picks one expert.
    """
    selected = router_logits.detach().float()[as_bool_mask(mask)]
    if selected.shape[0] == 0:
        return torch.zeros(())
    log_probs = torch.log_softmax(selected, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1).mean()


def routing_sums(layer_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], mask: torch.Tensor,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The additive parts of :func:`routing_stats`, which chunks of one forward (sequence parallelism) sum:
    ``(load (L, E), entropy_sum (L,), tokens 0-dim)``, fp32 and detached, over the selected tokens (``mask``)
    of each MoE layer's (N, E) logits."""
    selected = as_bool_mask(mask)
    load = torch.stack([expert_load(logits, selected, top_k) for logits in layer_logits])
    tokens = selected.sum().float()
    entropy = torch.stack([router_entropy(logits, selected).to(load.device) * tokens for logits in layer_logits])
    return load, entropy, tokens.to(load.device)


def routing_stats_from_sums(load: torch.Tensor, entropy_sum: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """Logged routing statistics from :func:`routing_sums` (of one forward, or added over its chunks): per MoE
    layer ``i`` (in model order) the load ratio ``moe/layer<i>/load_max_over_mean``, the worst layer's ratio
    ``moe/load_max_over_mean``, and the router entropy averaged over layers ``moe/router_entropy``."""
    ratios = [float(load_max_over_mean(layer)) for layer in load]
    stats = {f"moe/layer{i}/load_max_over_mean": r for i, r in enumerate(ratios)}
    stats["moe/load_max_over_mean"] = max(ratios)
    stats["moe/router_entropy"] = float((entropy_sum / tokens.clamp(min=1)).mean())
    return stats


def routing_stats(layer_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], mask: torch.Tensor,
                  top_k: int) -> dict[str, float]:
    """:func:`routing_stats_from_sums` of one forward's router logits: one (N, E) tensor per MoE layer over the
    same N tokens; ``mask`` (N,) the tokens counted."""
    return routing_stats_from_sums(*routing_sums(layer_logits, mask, top_k))


def switch_loss_sums(layer_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], mask: torch.Tensor,
                     top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The additive parts of the Switch-Transformer load-balancing loss over the selected tokens of every MoE
    layer (pooled, as transformers' ``load_balancing_loss_func`` pools them): ``(assigned (E,), probability_sum
    (E,), rows 0-dim)``, fp32. ``assigned`` counts top-k assignments per expert (detached: top-k has no gradient);
    ``probability_sum`` adds ``softmax(router_logits)`` and carries the router's gradient; ``rows`` counts
    (token, layer) pairs. Chunks of one forward (sequence parallelism) add them up before :func:`switch_loss`."""
    selected = as_bool_mask(mask)
    num_experts = layer_logits[0].shape[-1]
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=layer_logits[0].device)
    probability_sum = torch.zeros_like(assigned)
    for logits in layer_logits:
        probs = torch.softmax(logits.float()[selected.to(logits.device)], dim=-1)  # (n, E)
        chosen = probs.detach().topk(top_k, dim=-1).indices.reshape(-1)
        assigned = assigned + torch.bincount(chosen, minlength=num_experts).float()
        probability_sum = probability_sum + probs.sum(dim=0)
    rows = selected.sum().float().to(assigned.device) * len(layer_logits)
    return assigned, probability_sum, rows


def switch_loss(assigned: torch.Tensor, probability_sum: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` from :func:`switch_loss_sums`: ``f_e = assigned_e / rows`` (sums to top_k),
    ``P_e = probability_sum_e / rows``; 0-dim fp32, 0 when no token was selected."""
    rows = rows.clamp(min=1)
    return (assigned / rows * probability_sum / rows).sum() * assigned.shape[-1]


def not_recorded(dtype: torch.dtype) -> int:
    """The id that marks a position without recorded routes in routes of integer ``dtype`` (its largest value,
    never a real expert id: ``hpc_rlhf.models.routing_replay``)."""
    return torch.iinfo(dtype).max


def was_recorded(routes: torch.Tensor) -> torch.Tensor:
    """(..., L, k) routes -> (...) bool: every layer of the position holds recorded experts."""
    return (routes != not_recorded(routes.dtype)).all(dim=-1).all(dim=-1)


def route_mismatch_sums(layer_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], recorded: torch.Tensor,
                        mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """The additive parts of :func:`route_mismatch`, which chunks of one forward (sequence parallelism) sum:
    ``[tokens that differ, (token, layer) pairs that differ, tokens counted, (token, layer) pairs counted]`` (4,)
    fp32. Arguments as :func:`route_mismatch`."""
    recorded = recorded.to(layer_logits[0].device)
    counted = as_bool_mask(mask).to(recorded.device) & was_recorded(recorded)  # (N,)
    sums = torch.zeros(4, dtype=torch.float32, device=recorded.device)
    if not bool(counted.any()):
        return sums
    own = torch.stack([logits.detach()[counted].topk(top_k, dim=-1).indices for logits in layer_logits], dim=1)
    differs = (own.sort(dim=-1).values != recorded[counted].long().sort(dim=-1).values).any(dim=-1)  # (n, L)
    return torch.stack([differs.any(dim=-1).float().sum(), differs.float().sum(),
                        counted.float().sum(), torch.tensor(float(differs.numel()), device=recorded.device)])


def route_mismatch_from_sums(sums: torch.Tensor) -> dict[str, float]:
    """``moe/route_mismatch`` and ``moe/route_mismatch_layer_mean`` from :func:`route_mismatch_sums` (of one forward,
    or added over its chunks); both 0 when no recorded token is counted."""
    tokens, pairs, counted, counted_pairs = (float(x) for x in sums)
    return {"moe/route_mismatch": tokens / counted if counted else 0.0,
            "moe/route_mismatch_layer_mean": pairs / counted_pairs if counted_pairs else 0.0}


def route_mismatch(layer_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], recorded: torch.Tensor,
                   mask: torch.Tensor, top_k: int) -> dict[str, float]:
    """How often the trainer's router picks other experts than the rollout engine did, over the selected tokens.

    ``layer_logits``: one (N, E) router-logit tensor per MoE layer of the trainer's forward; ``recorded`` (N, L, k):
    the experts the rollout engine used at the same positions (``hpc_rlhf.models.routing_replay``; positions
    holding the dtype's largest value were not recorded and are left out); ``mask`` (N,) the positions counted. A token
    *differs* when, in at least one layer, its top-k expert set differs from the recorded set (order ignored).

    Returns ``moe/route_mismatch`` (fraction of counted tokens that differ) and ``moe/route_mismatch_layer_mean``
    (fraction of (token, layer) pairs that differ); both 0 when no recorded token is counted.
    """
    return route_mismatch_from_sums(route_mismatch_sums(layer_logits, recorded, mask, top_k))
