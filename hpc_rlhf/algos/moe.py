"""Routing statistics of a mixture-of-experts model, from its router logits.

A top-k router sends each token to the ``k`` experts with the largest router probability
``softmax(router_logits)``. These functions say how evenly one layer's tokens spread over the experts and how
sure the router is, for logging (the load-balancing *loss* is transformers' ``load_balancing_loss_func``, see
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


def routing_stats(layer_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], mask: torch.Tensor,
                  top_k: int) -> dict[str, float]:
    """Logged routing statistics of one forward: per MoE layer ``i`` (in model order) the load ratio
    ``moe/layer<i>/load_max_over_mean``, the worst layer's ratio ``moe/load_max_over_mean``, and the router
    entropy averaged over layers ``moe/router_entropy``.

    ``layer_logits``: one (N, E) tensor per MoE layer over the same N tokens; ``mask`` (N,) the tokens counted.
    """
    ratios = [float(load_max_over_mean(expert_load(logits, mask, top_k))) for logits in layer_logits]
    entropies = [float(router_entropy(logits, mask)) for logits in layer_logits]
    stats = {f"moe/layer{i}/load_max_over_mean": r for i, r in enumerate(ratios)}
    stats["moe/load_max_over_mean"] = max(ratios)
    stats["moe/router_entropy"] = sum(entropies) / len(entropies)
    return stats


def not_recorded(dtype: torch.dtype) -> int:
    """The id that marks a position without recorded routes in routes of integer ``dtype`` (its largest value,
    never a real expert id: ``hpc_rlhf.models.routing_replay``)."""
    return torch.iinfo(dtype).max


def was_recorded(routes: torch.Tensor) -> torch.Tensor:
    """(..., L, k) routes -> (...) bool: every layer of the position holds recorded experts."""
    return (routes != not_recorded(routes.dtype)).all(dim=-1).all(dim=-1)


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
    recorded = recorded.to(layer_logits[0].device)
    counted = as_bool_mask(mask).to(recorded.device) & was_recorded(recorded)  # (N,)
    recorded = recorded.long()
    if not bool(counted.any()):
        return {"moe/route_mismatch": 0.0, "moe/route_mismatch_layer_mean": 0.0}
    own = torch.stack([logits.detach()[counted].topk(top_k, dim=-1).indices for logits in layer_logits], dim=1)
    differs = (own.sort(dim=-1).values != recorded[counted].sort(dim=-1).values).any(dim=-1)  # (n, L)
    return {"moe/route_mismatch": float(differs.any(dim=-1).float().mean()),
            "moe/route_mismatch_layer_mean": float(differs.float().mean())}
