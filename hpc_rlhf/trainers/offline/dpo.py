"""DPO / cDPO / IPO against a frozen reference model, with an optional NLL term on the chosen answers.

Chosen and rejected sequences of a micro-batch go through the policy in one forward (padded or
packed); the reference runs on the same layout under ``no_grad``. A vision-language ``model.pretrain`` takes
pairs whose shared prompt holds images (``hpc_rlhf.data.vision_sft.make_vision_pair``): both forwards carry them.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.preference import dpo_loss, global_mean, sft_loss
from hpc_rlhf.config.supervised import DPORunConfig
from hpc_rlhf.data.preference import PreferencePair, build_preference_datasets
from hpc_rlhf.data.sft import TextFormatter, load_train_and_eval
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.data.vision_sft import make_vision_pair, sft_vision_encoder, visual_inputs
from hpc_rlhf.models.forward import causal_lm_forward, sequence_logprobs
from hpc_rlhf.models.vision_forward import vision_causal_lm_forward
from hpc_rlhf.trainers.offline.base import SupervisedTrainer, ratio


class DPOTrainer(SupervisedTrainer[DPORunConfig]):
    kind = "dpo"
    uses_reference = True
    vision: VisionPromptEncoder | None = None

    def build_datasets(self):
        data = self.cfg.data
        self.vision = sft_vision_encoder(self.cfg.model.pretrain_path("model.pretrain"), self.tokenizer, data)
        if self.vision is None:
            return build_preference_datasets(data, self.tokenizer, self.cfg.train.seed)
        make = make_vision_pair(TextFormatter.from_config(data, self.tokenizer), data, self.vision)
        return load_train_and_eval(data, make, self.cfg.train.seed, "preference {} pairs")

    def _logps(self, model, batch, samples, router: list | None = None):
        """Per-target-token log-probs of ``model`` over the collated ``samples`` (with their images)."""
        if self.vision is None:
            return causal_lm_forward(model, batch, self.attn, self.dtype, router=router)
        if router is not None:
            raise NotImplementedError("mixture-of-experts vision-language models (router logits with images)")
        return vision_causal_lm_forward(model, batch, visual_inputs(samples, batch, self.vision))

    def global_counts(self, batch: list[PreferencePair]):
        return {"num_pairs": len(batch), "chosen_tokens": sum(p.chosen.num_targets for p in batch)}

    def input_tokens(self, items: list[PreferencePair]) -> int:
        return sum(len(p.chosen) + len(p.rejected) for p in items)

    def _forward(self, items: list[PreferencePair], router: list | None = None):
        loss_cfg = self.cfg.loss
        n = len(items)
        samples = [p.chosen for p in items] + [p.rejected for p in items]
        batch = self.collate(samples)
        token_logps = self._logps(self.engine, batch, samples, router)
        policy = sequence_logprobs(token_logps, batch, mean=loss_cfg.ipo)
        with torch.no_grad():
            ref = sequence_logprobs(self._logps(self.ref, batch, samples), batch, mean=loss_cfg.ipo)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy[:n], policy[n:], ref[:n], ref[n:], beta=loss_cfg.beta, label_smoothing=loss_cfg.label_smoothing,
            ipo=loss_cfg.ipo)
        chosen_mask = batch["target_mask"] & (batch["segment_ids"] < n)
        return losses, chosen_rewards, rejected_rewards, token_logps, chosen_mask

    def _stats(self, items, losses, chosen_rewards, rejected_rewards, token_logps, chosen_mask):
        return {"loss_sum": float(losses.detach().sum()), "num_pairs": float(len(items)),
                "correct": float((chosen_rewards > rejected_rewards).sum()),
                "chosen_sum": float(chosen_rewards.sum()), "rejected_sum": float(rejected_rewards.sum()),
                "chosen_nll_sum": float(-token_logps.detach()[chosen_mask].sum()),
                "chosen_tokens": float(chosen_mask.sum())}

    def train_micro(self, items, counts):
        losses, cr, rr, token_logps, chosen_mask = self._forward(items, self.router_sink())
        loss = global_mean(losses, counts["num_pairs"], self.dp_size)
        if self.cfg.loss.nll_loss_coef > 0:
            loss = loss + self.cfg.loss.nll_loss_coef * sft_loss(
                token_logps, chosen_mask, global_num_tokens=counts["chosen_tokens"], dp_size=self.dp_size)
        return loss, self._stats(items, losses, cr, rr, token_logps, chosen_mask)

    def eval_micro(self, items):
        return self._stats(items, *self._forward(items))

    def summarize(self, sums, prefix=""):
        chosen, rejected = ratio(sums, "chosen_sum", "num_pairs"), ratio(sums, "rejected_sum", "num_pairs")
        return {f"{prefix}loss": ratio(sums, "loss_sum", "num_pairs"),
                f"{prefix}reward_accuracy": ratio(sums, "correct", "num_pairs"),
                f"{prefix}chosen_reward": chosen, f"{prefix}rejected_reward": rejected,
                f"{prefix}reward_margin": chosen - rejected,
                f"{prefix}chosen_nll": ratio(sums, "chosen_nll_sum", "chosen_tokens")}
