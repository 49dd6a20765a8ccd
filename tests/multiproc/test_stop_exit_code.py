"""A run stopped by SIGUSR1/SIGTERM outside SLURM checkpoints and exits with STOPPED_EXIT_CODE, not 0, so a wrapper
can tell "stopped, resume me" from "finished" (the real train_sft entry point, one rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_rlhf.resilience.preemption import STOPPED_EXIT_CODE
from tests.multiproc.spawn import _free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# The signal arrives during start-up: the guard remembers it and the first step boundary stops the run.
DRIVER = textwrap.dedent("""
    import os, signal, sys
    from hpc_rlhf.resilience.preemption import preemption_guard
    preemption_guard()
    os.kill(os.getpid(), signal.SIGUSR1)
    from hpc_rlhf.cli.train_sft import main
    main(sys.argv[1:])
""")


def test_signal_outside_slurm_exits_with_the_stopped_status(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "sft"
    args = ["--config", str(ROOT / "configs/sft_tiny_cpu.yaml"), f"model.pretrain={tmp_path / 'tiny'}",
            f"data.train_data=[{tmp_path / 'train.jsonl'}]", f"data.eval_data=[{tmp_path / 'eval.jsonl'}]",
            "data.synthetic_num_samples=256", f"train.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-c", DRIVER, *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == STOPPED_EXIT_CODE, proc.stderr[-3000:]
    assert "ckpt.load=true" in proc.stderr
    assert (out / "ckpt" / "LATEST").read_text().strip() == "step_1"
    assert not (out / "model").exists()
