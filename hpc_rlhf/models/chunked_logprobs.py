"""Chosen-token log-probs (and entropy) from final hidden states, without materialising (N, V) logits.

A 49k-150k vocabulary makes the LM head's output the largest tensor of a policy forward: (N, V) fp32
logits, then as many again for ``log_softmax`` and, in training, for their gradient. Only two numbers
per token are needed from it: the logit of the chosen token and the log-partition ``logsumexp``. Here
the vocabulary is walked in chunks of ``C`` columns; each chunk's logits (N, C) are folded into the
running log-partition (and the running ``E_p[z]`` for the entropy) and dropped. Backward recomputes
each chunk's logits from the saved hidden states and weight, so neither pass holds more than (N, C).

``d log p(y) / dz_v = 1[v = y] - p_v``; ``d H / dz_v = -p_v (log p_v + H)``; both scaled by
``1 / temperature`` since ``z = (h W^T) / temperature``.
"""

from __future__ import annotations

import torch

# Elements of one (N, C) logits chunk: 4M fp32 = 16 MiB whatever the number of tokens N.
CHUNK_ELEMENTS = 1 << 22
MIN_CHUNK_COLUMNS = 1024


def vocab_chunk_columns(num_tokens: int, vocab_size: int) -> int:
    """Columns per vocabulary chunk so that one (N, C) chunk holds about ``CHUNK_ELEMENTS`` elements."""
    return max(MIN_CHUNK_COLUMNS, min(vocab_size, CHUNK_ELEMENTS // max(num_tokens, 1)))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, start: int, stop: int,
                  inv_temperature: float) -> torch.Tensor:
    """(N, H) x (V, H)[start:stop] -> (N, C) fp32 logits / temperature (matmul in the weight's dtype, as
    the model's own LM head would do it)."""
    z = (hidden @ weight[start:stop].T).float()
    return z * inv_temperature if inv_temperature != 1.0 else z


class _ChunkedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy):
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        inv_t = 1.0 / temperature
        step = vocab_chunk_columns(num_tokens, vocab)
        chunk_lse, chunk_mean = [], []  # per chunk: (N,) logsumexp and E_{p_chunk}[z]
        target_logit = torch.zeros(num_tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, vocab, step):
            stop = min(start + step, vocab)
            z = _chunk_logits(hidden, weight, start, stop, inv_t)
            lse = torch.logsumexp(z, dim=-1)
            chunk_lse.append(lse)
            if with_entropy:
                chunk_mean.append((torch.softmax(z, dim=-1) * z).sum(-1))
            inside = (targets >= start) & (targets < stop)
            local = (targets - start).clamp(0, stop - start - 1)
            target_logit = torch.where(inside, z.gather(1, local[:, None]).squeeze(1), target_logit)
        lse_per_chunk = torch.stack(chunk_lse, dim=1)  # (N, chunks)
        log_z = torch.logsumexp(lse_per_chunk, dim=1)
        logprobs = target_logit - log_z
        entropy = None
        if with_entropy:
            # E_p[z] = sum over chunks of P(chunk) * E_{p | chunk}[z], P(chunk) = exp(lse_chunk - log_z)
            mean_z = (torch.exp(lse_per_chunk - log_z[:, None]) * torch.stack(chunk_mean, dim=1)).sum(1)
            entropy = log_z - mean_z
        ctx.save_for_backward(hidden, weight, targets, log_z, entropy if with_entropy else log_z)
        ctx.inv_t, ctx.step, ctx.with_entropy = inv_t, step, with_entropy
        # An output outside the loss (a detached entropy that is only logged) then reaches backward as None,
        # not as zeros, and its term is skipped instead of computed on every vocabulary chunk.
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logprobs, entropy
        return logprobs, torch.zeros_like(logprobs)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        inv_t, step = ctx.inv_t, ctx.step
        use_entropy = ctx.with_entropy and grad_entropy is not None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # every row of grad_weight is written by exactly one chunk below: no zero-fill (113 MB at 49k x 576)
        grad_weight = torch.empty_like(weight) if need_weight else None
        vocab = weight.shape[0]
        for start in range(0, vocab, step):
            stop = min(start + step, vocab)
            log_p = _chunk_logits(hidden, weight, start, stop, inv_t) - log_z[:, None]
            p = torch.exp(log_p)
            # grad_z = -g_lp p + 1[v = y] g_lp - g_H p (log p + H), built in place on p's buffer
            coef = torch.zeros_like(p[:, :1]) if grad_logprobs is None else -grad_logprobs[:, None]
            if use_entropy:
                coef = coef - grad_entropy[:, None] * (log_p + entropy[:, None])
            grad_z = p.mul_(coef)
            if grad_logprobs is not None:
                inside = ((targets >= start) & (targets < stop)).nonzero(as_tuple=True)[0]
                grad_z[inside, targets[inside] - start] += grad_logprobs[inside]
            if inv_t != 1.0:
                grad_z *= inv_t
            grad_z = grad_z.to(hidden.dtype)
            if need_hidden:
                grad_hidden += grad_z @ weight[start:stop]
            if need_weight:
                torch.mm(grad_z.T, hidden, out=grad_weight[start:stop])  # rows start:stop are contiguous
        return grad_hidden, grad_weight, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ weight.T / temperature)[targets]`` (and the entropy), chunked over the vocabulary.

    Args:
        hidden: (N, H) final hidden states (after the last norm), one per scored token.
        weight: (V, H) LM-head weight (tied or not; no bias).
        targets: (N,) long token ids, each in ``[0, V)``.
        temperature: the sampling temperature the logits are divided by.
        with_entropy: also return the entropy of each token's distribution.
    Returns:
        ``(logprobs (N,) fp32, entropy (N,) fp32 or None)``; differentiable in ``hidden`` and ``weight``.
        Peak extra memory is one (N, C) chunk (:func:`vocab_chunk_columns`), not (N, V).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logprobs: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "must be (N, H) and (V, H)")
    if vocab_chunk_columns(hidden.shape[0], weight.shape[0]) >= weight.shape[0]:
        # One chunk holds every logit (a small vocabulary or few tokens): plain autograd keeps the (N, V)
        # log-softmax for its backward instead of recomputing the head, and is then the faster of the two.
        log_p = _chunk_logits(hidden, weight, 0, weight.shape[0], 1.0 / temperature).log_softmax(dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
        return log_p.gather(1, targets[:, None]).squeeze(1), entropy
    logprobs, entropy = _ChunkedLinearLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy)
    return logprobs, (entropy if with_entropy else None)
