"""KTO against a frozen reference model on unpaired desirable / undesirable samples.

The reference point ``z = max(0, KL)`` is estimated per micro-batch step over all ranks: from mismatched
pairs ``(x_i, y_{i+1})`` (``loss.kl_mode=mismatched``, as TRL / OpenRLHF) or from the batch's own
log-ratios (``batch_mean``); it is detached, as in the paper.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc_rlhf.algos.preference import global_mean, kto_loss, kto_reference_point
from hpc_rlhf.config.supervised import KTORunConfig
from hpc_rlhf.data.preference import KTOSample, build_kto_datasets, mismatched_samples
from hpc_rlhf.models.forward import causal_lm_forward, sequence_logprobs
from hpc_rlhf.trainers.offline.base import SupervisedTrainer, ratio
from hpc_rlhf.world.groups import comm_device


class KTOTrainer(SupervisedTrainer[KTORunConfig]):
    kind = "kto"
    uses_reference = True

    def build_datasets(self):
        return build_kto_datasets(self.cfg.data, self.tokenizer, self.cfg.train.seed)

    def global_counts(self, batch: list[KTOSample]):
        return {"num_samples": len(batch)}

    def input_tokens(self, items: list[KTOSample]) -> int:
        return sum(len(s.sample) for s in items)

    def _logps(self, model, batch, router: list | None = None) -> torch.Tensor:
        return sequence_logprobs(causal_lm_forward(model, batch, self.attn, self.dtype, router=router), batch)

    def _reference_point(self, items: list[KTOSample], policy: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.cfg.loss.kl_mode == "mismatched":
                kl_batch = self.collate(mismatched_samples(items, self.cfg.data.max_len))
                diffs = self._logps(self.engine, kl_batch) - self._logps(self.ref, kl_batch)
            else:
                diffs = (policy - ref).detach()
            totals = torch.tensor([float(diffs.sum()), float(len(items))], dtype=torch.float64, device=comm_device())
            if dist.is_initialized():
                dist.all_reduce(totals, group=self.dp_group)  # every rank runs the same number of micro-batches
        return kto_reference_point(totals[0].float().cpu(), totals[1].float().cpu())

    def _forward(self, items: list[KTOSample], router: list | None = None):
        loss_cfg = self.cfg.loss
        batch = self.collate([s.sample for s in items])
        policy = self._logps(self.engine, batch, router)
        with torch.no_grad():
            ref = self._logps(self.ref, batch)
        z = self._reference_point(items, policy, ref)
        desirable = torch.tensor([s.desirable for s in items], device=policy.device)
        losses, rewards = kto_loss(policy, ref, desirable, z.to(policy.device), beta=loss_cfg.beta,
                                   desirable_weight=loss_cfg.desirable_weight,
                                   undesirable_weight=loss_cfg.undesirable_weight)
        return losses, rewards, desirable, z

    @staticmethod
    def _stats(items, losses, rewards, desirable, z):
        good = desirable.float()
        return {"loss_sum": float(losses.detach().sum()), "num_samples": float(len(items)),
                "desirable_sum": float((rewards * good).sum()), "num_desirable": float(good.sum()),
                "undesirable_sum": float((rewards * (1 - good)).sum()), "num_undesirable": float((1 - good).sum()),
                "sign_correct": float(((rewards > 0) == desirable).sum()), "kl_sum": float(z) * len(items)}

    def train_micro(self, items, counts):
        losses, rewards, desirable, z = self._forward(items, self.router_sink())
        return global_mean(losses, counts["num_samples"], self.dp_size), self._stats(items, losses, rewards,
                                                                                     desirable, z)

    def eval_micro(self, items):
        return self._stats(items, *self._forward(items))

    def summarize(self, sums, prefix=""):
        good, bad = ratio(sums, "desirable_sum", "num_desirable"), ratio(sums, "undesirable_sum", "num_undesirable")
        return {f"{prefix}loss": ratio(sums, "loss_sum", "num_samples"),
                f"{prefix}desirable_reward": good, f"{prefix}undesirable_reward": bad,
                f"{prefix}reward_margin": good - bad,
                f"{prefix}reward_accuracy": ratio(sums, "sign_correct", "num_samples"),
                f"{prefix}kl": ratio(sums, "kl_sum", "num_samples")}
