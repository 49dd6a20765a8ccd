"""Seeded faults at real points of the tiny GRPO run (2 ranks, torchrun): the job ends fast, nothing is lost.

See tests/faults/driver.py for what is injected and asserted. ``pytest tests/faults --fault-injections 20``
runs more; the table of outcomes is printed at the end (and goes into docs/reliability.md).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from hpc_rlhf.ckpt.atomic import CheckpointManager
from hpc_rlhf.resilience.watchdog import STALL_EXIT_CODE
from hpc_rlhf.utils.metrics import read_metrics
from tests.faults import driver
from tests.faults.conftest import OUTCOMES, idle_fault
from tests.multiproc.rl_fixtures import make_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted run's metrics rows."""
    out = tmp_path_factory.mktemp("reference")
    assert driver.wait_job(driver.start_job(driver.overrides(assets, out), out / "job.log")) == 0, out / "job.log"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, driver.NUM_STEPS + 1))
    return rows


@pytest.fixture(scope="module")
def idle_injections(request, assets, reference, tmp_path_factory):
    """The module's injections of an idle kind (driver.IDLE_KINDS), started together once the reference run is done
    and left running beside the other tests: {fault: (run folder, future of its Outcome)}. Only the faults selected
    for this run are started."""
    # this module's selected faults (after -k and --deselect) of an idle kind
    faults = [fault for item in request.session.items
              if item.module is request.module and (fault := idle_fault(item)) is not None]
    if not faults:
        yield {}
        return
    with ThreadPoolExecutor(max_workers=len(faults), thread_name_prefix="idle-injection") as pool:
        started = {}
        for fault in faults:
            out = tmp_path_factory.mktemp("idle_injection") / "run"
            started[fault] = (out, pool.submit(driver.inject, fault, assets, out))
        yield started


def _check_diagnosis(fault: driver.Fault, outcome: driver.Outcome, out) -> None:
    """The job says what happened: the dead rank's number, the hang's dumps, the stop's checkpoint."""
    log = outcome.log
    if fault.kind == "sigkill_one":
        # torchrun's "Root Cause" block names the killed rank (its agent notices within 0.1 s and stops the
        # survivor, usually before the survivor's own "rank N is dead" message from StallGuard).
        assert re.search(rf"Root Cause[^\[]*\[0\]:\s+time\s*:[^\n]*\s+host\s*:[^\n]*\s+rank\s*:\s*{fault.rank} "
                         r"\(local_rank: \d\)\s+exitcode\s*:\s*-9", log), log[-3000:]
    elif fault.kind == "sigstop_one":
        peer = 1 - fault.rank
        hang = out / "hang"
        assert (hang / f"rank{peer}.txt").is_file(), "the running rank dumped no stacks"
        assert not (hang / f"rank{fault.rank}.txt").exists()  # a stopped process cannot dump
        assert f"exitcode  : {STALL_EXIT_CODE}" in log, log[-3000:]
        summary = (hang / "summary.txt").read_text()
        assert f"rank {fault.rank} stopped checking in" in summary, summary
    elif fault.kind in ("sigusr1_all", "sigterm_all"):
        assert "will checkpoint and stop" in log, log[-3000:]
        # A signal during the last step's save: the run is complete, so it exports and exits 0 (nothing to resume).
        assert "exitcode  : 75" in log or (outcome.exit_code == 0 and (out / "model").is_dir()), log[-3000:]
    elif fault.kind == "enospc_save":
        assert "No space left on device (injected" in log, log[-3000:]


def test_fault_is_survived(fault, assets, reference, idle_injections, tmp_path):
    if fault in idle_injections:  # started at the module's start (driver.IDLE_KINDS)
        out, future = idle_injections[fault]
        outcome = future.result()
    else:
        out = tmp_path / "run"
        outcome = driver.inject(fault, assets, out)
    OUTCOMES.append(outcome)
    print(f"{fault}: exit {outcome.exit_code} after {outcome.exit_s:.1f} s")
    last_step_signal = fault.kind in ("sigusr1_all", "sigterm_all") and fault.step == driver.NUM_STEPS
    assert outcome.exit_code != 0 or last_step_signal, "the faulted job claims success"
    assert outcome.exit_s < fault.bound_s, f"{fault}: {outcome.exit_s:.1f} s from fault to exit"
    _check_diagnosis(fault, outcome, out)
    driver.check_checkpoints(out, outcome.checkpoints_before)
    latest = CheckpointManager(out / "ckpt", rank=0).latest_verified()
    expected_start = 0 if latest is None else int(latest.name.split("_")[1])

    outcome.resumed_from = driver.run_to_completion(driver.overrides(assets, out), out / "job.log")
    assert outcome.resumed_from[0] == expected_start, (outcome.resumed_from, expected_start)
    driver.check_checkpoints(out, outcome.checkpoints_before)
    diffs = driver.same_metrics(reference, read_metrics(out))
    assert not diffs, diffs
    outcome.survived = True


@pytest.mark.slurm
def test_a_killed_rank_ends_the_srun_step(assets, reference, tmp_path, slurm_or_skip):
    """Under srun (as slurm/launch.sh runs the ranks): SIGKILL of rank 0 (the controller, which also holds the
    rendezvous store) at a seeded point ends the step at once, srun names the task, no rank process is left; the
    run then resumes and matches the reference."""
    import random

    rng = random.Random(1)
    fault = driver.Fault("sigkill_one", rng.choice(["generation", "train", "weight_sync"]), rng.randint(2, 5), 0)
    out = tmp_path / "run"
    outcome = driver.inject(fault, assets, out, launcher="srun")
    OUTCOMES.append(outcome)
    print(f"srun {fault}: exit {outcome.exit_code} after {outcome.exit_s:.1f} s")
    assert outcome.exit_code != 0
    assert outcome.exit_s < fault.bound_s, f"{fault}: {outcome.exit_s:.1f} s from fault to exit"
    assert re.search(rf"task {fault.rank}: Killed", outcome.log), outcome.log[-3000:]
    driver.check_checkpoints(out, outcome.checkpoints_before)
    driver.run_to_completion(driver.overrides(assets, out), out / "job.log")
    assert not driver.same_metrics(reference, read_metrics(out))
    outcome.survived = True
