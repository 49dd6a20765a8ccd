"""Preference pairs (reward model, DPO) and KTO samples: local rows -> token sequences with loss masks.

Pairs: ``prompt_key`` + ``chosen_key`` + ``rejected_key`` (strings; the prompt may be chat messages
with ``apply_chat_template``), or, with ``prompt_key: null``, ``chosen`` / ``rejected`` as full chat
conversations whose last message is the assistant answer (the shared history is the prompt). An
optional ``margin_key`` gives a per-pair reward margin. KTO rows: ``prompt_key`` + ``completion_key`` +
``label_key`` (true / 1 desirable, false / 0 undesirable).

Loss masks mark the response tokens (what DPO / KTO sum log-probabilities over); a reward model scores
the last token of each sequence, which is the EOS that every response ends with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_rlhf.data.packing import TokenSample
from hpc_rlhf.data.sft import Piece, TextFormatter, _text, load_train_and_eval
from hpc_rlhf.data.sources import row_error
from hpc_rlhf.models.tokenizer_protocol import Tokenizer


@dataclass(frozen=True)
class PreferencePair:
    chosen: TokenSample
    rejected: TokenSample
    margin: float = 0.0


@dataclass(frozen=True)
class KTOSample:
    sample: TokenSample
    desirable: bool
    prompt_len: int  # tokens of the prompt, to pair it with another sample's response (KL estimate)


def _response_pieces(formatter: TextFormatter, row: dict, data: Any, key: str, path: str,
                     index: int) -> list[Piece]:
    if data.prompt_key is None:
        messages = row.get(key)
        if not isinstance(messages, list) or len(messages) < 2 or messages[-1].get("role") != "assistant":
            raise row_error(path, index, key, "with data.prompt_key=null each answer must be a chat conversation "
                                              "ending with an assistant message")
        if not formatter.apply_chat_template:
            raise row_error(path, index, key, "chat conversations need data.apply_chat_template=true")
        messages = [dict(m) for m in messages]
        prompt = formatter.render(formatter.prompt_messages(messages[:-1]), True, path, index, key)
        full = formatter.render([*formatter.prompt_messages(messages[:-1]), messages[-1]], False, path, index, key)
        return formatter.split_prefix(prompt, full, path, index, key)
    prompt = _text(row, data.prompt_key, path, index, allow_list=formatter.apply_chat_template)
    return formatter.prompt_response(prompt, _text(row, key, path, index), path, index, key)


def _fit(formatter: TextFormatter, pieces: list[Piece], path: str, index: int, key: str) -> TokenSample:
    sample = formatter.tokenize(pieces)
    if sample is None:
        raise row_error(path, index, key, f"no response token fits in data.max_len={formatter.max_len} "
                                          "(prompt too long); raise max_len or drop the row")
    return sample


def row_margin(row: dict, data: Any, path: str, index: int) -> float:
    """The pair's reward margin from ``data.margin_key`` (0 without one); a non-number names the row and key."""
    if data.margin_key is None:
        return 0.0
    value = row.get(data.margin_key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise row_error(path, index, data.margin_key, f"margin must be a number, got {value!r:.40}")
    return float(value)


def make_pair(formatter: TextFormatter, data: Any):
    def make(row: Any, path: str, index: int) -> PreferencePair:
        if not isinstance(row, dict):
            raise row_error(path, index, None, f"expected an object, got {type(row).__name__}")
        chosen = _fit(formatter, _response_pieces(formatter, row, data, data.chosen_key, path, index), path, index,
                      data.chosen_key)
        rejected = _fit(formatter, _response_pieces(formatter, row, data, data.rejected_key, path, index), path,
                        index, data.rejected_key)
        return PreferencePair(chosen, rejected, row_margin(row, data, path, index))

    return make


def _label(value: Any, path: str, index: int, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "desirable", "undesirable"):
        return value.lower() in ("true", "desirable")
    raise row_error(path, index, key, f"KTO label must be true/false (or 1/0), got {value!r:.40}")


def make_kto_sample(formatter: TextFormatter, data: Any):
    def make(row: Any, path: str, index: int) -> KTOSample:
        if not isinstance(row, dict):
            raise row_error(path, index, None, f"expected an object, got {type(row).__name__}")
        if data.label_key not in row:
            raise row_error(path, index, data.label_key, "missing desirable / undesirable label")
        desirable = _label(row[data.label_key], path, index, data.label_key)
        pieces = _response_pieces(formatter, row, data, data.completion_key, path, index)
        sample = _fit(formatter, pieces, path, index, data.completion_key)
        prompt_len = sample.loss_mask.index(True)
        return KTOSample(sample, desirable, prompt_len)

    return make


def build_preference_datasets(data: Any, tokenizer: Tokenizer,
                              seed: int) -> tuple[list[PreferencePair], list[PreferencePair]]:
    return load_train_and_eval(data, make_pair(TextFormatter.from_config(data, tokenizer), data), seed,
                               "preference {} pairs")


def build_kto_datasets(data: Any, tokenizer: Tokenizer, seed: int) -> tuple[list[KTOSample], list[KTOSample]]:
    return load_train_and_eval(data, make_kto_sample(TextFormatter.from_config(data, tokenizer), data), seed,
                               "KTO {} samples")


def mismatched_samples(samples: list[KTOSample], max_len: int) -> list[TokenSample]:
    """KL pairs ``(x_i, y_{i+1 mod n})``: each prompt with the next sample's response (TRL / OpenRLHF)."""
    out = []
    n = len(samples)
    for i, s in enumerate(samples):
        other = samples[(i + 1) % n].sample if n > 1 else s.sample
        other_prompt = other.loss_mask.index(True)
        ids = s.sample.input_ids[:s.prompt_len] + other.input_ids[other_prompt:]
        mask = (False,) * s.prompt_len + other.loss_mask[other_prompt:]
        ids, mask = ids[:max_len], mask[:max_len]
        if not any(mask[1:]):  # the prompt fills max_len: keep the matched sample (KL term of 0 for it)
            ids, mask = s.sample.input_ids, s.sample.loss_mask
        out.append(TokenSample(tuple(ids), tuple(mask)))
    return out
