"""DeepSpeed's universal checkpoint: a trained role's states re-partitioned for another layout.

A DeepSpeed checkpoint stores each data-parallel rank's ZeRO partition (and, under AutoTP, each tensor-parallel
rank's slice) as saved; it loads only into the same partitioning. DeepSpeed's ``ds_to_universal`` rewrites it as one
folder per parameter holding the whole fp32 master weight and Adam moments; an engine with
``load_universal_checkpoint`` then takes its own partition of each, whatever its data-parallel size, ZeRO stage or
tensor-parallel size (DeepSpeed 0.19: ZeRO 1-3, AutoTP merges; see ``hpc_rlhf.ckpt.layout`` for when it is used).

The conversion runs once per checkpoint and role, on one rank, as DeepSpeed's own script in a subprocess (it uses
worker pools); its output goes next to the checkpoints, ``<ckpt root>/universal/step_<N>/<role>``, written to a
temporary folder and renamed, so a crash mid-conversion leaves nothing half-written to load, and the checkpoint
itself (verified against its manifest) is never modified.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)
UNIVERSAL_DIR = "universal"


def universal_path(step_dir: str | Path, role: str) -> Path:
    """Where the universal copy of ``role``'s states in checkpoint ``step_dir`` lives."""
    step_dir = Path(step_dir)
    return step_dir.parent / UNIVERSAL_DIR / step_dir.name / role


def convert_to_universal(engine_dir: str | Path, tag: str, out: str | Path, workers: int = 1) -> Path:
    """The universal copy of ``<engine_dir>/<tag>`` (a role's DeepSpeed checkpoint) in ``out``, converting it if it
    does not exist yet; returns ``out``, the folder to pass to ``load_checkpoint(out, tag, universal=True)``.

    Raises:
        RuntimeError: DeepSpeed's conversion failed; the message holds the end of its output.
    """
    out = Path(out)
    if (out / tag).is_dir():
        return out
    source = Path(engine_dir) / tag
    tmp = out.with_name(f".tmp_{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.perf_counter()
    # --inject_missing_state: engines without AutoTP record no universal_checkpoint_info; the conversion needs only
    # its version marker for them. One worker per pool keeps its memory to one parameter at a time.
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
           "--output_folder", str(tmp / tag), "--inject_missing_state", "--num_extract_workers", str(workers),
           "--num_merge_workers", str(workers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"converting {source} to DeepSpeed's universal checkpoint failed (exit {proc.returncode}):"
                           f"\n{(proc.stdout + proc.stderr)[-3000:]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    _drop_other_steps(out.parent.parent, keep=out.parent.name)
    log.info("converted %s to a universal checkpoint in %s (%.1f s)", source, out, time.perf_counter() - started)
    return out


def load_resharded(engine, step_dir: str | Path, role: str, engine_dir: str | Path, tag: str) -> None:
    """Collective over the world: rank 0 converts ``<engine_dir>/<tag>`` (``role``'s DeepSpeed checkpoint in
    checkpoint ``step_dir``) to the universal format once; every rank learns the outcome, so a failed conversion
    raises everywhere instead of leaving the others waiting; then ``engine`` (a ``TrainEngine``, None on ranks that
    do not host the role) loads its partition of it."""
    out = universal_path(step_dir, role)
    box: list[str | None] = [None]  # rank 0's conversion error, if any
    if dist.get_rank() == 0:
        try:
            convert_to_universal(engine_dir, tag, out)
        except RuntimeError as err:
            box[0] = str(err)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(box[0])
    if engine is not None:
        engine.load_checkpoint(str(out), tag=tag, universal=True)


def _drop_other_steps(root: Path, keep: str) -> None:
    """Universal copies of other checkpoints: only the one being resumed is ever read again."""
    for entry in root.iterdir():
        if entry.is_dir() and entry.name != keep:
            shutil.rmtree(entry, ignore_errors=True)
