"""What the controller watches in each step's rollouts: agent failures (the run stops past a limit), episodes
cut by ``data.max_len`` (a warning), and the ``extra_logs`` of reward functions and agents (metrics).

Rank 0 only; the trainer shares the stop decision with every rank. Everything here counts episodes: an
episode with several rows (a branching OpenAI-client agent, ``Trajectory.branch_index``) counts once.

Runs on rank 0 only.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any

from hpc_rlhf.rollout.base import Trajectory

log = logging.getLogger(__name__)

# Per-episode numbers the multi-turn and OpenAI-agent executors themselves write into ``extra_logs``
# (logged under ``agent/``).
EXECUTOR_LOGS = ("num_turns", "agent_error", "agent_timeout", "num_calls", "num_branches")
# Seconds an episode spent in a tool (e.g. ``timing/tools/code_interpreter`` from the code interpreter's ``stats()``):
# logged under that name beside the step's phase timings, SUMMED over the step's episodes (the tool time the step
# paid for; with episodes running concurrently it can exceed the step's wall time). Other ``timing/`` names stay
# under ``extra/`` so that no agent can overwrite a phase timing of the step.
TOOL_TIMING_PREFIX = "timing/tools/"
_PROMPT_CHARS = 500


class AgentFailureLimitError(RuntimeError):
    """Too many agent episodes failed over the window (``train.max_agent_failure_fraction``)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def first_rows(trajectories: list[Trajectory]) -> list[Trajectory]:
    """One row per episode: its first (``branch_index`` 0); the rows of an episode share its ``extra_logs``."""
    return [t for t in trajectories if t.branch_index == 0]


def extra_log_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Episode means of every numeric ``extra_logs`` name: the executor's counts as ``agent/<name>``, the reward
    function's and agent's own as ``extra/<name>`` (so they can never overwrite a core metric), tool seconds
    (``timing/tools/<tool>``) as step sums under their own name, plus the fractions of episodes ended by error,
    timeout and length, and the training rows per episode."""
    rows = len(trajectories)
    trajectories = first_rows(trajectories)
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for t in trajectories:
        for name, value in t.extra_logs.items():
            if _is_number(value):
                if name in EXECUTOR_LOGS:
                    key = f"agent/{name}"
                elif name.startswith(TOOL_TIMING_PREFIX):
                    key = name
                else:
                    key = f"extra/{name}"
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] += 1
    row = {key: total if key.startswith(TOOL_TIMING_PREFIX) else total / counts[key] for key, total in sums.items()}
    if trajectories and any(t.failure is not None or "num_turns" in t.extra_logs for t in trajectories):
        n = len(trajectories)
        row["agent/error_fraction"] = sum(t.finish_reason == "agent_error" for t in trajectories) / n
        row["agent/timeout_fraction"] = sum(t.finish_reason == "agent_timeout" for t in trajectories) / n
        row["agent/max_len_fraction"] = sum(t.finish_reason == "max_len" for t in trajectories) / n
        row["agent/max_turns_fraction"] = sum(t.finish_reason == "max_turns" for t in trajectories) / n
        row["agent/rows_per_episode"] = rows / n
    return row


class RolloutHealth:
    """Failure window and truncation warnings over the steps' trajectories (see the module docstring)."""

    def __init__(self, max_failure_fraction: float, window_steps: int, max_len: int | None) -> None:
        self.max_failure_fraction = max_failure_fraction
        self.window: deque[tuple[int, int, Counter[str], dict[str, str]]] = deque(maxlen=window_steps)
        self.max_len = max_len
        self.worst_truncation = 0.0

    def observe(self, trajectories: list[Trajectory], step: int) -> None:
        trajectories = first_rows(trajectories)
        failures: Counter[str] = Counter()
        example: dict[str, str] = {}
        for t in trajectories:
            if t.failure is not None:
                failures[t.failure] += 1
                example.setdefault(t.failure, t.prompt)
        self.window.append((sum(failures.values()), len(trajectories), failures, example))
        self._warn_truncation(trajectories, step)

    def _warn_truncation(self, trajectories: list[Trajectory], step: int) -> None:
        cut = sum(t.finish_reason == "max_len" for t in trajectories)
        fraction = cut / max(len(trajectories), 1)
        if fraction > self.worst_truncation:  # warn the first time, then only when it gets worse
            self.worst_truncation = fraction
            log.warning(
                "step %d: %d of %d episodes (%.0f%%) were cut at data.max_len=%s (response or environment feedback "
                "did not fit); they end with the reward of their last step. Raise data.max_len or shorten the "
                "feedback (metric agent/max_len_fraction)", step, cut, len(trajectories), 100 * fraction,
                self.max_len)

    def verdict(self) -> str | None:
        """The error message when the window is full and its failure fraction is over the limit, else None."""
        if len(self.window) < (self.window.maxlen or 0):
            return None
        failed = sum(f for f, _, _, _ in self.window)
        total = sum(n for _, n, _, _ in self.window)
        if total == 0 or failed / total <= self.max_failure_fraction:
            return None
        causes: Counter[str] = Counter()
        examples: dict[str, str] = {}
        for _, _, counter, example in self.window:
            causes.update(counter)
            for cause, prompt in example.items():
                examples.setdefault(cause, prompt)
        cause, count = causes.most_common(1)[0]
        prompt = examples[cause]
        if len(prompt) > _PROMPT_CHARS:
            prompt = prompt[:_PROMPT_CHARS] + f"... [{len(prompt) - _PROMPT_CHARS} more chars]"
        return (f"{failed} of {total} agent episodes ({100 * failed / total:.0f}%) failed over the last "
                f"{len(self.window)} steps, more than train.max_agent_failure_fraction="
                f"{self.max_failure_fraction} (window train.agent_failure_window_steps={self.window.maxlen}); "
                f"the run learns nothing from them, so it stops. Most common failure ({count}x): {cause}\n"
                f"sample prompt:\n{prompt}\nFix the agent file (train.agent_func_path); the first traceback of "
                "each rollout is in the log above")
