"""hpc-rlhf: SLURM-native RLHF and agentic RL in one torch.distributed world.

Importing this package is cheap on purpose: it must work on a login node
without deepspeed, vllm or flash-attn.
"""

__version__ = "0.1.0"
