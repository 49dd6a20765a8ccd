"""Loss aggregation: hand values and exactness under micro-batching and simulated dp ranks."""

import pytest
import torch

from hpc_rlhf.algos import AGGREGATION_MODES, aggregate_loss, count_tokens_and_seqs

NAN = float("nan")
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, float("inf")], [NAN, NAN, NAN]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode,expected", [
    ("token_mean", 10 / 4),
    ("seq_mean_token_mean", (2 + 4) / 2),
    ("seq_mean_token_sum", (6 + 4) / 2),
    ("seq_mean_token_sum_norm", 10 / (2 * 4)),
])
def test_aggregate_loss_by_hand(mode, expected):
    got = aggregate_loss(LOSS, MASK, mode, max_tokens=4)
    assert got.item() == pytest.approx(expected)


def test_count_tokens_and_seqs_ignores_padding_rows():
    num_tokens, num_seqs = count_tokens_and_seqs(MASK)
    assert (num_tokens.item(), num_seqs.item()) == (4, 2)


def test_global_count_and_dp_size_scale_the_local_sum():
    got = aggregate_loss(LOSS, MASK, "token_mean", global_num_tokens=20, dp_size=4)
    assert got.item() == pytest.approx(10 * 4 / 20)
    got = aggregate_loss(
        LOSS, MASK, "seq_mean_token_mean", global_num_seqs=torch.tensor(6), dp_size=3
    )
    assert got.item() == pytest.approx(6 * 3 / 6)


def test_missing_global_count_with_dp_fails_loudly():
    with pytest.raises(ValueError, match="global"):
        aggregate_loss(LOSS, MASK, "token_mean", dp_size=2)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate_loss(LOSS, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate_loss(LOSS, MASK, "mean")


def test_all_padding_batch_gives_zero_not_nan():
    got = aggregate_loss(torch.full((2, 3), NAN), torch.zeros(2, 3, dtype=torch.bool))
    assert got.item() == 0.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_masked_inputs_get_zero_gradient_even_if_nan(mode):
    loss_in = LOSS.clone().requires_grad_(True)
    aggregate_loss(loss_in, MASK, mode, max_tokens=4).backward()
    assert torch.isfinite(loss_in.grad).all()
    assert (loss_in.grad[~MASK] == 0).all()
    assert (loss_in.grad[MASK] > 0).all()


def make_problem(seed):
    """A tiny model: per-token loss depends on a shared weight vector, masks of varied length."""
    g = torch.Generator().manual_seed(seed)
    num_rows, num_positions, dim = 12, 7, 3
    features = torch.randn(num_rows, num_positions, dim, generator=g)
    lengths = torch.randint(0, num_positions + 1, (num_rows,), generator=g)
    lengths[3] = 0  # a padding row
    mask = torch.arange(num_positions).unsqueeze(0) < lengths.unsqueeze(1)
    # Finite garbage outside the mask. (NaN there would poison the weight gradient
    # upstream of aggregate_loss, through the caller's own model, not through it.)
    features = torch.where(mask.unsqueeze(-1), features, 1e3)
    weight = torch.randn(dim, generator=g)
    return features, mask, weight


def per_token_loss(features, weight):
    return torch.sin(features @ weight) + (features @ weight) ** 2


def full_batch_reference(features, mask, weight, mode, max_tokens):
    """Independent definition of each mode as a plain mean over the whole batch."""
    w = weight.clone().requires_grad_(True)
    rows = []
    for i in range(features.shape[0]):
        n = int(mask[i].sum())
        if n:
            rows.append(per_token_loss(features[i, :n], w))
    if mode == "token_mean":
        loss = torch.cat(rows).mean()
    elif mode == "seq_mean_token_mean":
        loss = torch.stack([r.mean() for r in rows]).mean()
    elif mode == "seq_mean_token_sum":
        loss = torch.stack([r.sum() for r in rows]).mean()
    else:
        loss = torch.stack([r.sum() for r in rows]).sum() / (len(rows) * max_tokens)
    loss.backward()
    return loss.detach(), w.grad


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("rank_rows", [
    [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]],           # 1 rank
    [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]],        # 2 ranks, even
    [[0, 5, 9], [1, 2, 3, 4, 6], [7, 8, 10, 11]],      # 3 ranks, uneven, shuffled
])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 5])
def test_sharded_loss_and_grads_equal_full_batch(mode, rank_rows, micro_batch_size):
    features, mask, weight = make_problem(seed=len(rank_rows) + micro_batch_size)
    max_tokens = 8
    expected_loss, expected_grad = full_batch_reference(features, mask, weight, mode, max_tokens)

    dp_size = len(rank_rows)
    # Step 1 of the contract: global counts summed over every shard (a dp all-reduce).
    counts = [count_tokens_and_seqs(mask[rows]) for rows in rank_rows]
    global_num_tokens = sum(c[0] for c in counts)
    global_num_seqs = sum(c[1] for c in counts)

    rank_grads, rank_losses = [], []
    for rows in rank_rows:
        w = weight.clone().requires_grad_(True)
        accumulated = torch.zeros(())
        for start in range(0, len(rows), micro_batch_size):
            micro = rows[start:start + micro_batch_size]
            loss = aggregate_loss(
                per_token_loss(features[micro], w), mask[micro], mode,
                global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                dp_size=dp_size, max_tokens=max_tokens,
            )
            loss.backward()  # gradients accumulate (summed) across micro-batches
            accumulated = accumulated + loss.detach()
        rank_grads.append(w.grad)
        rank_losses.append(accumulated)
    # The engine averages gradients over dp ranks.
    torch.testing.assert_close(torch.stack(rank_grads).mean(0), expected_grad)
    torch.testing.assert_close(torch.stack(rank_losses).mean(), expected_loss)
    assert all(torch.isfinite(g).all() for g in rank_grads)
