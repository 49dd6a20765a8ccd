"""The controller-traffic phase of ``plan`` against the channel's own accounting, and the message counts that the
replica path promises (one copy of a shard per replica off rank 0, one message per shard)."""

from pathlib import Path

import pytest
import torch

from hpc_rlhf.config import load_config
from hpc_rlhf.planning.devices import get_device
from hpc_rlhf.planning.step_time import need_old_logprobs, rl_step_time, step_transfers
from hpc_rlhf.trainers.rl.row_layout import forward_shards, train_shards
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from hpc_rlhf.trainers.rl.workers import TRAIN_FIELDS
from hpc_rlhf.world.channel import payload_of
from hpc_rlhf.world.placement import RoleGrid, build_placement
from hpc_rlhf.world.traffic import (
    Payload,
    ReplicaLayout,
    count,
    per_rank_scatter_messages,
    scatter_messages,
    total_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
# A small layout of each kind: GRPO with a reference (KL loss) at tensor parallel 2, PPO with a critic.
CASES = {
    "grpo_tp2": ("configs/grpo_tiny_cpu.yaml", ["algo.kl.init_coef=0.01", "algo.kl.use_loss=true",
                                                 "ds.tensor_parallel_size=2"], 4),
    "ppo_critic": ("configs/ppo_tiny_cpu.yaml", [], 2),
}


def _full_batch(cfg, placement, need_old: bool) -> StepBatch:
    """A step batch at the recipe's budgets with every field the controller sets before training."""
    rows = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    prompt, response = cfg.data.prompt_max_len, cfg.rollout.generate_max_len
    per_action = torch.zeros(rows, response)
    batch = StepBatch(torch.zeros(rows, prompt + response, dtype=torch.long),
                      torch.ones(rows, prompt + response, dtype=torch.long), torch.ones(rows, response, dtype=torch.bool),
                      rollout_logprobs=per_action, response_length=torch.full((rows,), response),
                      rewards=torch.zeros(rows), episode_index=torch.arange(rows), advantages=per_action,
                      returns=per_action)
    if need_old:
        batch.old_logprobs = per_action
    if "ref" in placement.roles:
        batch.ref_logprobs = per_action
    if "critic" in placement.roles:
        batch.values = per_action
    return batch


def _channel_messages(cfg, placement, name: str, batch: StepBatch):
    """The channel's accounting of a transfer's scatter, from the shards the trainer builds for it."""
    role = name.split()[-1] if name.startswith("train") else name.split()[0]
    grid = placement.roles[role]
    layout = ReplicaLayout.from_ranks({r: grid.dp_rank(r) for r in grid.ranks}, grid.dp_leaders())
    if name.startswith("train"):
        shards = [s.to_wire() for s in train_shards(batch.select(*TRAIN_FIELDS[role]), batch.episode_index,
                                                    cfg.train.train_batch_size, grid.dp_size, False, 0.01)]
    else:
        shards = [s.to_wire() for s in forward_shards(batch, grid.dp_size, False)[0]]
    return scatter_messages(layout, [payload_of(s) for s in shards])


@pytest.mark.parametrize("case", list(CASES))
def test_plan_bytes_match_the_channels_accounting(case):
    path, overrides, ranks = CASES[case]
    cfg = load_config(str(ROOT / path), ["actor.build_tiny=false", *overrides])
    placement = build_placement(cfg, ranks)
    need_old = need_old_logprobs(cfg, placement)
    batch = _full_batch(cfg, placement, need_old)
    checked = []
    for transfer in step_transfers(cfg, placement, need_old):
        if transfer.name.startswith("prompts"):
            continue  # pickled Python objects: the plan estimates their size
        planned = scatter_messages(transfer.layout, transfer.out)
        real = _channel_messages(cfg, placement, transfer.name, batch)
        assert [(m.op, m.src, m.dst, m.tensor_bytes) for m in planned] == \
               [(m.op, m.src, m.dst, m.tensor_bytes) for m in real], transfer.name
        for plan_m, real_m in zip(planned, real, strict=True):  # only the pickled skeleton is an estimate
            assert abs(plan_m.num_bytes - real_m.num_bytes) <= 512, (transfer.name, plan_m, real_m)
        checked.append(transfer.name)
    assert "train actor" in checked and len(checked) >= 2, checked


def test_plan_prints_the_controller_traffic_phase(capsys):
    from hpc_rlhf.cli.plan import plan

    assert plan(["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("controller traffic"))
    assert "rank 0 sends" in line and "a copy per rank and a message per tensor" in line


def test_tp_sp_layout_sends_a_shard_once_per_replica():
    """On a 512-GPU, TP 2 x SP 4 GRPO layout, rank 0's bytes to other nodes fall by tp x sp and its messages to
    one per replica; the phase's seconds fall with them."""
    cfg = load_config(str(ROOT / "configs/grpo_longctx_7b.yaml"),
                      ["rollout.rollout_batch_size=512", "train.train_batch_size=4096", "ds.tensor_parallel_size=2"])
    placement = build_placement(cfg, 512)
    actor = next(t for t in step_transfers(cfg, placement, False) if t.name == "train actor")

    def off_node(messages):
        return sum(m.num_bytes for m in messages if m.src == 0 and any(r >= 8 for r in m.dst))

    now, before = scatter_messages(actor.layout, actor.out), per_rank_scatter_messages(actor.layout, actor.out)
    assert off_node(before) / off_node(now) == pytest.approx(2 * 4, rel=0.01)
    assert count([m for m in now if m.op == "send"]) == 64 - 1  # one buffer per replica but rank 0's own
    assert count(before) == 511 * (2 + 5)  # per rank: pickled skeleton (2 sends) + 5 tensors (no reference)
    step = rl_step_time(cfg, placement, get_device("h100"), nodes=64, gpus_per_node=8)
    phase = next(p for p in step.phases if p.name == "controller traffic")
    assert 0 < phase.seconds < 1.0


def test_model_counts_on_a_colocated_tp4_sp2_role():
    grid = RoleGrid("actor", tuple(range(64)), tp_size=4, sp_size=2)
    layout = ReplicaLayout.from_ranks({r: grid.dp_rank(r) for r in grid.ranks}, grid.dp_leaders())
    shard = Payload(300, (8000, 8000, 1000, 4000, 4000, 4000))
    packed = scatter_messages(layout, [shard] * grid.dp_size)
    baseline = per_rank_scatter_messages(layout, [shard] * grid.dp_size)
    # rank 0: the lengths, one buffer to each of the 7 other leaders, its own replica's broadcast
    assert count(packed) == 1 + 7 + 1 and count(baseline) == 63 * (2 + 6)
    assert total_bytes(baseline) / total_bytes(packed) == pytest.approx(63 / 8, rel=0.05)
    # the other leaders' broadcasts: skeleton and tensors, each padded to 16 bytes
    assert total_bytes(packed, src=None) - total_bytes(packed) == 7 * (304 + 8000 + 8000 + 1008 + 3 * 4000)


def test_controller_must_lead_its_replica():
    with pytest.raises(ValueError, match="rank 0 is in replica 0"):
        ReplicaLayout.from_ranks({0: 0, 1: 0}, [1])
