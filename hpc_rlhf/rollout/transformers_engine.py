"""Rollout on a plain transformers model: KV-cache generation written by hand.

Runs everywhere (CPU tests and quickstart, GPU fallback when vLLM is absent). ``model.generate`` is
avoided on purpose: we need per-row sampling parameters, per-token logprobs of the sampling
distribution, our own stop rule, and pruning of finished rows.

How one ``generate`` call works:

1. **One prefill for all prompts.** The ``R`` prompts of the call are left-padded into one batch;
   the 2-D attention mask hides the padding and ``position_ids = cumsum(mask) - 1`` makes every prompt
   start at position 0, so a padded row computes exactly what it would alone.
2. **n samples share their prompt's prefill.** The first-token logits and the ``DynamicCache`` rows
   are replicated ``n`` times (``Cache.batch_select_indices`` with a repeat-interleave index), so the
   prompt is computed once per request, not once per sample.
3. **Decode with pruning.** Each step samples one token per active row. Rows that hit a stop token or
   their own ``max_new_tokens`` leave the batch: their KV rows are dropped with
   ``batch_select_indices`` (one gather per step in which something finished - the same order of cost
   as the ``torch.cat`` that ``DynamicLayer.update`` already does every step). Later forwards only pay
   for live rows. The loop ends when no row is left.

Sampling (per row, rows may differ): ``scaled = logits / temperature``; top-k then top-p (on the
top-k-renormalised distribution, as vLLM) mask ``scaled``; the token is drawn by inverting the row's
cumulative distribution at one uniform draw (fp64 ``cumsum`` + ``searchsorted``: the law of multinomial, no host
sync; an exponential race ``argmax(p / q), q ~ Exp(1)`` draws V random numbers a row and took 11 ms of each
decode step at a 49k vocabulary on CPU, the inversion 2.6 ms). ``temperature == 0`` rows take
``argmax(logits)``. The reported logprob is ``log_softmax(scaled)[token]`` over the *full* vocabulary
(temperature applied, top-k/top-p NOT applied): the quantity the trainer recomputes with
``logits / temperature``, so the rollout/trainer ratio is 1 up to numerics even with truncation.

Routes (mixture-of-experts models, ``record_routes``): a forward hook on each router keeps the experts of
every position the engine computes (the prefill's prompt positions, then each decode step's token), returned
as ``GenerationResult.routed_experts`` (``hpc_rlhf.models.routing_replay``). The last output token is never fed
forward, so its position is marked not recorded.

Randomness: one ``torch.Generator`` per call on the model's device. Its seed is derived from the
requests' ``seed`` values when any is set (same seeds + same weights + same batch => same outputs),
else from the engine seed and a call counter (a run is reproducible, consecutive calls differ).
Unlike vLLM's per-request seeds, a sample depends on the whole call's batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache, PreTrainedModel

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.models.hf_compat import cache_kwargs
from hpc_rlhf.models.hf_module import to_device
from hpc_rlhf.models.lora import apply_lora, load_adapter_state  # peft itself: lazily, inside
from hpc_rlhf.models.moe import moe_spec
from hpc_rlhf.models.routing_replay import RouteRecorder, not_recorded
from hpc_rlhf.models.vision import flat_images, visual_row_fields
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, RolloutEngine
from hpc_rlhf.rollout.placeholder_tokens import placeholder_token_ids


@dataclass
class _RowParams:
    """Per-sample sampling parameters as device tensors, indexed like the active batch."""

    temperature: torch.Tensor  # [S] float, 0 = greedy
    top_p: torch.Tensor  # [S] float
    top_k: torch.Tensor  # [S] long, <= 0 = off
    max_new_tokens: torch.Tensor  # [S] long
    stop_ids: torch.Tensor  # [S, K] long, -1 padded (K >= 1)
    # call-level flags, computed once on the host so that sampling needs no per-step device sync;
    # they stay valid (conservative) for any subset of rows
    all_greedy: bool = False
    any_greedy: bool = False
    any_truncation: bool = False

    def select(self, index: torch.Tensor) -> _RowParams:
        """The rows ``index`` of every tensor; the call-level flags stay."""
        return dataclasses.replace(self, temperature=self.temperature[index], top_p=self.top_p[index],
                                   top_k=self.top_k[index], max_new_tokens=self.max_new_tokens[index],
                                   stop_ids=self.stop_ids[index])

    def to(self, device: torch.device) -> _RowParams:
        """Every tensor on ``device``; the call-level flags stay."""
        return dataclasses.replace(self, temperature=self.temperature.to(device), top_p=self.top_p.to(device),
                                   top_k=self.top_k.to(device), max_new_tokens=self.max_new_tokens.to(device),
                                   stop_ids=self.stop_ids.to(device))


def call_seed(requests: list[GenerationRequest], fallback: int) -> int:
    """A 63-bit seed for a whole call: from the requests' seeds if any, else ``fallback``."""
    seeds = [r.params.seed for r in requests if r.params.seed is not None]
    if not seeds:
        return fallback
    digest = hashlib.sha256(repr(seeds).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask ``logits`` [A, V] to each row's top-k, then top-p (nucleus) set; returns a new tensor.

    ``top_k <= 0`` and ``top_p >= 1`` disable the respective filter. Top-p is computed on the
    distribution renormalised after top-k and always keeps the most likely token (vLLM's order).
    """
    vocab = logits.size(-1)
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    if bool((top_p < 1).any()):
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_index, sorted_logits)


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [A, V] (rows sum to ~1, zeros allowed): the first index whose cumulative
    probability reaches ``u * total``, ``u ~ U(0, 1]``, so ``P(v) = p_v / total`` exactly up to fp64 rounding
    and a zero-probability token is never drawn. Returns [A] long."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = 1.0 - torch.rand((probs.size(0), 1), dtype=torch.float64, device=probs.device, generator=generator)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1).clamp_(max=probs.size(-1) - 1)


def sample_tokens(
    logits: torch.Tensor, params: _RowParams, generator: torch.Generator | None, banned: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [A, V] (float32); returns ``(tokens [A], logprobs [A])``.

    ``banned`` [V] bool: tokens never sampled (a vision-language model's image placeholders, which only the
    processor may place); like top-k / top-p, it changes what can be drawn, not the reported full-vocabulary
    log-prob."""
    greedy = params.temperature == 0
    scale = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / scale[:, None]
    logprobs_full = scaled.log_softmax(dim=-1)
    drawn = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    if params.all_greedy:
        tokens = drawn.argmax(dim=-1)
    else:
        if params.any_truncation:
            probs = apply_top_k_top_p(drawn, params.top_k, params.top_p).softmax(dim=-1)
        elif banned is None:
            probs = logprobs_full.exp()  # the untruncated distribution: already computed as its log
        else:
            probs = drawn.softmax(dim=-1)
        tokens = inverse_cdf_sample(probs, generator)
        if params.any_greedy:
            tokens = torch.where(greedy, drawn.argmax(dim=-1), tokens)
    return tokens, logprobs_full.gather(-1, tokens[:, None]).squeeze(-1)


def vision_placeholder_mask(config, device: torch.device) -> torch.Tensor | None:
    """[V] bool: a vision-language model's image / video placeholder and boundary tokens
    (``rollout.placeholder_tokens``: never sampled); None for a text model."""
    ids = placeholder_token_ids(config)
    if not ids:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    banned = torch.zeros(int(text.vocab_size), dtype=torch.bool, device=device)
    banned[torch.tensor(ids, dtype=torch.long)] = True
    return banned


def prefill_images(requests: list[GenerationRequest], input_ids: torch.Tensor,
                   attention_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The prefill of left-padded prompts ``input_ids`` (R, P) with images: their (3, R, P) M-RoPE positions and the
    flat ``pixel_values`` / ``image_grid_thw`` of every prompt's images in prompt order (each prompt once)."""
    visuals = [r.visual for r in requests]
    fields = visual_row_fields(visuals, input_ids.cpu(), attention_mask.cpu())
    pixels, grid = flat_images(fields["pixel_values"], fields["image_grid_thw"])
    positions = fields["mrope_position_ids"].permute(2, 0, 1)
    return positions, {"pixel_values": pixels, "image_grid_thw": grid} if grid.shape[0] else {}


class _RouteBuffer:
    """The routes of one ``generate`` call: ``prompt`` (R, P_max, L, k), the prefill's per request, left-padded like
    it; ``decoded`` (S, max_steps, L, k), step t's forward over output token t of each sample."""

    def __init__(self, prefill: torch.Tensor, num_requests: int, num_samples: int, max_steps: int) -> None:
        self.prompt = prefill.view(num_requests, -1, *prefill.shape[1:])  # the prefill's (R * P_max, L, k), row-major
        self.decoded = torch.full((num_samples, max_steps, *prefill.shape[1:]), not_recorded(prefill.dtype),
                                  dtype=prefill.dtype, device=prefill.device)

    def attach(self, results: list[GenerationResult], prompt_lens: list[int]) -> None:
        """Set each result's ``routed_experts`` (P + O, L, k) on the host."""
        prompt, decoded = self.prompt.cpu(), self.decoded.cpu()
        for sample, result in enumerate(results):
            i, p = result.request_index, prompt_lens[result.request_index]
            result.routed_experts = torch.cat([prompt[i, prompt.shape[1] - p:],
                                               decoded[sample, :len(result.output_ids)]])


def _max_positions(config: Any) -> int | None:
    """The positions the model was built for (a vision-language model's are its text model's)."""
    text = getattr(config, "text_config", None) or config
    positions = getattr(text, "max_position_embeddings", None)
    return int(positions) if isinstance(positions, int) and positions > 0 else None


class TransformersRolloutEngine(RolloutEngine):
    """Batched KV-cache generation on a ``*ForCausalLM`` (see the module docstring).

    Args:
        model: a causal LM; switched to eval mode during ``generate`` (its mode is restored after).
        eos_token_id: always ends a sequence (like vLLM without ``ignore_eos``); None to rely on
            ``stop_token_ids`` only.
        pad_token_id: filler id for left padding (never attended to); defaults to eos or 0.
        device: where generation runs; defaults to the model's device. The model is moved there.
        seed: engine seed for calls whose requests carry no seed.
        shares_trained_model: ``model`` is the trained actor's own module (colocated, see
            ``hpc_rlhf.trainers.rl.setup.rollout_shares_actor``): its weights are always current, so the
            trainer skips ``update_weights``, and ``sleep`` / ``wake_up`` leave it where training needs it.
        record_routes: return each sample's routed experts (a mixture-of-experts ``model`` only).
        lora: ``ds.lora`` under ``ds.lora.sync=adapter``: peft injects the same LoRA layers as in the actor into
            ``model`` (their ``lora_B`` zero: the base's outputs until the first :meth:`update_adapter`), and each
            sync loads the actor's adapter into them with peft's own loader, never merging it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_id: int | None,
        pad_token_id: int | None,
        device: torch.device | str | None = None,
        *,
        seed: int = 0,
        shares_trained_model: bool = False,
        record_routes: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        if lora is not None:
            # apply_lora injects peft's layers into ``model`` itself and returns it: still the same HF model
            model = cast(PreTrainedModel, apply_lora(model, lora, task_type="CAUSAL_LM"))
            model.requires_grad_(False)  # inference only: the adapter's values come from the actor
        self.lora = lora
        self.model = model
        self.max_context_len = _max_positions(model.config)
        self._num_experts: int | None = None
        if record_routes:
            spec = moe_spec(model.config)
            if spec is None:
                raise ValueError(f"record_routes: {type(model).__name__} is not a mixture-of-experts model")
            self._num_experts = spec.num_experts
        self.shares_trained_model = shares_trained_model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else (eos_token_id or 0)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        to_device(self.model, self.device)
        self.seed = seed
        self._num_calls = 0
        self._asleep = False
        self._accepts_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._banned = vision_placeholder_mask(model.config, self.device)

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        if self._asleep:
            raise RuntimeError("TransformersRolloutEngine.generate called while asleep: call wake_up() first")
        seed = call_seed(requests, fallback=self.seed * 1_000_003 + self._num_calls)
        self._num_calls += 1
        was_training = self.model.training
        self.model.eval()
        recording = RouteRecorder(self.model, self._num_experts) if self._num_experts else None
        try:
            with recording or contextlib.nullcontext():
                return self._generate(requests, seed, recording)
        finally:
            self.model.train(was_training)

    def _forward(self, input_ids, attention_mask, position_ids, cache, **images) -> torch.Tensor:
        """Next-token logits [B, V] (float32) of the last position of each row; ``images``: the prefill's
        ``pixel_values`` / ``image_grid_thw`` (vision-language models)."""
        kwargs = {"logits_to_keep": 1} if self._accepts_logits_to_keep else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **cache_kwargs(self.model, cache), **kwargs, **images)
        return out.logits[:, -1, :].float()

    def _generate(self, requests: list[GenerationRequest], seed: int,
                  recording: RouteRecorder | None) -> list[GenerationResult]:
        device = self.device
        num_requests = len(requests)
        samples_per_request = torch.tensor([r.n for r in requests], device=device)
        # sample s belongs to request sample_request[s]; samples of a request are consecutive
        sample_request = torch.repeat_interleave(torch.arange(num_requests, device=device), samples_per_request)
        num_samples = int(sample_request.numel())
        params = self._row_params(requests, sample_request)
        max_steps = max(r.params.max_new_tokens for r in requests)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)

        # 1. prefill every prompt once, left-padded
        prompt_lens = [len(r.prompt_ids) for r in requests]
        max_prompt = max(prompt_lens)
        input_ids = torch.full((num_requests, max_prompt), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((num_requests, max_prompt), dtype=torch.long)
        for i, r in enumerate(requests):
            input_ids[i, max_prompt - prompt_lens[i]:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            attention_mask[i, max_prompt - prompt_lens[i]:] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        if any(r.visual is not None for r in requests):
            # each prompt's images once (its n samples share the prefill); 3-D M-RoPE positions per prompt
            prefill_positions, images = prefill_images(requests, input_ids, attention_mask)
            logits = self._forward(input_ids, attention_mask, prefill_positions.to(device), cache,
                                   **{k: v.to(device) for k, v in images.items()})
            # decoding continues at one past each prompt's largest position (text positions are equal on all axes)
            position_ids = prefill_positions.amax(dim=0).to(device)
        else:
            logits = self._forward(input_ids, attention_mask, position_ids, cache)
        routes = (_RouteBuffer(recording.take(), num_requests, num_samples, max_steps)
                  if recording else None)

        # 2. replicate per sample; the KV copy is folded into the first gather of the loop
        logits = logits[sample_request]
        attention_mask = attention_mask[sample_request]
        next_position = position_ids[sample_request, -1] + 1
        active = torch.arange(num_samples, device=device)  # global sample id of each active row
        row_params = params
        pending_gather = None if num_samples == num_requests else sample_request  # cache rows to keep

        out_tokens = torch.full((num_samples, max_steps), self.pad_token_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((num_samples, max_steps), dtype=torch.float32, device=device)
        out_lengths = torch.zeros(num_samples, dtype=torch.long, device=device)
        stopped = torch.zeros(num_samples, dtype=torch.bool, device=device)

        # 3. decode, dropping finished rows
        for step in range(max_steps):
            tokens, logprobs = sample_tokens(logits, row_params, generator, self._banned)
            out_tokens[active, step] = tokens
            out_logprobs[active, step] = logprobs
            hit_stop = (tokens[:, None] == row_params.stop_ids).any(dim=-1)
            finished = hit_stop | (row_params.max_new_tokens <= step + 1)
            if bool(finished.any()):
                done = active[finished]
                out_lengths[done] = step + 1
                stopped[done] = hit_stop[finished]
                keep = (~finished).nonzero(as_tuple=True)[0]
                if keep.numel() == 0:
                    break
                active, tokens, row_params = active[keep], tokens[keep], row_params.select(keep)
                attention_mask, next_position = attention_mask[keep], next_position[keep]
                pending_gather = keep if pending_gather is None else pending_gather[keep]
            if pending_gather is not None:
                cache.batch_select_indices(pending_gather)
                pending_gather = None
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.size(0), 1))], dim=-1)
            logits = self._forward(tokens[:, None], attention_mask, next_position[:, None], cache)
            if routes is not None and recording is not None:  # both or neither
                routes.decoded[active, step] = recording.take()
            next_position = next_position + 1
        results = self._results(requests, sample_request, out_tokens, out_logprobs, out_lengths, stopped)
        if routes is not None:
            routes.attach(results, prompt_lens)
        return results

    def _row_params(self, requests: list[GenerationRequest], sample_request: torch.Tensor) -> _RowParams:
        stop_lists = []
        for r in requests:
            stops = list(r.params.stop_token_ids)
            if self.eos_token_id is not None and self.eos_token_id not in stops:
                stops.append(self.eos_token_id)
            stop_lists.append(stops)
        width = max(1, max(len(s) for s in stop_lists))
        stop_ids = torch.full((len(requests), width), -1, dtype=torch.long)
        for i, stops in enumerate(stop_lists):
            stop_ids[i, :len(stops)] = torch.tensor(stops, dtype=torch.long)
        per_request = _RowParams(
            temperature=torch.tensor([r.params.temperature for r in requests], dtype=torch.float32),
            top_p=torch.tensor([r.params.top_p for r in requests], dtype=torch.float32),
            top_k=torch.tensor([r.params.top_k for r in requests], dtype=torch.long),
            max_new_tokens=torch.tensor([r.params.max_new_tokens for r in requests], dtype=torch.long),
            stop_ids=stop_ids,
            all_greedy=all(r.params.temperature == 0 for r in requests),
            any_greedy=any(r.params.temperature == 0 for r in requests),
            any_truncation=any(r.params.top_k > 0 or r.params.top_p < 1 for r in requests),
        )
        return per_request.to(self.device).select(sample_request)

    @staticmethod
    def _results(requests, sample_request, out_tokens, out_logprobs, out_lengths, stopped) -> list[GenerationResult]:
        # one device->host copy for the whole call
        tokens, logprobs = out_tokens.tolist(), out_logprobs.tolist()
        lengths, stopped, owners = out_lengths.tolist(), stopped.tolist(), sample_request.tolist()
        results = []
        for s, i in enumerate(owners):
            n = lengths[s]
            results.append(GenerationResult(
                prompt_ids=list(requests[i].prompt_ids),
                output_ids=tokens[s][:n],
                output_logprobs=logprobs[s][:n],
                finish_reason="stop" if stopped[s] else "length",
                request_index=i,
            ))
        return results

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # state_dict(keep_vars=True) lists tied weights under every name (lm_head.weight and
        # model.embed_tokens.weight), which named_parameters() would deduplicate away.
        targets = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise KeyError(f"update_weights: unknown parameter name {name!r} for "
                               f"{type(self.model).__name__} (expected HF state_dict names)")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"update_weights: shape mismatch for {name!r}: model has "
                                 f"{tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.data.copy_(tensor)

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """``ds.lora.sync=adapter``: load the actor's adapter into this engine's LoRA layers (peft's
        ``set_peft_model_state_dict``; the base weights stay). Returns the adapter's bytes."""
        if self.lora is None:
            raise RuntimeError("TransformersRolloutEngine.update_adapter: the engine was built without a LoRA "
                               "adapter (ds.lora.sync resolved to merged); sync merged weights with update_weights")
        tensors = [(name, tensor.to(self.device)) for name, tensor in named_tensors]
        load_adapter_state(self.model, tensors)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def sleep(self) -> None:
        if self.device.type == "cpu" or self._asleep or self.shares_trained_model:
            return
        to_device(self.model, "cpu")
        self._asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``"weights"`` (or no tags) moves the model back; ``"kv_cache"`` is a no-op: no cache outlives a call."""
        if not self._asleep or (tags is not None and "weights" not in tags):
            return
        to_device(self.model, self.device)
        self._asleep = False

    def reset_prefix_cache(self) -> None:
        """No cache survives a ``generate`` call, so there is nothing to reset."""
