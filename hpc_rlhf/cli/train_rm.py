"""Reward-model training on preference pairs (value head ``score``, exported for serve_rm).

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_rm --config configs/rm_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_rm --config CONFIG.yaml
"""

from __future__ import annotations

import functools

from hpc_rlhf.cli.startup import run_offline_trainer

main = functools.partial(run_offline_trainer, "rm", "hpc_rlhf.trainers.offline.rm", "RewardModelTrainer")

if __name__ == "__main__":
    main()
