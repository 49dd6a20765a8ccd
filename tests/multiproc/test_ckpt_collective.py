"""CheckpointManager across 2 gloo ranks: one commit for all shards; a failing rank means no commit, no hang."""

from __future__ import annotations

import datetime
import shutil

import pytest
import torch.distributed as dist

from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow

# A failed save must surface within this bound instead of the world's 120 s timeout.
SHORT_TIMEOUT_S = 4


def _save_shards(rank: int, world_size: int, root: str) -> dict:
    from hpc_rlhf.ckpt import CheckpointManager, load_json
    from hpc_rlhf.ckpt.rng import load_rank_rng, save_rank_rng

    mgr = CheckpointManager(root, max_num=2)  # rank, world size and barrier from torch.distributed
    assert (mgr.rank, mgr.world_size) == (rank, world_size)
    for step in (1, 2, 3):
        with mgr.saving(step) as tmp:
            (tmp / f"shard_rank{rank}.bin").write_bytes(bytes([rank]) * (1000 * (rank + 1)))
            save_rank_rng(tmp, rank)
        # The final barrier guarantees every rank sees the moved LATEST right after the block.
        assert mgr.latest_step() == step
    latest = mgr.latest()
    load_rank_rng(latest, rank)
    return {"latest": latest.name, "complete": [s for s, _ in mgr.list_complete()],
            "manifest": load_json(latest / "COMPLETE")}


@pytest.mark.timeout(180)
def test_two_ranks_commit_once_with_both_shards(tmp_path):
    results = run_on_ranks(_save_shards, 2, str(tmp_path))
    assert results[0] == results[1]
    assert results[0]["latest"] == "step_3" and results[0]["complete"] == [2, 3]
    manifest = results[0]["manifest"]
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    assert sorted((f["path"], f["size"]) for f in manifest["files"] if f["path"].startswith("shard")) == [
        ("shard_rank0.bin", 1000), ("shard_rank1.bin", 2000)]
    assert {f["path"] for f in manifest["files"]} >= {"rng_rank0.pt", "rng_rank1.pt"}
    assert (tmp_path / "LATEST").read_text().strip() == "step_3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_2", "step_3"]
    assert (tmp_path / "step_3" / "shard_rank1.bin").read_bytes() == b"\x01" * 2000


def _one_rank_fails(rank: int, world_size: int, root: str, failing_rank: int) -> dict:
    from hpc_rlhf.ckpt import CheckpointManager

    # The contract: a save failure on one rank surfaces on the others through the barrier's timeout.
    # A dedicated gloo group gives that barrier a short timeout without touching the world's.
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
    mgr = CheckpointManager(root, max_num=3, barrier=lambda: dist.barrier(group=short))
    with mgr.saving(1) as tmp:
        (tmp / f"shard_rank{rank}.bin").write_bytes(b"good")
    try:
        with mgr.saving(2) as tmp:
            (tmp / f"shard_rank{rank}.bin").write_bytes(b"partial")
            if rank == failing_rank:
                raise RuntimeError("disk full on this rank")
    except RuntimeError as exc:
        outcome = "raised: " + str(exc).splitlines()[0][:200]
    else:
        outcome = "returned"
    return {"outcome": outcome, "latest": mgr.latest_step()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_one_rank_failing_inside_saving_commits_nothing_and_does_not_hang(tmp_path, failing_rank):
    results = run_on_ranks(_one_rank_fails, 2, str(tmp_path), failing_rank)
    other = 1 - failing_rank
    assert results[failing_rank]["outcome"] == "raised: disk full on this rank"
    # The healthy rank did not hang: its post-body barrier timed out, so it raised too and committed nothing.
    assert results[other]["outcome"].startswith("raised: "), results[other]
    assert "timed out" in results[other]["outcome"].lower(), results[other]
    assert results[0]["latest"] == results[1]["latest"] == 1
    assert (tmp_path / "LATEST").read_text().strip() == "step_1"
    assert not (tmp_path / "step_2").exists()
    assert (tmp_path / "step_1" / "shard_rank0.bin").read_bytes() == b"good"
    assert (tmp_path / "step_1" / "shard_rank1.bin").read_bytes() == b"good"
    assert (tmp_path / ".tmp_step_2").is_dir()  # left for the next save (rank 0) to clean


def _agree_on_resume(rank: int, world_size: int, root: str) -> dict:
    from hpc_rlhf.ckpt import CheckpointManager
    from hpc_rlhf.ckpt.resume import agreed_checkpoint

    try:
        chosen = agreed_checkpoint(CheckpointManager(root))
    except RuntimeError as exc:
        return {"raised": str(exc)}
    return {"chosen": None if chosen is None else chosen.name}


@pytest.mark.timeout(180)
def test_every_rank_refuses_to_start_fresh_when_latest_names_a_deleted_checkpoint(tmp_path):
    """What the RL and offline trainers call on resume: rank 0's verdict reaches every rank, so no rank starts fresh
    (or waits) over a run whose checkpoints are gone."""
    from hpc_rlhf.ckpt import CheckpointManager

    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, barrier=lambda: None)
    with mgr.saving(3) as tmp:
        (tmp / "model.bin").write_bytes(b"weights")
    shutil.rmtree(tmp_path / "step_3")
    results = run_on_ranks(_agree_on_resume, 2, str(tmp_path))
    assert results[0] == results[1] and "raised" in results[0], results
    assert "LATEST names step_3, which is not a complete checkpoint" in results[0]["raised"]
