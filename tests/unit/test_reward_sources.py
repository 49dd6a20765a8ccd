"""User reward functions: loading by path, output validation, failure reports, the example files."""

import os
import textwrap

import pytest
import torch

from hpc_rlhf.rewards.functions import RewardFunction, RewardFunctionError, RewardOutput, validate_reward_output

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "reward_funcs")


def reward_file(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_loads_and_normalises_openrlhf_output(tmp_path):
    path = reward_file(tmp_path, """
        import torch
        def reward_func(queries, prompts, labels):
            r = torch.tensor([float(len(q)) for q in queries])
            return {"rewards": r, "scores": [0, 1, 0], "extra_logs": {"len": r, "const": 2.5}}
    """)
    fn = RewardFunction(path)
    out = fn(["a", "bb", "ccc"], ["p", "p", "p"], [None, None, None])
    assert isinstance(out, RewardOutput)
    assert torch.equal(out.rewards, torch.tensor([1.0, 2.0, 3.0]))
    assert out.rewards.dtype == torch.float32 and out.scores.dtype == torch.float32
    assert torch.equal(out.scores, torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(out.extra_logs["len"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(out.extra_logs["const"], torch.tensor([2.5, 2.5, 2.5]))


def test_scores_default_to_rewards_and_bare_lists_are_rewards(tmp_path):
    path = reward_file(tmp_path, """
        def reward_func(queries, prompts, labels):
            return [1, 0.5]
    """)
    out = RewardFunction(path)(["a", "b"], ["a", "b"], [1, 2])
    assert out.rewards.tolist() == [1.0, 0.5] and out.scores.tolist() == [1.0, 0.5] and out.extra_logs == {}
    # (B, 1) tensors are accepted as (B,)
    out = validate_reward_output({"rewards": torch.ones(2, 1)}, 2, "f.py")
    assert out.rewards.shape == (2,)


def test_two_files_with_the_same_module_name_do_not_shadow(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    a = reward_file(tmp_path / "one", "def reward_func(q, p, l):\n    return [1.0] * len(q)\n", "r.py")
    b = reward_file(tmp_path / "two", "def reward_func(q, p, l):\n    return [2.0] * len(q)\n", "r.py")
    fa, fb = RewardFunction(a), RewardFunction(b)
    assert fa(["x"], ["x"], [None]).rewards.item() == 1.0
    assert fb(["x"], ["x"], [None]).rewards.item() == 2.0


def test_optional_kwargs_only_reach_functions_that_accept_them(tmp_path):
    plain = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    assert RewardFunction(plain)(["q"], ["p"], [None], responses=["r"]).rewards.tolist() == [0.0]
    takes = reward_file(tmp_path, """
        def reward_func(queries, prompts, labels, responses=None):
            return [float(len(r)) for r in responses]
    """, "takes.py")
    assert RewardFunction(takes)(["q", "q"], ["p", "p"], [None, None], responses=["abc", "x"]).rewards.tolist() == [3.0, 1.0]


@pytest.mark.parametrize(
    "body, match",
    [
        ("x = 1\n", "must define a callable reward_func"),
        ("import not_a_module_anywhere\n", "importing reward function file .* failed: ModuleNotFoundError"),
    ],
)
def test_loading_errors_name_the_file(tmp_path, body, match):
    path = reward_file(tmp_path, body)
    with pytest.raises(RewardFunctionError, match=match) as info:
        RewardFunction(path)
    assert path in str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(RewardFunctionError, match="absent.py does not exist"):
        RewardFunction(str(tmp_path / "absent.py"))


@pytest.mark.parametrize(
    "returned, match",
    [
        ("{'rewards': [1.0]}", "rewards has 1 values for a batch of 2 samples"),
        ("{'rewards': [1.0, 'high']}", r"rewards\[1\] = 'high' is not a number"),
        ("{'rewards': [1.0, None]}", r"rewards\[1\] = None is not a number"),
        ("{'rewards': [1.0, float('nan')]}", r"rewards\[1\] = nan is not finite"),
        ("{'rewards': [1.0, 2.0], 'scores': [1.0]}", "scores has 1 values"),
        ("{'rewards': [1.0, 2.0], 'extra_logs': {'acc': [1.0, 2.0, 3.0]}}", r"extra_logs\['acc'\] has 3 values"),
        ("{'rewards': [1.0, 2.0], 'extra_logs': [1.0]}", "extra_logs must be a dict"),
        ("{'reward': [1.0, 2.0]}", "without 'rewards'"),
        ("'good'", "must return a dict with 'rewards', got str"),
        ("{'rewards': torch.zeros(2, 3)}", r"shape \(B,\), got \(2, 3\)"),
    ],
)
def test_malformed_output_errors_name_file_and_key(tmp_path, returned, match):
    path = reward_file(tmp_path, f"import torch\ndef reward_func(queries, prompts, labels):\n    return {returned}\n")
    with pytest.raises(RewardFunctionError, match=match) as info:
        RewardFunction(path)(["a", "b"], ["a", "b"], [None, None])
    assert str(info.value).startswith(path)


def test_raising_function_reports_the_failing_prompt_and_traceback(tmp_path):
    path = reward_file(tmp_path, """
        CALLS = []
        def parse_label(label):
            return int(label)
        def reward_func(queries, prompts, labels):
            CALLS.append(len(queries))
            return [float(parse_label(l)) for l in labels]
    """)
    fn = RewardFunction(path)
    prompts = ["What is 1+1?", "What is 2+2?", "What is the meaning?", "What is 3+3?"]
    with pytest.raises(RewardFunctionError) as info:
        fn(prompts, prompts, ["2", "4", "forty-two", "6"])
    err = info.value
    message = str(err)
    assert err.sample_index == 2 and err.prompt == "What is the meaning?"
    assert "sample 2 of 4" in message and "What is the meaning?" in message and "'forty-two'" in message
    assert "ValueError" in message and path in message
    assert "Traceback (most recent call last)" in message and "in parse_label" in message
    assert "return int(label)" in err.traceback_text
    # the batch, then samples 0, 1, 2 one by one (stops at the first failure)
    import sys

    module = [m for m in sys.modules.values() if getattr(m, "__file__", None) == path][0]
    assert module.CALLS == [4, 1, 1, 1]
    assert isinstance(err.__cause__, ValueError)


def test_failure_only_on_the_whole_batch_is_reported_as_such(tmp_path):
    path = reward_file(tmp_path, """
        def reward_func(queries, prompts, labels):
            if len(queries) > 2:
                raise MemoryError("batch too large for the judge")
            return [1.0] * len(queries)
    """)
    with pytest.raises(RewardFunctionError, match=r"failed on a batch of 3 samples \(each sample alone succeeds\)") as info:
        RewardFunction(path)(["a", "b", "c"], ["a", "b", "c"], None)
    assert info.value.sample_index is None and "batch too large for the judge" in str(info.value)
    with pytest.raises(RewardFunctionError) as info:
        RewardFunction(path, locate_failing_sample=False)(["a", "b", "c"], ["a", "b", "c"], None)
    assert info.value.sample_index is None


def test_mismatched_input_lengths_are_rejected(tmp_path):
    path = reward_file(tmp_path, "def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    with pytest.raises(ValueError, match="one entry per sample"):
        RewardFunction(path)(["a", "b"], ["a"], [None, None])


def test_arithmetic_example_rewards_the_last_integer():
    fn = RewardFunction(os.path.join(EXAMPLES, "arithmetic.py"))
    prompts = ["What is 2 + 3?", "What is 10 - 4?", "What is 7 * 6?", "What is 1,000 + 1?", "What is 1 - 3?"]
    responses = [" 2 + 3 = 5", " maybe 6 or 7", " I don't know", " It is 1,001.", " -2"]
    queries = [p + r for p, r in zip(prompts, responses)]
    out = fn(queries, prompts, [5, "6", 42, 1001, -2])
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert out.extra_logs["has_answer"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    # prompts' own numbers are ignored when the response is passed explicitly
    out = fn(queries, prompts, [5, 6, 42, 1001, -2], responses=responses)
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(RewardFunctionError, match="failed on sample 1 of 2: ValueError: .*no label"):
        fn(["1", "2"], ["a", "b"], [1, None])


def test_random_example_returns_binary_rewards():
    out = RewardFunction(os.path.join(EXAMPLES, "random_reward.py"))(["q"] * 64, ["p"] * 64, [None] * 64)
    assert out.rewards.shape == (64,)
    assert set(out.rewards.tolist()) == {0.0, 1.0}
    assert torch.equal(out.extra_logs["dummy_scores"], out.rewards)
