"""Token-budgeted RL batches: which rows go to which data-parallel rank and which micro-batch.

Pure functions over row lengths (real tokens per sample); no process groups.

- :func:`balanced_order` reorders a batch so that the equal-row shards the controller sends to the
  data-parallel ranks (``split_rows``) carry about the same number of tokens, mini-batch by mini-batch
  (``train.use_dynamic_batch``). Mini-batch membership is kept, so the global loss counts stay exact.
- :func:`plan_micro_batches` cuts one rank's rows into micro-batches, either a fixed number of rows each
  or as many rows as fit a token budget (``train.max_tokens_per_gpu`` / ``rollout.max_tokens_per_gpu``).
- :func:`forward_row_layout` lays a batch out over the data-parallel ranks for an experience forward (equal
  rows each); :func:`first_positions` maps the gathered outputs back to the batch's rows.
- :func:`episode_minibatch_layout` lays out a batch whose agent episodes have several rows (branches):
  each mini-batch holds whole episodes (``train.train_batch_size`` of them), padded to a common row count.
- :func:`split_to_count` makes every data-parallel rank run the same number of micro-batches: ZeRO
  reduces gradients (and ZeRO-3 gathers parameters) collectively in every forward/backward, so ranks
  that ran fewer would hang the others.

The cost of a micro-batch is its real tokens when samples are packed into one row, and rows x longest
row when padded (what the forward actually computes).
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a forward over these rows computes: packed sum, or rows x longest when padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def balanced_order(lengths: Sequence[int], dp_size: int, rows_per_minibatch: int) -> list[int]:
    """A permutation of the batch rows that balances tokens over the data-parallel shards.

    The batch (``N = num_minibatches x dp_size x rows_per_minibatch`` rows) is consumed as
    ``split_rows(batch, dp_size)`` shards, each cut into mini-batches of ``rows_per_minibatch`` rows
    (``controller_steps.minibatch_counts``). Global mini-batch ``k`` is the ``k``-th contiguous chunk of
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


def plan_micro_batches(lengths: Sequence[int], *, micro_size: int | None = None, max_tokens: int | None = None,
                       packed: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch of one rank's rows.

    Fixed (``micro_size``): consecutive runs of ``micro_size`` rows. Token budget (``max_tokens``): first
    fit decreasing, so each micro-batch costs at most ``max_tokens`` (:func:`micro_batch_cost`); a row
    longer than the budget gets a micro-batch of its own (a budget never truncates). Exactly one of the
    two must be given.
    """
    if (micro_size is None) == (max_tokens is None):
        raise ValueError("give exactly one of micro_size and max_tokens")
    if micro_size is not None:
        return [list(range(i, min(i + micro_size, len(lengths)))) for i in range(0, len(lengths), micro_size)]
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
