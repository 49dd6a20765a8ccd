"""A SmolLM2-135M-shaped Llama and a byte-level BPE tokenizer with a ChatML template, built locally.

Nothing is downloaded: the tokenizer is trained with the ``tokenizers`` library on text found on this
machine (this repository's sources and docs, then Python's standard library), the model is a randomly
initialised ``LlamaForCausalLM`` with SmolLM2-135M's shape. Random weights are fine for timing: every
kernel, the LM head and the vocabulary have the real sizes.

From the ~24 MB corpus the trainer reaches the full 49152 tokens; were it to run out of merges, the model
would keep ``vocab_size=49152`` regardless (rows past the tokenizer are part of every LM-head matmul and
softmax, which is the cost the benchmark is about); ``tokenizer_vocab.json`` records both sizes.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROOT = Path(__file__).resolve().parents[1]


def corpus_texts(max_bytes: int = 24 * 2**20) -> list[str]:
    """Texts to train the tokenizer on: this repository first, then the standard library (UTF-8 files only)."""
    texts, total = [], 0
    roots = [ROOT / "hpc_rlhf", ROOT / "docs", ROOT / "tests", Path(sysconfig.get_paths()["stdlib"])]
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix not in (".py", ".md", ".txt", ".rst") or "site-packages" in path.parts:
                continue
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
            total += len(texts[-1])
            if total >= max_bytes:
                return texts
    return texts


def build_bpe_tokenizer(vocab_size: int = 49152):
    """Byte-level BPE (as SmolLM2's) trained locally, wrapped as a ``PreTrainedTokenizerFast`` with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus_texts(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>", padding_side="left")
    tok.chat_template = CHATML
    return tok


def build_smollm2_135m(path: str | Path, seed: int = 0) -> Path:
    """Create (once) the model + tokenizer folder at ``path``, loadable with the Auto classes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tok = build_bpe_tokenizer(SMOLLM2_135M["vocab_size"])
    config = LlamaConfig(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         initializer_range=0.041, **SMOLLM2_135M)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "tokenizer_vocab.json").write_text(json.dumps({"trained_vocab": len(tok),
                                                          "model_vocab": SMOLLM2_135M["vocab_size"]}))
    tmp.rename(path)
    return path
