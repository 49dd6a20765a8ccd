"""KTO on unpaired desirable / undesirable samples.

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_kto --config configs/kto_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_kto --config CONFIG.yaml
"""

from __future__ import annotations

from hpc_rlhf.cli.startup import run_offline_trainer


def main(argv: list[str] | None = None) -> None:
    run_offline_trainer("kto", "hpc_rlhf.trainers.offline.kto", "KTOTrainer", argv)


if __name__ == "__main__":
    main()
