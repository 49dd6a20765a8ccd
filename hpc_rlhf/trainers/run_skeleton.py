"""The run skeleton shared by the RL trainer and the offline trainers: everything around the step.

A trainer supplies the step, its evaluation, its metrics row, its checkpoint and its export through
:class:`RunHooks`; :func:`run` owns the order they happen in, the schedules, and what bounds them::

    [resume]                                     checkpoint phase limit (RL; offline trainers restore while built)
    [eval at start]                              eval phase limit; step 0 in metrics.jsonl
    before_steps
    for each remaining step:
        run_step                                 timing/step; the stall guard learns its duration
        [eval]                                   every plan.eval_every steps and the last; eval phase limit
        metrics row -> metrics.jsonl             every logger.logging_steps steps, the last and every eval step
        progress bar, health check
        preemption agreement                     collective: any rank signalled -> every rank stops
        [checkpoint]                             every ckpt.save_steps steps, and before a stop
        [stop: requeue]                          rank 0 asks SLURM to requeue the job (slurm.requeue)
    after_steps
    [export]                                     unless stopped; checkpoint phase limit (a write as large as a save)
    finish

Every phase runs under the ``StallGuard`` (a hang ends the job with status 124 and stack dumps); a failure
that a dead peer caused names that peer before it propagates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from hpc_rlhf.resilience.preemption import preemption_guard, requeue_if_enabled
from hpc_rlhf.resilience.stall_guard import StallGuard
from hpc_rlhf.utils.metrics import MetricsLogger, PhaseTimer, is_logging_step

Row = dict[str, Any]


@dataclass(frozen=True)
class RunPlan:
    """The schedules of one run (steps are 1-based; step 0 is the state before the first step)."""

    num_steps: int
    rank: int
    logging_steps: int = 1  # logger.logging_steps: rows written every N steps and the last (eval steps always)
    save_steps: int | None = None  # ckpt.save_steps; None: only the checkpoint before a signalled stop
    save_last_step: bool = False  # whether the last step is a save step too (RL; the offline export stands for it)
    evaluates: bool = False  # whether there is held-out data to evaluate on
    eval_every: int | None = None  # evaluate every N steps; the last step always evaluates
    eval_at_start: bool = False  # with `evaluates`: evaluate the initial weights when the run starts at step 0
    resume: bool = False  # restore the latest checkpoint first (RL's ckpt.load), under the checkpoint phase limit
    start_step: int = 0  # steps done before the run without `resume` (an offline trainer restores while it is
    # built: its metrics file is opened for the restored step, and callers read that step before fit)
    requeue: bool = False  # slurm.requeue: after a signalled stop, rank 0 requeues the SLURM job
    progress_bar: bool = False  # a tqdm bar of the steps on this rank

    def eval_due(self, step: int) -> bool:
        return self.evaluates and (step == self.num_steps or bool(self.eval_every and step % self.eval_every == 0))

    def log_due(self, step: int) -> bool:
        return is_logging_step(step, self.num_steps, self.logging_steps)

    def save_due(self, step: int) -> bool:
        if not self.save_steps:
            return False
        return step % self.save_steps == 0 or (self.save_last_step and step == self.num_steps)


@dataclass
class RunOutcome:
    history: list[Row] = field(default_factory=list)  # the rows history_row kept, in order
    stopped_by_signal: bool = False  # SIGUSR1/SIGTERM: checkpointed and stopped early, nothing exported
    requeued: bool = False  # with stopped_by_signal: SLURM restarts the job (the CLI's exit status reads it)


class RunHooks:
    """What a trainer gives the skeleton. Every hook is called on every rank (collective ones included);
    those returning rows return None on ranks that keep none. The defaults do nothing."""

    metrics: MetricsLogger | None = None  # rank 0's metrics.jsonl; None elsewhere

    def resume(self) -> int:
        """Restore the latest checkpoint (only with ``RunPlan.resume``); returns its step, 0 when there is none."""
        return 0

    def before_steps(self, start: int) -> None:
        """After any eval at start, before step ``start + 1`` (the asynchronous RL trainer fills its queue)."""

    def run_step(self, step: int, timer: PhaseTimer) -> Any:
        """Train step ``step``; time its phases on ``timer``. The result goes to :meth:`metrics_row` only."""
        raise NotImplementedError

    def run_eval(self, step: int) -> Row | None:
        """Collective: evaluate the weights after ``step`` steps; the eval metrics (rank 0 at least)."""
        raise NotImplementedError

    def metrics_row(self, step: int, result: Any, eval_row: Row | None, timer: PhaseTimer) -> Row | None:
        """The step's metrics row from the step result, the eval metrics (eval steps) and the phase timings."""
        raise NotImplementedError

    def history_row(self, step: int, row: Row) -> Row | None:
        """The entry :func:`run` returns for a recorded row (step 0: the eval at start), or None to keep none;
        also where a trainer writes its own log line of the row."""
        return row

    def progress_postfix(self, row: Row) -> dict[str, str]:
        """What the progress bar shows after a step."""
        return {}

    def check_health(self, step: int) -> None:
        """Collective: raise to end the run (the RL trainer's agent failure limit)."""

    def save_checkpoint(self, step: int) -> None:
        """Collective: write the checkpoint of step ``step``."""
        raise NotImplementedError

    def after_steps(self) -> None:
        """After the last step run (also after a signalled stop), before the export."""

    def export(self) -> None:
        """Collective: the final model (skipped after a signalled stop)."""

    def finish(self) -> None:
        """Last, once the stall guard is stopped (closing the metrics sinks)."""


def run(hooks: RunHooks, plan: RunPlan, guard: StallGuard) -> RunOutcome:
    """Run ``plan`` with ``hooks`` under ``guard`` (started here, stopped on success)."""
    guard.start()
    try:
        outcome = _run_steps(hooks, plan, guard)
        hooks.after_steps()
        if not outcome.stopped_by_signal:
            with guard.phase("checkpoint"):  # the HF export: a write as large as a save
                hooks.export()
    except Exception as exc:
        guard.explain_failure(exc)
        raise
    guard.stop()
    hooks.finish()
    return outcome


def _run_steps(hooks: RunHooks, plan: RunPlan, guard: StallGuard) -> RunOutcome:
    outcome = RunOutcome()
    start = plan.start_step
    if plan.resume:
        with guard.phase("checkpoint"):
            start = hooks.resume()
    preemption = preemption_guard()
    if start == 0 and plan.evaluates and plan.eval_at_start:
        with guard.phase("eval"):
            eval_row = hooks.run_eval(0)  # the initial weights: the baseline every later eval compares with
        _record(hooks, plan, outcome, 0, eval_row, evaluated=True)
    hooks.before_steps(start)
    progress = tqdm(total=plan.num_steps, desc="steps", disable=not plan.progress_bar, dynamic_ncols=True)
    progress.update(start)
    for step in range(start + 1, plan.num_steps + 1):
        timer = PhaseTimer()
        with timer("step"):
            result = hooks.run_step(step, timer)
        eval_row = None
        if plan.eval_due(step):
            with timer("eval"), guard.phase("eval"):
                eval_row = hooks.run_eval(step)
        row = hooks.metrics_row(step, result, eval_row, timer)
        if row is not None:
            _record(hooks, plan, outcome, step, row, evaluated=eval_row is not None)
            postfix = hooks.progress_postfix(row)
            if postfix:
                progress.set_postfix(postfix, refresh=False)
        progress.update(1)
        hooks.check_health(step)
        guard.step_done(timer.seconds["step"])  # evaluation and saves have limits of their own
        stop = preemption.agreed_stop()
        if stop or plan.save_due(step):
            with guard.phase("checkpoint"):
                hooks.save_checkpoint(step)
        if stop:
            outcome.stopped_by_signal = True
            outcome.requeued = requeue_if_enabled(plan.requeue, plan.rank)
            break
    progress.close()
    return outcome


def _record(hooks: RunHooks, plan: RunPlan, outcome: RunOutcome, step: int, row: Row | None,
            evaluated: bool) -> None:
    """Write ``row`` to metrics.jsonl when it is due (an eval step, or a logging step) and keep its history entry."""
    if row is None:
        return
    if hooks.metrics is not None and (evaluated or plan.log_due(step)):
        hooks.metrics.log(step, row)
    kept = hooks.history_row(step, row)
    if kept is not None:
        outcome.history.append(kept)
