"""Load the models of each role from local HF folders, and compute values and scores with them.

The critic and the reward model are ``AutoModelForSequenceClassification`` with one label: their linear
head is called ``score`` like OpenRLHF's value head, so a reward model trained elsewhere loads as is.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

# resolve_attn_implementation is re-exported: the trainers import it from here.
from hpc_rlhf.models.kernels import apply_liger_kernel, resolve_attn_implementation  # noqa: F401
from hpc_rlhf.models.quantization import bnb_4bit_load_kwargs, keep_cpu_numerics_exact


def _from_pretrained(auto_class, path: str, dtype: torch.dtype, attn_implementation: str, use_liger_kernel: bool,
                     load_in_4bit: bool, **kwargs) -> PreTrainedModel:
    """``auto_class.from_pretrained`` with the options every role shares: QLoRA's 4-bit base, Liger kernels."""
    if load_in_4bit:
        kwargs.update(bnb_4bit_load_kwargs(dtype, on_gpu=torch.cuda.is_available()))
    model = auto_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **kwargs)
    if load_in_4bit:
        keep_cpu_numerics_exact(model)
    if use_liger_kernel:
        apply_liger_kernel(model)
    return model


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa",
                   use_liger_kernel: bool = False, load_in_4bit: bool = False) -> PreTrainedModel:
    """An actor / reference policy. ``use_liger_kernel``: Liger's kernels when they can run (``kernels``).
    ``load_in_4bit``: NF4 base weights for QLoRA (``hpc_rlhf.models.quantization``)."""
    return _from_pretrained(AutoModelForCausalLM, path, dtype, attn_implementation, use_liger_kernel, load_in_4bit)


def load_value_model(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa",
                     use_liger_kernel: bool = False, load_in_4bit: bool = False) -> PreTrainedModel:
    """A critic or reward model: base transformer + linear ``score`` head with one output (kept in full
    precision under ``load_in_4bit``: bitsandbytes skips the modules transformers marks as heads)."""
    model = _from_pretrained(AutoModelForSequenceClassification, path, dtype, attn_implementation, use_liger_kernel,
                             load_in_4bit, num_labels=1)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B, T) positions counting only real tokens (left padding starts at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_values(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of a critic: (B, T) ids -> (B, T) fp32, the ``score`` head on every hidden state.

    ``model`` may be a training-engine wrapper; its ``module`` is used (ZeRO hooks live on the modules).
    """
    model = getattr(model, "module", model)
    base = getattr(model, model.base_model_prefix)
    hidden = base(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def sequence_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score of each sequence: the value at its last real token. (B, T) -> (B,) fp32."""
    return score_at_last_token(token_values(model, input_ids, attention_mask), attention_mask)


def score_at_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token values -> (B,) the value at each row's last real token (rows may be left-padded)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
    last = torch.where(attention_mask.bool(), positions, -1).max(dim=-1).values
    return values.gather(1, last.to(values.device).unsqueeze(1)).squeeze(1)
