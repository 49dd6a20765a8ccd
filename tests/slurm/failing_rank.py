"""Rank 1 raises after the world is up; rank 0 blocks in a wait that cannot notice (600 s timeout).

Rank 0 waits on a key of the rendezvous store it hosts itself, like a rank stuck in a collective
whose peer died silently: only ``srun --kill-on-bad-exit=1`` can end the job promptly.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from hpc_rlhf.world.groups import init_world

TOKEN = sys.argv[1]
env = init_world(timeout_s=600, backend="gloo")
t = torch.ones(1)
dist.all_reduce(t)  # the world works
print(f"rank {env.rank}: world up, all_reduce={t.item()}", flush=True)
if env.rank == 1:
    time.sleep(1.0)
    raise RuntimeError(f"rank 1 fails on purpose: {TOKEN}")
store = dist.distributed_c10d._get_default_store()
store.wait(["never-set"], datetime.timedelta(seconds=600))
print("rank 0: wait returned (should not happen)", flush=True)
os._exit(0)
