"""Config trees of the offline trainers (SFT, reward model, DPO / IPO / cDPO, KTO). Imports no torch.

Shared sections come from ``schema.py`` (``model`` is an ``ActorConfig``, ``ds``, ``logger``, ``ckpt``,
``slurm``, ``ref``); ``data``, ``train`` and ``loss`` are defined here. Every section forbids unknown keys,
so ``loss.bta=0.1`` fails naming ``loss.bta`` and listing what is allowed. Load with
:func:`load_supervised_config` (YAML recipe + dotted overrides), exactly like ``load_config`` for RL runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from hpc_rlhf.config.loader import ConfigError, load_config
from hpc_rlhf.config.schema import (
    ActorConfig,
    CkptConfig,
    DeepSpeedConfig,
    LoggerConfig,
    OutputAccess,
    RefConfig,
    SlurmConfig,
    StallLimits,
)
from hpc_rlhf.config.section import Section

SyntheticTask = Literal["sft_arithmetic", "preference_arithmetic", "kto_arithmetic", "sft_colour", "sft_code"]


class SupervisedDataConfig(Section):
    train_data: list[str] = Field(default_factory=list, description="files or save_to_disk folders")
    train_data_probs: list[float] | None = Field(None, description="mixture probabilities, one per train_data")
    eval_data: list[str] = Field(default_factory=list, description="held-out files (concatenated)")
    max_samples: int | None = Field(None, ge=1, description="use at most this many training samples")
    max_eval_samples: int | None = Field(None, ge=1, description="use at most this many evaluation samples")
    # SFT
    input_key: str = Field("input", description="SFT prompt (or the whole text in pretrain_mode)")
    output_key: str = Field("output", description="SFT response")
    messages_key: str | None = Field(None, description="SFT chat rows: list of {role, content}; loss on assistant")
    pretrain_mode: bool = Field(False, description="SFT: loss on every token of input_key")
    # SFT / DPO with images (vision-language models, docs/vlm.md)
    images_key: str = Field(
        "images", description="SFT / DPO: column holding a row's images (paths relative to the data file, file:// or "
        "base64 data URLs, HF datasets.Image values); image content parts in chat messages are read too")
    min_pixels: int | None = Field(
        None, ge=1, description="vision-language models: smallest image area in pixels (null: the processor's own)")
    max_pixels: int | None = Field(
        None, ge=1, description="vision-language models: largest image area in pixels; larger images are scaled "
        "down by the model's image processor (null: the processor's own)")
    # preference (RM, DPO) and KTO
    prompt_key: str | None = Field("prompt", description="None: chosen/rejected are full chat message lists")
    chosen_key: str = Field("chosen", description="RM / DPO: column of the preferred response")
    rejected_key: str = Field("rejected", description="RM / DPO: column of the rejected response")
    margin_key: str | None = Field(None, description="RM: per-pair margin column (Llama 2 margin loss)")
    completion_key: str = Field("completion", description="KTO response")
    label_key: str = Field("label", description="KTO: true / 1 = desirable, false / 0 = undesirable")
    # formatting
    input_template: str | None = Field(None, description="format string with one {} for the prompt")
    apply_chat_template: bool = Field(False, description="format samples with the tokenizer's chat template")
    max_len: int = Field(512, ge=2, description="tokens per sample (prompt + response); longer are truncated")
    skip_bad_rows: bool = Field(
        False,
        description="skip and count rows that fail validation instead of stopping with an error naming the file and "
        "row")
    synthetic_task: SyntheticTask | None = Field(
        None, description="write seeded arithmetic data (sft_colour: the colour images task with answers; sft_code: "
        "programs of the code task, the eval file from its held-out functions) to "
        "train_data[0] / eval_data[0] if missing (CPU recipes)")
    synthetic_num_samples: int = Field(512, ge=1, description="data.synthetic_task: training samples written")
    synthetic_eval_samples: int = Field(128, ge=1, description="data.synthetic_task: evaluation samples written")
    synthetic_max_operand: int = Field(
        9, ge=1, description="data.synthetic_task: largest operand of the arithmetic problems")

    @model_validator(mode="after")
    def _check(self) -> SupervisedDataConfig:
        if self.train_data_probs is not None and len(self.train_data_probs) != len(self.train_data):
            raise ValueError(f"data.train_data_probs has {len(self.train_data_probs)} entries but data.train_data "
                             f"has {len(self.train_data)}; give one probability per dataset")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"data.min_pixels={self.min_pixels} is larger than data.max_pixels={self.max_pixels}")
        return self


class SupervisedTrainConfig(StallLimits):
    output_dir: str = Field(
        "runs/supervised", description="run folder: metrics.jsonl, checkpoints (ckpt/), the exported model (model/)")
    output_access: OutputAccess = Field(
        "private", description="who may read what the run writes (checkpoints, exports, metrics, rollout dumps): "
        "private: this user only (files 0600, folders 0700); group: the user's group may read too (0640 / 0750). "
        "Set as every rank's umask at start-up, so the processes a rank starts follow it")
    seed: int = Field(42, description="seed of data order and initialisation (checkpoints keep every RNG state)")
    max_epochs: int = Field(1, ge=1, description="passes over the train data")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    train_batch_size: int = Field(32, ge=1, description="samples (pairs for RM/DPO) per optimizer step, global")
    micro_train_batch_size: int = Field(8, ge=1, description="samples per forward/backward per rank")
    eval_steps: int | None = Field(None, ge=1, description="evaluate every N steps (always at start and end)")
    packing_samples: bool = Field(False, description="pack the samples of a micro-batch into few rows")
    packing_max_tokens: int | None = Field(None, ge=2, description="tokens per packed row; default data.max_len")


class LossConfig(Section):
    """What every offline trainer's loss can add: a mixture-of-experts model's load-balancing loss
    (``hpc_rlhf.trainers.offline.moe_terms``)."""

    aux_loss_coef: float = Field(
        0.0, ge=0, description="weight of a mixture-of-experts model's router load-balancing loss (Switch "
        "Transformer; transformers' load_balancing_loss_func); > 0 needs an MoE model")


class SFTLossConfig(LossConfig):
    """SFT's loss is the token-mean NLL (plus the MoE load-balancing loss when asked)."""


class RMLossConfig(LossConfig):
    loss: Literal["sigmoid", "logexp"] = Field(
        "sigmoid",
        description="pairwise loss: sigmoid (-log sigmoid(r_chosen - r_rejected - margin)) or logexp (log(1 + "
        "exp(r_rejected - "
        "r_chosen)))")


class DPOLossConfig(LossConfig):
    beta: float = Field(0.1, gt=0, description="DPO temperature: weight of the log-ratio to the reference")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cDPO: assumed label-flip probability")
    ipo: bool = Field(False, description="IPO loss on length-averaged log-probabilities")
    nll_loss_coef: float = Field(0.0, ge=0, description="weight of the chosen responses' token-mean NLL")

    @model_validator(mode="after")
    def _ipo_without_smoothing(self) -> DPOLossConfig:
        if self.ipo and self.label_smoothing:
            raise ValueError("loss.label_smoothing (cDPO) does not apply with loss.ipo=true; set one of them")
        return self


class KTOLossConfig(LossConfig):
    beta: float = Field(0.1, gt=0, description="KTO temperature: weight of the log-ratio to the reference")
    desirable_weight: float = Field(1.0, gt=0, description="loss weight of desirable samples (lambda_D)")
    undesirable_weight: float = Field(1.0, gt=0, description="loss weight of undesirable samples (lambda_U)")
    kl_mode: Literal["mismatched", "batch_mean"] = Field(
        "mismatched", description="reference point from mismatched (x_i, y_i+1) pairs, or the batch's own ratios")


class SupervisedRunConfig(Section):
    model: ActorConfig = Field(default_factory=ActorConfig)
    ds: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    data: SupervisedDataConfig = Field(default_factory=SupervisedDataConfig)
    train: SupervisedTrainConfig = Field(default_factory=SupervisedTrainConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    loss: LossConfig = Field(default_factory=LossConfig)  # each trainer's run config narrows it to its loss's

    @model_validator(mode="after")
    def _batches(self) -> SupervisedRunConfig:
        if self.train.train_batch_size % self.train.micro_train_batch_size:
            raise ValueError(f"train.train_batch_size={self.train.train_batch_size} must be a multiple of "
                             f"train.micro_train_batch_size={self.train.micro_train_batch_size}")
        if not self.model.pretrain:
            raise ValueError("model.pretrain is required (a local HF folder; with model.build_tiny=true it is created)")
        if not self.data.train_data:
            raise ValueError("data.train_data is empty: give at least one file or save_to_disk folder")
        return self


class SFTRunConfig(SupervisedRunConfig):
    loss: SFTLossConfig = Field(default_factory=SFTLossConfig)


class RMRunConfig(SupervisedRunConfig):
    loss: RMLossConfig = Field(default_factory=RMLossConfig)


class ReferenceRunConfig(SupervisedRunConfig):
    """A run whose loss compares the policy with a frozen reference model (DPO, KTO)."""

    ref: RefConfig = Field(default_factory=RefConfig, description="pretrain defaults to model.pretrain")


class DPORunConfig(ReferenceRunConfig):
    loss: DPOLossConfig = Field(default_factory=DPOLossConfig)


class KTORunConfig(ReferenceRunConfig):
    loss: KTOLossConfig = Field(default_factory=KTOLossConfig)


CONFIG_CLASSES: dict[str, type[SupervisedRunConfig]] = {
    "sft": SFTRunConfig, "rm": RMRunConfig, "dpo": DPORunConfig, "kto": KTORunConfig,
}


def load_supervised_config(kind: str, path: str | Path | None = None,
                           overrides: Sequence[str] = ()) -> SupervisedRunConfig:
    """Config of an offline trainer (``kind`` in sft, rm, dpo, kto) from YAML + ``key=value`` overrides.

    Raises:
        ConfigError: naming the file and the dotted key at fault.
    """
    if kind not in CONFIG_CLASSES:
        raise ConfigError(f"unknown trainer kind {kind!r}; choose one of {sorted(CONFIG_CLASSES)}")
    return load_config(path, overrides, root=CONFIG_CLASSES[kind])
