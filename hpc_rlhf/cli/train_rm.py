"""Reward-model training on preference pairs (value head ``score``, exported for serve_rm).

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_rm --config configs/rm_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_rm --config CONFIG.yaml
"""

from __future__ import annotations

from hpc_rlhf.cli.startup import run_offline_trainer


def main(argv: list[str] | None = None) -> None:
    run_offline_trainer("rm", "hpc_rlhf.trainers.offline.rm", "RewardModelTrainer", argv)


if __name__ == "__main__":
    main()
