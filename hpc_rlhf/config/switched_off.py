"""Keys whose effect depends on another key's value, and what happens when that other key switches them off.

Every config key is read by the package (``tests/unit/test_config_fields_are_read.py``); this is the next step of
that promise: a key that is *read* but has no effect because another key switched it off must not pass in
silence. Each :class:`SwitchedOff` rule names the dependent key, the key that gates it, and whether the
combination is refused (it can only be a mistake: ``algo.kl.use_loss=true`` with ``algo.kl.init_coef=0`` trains
without any KL term) or warned about (a leftover that changes nothing, e.g. ``algo.sapo_tau_pos`` under the ppo
loss). A rule fires only when the dependent key differs from its default, so recipes that spell out the
defaults stay quiet.

Refusals are raised by ``RunConfig``'s validation (a bad config fails at load, naming both keys); warnings are
logged at start-up (``hpc_rlhf.cli.startup``) and printed by ``hpc-rlhf plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True)
class SwitchedOff:
    """``key`` has no effect while ``gate(cfg)`` holds; ``gate_key`` is the key that switches it off."""

    key: str
    gate_key: str
    gate: Callable[[Any], bool]
    refuse: bool
    fix: str

    def message(self, cfg: Any) -> str:
        return (f"{self.key}={_value(cfg, self.key)!r} has no effect with "
                f"{self.gate_key}={_value(cfg, self.gate_key)!r}: {self.fix}")


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _differs_from_default(cfg: BaseModel, key: str) -> bool:
    *path, name = key.split(".")
    section: Any = cfg
    for part in path:
        section = getattr(section, part)
    field = type(section).model_fields[name]
    return bool(getattr(section, name) != field.get_default(call_default_factory=True))


def _kl_off(cfg: Any) -> bool:
    return bool(cfg.algo.kl.init_coef == 0)


_KL_FIX = "set algo.kl.init_coef > 0 (e.g. 0.001) to use a KL penalty, or drop the key"

RULES: tuple[SwitchedOff, ...] = (
    SwitchedOff("algo.kl.use_loss", "algo.kl.init_coef", _kl_off, True,
                "a KL loss term with coefficient 0 is no KL at all (no reference model is even loaded); "
                + _KL_FIX),
    SwitchedOff("algo.kl.target", "algo.kl.init_coef", _kl_off, True,
                "the adaptive controller scales its coefficient multiplicatively, so it stays 0; " + _KL_FIX),
    SwitchedOff("algo.kl.estimator", "algo.kl.init_coef", _kl_off, False, _KL_FIX),
    SwitchedOff("algo.kl.horizon", "algo.kl.target", lambda c: c.algo.kl.target is None, False,
                "the horizon belongs to the adaptive controller; set algo.kl.target, or drop the key"),
    SwitchedOff("algo.sapo_tau_pos", "algo.policy_loss_type", lambda c: c.algo.policy_loss_type != "sapo", False,
                "the gate temperatures belong to algo.policy_loss_type=sapo"),
    SwitchedOff("algo.sapo_tau_neg", "algo.policy_loss_type", lambda c: c.algo.policy_loss_type != "sapo", False,
                "the gate temperatures belong to algo.policy_loss_type=sapo"),
    SwitchedOff("algo.eps_clip_low", "algo.policy_loss_type", lambda c: c.algo.policy_loss_type == "sapo", False,
                "SAPO has no clip band (its trust region is algo.sapo_tau_pos / sapo_tau_neg)"),
    SwitchedOff("algo.eps_clip_high", "algo.policy_loss_type", lambda c: c.algo.policy_loss_type == "sapo", False,
                "SAPO has no clip band (its trust region is algo.sapo_tau_pos / sapo_tau_neg)"),
    SwitchedOff("algo.is_truncation", "algo.is_correction", lambda c: c.algo.is_correction == "none", False,
                "the band applies to an importance-sampling correction; set algo.is_correction (tis, icepop, "
                "seq_mask_tis)"),
    SwitchedOff("algo.dynamic_filtering_reward_range", "algo.dynamic_filtering",
                lambda c: not c.algo.dynamic_filtering, False, "set algo.dynamic_filtering=true to filter groups"),
    SwitchedOff("rollout.dynamic_filtering_max_rounds", "algo.dynamic_filtering",
                lambda c: not c.algo.dynamic_filtering, False, "set algo.dynamic_filtering=true to filter groups"),
    SwitchedOff("algo.overlong_penalty_factor", "algo.overlong_buffer_len",
                lambda c: c.algo.overlong_buffer_len is None, False,
                "the penalty applies over the last algo.overlong_buffer_len tokens; set it"),
    SwitchedOff("vllm.sleep_level", "vllm.enable_sleep", lambda c: not c.vllm.enable_sleep, False,
                "vLLM never sleeps; set vllm.enable_sleep=true"),
    SwitchedOff("logger.wandb_project", "logger.use_wandb", lambda c: not c.logger.use_wandb, False,
                "set logger.use_wandb=true to log to Weights & Biases"),
    SwitchedOff("logger.wandb_run_name", "logger.use_wandb", lambda c: not c.logger.use_wandb, False,
                "set logger.use_wandb=true to log to Weights & Biases"),
    SwitchedOff("train.partial_rollout", "train.async_train", lambda c: not c.train.async_train, True,
                "weight updates land during generation only in asynchronous training; set train.async_train=true"),
    *(SwitchedOff(f"train.{key}", "train.async_train", lambda c: not c.train.async_train, False,
                  "synchronous training generates each batch with the current weights; set train.async_train=true")
      for key in ("async_queue_size", "max_staleness", "staleness_policy")),
    SwitchedOff("rollout.partial_chunk_tokens", "train.partial_rollout", lambda c: not c.train.partial_rollout,
                False, "the chunk size belongs to train.partial_rollout=true"),
    *(SwitchedOff(f"eval.{key}", "eval.data", lambda c: not c.eval.data, False,
                  "nothing is evaluated without eval.data (held-out prompt files)")
      for key in ("steps", "n_samples_per_prompt", "temperature", "max_samples", "at_start", "pass_threshold")),
    SwitchedOff("ckpt.best_mode", "ckpt.best_metric", lambda c: c.ckpt.best_metric is None, False,
                "set ckpt.best_metric to keep the best checkpoint"),
    SwitchedOff("algo.distill_coef", "teacher.pretrain", lambda c: c.teacher.pretrain is None, False,
                "the distillation advantage needs a teacher; set teacher.pretrain"),
    *(SwitchedOff(f"ds.lora.{key}", "ds.lora.rank", lambda c: c.ds.lora.rank == 0, False,
                  "ds.lora.rank=0 trains no adapters; set ds.lora.rank > 0 (e.g. 16)")
      for key in ("alpha", "dropout", "target_modules")),
    *(SwitchedOff(f"train.{key}", "train.agent_func_path", lambda c: c.train.agent_func_path is None, False,
                  "single-turn rollouts run no agent; set train.agent_func_path")
      for key in ("agent_max_turns", "agent_step_timeout_s", "agent_episode_timeout_s", "agent_kwargs")),
)


def switched_off(cfg: BaseModel) -> list[SwitchedOff]:
    """The rules that fire for ``cfg`` (a ``RunConfig``): dependent key changed from its default, gate off."""
    return [rule for rule in RULES if _differs_from_default(cfg, rule.key) and rule.gate(cfg)]


def refuse_switched_off(cfg: BaseModel) -> None:
    """Raise ``ValueError`` naming both keys of every refused combination in ``cfg``."""
    refused = [rule.message(cfg) for rule in switched_off(cfg) if rule.refuse]
    if refused:
        raise ValueError("; ".join(refused))


def switched_off_warnings(cfg: BaseModel) -> list[str]:
    """One line per warned combination in ``cfg`` (keys that do nothing here)."""
    return [rule.message(cfg) for rule in switched_off(cfg) if not rule.refuse]


__all__ = ["RULES", "SwitchedOff", "refuse_switched_off", "switched_off", "switched_off_warnings"]
