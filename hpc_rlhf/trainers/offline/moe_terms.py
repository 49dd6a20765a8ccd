"""A mixture-of-experts model in the offline trainers (SFT, reward model, DPO, KTO): its load-balancing loss
in the loss (``loss.aux_loss_coef``) and its routing statistics in the metrics, every step.

The trained model's forward of each train micro-batch appends its router logits to a sink
(:meth:`MoETerms.sink`); the reference's forwards and the evaluation's do not. The load-balancing loss is a mean
over the forward's real tokens, not a sum a global normaliser could divide, so each micro-batch's loss is weighted
by its share of the global batch's input tokens (``hpc_rlhf.algos.token_share``): the shares add up to one over
micro-batches and ranks, and the logged ``aux_loss`` is the token-weighted mean of the micro-batch means, however
the batch is split. The routing statistics (``hpc_rlhf.algos.moe.routing_stats``) are token-weighted means of the
micro-batch values the same way.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos import routing_stats, token_share
from hpc_rlhf.models.moe import MoESpec, RouterLogits, load_balancing_loss, trained_moe_spec

TOKENS = "moe_tokens"  # the statistics' weight: input tokens of the micro-batches that routed


class MoETerms:
    """The MoE terms of one offline trainer's model (``module``: the engine's transformers model)."""

    def __init__(self, module: torch.nn.Module, spec: MoESpec, aux_loss_coef: float) -> None:
        self.module = module
        self.spec = spec
        self.aux_loss_coef = aux_loss_coef
        self._router: list[RouterLogits] | None = None

    @classmethod
    def of(cls, module: torch.nn.Module, aux_loss_coef: float) -> MoETerms | None:
        """The terms of ``module`` when it is a mixture-of-experts model, else None.

        Raises:
            ValueError: ``loss.aux_loss_coef`` > 0 for a dense model.
        """
        spec = trained_moe_spec(module, aux_loss_coef, "loss.aux_loss_coef")
        return cls(module, spec, aux_loss_coef) if spec is not None else None

    def start_micro(self) -> None:
        """A train micro-batch begins: the next :meth:`sink` collects its trained forward's router logits."""
        self._router = []

    def sink(self) -> list[RouterLogits] | None:
        """The list the trained model's forward passes as ``router`` (None outside a train micro-batch)."""
        return self._router

    def finish_micro(self, loss: torch.Tensor, tokens: int, global_tokens: int,
                     dp_size: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss with the weighted load-balancing loss added, and its statistics as sums.

        ``tokens``: the micro-batch's input tokens (those the forward routed); ``global_tokens``: the global
        batch's, over all ranks (``dp_size`` of them).
        """
        router, self._router = self._router, None
        if not router or len(router) != 1:
            raise RuntimeError(f"the trained model's forward of a micro-batch recorded {len(router or [])} router "
                               "outputs, expected 1: pass MoETerms.sink() as its router")
        logits = router[0]
        aux = load_balancing_loss(self.module, logits)
        if self.aux_loss_coef > 0:
            loss = loss + self.aux_loss_coef * token_share(tokens, global_tokens, dp_size).to(aux.device) * aux
        stats = {f"{key}_sum": value * tokens
                 for key, value in routing_stats(logits.layers, logits.token_mask, self.spec.top_k).items()}
        stats.update({"aux_loss_sum": float(aux.detach()) * tokens, TOKENS: float(tokens)})
        return loss, stats


def moe_summary(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """``aux_loss`` and the ``moe/...`` statistics from the step's summed statistics (empty for a dense model)."""
    if not sums.get(TOKENS):
        return {}
    return {f"{prefix}{key[:-len('_sum')]}": value / sums[TOKENS] for key, value in sums.items()
            if key.endswith("_sum") and (key.startswith("moe/") or key == "aux_loss_sum")}
