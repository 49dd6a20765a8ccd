"""KTO on unpaired desirable / undesirable samples.

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_kto --config configs/kto_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_kto --config CONFIG.yaml
"""

from __future__ import annotations

import functools

from hpc_rlhf.cli.startup import run_offline_trainer

main = functools.partial(run_offline_trainer, "kto", "hpc_rlhf.trainers.offline.kto", "KTOTrainer")

if __name__ == "__main__":
    main()
