"""Supervised fine-tuning (chat, prompt/response or pretraining text), packed or padded.

    torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_sft --config configs/sft_tiny_cpu.yaml [key=value ...]
    srun python -m hpc_rlhf.cli.train_sft --config CONFIG.yaml
"""

from __future__ import annotations

import functools

from hpc_rlhf.cli.startup import run_offline_trainer

main = functools.partial(run_offline_trainer, "sft", "hpc_rlhf.trainers.offline.sft", "SFTTrainer")

if __name__ == "__main__":
    main()
