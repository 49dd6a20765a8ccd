"""Models: loading, the forward passes, kernels, LoRA / QLoRA and tiny local models.

Where each kind of forward lives:

* ``forward``: the padded and packed forwards of one model: the offline trainers' micro-batches
  (``causal_lm_forward``, ``value_model_forward``), the RL batch's log-probs, values and scores
  (``policy_logprobs``, ``critic_values``, ``sequence_scores``) and the reward server's scores.
* ``micro_forward``: one RL micro-batch's forwards for the role workers (``forward_scope`` /
  ``MicroForward``), which picks padded, packed or sequence-parallel once and calls the modules below.
* ``sequence_parallel``: the batch sharded along the sequence over an sp group, run with ring attention
  (``ring_attention``: the exact ring; ``ring_flash_import``: the ring-flash-attn kernel), outputs gathered back.
* ``chunked_logprobs``: chosen-token log-probs and entropy from hidden states through the LM head in
  vocabulary chunks (no (N, V) logits); ``forward.policy_logprobs`` uses it when the model allows.
* ``shared_prefix``: a padded GRPO batch's decoder forward with each distinct prompt run once;
  ``forward.policy_logprobs`` uses it when the attention implementation allows.
* ``vision_forward``: the same forwards of a vision-language model (images through its vision tower).
* ``token_layout``: what the text and vision forwards share (model inputs of a collated micro-batch, padded rows
  packed into one row, the chunked head's weight, the entropy over the vocabulary).
* ``logprobs``: log-probs from logits (pure tensor math).

The rest: ``loading`` (HF causal LMs and value models with the head ``score``), ``value_head``, ``precision``,
``kernels`` (Liger, attention implementation), ``lora`` / ``quantization`` (LoRA, QLoRA), ``tiny`` / ``tiny_vlm``
(tiny local models), ``tiny_tokenizer`` (their character tokenizer) and ``tokenizer_protocol`` (what the
package asks of any tokenizer: the ``Tokenizer`` protocol it annotates with).
"""
