"""After a stop checkpoint, only rank 0 requeues, and only when the recipe allows it (``slurm.requeue``)."""

from __future__ import annotations

import pytest

from hpc_rlhf.resilience import preemption


@pytest.fixture
def requeue_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(preemption, "requeue_slurm_job", lambda: calls.append(True) or True)
    return calls


def test_rank_0_requeues_when_enabled(requeue_calls):
    preemption.requeue_if_enabled(True, rank=0)
    assert requeue_calls == [True]


def test_requeue_false_is_honoured(requeue_calls, caplog):
    preemption.requeue_if_enabled(False, rank=0)
    assert requeue_calls == []
    assert "slurm.requeue=false" in caplog.text


def test_other_ranks_never_requeue(requeue_calls):
    preemption.requeue_if_enabled(True, rank=1)
    assert requeue_calls == []


def test_requeue_outside_slurm_asks_to_resume_by_hand(monkeypatch, caplog):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert preemption.requeue_slurm_job() is False
    assert "ckpt.load=true" in caplog.text


def test_importing_preemption_costs_no_torch():
    import subprocess
    import sys

    code = "import sys, hpc_rlhf.resilience.preemption; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
