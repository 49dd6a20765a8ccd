"""Which rows of the step batch go to which data-parallel replica, mini-batch and micro-batch.

Pure functions over row lengths (real tokens per row), episode indices and :class:`StepBatch` rows; no process
groups. The controller lays the batch out (rank 0); each replica cuts its rows into micro-batches.

Controller, experience forwards (old / ref log-probs, values, reward-model scores):

- :func:`forward_shards` deals the rows to the ``dp`` replicas in equal shards (:func:`forward_row_layout`:
  repeating the last row up to a multiple of ``dp``, and balancing tokens with ``train.use_dynamic_batch``);
  :func:`in_batch_order` puts the gathered outputs back in row order (:func:`first_positions`).

Controller, training (:func:`train_shards`):

- :func:`episode_layout` (:func:`episode_minibatch_layout`): ``train.train_batch_size`` counts episodes, so each
  mini-batch holds whole episodes, padded to a common row count with masked copies of its own rows;
- :func:`balanced_rows` (:func:`balanced_order`): with ``train.use_dynamic_batch``, each mini-batch's rows are
  dealt to the replicas to balance tokens (mini-batch membership kept, so the global loss counts stay exact);
- :func:`minibatch_counts`: the global token and row counts of each mini-batch, which every replica receives.

Each replica (``workers``):

- :class:`Batching` / :func:`plan_micro_batches` cut its rows into micro-batches, either a fixed number of rows
  each or as many rows as fit a token budget (``train.max_tokens_per_gpu`` / ``rollout.max_tokens_per_gpu``);
- :func:`split_to_count` makes every replica run the same number of micro-batches: ZeRO reduces gradients (and
  ZeRO-3 gathers parameters) collectively in every forward/backward, so replicas that ran fewer would hang the
  others.

The cost of a micro-batch is its real tokens when samples are packed into one row, and rows x longest
row when padded (what the forward actually computes).

Runs on rank 0 (dealing rows to replicas and mini-batches) and on each role's ranks (micro-batch plans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hpc_rlhf.algos import count_tokens_and_seqs
from hpc_rlhf.config.rollout import RolloutConfig
from hpc_rlhf.config.schema import DeepSpeedConfig, TrainConfig
from hpc_rlhf.trainers.rl.step_batch import StepBatch, TrainShard

# ---------------------------------------------------------------------------------------------- row orders


def micro_batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a forward over these rows computes: packed sum, or rows x longest when padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def balanced_order(lengths: Sequence[int], dp_size: int, rows_per_minibatch: int) -> list[int]:
    """A permutation of the batch rows that balances tokens over the data-parallel shards.

    The batch (``N = num_minibatches x dp_size x rows_per_minibatch`` rows) is consumed as
    ``split_rows(dp_size)`` shards, each cut into mini-batches of ``rows_per_minibatch`` rows
    (:func:`minibatch_counts`). Global mini-batch ``k`` is the ``k``-th contiguous chunk of
    ``dp_size x rows_per_minibatch`` rows of the ORIGINAL order; its rows are dealt to the ranks
    longest first, each to the rank with the fewest tokens that still has room (LPT with equal
    cardinality), and ``order[i]`` is the original row placed at position ``i``.
    """
    per_mb = dp_size * rows_per_minibatch
    if len(lengths) % per_mb:
        raise ValueError(f"{len(lengths)} rows do not split into mini-batches of {dp_size} ranks x "
                         f"{rows_per_minibatch} rows")
    num_mb = len(lengths) // per_mb
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for k in range(num_mb):
        rows = range(k * per_mb, (k + 1) * per_mb)
        assigned: list[list[int]] = [[] for _ in range(dp_size)]
        tokens = [0] * dp_size
        for row in sorted(rows, key=lambda r: (-lengths[r], r)):
            rank = min((d for d in range(dp_size) if len(assigned[d]) < rows_per_minibatch),
                       key=lambda d: (tokens[d], d))
            assigned[rank].append(row)
            tokens[rank] += lengths[row]
        for d in range(dp_size):
            shards[d].extend(sorted(assigned[d]))
    return [row for shard in shards for row in shard]


def forward_row_layout(num_rows: int, dp_size: int, lengths: Sequence[int] | None = None) -> list[int]:
    """The batch rows, in the order an experience forward's ``dp_size`` equal shards take them.

    Agent episodes with several rows make any row count possible, so the last row is repeated up to a multiple
    of ``dp_size`` (its extra outputs are dropped by :func:`first_positions`). With ``lengths`` (real tokens per
    row, ``train.use_dynamic_batch``) the rows are dealt by :func:`balanced_order` as one mini-batch.
    """
    rows = list(range(num_rows)) + [num_rows - 1] * (-num_rows % dp_size)
    if lengths is None or dp_size == 1:
        return rows
    order = balanced_order([lengths[r] for r in rows], dp_size, len(rows) // dp_size)
    return [rows[i] for i in order]


def first_positions(layout: Sequence[int], num_rows: int) -> list[int]:
    """For each row ``0 .. num_rows-1``, its first position in ``layout``: taking these from outputs computed in
    layout order gives them back in row order, each once."""
    first: dict[int, int] = {}
    for position, row in enumerate(layout):
        first.setdefault(row, position)
    return [first[row] for row in range(num_rows)]


def episode_minibatch_layout(episode_index: Sequence[int], episodes_per_minibatch: int,
                             dp_size: int) -> tuple[list[int], list[bool], int]:
    """Row order of a training batch whose episodes may have several rows.

    ``train.train_batch_size`` counts episodes: mini-batch ``k`` is every row of episodes
    ``[k*T, (k+1)*T)`` (``T = episodes_per_minibatch``), so the optimizer steps per rollout step do not
    depend on how an agent branched. Mini-batches then hold different numbers of rows, while the
    controller's layout (``split_rows`` into ``dp_size`` shards, each cut into equal mini-batches) needs one
    count ``M`` of rows per rank per mini-batch: each mini-batch is padded to ``dp_size x M`` rows
    (``M = ceil(largest mini-batch / dp_size)``) by repeating its own rows, flagged in ``is_padding``; the
    caller clears their action mask, so they add no loss and no token or sequence counts.

    Args:
        episode_index: (B,) episode of each row, rows of an episode consecutive, episodes ``0 .. E-1``.
        episodes_per_minibatch: T; E must be a multiple of it.
        dp_size: data-parallel ranks.
    Returns:
        ``(order, is_padding, M)``: position ``i`` of the laid-out batch is original row ``order[i]``
        (``len(order) = E / T x dp_size x M``), in mini-batch order. With one row per episode and ``T`` a
        multiple of ``dp_size`` it is the identity without padding.
    """
    num_episodes = (max(episode_index) + 1) if len(episode_index) else 0
    if num_episodes % episodes_per_minibatch:
        raise ValueError(f"{num_episodes} episodes do not split into mini-batches of {episodes_per_minibatch}")
    minibatches: list[list[int]] = [[] for _ in range(num_episodes // episodes_per_minibatch)]
    for row, episode in enumerate(episode_index):
        minibatches[episode // episodes_per_minibatch].append(row)
    rows_per_rank = max((-(-len(rows) // dp_size) for rows in minibatches), default=0)
    order: list[int] = []
    is_padding: list[bool] = []
    for rows in minibatches:
        padding = dp_size * rows_per_rank - len(rows)
        order += rows + [rows[i % len(rows)] for i in range(padding)]
        is_padding += [False] * len(rows) + [True] * padding
    return order, is_padding, rows_per_rank


# ---------------------------------------------------------------------------------------------- micro-batches


def plan_micro_batches(lengths: Sequence[int], *, micro_size: int | None = None, max_tokens: int | None = None,
                       packed: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch of one rank's rows.

    Fixed (``micro_size``): consecutive runs of ``micro_size`` rows. Token budget (``max_tokens``): first
    fit decreasing, so each micro-batch costs at most ``max_tokens`` (:func:`micro_batch_cost`); a row
    longer than the budget gets a micro-batch of its own (a budget never truncates). Exactly one of the
    two must be given.
    """
    if micro_size is not None and max_tokens is None:
        return [list(range(i, min(i + micro_size, len(lengths)))) for i in range(0, len(lengths), micro_size)]
    if micro_size is not None or max_tokens is None:
        raise ValueError("give exactly one of micro_size and max_tokens")
    bins: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        for rows in bins:
            if micro_batch_cost([lengths[r] for r in rows] + [lengths[row]], packed) <= max_tokens:
                rows.append(row)
                break
        else:
            bins.append([row])
    return [sorted(rows) for rows in bins]


def split_to_count(plan: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split the costliest multi-row micro-batches in two until there are ``count`` of them.

    ``count`` is the largest number of micro-batches any data-parallel rank planned; it never exceeds
    the rows a rank holds (every rank holds as many rows, and a micro-batch has at least one).
    """
    plan = [list(rows) for rows in plan]
    while len(plan) < count:
        splittable = [i for i, rows in enumerate(plan) if len(rows) > 1]
        if not splittable:
            raise ValueError(f"cannot make {count} micro-batches out of {sum(map(len, plan))} rows")
        i = max(splittable, key=lambda j: (sum(lengths[r] for r in plan[j]), -j))
        rows = plan.pop(i)
        half = len(rows) // 2
        plan[i:i] = [rows[:half], rows[half:]]
    return plan


def _token_budget(max_tokens_per_gpu: int | None) -> int:
    if max_tokens_per_gpu is None:  # the config refuses this; here for a Batching built by hand
        raise ValueError("train.use_dynamic_batch=true needs train.max_tokens_per_gpu")
    return max_tokens_per_gpu


@dataclass(frozen=True)
class Batching:
    """How one rank cuts its rows into micro-batches: ``micro_size`` rows each, or as many as fit
    ``max_tokens`` (``train.use_dynamic_batch``); ``packed`` forwards one packed row per micro-batch."""

    packed: bool = False
    micro_size: int | None = 1
    max_tokens: int | None = None

    @classmethod
    def for_training(cls, train: TrainConfig, ds: DeepSpeedConfig) -> Batching:
        if train.use_dynamic_batch:
            # The budget is per GPU; ring attention spreads one micro-batch over ds.ring_attn_size GPUs.
            return cls(train.packing_samples, None, _token_budget(train.max_tokens_per_gpu) * ds.ring_attn_size)
        return cls(train.packing_samples, train.micro_train_batch_size, None)

    @classmethod
    def for_experience(cls, train: TrainConfig, rollout: RolloutConfig, ds: DeepSpeedConfig) -> Batching:
        if train.use_dynamic_batch:
            budget = _token_budget(rollout.max_tokens_per_gpu or train.max_tokens_per_gpu)
            return cls(train.packing_samples, None, budget * ds.ring_attn_size)
        return cls(train.packing_samples, rollout.micro_rollout_batch_size, None)

    @property
    def token_budgeted(self) -> bool:
        """Plans differ between ranks (and must be evened out with :func:`split_to_count`)."""
        return self.max_tokens is not None

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Row indices of each micro-batch of rows with these real-token ``lengths`` (this rank's plan)."""
        return plan_micro_batches(lengths, micro_size=self.micro_size, max_tokens=self.max_tokens,
                                  packed=self.packed)


# ------------------------------------------------------------------------------------ the controller's layouts


def forward_shards(batch: StepBatch, dp_size: int, balance_tokens: bool,
                   fields: tuple[str, ...] = ()) -> tuple[list[StepBatch], list[int]]:
    """The forward fields of ``batch`` (and ``fields``) in ``dp_size`` equal shards for an experience forward, and
    the row layout they follow (:func:`forward_row_layout`; ``balance_tokens``: ``train.use_dynamic_batch``)."""
    view = batch.select(*fields)
    lengths = view.attention_mask.sum(dim=1).tolist() if balance_tokens else None
    layout = forward_row_layout(view.num_rows, dp_size, lengths)
    laid_out = view if layout == list(range(view.num_rows)) else view.take_rows(layout)
    return laid_out.split_rows(dp_size), layout


def in_batch_order(outputs: Sequence[torch.Tensor], layout: list[int], num_rows: int) -> torch.Tensor:
    """The shards' outputs (each (b, ...), in shard order) -> (num_rows, ...) in the batch's row order."""
    out = torch.cat(list(outputs))
    if layout == list(range(num_rows)):
        return out
    return out[torch.as_tensor(first_positions(layout, num_rows), dtype=torch.long)]


def episode_layout(view: StepBatch, episode_index: torch.Tensor, train_batch_size: int,
                   dp_size: int) -> tuple[StepBatch, int, bool]:
    """The training view laid out as whole episodes per mini-batch (:func:`episode_minibatch_layout`):
    ``train_batch_size`` episodes per optimizer step, padded with copies of their own rows whose action mask is
    cleared. Returns ``(view, rows per rank per mini-batch, regrouped)``. Unchanged (``regrouped`` False) with
    one row per episode; else mini-batch ``k`` is the ``k``-th contiguous chunk of ``dp_size x M`` rows, which
    :func:`balanced_rows` deals to the ranks before ``split_rows``."""
    order, is_padding, rows_per_rank = episode_minibatch_layout(episode_index.tolist(), train_batch_size, dp_size)
    if order == list(range(episode_index.shape[0])):
        return view, rows_per_rank, False
    view = view.take_rows(order)
    view = replace(view, action_mask=view.action_mask & ~torch.tensor(is_padding).unsqueeze(1))
    return view, rows_per_rank, True


def balanced_rows(view: StepBatch, dp_size: int, rows_per_minibatch: int, balance_tokens: bool,
                  contiguous_minibatches: bool = False) -> StepBatch:
    """With ``balance_tokens`` (``train.use_dynamic_batch``), ``view`` reordered to balance tokens over the dp
    shards. With ``contiguous_minibatches`` (:func:`episode_layout` regrouped the rows) the mini-batches are dealt
    to the shards in any case (equal rows each), so that every shard's ``k``-th chunk belongs to mini-batch ``k``."""
    if dp_size == 1 or not (balance_tokens or contiguous_minibatches):
        return view
    lengths = view.attention_mask.sum(dim=1).tolist() if balance_tokens else [1] * view.num_rows
    return view.take_rows(balanced_order(lengths, dp_size, rows_per_minibatch))


def minibatch_counts(action_mask: torch.Tensor, dp_size: int, rows_per_minibatch: int) -> dict[str, list[int]]:
    """Global action-token and row counts of each mini-batch.

    The batch is cut into ``dp_size`` contiguous shards; mini-batch ``i`` is rows
    ``[i*m, (i+1)*m)`` of every shard. These counts normalise the loss exactly (``aggregate_loss``).
    """
    rows = action_mask.shape[0]
    shard = rows // dp_size
    num_tokens, num_seqs = [], []
    for i in range(shard // rows_per_minibatch):
        picked = torch.cat([action_mask[d * shard + i * rows_per_minibatch : d * shard + (i + 1) * rows_per_minibatch]
                            for d in range(dp_size)])
        tokens, seqs = count_tokens_and_seqs(picked)
        num_tokens.append(int(tokens))
        num_seqs.append(int(seqs))
    return {"num_tokens": num_tokens, "num_seqs": num_seqs}


def train_shards(view: StepBatch, episode_index: torch.Tensor, train_batch_size: int, dp_size: int,
                 balance_tokens: bool, kl_coef: float = 0.0) -> list[TrainShard]:
    """The rows of ``view`` (what a training role reads, :meth:`StepBatch.select`) as ``dp_size`` shards of whole
    mini-batches: ``train_batch_size`` episodes each (``episode_index`` (B,) of the full batch), tokens balanced
    over the shards with ``balance_tokens``, and every shard holding the global counts of each mini-batch."""
    view, rows_per_rank, regrouped = episode_layout(view, episode_index, train_batch_size, dp_size)
    view = balanced_rows(view, dp_size, rows_per_rank, balance_tokens, regrouped)
    counts = minibatch_counts(view.action_mask, dp_size, rows_per_rank)
    return TrainShard(view, rows_per_rank, counts["num_tokens"], counts["num_seqs"], kl_coef).split(dp_size)
