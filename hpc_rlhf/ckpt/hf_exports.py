"""HF exports to pick a checkpoint from (``ckpt.save_hf``, ``ckpt.best_metric``): ``<train.output_dir>/hf/``.

    hf/step_<N>/          the actor in HF format at checkpoint N (``critic/`` inside with ``ckpt.save_critic_hf``)
    hf/BEST               JSON {"step", "path", "metric", "value"}: the export with the best metric so far

An export is written under ``hf/.tmp_step_<N>`` and renamed into place, so ``step_<N>`` is always whole. Rotation
keeps the newest ``ckpt.max_num`` exports and, always, the one ``BEST`` names. No torch here.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from hpc_rlhf.ckpt.atomic import (
    TMP_PREFIX,
    clean_temp_dirs,
    discard_dir,
    fsync_dir,
    load_json,
    parse_step_name,
    save_json_atomic,
)

log = logging.getLogger(__name__)
HF_DIR = "hf"
BEST_NAME = "BEST"


def improves(value: float, best: float | None, mode: str) -> bool:
    """Whether ``value`` is strictly better than ``best`` (None: nothing yet) under ``mode`` ("max" or "min");
    NaN never improves."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


class HFExports:
    """Owns ``<output_dir>/hf``. Directory work is done by the one process that calls it (rank 0)."""

    def __init__(self, output_dir: str | Path, max_num: int | None) -> None:
        self.root = Path(output_dir) / HF_DIR
        self.max_num = max_num

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def tmp_dir(self, step: int) -> Path:
        return self.root / f"{TMP_PREFIX}step_{step}"

    @property
    def best_file(self) -> Path:
        return self.root / BEST_NAME

    def prepare(self, step: int) -> Path:
        """A fresh temporary directory for export ``step`` (leftovers of an interrupted export removed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        clean_temp_dirs(self.root)
        tmp = self.tmp_dir(step)
        tmp.mkdir()
        fsync_dir(self.root)
        return tmp

    def commit(self, step: int) -> Path:
        """Rename the temporary export into ``step_<N>`` (replacing an older one of that step, e.g. after a resume)."""
        final = self.step_dir(step)
        if final.exists():
            discard_dir(self.root, final, "replaced")
        self.tmp_dir(step).rename(final)
        fsync_dir(self.root)
        return final

    def best(self) -> dict | None:
        return load_json(self.best_file) if self.best_file.is_file() else None

    def update_best(self, step: int, metric: str, value: float, mode: str) -> bool:
        """Point ``BEST`` at export ``step`` when ``value`` improves on the recorded best; returns whether it moved."""
        current = self.best()
        best_value = current["value"] if current is not None and current.get("metric") == metric else None
        if not improves(value, best_value, mode):
            return False
        save_json_atomic(self.best_file, {"step": step, "path": self.step_dir(step).name, "metric": metric,
                                          "value": value})
        log.info("hf/%s: %s=%.4f is the best so far (was %s)", self.step_dir(step).name, metric, value, best_value)
        return True

    def rotate(self) -> list[Path]:
        """Delete all but the newest ``max_num`` exports, never the best one; returns the deleted paths."""
        if self.max_num is None or not self.root.is_dir():
            return []
        best = self.best()
        keep_best = self.root / best["path"] if best else None
        exports = sorted((parse_step_name(d.name), d) for d in self.root.iterdir()
                         if d.is_dir() and parse_step_name(d.name) is not None)
        deleted = []
        for _, stale in exports[: max(0, len(exports) - self.max_num)]:
            if stale == keep_best:
                continue
            discard_dir(self.root, stale, "delete")
            deleted.append(stale)
        fsync_dir(self.root)
        return deleted
