"""StallGuard.explain_failure: a failed collective names the peer that went silent; the rank's own errors (which name
their cause already) do not wait for a peer to explain them."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from hpc_rlhf.resilience.stall_guard import HEARTBEAT_DIR, StallGuard, may_be_a_peers_failure
from hpc_rlhf.resilience.stall_limits import StallLimits
from hpc_rlhf.rewards.functions import RewardFunctionError
from hpc_rlhf.rollout.engine_restart import EngineRestartLimitError
from hpc_rlhf.rollout.weight_round_failure import WeightRoundError

COLLECTIVE_ERRORS = [RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"),
                     dist.DistBackendError("Connection reset by peer"), dist.DistNetworkError("Broken pipe"),
                     dist.DistStoreError("Timed out after 30 s")]
OWN_ERRORS = [EngineRestartLimitError("rank 1's vLLM rollout engine failed"),
              RewardFunctionError("the reward function raised"), WeightRoundError("engine died mid-round"),
              ValueError("bad config"), KeyError("prompt")]


def _guard_with_a_silent_peer(tmp_path: Path) -> StallGuard:
    """Rank 0 of 2 whose peer (rank 1) last wrote its heartbeat 60 s ago."""
    guard = StallGuard(StallLimits(floor_s=30), tmp_path, rank=0, world_size=2)
    beats = tmp_path / HEARTBEAT_DIR
    beats.mkdir(parents=True, exist_ok=True)
    now = time.time()
    (beats / "rank_0").write_text(f"100 {now:.3f}\n")
    (beats / "rank_1").write_text(f"40 {now - 60:.3f}\n")
    return guard


@pytest.mark.parametrize("exc", COLLECTIVE_ERRORS, ids=lambda e: type(e).__name__)
def test_a_failed_collective_names_the_silent_peer(tmp_path, caplog, exc):
    assert may_be_a_peers_failure(exc)
    with caplog.at_level(logging.ERROR, logger="hpc_rlhf.resilience.stall_guard"):
        _guard_with_a_silent_peer(tmp_path).explain_failure(exc, wait_s=0)
    assert "rank 0 stops after" in caplog.text and "rank 1 stopped checking in" in caplog.text, caplog.text


@pytest.mark.parametrize("exc", OWN_ERRORS, ids=lambda e: type(e).__name__)
def test_the_ranks_own_error_is_not_blamed_on_a_peer(tmp_path, caplog, exc):
    """A silent peer is there to be named, and still the rank's own error is left as it is (and the rank does not
    wait ``wait_s`` for a peer to show: it would return at once either way here)."""
    assert not may_be_a_peers_failure(exc)
    with caplog.at_level(logging.ERROR, logger="hpc_rlhf.resilience.stall_guard"):
        _guard_with_a_silent_peer(tmp_path).explain_failure(exc, wait_s=0)
    assert "stops after" not in caplog.text, caplog.text
