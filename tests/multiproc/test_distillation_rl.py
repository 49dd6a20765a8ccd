"""On-policy distillation on 2 gloo ranks: a weak student learns single-digit sums from a fitted teacher through the
teacher's per-token scores alone (the task reward is logged, not trained on); and the teacher role runs in the
asynchronous, disaggregated loop beside the actor."""

from __future__ import annotations

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, fit_addition_model, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
EXACT_REWARD = str(ROOT / "examples/reward_funcs/arithmetic.py")
ACCURACY = "eval/facts/pass@1"


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()


def _overrides(student: str, teacher: str, facts: str, out, *extra: str) -> list[str]:
    return [
        f"actor.pretrain={student}", "actor.learning_rate=1e-3", "actor.lr_warmup_ratio=0", "actor.min_lr_ratio=1",
        f"teacher.pretrain={teacher}", "algo.advantage_estimator=distill", f"reward.reward_func_path={EXACT_REWARD}",
        "rollout.n_samples_per_prompt=8", "rollout.rollout_batch_size=8", "rollout.micro_rollout_batch_size=32",
        "rollout.generate_max_len=4", "ds.zero_stage=2", f"train.output_dir={out}", "train.num_episodes=100",
        "train.train_batch_size=64", "train.micro_train_batch_size=32", f"data.prompt_data=[{facts}]",
        "data.input_key=input", "data.label_key=label", "data.prompt_max_len=16", "logger.use_tensorboard=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def addition_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("distill_models")
    facts = base / "facts.jsonl"
    # The same model fitted for 40 and for 100 full-batch steps: greedy accuracy about 0.1 and 0.95 on the sums.
    student = fit_addition_model(base / "student", facts, steps=40, seed=0)["model"]
    teacher = fit_addition_model(base / "teacher", facts, steps=100, seed=0)["model"]
    return {"student": student, "teacher": teacher, "facts": str(facts)}


def test_distillation_raises_the_students_accuracy_toward_the_teachers(addition_models, tmp_path):
    m = addition_models
    out = tmp_path / "distill"
    run_on_ranks(_fit, 2, _overrides(m["student"], m["teacher"], m["facts"], out, "train.max_steps=50",
                                     f"eval.data=[{m['facts']}]", "eval.steps=50", "eval.at_start=true",
                                     "eval.temperature=0"))
    rows = read_metrics(out)
    evals = [r[ACCURACY] for r in rows if ACCURACY in r]
    assert len(evals) == 2, evals  # before the first step and after the last
    # The only training signal is the teacher's: without it (or with its sign flipped) the student stays or drops.
    assert evals[1] >= evals[0] + 0.1, evals
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert len(steps) == 50
    first = sum(r["distill/reverse_kl"] for r in steps[:10]) / 10
    last = sum(r["distill/reverse_kl"] for r in steps[-10:]) / 10
    assert last < 0.8 * first, (first, last)
    assert all(r["distill/teacher_logprob"] <= 0 for r in steps)


def test_teacher_beside_the_actor_in_the_async_loop(addition_models, tmp_path):
    """Rank 0: actor and teacher (train.colocate_actor_ref); rank 1: rollout, one batch ahead. The teacher's term
    is added to GRPO's advantage (the mixed mode)."""
    m = addition_models
    out = tmp_path / "async"
    run_on_ranks(_fit, 2, _overrides(m["student"], m["teacher"], m["facts"], out, "train.max_steps=3",
                                     "algo.advantage_estimator=group_norm", "algo.distill_coef=0.5",
                                     "train.colocate_all=false", "train.colocate_actor_ref=true",
                                     "actor.num_ranks=1", "train.async_train=true"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["distill/reverse_kl"] == row["distill/reverse_kl"]  # not NaN
        assert row["distill/teacher_logprob"] < 0
    assert max(r["async/staleness_max"] for r in rows) == 1
