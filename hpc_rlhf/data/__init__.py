"""Datasets and token layouts: RL prompts, SFT / preference / KTO data, mixtures, templates, packing."""

from hpc_rlhf.data.prompts import Prompt, PromptDataset, PromptStream, source_name, tokenize_prompts
from hpc_rlhf.data.sources import DataError

__all__ = ["DataError", "Prompt", "PromptDataset", "PromptStream", "source_name", "tokenize_prompts"]
