"""Actor -> rollout weight sync on 5 gloo ranks, one world for three layouts (one spawn keeps the test short).

The actor side runs the real gathering code (``state_gather.ModuleWeights``, ZeRO 0-2: every replica holds full
weights) behind the two methods a weight sync needs from a ``TrainEngine``.

- ``ShardedWeightSync`` (in-process engines): 3 actor replicas send, 2 transformers engines receive; and 2
  tensor-parallel replicas of 2 ranks taking turns, 1 engine.
- ``EngineChannelWeightSync`` (``rollout.vllm_mode=server_process``): 2 actor ranks feed 3 engines, each engine over
  a channel of its own with one sender. vLLM and NCCL are not available here, so the channel is a stand-in with
  the same shape: the sender hosts a ``TCPStore`` on the port it announced (as vLLM's ``trainer_init`` hosts its
  rendezvous store) and puts each tensor of a bucket under the next key; the engine connects to that address and
  port and takes the tensors in the order the bucket descriptions it was handed announce them. Everything else
  -- the assignment, the rendezvous over the main world, the per-bucket descriptions, the gathering -- is the
  code a GPU run uses.
"""

from __future__ import annotations

import datetime
import io

import pytest
import torch

from tests.multiproc.spawn import run_on_ranks

BUCKET_BYTES = 16 << 10  # a ~350 KB model: about two dozen buckets, so every replica sends several


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


# 5 ranks each: 3 data-parallel replicas -> 2 engines; 2 tensor-parallel replicas of 2 ranks (taking turns) -> 1
LAYOUTS = {"dp3": ["actor.num_ranks=3", "rollout.num_engines=2"],
           "tp2": ["actor.num_ranks=4", "ds.tensor_parallel_size=2", "rollout.num_engines=1"]}


def _sync_twice(rank: int, world_size: int, overrides: list[str]) -> dict:
    from hpc_rlhf.config import load_config
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine
    from hpc_rlhf.weight_sync.sharded import ShardedWeightSync
    from hpc_rlhf.weight_sync.state_gather import ModuleWeights
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, ["train.colocate_all=false", *overrides])
    world = build_world_groups(build_placement(cfg, world_size))
    sync = ShardedWeightSync(world, bucket_bytes=BUCKET_BYTES)
    actor_ranks = world.placement.roles["actor"].ranks
    result: dict = {"role": "actor" if rank in actor_ranks else "rollout"}
    if rank in actor_ranks:
        actor = _model(seed=1)  # every replica holds the same weights, as data-parallel ranks do
        sync.send(ModuleWeights(actor))
        with torch.no_grad():  # a training step's change; the second sync reuses the plan and cached headers
            for p in actor.parameters():
                p.add_(0.5)
        sync.send(ModuleWeights(actor))
        result.update(bytes_sent=sync.bytes_sent, plan_sent=sync.plan.bytes_per_sender())
    else:
        engine = TransformersRolloutEngine(_model(seed=2), eos_token_id=1, pad_token_id=0)
        expected = _model(seed=1)
        sync.receive(engine)
        first = all(torch.equal(engine.model.state_dict()[k], v) for k, v in expected.state_dict().items())
        with torch.no_grad():
            for p in expected.parameters():
                p.add_(0.5)
        sync.receive(engine)
        second = all(torch.equal(engine.model.state_dict()[k], v) for k, v in expected.state_dict().items())
        result.update(first=first, second=second, num_buckets=len(sync.plan.buckets),
                      total=sum(b.nbytes for b in sync.plan.buckets),
                      largest=max(b.nbytes for b in sync.plan.buckets),
                      padding=15 * sum(len(b.names) for b in sync.plan.buckets))  # 16-byte alignment, at most
    return result


TIMEOUT = datetime.timedelta(seconds=120)
# 2 actor ranks feed 3 engines; 2 tensor-parallel replicas of 2 ranks, 1 engine (one replica gathers, one rests)
SERVER_PROCESS = ["train.colocate_all=false", "rollout.backend=vllm", "rollout.vllm_mode=server_process"]
CHANNEL_LAYOUTS = {"channels": ["actor.num_ranks=2", "rollout.num_engines=3"],
                   "channels_tp2": ["actor.num_ranks=4", "ds.tensor_parallel_size=2", "rollout.num_engines=1"]}


def _serialize(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class StoreChannel:
    """The sender's end: hosts the store (``is_master``) and puts every tensor of a bucket under the next key, then
    waits for the engine to take the bucket (a broadcast returns once the receivers joined it)."""

    opened = 0  # channels this process opened

    def __init__(self, num_workers: int):
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, world_size=1 + num_workers, is_master=True,
                                   wait_for_workers=False, timeout=TIMEOUT)
        self.rendezvous = {"master_address": "127.0.0.1", "master_port": self.store.port}
        self.store.set("sender", str(dist.get_rank()))
        self.next_key = self.buckets_sent = 0
        StoreChannel.opened += 1

    def connect(self) -> None:
        pass

    def send(self, bucket) -> None:
        for name, tensor in bucket:
            self.store.set(f"tensor{self.next_key}", _serialize((name, tensor.detach().clone())))
            self.next_key += 1
        self.store.wait([f"taken{self.buckets_sent}"])
        self.buckets_sent += 1


class StoreEngine:
    """An engine's side: ``open_weight_channel`` / ``receive_weights`` as ``VllmServerEngine`` has them."""

    def __init__(self):
        self.opens = 0
        self.rounds: list[dict[str, list[torch.Tensor]]] = []

    def open_weight_channel(self, rendezvous) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(rendezvous["master_address"], rendezvous["master_port"], is_master=False,
                                   timeout=TIMEOUT)
        self.sender = int(self.store.get("sender"))
        self.next_key = self.buckets_taken = 0
        self.opens += 1

    def receive_weights(self, buckets) -> None:
        received: dict[str, list[torch.Tensor]] = {}
        for bucket in buckets:
            for name, meta in bucket:
                sent_name, tensor = torch.load(io.BytesIO(self.store.get(f"tensor{self.next_key}")))
                self.next_key += 1
                assert meta.device.type == "meta" and sent_name == name, (meta, sent_name, name)
                assert tensor.shape == meta.shape and tensor.dtype == meta.dtype, name
                received.setdefault(name, []).append(tensor)
            self.store.set(f"taken{self.buckets_taken}", "")
            self.buckets_taken += 1
        self.rounds.append(received)

    def reset_prefix_cache(self) -> None:
        pass


def _matches(received: dict[str, list[torch.Tensor]], expected: torch.nn.Module) -> bool:
    from hpc_rlhf.weight_sync.state_gather import state_dict_sizes

    state = expected.state_dict()
    names = [name for name, _ in state_dict_sizes(expected)]  # tied weights once, under their first name
    return sorted(received) == sorted(names) and all(
        len(copies) == 1 and torch.equal(copies[0], state[name]) for name, copies in received.items())


def _sync_over_channels(rank: int, world_size: int, overrides: list[str]) -> dict:
    from hpc_rlhf.config import load_config
    from hpc_rlhf.weight_sync.sharded import EngineChannelWeightSync, build_weight_sync
    from hpc_rlhf.weight_sync.state_gather import ModuleWeights
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, [*SERVER_PROCESS, *overrides])
    world = build_world_groups(build_placement(cfg, world_size))
    sync = build_weight_sync(cfg.rollout, world, bucket_bytes=BUCKET_BYTES, open_channel=StoreChannel)
    assert isinstance(sync, EngineChannelWeightSync)
    result: dict = {"sender_of": sync.sender_of}
    if rank in world.placement.roles["actor"].ranks:
        actor = _model(seed=1)  # every data-parallel rank holds the same weights
        sync.send(ModuleWeights(actor))
        with torch.no_grad():  # a training step's change; the second sync reuses the channels and descriptions
            for p in actor.parameters():
                p.add_(0.5)
        sync.send(ModuleWeights(actor))
        result.update(role="actor", bytes_sent=sync.bytes_sent, channels_opened=StoreChannel.opened,
                      model_bytes=sum(n for _, n in ModuleWeights(actor).state_dict_sizes()))
    else:
        engine, expected = StoreEngine(), _model(seed=1)
        sync.receive(engine)
        first = _matches(engine.rounds[0], expected)
        with torch.no_grad():
            for p in expected.parameters():
                p.add_(0.5)
        sync.receive(engine)
        result.update(role="rollout", first=first, second=_matches(engine.rounds[1], expected),
                      opens=engine.opens, sender=engine.sender, num_buckets=sync.num_buckets)
    return result


def _every_layout(rank: int, world_size: int) -> dict:
    # One world for every layout: each builds its own groups, as a fresh run would.
    results = {name: _sync_twice(rank, world_size, overrides) for name, overrides in LAYOUTS.items()}
    return {**results, **{name: _sync_over_channels(rank, world_size, overrides)
                          for name, overrides in CHANNEL_LAYOUTS.items()}}


@pytest.fixture(scope="module")
def synced():
    per_rank = run_on_ranks(_every_layout, 5)
    return {name: [r[name] for r in per_rank] for name in [*LAYOUTS, *CHANNEL_LAYOUTS]}


def test_sharded_sync_reaches_every_engine_and_rank0_sends_only_its_share(synced):
    results = synced["dp3"]
    actors, rollouts = results[:3], results[3:]
    assert [r["role"] for r in results] == ["actor"] * 3 + ["rollout"] * 2
    for r in rollouts:  # both engines end with the actor's weights, after the first and the second sync
        assert r["first"] and r["second"], r
    total, largest, padding = rollouts[0]["total"], rollouts[0]["largest"], rollouts[0]["padding"]
    assert rollouts[0]["num_buckets"] >= 9
    # Each bucket left exactly one rank, twice (payload bytes counted by the transport, alignment padding included)
    sent = [r["bytes_sent"] for r in actors]
    assert 2 * total <= sum(sent) <= 2 * (total + padding)
    # ... and every replica sent: rank 0 carries about a third, never the whole model.
    assert all(s > 0 for s in sent)
    assert sent[0] <= 2 * (total / 3 + largest + padding), (sent, total)
    assert actors[0]["plan_sent"] == actors[1]["plan_sent"] == actors[2]["plan_sent"]  # one plan on every rank


def test_tensor_parallel_ranks_take_turns_sending(synced):
    results = synced["tp2"]
    actors, rollout = results[:4], results[4]
    assert rollout["role"] == "rollout" and rollout["first"] and rollout["second"], rollout
    sent = [r["bytes_sent"] for r in actors]
    assert all(s > 0 for s in sent), sent  # both ranks of each tp replica send, not only its leader
    assert 2 * rollout["total"] <= sum(sent) <= 2 * (rollout["total"] + rollout["padding"])


def test_every_engine_gets_every_weight_once_from_its_assigned_sender(synced):
    synced = synced["channels"]
    engines = synced[2:]
    assert [r["role"] for r in synced] == ["actor"] * 2 + ["rollout"] * 3
    sender_of = synced[0]["sender_of"]
    assert all(r["sender_of"] == sender_of for r in synced)  # one assignment on every rank
    for rank, r in enumerate(engines, start=2):
        assert r["first"] and r["second"], r  # the actor's weights after each sync, each tensor exactly once
        assert r["sender"] == sender_of[rank] in (0, 1), r  # over the channel of the rank assigned to it
        assert r["opens"] == 1 and r["num_buckets"] >= 9, r  # one rendezvous for two syncs, several buckets
    assert {sender_of[e] for e in (2, 3, 4)} == {0, 1}  # both actor ranks send, in parallel


def test_engine_channels_leave_rank0_only_its_share(synced):
    synced = synced["channels"]
    actors = synced[:2]
    sender_of = synced[0]["sender_of"]
    model = actors[0]["model_bytes"]
    for rank, r in enumerate(actors):
        engines = sum(s == rank for s in sender_of.values())
        assert r["channels_opened"] == engines  # channels opened at the first sync only
        assert r["bytes_sent"] == 2 * engines * model  # two syncs, the whole model to each of its engines
    assert sum(s == 0 for s in sender_of.values()) == 1  # 3 engines over 2 ranks: the controller feeds one


def test_engine_channels_from_a_tensor_parallel_replica(synced):
    results = synced["channels_tp2"]
    actors, engine = results[:4], results[4]
    sender = results[0]["sender_of"][4]
    assert sender == 2 and engine["sender"] == 2, engine  # the replica without the controller, its first rank
    assert engine["first"] and engine["second"] and engine["opens"] == 1, engine
    assert [r["bytes_sent"] for r in actors] == [0, 0, 2 * actors[0]["model_bytes"], 0]
