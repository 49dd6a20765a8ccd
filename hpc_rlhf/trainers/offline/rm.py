"""Reward model: a ``score`` head on the transformer, Bradley-Terry loss on preference pairs.

The export is an ``AutoModelForSequenceClassification`` folder (``num_labels=1``, head ``score``) whose
``config.json`` also holds ``reward_mean`` / ``reward_std`` of the final model's rewards on the eval set
(or, without one, on up to 256 train pairs): ``serve_rm --normalize`` reads them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from hpc_rlhf.algos.preference import global_mean, pairwise_reward_loss
from hpc_rlhf.config.supervised import RMRunConfig
from hpc_rlhf.data.packing import CollatedBatch
from hpc_rlhf.data.preference import PreferencePair, build_preference_datasets
from hpc_rlhf.models.forward import value_model_forward
from hpc_rlhf.models.loading import load_value_model
from hpc_rlhf.trainers.offline.base import RM_STATS_SAMPLES, SupervisedTrainer, ratio


class RewardModelTrainer(SupervisedTrainer[RMRunConfig]):
    kind = "rm"

    def build_datasets(self):
        return build_preference_datasets(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def model_factory(self) -> torch.nn.Module:
        ds = self.cfg.ds
        model = load_value_model(self.cfg.model.pretrain_path("model.pretrain"), self.dtype, self.attn,
                                 ds.use_liger_kernel, ds.lora.load_in_4bit)
        model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    def global_counts(self, batch):
        return {"num_pairs": len(batch)}

    def input_tokens(self, items: list[PreferencePair]) -> int:
        return sum(len(p.chosen) + len(p.rejected) for p in items)

    def _scores(self, items: list[PreferencePair],
                router: list | None = None) -> tuple[torch.Tensor, torch.Tensor, CollatedBatch]:
        samples = [p.chosen for p in items] + [p.rejected for p in items]
        batch = self.collate(samples)
        scores = value_model_forward(self.engine, batch, self.attn, self.dtype, router=router)
        n = len(items)
        return scores[:n], scores[n:], batch

    def _stats(self, items, chosen, rejected, losses) -> dict[str, float]:
        chosen, rejected = chosen.detach(), rejected.detach()
        rewards = torch.cat([chosen, rejected])
        return {"loss_sum": float(losses.detach().sum()), "num_pairs": float(len(items)),
                "correct": float((chosen > rejected).sum()), "margin_sum": float((chosen - rejected).sum()),
                "chosen_sum": float(chosen.sum()), "rejected_sum": float(rejected.sum()),
                "reward_sum": float(rewards.sum()), "reward_sq_sum": float((rewards ** 2).sum())}

    def _losses(self, items, chosen, rejected):
        margin = None
        if self.cfg.data.margin_key is not None:
            margin = torch.tensor([p.margin for p in items], device=chosen.device)
        return pairwise_reward_loss(chosen, rejected, margin, self.cfg.loss.loss)

    def train_micro(self, items, counts):
        chosen, rejected, _ = self._scores(items, self.router_sink())
        losses = self._losses(items, chosen, rejected)
        loss = global_mean(losses, counts["num_pairs"], self.dp_size)
        return loss, self._stats(items, chosen, rejected, losses)

    def eval_micro(self, items):
        chosen, rejected, _ = self._scores(items)
        return self._stats(items, chosen, rejected, self._losses(items, chosen, rejected))

    def summarize(self, sums, prefix=""):
        mean = ratio(sums, "reward_sum", "num_pairs") / 2
        second = ratio(sums, "reward_sq_sum", "num_pairs") / 2
        return {f"{prefix}loss": ratio(sums, "loss_sum", "num_pairs"),
                f"{prefix}accuracy": ratio(sums, "correct", "num_pairs"),
                f"{prefix}reward_margin": ratio(sums, "margin_sum", "num_pairs"),
                f"{prefix}chosen_reward": ratio(sums, "chosen_sum", "num_pairs"),
                f"{prefix}rejected_reward": ratio(sums, "rejected_sum", "num_pairs"),
                f"{prefix}reward_mean": mean,
                f"{prefix}reward_std": math.sqrt(max(second - mean * mean, 0.0))}

    def export(self) -> None:
        # Collective: every rank scores its share before rank 0 writes the statistics.
        items = self.eval_set or self.train_set[:RM_STATS_SAMPLES - RM_STATS_SAMPLES % self.dp_size]
        stats = self.evaluate(items)
        self.reward_stats = {"reward_mean": stats["eval_reward_mean"], "reward_std": stats["eval_reward_std"]}
        super().export()

    def after_export(self, model_dir: Path) -> None:
        config_file = model_dir / "config.json"
        config = json.loads(config_file.read_text())
        config.update(self.reward_stats)
        tmp = config_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp.replace(config_file)
