"""End to end on a real local slurmctld/slurmd (``sudo bash .ci/setup_slurm.sh``): sbatch recipes,
submitit, multi-node rank/rendezvous logic, fail-fast, time-limit signal, preemption -> requeue -> resume, and a
job requeued on another number of tasks resuming through the universal checkpoint.

Each test submits a job from the repository root with its outputs in a tmp dir and polls
``scontrol show job`` (no slurmdbd here, so no sacct) with a bounded timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .conftest import FINAL, ROOT, job_info, sbatch, wait_for_state, wait_job, write_time_limit_job

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
TINY = ["train.max_steps=2"]


def _read(log: Path) -> str:
    # progress bars of two ranks interleave mid-character in one log
    return log.read_text(errors="replace")


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def test_cpu_debug_recipe_completes(tmp_path):
    log = tmp_path / "job.out"
    start = time.monotonic()
    job = sbatch("-o", str(log), "slurm/cpu_debug.sbatch", *TINY, f"train.output_dir={tmp_path / 'run'}")
    info = wait_job(job, 240, log)
    text = _read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    assert _steps(tmp_path / "run/metrics.jsonl") == [1, 2]
    assert (tmp_path / "run/model/config.json").exists()
    assert "fits" in text and "0: " in text and "1: " in text  # plan guard ran; two labelled ranks
    print(f"cpu_debug.sbatch: {time.monotonic() - start:.1f}s")


def test_cpu_debug_plan_guard_refuses_bad_layout(tmp_path):
    log = tmp_path / "job.out"
    # 2 ranks cannot host a tensor-parallel-4 rollout engine: plan must stop the job before srun.
    job = sbatch("-o", str(log), "slurm/cpu_debug.sbatch", "rollout.tensor_parallel_size=4",
                 f"train.output_dir={tmp_path / 'run'}")
    info = wait_job(job, 120, log)
    text = _read(log)
    assert info["JobState"] == "FAILED", text[-2000:]
    assert "plan rejected this layout" in text and "tensor_parallel_size" in text
    assert not (tmp_path / "run/metrics.jsonl").exists()


def test_submitit_submission_completes(tmp_path):
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "hpc_rlhf.cli.submit", "--config", "configs/grpo_tiny_cpu.yaml",
         "--partition", "debug", "--gpus-per-node", "0", "--tasks-per-node", "2", "--time", "00:20:00",
         "--wait", *TINY, f"train.output_dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "submitted job" in out.stdout and "_0_log.out" in out.stdout and "finished" in out.stdout
    assert _steps(tmp_path / "run/metrics.jsonl") == [1, 2]
    job_id = out.stdout.split("submitted job ")[1].split(":")[0]
    script = (tmp_path / "run/submitit" / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --signal=USR1@" in script and "#SBATCH --requeue" in script
    print(f"submitit: {time.monotonic() - start:.1f}s")


def test_two_node_rank_and_rendezvous_logic(tmp_path):
    """What it proves: with SLURM's 2-node / 1-task-per-node variables, launch_env derives node ranks
    0 and 1, local rank 0 on each, the first host as master and the same job-id port on both, and the
    two ranks rendezvous with nothing else exchanged. What it does not: real cross-host networking,
    NCCL interface choice, name resolution on other machines (all on one host here)."""
    log, result = tmp_path / "job.out", tmp_path / "ranks.json"
    script = tmp_path / "probe.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --cpus-per-task=1\n"
                      f"srun --kill-on-bad-exit=1 --label {sys.executable} tests/slurm/multinode_probe.py {result}\n")
    job = sbatch("-o", str(log), str(script))
    info = wait_job(job, 120, log)
    assert info["JobState"] == "COMPLETED", _read(log)[-3000:]
    data = json.loads(result.read_text())
    ranks = data["ranks"]
    assert data["all_reduce"] == 3.0
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert [r["node_rank"] for r in ranks] == [0, 1] and {r["num_nodes"] for r in ranks} == {2}
    assert [r["local_rank"] for r in ranks] == [0, 0] and {r["local_world_size"] for r in ranks} == {1}
    assert [r["my_node"] for r in ranks] == ["localhost", "127.0.0.1"]
    assert {r["launcher"] for r in ranks} == {"slurm"} and {r["job_id"] for r in ranks} == {job}
    assert {r["master_addr"] for r in ranks} == {"localhost"}
    assert {r["master_port"] for r in ranks} == {20000 + int(job) % 20000}


def test_one_failing_rank_ends_the_job_fast(tmp_path):
    log = tmp_path / "job.out"
    token = uuid.uuid4().hex[:12]
    script = tmp_path / "fail.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --cpus-per-task=1\n"
                      f"srun --kill-on-bad-exit=1 --label {sys.executable} tests/slurm/failing_rank.py {token}\n")
    job = sbatch("-o", str(log), str(script))
    start = time.monotonic()
    while job_info(job).get("JobState") in ("PENDING", "CONFIGURING", None):
        time.sleep(0.2)
    info = wait_job(job, 120, log)  # rank 0 would wait 600 s without --kill-on-bad-exit
    elapsed = time.monotonic() - start
    text = _read(log)
    assert info["JobState"] == "FAILED", text[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert any(line.startswith("1: ") and f"RuntimeError: rank 1 fails on purpose: {token}" in line
               for line in text.splitlines()), text[-3000:]  # the failing rank's error, labelled
    assert "rank 0: world up" in text and "wait returned" not in text
    print(f"fail-fast: job ended {elapsed:.1f}s after it started running")


@pytest.fixture(scope="module", autouse=True)
def time_limit_job(slurm_cluster, tmp_path_factory) -> tuple[str, Path]:
    """The time-limit job (``write_time_limit_job``), submitted before the module's first test so that its wait for
    the signal runs beside the other tests' jobs (the node takes them together)."""
    folder = tmp_path_factory.mktemp("time_limit")
    log = folder / "sig.out"
    job = sbatch("-o", str(log), str(write_time_limit_job(folder, "#SBATCH --ntasks=2", "#SBATCH --cpus-per-task=1")))
    yield job, log
    if job_info(job).get("JobState") not in FINAL:
        subprocess.run(["scancel", job], check=False)


def test_time_limit_signal_reaches_every_task(time_limit_job):
    """--signal=USR1@N (no B:) is delivered by the scheduler to the tasks of the srun step, not the shell."""
    job, log = time_limit_job
    info = wait_job(job, 150, log)
    text = _read(log)
    assert info["JobState"] == "COMPLETED", text
    assert re.search(r"task 0 on \S+ got USR1", text) and re.search(r"task 1 on \S+ got USR1", text), text
    assert "batch shell got USR1" not in text and "batch done" in text


def _wait_for_steps(job: str, metrics: Path, log: Path, at_least: int, restarts: int) -> None:
    """Until the job (after ``restarts`` restarts) is running and has logged ``at_least`` steps."""
    deadline = time.monotonic() + 240
    while True:
        info = job_info(job)
        lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if lines >= at_least and info.get("Restarts") == str(restarts) and info.get("JobState") == "RUNNING":
            return
        assert time.monotonic() < deadline, f"no progress to step {at_least}: " + (
            _read(log)[-2000:] if log.exists() else "")
        assert info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), _read(log)[-3000:]
        time.sleep(0.1)


COMPARED = ("reward", "score", "response_length", "policy_loss", "actor_grad_norm", "actor_lr")


def test_preemption_twice_resumes_to_the_uninterrupted_result(tmp_path):
    """USR1 to every rank mid-run -> ranks agree -> atomic checkpoint -> scontrol requeue -> the same job
    restarts (SLURM_RESTART_COUNT, log appended) with ckpt.load=true -> resumes at the next step. Twice,
    and the final metrics equal an uninterrupted job's."""
    num_steps = 30
    log, run = tmp_path / "job.out", tmp_path / "run"
    ref_log, ref_run = tmp_path / "ref.out", tmp_path / "ref"
    reference = sbatch("-o", str(ref_log), "slurm/cpu_debug.sbatch", f"train.max_steps={num_steps}",
                       f"train.output_dir={ref_run}")
    job = sbatch("-o", str(log), "slurm/cpu_debug.sbatch", f"train.max_steps={num_steps}",
                 f"train.output_dir={run}")
    metrics = run / "metrics.jsonl"
    _wait_for_steps(job, metrics, log, at_least=2, restarts=0)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)  # to every task of the running steps
    first_stop = None
    deadline = time.monotonic() + 240
    while first_stop is None:  # the restarted job appends after the resumed step
        info = job_info(job)
        if info.get("Restarts") == "1":
            first_stop = len(metrics.read_text().splitlines())
        assert time.monotonic() < deadline, _read(log)[-3000:]
        time.sleep(0.1)
    _wait_for_steps(job, metrics, log, at_least=first_stop + 2, restarts=1)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    info = wait_job(job, 400, log)
    text = _read(log)
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert info["Restarts"] == "2", text[-4000:]
    assert all(f"job {job} restart {i}" in text for i in range(3)) and "ckpt.load=true" in text
    assert text.count("resumed from") >= 2, text[-4000:]
    assert _steps(metrics) == list(range(1, num_steps + 1))  # nothing lost, nothing repeated
    assert (run / "model/config.json").exists()
    assert wait_job(reference, 300, ref_log)["JobState"] == "COMPLETED", _read(ref_log)[-3000:]
    got, want = _rows(metrics), _rows(ref_run / "metrics.jsonl")
    for a, b in zip(want, got, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


# 48 samples a step (6 prompts x 8): whole micro-batches of 4 on 2 or 3 data-parallel ranks.
RESIZABLE = ["rollout.rollout_batch_size=6", "train.train_batch_size=48", "train.micro_train_batch_size=4"]


def test_requeued_with_another_number_of_tasks_resumes_and_finishes(tmp_path):
    """A running 2-rank job is requeued and held in one request (``scontrol requeuehold``: SIGTERM to every rank,
    which checkpoint at the step boundary), given 3 tasks while pending and released: it restarts with
    ckpt.load=true on 3 ranks, loads the 2-rank checkpoint through DeepSpeed's universal checkpoint (dp 2 -> 3),
    logs every step once and exports the model. Also covers slurm/launch.sh taking the task counts from the new
    allocation (the job's stored environment keeps SLURM_NTASKS=2)."""
    num_steps = 30
    log, run = tmp_path / "job.out", tmp_path / "run"
    metrics = run / "metrics.jsonl"
    start = time.monotonic()
    job = sbatch("-o", str(log), "slurm/cpu_debug.sbatch", f"train.max_steps={num_steps}", "ckpt.save_steps=20",
                 *RESIZABLE, f"train.output_dir={run}")
    try:
        _wait_for_steps(job, metrics, log, at_least=2, restarts=0)
        # Requeue and hold at once, not `scancel --signal=USR1` then `scontrol hold`: the job cannot start again
        # between the two. Rank 0's own `scontrol requeue` after its checkpoint is then refused ("Job is pending
        # execution"), which leaves the job held.
        subprocess.run(["scontrol", "requeuehold", job], check=True, timeout=30)
        held = wait_for_state(job_info, job, "PENDING", log, 120)  # COMPLETING until every rank has exited
        assert held["Restarts"] == "1" and held["Priority"] == "0", held
        stopped = _steps(metrics)
        assert stopped == list(range(1, len(stopped) + 1)) and 2 <= len(stopped) < num_steps, stopped
        checkpoint = run / "ckpt" / (run / "ckpt/LATEST").read_text().strip()
        assert checkpoint.name == f"step_{len(stopped)}"  # the stop checkpoint, at the last logged step
        saved = json.loads((checkpoint / "layout.json").read_text())
        assert saved["world_size"] == 2 and saved["roles"]["actor"]["dp"] == 2, saved
        # The recipe's --ntasks-per-node=2 is stored in the job: TasksPerNode too, and the CPUs for 3 tasks.
        subprocess.run(["scontrol", "update", f"JobId={job}", "NumTasks=3", "TasksPerNode=3", "NumCPUs=3"],
                       check=True, timeout=30)
        resized = job_info(job)
        assert (resized["NumTasks"], resized["NumCPUs"]) == ("3", "3"), resized
        subprocess.run(["scontrol", "release", job], check=True, timeout=30)
        info = wait_job(job, 240, log)
    finally:
        if job_info(job).get("JobState") not in FINAL:
            subprocess.run(["scancel", job], check=False)
    text = _read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    assert info["Restarts"] == "1", text[-4000:]
    assert f"job {job} restart 0: 2 ranks on" in text and f"job {job} restart 1: 3 ranks on" in text
    assert "the allocation has 3 tasks (SLURM_TASKS_PER_NODE=3), the job was submitted with 2" in text
    assert "1 nodes x 3 GPUs = 3 ranks" in text  # the guard checked the new layout
    assert f"{checkpoint} was saved with another layout: actor: dp 2 -> 3" in text, text[-4000:]
    assert f"resumed from {checkpoint} (step {len(stopped)})" in text, text[-4000:]
    assert _steps(metrics) == list(range(1, num_steps + 1))  # nothing lost, nothing repeated
    assert (run / "ckpt/universal" / checkpoint.name / "actor").is_dir()
    final = json.loads((run / "ckpt" / f"step_{num_steps}" / "layout.json").read_text())
    assert final["world_size"] == 3 and final["roles"]["actor"]["dp"] == 3
    assert (run / "model/config.json").exists()
    print(f"requeue 2 -> 3 ranks: stopped at step {len(stopped)}, {time.monotonic() - start:.1f}s in all")
