"""Each distinct prompt computed once (``hpc_rlhf.models.shared_prefix``): the same log-probs, entropy and
gradients as the full padded forward."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_rlhf.models.forward import policy_logprobs
from hpc_rlhf.models.hf_compat import enable_activation_checkpointing
from hpc_rlhf.models.shared_prefix import can_share_prompts, distinct_prompts

TOL = {"atol": 1e-5, "rtol": 1e-5}
VOCAB = 301


def _grpo_batch():
    """3 prompts (4, 2 and 5 real tokens, left-padded to 5) with 3, 2 and 1 samples, rows interleaved as a
    token-balancing shuffle leaves them; responses right-padded to 6 (lengths 6, 1, 3, 6, 2, 4)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (4, 2, 5)]
    owners, response_lens, p, r = [0, 1, 0, 2, 1, 0], [6, 1, 3, 6, 2, 4], 5, 6
    sequences = torch.zeros(len(owners), p + r, dtype=torch.long)
    attention_mask = torch.zeros_like(sequences)
    for row, (owner, rl) in enumerate(zip(owners, response_lens)):
        prompt = prompts[owner]
        sequences[row, p - len(prompt) : p] = prompt
        sequences[row, p : p + rl] = torch.randint(1, VOCAB, (rl,), generator=gen)
        attention_mask[row, p - len(prompt) : p + rl] = 1
    return sequences, attention_mask, r, owners


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def test_distinct_prompts_groups_rows_by_prompt():
    sequences, attention_mask, r, owners = _grpo_batch()
    first_rows, row_prompt = distinct_prompts(sequences, attention_mask, r)
    assert len(first_rows) == 3
    # rows map to their own prompt's first row, and that row holds the same prompt
    assert [int(first_rows[row_prompt[i]]) for i in range(len(owners))] == [0, 1, 0, 3, 1, 0]
    distinct_only = [0, 1, 3]
    assert distinct_prompts(sequences[distinct_only], attention_mask[distinct_only], r) is None


def test_shared_prefix_forward_equals_the_full_forward_with_gradients():
    model = _model()
    assert can_share_prompts(model)
    sequences, attention_mask, r, _ = _grpo_batch()
    mask = attention_mask[:, -r:].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for chunked in (True, False):  # chunked: the shared-prefix path; otherwise full logits of the full forward
        model.zero_grad()
        lp, ent = policy_logprobs(model, sequences, attention_mask, r, temperature=0.8, with_entropy=True,
                                  chunked=chunked)
        (((lp + 0.1 * ent) * weights)[mask]).sum().backward()
        results[chunked] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp_s, ent_s, grads_s), (lp_f, ent_f, grads_f) = results[True], results[False]
    torch.testing.assert_close(lp_s[mask], lp_f[mask], **TOL)
    torch.testing.assert_close(ent_s[mask], ent_f[mask], **TOL)
    for name, grad in grads_f.items():
        torch.testing.assert_close(grads_s[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_shared_prefix_skips_checkpointed_models():
    model = _model()
    enable_activation_checkpointing(model, use_reentrant=False)
    assert not can_share_prompts(model)
    model.train()
    sequences, attention_mask, r, _ = _grpo_batch()
    lp, _ = policy_logprobs(model, sequences, attention_mask, r)
    full, _ = policy_logprobs(model, sequences, attention_mask, r, chunked=False)
    mask = attention_mask[:, -r:].bool()
    torch.testing.assert_close(lp[mask], full[mask], **TOL)
