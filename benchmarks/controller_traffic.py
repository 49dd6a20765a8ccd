"""What rank 0 sends to move one RL step's batches, with a copy per rank and through replica leaders, on gloo ranks.

    python benchmarks/controller_traffic.py --ranks 16              # ~2 minutes on 2 cores
    python benchmarks/controller_traffic.py --ranks 8 --layouts dp,tp2 --repeats 1
    srun -N 2 --ntasks-per-node=1 python benchmarks/controller_traffic.py --layouts dp   # one rank per task, over
                                                                                          # the nodes' network

One step here is what the trainer's controller moves for one scoring role and one trained role: the forward
inputs of every replica out and its (B, R) log-probs back (``_role_forward``), then every replica's training
shard out (the actor's fields with a KL loss: sequences, attention mask, action mask, advantages, rollout and
reference log-probs, plus the loss-normalising counts) and its statistics back (``_on_role``). The batch is a
7B GRPO step (grpo_qwen2.5_7b: 1024 samples of 1024 + 2048 tokens) scaled down to ``--samples`` x
(``--prompt-len`` + ``--response-len``).

"per-rank" is the baseline (``benchmarks/per_rank_channel.py``): one send per rank of the role and per tensor,
one after another. "replica leaders" is the package's channel (one packed buffer per message, to each replica's
leader, which broadcasts it inside the replica). Both run in the same world on the same layouts. Per layout and
channel:

- rank-0 messages: calls into torch.distributed that send (a point-to-point send, or a collective rank 0 is
  the root of), counted by wrapping those functions; a gloo collective may be several writes underneath;
- rank-0 MB out of replica: bytes of those calls to ranks outside rank 0's own data-parallel replica (the
  NIC in a real allocation); in replica: to its own tp/sp peers (NVLink in a real allocation);
- rank-0 MB written: what rank 0's process wrote to its sockets (/proc/self/io wchar: exact on gloo, with
  gloo's binomial-tree broadcasts and headers); max other MB: the most any other rank wrote;
- wall ms: median over ``--repeats`` steps, barrier to barrier on rank 0 (indicative only: 16 processes
  share 2 cores here, and gloo over loopback is not NCCL over InfiniBand);
- model: whether the messages agree with ``hpc_rlhf.world.traffic``: for "replica leaders" every rank's ledger
  (``channel.count_traffic``) equals the layout's listed messages byte for byte and the wrapped calls equal
  the ledger; for "per-rank" rank 0's count of sends equals ``per_rank_scatter_messages``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d as c10d

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"dp": (1, 1), "tp2": (2, 1), "tp4": (4, 1), "sp2": (1, 2), "tp2_sp2": (2, 2)}  # name -> (tp, sp)


# ---- counting what this rank hands to torch.distributed ----------------------------------------------------

class Tap:
    """Wraps torch.distributed's send, isend and broadcast (the channel's and those inside *_object_list) and
    counts, per destination class, the calls this rank makes as sender or root and their tensor bytes."""

    def __init__(self) -> None:
        self.own_replica: set[int] = set()  # rank 0's replica in the layout being measured
        self.messages = self.bytes_out = self.bytes_in = 0
        self.inside = False
        for name in ("send", "isend", "broadcast"):
            original = getattr(c10d, name)
            wrapped = self._wrap(name, original)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def reset(self) -> None:
        self.messages = self.bytes_out = self.bytes_in = 0

    def _count(self, tensor: torch.Tensor, receivers: set[int]) -> None:
        size = tensor.numel() * tensor.element_size()
        self.messages += 1
        if receivers <= self.own_replica:
            self.bytes_in += size
        else:
            self.bytes_out += size

    def _wrap(self, name: str, original):
        def wrapper(tensor, *args, **kwargs):
            if self.inside:  # torch's send is an isend and a wait: count the outer call only
                return original(tensor, *args, **kwargs)
            self.inside = True
            try:
                self._observe(name, tensor, args, kwargs)
                return original(tensor, *args, **kwargs)
            finally:
                self.inside = False

        return wrapper

    def _observe(self, name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if name == "broadcast":
            src = kwargs.get("src", args[0] if args else None)
            if src is None and kwargs.get("group_src") is not None:
                src = dist.get_global_rank(group, kwargs["group_src"])
            if src == dist.get_rank():
                members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
                self._count(tensor, set(members) - {src})
            return
        dst = kwargs.get("dst", args[0] if args else None)
        if dst is None and kwargs.get("group_dst") is not None:
            dst = dist.get_global_rank(group, kwargs["group_dst"])
        self._count(tensor, {dst})


def written_bytes() -> int:
    """Bytes this process has written (sockets included), from /proc/self/io."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


# ---- the step ----------------------------------------------------------------------------------------------

def step_batch(samples: int, prompt_len: int, response_len: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    width = prompt_len + response_len
    return {
        "sequences": torch.randint(0, 150_000, (samples, width), generator=gen),
        "attention_mask": torch.ones(samples, width, dtype=torch.long),
        "action_mask": torch.rand(samples, response_len, generator=gen) > 0.1,
        "advantages": torch.randn(samples, response_len, generator=gen),
        "rollout_logprobs": -torch.rand(samples, response_len, generator=gen),
        "ref_logprobs": -torch.rand(samples, response_len, generator=gen),
    }


FORWARD_FIELDS = ("sequences", "attention_mask", "action_mask")


def shards_of(batch: dict[str, torch.Tensor], dp: int) -> tuple[list[dict], list[dict]]:
    """(forward-input shards, training shards in TrainShard.to_wire's form), one per replica."""
    rows = [{k: v for k, v in zip(batch, parts, strict=True)}
            for parts in zip(*(t.chunk(dp) for t in batch.values()), strict=True)]
    forward = [{k: r[k] for k in FORWARD_FIELDS} for r in rows]
    train = [{"rows": r, "rows_per_minibatch": len(r["sequences"]), "num_tokens": [int(batch["action_mask"].sum())],
              "num_seqs": [len(batch["sequences"])], "kl_coef": 0.001} for r in rows]
    return forward, train


def one_step(channel, groups, batch: dict | None, dp: int) -> None:
    rank = dist.get_rank()
    forward, train = shards_of(batch, dp) if rank == 0 else (None, None)
    mine = channel.scatter_to_role(forward, groups)
    channel.gather_from_role(-mine["action_mask"].float(), groups)  # stands for the role's (b, R) log-probs
    mine = channel.scatter_to_role(train, groups)
    channel.gather_from_role({"policy_loss": float(mine["rows"]["advantages"].mean()), "clip_frac": 0.1}, groups)


def expected_after(groups, batch: dict, dp: int):
    """The messages ``hpc_rlhf.world.traffic`` lists for one step (every rank's), from rank 0's shards."""
    from hpc_rlhf.world.channel import payload_of, replica_layout
    from hpc_rlhf.world.traffic import gather_messages, scatter_messages

    layout = replica_layout(groups)
    forward, train = shards_of(batch, dp)
    logprobs = [payload_of(-shard["action_mask"].float()) for shard in forward]
    stats = [payload_of({"policy_loss": float(shard["rows"]["advantages"].mean()), "clip_frac": 0.1})
             for shard in train]
    return (scatter_messages(layout, [payload_of(s) for s in forward]) + gather_messages(layout, logprobs)
            + scatter_messages(layout, [payload_of(s) for s in train]) + gather_messages(layout, stats))


def expected_before_count(groups, batch: dict, dp: int) -> int:
    from hpc_rlhf.world.channel import payload_of, replica_layout
    from hpc_rlhf.world.traffic import count, per_rank_scatter_messages

    layout = replica_layout(groups)
    forward, train = shards_of(batch, dp)
    return (count(per_rank_scatter_messages(layout, [payload_of(s) for s in forward]))
            + count(per_rank_scatter_messages(layout, [payload_of(s) for s in train])))


def run_rank(rank: int, world_size: int, port: int | None, args: argparse.Namespace, results) -> None:
    """One rank of the benchmark: spawned here on loopback (``port``), or started by srun / torchrun (``port`` None:
    the launcher's variables say where rank 0 is, on another node possibly)."""
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from hpc_rlhf.world import channel as after
    from hpc_rlhf.world.groups import build_world_groups, init_world
    from hpc_rlhf.world.placement import Placement, RoleGrid

    init_world(timeout_s=600, backend="gloo")
    grids = {name: RoleGrid(name, tuple(range(world_size)), *LAYOUTS[name]) for name in args.layouts}
    world = build_world_groups(Placement(world_size, "benchmark", grids))
    batch = step_batch(args.samples, args.prompt_len, args.response_len) if rank == 0 else None
    before = importlib.import_module("per_rank_channel")
    rows, tap = [], Tap()
    for name, grid in grids.items():
        groups = world.roles[name]
        tap.own_replica = {r for r in grid.ranks if grid.dp_rank(r) == 0}
        for label, channel in (("per-rank", before), ("replica leaders", after)):
            times, check = [], None
            for repeat in range(args.repeats + 1):  # the first step also opens gloo's connections: not timed
                tap.reset()
                dist.barrier()
                written, start = written_bytes(), time.perf_counter()
                with after.count_traffic() as ledger:
                    one_step(channel, groups, batch, grid.dp_size)
                written = written_bytes() - written
                dist.barrier()
                elapsed = time.perf_counter() - start
                if repeat:
                    times.append(elapsed)
                else:
                    first = (tap.messages, tap.bytes_out, tap.bytes_in, written, list(ledger.messages))
            sent = [None] * world_size
            dist.all_gather_object(sent, first)
            if rank == 0:
                messages, out_b, in_b, wrote, _ = first
                if label == "replica leaders":
                    every = sorted((m for s in sent for m in s[4]), key=repr)
                    taps_match = all(s[0] == len(s[4]) and s[1] + s[2] == sum(m.num_bytes for m in s[4])
                                     for s in sent)
                    check = every == sorted(expected_after(groups, batch, grid.dp_size), key=repr) and taps_match
                else:
                    check = messages == expected_before_count(groups, batch, grid.dp_size)
                rows.append([name, f"{grid.tp_size}x{grid.sp_size}", grid.dp_size, label, messages,
                             f"{out_b / 1e6:.2f}", f"{in_b / 1e6:.2f}", f"{wrote / 1e6:.2f}",
                             f"{max(s[3] for s in sent[1:]) / 1e6:.2f}", f"{statistics.median(times) * 1e3:.0f}",
                             "yes" if check else "NO"])
    hosts = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    if rank == 0:
        results["rows"] = rows
        results["hosts"] = sorted(set(hosts))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--samples", type=int, default=256, help="rows of the step (default 256)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout and channel")
    args = parser.parse_args(argv)
    args.layouts = [name.strip() for name in args.layouts.split(",")]
    launched = "SLURM_STEP_ID" in os.environ or "RANK" in os.environ
    if launched:
        # started by srun or torchrun, one process per rank, maybe over several nodes: the launcher says how many
        from hpc_rlhf.world.launch_env import detect_launch_env

        env = detect_launch_env()
        args.ranks = env.world_size
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    for name in args.layouts:
        tp, sp = LAYOUTS[name]
        if args.ranks % (tp * sp) or args.samples % (args.ranks // (tp * sp)):
            parser.error(f"--ranks {args.ranks} and --samples {args.samples} do not split into layout {name}")
    start = time.perf_counter()
    if launched:  # this process is one rank; rank 0 reports
        results: dict = {}
        run_rank(env.rank, env.world_size, None, args, results)
        if env.rank != 0:
            return 0
    else:
        results = mp.Manager().dict()
        mp.spawn(run_rank, args=(args.ranks, free_port(), args, results), nprocs=args.ranks, join=True)
    header = ["layout", "tp x sp", "dp", "channel", "rank-0 messages", "rank-0 MB out of replica",
              "rank-0 MB in replica", "rank-0 MB written", "max other MB written", "wall ms", "model"]
    print(f"{args.ranks} gloo ranks on {', '.join(results['hosts'])}, {args.samples} samples x ({args.prompt_len} + {args.response_len}) tokens, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {time.perf_counter() - start:.0f} s in all\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in results["rows"]:
        print("| " + " | ".join(map(str, row)) + " |")
    return 0 if all(row[-1] == "yes" for row in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
