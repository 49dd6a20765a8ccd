"""Run under ``srun -n 2`` on ONE machine, pretending each task is on its own node.

Each task rewrites only the *placement* variables SLURM would give on a 2-node step with one task per
node (SLURM_NODEID, SLURM_LOCALID, the node lists, tasks-per-node) and keeps the real ones
(SLURM_PROCID, SLURM_STEP_ID, SLURM_STEP_NUM_TASKS, SLURM_JOB_ID). The fake node list is
``localhost,127.0.0.1``: two names for this machine, so node 1 must reach the master by the *first*
host's name. Rank 0 writes what every rank derived to argv[1].
"""

import json
import os
import socket
import sys

procid = int(os.environ["SLURM_PROCID"])
fake = {"SLURM_NODEID": str(procid), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
        "SLURM_STEP_NODELIST": "localhost,127.0.0.1", "SLURM_NODELIST": "localhost,127.0.0.1",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NUM_NODES": "2"}
os.environ.update(fake)
for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
    os.environ.pop(name, None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpc_rlhf.world.groups import init_world  # noqa: E402
from hpc_rlhf.world.launch_env import detect_launch_env  # noqa: E402

env = detect_launch_env()
init_world(timeout_s=60, env=env, backend="gloo")
mine = {"rank": env.rank, "world_size": env.world_size, "node_rank": env.node_rank, "num_nodes": env.num_nodes,
        "local_rank": env.local_rank, "local_world_size": env.local_world_size, "launcher": env.launcher,
        "master_addr": env.master_addr, "master_port": env.master_port, "job_id": env.job_id,
        "my_node": env.nodes[env.node_rank], "pid": os.getpid(), "host": socket.gethostname()}
gathered = [None] * env.world_size
dist.all_gather_object(gathered, mine)
total = torch.tensor([env.rank + 1.0])
dist.all_reduce(total)
if env.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"ranks": gathered, "all_reduce": total.item()}, f)
dist.destroy_process_group()
