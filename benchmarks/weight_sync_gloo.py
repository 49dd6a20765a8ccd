"""Actor -> rollout weight sync time on CPU over gloo: through rank 0 (the former path) vs sharded.

    torchrun --nproc_per_node 5 benchmarks/weight_sync_gloo.py --actor-ranks 3 --model-mb 300

The model is ``--model-mb`` of fp32 tensors of 4 MB (the sync does not care what they mean); every actor
rank holds a full copy (ZeRO 0-2), the rollout ranks copy what they receive into a model of the same shapes.
"through rank 0": rank 0 gathers 256 MB buckets and broadcasts every tensor to the rollout ranks over the
controller group, as ``PPOTrainer.sync_weights`` did; "sharded": ``ShardedWeightSync``. Rank 0 prints the
median of ``--repeats`` syncs, the effective bandwidth (model bytes / seconds: every rollout rank receives the
whole model) and the payload bytes rank 0 sent.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

TENSOR_ELEMS = 1 << 20  # 4 MB of fp32


class Weights(torch.nn.Module):
    def __init__(self, num_tensors: int):
        super().__init__()
        self.tensors = torch.nn.ParameterList(torch.nn.Parameter(torch.full((TENSOR_ELEMS,), float(i)))
                                              for i in range(num_tensors))


class CopySink:
    """A rollout engine's ``update_weights``: copy each received tensor into the model's."""

    def __init__(self, module: torch.nn.Module):
        self.targets = dict(module.named_parameters())

    def update_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.targets[name].data.copy_(tensor)


def sync_through_rank0(world, actor, sink: CopySink | None) -> None:
    """The former path: gathering on every actor rank, rank 0 forwards each bucket to the rollout role."""
    from hpc_rlhf.world.channel import broadcast_to_role

    rollout = world.roles["rollout"]
    if actor is not None:
        for bucket in actor.gathered_state_dict_items():
            if world.rank == 0:
                broadcast_to_role(dict(bucket), rollout)
        if world.rank == 0:
            broadcast_to_role(None, rollout)
    else:
        while (bucket := broadcast_to_role(None, rollout)) is not None:
            sink.update_weights(bucket.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actor-ranks", type=int, default=3)
    parser.add_argument("--model-mb", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from hpc_rlhf.config import load_config
    from hpc_rlhf.weight_sync.state_gather import ModuleWeights
    from hpc_rlhf.weight_sync.sharded import ShardedWeightSync
    from hpc_rlhf.world.groups import build_world_groups, init_world
    from hpc_rlhf.world.placement import build_placement

    env = init_world(backend="gloo")
    cfg = load_config(None, ["train.colocate_all=false", f"actor.num_ranks={args.actor_ranks}"])
    world = build_world_groups(build_placement(cfg, env.world_size))
    sharded = ShardedWeightSync(world)
    module = Weights(max(1, args.model_mb // 4))
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    is_actor = env.rank < args.actor_ranks
    actor, sink = (ModuleWeights(module), None) if is_actor else (None, CopySink(module))

    def run_sharded() -> None:
        sharded.send(actor) if is_actor else sharded.receive(sink)

    results = {}
    for name, fn in (("through rank 0", lambda: sync_through_rank0(world, actor, sink)), ("sharded", run_sharded)):
        fn()  # warm-up: connections, the plan and the headers
        sent_before = sharded.bytes_sent
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - start)
        rank0_bytes = model_bytes if name == "through rank 0" else (sharded.bytes_sent - sent_before) // args.repeats
        results[name] = (statistics.median(times), rank0_bytes)
    if env.rank == 0:
        print(f"{env.world_size} gloo ranks ({args.actor_ranks} actor, {env.world_size - args.actor_ranks} rollout), "
              f"model {model_bytes / 2**20:.0f} MiB fp32, median of {args.repeats}")
        for name, (seconds, rank0_bytes) in results.items():
            print(f"  {name:15s} {seconds:6.2f} s  {model_bytes / seconds / 2**30:5.2f} GiB/s effective  "
                  f"rank 0 broadcast {rank0_bytes / 2**20:.0f} MiB per sync")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
