"""The quickstart runs end to end (short settings): SFT and GRPO under torchrun, plot, metrics, model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multiproc.rl_fixtures import ROOT

pytestmark = pytest.mark.slow


def test_quickstart_short_run_writes_every_output(tmp_path):
    out = tmp_path / "qs"
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli.main", "quickstart", "--output-dir", str(out),
                           "--sft-samples", "1024", "--rl-steps", "4"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy" in proc.stdout and "next:" in proc.stdout
    accuracy = [json.loads(line) for line in (out / "accuracy.jsonl").read_text().splitlines()]
    assert [a["stage"] for a in accuracy] == ["base", "after SFT", "after GRPO"]
    assert all(0.0 <= a["heldout_accuracy"] <= 1.0 for a in accuracy)
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # step 0: the SFT policy's evaluation
    evals = [r for r in rows if "eval/heldout_prompts/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 4]
    assert [a["heldout_accuracy"] for a in accuracy[1:]] == [r["eval/heldout_prompts/pass@1"] for r in evals]
    assert (out / "quickstart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "grpo" / "model" / "config.json").is_file()
