"""Direct preference optimisation: DPO, cDPO (label smoothing), IPO, optional NLL term.

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_dpo --config configs/dpo_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_dpo --config CONFIG.yaml
"""

from __future__ import annotations

import functools

from hpc_rlhf.cli.startup import run_offline_trainer

main = functools.partial(run_offline_trainer, "dpo", "hpc_rlhf.trainers.offline.dpo", "DPOTrainer")

if __name__ == "__main__":
    main()
