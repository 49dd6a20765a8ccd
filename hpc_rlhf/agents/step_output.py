"""Check and normalise what a user's ``AgentInstance`` returns (OpenRLHF's step-output dict): numbers, feedback,
extra logs, per-step sampling overrides. Errors name the field and say what was expected."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hpc_rlhf.rollout.base import SamplingParams

_SAMPLING_ALIASES = {"max_tokens": "max_new_tokens"}  # vLLM's names
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class AgentOutputError(ValueError):
    """An agent's ``reset`` / ``step`` returned something the executor cannot use."""


def numeric_logs(extra_logs: dict) -> dict:
    logs = {}
    for name, value in extra_logs.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        logs[name] = float(value) if isinstance(value, (bool, int, float)) else value
    return logs


def to_float(value: Any, name: str) -> float:
    if hasattr(value, "numel") and value.numel() != 1:
        raise AgentOutputError(f"step output {name!r} must be one number, got a tensor of shape {tuple(value.shape)}")
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentOutputError(f"step output {name!r} must be a number or a 1-element tensor, got {value!r:.100}")
    value = float(value)
    if not math.isfinite(value):
        raise AgentOutputError(f"step output {name!r} is {value}")
    return value


def parse_step_output(output: Any) -> dict[str, Any]:
    if not isinstance(output, dict):
        raise AgentOutputError(f"step must return a dict, got {type(output).__name__}")
    missing = [key for key in ("rewards", "done") if key not in output]
    if missing:
        raise AgentOutputError(f"step output lacks {missing} (has keys {sorted(output)})")
    feedback = output.get("environment_feedback") or ""
    if not isinstance(feedback, str):
        raise AgentOutputError(f"step output 'environment_feedback' must be a str, got {type(feedback).__name__}")
    extra_logs = output.get("extra_logs") or {}
    if not isinstance(extra_logs, dict):
        raise AgentOutputError(f"step output 'extra_logs' must be a dict, got {type(extra_logs).__name__}")
    logs = numeric_logs(extra_logs)
    scores = output.get("scores")
    images = output.get("environment_images")  # screenshots for the next turn (hpc_rlhf.agents.images)
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    return {
        "rewards": to_float(output["rewards"], "rewards"),
        "scores": None if scores is None else to_float(scores, "scores"),
        "done": bool(output["done"]),
        "environment_feedback": feedback,
        "environment_images": list(images or []),
        "sampling_params": output.get("sampling_params"),
        "extra_logs": logs,
    }


def apply_sampling(current: SamplingParams, overrides: Any) -> SamplingParams:
    """The episode's sampling parameters after a step's ``sampling_params`` (a dict of overrides)."""
    if overrides is None:
        return current
    if isinstance(overrides, SamplingParams):
        return overrides
    if not isinstance(overrides, dict):
        raise AgentOutputError(f"step output 'sampling_params' must be a dict of overrides or SamplingParams, "
                               f"got {type(overrides).__name__}")
    if not all(isinstance(key, str) for key in overrides):
        raise AgentOutputError("step output 'sampling_params' keys must be strings, got "
                               f"{sorted(map(repr, overrides))}")
    named: dict[str, Any] = overrides  # keys checked above
    changes = {_SAMPLING_ALIASES.get(key, key): value for key, value in named.items()}
    unknown = sorted(set(changes) - _SAMPLING_FIELDS)
    if unknown:
        raise AgentOutputError(f"step output 'sampling_params' has unknown keys {unknown}; "
                               f"known: {sorted(_SAMPLING_FIELDS | set(_SAMPLING_ALIASES))}")
    return dataclasses.replace(current, **changes)
