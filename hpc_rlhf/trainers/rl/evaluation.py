"""Held-out evaluation during RL: which prompts, when, and what is reported (``eval.*`` keys).

The loop generates the eval samples through the training rollout engines and agent executor and scores them
with the training reward source; this module holds the parts that need no process group: loading the eval
prompts, the eval schedule, the sampling parameters, and the per-source metrics (mean@n, pass@k).

Runs on rank 0 (prompts, grouping, metrics), except :func:`eval_sampling`, which each rollout rank calls for
its engine.
"""

from __future__ import annotations

from collections import defaultdict

from hpc_rlhf.algos.pass_at_k import pass_at_k, powers_of_two_up_to
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.data.prompts import Prompt, PromptDataset, source_name
from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.rollout.base import SamplingParams, Trajectory

ALL_SOURCES = "all"


def load_eval_prompts(cfg: RunConfig, tokenizer: Tokenizer) -> list[Prompt]:
    """The prompts of every ``eval.data`` entry (at most ``eval.max_samples`` from each), with the training data's
    keys and templates; the training prompt stream is not touched."""
    prompts: list[Prompt] = []
    for path in cfg.eval.data:
        data = cfg.data
        prompts.extend(PromptDataset([path], input_key=data.input_key, label_key=data.label_key,
                                     input_template=data.input_template,
                                     apply_chat_template=data.apply_chat_template, tokenizer=tokenizer,
                                     max_samples=cfg.eval.max_samples, skip_bad_rows=data.skip_bad_rows,
                                     images_key=data.images_key))
    names = {source_name(p) for p in prompts}
    if ALL_SOURCES in names:
        raise ValueError(f"eval.data: a data source is named {ALL_SOURCES!r}, which is the name of the overall "
                         "metrics; rename the file or its data_source values")
    return prompts


def is_eval_step(step: int, num_steps: int, every: int | None) -> bool:
    """Every ``eval.steps``-th step and the last one."""
    return step == num_steps or (every is not None and step % every == 0)


def eval_sampling(cfg: RunConfig, stop_token_ids: list[int], engine_index: int) -> SamplingParams:
    """Training's length and truncation settings with ``eval.temperature``; the seed is the same at every eval
    (only the weights change between two evals) and never the training's."""
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.generate_max_len, temperature=cfg.eval.temperature, top_p=r.top_p,
                          top_k=r.top_k, stop_token_ids=list(stop_token_ids),
                          seed=(cfg.train.seed + 1) * 7_919 + engine_index)


def group_by_prompt(shares: list[list[Prompt]], gathered: list[tuple[list[Trajectory], float]],
                    ) -> tuple[list[list[Trajectory]], list[Trajectory]]:
    """Each engine's eval samples back to their prompts: ``(per prompt, every row)``.

    ``shares``: the prompts each engine got, in engine order; ``gathered``: each engine's (trajectories, seconds).
    Executors number a share's prompts from 0 (``group_index``); an episode counts once (its first row,
    ``branch_index`` 0: pass@k counts episodes, and an episode's rows share its reward)."""
    per_prompt: list[list[Trajectory]] = [[] for share in shares for _ in share]
    rows: list[Trajectory] = []
    offset = 0
    for share, (part, _) in zip(shares, gathered, strict=True):
        for t in part:
            if t.branch_index == 0:
                per_prompt[offset + t.group_index].append(t)
        rows.extend(part)
        offset += len(share)
    return per_prompt, rows


def eval_metrics(samples: list[tuple[str, list[Trajectory]]], n: int, pass_threshold: float) -> dict[str, float]:
    """Per-source and overall metrics of one evaluation.

    ``samples``: one ``(source, trajectories)`` per prompt, ``n`` scored trajectories each. Returns
    ``eval/<source>/mean@n`` (mean score), ``eval/<source>/pass@k`` for k = 1, 2, 4, ... <= n (the unbiased
    estimator averaged over prompts; correct: score >= ``pass_threshold``), ``response_length`` (tokens),
    ``truncated_fraction`` and ``num_prompts``; ``<source>`` = ``all`` pools every prompt.
    """
    by_source: dict[str, list[list[Trajectory]]] = defaultdict(list)
    for source, group in samples:
        if len(group) != n:
            raise ValueError(f"eval: a prompt of data source {source!r} has {len(group)} samples, expected "
                             f"eval.n_samples_per_prompt={n}")
        by_source[source].append(group)
        by_source[ALL_SOURCES].append(group)
    row: dict[str, float] = {}
    for source, groups in sorted(by_source.items()):
        flat = [t for g in groups for t in g]
        scores = [_score(t) for t in flat]
        prefix = f"eval/{source}/"
        row[f"{prefix}mean@{n}"] = sum(scores) / len(scores)
        for k in powers_of_two_up_to(n):
            row[f"{prefix}pass@{k}"] = sum(pass_at_k(n, sum(_score(t) >= pass_threshold for t in g), k)
                                           for g in groups) / len(groups)
        row[f"{prefix}response_length"] = sum(len(t.response_ids) for t in flat) / len(flat)
        row[f"{prefix}truncated_fraction"] = sum(bool(t.truncated) for t in flat) / len(flat)
        row[f"{prefix}num_prompts"] = float(len(groups))
    return row


def _score(trajectory: Trajectory) -> float:
    score = trajectory.score if trajectory.score is not None else trajectory.reward
    if score is None:
        raise ValueError(f"eval: a sample of group {trajectory.group_index} has no reward (the reward source set "
                         "none)")
    return float(score)
