"""Online RL (PPO / REINFORCE++ / GRPO / RLOO ...): one rank per GPU (or CPU process).

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_ppo --config configs/grpo_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_ppo --config configs/ppo_llama3_8b.yaml
"""

from __future__ import annotations

import torch.distributed as dist

from hpc_rlhf.cli.startup import start_run
from hpc_rlhf.config import load_config
from hpc_rlhf.resilience.preemption import exit_if_stopped
from hpc_rlhf.world.groups import build_world_groups
from hpc_rlhf.world.placement import build_placement


def main(argv: list[str] | None = None) -> None:
    cfg, env = start_run("train_ppo", argv, load_config)
    # Imported once start_run has installed the preemption guard: loading the trainer (transformers, the
    # rollout and training facades) takes seconds, and a SLURM signal in that window must be remembered, not fatal.
    from hpc_rlhf.trainers.rl.async_loop import trainer_class

    world = build_world_groups(build_placement(cfg, env.world_size))
    trainer = trainer_class(cfg)(cfg, world)
    trainer.fit()
    trainer.close()
    if dist.is_initialized():  # vLLM's external launcher takes the world down with its engine
        dist.destroy_process_group()
    exit_if_stopped(trainer)  # status 75: stopped on a signal, resume with ckpt.load=true


if __name__ == "__main__":
    main()
