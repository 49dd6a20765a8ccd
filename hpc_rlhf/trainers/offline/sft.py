"""Supervised fine-tuning (and continued pretraining): token-mean NLL on the trained tokens (plus a
mixture-of-experts model's load-balancing loss when ``loss.aux_loss_coef`` > 0: the base class adds it)."""

from __future__ import annotations

import torch

from hpc_rlhf.algos.preference import sft_loss
from hpc_rlhf.config.supervised import SFTRunConfig
from hpc_rlhf.data.packing import CollatedBatch, TokenSample
from hpc_rlhf.data.sft import build_sft_datasets
from hpc_rlhf.models.forward import causal_lm_forward
from hpc_rlhf.trainers.offline.base import SupervisedTrainer, ratio


class SFTTrainer(SupervisedTrainer[SFTRunConfig]):
    kind = "sft"

    def build_datasets(self) -> tuple[list[TokenSample], list[TokenSample]]:
        return build_sft_datasets(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def global_counts(self, batch: list[TokenSample]) -> dict[str, int]:
        return {"num_tokens": sum(s.num_targets for s in batch)}

    def input_tokens(self, items: list[TokenSample]) -> int:
        return sum(len(s) for s in items)

    def _nll(self, items: list[TokenSample], router: list | None = None) -> tuple[torch.Tensor, CollatedBatch]:
        batch = self.collate(items)
        logps = causal_lm_forward(self.engine, batch, self.attn, self.dtype, router=router)
        return logps, batch

    def train_micro(self, items, counts):
        logps, batch = self._nll(items, self.router_sink())
        loss = sft_loss(logps, batch["target_mask"], global_num_tokens=counts["num_tokens"], dp_size=self.dp_size)
        return loss, {"nll_sum": float(-logps.detach().sum()), "num_tokens": float(batch["target_mask"].sum())}

    def eval_micro(self, items):
        logps, batch = self._nll(items)
        return {"nll_sum": float(-logps.sum()), "num_tokens": float(batch["target_mask"].sum())}

    def summarize(self, sums, prefix=""):
        return {f"{prefix}loss": ratio(sums, "nll_sum", "num_tokens")}
