"""SingleTurnExecutor with a fake engine: grouping, masks, truncation; and score_trajectories."""

import os
import random

import pytest
import torch

from hpc_rlhf.agents.executor import SingleTurnExecutor
from hpc_rlhf.data.prompts import Prompt, tokenize_prompts
from hpc_rlhf.rewards.functions import RewardFunction
from hpc_rlhf.rewards.scoring import score_trajectories
from hpc_rlhf.rollout.base import GenerationResult, SamplingParams, Trajectory

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "reward_funcs")
WORDS = ["What", "is", "2", "+", "3", "?", "5", "6", "7", "the", "answer"] + [f"w{i}" for i in range(30)]


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


class FakeEngine:
    """Sample j of request i answers tokens [10 + i, 20 + j, ...] of length 1 + j; even j stop, odd j hit length."""

    def __init__(self, shuffle=False):
        self.calls = []
        self.shuffle = shuffle

    def __call__(self, requests):
        self.calls.append(requests)
        results = []
        for i, request in enumerate(requests):
            for j in range(request.n):
                output = [10 + i] + [20 + j] * j
                results.append(GenerationResult(
                    prompt_ids=request.prompt_ids, output_ids=output,
                    output_logprobs=[-0.1 * (k + 1) for k in range(len(output))],
                    finish_reason="length" if j % 2 else "stop", request_index=i))
        if self.shuffle:  # a (misbehaving but honest) engine returning results out of order
            random.Random(0).shuffle(results)
        return results


def make_prompts(k):
    return [Prompt(text=f"What is w{i} ?", label=i, source="mem", index=i) for i in range(k)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_single_turn_groups_masks_and_truncation(shuffle):
    tok = make_tokenizer()
    engine = FakeEngine(shuffle=shuffle)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.7, stop_token_ids=[2])
    prompts = make_prompts(3)
    trajectories = SingleTurnExecutor(tok, prompt_max_len=64).run(prompts, engine, sampling, n_samples_per_prompt=4)

    # one engine call, one request per prompt sampled n times with the given params
    assert len(engine.calls) == 1
    requests = engine.calls[0]
    assert [r.n for r in requests] == [4, 4, 4] and all(r.params is sampling for r in requests)
    expected_ids = tokenize_prompts(tok, [p.text for p in prompts], 64)
    assert [r.prompt_ids for r in requests] == expected_ids

    assert len(trajectories) == 12
    for k, t in enumerate(trajectories):
        i = k // 4
        j = len(t.response_ids) - 1  # which sample of its request (samples of one prompt may come in any order)
        assert t.group_index == i
        assert (t.prompt, t.label) == (prompts[i].text, prompts[i].label)
        assert t.prompt_ids == expected_ids[i]
        assert t.response_ids == [10 + i] + [20 + j] * j
        assert t.action_mask == [1] * len(t.response_ids)
        assert t.rollout_logprobs == pytest.approx([-0.1 * (m + 1) for m in range(len(t.response_ids))])
        assert t.truncated == (j % 2 == 1)
        assert t.finish_reason == ("length" if j % 2 else "stop")
        assert t.reward is None and t.score is None
        assert t.sequence_ids == t.prompt_ids + t.response_ids
    for i in range(3):
        assert sorted(len(t.response_ids) - 1 for t in trajectories[4 * i:4 * i + 4]) == [0, 1, 2, 3]
    if not shuffle:
        assert [len(t.response_ids) - 1 for t in trajectories] == [0, 1, 2, 3] * 3


def test_trajectories_carry_their_prompts_source_name():
    prompts = [Prompt(text="What is w1 ?", label=None, source="/data/math_train.jsonl", index=0),
               Prompt(text="What is w2 ?", label=None, source="/data/mix.jsonl", index=1, data_source="gsm8k")]
    trajectories = SingleTurnExecutor(make_tokenizer(), 64).run(prompts, FakeEngine(), SamplingParams(4), 2)
    assert [t.data_source for t in trajectories] == ["math_train"] * 2 + ["gsm8k"] * 2


def test_prompts_are_left_truncated_before_generation():
    tok = make_tokenizer()
    engine = FakeEngine()
    long_prompt = Prompt(text=" ".join(f"w{i}" for i in range(30)), label=None, source="mem", index=0)
    (t,) = SingleTurnExecutor(tok, prompt_max_len=5).run([long_prompt], engine, SamplingParams(4), 1)
    assert len(engine.calls[0][0].prompt_ids) == 5
    assert tok.convert_ids_to_tokens(t.prompt_ids) == ["<s>", "w26", "w27", "w28", "w29"]


@pytest.mark.parametrize("broken", ["missing_result", "bad_index", "logprob_length"])
def test_engine_contract_violations_fail_loudly(broken):
    tok = make_tokenizer()

    def generate(requests):
        results = FakeEngine()(requests)
        if broken == "missing_result":
            return results[:-1]
        if broken == "bad_index":
            results[0].request_index = len(requests)
        if broken == "logprob_length":
            results[0].output_logprobs = []
        return results

    with pytest.raises(RuntimeError, match="rollout engine returned"):
        SingleTurnExecutor(tok, 64).run(make_prompts(2), generate, SamplingParams(4), 2)


def test_trajectory_check_catches_inconsistent_fields():
    good = Trajectory(prompt="p", label=None, prompt_ids=[1], response_ids=[5, 6], action_mask=[1, 0],
                      rollout_logprobs=[-0.5, 0.0])
    good.check()
    assert good.num_action_tokens == 1 and good.num_response_tokens == 2
    with pytest.raises(ValueError, match="action_mask has 1"):
        Trajectory(prompt="p", label=None, prompt_ids=[1], response_ids=[5, 6], action_mask=[1],
                   rollout_logprobs=[-0.5, 0.0]).check()
    with pytest.raises(ValueError, match="only 0 and 1"):
        Trajectory(prompt="p", label=None, prompt_ids=[1], response_ids=[5], action_mask=[2],
                   rollout_logprobs=[0.0]).check()


def test_score_trajectories_decodes_and_attaches_rewards():
    tok = make_tokenizer()
    ids = lambda text: tok.convert_tokens_to_ids(text.split())  # noqa: E731
    prompt_ids = [1] + ids("What is 2 + 3 ?")
    responses = ["the answer 5", "the answer 6", "5 6 7", "the answer"]
    trajectories = [
        Trajectory(prompt="What is 2 + 3 ?", label=5, prompt_ids=prompt_ids, response_ids=ids(r) + [2],
                   action_mask=[1] * (len(r.split()) + 1), rollout_logprobs=[0.0] * (len(r.split()) + 1))
        for r in responses
    ]
    seen = {}

    def spy(queries, prompts, labels, responses=None):
        seen.update(queries=queries, prompts=prompts, labels=labels, responses=responses)
        return RewardFunction(os.path.join(EXAMPLES, "arithmetic.py"))(queries, prompts, labels, responses=responses)

    out = score_trajectories(trajectories, spy, tok)
    assert seen["queries"][0] == "<s> What is 2 + 3 ? the answer 5 </s>"  # special tokens kept in queries
    assert seen["responses"][0] == "the answer 5"  # and skipped in responses
    assert seen["prompts"] == ["What is 2 + 3 ?"] * 4 and seen["labels"] == [5] * 4
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert [t.reward for t in trajectories] == [1.0, 0.0, 0.0, 0.0]
    assert [t.extra_logs["has_answer"] for t in trajectories] == [1.0, 1.0, 1.0, 0.0]
    assert torch.equal(out.extra_logs["has_answer"], torch.tensor([1.0, 1.0, 1.0, 0.0]))


def test_score_trajectories_keeps_rewards_set_by_the_executor():
    tok = make_tokenizer()
    calls = []

    def reward_func(queries, prompts, labels):  # plain OpenRLHF signature: no responses kwarg
        calls.append(len(queries))
        return {"rewards": [0.25] * len(queries)}

    trajectories = [Trajectory(prompt="p", label=None, prompt_ids=[1], response_ids=[4], action_mask=[1],
                               rollout_logprobs=[0.0], reward=r) for r in (None, 2.0, None)]
    out = score_trajectories(trajectories, reward_func, tok)
    assert calls == [2]
    assert out.rewards.tolist() == [0.25, 2.0, 0.25]
    assert [t.score for t in trajectories] == [0.25, None, 0.25]
    assert out.scores.tolist() == [0.25, 2.0, 0.25]  # score falls back to the reward
    score_trajectories(trajectories, reward_func, tok)
    assert calls == [2]  # everything scored: not called again
