"""The shared run skeleton with a fake trainer: the order of the hooks, the eval / logging / checkpoint schedules,
which stall-guard phase bounds each of them, and a signalled stop (checkpoint, requeue, no export)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

from hpc_rlhf.resilience import preemption
from hpc_rlhf.trainers import run_skeleton
from hpc_rlhf.trainers.run_skeleton import RunHooks, RunPlan


class FakeGuard:
    """Records the phase each hook runs under and the step durations it learns."""

    def __init__(self) -> None:
        self.phase_now = "first_step"
        self.step_seconds: list[float] = []
        self.failures: list[BaseException] = []
        self.events: list[str] = []

    def start(self):
        self.events.append("guard.start")
        return self

    @contextmanager
    def phase(self, name):
        previous, self.phase_now = self.phase_now, name
        yield
        self.phase_now = previous

    def step_done(self, seconds):
        self.step_seconds.append(seconds)
        self.phase_now = "step"

    def stop(self):
        self.events.append("guard.stop")

    def explain_failure(self, exc):
        self.failures.append(exc)


class FakeMetrics:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, step, row):
        self.logged.append((step, dict(row)))


class FakeTrainer(RunHooks):
    """Each hook appends ``(name, step, guard phase)`` to ``calls``."""

    def __init__(self, guard: FakeGuard, resume_at: int = 0, eval_s: float = 0.0, fail_at: int | None = None):
        self.guard, self.resume_at, self.eval_s, self.fail_at = guard, resume_at, eval_s, fail_at
        self.metrics = FakeMetrics()
        self.calls: list[tuple[str, int | None, str]] = []

    def _call(self, name, step=None):
        self.calls.append((name, step, self.guard.phase_now))
        self.guard.events.append(name)

    def resume(self):
        self._call("resume", self.resume_at)
        return self.resume_at

    def before_steps(self, start):
        self._call("before_steps", start)

    def run_step(self, step, timer):
        self._call("run_step", step)
        if step == self.fail_at:
            raise RuntimeError("peer gone")
        with timer("train"):
            pass
        return {"loss": float(step)}

    def run_eval(self, step):
        self._call("run_eval", step)
        time.sleep(self.eval_s)
        return {"eval_loss": float(step)}

    def metrics_row(self, step, result, eval_row, timer):
        return {**result, **(eval_row or {}), **timer.metrics()}

    def history_row(self, step, row):
        return {"step": step, **row}

    def check_health(self, step):
        self._call("check_health", step)

    def save_checkpoint(self, step):
        self._call("save_checkpoint", step)

    def after_steps(self):
        self._call("after_steps")

    def export(self):
        self._call("export")

    def finish(self):
        self._call("finish")

    def steps_of(self, name):
        return [step for hook, step, _ in self.calls if hook == name]

    def phases_of(self, name):
        return {phase for hook, _, phase in self.calls if hook == name}


class FakePreemption:
    """Every rank agrees to stop at the ``stop_at``-th step boundary (a signal arrived during that step)."""

    def __init__(self, stop_at: int | None) -> None:
        self.stop_at, self.boundaries = stop_at, 0

    def agreed_stop(self):
        self.boundaries += 1
        return self.boundaries == self.stop_at


@pytest.fixture
def stop_at(monkeypatch):
    def install(boundary):
        monkeypatch.setattr(run_skeleton, "preemption_guard", lambda: FakePreemption(boundary))
    install(None)
    return install


@pytest.fixture
def requeue_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(preemption, "requeue_slurm_job", lambda: calls.append(True) or True)
    return calls


def _run(plan, **trainer_kwargs):
    guard = FakeGuard()
    trainer = FakeTrainer(guard, **trainer_kwargs)
    outcome = run_skeleton.run(trainer, plan, guard)
    return trainer, guard, outcome


def test_a_full_run_calls_the_hooks_in_order(stop_at):
    plan = RunPlan(num_steps=2, rank=0, evaluates=True, eval_every=1, eval_at_start=True, resume=True, save_steps=1)
    trainer, guard, outcome = _run(plan)
    assert guard.events == ["guard.start", "resume", "run_eval", "before_steps",
                            "run_step", "run_eval", "check_health", "save_checkpoint",
                            "run_step", "run_eval", "check_health", "save_checkpoint",
                            "after_steps", "export", "guard.stop", "finish"]
    assert [row["step"] for row in outcome.history] == [0, 1, 2]
    assert not outcome.stopped_by_signal and not outcome.requeued


@pytest.mark.parametrize(("save_steps", "save_last_step", "saved"), [
    (2, False, [2, 4]), (2, True, [2, 4, 5]), (5, True, [5]), (None, True, [])])
def test_checkpoint_schedule(stop_at, save_steps, save_last_step, saved):
    plan = RunPlan(num_steps=5, rank=0, save_steps=save_steps, save_last_step=save_last_step)
    trainer, _, _ = _run(plan)
    assert trainer.steps_of("save_checkpoint") == saved
    assert trainer.phases_of("save_checkpoint") <= {"checkpoint"}
    assert trainer.phases_of("export") == {"checkpoint"}


@pytest.mark.parametrize(("eval_every", "evaluated"), [(2, [2, 4, 5]), (None, [5]), (5, [5])])
def test_eval_schedule_every_n_steps_and_the_last(stop_at, eval_every, evaluated):
    trainer, _, outcome = _run(RunPlan(num_steps=5, rank=0, evaluates=True, eval_every=eval_every))
    assert trainer.steps_of("run_eval") == evaluated
    assert trainer.phases_of("run_eval") == {"eval"}
    assert [row["step"] for row in outcome.history if "eval_loss" in row] == evaluated


def test_no_eval_without_eval_data(stop_at):
    trainer, _, _ = _run(RunPlan(num_steps=3, rank=0, evaluates=False, eval_every=1, eval_at_start=True))
    assert trainer.steps_of("run_eval") == []


def test_eval_at_start_only_when_starting_at_step_0(stop_at):
    fresh, _, _ = _run(RunPlan(num_steps=3, rank=0, evaluates=True, eval_at_start=True))
    assert fresh.steps_of("run_eval") == [0, 3]
    resumed, _, outcome = _run(RunPlan(num_steps=3, rank=0, evaluates=True, eval_at_start=True, resume=True),
                               resume_at=1)
    assert resumed.steps_of("run_eval") == [3]
    assert resumed.steps_of("run_step") == [2, 3]
    assert resumed.phases_of("resume") == {"checkpoint"}
    assert [row["step"] for row in outcome.history] == [2, 3]


def test_start_step_without_resume_skips_done_steps(stop_at):
    trainer, _, _ = _run(RunPlan(num_steps=4, rank=0, start_step=2))
    assert trainer.steps_of("resume") == []
    assert trainer.steps_of("run_step") == [3, 4]


def test_metrics_are_written_on_logging_steps_the_last_and_every_eval(stop_at):
    plan = RunPlan(num_steps=7, rank=0, logging_steps=3, evaluates=True, eval_every=5, eval_at_start=True)
    trainer, _, outcome = _run(plan)
    assert [step for step, _ in trainer.metrics.logged] == [0, 3, 5, 6, 7]
    assert len(outcome.history) == 8  # every row is kept, logged or not
    assert trainer.metrics.logged[2][1]["eval_loss"] == 5.0


def test_the_guard_learns_the_step_time_without_the_eval(stop_at):
    trainer, guard, outcome = _run(RunPlan(num_steps=2, rank=0, evaluates=True, eval_every=1), eval_s=0.05)
    assert len(guard.step_seconds) == 2
    assert all(seconds < 0.05 for seconds in guard.step_seconds)
    assert all(row["timing/eval"] >= 0.05 and row["timing/step"] < 0.05 for row in outcome.history)


def test_an_agreed_stop_checkpoints_requeues_and_skips_the_export(stop_at, requeue_calls):
    stop_at(2)
    trainer, guard, outcome = _run(RunPlan(num_steps=5, rank=0, save_steps=4, requeue=True))
    assert trainer.steps_of("run_step") == [1, 2]
    assert trainer.steps_of("save_checkpoint") == [2]
    assert trainer.phases_of("save_checkpoint") == {"checkpoint"}
    assert trainer.steps_of("export") == []
    assert trainer.steps_of("after_steps") == [None] and trainer.steps_of("finish") == [None]
    assert outcome.stopped_by_signal and outcome.requeued and requeue_calls == [True]
    assert [row["step"] for row in outcome.history] == [1, 2]


def test_a_stop_without_requeue_is_reported_as_not_requeued(stop_at, requeue_calls):
    stop_at(1)
    _, _, outcome = _run(RunPlan(num_steps=3, rank=0, requeue=False))
    assert outcome.stopped_by_signal and not outcome.requeued and requeue_calls == []


def test_a_stop_on_a_save_step_saves_once(stop_at):
    stop_at(2)
    trainer, _, _ = _run(RunPlan(num_steps=5, rank=0, save_steps=2))
    assert trainer.steps_of("save_checkpoint") == [2]


def test_a_failing_step_is_explained_and_raised(stop_at):
    guard = FakeGuard()
    trainer = FakeTrainer(guard, fail_at=2)
    with pytest.raises(RuntimeError, match="peer gone"):
        run_skeleton.run(trainer, RunPlan(num_steps=3, rank=0), guard)
    assert [str(exc) for exc in guard.failures] == ["peer gone"]
    assert "guard.stop" not in guard.events and trainer.steps_of("finish") == []
    assert trainer.steps_of("export") == []


def test_a_rank_that_keeps_no_rows_still_runs_every_collective(stop_at):
    class NonController(FakeTrainer):
        def run_eval(self, step):
            super().run_eval(step)
            return None  # the eval metrics are rank 0's

        def metrics_row(self, step, result, eval_row, timer):
            return None

    guard = FakeGuard()
    trainer = NonController(guard)
    outcome = run_skeleton.run(trainer, RunPlan(num_steps=2, rank=1, evaluates=True, eval_at_start=True,
                                                save_steps=1), guard)
    assert outcome.history == [] and trainer.metrics.logged == []
    assert trainer.steps_of("run_eval") == [0, 2]
    assert trainer.steps_of("save_checkpoint") == [1, 2]
    assert trainer.steps_of("export") == [None]


def test_the_rl_plan_reads_the_run_config():
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.setup import run_plan

    cfg = load_config(None, ["ckpt.save_steps=3", "ckpt.load=true", "eval.steps=2", "eval.at_start=true",
                             "logger.logging_steps=4", "slurm.requeue=false"])
    plan = run_plan(cfg, num_steps=9, rank=1, is_controller=False)
    assert (plan.num_steps, plan.rank, plan.save_steps, plan.logging_steps, plan.eval_every) == (9, 1, 3, 4, 2)
    assert plan.resume and plan.save_last_step and not plan.requeue and not plan.progress_bar
    assert not plan.evaluates and not plan.eval_at_start  # no eval.data: nothing to evaluate
    with_data = run_plan(load_config(None, ["eval.data=[x.jsonl]"]), num_steps=9, rank=1, is_controller=False)
    assert with_data.evaluates and not with_data.eval_at_start and with_data.save_steps is None
