"""Mixture-of-experts actors: the load-balancing loss (transformers' function, checked by hand), the routing
statistics, the router logits of every forward layout, and ``algo.aux_loss_coef`` in the actor update."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hpc_rlhf.algos import token_share, total_loss
from hpc_rlhf.algos.moe import expert_load, load_max_over_mean, router_entropy, routing_stats
from hpc_rlhf.config import load_config
from hpc_rlhf.models.forward import policy_logprobs
from hpc_rlhf.models.moe import RouterLogits, load_balancing_loss, moe_spec, sparse_moe_block_classes
from hpc_rlhf.models.tiny import build_tiny_moe_model
from hpc_rlhf.trainers.rl.workers import UpdateSettings, train_actor
from tests.unit.test_actor_entropy import _Engine, _model, _shard


def _moe_model(num_experts: int = 4, top_k: int = 2, layers: int = 2) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            initializer_range=0.5)
    return Qwen3MoeForCausalLM(config).float()


def test_load_balancing_loss_is_the_switch_transformer_formula_by_hand():
    # One layer, four tokens, two experts, top-1. Router probabilities p = softmax(logits).
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [3.0, 0.0]])
    p = [[1 / (1 + math.exp(-d)), 1 - 1 / (1 + math.exp(-d))] for d in (2.0, -1.0, 1.0, 3.0)]
    # Top-1 picks expert 0, 1, 0, 0: f = fraction of tokens per expert; P = mean router probability per expert.
    f = [3 / 4, 1 / 4]
    mean_p = [sum(row[e] for row in p) / 4 for e in range(2)]
    by_hand = 2 * (f[0] * mean_p[0] + f[1] * mean_p[1])
    model = _moe_model(num_experts=2, top_k=1, layers=1)
    every = torch.ones(4, dtype=torch.bool)
    got = load_balancing_loss(model, RouterLogits((logits,), every, every))
    assert float(got) == pytest.approx(by_hand, rel=1e-6)
    # A padding token (masked out) changes nothing: add one routed to expert 1 with any logits.
    padded = torch.cat([logits, torch.tensor([[-5.0, 5.0]])])
    mask = torch.tensor([True, True, True, True, False])
    assert float(load_balancing_loss(model, RouterLogits((padded,), mask, mask))) == pytest.approx(by_hand, rel=1e-6)


def test_routing_statistics_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 3.0], [5.0, 1.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([True, True, True, False])
    # top-2 of rows 0-2: {0, 1 or 2}, {2, 0}, {0, 1}: expert 0 gets 3 tokens.
    load = expert_load(logits, mask, top_k=2)
    assert load.sum() == 6 and load[0] == 3
    assert float(load_max_over_mean(torch.tensor([3.0, 1.0, 2.0]))) == pytest.approx(1.5)
    assert float(load_max_over_mean(torch.zeros(3))) == 1.0
    uniform = torch.zeros(2, 4)
    assert float(router_entropy(uniform, torch.ones(2, dtype=torch.bool))) == pytest.approx(math.log(4))
    sure = torch.tensor([[100.0, 0.0], [0.0, 0.0]])
    # Mean over the selected token only: the sure one, entropy ~0.
    assert float(router_entropy(sure, torch.tensor([True, False]))) == pytest.approx(0.0, abs=1e-6)
    stats = routing_stats((torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])),
                          torch.ones(2, dtype=torch.bool), top_k=1)
    assert stats["moe/layer0/load_max_over_mean"] == pytest.approx(2.0)  # both tokens on expert 0
    assert stats["moe/layer1/load_max_over_mean"] == pytest.approx(1.0)
    assert stats["moe/load_max_over_mean"] == pytest.approx(2.0)  # the worst layer
    h = -(0.7311 * math.log(0.7311) + 0.2689 * math.log(0.2689))
    assert stats["moe/router_entropy"] == pytest.approx(h, rel=1e-3)


def test_moe_spec_and_sparse_blocks(tmp_path):
    assert moe_spec({"num_experts": 8, "num_experts_per_tok": 2}).num_experts == 8
    assert moe_spec({"num_local_experts": 8, "num_experts_per_tok": 2}).top_k == 2
    assert moe_spec({"hidden_size": 8}) is None
    assert moe_spec(_model().config) is None and sparse_moe_block_classes(_model()) == []
    for family in ("qwen3_moe", "mixtral"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(build_tiny_moe_model(tmp_path / family, family=family))
        assert moe_spec(model.config).num_experts == 4
        assert [c.__name__ for c in sparse_moe_block_classes(model)][0].endswith("SparseMoeBlock")


def _rows(num_actions: int = 3):
    sequences = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [0, 4, 5, 6, 7, 8, 0], [3, 4, 5, 6, 10, 0, 0]])
    attention_mask = (sequences != 0).long()
    return sequences, attention_mask, num_actions


@pytest.mark.parametrize("packed,chunked", [(False, True), (True, True), (False, False), (True, False)])
def test_every_forward_layout_returns_the_same_routing(packed, chunked):
    model = _moe_model()
    sequences, mask, r = _rows()
    reference: list = []
    policy_logprobs(model, sequences, mask, r, router=reference)
    router: list = []
    policy_logprobs(model, sequences, mask, r, packed=packed, chunked=chunked, router=router)
    expected = load_balancing_loss(model, reference[0]).detach()
    # the model's own aux_loss over the same padded batch
    with torch.no_grad():
        own = model(input_ids=sequences, attention_mask=mask, output_router_logits=True).aux_loss
    assert float(expected) == pytest.approx(float(own), rel=1e-5)
    assert float(load_balancing_loss(model, router[0]).detach()) == pytest.approx(float(expected), rel=1e-5)
    assert int(router[0].action_mask.sum()) == int(mask[:, -r:].sum())
    want = routing_stats(reference[0].layers, reference[0].action_mask, 2)
    got = routing_stats(router[0].layers, router[0].action_mask, 2)
    assert got == pytest.approx(want, rel=1e-5)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _train(model, coef: float):
    cfg = load_config(None, ["train.micro_train_batch_size=1", f"algo.aux_loss_coef={coef}"])
    settings = UpdateSettings.from_sections(cfg.train, cfg.rollout, cfg.ds)
    shard = _shard()
    return train_actor(_Engine(model), shard, cfg.algo, settings, dp_size=1), shard


def test_aux_loss_coef_enters_the_actor_gradient_and_is_logged():
    model = _moe_model()
    stats, shard = _train(model, 0.0)
    # Zero advantages: without the aux term nothing back-propagates, yet the aux loss and routing are logged.
    assert not _grads(model).any()
    assert stats["aux_loss"] > 0 and "moe/router_entropy" in stats and "moe/layer1/load_max_over_mean" in stats
    # The logged aux loss: per mini-batch, its micro-batches' means weighted by their share of action tokens.
    rows, expected = shard.rows, 0.0
    for k in range(shard.num_minibatches):
        for i in range(shard.minibatch(k).start, shard.minibatch(k).stop):
            one = rows.take_rows(torch.tensor([i])).trim_padding()
            router: list = []
            with torch.no_grad():
                policy_logprobs(model, one.sequences, one.attention_mask, one.action_mask.shape[1], router=router)
            weight = token_share(one.action_mask.sum(), shard.num_tokens[k])
            expected += float(weight * load_balancing_loss(model, router[0])) / shard.num_minibatches
    assert stats["aux_loss"] == pytest.approx(expected, rel=1e-5)
    model.zero_grad(set_to_none=True)
    _train(model, 0.01)
    assert _grads(model).abs().sum() > 0


def test_total_loss_weights_the_aux_loss_by_the_token_share():
    share = token_share(3, 12, dp_size=2)  # 3 of 12 tokens, gradients averaged over 2 ranks
    assert float(share) == pytest.approx(0.5)
    assert float(total_loss(torch.tensor(1.0), aux_loss=torch.tensor(2.0), aux_loss_coef=0.1,
                            aux_weight=share)) == pytest.approx(1.1)


def test_aux_loss_coef_is_refused_for_a_dense_actor():
    with pytest.raises(ValueError, match="algo.aux_loss_coef=0.01.*not a mixture-of-experts"):
        _train(_model(), 0.01)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_switch_loss_from_sums_is_transformers_loss_and_chunks_add_up(family):
    """Under sequence parallelism the load-balancing loss is built from sums the chunks add up
    (``switch_loss_sums``): over a whole forward it equals the model family's own ``load_balancing_loss_func``,
    and split into chunks it gives the same loss and statistics."""
    import importlib

    from hpc_rlhf.algos.moe import routing_stats_from_sums, routing_sums, switch_loss, switch_loss_sums

    own = importlib.import_module(f"transformers.models.{family}.modeling_{family}").load_balancing_loss_func
    gen = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(11, 4, generator=gen) for _ in range(3))
    mask = torch.tensor([True] * 8 + [False, True, False])
    whole = switch_loss(*switch_loss_sums(layers, mask, 2))
    assert float(whole) == pytest.approx(float(own(layers, 4, 2, mask.long()[None])), rel=1e-6)
    halves = [switch_loss_sums(tuple(x[part] for x in layers), mask[part], 2) for part in (slice(0, 5), slice(5, 11))]
    added = [a + b for a, b in zip(*halves)]
    assert float(switch_loss(*added)) == pytest.approx(float(whole), rel=1e-6)
    stats = [routing_sums(tuple(x[part] for x in layers), mask[part], 2) for part in (slice(0, 5), slice(5, 11))]
    chunked = routing_stats_from_sums(*[a + b for a, b in zip(*stats)])
    assert chunked == pytest.approx(routing_stats(layers, mask, 2), rel=1e-6)
