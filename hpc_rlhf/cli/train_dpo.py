"""Direct preference optimisation: DPO, cDPO (label smoothing), IPO, optional NLL term.

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_dpo --config configs/dpo_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_dpo --config CONFIG.yaml
"""

from __future__ import annotations

from hpc_rlhf.trainers.offline.base import run_supervised


def main(argv: list[str] | None = None) -> None:
    run_supervised("dpo", "hpc_rlhf.trainers.offline.dpo", "DPOTrainer", argv)


if __name__ == "__main__":
    main()
