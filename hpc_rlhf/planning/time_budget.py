"""A SLURM time budget against the predicted step time: steps per time limit, and the warning signal's grace.

SLURM sends ``USR1`` ``<grace>`` seconds before the time limit (``#SBATCH --signal=USR1@<grace>``); the trainer
finishes the step it is in, writes a checkpoint and requeues. The grace must therefore cover one whole step
(the signal may arrive just after a step began) plus one checkpoint save, or the job is killed mid-save and
loses everything since the previous checkpoint. Pure Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hpc_rlhf.planning.devices import Device
from hpc_rlhf.planning.step_time import StepTime


class GraceTooShort(ValueError):
    """The warning signal leaves less time than one step plus one checkpoint save."""


def slurm_time_seconds(value: str) -> int:
    """SLURM ``--time`` syntax (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``) -> seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not match:
        raise ValueError(f"time limit {value!r} is not SLURM time syntax (e.g. 30, 04:00:00, 2-00:00:00)")
    days, first, second, third = match.groups()
    a = int(first)
    if days is not None:  # D-H[:M[:S]]
        return int(days) * 86400 + a * 3600 + int(second or 0) * 60 + int(third or 0)
    if third is not None:  # H:M:S
        return a * 3600 + int(second) * 60 + int(third)
    if second is not None:  # M:S
        return a * 60 + int(second)
    return a * 60  # M


_SIGNAL = re.compile(r"^(?:B:)?(?:SIG)?USR1(?:@(\d+))?$")


@dataclass(frozen=True)
class SlurmBudget:
    time_s: int | None
    grace_s: int | None
    source: str | None  # where the grace came from, for messages

    @staticmethod
    def resolve(time: str | None, grace_s: int | None, from_file: SlurmBudget, slurm) -> SlurmBudget:
        """Flags first, then the sbatch file, then the recipe's ``slurm:`` section."""
        time_s = slurm_time_seconds(time) if time else from_file.time_s or slurm_time_seconds(slurm.time)
        if grace_s is not None:
            return SlurmBudget(time_s, grace_s, "--signal-grace-s")
        if from_file.grace_s is not None:
            return SlurmBudget(time_s, from_file.grace_s, from_file.source)
        return SlurmBudget(time_s, slurm.signal_grace_s, "slurm.signal_grace_s")


def read_sbatch_budget(path: str) -> SlurmBudget:
    """``#SBATCH --time`` / ``-t`` and ``--signal=[B:]USR1@<grace>`` of an sbatch file (SLURM's default grace is
    60 s when ``@`` is left out)."""
    time_s = grace_s = None
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#SBATCH"):
            continue
        tokens = line[len("#SBATCH"):].split()
        for i, token in enumerate(tokens):
            key, eq, value = token.partition("=")
            if not eq and i + 1 < len(tokens):  # "--time 04:00:00", "-t 30"
                value = tokens[i + 1]
            if key in ("--time", "-t") and value:
                time_s = slurm_time_seconds(value)
            elif key == "--signal" and (m := _SIGNAL.match(value)):
                grace_s = int(m.group(1) or 60)
    return SlurmBudget(time_s, grace_s, f"--signal in {Path(path).name}")


def grace_check(step: StepTime, budget: SlurmBudget) -> None:
    needed = step.step_s + step.checkpoint_save_s
    if budget.grace_s is not None and budget.grace_s < needed:
        raise GraceTooShort(
            f"the USR1 warning comes {budget.grace_s} s before the time limit ({budget.source}), less than one step "
            f"({step.step_s:.0f} s) plus one checkpoint save ({step.checkpoint_save_s:.0f} s) = {needed:.0f} s "
            f"predicted; raise the grace above {needed:.0f} s, with margin (e.g. {needed * 1.5:.0f} s: #SBATCH "
            "--signal=USR1@<s>, slurm.signal_grace_s), or give your filesystem's bandwidth (--fs-gbps)")


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s < 1 else f"{s:.1f} s" if s < 600 else f"{s:.0f} s ({s / 3600:.2f} h)"


def time_lines(step: StepTime, budget: SlurmBudget, device: Device) -> list[str]:
    """The plan's step-time section."""
    lines = [f"step time (predicted on {device.name}; model and sources: docs/step_time.md):"]
    width = max(len(p.name) for p in (*step.phases, *([step.overlap] if step.overlap else [])))
    lines += [f"  {p.name:<{width}}  {_seconds(p.seconds):>10}  {p.detail}" for p in step.phases]
    if step.overlap is not None:
        overlap = step.overlap
        lines.append(f"  {overlap.name:<{width}}  {'-' + _seconds(overlap.seconds):>10}  {overlap.detail}")
    lines.append(f"  {'step':<{width}}  {_seconds(step.step_s):>10}")
    size = step.checkpoint_bytes
    size_text = f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    lines.append(f"  checkpoint: {size_text}, save {_seconds(step.checkpoint_save_s)}, "
                 f"load {_seconds(step.checkpoint_load_s)} at {device.fs_bw / 1e9:g} GB/s")
    if budget.time_s is not None:
        usable = budget.time_s - (budget.grace_s or 0) - step.checkpoint_load_s
        steps = max(0, int(usable // step.step_s)) if step.step_s > 0 else 0
        lines.append(f"  time limit {budget.time_s} s ({budget.time_s / 3600:.1f} h): about {steps} steps per job "
                     "(after loading a checkpoint, before the warning signal)")
    if budget.grace_s is not None:
        needed = step.step_s + step.checkpoint_save_s
        verdict = "enough" if budget.grace_s >= needed else "TOO SHORT"
        lines.append(f"  signal grace {budget.grace_s} s ({budget.source}) vs one step + one checkpoint save "
                     f"{needed:.0f} s: {verdict}")
    return lines
