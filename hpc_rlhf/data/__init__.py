"""Datasets: prompt data for RL (files, mixtures, templates, a resumable stream)."""

from hpc_rlhf.data.prompts import Prompt, PromptDataset, PromptStream, tokenize_prompts
from hpc_rlhf.data.sources import DataError

__all__ = ["DataError", "Prompt", "PromptDataset", "PromptStream", "tokenize_prompts"]
