"""Packing: layout, attention isolation, and packed == padded losses AND gradients (SFT, RM, DPO)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hpc_rlhf.algos.preference import dpo_loss, pairwise_reward_loss, sft_loss
from hpc_rlhf.data.packing import TokenSample, block_causal_mask, collate, pack_rows
from hpc_rlhf.models.forward import causal_lm_forward, sequence_logprobs, value_model_forward
from hpc_rlhf.models.tiny import build_tiny_model

LENGTHS = [5, 9, 3, 7, 1, 4, 6, 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _samples(lengths=LENGTHS, seed=0) -> list[TokenSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(4, 80, (n,), generator=gen).tolist()
        out.append(TokenSample(tuple(ids), tuple([False] * (n // 2) + [True] * (n - n // 2))))
    return out


def test_pack_rows_first_fit_decreasing_respects_the_budget():
    rows = pack_rows([5, 9, 3, 7, 1, 4], 10)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum([5, 9, 3, 7, 1, 4][i] for i in row) <= 10 for row in rows)
    assert len(rows) == 3  # 29 tokens in rows of 10
    assert pack_rows([12, 2], 10) == [[0], [1]]  # an over-long sample gets its own row


def test_collate_packed_layout():
    samples = _samples([3, 2, 4])
    batch = collate(samples, pad_token_id=0, packing=True, max_tokens_per_row=6)
    assert batch["input_ids"].shape == (2, 6)  # first-fit decreasing: rows [4, 2] and [3] (+ 3 pads)
    assert batch["segment_ids"].tolist() == [[2, 2, 2, 2, 1, 1], [0, 0, 0, -1, -1, -1]]
    seg, pos = batch["segment_ids"], batch["position_ids"]
    for i, sample in enumerate(samples):
        rows, cols = (seg == i).nonzero(as_tuple=True)
        assert rows.unique().numel() == 1 and len(cols) == len(sample)
        assert batch["input_ids"][rows, cols].tolist() == list(sample.input_ids)
        assert pos[rows, cols].tolist() == list(range(len(sample)))  # positions restart per sample
        assert batch["last_pos"][i].tolist() == [rows[0].item(), cols[-1].item()]
        # targets: the next token of the same sample, trained where the next token is a target
        assert batch["target_ids"][rows[:-1], cols[:-1]].tolist() == list(sample.input_ids[1:])
        assert batch["target_mask"][rows, cols].tolist() == list(sample.loss_mask[1:]) + [False]
    assert batch["target_mask"].sum() == sum(s.num_targets for s in samples)


def test_block_causal_mask_isolates_samples_and_padding():
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    allowed = block_causal_mask(seg)[0, 0] == 0
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding attends only to itself: no empty softmax row
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _compare(model, fn):
    """fn(model, packing) -> (per-sample values, scalar loss); returns max diffs of values and grads."""
    results = {}
    for packing in (False, True):
        model.zero_grad()
        values, loss = fn(model, packing)
        loss.backward()
        results[packing] = (values.detach(), _grads(model))
    value_diff = (results[True][0] - results[False][0]).abs().max().item()
    grad_diff = max((a - b).abs().max().item() for a, b in zip(results[True][1], results[False][1]))
    grad_scale = max(g.abs().max().item() for g in results[False][1])
    assert len(results[True][1]) == len(results[False][1]) > 0
    return value_diff, grad_diff / grad_scale


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sft_packed_equals_padded(tiny, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation=attn, dtype=torch.float32)
    samples = _samples()

    def fn(m, packing):
        batch = collate(samples, 0, packing=packing, max_tokens_per_row=12)
        if packing:
            assert batch["input_ids"].shape[0] < len(samples)
        logps = causal_lm_forward(m, batch, attn, torch.float32)
        return sequence_logprobs(logps, batch), sft_loss(logps, batch["target_mask"])

    value_diff, grad_diff = _compare(model, fn)
    assert value_diff < 1e-5 and grad_diff < 1e-5, (value_diff, grad_diff)


def test_packing_without_isolation_would_differ(tiny):
    """Guard that the comparison can fail: a plain causal mask over a packed row leaks across samples."""
    model = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="sdpa", dtype=torch.float32)
    samples = _samples()
    padded = collate(samples, 0)
    packed = collate(samples, 0, packing=True, max_tokens_per_row=12)
    ref = sequence_logprobs(causal_lm_forward(model, padded, "sdpa", torch.float32), padded)
    leaky = dict(packed, packed=False, segment_ids=torch.where(packed["segment_ids"] >= 0, 0, -1))
    logps = causal_lm_forward(model, leaky, "sdpa", torch.float32)
    assert (sequence_logprobs(logps, packed) - ref).abs().max() > 1e-3


def test_reward_model_packed_equals_padded(tiny):
    model = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    samples = _samples()
    half = len(samples) // 2

    def fn(m, packing):
        batch = collate(samples, 0, packing=packing, max_tokens_per_row=12)
        scores = value_model_forward(m, batch, "sdpa", torch.float32)
        return scores, pairwise_reward_loss(scores[:half], scores[half:]).mean()

    value_diff, grad_diff = _compare(model, fn)
    assert value_diff < 1e-5 and grad_diff < 1e-5, (value_diff, grad_diff)


@pytest.mark.parametrize("ipo", [False, True])
def test_dpo_logprobs_packed_equal_padded(tiny, ipo):
    model = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="sdpa", dtype=torch.float32)
    samples = _samples()
    half = len(samples) // 2
    ref = torch.randn(len(samples), generator=torch.Generator().manual_seed(1))

    def fn(m, packing):
        batch = collate(samples, 0, packing=packing, max_tokens_per_row=16)
        logps = sequence_logprobs(causal_lm_forward(m, batch, "sdpa", torch.float32), batch, mean=ipo)
        losses, _, _ = dpo_loss(logps[:half], logps[half:], ref[:half], ref[half:], beta=0.1, ipo=ipo)
        return logps, losses.mean()

    value_diff, grad_diff = _compare(model, fn)
    assert value_diff < 1e-5 and grad_diff < 1e-5, (value_diff, grad_diff)


def test_flash_attention_gets_one_flattened_row_without_mask():
    """transformers detects varlen packing from position_ids only for a single row (``_is_packed_sequence``)."""
    from hpc_rlhf.models.token_layout import model_inputs, unflatten_varlen

    batch = collate(_samples(), 0, packing=True, max_tokens_per_row=12)
    rows, width = batch["input_ids"].shape
    kwargs = model_inputs(batch, "flash_attention_2", torch.bfloat16, "cpu")
    assert kwargs["attention_mask"] is None and kwargs["input_ids"].shape == (1, rows * width)
    positions = kwargs["position_ids"][0]
    starts = int((positions == 0).sum())  # every sample and every padding tail starts a new segment
    assert starts == len(LENGTHS) + int((batch["segment_ids"][:, -1] < 0).sum())
    hidden = torch.randn(1, rows * width, 3)
    assert torch.equal(unflatten_varlen(hidden, batch, "flash_attention_2"), hidden.view(rows, width, 3))
    padded = model_inputs(collate(_samples(), 0), "flash_attention_2", torch.bfloat16, "cpu")
    assert padded["attention_mask"].shape == padded["input_ids"].shape  # unpacked: ordinary 2D padding mask
