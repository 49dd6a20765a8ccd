"""The typed step batch and training shard: building from trajectories, row shuffles that keep every field aligned,
the wire format, and the controller's layouts built on them."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from hpc_rlhf.config import load_config
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.row_layout import forward_shards, in_batch_order, train_shards
from hpc_rlhf.trainers.rl.step_batch import StepBatch, TrainShard
from hpc_rlhf.trainers.rl.workers import TRAIN_FIELDS, UpdateSettings, _updates

PAD = 0


def _trajectory(prompt_len: int, response_len: int, reward: float, branch: int = 0, feedback: bool = False):
    response = list(range(10, 10 + response_len))
    mask = [0 if feedback and i == 1 else 1 for i in range(response_len)]
    return Trajectory(prompt="p", label=None, prompt_ids=list(range(1, 1 + prompt_len)), response_ids=response,
                      action_mask=mask, rollout_logprobs=[-0.5 * m for m in mask], reward=reward,
                      branch_index=branch)


def _batch(num_rows: int = 6, seed: int = 0) -> StepBatch:
    """A batch whose every per-row field encodes its row number r, so misaligned fields are visible."""
    rng = random.Random(seed)
    trajectories = [_trajectory(rng.randint(1, 4), rng.randint(1, 5), float(r)) for r in range(num_rows)]
    batch = StepBatch.from_trajectories(trajectories, PAD)
    rows = torch.arange(num_rows, dtype=torch.float32).unsqueeze(1).expand_as(batch.rollout_logprobs)
    batch.old_logprobs, batch.ref_logprobs = rows + 0.1, rows + 0.2
    batch.advantages, batch.returns, batch.values = rows + 0.3, rows + 0.4, rows + 0.5
    return batch


def _row_ids(batch: StepBatch) -> dict[str, list[int]]:
    """Row number each field's rows carry (see :func:`_batch`)."""
    return {"rewards": batch.rewards.long().tolist(), "episode_index": batch.episode_index.tolist(),
            **{k: getattr(batch, k)[:, 0].floor().long().tolist()
               for k in ("old_logprobs", "ref_logprobs", "advantages", "returns", "values")}}


def _assert_same(a: StepBatch, b: StepBatch) -> None:
    assert list(a.tensors()) == list(b.tensors())
    for name, tensor in a.tensors().items():
        other = getattr(b, name)
        assert tensor.dtype == other.dtype and torch.equal(tensor, other), name


def test_from_trajectories_lays_out_rows_with_shapes_and_dtypes():
    trajectories = [_trajectory(2, 3, 1.0), _trajectory(4, 1, 0.0), _trajectory(1, 2, 0.5, branch=1, feedback=True)]
    batch = StepBatch.from_trajectories(trajectories, PAD)
    assert batch.sequences.shape == (3, 4 + 3) and batch.sequences.dtype == torch.long
    assert batch.attention_mask.dtype == torch.long and batch.action_mask.dtype == torch.bool
    assert batch.rollout_logprobs.shape == (3, 3) and batch.rollout_logprobs.dtype == torch.float32
    # Row 0: prompt right-aligned at column P=4, response from column 4.
    assert batch.sequences[0].tolist() == [PAD, PAD, 1, 2, 10, 11, 12]
    assert batch.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert batch.action_mask[2].tolist() == [True, False, False]  # feedback token and padding are not actions
    assert batch.response_length.tolist() == [3, 1, 2] and batch.response_length.dtype == torch.long
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5] and batch.rewards.dtype == torch.float32
    assert batch.episode_index.tolist() == [0, 1, 1]  # the third row is a branch of the second episode
    assert batch.old_logprobs is None and batch.advantages is None
    assert StepBatch.from_trajectories(trajectories, PAD, scored=False).rewards is None


def test_split_then_cat_gives_back_the_batch():
    batch = _batch(6)
    parts = batch.split_rows(3)
    assert [p.num_rows for p in parts] == [2, 2, 2]
    assert _row_ids(parts[1])["advantages"] == [2, 3]
    _assert_same(StepBatch.cat(parts), batch)
    with pytest.raises(ValueError, match="cannot split 6 samples into 4"):
        batch.split_rows(4)
    with pytest.raises(ValueError, match="cannot concatenate"):
        StepBatch.cat([parts[0], parts[1].select()])


def test_take_rows_keeps_every_field_aligned():
    batch = _batch(6)
    order = [4, 0, 0, 5, 2]  # a permutation with a repeat, as the layouts make
    taken = batch.take_rows(order)
    assert set(taken.tensors()) == set(batch.tensors())
    for name, rows in _row_ids(taken).items():
        assert rows == (order if name != "episode_index" else [batch.episode_index[r].item() for r in order]), name
    for name in ("sequences", "attention_mask", "action_mask", "rollout_logprobs", "response_length"):
        assert torch.equal(getattr(taken, name), getattr(batch, name)[order]), name
    assert torch.equal(batch.take_rows(torch.tensor(order)).sequences, taken.sequences)  # a tensor index too


def test_select_keeps_forward_fields_and_wire_round_trip():
    batch = _batch(4)
    view = batch.select(*TRAIN_FIELDS["critic"])
    assert set(view.tensors()) == {"sequences", "attention_mask", "action_mask", "values", "returns"}
    assert set(batch.select().tensors()) == {"sequences", "attention_mask", "action_mask"}
    with pytest.raises(ValueError, match="no field"):
        batch.select("logits")
    wire = view.to_wire()
    assert isinstance(wire, dict) and all(isinstance(v, torch.Tensor) for v in wire.values())
    _assert_same(StepBatch.from_wire(wire), view)


def test_trim_padding_cuts_every_per_action_field_to_the_longest_response():
    batch = _batch(6).take_rows([1, 3])
    trimmed = batch.trim_padding()
    resp = int(batch.response_length.max())
    assert trimmed.action_mask.shape[1] == resp
    for name in ("rollout_logprobs", "old_logprobs", "advantages", "values"):
        assert torch.equal(getattr(trimmed, name), getattr(batch, name)[:, :resp]), name
    assert torch.equal(trimmed.rewards, batch.rewards)  # (B,) fields are unchanged
    assert int(trimmed.attention_mask.sum()) == int(batch.attention_mask.sum())  # only padding columns went


def test_train_shard_scalars_survive_split_and_wire():
    rows = _batch(8).select(*TRAIN_FIELDS["actor"])
    shard = TrainShard(rows, rows_per_minibatch=2, num_tokens=[7, 9], num_seqs=[4, 4], kl_coef=0.25)
    parts = shard.split(2)
    for i, part in enumerate(parts):
        assert (part.rows_per_minibatch, part.num_tokens, part.num_seqs, part.kl_coef) == (2, [7, 9], [4, 4], 0.25)
        assert part.num_minibatches == 2 and part.minibatch(1) == slice(2, 4)
        _assert_same(part.rows, rows.split_rows(2)[i])
        back = TrainShard.from_wire(part.to_wire())
        assert (back.rows_per_minibatch, back.num_tokens, back.num_seqs, back.kl_coef) == (2, [7, 9], [4, 4], 0.25)
        _assert_same(back.rows, part.rows)


@pytest.mark.parametrize("balance", [False, True])
def test_forward_shards_and_in_batch_order_give_outputs_in_row_order(balance):
    batch = _batch(5, seed=3)  # 5 rows over 2 replicas: the last row is repeated
    shards, layout = forward_shards(batch, 2, balance)
    assert [s.num_rows for s in shards] == [3, 3]
    assert set(shards[0].tensors()) == {"sequences", "attention_mask", "action_mask"}
    outputs = [s.sequences.sum(dim=1) for s in shards]  # any per-row output, computed shard by shard
    assert torch.equal(in_batch_order(outputs, layout, batch.num_rows), batch.sequences.sum(dim=1))


def test_train_shards_hold_whole_episode_minibatches_and_global_counts():
    # 4 episodes of 1, 2, 1, 2 rows; 2 episodes per mini-batch, 2 replicas.
    rows_per_episode = [1, 2, 1, 2]
    trajectories = [_trajectory(2, 3, float(e), branch=b) for e, n in enumerate(rows_per_episode) for b in range(n)]
    batch = StepBatch.from_trajectories(trajectories, PAD)
    batch.advantages = batch.episode_index.float().unsqueeze(1).expand(-1, 3).clone()
    batch.rollout_logprobs = batch.rollout_logprobs.clone()
    shards = train_shards(batch.select(*TRAIN_FIELDS["actor"]), batch.episode_index, 2, 2, False, kl_coef=0.5)
    assert len(shards) == 2
    for shard in shards:
        assert shard.rows_per_minibatch == 2 and shard.kl_coef == 0.5
        assert shard.num_tokens == [9, 9] and shard.num_seqs == [3, 3]  # real rows only; padding copies masked
    for k, episodes in enumerate(({0, 1}, {2, 3})):
        held = torch.cat([s.rows.advantages[s.minibatch(k), 0] for s in shards]).long().tolist()
        assert set(held) == episodes  # every replica's k-th chunk belongs to mini-batch k


def test_updates_walk_each_minibatch_in_micro_batches():
    cfg = load_config(None, ["train.micro_train_batch_size=1", "train.max_epochs=2"])
    settings = UpdateSettings.from_sections(cfg.train, cfg.rollout, cfg.ds)
    rows = _batch(4).select(*TRAIN_FIELDS["critic"])
    shard = TrainShard(rows, rows_per_minibatch=2, num_tokens=[1, 1], num_seqs=[1, 1])
    engine = SimpleNamespace(dp_group=None, device=torch.device("cpu"))  # what _updates reads of the engine
    seen = [(mb, int(micro.values[0, 0]), num, last) for mb, micro, num, last in _updates(shard, settings, engine)]
    one_epoch = [(0, 0, 2, False), (0, 1, 2, True), (1, 2, 2, False), (1, 3, 2, True)]
    assert seen == one_epoch * 2


def test_updates_move_micro_batches_to_the_engine_device():
    """The step batch travels and is cut on the host; each micro-batch must reach the engine's device before its
    forward (on a GPU the rows stayed on the host: "Expected all tensors to be on the same device")."""
    cfg = load_config(None, [])
    settings = UpdateSettings.from_sections(cfg.train, cfg.rollout, cfg.ds)
    rows = _batch(4).select(*TRAIN_FIELDS["critic"])
    shard = TrainShard(rows, rows_per_minibatch=2, num_tokens=[1, 1], num_seqs=[1, 1])
    engine = SimpleNamespace(dp_group=None, device=torch.device("meta"))  # a device other than the host's
    micro_batches = [micro for _mb, micro, _num, _last in _updates(shard, settings, engine)]
    assert micro_batches and all(t.device.type == "meta" for micro in micro_batches for t in micro.tensors().values())
    assert all(t.device.type == "cpu" for t in shard.rows.tensors().values())  # the shard itself stays
