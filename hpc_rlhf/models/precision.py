"""The torch dtype of a run's parameters (``ds.param_dtype``), one rule for every role and engine."""

from __future__ import annotations

import torch

from hpc_rlhf.config.schema import resolved_param_dtype


def resolve_dtype(param_dtype: str, on_gpu: bool) -> torch.dtype:
    """``auto`` means bf16 on GPU and fp32 on CPU (``hpc_rlhf.config.schema.resolved_param_dtype``)."""
    return torch.bfloat16 if resolved_param_dtype(param_dtype, on_gpu) == "bf16" else torch.float32
