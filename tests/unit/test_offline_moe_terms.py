"""The offline trainers' MoE terms (``hpc_rlhf.trainers.offline.moe_terms``): the load-balancing loss weighted by
each micro-batch's token share, so the weighted sum over micro-batches and ranks is the token-weighted mean of the
micro-batch losses, ``loss.aux_loss_coef`` in the loss, and the logged statistics."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_rlhf.data.packing import TokenSample, collate
from hpc_rlhf.models.forward import value_model_forward
from hpc_rlhf.models.moe import RouterLogits, load_balancing_loss
from hpc_rlhf.trainers.offline.moe_terms import MoETerms, moe_summary
from tests.unit.test_moe import _moe_model


def _router(seed: int, tokens: int, experts: int = 4, layers: int = 2) -> RouterLogits:
    gen = torch.Generator().manual_seed(seed)
    every = torch.ones(tokens, dtype=torch.bool)
    return RouterLogits(tuple(torch.randn(tokens, experts, generator=gen) for _ in range(layers)), every, every)


def _micro(terms: MoETerms, router: RouterLogits, tokens: int, global_tokens: int, dp_size: int, loss: float = 0.0):
    terms.start_micro()
    terms.sink().append(router)
    return terms.finish_micro(torch.tensor(loss), tokens, global_tokens, dp_size)


def test_the_weighted_aux_losses_add_up_to_the_token_weighted_mean_over_micro_batches_and_ranks():
    model = _moe_model()
    coef = 0.1
    # Two ranks, two micro-batches each, of 3, 5, 2 and 6 tokens (16 in all).
    sizes = [[3, 5], [2, 6]]
    routers = [[_router(10 * r + m, n) for m, n in enumerate(ranks)] for r, ranks in enumerate(sizes)]
    means = [[float(load_balancing_loss(model, router)) for router in ranks] for ranks in routers]
    by_hand = sum(n * mean for ranks_n, ranks_m in zip(sizes, means) for n, mean in zip(ranks_n, ranks_m)) / 16
    terms = MoETerms.of(model, coef)
    # DeepSpeed averages the ranks' gradients: the step's loss is the mean over ranks of each rank's summed shares.
    per_rank = [sum(float(_micro(terms, router, n, 16, dp_size=2)[0]) for router, n in zip(ranks_r, ranks_n))
                for ranks_r, ranks_n in zip(routers, sizes)]
    assert sum(per_rank) / 2 == pytest.approx(coef * by_hand, rel=1e-5)


def test_the_coefficient_changes_the_loss_and_the_statistics_are_logged():
    model = _moe_model()
    router = _router(0, 8)
    base, stats = _micro(MoETerms.of(model, 0.0), router, 8, 8, dp_size=1, loss=1.0)
    weighted, _ = _micro(MoETerms.of(model, 0.5), router, 8, 8, dp_size=1, loss=1.0)
    aux = float(load_balancing_loss(model, router))
    assert float(base) == 1.0 and float(weighted) == pytest.approx(1.0 + 0.5 * aux, rel=1e-6)
    summary = moe_summary(stats, prefix="")
    assert summary["aux_loss"] == pytest.approx(aux, rel=1e-6)
    assert {"moe/router_entropy", "moe/load_max_over_mean", "moe/layer0/load_max_over_mean",
            "moe/layer1/load_max_over_mean"} <= set(summary)
    assert moe_summary({"loss_sum": 1.0}) == {}  # a dense model logs no MoE keys


def test_the_router_logits_reach_the_gradient():
    model = _moe_model()
    ids = torch.randint(0, 32, (2, 6))
    terms = MoETerms.of(model, 1.0)
    terms.start_micro()
    out = model(input_ids=ids, output_router_logits=True)
    every = torch.ones(12, dtype=torch.bool)
    terms.sink().append(RouterLogits(out.router_logits, every, every))
    loss, _ = terms.finish_micro(torch.zeros(()), 12, 12, 1)
    loss.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0


def test_a_forward_that_did_not_record_fails_loudly_and_a_dense_model_refuses_the_coefficient():
    terms = MoETerms.of(_moe_model(), 0.1)
    terms.start_micro()
    with pytest.raises(RuntimeError, match="recorded 0 router outputs"):
        terms.finish_micro(torch.zeros(()), 4, 4, 1)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert MoETerms.of(dense, 0.0) is None
    with pytest.raises(ValueError, match="loss.aux_loss_coef=0.1"):
        MoETerms.of(dense, 0.1)


@pytest.mark.parametrize("packing", [False, True])
def test_the_reward_model_forward_returns_the_router_logits_of_the_real_tokens(packing):
    from transformers import Qwen3MoeForSequenceClassification

    config = _moe_model().config
    config.num_labels = 1
    config.pad_token_id = 0
    torch.manual_seed(0)
    model = Qwen3MoeForSequenceClassification(config).float()
    samples = [TokenSample((1, 2, 3, 4, 5), (True,) * 5), TokenSample((6, 7, 8), (True,) * 3)]
    router: list = []
    scores = value_model_forward(model, collate(samples, 0, packing=packing), "sdpa", torch.float32, router=router)
    assert scores.shape == (2,) and len(router) == 1 and len(router[0].layers) == 2
    assert router[0].layers[0].shape[-1] == 4 and int(router[0].token_mask.sum()) == 8  # 5 + 3 real tokens
    alone: list = []
    value_model_forward(model, collate(samples[1:], 0), "sdpa", torch.float32, router=alone)
    # the second sample's routing does not depend on the layout it was batched in
    torch.testing.assert_close(router[0].layers[1][router[0].token_mask][5:], alone[0].layers[1], atol=1e-5, rtol=1e-5)
