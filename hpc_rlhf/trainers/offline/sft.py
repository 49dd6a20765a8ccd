"""Supervised fine-tuning (and continued pretraining): token-mean NLL on the trained tokens (plus a
mixture-of-experts model's load-balancing loss when ``loss.aux_loss_coef`` > 0: the base class adds it).

A vision-language ``model.pretrain`` (Qwen2.5-VL / Qwen3-VL, ``hpc_rlhf.models.vision``) trains on rows with
images (``hpc_rlhf.data.vision_sft``): each micro-batch's images are processed when it is laid out and the
forward carries them with each sample's M-RoPE positions, padded or packed; image tokens are never trained on.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.preference import sft_loss
from hpc_rlhf.config.supervised import SFTRunConfig
from hpc_rlhf.data.packing import CollatedBatch, TokenSample
from hpc_rlhf.data.sft import TextFormatter, load_train_and_eval, make_sft_example
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.data.vision_sft import make_vision_sft_example, refuse_images, sft_vision_encoder, visual_inputs
from hpc_rlhf.models.forward import causal_lm_forward
from hpc_rlhf.models.vision_forward import vision_causal_lm_forward
from hpc_rlhf.trainers.offline.base import SupervisedTrainer, ratio


class SFTTrainer(SupervisedTrainer[SFTRunConfig]):
    kind = "sft"
    vision: VisionPromptEncoder | None = None

    def build_datasets(self) -> tuple[list[TokenSample], list[TokenSample]]:
        data, model_dir = self.cfg.data, self.cfg.model.pretrain_path("model.pretrain")
        formatter = TextFormatter.from_config(data, self.tokenizer)
        self.vision = sft_vision_encoder(model_dir, self.tokenizer, data)
        if self.vision is None:
            if self.cfg.model.freeze_vision_tower:
                raise ValueError(f"model.freeze_vision_tower=true but model.pretrain={model_dir} is a text-only model")
            make = refuse_images(make_sft_example(formatter, data), data, model_dir)
        else:
            make = make_vision_sft_example(formatter, data, self.vision)
        return load_train_and_eval(data, make, self.cfg.train.seed, "SFT {} samples")

    def global_counts(self, batch: list[TokenSample]) -> dict[str, int]:
        return {"num_tokens": sum(s.num_targets for s in batch)}

    def input_tokens(self, items: list[TokenSample]) -> int:
        return sum(len(s) for s in items)

    def _nll(self, items: list[TokenSample], router: list | None = None) -> tuple[torch.Tensor, CollatedBatch]:
        batch = self.collate(items)
        if self.vision is not None:
            if router is not None:
                raise NotImplementedError("mixture-of-experts vision-language models (router logits with images)")
            return vision_causal_lm_forward(self.engine, batch, visual_inputs(items, batch, self.vision)), batch
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
