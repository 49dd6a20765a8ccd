"""Token-budgeted micro-batches, dp balancing, and packed RL forwards equal to padded ones."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from hpc_rlhf.config import load_config
from hpc_rlhf.models.forward import critic_values, pack_actions, policy_logprobs
from hpc_rlhf.trainers.rl.row_layout import (
    Batching,
    balanced_order,
    first_positions,
    forward_row_layout,
    micro_batch_cost,
    plan_micro_batches,
    split_to_count,
)


@pytest.mark.parametrize("packed", [True, False])
def test_token_budget_plan_covers_every_row_once_within_budget(packed):
    rng = random.Random(0)
    lengths = [rng.randint(5, 60) for _ in range(37)] + [90]  # one row over the budget
    plan = plan_micro_batches(lengths, max_tokens=80, packed=packed)
    assert sorted(r for rows in plan for r in rows) == list(range(len(lengths)))
    for rows in plan:
        cost = micro_batch_cost([lengths[r] for r in rows], packed)
        assert cost <= 80 or len(rows) == 1
    assert [37] in plan  # the long row alone, never truncated
    # Packing fits more rows per micro-batch than padding for the same budget.
    if packed:
        assert len(plan) < len(plan_micro_batches(lengths, max_tokens=80, packed=False))


def test_fixed_plan_and_argument_checks():
    assert plan_micro_batches([3] * 5, micro_size=2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="exactly one"):
        plan_micro_batches([3], micro_size=1, max_tokens=4)


def test_split_to_count_keeps_rows_and_reaches_the_count():
    lengths = [10, 9, 8, 7, 1, 1]
    plan = plan_micro_batches(lengths, max_tokens=100, packed=True)
    assert len(plan) == 1
    split = split_to_count(plan, 4, lengths)
    assert len(split) == 4 and sorted(r for rows in split for r in rows) == list(range(6))
    with pytest.raises(ValueError, match="cannot make 7"):
        split_to_count(plan, 7, lengths)


def test_balanced_order_keeps_minibatches_and_balances_ranks():
    rng = random.Random(1)
    dp, per_rank = 2, 4
    lengths = [rng.choice([5, 50]) for _ in range(2 * dp * per_rank)]  # 2 mini-batches
    lengths[:8] = [50, 50, 50, 50, 5, 5, 5, 5]  # split_rows alone would give one rank all the long rows
    order = balanced_order(lengths, dp, per_rank)
    assert sorted(order) == list(range(len(lengths)))
    shard = len(lengths) // dp
    for k in range(2):
        picked = [order[d * shard + k * per_rank + j] for d in range(dp) for j in range(per_rank)]
        assert sorted(picked) == list(range(k * dp * per_rank, (k + 1) * dp * per_rank))  # same mini-batch
        tokens = [sum(lengths[order[d * shard + k * per_rank + j]] for j in range(per_rank)) for d in range(dp)]
        assert max(tokens) - min(tokens) <= max(lengths)
    assert sum(lengths[order[j]] for j in range(per_rank)) == 110  # 2 long + 2 short on rank 0


def _batch(num_rows=5, prompt=6, resp=7, vocab=40, seed=0):
    """Left-padded prompts, right-padded responses of different lengths (as ``StepBatch.from_trajectories`` lays
    out)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, vocab, (num_rows, prompt + resp), generator=g)
    mask = torch.zeros_like(seq)
    for i in range(num_rows):
        p, r = 2 + i % (prompt - 1), 1 + (3 * i) % resp
        mask[i, prompt - p : prompt + r] = 1
    seq[mask == 0] = 0
    return seq, mask, resp


def _llama(cls, **kw):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", **kw)
    return cls(cfg)


@pytest.mark.parametrize(("num_rows", "dp", "dynamic"), [(5, 2, False), (5, 2, True), (7, 3, True), (4, 2, True),
                                                       (3, 1, True)])
def test_forward_row_layout_pads_to_equal_shards_and_maps_back(num_rows, dp, dynamic):
    rng = random.Random(num_rows * 10 + dp)
    lengths = [rng.randint(1, 50) for _ in range(num_rows)]
    layout = forward_row_layout(num_rows, dp, lengths if dynamic else None)
    assert len(layout) % dp == 0 and len(layout) - num_rows < dp
    assert sorted(set(layout)) == list(range(num_rows))  # every row, the extras copies of the last row
    assert layout.count(num_rows - 1) == 1 + len(layout) - num_rows
    outputs = [row * 100 for row in layout]  # what the shards return, in layout order
    assert [outputs[p] for p in first_positions(layout, num_rows)] == [row * 100 for row in range(num_rows)]
    if dynamic and dp > 1:  # token balance: no shard above the most loaded shard of the plain order
        per = len(layout) // dp
        padded = [lengths[r] for r in range(num_rows)] + [lengths[-1]] * (len(layout) - num_rows)
        plain = max(sum(padded[i * per:(i + 1) * per]) for i in range(dp))
        assert max(sum(lengths[r] for r in layout[i * per:(i + 1) * per]) for i in range(dp)) <= plain


def test_pack_actions_places_every_response_token():
    seq, mask, resp = _batch()
    pack = pack_actions(seq, mask, resp)
    response_mask = mask[:, -resp:].bool()
    assert pack.inputs["input_ids"].shape == (1, int(mask.sum()))
    assert int(response_mask.sum()) == len(pack.positions)
    assert torch.equal(pack.targets, seq[:, -resp:][pack.rows, pack.cols])
    assert bool(response_mask[pack.rows, pack.cols].all())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_entropy_and_gradients_equal_padded(temperature):
    model = _llama(LlamaForCausalLM)
    seq, mask, resp = _batch()
    action = mask[:, -resp:].bool()
    weights = torch.randn(action.shape)
    results = {}
    for packed in (False, True):
        model.zero_grad()
        logprobs, entropy = policy_logprobs(model, seq, mask, resp, temperature, packed=packed, with_entropy=True)
        loss = ((logprobs + 0.1 * entropy) * weights)[action].sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[packed] = (logprobs[action], entropy[action], loss.detach(), grads)
    for a, b in zip(results[False], results[True]):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4)
    assert results[True][3].abs().sum() > 0


def test_packed_critic_values_equal_padded():
    model = _llama(LlamaForSequenceClassification, num_labels=1, pad_token_id=0).eval()
    seq, mask, resp = _batch(seed=3)
    action = mask[:, -resp:].bool()
    with torch.no_grad():
        padded = critic_values(model, seq, mask, resp)
        packed = critic_values(model, seq, mask, resp, packed=True)
    assert torch.allclose(padded[action], packed[action], atol=1e-5)
    assert bool((packed[~action] == 0).all())


def test_token_budget_is_per_gpu_and_a_ring_holds_sp_times_more():
    base = ["train.use_dynamic_batch=true", "train.max_tokens_per_gpu=100", "train.packing_samples=true"]
    cfg = load_config(None, base)
    assert Batching.for_training(cfg.train, cfg.ds).max_tokens == 100
    ring = load_config(None, [*base, "ds.ring_attn_size=4", "rollout.max_tokens_per_gpu=50"])
    assert Batching.for_training(ring.train, ring.ds).max_tokens == 400
    assert Batching.for_experience(ring.train, ring.rollout, ring.ds).max_tokens == 200
    cfg = load_config(None, ["train.micro_train_batch_size=3"])
    fixed = Batching.for_training(cfg.train, cfg.ds)
    assert (fixed.micro_size, fixed.max_tokens, fixed.packed) == (3, None, False)
