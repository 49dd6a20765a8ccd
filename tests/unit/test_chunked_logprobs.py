"""Chunked LM-head log-probs equal the full-logits path: values and gradients, padded and packed layouts."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_rlhf.algos import entropy_from_logits
from hpc_rlhf.models import chunked_logprobs
from hpc_rlhf.models.chunked_logprobs import linear_logprobs
from hpc_rlhf.models.forward import chunked_head_weight, policy_logprobs
from hpc_rlhf.models.logprobs import logprobs_from_logits

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 columns for up to 32 tokens, so every test vocabulary spans several chunks, the last
    one partial."""
    monkeypatch.setattr(chunked_logprobs, "CHUNK_ELEMENTS", 32 * 64)
    monkeypatch.setattr(chunked_logprobs, "MIN_CHUNK_COLUMNS", 64)


@pytest.fixture(params=["several_chunks", "one_chunk"])
def chunking(request, monkeypatch):
    """Both code paths: several vocabulary chunks with a recomputing backward, or one chunk by plain autograd."""
    if request.param == "several_chunks":
        request.getfixturevalue("small_chunks")
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_linear_logprobs_match_log_softmax_with_gradients(chunking, temperature, with_entropy):
    gen = torch.Generator().manual_seed(0)
    n, h, v = 29, 16, 301
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = (torch.randn(v, h, generator=gen) * 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[:3] = torch.tensor([0, v - 1, 64])  # first and last column, a chunk boundary
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    lp, ent = linear_logprobs(hidden, weight, targets, temperature, with_entropy=with_entropy)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    grads = torch.autograd.grad(loss, (hidden, weight))

    logits = (hidden @ weight.T)[None]
    ref_lp = logprobs_from_logits(logits, targets[None], temperature)[0]
    ref_ent = entropy_from_logits(logits / temperature, torch.ones(1, n, dtype=torch.bool))[0]
    ref_loss = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if with_entropy else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))

    torch.testing.assert_close(lp, ref_lp, **TOL)
    assert (ent is None) != with_entropy
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


def _model_and_batch():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=301, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.2)
    model = LlamaForCausalLM(config).float()
    # RL layout: left-padded prompts (P=5), right-padded responses (R=6) of lengths 6, 3, 1, 4
    prompt_lens, response_lens, p, r = [5, 2, 4, 3], [6, 3, 1, 4], 5, 6
    sequences = torch.zeros(4, p + r, dtype=torch.long)
    attention_mask = torch.zeros(4, p + r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        sequences[i, p - pl : p + rl] = torch.randint(1, 301, (pl + rl,))
        attention_mask[i, p - pl : p + rl] = 1
    return model, sequences, attention_mask, r


@pytest.mark.parametrize("packed", [False, True])
def test_policy_logprobs_chunked_equal_logits_path_with_gradients(small_chunks, packed):
    model, sequences, attention_mask, num_actions = _model_and_batch()
    mask = attention_mask[:, -num_actions:].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for chunked in (True, False):
        model.zero_grad()
        lp, ent = policy_logprobs(model, sequences, attention_mask, num_actions, temperature=0.8, packed=packed,
                                  with_entropy=True, chunked=chunked)
        (((lp + 0.1 * ent) * weights)[mask]).sum().backward()
        results[chunked] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp_c, ent_c, grads_c), (lp_f, ent_f, grads_f) = results[True], results[False]
    torch.testing.assert_close(lp_c[mask], lp_f[mask], **TOL)
    torch.testing.assert_close(ent_c[mask], ent_f[mask], **TOL)
    assert not lp_c[~mask].any() and not ent_c[~mask].any()  # response padding carries zeros
    for name, grad in grads_f.items():
        torch.testing.assert_close(grads_c[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_an_entropy_outside_the_loss_costs_the_chunked_backward_nothing(small_chunks, monkeypatch):
    """A logged (detached) entropy reaches the chunked backward as None, so its term is skipped."""
    seen = []
    backward = chunked_logprobs._ChunkedLinearLogprobs.backward

    def spy(ctx, grad_logprobs, grad_entropy):
        seen.append(grad_entropy)
        return backward(ctx, grad_logprobs, grad_entropy)

    monkeypatch.setattr(chunked_logprobs._ChunkedLinearLogprobs, "backward", staticmethod(spy))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, 16, generator=gen, requires_grad=True)
    weight = torch.randn(301, 16, generator=gen)
    lp, ent = linear_logprobs(hidden, weight, torch.randint(0, 301, (20,), generator=gen), with_entropy=True)
    (lp.sum() + 0.0 * ent.detach().sum()).backward()
    assert seen == [None]


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_entropy_without_grad_is_detached_and_leaves_the_logprob_gradients_alone(small_chunks, chunked, packed):
    model, sequences, attention_mask, num_actions = _model_and_batch()
    mask = attention_mask[:, -num_actions:].bool()
    results = {}
    for entropy_grad in (True, False):
        model.zero_grad()
        lp, ent = policy_logprobs(model, sequences, attention_mask, num_actions, temperature=0.8, packed=packed,
                                  with_entropy=True, entropy_grad=entropy_grad, chunked=chunked)
        assert ent.requires_grad == entropy_grad
        lp[mask].sum().backward()
        results[entropy_grad] = (lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()])
    (lp_g, ent_g, grads_g), (lp_n, ent_n, grads_n) = results[True], results[False]
    torch.testing.assert_close(lp_n, lp_g, **TOL)
    torch.testing.assert_close(ent_n[mask], ent_g[mask], **TOL)
    for got, want in zip(grads_n, grads_g):
        torch.testing.assert_close(got, want, **TOL)


def test_no_grad_forward_equals_logits_path_and_keeps_nothing_for_backward(small_chunks):
    model, sequences, attention_mask, num_actions = _model_and_batch()
    with torch.no_grad():
        lp_c, _ = policy_logprobs(model, sequences, attention_mask, num_actions, chunked=True)
        lp_f, _ = policy_logprobs(model, sequences, attention_mask, num_actions, chunked=False)
    mask = attention_mask[:, -num_actions:].bool()
    assert not lp_c.requires_grad
    torch.testing.assert_close(lp_c[mask], lp_f[mask], **TOL)


def test_models_whose_head_the_chunked_path_cannot_reproduce_fall_back_to_logits():
    model, *_ = _model_and_batch()
    assert chunked_head_weight(model) is model.lm_head.weight
    model.config.final_logit_softcapping = 30.0  # Gemma-2 style: logits are transformed after the head
    assert chunked_head_weight(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head = torch.nn.Linear(32, 301, bias=True)
    assert chunked_head_weight(model) is None
