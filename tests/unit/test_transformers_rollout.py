"""TransformersRolloutEngine: left padding, logprobs, n samples, stopping, pruning, weight updates."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams, num_results
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine, apply_top_k_top_p, inverse_cdf_sample

EOS, PAD = 63, 0
PROMPTS = [[5, 6, 7], [1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [40, 41]]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.fixture()
def engine(model):
    return TransformersRolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, device="cpu", seed=1)


@torch.no_grad()
def naive_greedy(model, prompt, max_new_tokens, stop_ids=(EOS,)):
    """No cache, no padding: full forward over the whole sequence for every token."""
    ids, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out


def requests_for(prompts, **params):
    n = params.pop("n", 1)
    return [GenerationRequest(list(p), SamplingParams(**params), n=n) for p in prompts]


def test_greedy_matches_naive_loop_with_left_padding(model, engine):
    results = engine.generate(requests_for(PROMPTS, max_new_tokens=12, temperature=0.0))
    assert [r.request_index for r in results] == [0, 1, 2, 3]
    for prompt, result in zip(PROMPTS, results):
        assert result.prompt_ids == prompt
        assert result.output_ids == naive_greedy(model, prompt, 12)
        assert len(result.output_logprobs) == len(result.output_ids)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 20), (0.0, 1.0, -1)])
def test_logprobs_equal_teacher_forced_temperature_scaled(model, engine, temperature, top_p, top_k):
    results = engine.generate(requests_for(PROMPTS, max_new_tokens=10, temperature=temperature,
                                           top_p=top_p, top_k=top_k, n=2))
    scale = temperature if temperature > 0 else 1.0
    with torch.no_grad():
        for r in results:
            full = torch.tensor([r.prompt_ids + r.output_ids])
            logits = model(full).logits[0, len(r.prompt_ids) - 1:-1].float() / scale
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(r.output_logprobs), expected, atol=1e-4, rtol=0)


def test_n_samples_order_diversity_and_seed(engine):
    requests = requests_for(PROMPTS[:3], max_new_tokens=16, temperature=1.0, n=4, seed=123)
    results = engine.generate(requests)
    assert len(results) == num_results(requests) == 12
    assert [r.request_index for r in results] == [0] * 4 + [1] * 4 + [2] * 4
    for i in range(3):
        group = results[4 * i:4 * i + 4]
        assert all(r.prompt_ids == PROMPTS[i] for r in group)
        assert len({tuple(r.output_ids) for r in group}) > 1, "samples of one prompt should differ at T=1"
    again = engine.generate(requests)
    assert [r.output_ids for r in again] == [r.output_ids for r in results]
    assert [r.output_logprobs for r in again] == [r.output_logprobs for r in results]
    other = engine.generate(requests_for(PROMPTS[:3], max_new_tokens=16, temperature=1.0, n=4, seed=124))
    assert [r.output_ids for r in other] != [r.output_ids for r in results]


def test_unseeded_calls_reproducible_across_engines_and_differ_between_calls(model):
    requests = requests_for(PROMPTS, max_new_tokens=8, temperature=1.0, n=2)
    a = TransformersRolloutEngine(model, EOS, PAD, "cpu", seed=7)
    b = TransformersRolloutEngine(model, EOS, PAD, "cpu", seed=7)
    first_a, first_b = a.generate(requests), b.generate(requests)
    assert [r.output_ids for r in first_a] == [r.output_ids for r in first_b]
    assert [r.output_ids for r in a.generate(requests)] != [r.output_ids for r in first_a]


def test_stop_tokens_and_length(engine):
    # half the vocabulary stops request 0 within a few tokens; request 1 has no stop token but eos
    stop_many = list(range(32))
    requests = [GenerationRequest([5, 6], SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=stop_many,
                                                         seed=3), n=4),
                GenerationRequest([7], SamplingParams(max_new_tokens=5, temperature=1.0, seed=3), n=2)]
    results = engine.generate(requests)
    for r in results[:4]:
        assert r.finish_reason == "stop"
        assert r.output_ids[-1] in stop_many, "the stop token is kept in output_ids"
        assert all(t not in stop_many for t in r.output_ids[:-1])
        assert len(r.output_logprobs) == len(r.output_ids)
    for r in results[4:]:
        if r.output_ids[-1] == EOS:
            assert r.finish_reason == "stop"
        else:
            assert r.finish_reason == "length" and len(r.output_ids) == 5


def test_stop_on_last_allowed_token_is_stop(model, engine):
    # greedy: make the token produced at step 3 a stop token and allow exactly 3 tokens
    third = naive_greedy(model, PROMPTS[0], 3, stop_ids=())[2]
    first_two = naive_greedy(model, PROMPTS[0], 2, stop_ids=())
    if third in first_two:
        pytest.skip("greedy continuation repeats the token earlier")
    [r] = engine.generate([GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                        stop_token_ids=[third]))])
    assert r.output_ids[-1] == third and len(r.output_ids) == 3 and r.finish_reason == "stop"


def test_mixed_params_per_row(model, engine):
    """A greedy request batched with sampled ones still equals its solo greedy output."""
    requests = [GenerationRequest(PROMPTS[2], SamplingParams(max_new_tokens=9, temperature=0.0)),
                GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=1.3, top_k=5), n=3),
                GenerationRequest(PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.5), n=2)]
    results = engine.generate(requests)
    assert results[0].output_ids == naive_greedy(model, PROMPTS[2], 9)
    assert all(len(r.output_ids) <= 4 for r in results[4:])


def test_finished_rows_are_pruned(model, engine):
    batch_sizes = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, out: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        requests = [GenerationRequest([5, 6], SamplingParams(max_new_tokens=2, temperature=1.0, seed=0), n=3),
                    GenerationRequest([7, 8, 9], SamplingParams(max_new_tokens=12, temperature=1.0, seed=0), n=2),
                    GenerationRequest([3], SamplingParams(max_new_tokens=6, temperature=1.0, seed=0), n=1)]
        results = engine.generate(requests)
    finally:
        hook.remove()
    assert batch_sizes[0] == 3, "one prefill row per request (prefill shared by the n samples)"
    decode = batch_sizes[1:]
    assert decode[0] <= 6
    assert decode == sorted(decode, reverse=True), "the active batch never grows"
    longest = max(len(r.output_ids) for r in results)
    survivors = sum(1 for r in results if len(r.output_ids) == longest)
    assert decode[-1] == survivors < 6, "only unfinished rows are computed in later steps"
    assert len(decode) == longest - 1


def test_update_weights_switches_model(model, engine):
    other = tiny_llama(1)
    prompts_results = requests_for(PROMPTS, max_new_tokens=10, temperature=0.0)
    before = engine.generate(prompts_results)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        state = other.state_dict()
        items = list(state.items())
        half = len(items) // 2
        engine.update_weights(items[:half])  # buckets
        engine.update_weights(iter(items[half:]))
        after = engine.generate(prompts_results)
        for prompt, result in zip(PROMPTS, after):
            assert result.output_ids == naive_greedy(other, prompt, 10)
        assert [r.output_ids for r in after] != [r.output_ids for r in before]
    finally:
        model.load_state_dict(original)


def test_update_weights_rejects_bad_names_and_shapes(engine):
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_sleep_wake_reset_are_noops_on_cpu(model, engine):
    engine.sleep()
    engine.wake_up()
    engine.reset_prefix_cache()
    [r] = engine.generate(requests_for(PROMPTS[:1], max_new_tokens=5, temperature=0.0))
    assert r.output_ids == naive_greedy(model, PROMPTS[0], 5)


def test_apply_top_k_top_p_masks_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    out = apply_top_k_top_p(logits, top_k=torch.tensor([2, -1, -1]), top_p=torch.tensor([1.0, 0.6, 1.0]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, True, True]]
    torch.testing.assert_close(out[kept], logits[kept])


def test_inverse_cdf_sample_draws_each_rows_law_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.25, 0.25, 0.25, 0.25]])
    draws = 40_000
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(probs)
    for _ in range(draws // 1000):
        tokens = inverse_cdf_sample(probs.repeat_interleave(1000, dim=0), generator).view(3, 1000)
        counts += torch.nn.functional.one_hot(tokens, probs.size(1)).sum(1).float()
    assert counts[probs == 0].sum() == 0
    # binomial standard error at p = 0.5 over 40k draws is 0.0025; 4 of them
    torch.testing.assert_close(counts / draws, probs, atol=0.01, rtol=0)
    # unnormalised rows (a truncated softmax) draw the same law
    scaled = inverse_cdf_sample(probs * 3.0, torch.Generator().manual_seed(1))
    assert scaled.tolist() == inverse_cdf_sample(probs, torch.Generator().manual_seed(1)).tolist()


def test_empty_and_invalid_requests(engine):
    assert engine.generate([]) == []
    with pytest.raises(ValueError, match="prompt_ids"):
        GenerationRequest([], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(max_new_tokens=1, top_k=0)


def test_rollout_throughput_report(engine):
    """16 prompts x n=4 x 32 new tokens; prints tokens/s (informational, never asserted)."""
    requests = [GenerationRequest([(7 * i + j) % 60 + 1 for j in range(8 + i % 5)],
                                  SamplingParams(max_new_tokens=32, temperature=1.0, seed=0), n=4)
                for i in range(16)]
    engine.generate(requests[:2])  # warm-up
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(r.output_ids) for r in results)
    print(f"\n[rollout throughput] transformers engine, tiny llama, CPU: {num_tokens} tokens in "
          f"{elapsed * 1e3:.1f} ms = {num_tokens / elapsed:.0f} tokens/s")
    assert len(results) == 64
