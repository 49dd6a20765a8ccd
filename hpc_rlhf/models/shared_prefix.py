"""A padded RL micro-batch's decoder forward with every distinct prompt computed once.

GRPO-style batches hold ``n`` samples of each prompt, so a padded forward over ``(B, P+R)`` repeats each
prompt's ``P`` columns ``n`` times. With causal attention a prompt's hidden states and keys/values do not
depend on what follows it, so the forward here runs the ``U`` distinct prompts once, copies their KV cache
to the ``B`` rows (an index, so gradients of the copies add up in the shared prompt), and runs the
response columns against it. Values and gradients are those of the full forward up to float round-off;
the decoder's linear layers see ``U*P + B*R`` tokens instead of ``B*(P+R)``.

It needs a decoder that takes a KV cache in training (transformers' own attention: sdpa or
eager) and no activation checkpointing (transformers turns the cache off under it):
:func:`can_share_prompts` says when.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from hpc_rlhf.models.hf_compat import cache_kwargs, is_activation_checkpointing

SHARED_PREFIX_ATTENTION = ("sdpa", "eager")


def can_share_prompts(module: torch.nn.Module) -> bool:
    """Whether :func:`shared_prefix_hidden` reproduces ``module``'s padded forward."""
    config = getattr(module, "config", None)  # a transformers model's; other modules have none
    return (getattr(config, "_attn_implementation", None) in SHARED_PREFIX_ATTENTION
            and not is_activation_checkpointing(module))


def distinct_prompts(sequences: torch.Tensor, attention_mask: torch.Tensor,
                     num_actions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first_rows (U,), row_prompt (B,))``: one row per distinct left-padded prompt (tokens and padding
    alike) and, for each row, the index into ``first_rows`` of its prompt; None when no two rows share one.
    Pure; ``sequences`` / ``attention_mask`` are (B, P+R)."""
    prompt_len = sequences.shape[1] - num_actions
    if prompt_len <= 0:
        return None
    prompts = torch.where(attention_mask[:, :prompt_len].bool(), sequences[:, :prompt_len], -1)
    unique, row_prompt = torch.unique(prompts, dim=0, return_inverse=True)
    if unique.shape[0] == prompts.shape[0]:
        return None
    # the first row holding each distinct prompt
    rows = torch.arange(prompts.shape[0], device=prompts.device)
    first_rows = torch.full((unique.shape[0],), prompts.shape[0], dtype=torch.long, device=prompts.device)
    first_rows = first_rows.scatter_reduce(0, row_prompt, rows, reduce="amin")
    return first_rows, row_prompt


def shared_prefix_hidden(decoder: PreTrainedModel, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, num_actions: int, first_rows: torch.Tensor,
                         row_prompt: torch.Tensor) -> torch.Tensor:
    """(B, R, H) final hidden states at the R positions that predict the response tokens (the last prompt
    position, then response positions 0..R-2), each distinct prompt computed once.

    ``decoder``: the base model (``get_decoder()``), returning ``last_hidden_state``; ``first_rows`` /
    ``row_prompt`` from :func:`distinct_prompts`; ``position_ids`` (B, P+R) those of the full forward.
    """
    prompt_len = sequences.shape[1] - num_actions
    prompt_ids, response_ids = sequences[first_rows, :prompt_len], sequences[:, prompt_len:]
    # One embedding lookup for both forwards: its backward then builds one dense (V, H) gradient, not two.
    embeds = decoder.get_input_embeddings()(torch.cat([prompt_ids.flatten(), response_ids.flatten()]))
    prompt_embeds = embeds[: prompt_ids.numel()].view(*prompt_ids.shape, -1)
    response_embeds = embeds[prompt_ids.numel():].view(*response_ids.shape, -1)
    cache = DynamicCache(config=decoder.config)
    prompt_hidden = decoder(inputs_embeds=prompt_embeds, attention_mask=attention_mask[first_rows, :prompt_len],
                            position_ids=position_ids[first_rows, :prompt_len], use_cache=True,
                            **cache_kwargs(decoder, cache)).last_hidden_state  # (U, P, H)
    cache.batch_select_indices(row_prompt)  # (U, ...) -> (B, ...) per layer
    response_hidden = decoder(inputs_embeds=response_embeds, attention_mask=attention_mask,
                              position_ids=position_ids[:, prompt_len:], use_cache=True,
                              **cache_kwargs(decoder, cache)).last_hidden_state  # (B, R, H)
    # left padding: every prompt's last real token sits in column P-1
    return torch.cat([prompt_hidden[row_prompt, -1:], response_hidden[:, :-1]], dim=1)
