"""A rollout engine that dies during a weight round, without vLLM (``hpc_rlhf.rollout.weight_round_failure``): the
rollout rank's side of the round, the sender's lost engines, and the sender's round skipping them. The vLLM engine's
use of it: ``tests/unit/test_vllm_server.py``; a real engine core killed mid-round:
``tests/faults/test_engine_restart.py``."""

from __future__ import annotations

import logging

import pytest
import torch

from hpc_rlhf.rollout.engine_restart import EngineFailure
from hpc_rlhf.rollout.weight_round_failure import LostReceivers, WeightRoundError, receive_round
from hpc_rlhf.weight_sync.sharded import EngineChannelWeightSync


class Round:
    """An engine's round calls, recorded; ``dies_at``: the call that finds the engine dead (``"begin"``, a bucket's
    name, ``"finish"``), ``fails_at`` the same for an error of a live engine."""

    def __init__(self, dies_at: str | None = None, fails_at: str | None = None):
        self.dies_at, self.fails_at = dies_at, fails_at
        self.calls: list[str] = []
        self.drawn: list[str] = []  # buckets taken from the sender

    def buckets(self, names):
        for name in names:
            self.drawn.append(name)
            yield name

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if what == self.dies_at:
            raise EngineFailure("engine-core exited", incarnation=4)
        if what == self.fails_at:
            raise RuntimeError(f"{what}: shape mismatch")

    def run(self, names, backend: str = "gloo"):
        return receive_round(self.buckets(names), begin=lambda: self._call("begin"), load=self._call,
                             finish=lambda: self._call("finish"), engine_name="rank 1's engine", backend=backend)


def test_a_round_without_failure_loads_every_bucket_in_order():
    engine = Round()
    assert engine.run(["b0", "b1", "b2"]) is None
    assert engine.calls == ["begin", "b0", "b1", "b2", "finish"]


@pytest.mark.parametrize(("dies_at", "loaded", "calls"), [
    ("b1", 1, ["begin", "b0", "b1"]),
    ("begin", 0, ["begin"]),
])
def test_a_death_mid_round_lets_the_rest_of_the_round_go_by(dies_at, loaded, calls):
    """gloo: the sender goes on with its round, so every bucket is taken from it; the engine loads nothing more, is
    not finished, and the failure names the round and how far it got."""
    engine = Round(dies_at=dies_at)
    failure = engine.run(["b0", "b1", "b2", "b3"])
    assert engine.calls == calls
    assert engine.drawn == ["b0", "b1", "b2", "b3"]
    assert failure.cause == f"during a weight round ({loaded} of 4 bucket(s) loaded), engine-core exited"
    assert failure.incarnation == 4  # the engine that died, so that a concurrent failure restarts it once


def test_a_death_after_the_last_bucket_is_recovered_over_either_transport():
    for backend in ("gloo", "nccl"):
        engine = Round(dies_at="finish")
        failure = engine.run(["b0", "b1"], backend=backend)
        assert failure.cause == "during a weight round (all 2 bucket(s) loaded, not finished), engine-core exited"


@pytest.mark.parametrize("dies_at", ["begin", "b1"])
def test_over_nccl_a_death_before_the_last_bucket_ends_the_job_at_once(dies_at):
    """The sender is left in its broadcast: nothing more comes from it, so nothing more is waited for."""
    engine = Round(dies_at=dies_at)
    with pytest.raises(WeightRoundError, match=r"rank 1's engine died during a weight round, after \d bucket\(s\) "
                       r"were loaded: engine-core exited\. Its workers share a nccl communicator") as err:
        engine.run(["b0", "b1", "b2"], backend="nccl")
    assert isinstance(err.value.__cause__, EngineFailure)
    assert engine.drawn == ([] if dies_at == "begin" else ["b0", "b1"])


def test_an_error_of_a_live_engine_is_not_a_death():
    engine = Round(fails_at="b1")
    with pytest.raises(RuntimeError, match="b1: shape mismatch"):
        engine.run(["b0", "b1", "b2"])
    assert engine.drawn == ["b0", "b1"]


class Channel:
    """A sender's channel; its workers die after ``dies_after`` buckets (then every send fails, as gloo's does)."""

    def __init__(self, survives: bool | None, dies_after: int | None = None):
        if survives is not None:
            self.survives_lost_receiver = survives
        self.dies_after = dies_after
        self.sent: list[list[str]] = []
        self.tries = 0

    def send(self, bucket):
        self.tries += 1
        if self.dies_after is not None and len(self.sent) >= self.dies_after:
            raise RuntimeError("Connection closed by peer [10.0.0.2]:4000")
        self.sent.append([name for name, _ in bucket])


def test_a_sender_leaves_a_lost_engine_out_until_it_reports_its_restart(caplog):
    lost = LostReceivers(rank=0)
    with caplog.at_level(logging.WARNING):
        lost.send_failed(3, Channel(survives=True), RuntimeError("Connection closed by peer"), bucket=1, num_buckets=4)
    assert lost.skips(3) and not lost.skips(2)
    assert "rank 0: lost rank 3's rollout engine in bucket 2 of 4 of a weight round (RuntimeError: Connection " \
           "closed by peer)" in caplog.text
    with pytest.raises(WeightRoundError, match=r"rank 0: rank 3 reports its rollout engine done, but the weight "
                       r"round sent to it failed at bucket 2 of 4 .* reported no restart"):
        lost.reported_done(3)  # a partial round must not generate
    lost.send_failed(3, Channel(survives=True), RuntimeError("gone"), bucket=0, num_buckets=4)
    lost.restarted(3)
    assert not lost.skips(3)
    lost.reported_done(3)  # restarted, and sent a whole round since: nothing to say


@pytest.mark.parametrize("survives", [False, None])
def test_a_channel_that_cannot_lose_its_receivers_stops_the_sender(survives):
    lost = LostReceivers(rank=0)
    with pytest.raises(WeightRoundError, match=r"rank 0: sending bucket 1 of 2 of a weight round to rank 5's rollout "
                       r"engine failed \(RuntimeError: NCCL error\); its channel \(Channel\) cannot be given up"):
        lost.send_failed(5, Channel(survives=survives), RuntimeError("NCCL error"), bucket=0, num_buckets=2)


class Actor:
    """``gathered_state_dict_items`` of a model of three one-tensor buckets."""

    def gathered_state_dict_items(self, names):
        for bucket in names:
            yield [(name, torch.ones(2)) for name in bucket]


def _sender(channels) -> EngineChannelWeightSync:
    """The sending side's round alone (no groups: every bucket's description is known already)."""
    sync = object.__new__(EngineChannelWeightSync)
    sync.world = type("World", (), {"rank": 0})()
    sync.channels = channels
    sync.bucket_names = [["a"], ["b"], ["c"]]
    sync.descriptions = [[("a", (2,), torch.float32)], [("b", (2,), torch.float32)], [("c", (2,), torch.float32)]]
    sync.lost = LostReceivers(rank=0)
    sync._bytes_sent = 0
    return sync


def test_the_senders_round_goes_on_without_an_engine_whose_workers_died():
    alive, dying = Channel(survives=True), Channel(survives=True, dies_after=1)
    sync = _sender({1: alive, 2: dying})
    sync._send_round(Actor(), [1, 2])
    assert alive.sent == [["a"], ["b"], ["c"]]  # the other engine gets its whole round
    assert dying.sent == [["a"]] and dying.tries == 2  # tried at "b", then left out of "c"
    assert sync.lost.skips(2) and sync.lost.causes[2].startswith("bucket 2 of 3 of a weight round (RuntimeError")
    assert sync.bytes_sent == 4 * 2 * 4  # four buckets of two fp32 went out
