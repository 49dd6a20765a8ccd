"""On-policy distillation: the per-token advantage by hand, its use in the step's advantages, the teacher's
placement and the refusal of a teacher with another tokenizer."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hpc_rlhf.algos import distill_advantages, reverse_kl_metrics
from hpc_rlhf.config import load_config
from hpc_rlhf.models.loading import check_same_tokenizer, load_tokenizer
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.trainers.rl.controller_steps import distillation_metrics, make_advantages
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from hpc_rlhf.world.placement import build_placement


def test_distill_advantage_two_tokens_by_hand():
    # One row, two generated tokens and one feedback token between... and after them padding.
    # token 1: teacher p = 0.5, student p = 0.25 -> log 0.5 - log 0.25 = log 2 (pushed up)
    # token 2: teacher p = 0.1, student p = 0.4  -> log 0.1 - log 0.4 = -log 4 (pushed down)
    teacher = torch.tensor([[math.log(0.5), math.log(0.1), -3.0, 0.0]])
    student = torch.tensor([[math.log(0.25), math.log(0.4), -7.0, 0.0]])
    mask = torch.tensor([[True, True, False, False]])
    got = distill_advantages(teacher, student, mask)
    assert got[0, 0].item() == pytest.approx(math.log(2.0), abs=1e-6)
    assert got[0, 1].item() == pytest.approx(-math.log(4.0), abs=1e-6)
    assert got[0, 2:].tolist() == [0.0, 0.0]  # a tool/environment token's teacher score is ignored
    doubled = distill_advantages(teacher, student, mask, coef=2.0)
    assert doubled[0, :2].tolist() == pytest.approx((2 * got[0, :2]).tolist())
    metrics = reverse_kl_metrics(teacher, student, mask)
    # reverse KL estimate = mean(log student - log teacher) = (-log 2 + log 4) / 2 = log(2) / 2
    assert metrics["reverse_kl"] == pytest.approx(math.log(2.0) / 2, abs=1e-6)
    assert metrics["teacher_logprob"] == pytest.approx((math.log(0.5) + math.log(0.1)) / 2, abs=1e-6)


def test_distill_advantage_ignores_masked_infinities():
    teacher = torch.tensor([[-1.0, -float("inf")]])
    student = torch.tensor([[-2.0, float("nan")]])
    got = distill_advantages(teacher, student, torch.tensor([[True, False]]))
    assert got.tolist() == [[1.0, 0.0]]


def test_distill_advantage_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must be"):
        distill_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))


def _batch(teacher: list[list[float]], student: list[list[float]], rewards: list[float]) -> StepBatch:
    rows = len(rewards)
    width = len(teacher[0])
    return StepBatch(sequences=torch.ones(rows, 2 + width, dtype=torch.long),
                     attention_mask=torch.ones(rows, 2 + width, dtype=torch.long),
                     action_mask=torch.ones(rows, width, dtype=torch.bool),
                     rollout_logprobs=torch.tensor(student), rewards=torch.tensor(rewards),
                     episode_index=torch.arange(rows), teacher_logprobs=torch.tensor(teacher))


def _cfg(*extra: str):
    return load_config(None, ["teacher.pretrain=/nonexistent/teacher", "rollout.n_samples_per_prompt=2",
                              "rollout.rollout_batch_size=1", "train.train_batch_size=2", *extra])


def test_distill_estimator_trains_on_the_teacher_alone():
    batch = _batch([[-1.0, -2.0], [-0.5, -0.5]], [[-2.0, -1.0], [-0.5, -1.5]], rewards=[1.0, 0.0])
    out = make_advantages(batch, _cfg("algo.advantage_estimator=distill", "algo.distill_coef=0.5"),
                          batch.rewards, kl_coef=0.0)
    assert out.advantages.tolist() == [[0.5, -0.5], [0.0, 0.5]]  # 0.5 x (teacher - student); rewards unused
    assert torch.equal(out.returns, out.advantages)
    row = distillation_metrics(out)
    assert row["distill/reverse_kl"] == pytest.approx((-1.0 + 1.0 + 0.0 - 1.0) / 4)  # mean(student - teacher)


def test_distill_term_is_added_to_the_task_advantage():
    batch = _batch([[-1.0, -2.0], [-0.5, -0.5]], [[-2.0, -1.0], [-0.5, -1.5]], rewards=[1.0, 0.0])
    cfg = _cfg("algo.advantage_estimator=dr_grpo")
    out = make_advantages(batch, cfg, batch.rewards, kl_coef=0.0)
    # Dr. GRPO: r - group mean = +0.5 / -0.5 on every token; plus teacher - student per token.
    assert out.advantages.tolist() == [[1.5, -0.5], [-0.5, 0.5]]
    assert out.returns.tolist() == [[0.5, 0.5], [-0.5, -0.5]]  # the critic's targets stay the task reward's


def test_student_logprobs_prefer_the_actor_forward():
    batch = _batch([[-1.0]], [[-2.0]], rewards=[0.0])
    assert batch.student_logprobs.tolist() == [[-2.0]]
    batch.old_logprobs = torch.tensor([[-3.0]])
    assert batch.student_logprobs.tolist() == [[-3.0]]


def test_distill_estimator_needs_a_teacher():
    with pytest.raises(ValueError, match="teacher.pretrain"):
        load_config(None, ["algo.advantage_estimator=distill"])


def test_teacher_is_placed_like_the_reference():
    colocated = build_placement(_cfg(), 2)
    assert colocated.roles["teacher"].ranks == (0, 1)
    split = build_placement(_cfg("train.colocate_all=false", "actor.num_ranks=1", "teacher.num_ranks=1",
                                 "rollout.num_engines=1"), 3)
    assert [(r["role"], r["ranks"]) for r in split.describe()] == [("actor", "0"), ("teacher", "1"),
                                                                   ("rollout", "2")]
    shared = build_placement(_cfg("train.colocate_all=false", "train.colocate_actor_ref=true", "actor.num_ranks=1",
                                  "algo.kl.init_coef=0.01"), 2)
    assert shared.roles["teacher"].ranks == shared.roles["ref"].ranks == shared.roles["actor"].ranks == (0,)
    assert "teacher" not in build_placement(load_config(None, []), 2).roles


def test_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    student_path = build_tiny_model(tmp_path / "student", seed=0)
    teacher_path = build_tiny_model(tmp_path / "teacher", seed=1)
    student = load_tokenizer(str(student_path), "actor.pretrain")
    check_same_tokenizer(student, "actor.pretrain", str(teacher_path), "teacher.pretrain")  # same vocabulary: fine

    # The teacher's tokenizer with one token renumbered, as a tokenizer of another model family would be.
    spec = json.loads((teacher_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError) as err:
        check_same_tokenizer(student, "actor.pretrain", str(teacher_path), "teacher.pretrain")
    message = str(err.value)
    assert f"teacher.pretrain={teacher_path}" in message and f"actor.pretrain={student_path}" in message
    assert "same tokenizer" in message


def test_plan_prints_the_teachers_placement_memory_and_forward(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from hpc_rlhf.cli.plan import plan

    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[2]
    student = build_tiny_model(tmp_path / "student", seed=0)
    teacher = build_tiny_model(tmp_path / "teacher", seed=1, hidden_size=128, intermediate_size=256)
    assert plan(["--config", str(root / "configs/grpo_tiny_cpu.yaml"), "--nodes", "1", "--gpus-per-node", "2",
                 f"actor.pretrain={student}", "actor.build_tiny=false", f"teacher.pretrain={teacher}",
                 "algo.advantage_estimator=distill"]) == 0
    out = capsys.readouterr().out
    teacher_row = next(line for line in out.splitlines() if line.startswith("teacher "))
    assert "0-1" in teacher_row and "w " in teacher_row  # on both ranks, with its weights' memory
    assert "teacher: " in out and "h=128" in out  # sized from its own config.json, not the actor's
    assert "teacher logprob" in out
    assert "+teacher+" in out  # counted in the ranks' memory
