"""pass@k (Chen et al. 2021) by hand and by enumeration; the per-source eval metrics and schedule."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from hpc_rlhf.algos import pass_at_k, powers_of_two_up_to
from hpc_rlhf.trainers.rl.evaluation import eval_metrics, is_eval_step


def test_pass_at_k_by_hand_n4_c1():
    # 1 - C(3, k) / C(4, k): 1 - 3/4, 1 - 3/6, 1 - 0/1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == pytest.approx(1.0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_matches_brute_force_enumeration(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            expected = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="k=5, n=4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 1)


def test_powers_of_two():
    assert powers_of_two_up_to(1) == [1]
    assert powers_of_two_up_to(6) == [1, 2, 4]
    assert powers_of_two_up_to(8) == [1, 2, 4, 8]


def _t(score, length=3, truncated=False):
    return SimpleNamespace(score=score, reward=score + 0.5, response_ids=[0] * length, truncated=truncated)


def test_eval_metrics_per_source_and_overall():
    samples = [
        ("math", [_t(1.0), _t(0.0), _t(0.0), _t(0.0)]),       # c=1
        ("math", [_t(0.0), _t(0.0), _t(0.0), _t(0.0)]),       # c=0
        ("code", [_t(1.0, 5, True), _t(1.0), _t(1.0), _t(1.0)]),  # c=4
    ]
    row = eval_metrics(samples, 4, pass_threshold=1.0)
    assert row["eval/math/pass@1"] == pytest.approx(0.125)
    assert row["eval/math/pass@2"] == pytest.approx(0.25)
    assert row["eval/math/pass@4"] == pytest.approx(0.5)
    assert row["eval/math/mean@4"] == pytest.approx(1 / 8)
    assert row["eval/code/pass@1"] == 1.0 and row["eval/code/truncated_fraction"] == 0.25
    assert row["eval/code/response_length"] == pytest.approx(3.5)
    assert row["eval/all/pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert row["eval/all/num_prompts"] == 3.0
    assert "eval/all/pass@8" not in row


def test_eval_metrics_threshold_and_group_size():
    row = eval_metrics([("a", [_t(0.6)])], 1, pass_threshold=0.5)
    assert row["eval/a/pass@1"] == 1.0
    with pytest.raises(ValueError, match="eval.n_samples_per_prompt=2"):
        eval_metrics([("a", [_t(0.6)])], 2, pass_threshold=0.5)


def test_eval_schedule_every_n_and_last():
    assert [s for s in range(1, 8) if is_eval_step(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 8) if is_eval_step(s, 7, None)] == [7]


def test_eval_samples_go_back_to_their_prompts_across_engines():
    """Engines number their share's prompts from 0; a branching episode counts once (its first row)."""
    from hpc_rlhf.trainers.rl.evaluation import group_by_prompt
    from hpc_rlhf.trainers.rl.roles import split_even

    prompts = ["p0", "p1", "p2", "p3", "p4"]
    shares = split_even(prompts, 2)
    assert shares == [["p0", "p1"], ["p2", "p3", "p4"]]  # contiguous, sizes differ by at most one

    def row(prompt, group, branch=0):
        return SimpleNamespace(prompt=prompt, group_index=group, branch_index=branch)

    engine0 = [row("p0", 0), row("p1", 1), row("p1", 1, branch=1)]
    engine1 = [row("p2", 0), row("p3", 1), row("p4", 2)]
    per_prompt, rows = group_by_prompt(shares, [(engine0, 1.0), (engine1, 2.0)])
    assert [[t.prompt for t in group] for group in per_prompt] == [["p0"], ["p1"], ["p2"], ["p3"], ["p4"]]
    assert rows == engine0 + engine1
