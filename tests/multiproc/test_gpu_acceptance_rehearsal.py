"""The GPU acceptance's wiring, rehearsed on CPU: ``tests/gpu/acceptance_run.py`` under torchrun drives the real
trainer with its probes around the rollout engine, the actor and the train step, the resume stop, and the planner
call, with the device-memory queries answered from the host (``--rehearse-on-cpu``). A refactor that moves what the
probes wrap fails here, not on the first GPU that runs it."""

from __future__ import annotations

import json
import math

import pytest

from hpc_rlhf.data.synthetic import write_task_if_missing
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.utils.metrics import read_metrics
from tests.gpu import test_acceptance_gpu as acceptance

pytestmark = pytest.mark.slow

CPU_OVERRIDES = ["ds.param_dtype=fp32", "ds.gradient_checkpointing=false", "rollout.rollout_batch_size=4",
                 "rollout.n_samples_per_prompt=2", "rollout.micro_rollout_batch_size=8", "rollout.generate_max_len=8",
                 "train.train_batch_size=8", "train.micro_train_batch_size=4", "train.max_steps=2",
                 "ds.zero_stage=3"]


def test_acceptance_run_wiring_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_RLHF_ACCEPTANCE_DIR", str(tmp_path / "reports"))
    assets = {"model": str(build_tiny_model(tmp_path / "tiny", seed=0)),
              "data": str(write_task_if_missing("arithmetic", tmp_path / "arith.jsonl", 64, seed=0)),
              "base": tmp_path}
    out = tmp_path / "run"
    report_path = acceptance.report_dir() / "cpu.json"
    # --rehearse-on-cpu goes before the overrides (argparse options); _launch puts its own options first.
    report = acceptance._launch(report_path, ["--rehearse-on-cpu", *acceptance._overrides(assets, out, CPU_OVERRIDES)],
                                stop_after=None)
    assert report["steps"] == 2 and report["losses_finite"] and not report["stopped_by_signal"]
    assert report["device"] == "CPU rehearsal" and report["optimizer"]
    # Each probe saw its calls: one generation per step, and the actor's step once per micro-batch (2 per update).
    assert len(report["generation_allocated_gib"]) == 2 and len(report["training_allocated_gib"]) == 4
    for key in ("rollout_tokens_per_s", "train_tokens_per_s", "gather_gb_per_s", "plan_training_gib",
                "plan_peak_gib"):
        assert math.isfinite(report[key]) and report[key] > 0, key
    assert report["gathered_gb"] == pytest.approx(4 * report["num_params"] / 1e9, rel=0.05)  # fp32 weights

    # The resume stop: the signal during step 1 checkpoints and ends the run there.
    stopped = acceptance._launch(acceptance.report_dir() / "cut.json",
                                 ["--rehearse-on-cpu", *acceptance._overrides(assets, tmp_path / "cut",
                                                                              CPU_OVERRIDES)], stop_after=1)
    assert stopped["stopped_by_signal"] and [r["step"] for r in read_metrics(tmp_path / "cut")] == [1]
    assert json.loads(report_path.read_text())["steps"] == 2
