"""Step metrics: ``metrics.jsonl`` (always), TensorBoard (``logger.use_tensorboard``, on by default) and
wandb (``logger.use_wandb``).

Only the controller (rank 0) writes. Each logged step is one JSON object on one line, flushed at once, so
a crashed run keeps every logged step. Trainers log every ``logger.logging_steps`` steps and the last
one (:func:`is_logging_step`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpc_rlhf.config.redact import public_config
from hpc_rlhf.config.schema import LoggerConfig

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"


def is_logging_step(step: int, num_steps: int, logging_steps: int) -> bool:
    """Whether step ``step`` (1-based) of ``num_steps`` is written: every ``logging_steps``-th, as OpenRLHF's
    ``--logging_steps``, and the last one so a run always ends with its final numbers."""
    return step % logging_steps == 0 or step == num_steps


class PhaseTimer:
    """Wall time per phase of a step: ``with timer("generation"): ...`` -> ``timing/generation``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    def __init__(self, output_dir: str | Path, cfg: LoggerConfig, run_config: dict | None = None,
                 resume: bool = False) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS_FILE
        if not resume and self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        self._tb = None
        if cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow to import; only with use_tensorboard

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self._wandb = None
        if cfg.use_wandb:
            try:
                import wandb  # optional, and slow to import
            except ImportError as err:
                raise ImportError("logger.use_wandb=true needs `pip install wandb`") from err
            # The run's config as saved (config.redact): ${oc.env:NAME} secrets and URL credentials stay out.
            public = public_config(run_config) if run_config is not None else None
            self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=public,
                                     dir=str(self.dir), resume="allow")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop rows of steps that were logged after the checkpoint being resumed."""
        self._file.close()
        rows = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step] if self.path.exists() else []
        self.path.write_text("".join(r + "\n" for r in rows))
        self._file = self.path.open("a")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
