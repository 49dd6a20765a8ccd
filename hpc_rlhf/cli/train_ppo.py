"""Online RL (PPO / REINFORCE++ / GRPO / RLOO ...): one rank per GPU (or CPU process).

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_ppo --config configs/grpo_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_ppo --config configs/ppo_llama3_8b.yaml
"""

from __future__ import annotations

import torch.distributed as dist

from hpc_rlhf.cli.common import parse_run_args, prepare_local_assets, start_world
from hpc_rlhf.world.preemption import preemption_guard


def main(argv: list[str] | None = None) -> None:
    preemption_guard()  # first: a SLURM signal during start-up is kept, not fatal
    cfg = parse_run_args("train_ppo", argv)
    prepare_local_assets(cfg)
    _, world = start_world(cfg)
    from hpc_rlhf.trainers.rl.async_loop import trainer_class

    trainer_class(cfg)(cfg, world).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
