"""Supervised fine-tuning (and continued pretraining): token-mean NLL on the trained tokens, plus a
mixture-of-experts model's load-balancing loss when ``loss.aux_loss_coef`` > 0."""

from __future__ import annotations

import torch

from hpc_rlhf.algos import token_share
from hpc_rlhf.algos.preference import sft_loss
from hpc_rlhf.data.packing import TokenSample
from hpc_rlhf.data.sft import build_sft_datasets
from hpc_rlhf.models.forward import causal_lm_forward
from hpc_rlhf.models.moe import load_balancing_loss, moe_spec
from hpc_rlhf.trainers.offline.base import SupervisedTrainer, ratio


class SFTTrainer(SupervisedTrainer):
    kind = "sft"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        coef = cfg.loss.aux_loss_coef
        # An MoE model logs its load-balancing loss every step; the router logits cost nothing for a dense one.
        self.moe = moe_spec(self.engine.module.config) is not None
        if coef > 0 and not self.moe:
            raise ValueError(f"loss.aux_loss_coef={coef}: {type(self.engine.module).__name__} is not a "
                             "mixture-of-experts model, so it has no load-balancing loss; set loss.aux_loss_coef=0")

    def build_datasets(self) -> tuple[list[TokenSample], list[TokenSample]]:
        return build_sft_datasets(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def global_counts(self, batch: list[TokenSample]) -> dict[str, int]:
        return {"num_tokens": sum(s.num_targets for s in batch)}

    def _nll(self, items: list[TokenSample], router: list | None = None) -> tuple[torch.Tensor, dict]:
        batch = self.collate(items)
        logps = causal_lm_forward(self.engine, batch, self.attn, self.dtype, router=router)
        return logps, batch

    def train_micro(self, items, counts):
        router = [] if self.moe else None
        logps, batch = self._nll(items, router)
        loss = sft_loss(logps, batch["target_mask"], global_num_tokens=counts["num_tokens"], dp_size=self.dp_size)
        num_tokens = batch["target_mask"].sum()
        stats = {"nll_sum": float(-logps.detach().sum()), "num_tokens": float(num_tokens),
                 "num_input_tokens": float(sum(len(s) for s in items))}
        if router:
            # The load-balancing loss is a mean over the micro-batch's tokens: weighted by the micro-batch's share
            # of the global batch's trained tokens, the shares add up to a token-weighted mean over the batch
            # (the NLL's normaliser), however the batch is split into micro-batches and ranks.
            aux = load_balancing_loss(self.engine.module, router[0])
            coef = self.cfg.loss.aux_loss_coef
            if coef > 0:
                loss = loss + coef * token_share(num_tokens, counts["num_tokens"], self.dp_size) * aux
            stats["aux_loss_sum"] = float(aux.detach()) * float(num_tokens)
        return loss, stats

    def eval_micro(self, items):
        logps, batch = self._nll(items)
        return {"nll_sum": float(-logps.sum()), "num_tokens": float(batch["target_mask"].sum())}

    def summarize(self, sums, prefix=""):
        row = {f"{prefix}loss": ratio(sums, "nll_sum", "num_tokens")}
        if "aux_loss_sum" in sums:
            row[f"{prefix}aux_loss"] = ratio(sums, "aux_loss_sum", "num_tokens")
        return row
