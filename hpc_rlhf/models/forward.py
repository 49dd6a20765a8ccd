"""The padded and packed forwards of one model: log-probs, values and scores (the map of all forwards is in
``hpc_rlhf.models``).

Two batch layouts reach a model:

* the offline trainers' micro-batches (:func:`hpc_rlhf.data.packing.collate`: one sample per row, or
  several samples packed per row with restarting ``position_ids``), through :func:`model_inputs`,
  :func:`causal_lm_forward` and :func:`value_model_forward`;
* the RL batch (``hpc_rlhf.trainers.rl.step_batch``): left-padded prompts and right-padded responses,
  ``(B, P+R)``, whose R response (action) columns hold the same positions in every row, through
  :func:`policy_logprobs` and :func:`critic_values` (optionally repacked into one row of real tokens,
  :func:`pack_actions`) and :func:`sequence_scores` for reward models.

The policy log-probs run the LM head in vocabulary chunks (``hpc_rlhf.models.chunked_logprobs``) and, for
a padded batch with repeated prompts, each prompt once (``hpc_rlhf.models.shared_prefix``) where the model
allows. Sequence-parallel forwards (ring attention) are in ``hpc_rlhf.models.sequence_parallel``; one RL
micro-batch's forwards under any of these layouts are in ``hpc_rlhf.models.micro_forward``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hpc_rlhf.data.packing import CollatedBatch
from hpc_rlhf.models.chunked_logprobs import linear_logprobs
from hpc_rlhf.models.hf_module import ModelOrEngine, base_model, child_module, hf_model
from hpc_rlhf.models.logprobs import logprobs_from_logits
from hpc_rlhf.models.moe import RouterLogits
from hpc_rlhf.models.shared_prefix import can_share_prompts, distinct_prompts, shared_prefix_hidden
from hpc_rlhf.models.token_layout import (
    LOGIT_TRANSFORMS,
    PackedActions,
    chunked_head_weight,
    layout_of,
    logits_entropy,
    model_inputs,
    pack_actions,
    scatter_actions,
    unflatten_varlen,
)
from hpc_rlhf.models.vision_forward import vision_policy_logprobs

if TYPE_CHECKING:
    pass



def _router_kwargs(router: list | None) -> dict[str, bool]:
    """transformers' switch for the router logits of an MoE model's forward, when they are asked for."""
    return {"output_router_logits": True} if router is not None else {}


def _lm_forward(model: ModelOrEngine, inputs: dict[str, Any], router: list | None,
                logits_to_keep: int | torch.Tensor = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(logits, router logits)`` of a causal LM on ``inputs`` (:func:`model_inputs`); the router logits are
    ``()`` unless ``router`` asks for them.

    With the router logits asked for and a packed batch's block-causal (4-D) mask, the decoder and the LM
    head run apart: transformers' MoE ``ForCausalLM`` then computes its own ``aux_loss`` from the attention
    mask, which it flattens as if it were (B, T), and fails.
    """
    mask = inputs.get("attention_mask")
    if router is None or mask is None or mask.dim() == 2:
        keep = {"logits_to_keep": logits_to_keep} if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep else {}
        out = model(**inputs, use_cache=False, **keep, **_router_kwargs(router))
        return out.logits, (out.router_logits if router is not None else ())
    module = hf_model(model)
    config = getattr(module, "config", None)
    transforms = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1.0)]
    if transforms:
        raise NotImplementedError(f"router logits of a packed forward of a model that transforms its logits "
                                  f"({', '.join(transforms)})")
    out = module.get_decoder()(**inputs, use_cache=False, output_router_logits=True)
    hidden = out.last_hidden_state
    kept = hidden[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else hidden[:, logits_to_keep]
    return module.get_output_embeddings()(kept), out.router_logits


# ------------------------------------------------------------------ packed or padded micro-batches (collate)

def causal_lm_forward(model: ModelOrEngine, batch: CollatedBatch, attn_implementation: str, dtype: torch.dtype,
                      router: list | None = None) -> torch.Tensor:
    """Per-target-token log-probabilities (R, T) fp32 (0 where there is no target).

    ``router``: a list to which an MoE model's :class:`RouterLogits` of this forward is appended (its real
    tokens, and as ``action_mask`` the positions that predict a target).
    """
    device = next(iter(hf_model(model).parameters())).device
    logits, layers = _lm_forward(model, model_inputs(batch, attn_implementation, dtype, device), router)
    if router is not None:
        router.append(RouterLogits(layers, (batch["segment_ids"] >= 0).reshape(-1).to(device),
                                   batch["target_mask"].reshape(-1).to(device)))
    logits = unflatten_varlen(logits, batch, attn_implementation)
    logps = logprobs_from_logits(logits, batch["target_ids"].to(device))
    return torch.where(batch["target_mask"].to(device), logps, torch.zeros((), device=device))


def sequence_logprobs(token_logps: torch.Tensor, batch: CollatedBatch, mean: bool = False) -> torch.Tensor:
    """Sum (or token mean) of target log-probabilities per sample: (R, T) -> (S,)."""
    mask = batch["target_mask"].to(token_logps.device)
    seg = batch["segment_ids"].to(token_logps.device).clamp(min=0)
    num = batch["num_samples"]
    sums = torch.zeros(num, dtype=token_logps.dtype, device=token_logps.device)
    sums = sums.index_add(0, seg[mask], token_logps[mask])
    if not mean:
        return sums
    counts = torch.zeros(num, dtype=token_logps.dtype, device=token_logps.device)
    counts = counts.index_add(0, seg[mask], torch.ones_like(token_logps[mask]))
    return sums / counts.clamp(min=1)


def sequence_last_values(values: torch.Tensor, batch: CollatedBatch) -> torch.Tensor:
    """Value at each sample's last token: (R, T) -> (S,) (reward-model scores)."""
    pos = batch["last_pos"].to(values.device)
    return values[pos[:, 0], pos[:, 1]]


def value_model_forward(model: ModelOrEngine, batch: CollatedBatch, attn_implementation: str, dtype: torch.dtype,
                        router: list | None = None) -> torch.Tensor:
    """Reward-model scores (S,) fp32: the ``score`` head at each sample's last token.

    ``router``: a list to which an MoE model's :class:`RouterLogits` of this forward is appended (its real
    tokens; every one of them as ``action_mask``).
    """
    module = hf_model(model)
    device = next(iter(module.parameters())).device
    out = base_model(module)(**model_inputs(batch, attn_implementation, dtype, device), use_cache=False,
                             **_router_kwargs(router))
    if router is not None:
        real = (batch["segment_ids"] >= 0).reshape(-1).to(device)
        router.append(RouterLogits(out.router_logits, real, real))
    hidden = unflatten_varlen(out.last_hidden_state, batch, attn_implementation)
    values = child_module(module, "score")(hidden).squeeze(-1).float()
    return sequence_last_values(values, batch)


# ------------------------------------------------------------------ per-token values and scores

def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B, T) positions counting only real tokens (left padding starts at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_values(model: ModelOrEngine, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of a critic: (B, T) ids -> (B, T) fp32, the ``score`` head on every hidden state.

    ``model`` may be a training-engine wrapper; its ``module`` is used (ZeRO hooks live on the modules).
    """
    module = hf_model(model)
    hidden = base_model(module)(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    return child_module(module, "score")(hidden).squeeze(-1).float()


def sequence_scores(model: ModelOrEngine, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score of each sequence: the value at its last real token. (B, T) -> (B,) fp32."""
    return score_at_last_token(token_values(model, input_ids, attention_mask), attention_mask)


def score_at_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token values -> (B,) the value at each row's last real token (rows may be left-padded)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
    last = torch.where(attention_mask.bool(), positions, -1).max(dim=-1).values
    return values.gather(1, last.to(values.device).unsqueeze(1)).squeeze(1)


# ------------------------------------------------------------------ RL batches: response (action) columns

def action_logits(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  num_actions: int, router: list | None = None) -> torch.Tensor:
    """Logits predicting the last ``num_actions`` tokens: (B, P+R) -> (B, R, V).

    ``logits_to_keep`` skips the LM head on prompt positions (a large saving with 150k vocabularies).
    ``router``: see :func:`policy_logprobs`.
    """
    out = model(input_ids=sequences, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                logits_to_keep=num_actions + 1, **_router_kwargs(router))
    if router is not None:
        router.append(_padded_router(out.router_logits, attention_mask, num_actions))
    return out.logits[:, -num_actions - 1 : -1]


def predicting_actions(attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
    """(B, P+R) bool: the positions whose output predicts a real response (action) token of the row."""
    predicting = torch.zeros_like(attention_mask, dtype=torch.bool)
    predicting[:, -num_actions - 1 : -1] = attention_mask[:, -num_actions:].bool()
    return predicting


def _padded_router(layers: tuple[torch.Tensor, ...], attention_mask: torch.Tensor, num_actions: int) -> RouterLogits:
    """Router logits of a padded (B, P+R) forward: (B*(P+R), E) per layer, row-major like the router's input."""
    return RouterLogits(layers, attention_mask.bool().reshape(-1),
                        predicting_actions(attention_mask, num_actions).reshape(-1))


def _packed_router(layers: tuple[torch.Tensor, ...], pack: PackedActions) -> RouterLogits:
    """Router logits of a :func:`pack_actions` forward (one packed row): (N, E) per layer."""
    real = (pack.inputs["segment_ids"] >= 0).reshape(-1)
    predicting = torch.zeros_like(real)
    predicting[pack.positions] = True
    device = layers[0].device
    return RouterLogits(layers, real.to(device), predicting.to(device))


def action_logprobs(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    num_actions: int, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of the response tokens under ``model``: (B, P+R) -> (B, R) fp32.

    ``temperature`` matches the sampling temperature so the trainer's and the engine's logprobs
    describe the same distribution.
    """
    return policy_logprobs(model, sequences, attention_mask, num_actions, temperature)[0]


def action_values(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  num_actions: int) -> torch.Tensor:
    """Critic value of the state before each response token: (B, P+R) -> (B, R) fp32."""
    return token_values(model, sequences, attention_mask)[:, -num_actions - 1 : -1]


def _chunked_policy_logprobs(model: ModelOrEngine, weight: torch.Tensor, sequences: torch.Tensor,
                             attention_mask: torch.Tensor, num_actions: int, temperature: float, packed: bool,
                             with_entropy: bool, router: list | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`policy_logprobs` from the decoder's hidden states: the LM head runs only on the real
    response tokens, in vocabulary chunks (:func:`linear_logprobs`); no (B, R, V) logits exist."""
    module, attn, dtype, device = layout_of(model)
    decoder = module.get_decoder()
    if packed:
        pack = pack_actions(sequences, attention_mask, num_actions)
        out = decoder(**model_inputs(pack.inputs, attn, dtype, device), use_cache=False, **_router_kwargs(router))
        if router is not None:
            router.append(_packed_router(out.router_logits, pack))
        hidden = out.last_hidden_state
        logprobs, entropy = linear_logprobs(hidden[0, pack.positions.to(device)], weight, pack.targets.to(device),
                                            temperature, with_entropy)
        return pack.scatter(logprobs), (pack.scatter(entropy) if entropy is not None else None)
    position_ids = position_ids_from_mask(attention_mask)
    # The router logits are those of one forward over every token; the shared-prefix forward runs two.
    share = can_share_prompts(module) and router is None
    shared = distinct_prompts(sequences, attention_mask, num_actions) if share else None
    if shared is not None:  # n samples per prompt: each prompt's columns run once
        predicting = shared_prefix_hidden(decoder, sequences, attention_mask, position_ids, num_actions, *shared)
    else:
        out = decoder(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False, **_router_kwargs(router))
        if router is not None:
            router.append(_padded_router(out.router_logits, attention_mask, num_actions))
        hidden = out.last_hidden_state
        predicting = hidden[:, -num_actions - 1 : -1]  # (B, R, H): the states that predict each response token
    mask = attention_mask[:, -num_actions:].bool()  # real response tokens; finished rows are right-padded
    logprobs, entropy = linear_logprobs(predicting[mask], weight, sequences[:, -num_actions:][mask], temperature,
                                        with_entropy)
    return scatter_actions(logprobs, mask), (scatter_actions(entropy, mask) if entropy is not None else None)


def policy_logprobs(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    num_actions: int, temperature: float = 1.0, *, packed: bool = False,
                    with_entropy: bool = False, entropy_grad: bool = True, chunked: bool = True,
                    router: list | None = None,
                    visual: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally the entropy) of the response tokens: (B, P+R) -> two (B, R) fp32.

    ``packed`` runs the forward over one packed row of real tokens (no padding FLOPs; the LM head only
    on action positions) and returns the same values as the padded forward, up to float round-off.
    The entropy is that of the sampling distribution ``softmax(logits / temperature)``; with
    ``entropy_grad=False`` it is returned detached (for logging: it costs no backward).
    ``chunked`` (when the model allows it, :func:`chunked_head_weight`) computes them from the hidden
    states of the real response tokens in vocabulary chunks, never holding (B, R, V) logits; values are
    0 on response padding (where the logits path returns the pad token's log-prob, masked downstream).
    ``router``: a list to which this forward's :class:`RouterLogits` is appended (transformers'
    ``output_router_logits``; MoE models only). A padded batch then runs as one forward, never with its
    prompts shared (:mod:`hpc_rlhf.models.shared_prefix`).
    ``visual``: the rows' images (the step batch's ``hpc_rlhf.models.vision.VISUAL_FIELDS``) for a vision-language
    model, whose forward is :func:`hpc_rlhf.models.vision_forward.vision_policy_logprobs`.
    """
    if visual is not None:
        if router is not None:
            raise NotImplementedError("router logits of a vision-language forward (MoE vision-language models)")
        return vision_policy_logprobs(model, sequences, attention_mask, visual, num_actions, temperature,
                                      packed=packed, with_entropy=with_entropy, entropy_grad=entropy_grad)
    weight = chunked_head_weight(layout_of(model)[0]) if chunked else None
    if weight is not None:
        logprobs, entropy = _chunked_policy_logprobs(model, weight, sequences, attention_mask, num_actions,
                                                     temperature, packed, with_entropy, router)
        return logprobs, (entropy if entropy is None or entropy_grad else entropy.detach())
    if not packed:
        logits = action_logits(model, sequences, attention_mask, num_actions, router)
        logprobs = logprobs_from_logits(logits, sequences[:, -num_actions:], temperature)
        return logprobs, (logits_entropy(logits, temperature, attention_mask[:, -num_actions:], entropy_grad)
                          if with_entropy else None)
    pack = pack_actions(sequences, attention_mask, num_actions)
    _, attn, dtype, device = layout_of(model)
    logits, layers = _lm_forward(model, model_inputs(pack.inputs, attn, dtype, device), router,
                                 logits_to_keep=pack.positions.to(device))  # (1, K, V)
    if router is not None:
        router.append(_packed_router(layers, pack))
    logprobs = logprobs_from_logits(logits, pack.targets.to(device).unsqueeze(0), temperature)[0]
    entropy = None
    if with_entropy:
        everywhere = torch.ones_like(logprobs).unsqueeze(0)  # (1, K): every kept position is an action
        entropy = pack.scatter(logits_entropy(logits, temperature, everywhere, entropy_grad)[0])
    return pack.scatter(logprobs), entropy


def critic_values(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  num_actions: int, *, packed: bool = False) -> torch.Tensor:
    """Value of the state before each response token: (B, P+R) -> (B, R) fp32, padded or packed."""
    if not packed:
        return action_values(model, sequences, attention_mask, num_actions)
    pack = pack_actions(sequences, attention_mask, num_actions)
    module, attn, dtype, device = layout_of(model)
    hidden = base_model(module)(**model_inputs(pack.inputs, attn, dtype, device), use_cache=False).last_hidden_state
    return pack.scatter(child_module(module, "score")(hidden[0, pack.positions.to(device)]).squeeze(-1).float())
