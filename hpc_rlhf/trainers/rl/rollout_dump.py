"""Rollout dumps (``logger.dump_rollouts_every``): a step's samples as JSON lines, for debugging rewards and agents.

``<train.output_dir>/rollouts/step_<N>.jsonl``, one object per sample: prompt, response, label, reward, score,
policy version (and each token's, ``token_versions``, when generation spanned weight updates), truncation, the
reward's / agent's ``extra_logs`` and, for multi-turn agents, the turns.

Runs on rank 0 only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_rlhf.ckpt.atomic import atomic_write_text
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, decode_text

ROLLOUTS_DIR = "rollouts"


def is_dump_step(step: int, every: int | None) -> bool:
    return every is not None and step % every == 0


def turn_segments(response_ids: list[int], action_mask: list[int]) -> list[tuple[str, list[int]]]:
    """Split a response into maximal runs of model tokens (mask 1: ``"model"``) and environment feedback
    (mask 0: ``"environment"``), in order: one model run per agent turn, the feedback between them."""
    segments: list[tuple[str, list[int]]] = []
    for token, mask in zip(response_ids, action_mask, strict=True):
        who = "model" if mask else "environment"
        if segments and segments[-1][0] == who:
            segments[-1][1].append(token)
        else:
            segments.append((who, [token]))
    return segments


def rollout_records(trajectories: list[Any], tokenizer: Tokenizer, step: int) -> list[dict[str, Any]]:
    """One JSON-ready dict per trajectory. Texts are decoded without special tokens, as the reward function's
    ``responses`` are; ``turns`` is present only when the response holds environment feedback (agents)."""
    records = []
    for t in trajectories:
        record = {
            "step": step, "policy_version": t.policy_version, "group_index": t.group_index,
            "branch_index": t.branch_index, "prompt": t.prompt,
            "response": decode_text(tokenizer, t.response_ids, skip_special_tokens=True), "label": t.label,
            "reward": t.reward, "score": t.score, "response_length": len(t.response_ids), "truncated": t.truncated,
            "finish_reason": t.finish_reason, "extra_logs": t.extra_logs,
        }
        if t.failure is not None:
            record["failure"] = t.failure
        if getattr(t, "visual", None) is not None:  # a reference per image (path or content hash), never the pixels
            record["images"] = list(t.visual.refs)
        if t.token_versions is not None:  # generation spanned weight updates: the version of every response token
            record["token_versions"] = list(t.token_versions)
        segments = turn_segments(t.response_ids, t.action_mask)
        if any(who == "environment" for who, _ in segments):
            record["turns"] = [{"role": who, "text": decode_text(tokenizer, ids, skip_special_tokens=True)}
                               for who, ids in segments]
        records.append(record)
    return records


def write_rollouts(output_dir: str | Path, step: int, records: list[dict[str, Any]]) -> Path:
    """Write ``rollouts/step_<step>.jsonl`` atomically (a reader never sees half a file); returns its path."""
    path = Path(output_dir) / ROLLOUTS_DIR / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Labels may be any JSON-like object from the data file; anything else is written as its str().
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in records))
    return path
