"""How the RL trainer plugs into the shared run skeleton (``hpc_rlhf.trainers.run_skeleton``).

The trainer keeps its phases (``step``, ``evaluate``, ``save_checkpoint``, ``resume``, ``export``); this adapter
says what the skeleton needs beyond them: the schedules of the run config, the controller's metrics row (phase
timings, the KL coefficient, the eval metrics; the data state learns from it), the progress bar's reward and the
agent failure check. Only the controller keeps rows; the eval at start goes to metrics.jsonl, not the history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_rlhf.trainers.run_skeleton import Row, RunHooks, RunPlan
from hpc_rlhf.utils.metrics import PhaseTimer

if TYPE_CHECKING:  # the trainer imports this module
    from hpc_rlhf.trainers.rl.loop import PPOTrainer


def rl_run_plan(trainer: PPOTrainer) -> RunPlan:
    cfg = trainer.cfg
    return RunPlan(num_steps=trainer.num_steps, rank=trainer.rank, logging_steps=cfg.logger.logging_steps,
                   save_steps=cfg.ckpt.save_steps, save_last_step=True, evaluates=bool(cfg.eval.data),
                   eval_every=cfg.eval.steps, eval_at_start=bool(cfg.eval.data) and cfg.eval.at_start,
                   resume=cfg.ckpt.load, requeue=cfg.slurm.requeue, progress_bar=trainer.world.is_controller)


class RLRunHooks(RunHooks):
    def __init__(self, trainer: PPOTrainer) -> None:
        self.trainer = trainer
        self.metrics = trainer.metrics

    def resume(self) -> int:
        return self.trainer.resume()

    def before_steps(self, start: int) -> None:
        self.trainer.before_steps(start)

    def run_step(self, step: int, timer: PhaseTimer) -> Row | None:
        return self.trainer.step(step, timer)

    def run_eval(self, step: int) -> Row | None:
        return self.trainer.evaluate(step)

    def metrics_row(self, step: int, result: Row | None, eval_row: Row | None, timer: PhaseTimer) -> Row | None:
        trainer = self.trainer
        if not trainer.world.is_controller:
            return None
        row = {**result, **timer.metrics(), "kl_coef": trainer.data.kl_controller.value}
        trainer.data.after_step(row)
        if eval_row is not None:
            row.update(eval_row)
        trainer.last_row = row  # ckpt.best_metric reads it when the step's HF export is saved
        return row

    def history_row(self, step: int, row: Row) -> Row | None:
        return row if step > 0 else None  # the eval at start is in metrics.jsonl only

    def progress_postfix(self, row: Row) -> dict[str, str]:
        return {"reward": f"{row['reward']:.3f}"}

    def check_health(self, step: int) -> None:
        self.trainer.stop_on_agent_failures()

    def save_checkpoint(self, step: int) -> None:
        self.trainer.save_checkpoint(step)

    def after_steps(self) -> None:
        rollout = self.trainer.roles.rollout
        if rollout is not None:  # e.g. the OpenAI-agent endpoint stops serving when training ends
            rollout.executor.close()

    def export(self) -> None:
        self.trainer.export()

    def finish(self) -> None:
        if self.metrics:
            self.metrics.close()

