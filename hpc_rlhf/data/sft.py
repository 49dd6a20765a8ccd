"""SFT data: local rows -> token sequences with a loss mask (responses only, or every token).

Row formats (keys from the ``data`` section):

* prompt / response: ``input_key`` + ``output_key``; the prompt goes through ``input_template`` and, with
  ``apply_chat_template``, the tokenizer's chat template (``add_generation_prompt=True``); the response
  is trained on, ending with EOS.
* chat: ``messages_key`` holds ``[{"role", "content"}, ...]``; rendered with the chat template, loss on
  every assistant turn (multi-turn), nothing else.
* pretraining (``pretrain_mode``): ``input_key`` is plain text, loss on every token.

Files, mixtures and bad rows behave as for prompt data (``hpc_rlhf.data.sources``): a bad row raises
``DataError`` naming file, row and key, or is skipped and counted with ``skip_bad_rows``.
Tokenisation is piecewise (each prompt / response piece tokenised on its own, then concatenated), so the
loss mask is exact at piece boundaries and a prompt tokenises exactly as it does at generation time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from hpc_rlhf.data.packing import TokenSample
from hpc_rlhf.data.prompts import _check_messages, _check_template, _special_prefix
from hpc_rlhf.data.sources import DataError, SkippedRows, concatenate_or_mix, load_source, row_error
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, render_chat_text

log = logging.getLogger(__name__)

Piece = tuple[str, bool]  # (text, trained on)


def load_examples(paths: Sequence[str], make: Callable[[Any, str, int], Any], *, probs: Sequence[float] | None = None,
                  max_samples: int | None = None, seed: int = 42, skip_bad_rows: bool = False,
                  what: str = "samples") -> list[Any]:
    """Read ``paths`` and turn every row into an example with ``make(row, path, row_index)``.

    ``make`` raises ``DataError`` for a bad row (skipped and counted with ``skip_bad_rows``) and may
    return None to drop a row silently (e.g. nothing left to train on after truncation).
    Without ``probs`` the sources are concatenated (the first ``max_samples``); with ``probs`` they are
    mixed exactly in proportion, ``max_samples`` being the mixture's size (``sources.concatenate_or_mix``).
    """
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise DataError(f"no data files given for the {what}")
    skipped = SkippedRows(max_reasons=3)
    dropped = 0

    def load(path: str, limit: int | None) -> list[Any]:
        nonlocal dropped
        examples, num_dropped = load_source(path, make, limit=limit, skip_bad_rows=skip_bad_rows, skipped=skipped)
        dropped += num_dropped
        return examples

    examples = concatenate_or_mix(paths, load, probs=probs, max_samples=max_samples, seed=seed)
    if skipped.total:
        log.warning("skipped %d bad rows of the %s (%s); first reasons: %s", skipped.total, what,
                    ", ".join(f"{p}: {n}" for p, n in skipped.by_source.items()), " | ".join(skipped.reasons))
    if dropped:
        log.warning("dropped %d %s with no trainable token left after truncation to data.max_len", dropped, what)
    if not examples:
        raise DataError(f"no usable {what} in {list(paths)} (skipped {skipped.total} bad rows, "
                        f"dropped {dropped} too long)")
    return examples


class TextFormatter:
    """Templates and chat templates turned into text pieces; tokenises pieces into a :class:`TokenSample`."""

    def __init__(self, tokenizer: Tokenizer, *, input_template: str | None = None, apply_chat_template: bool = False,
                 max_len: int = 512):
        _check_template(input_template)
        if apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise DataError("data.apply_chat_template=true needs a tokenizer with a chat_template")
        if tokenizer.eos_token_id is None or tokenizer.eos_token is None:
            raise DataError("the tokenizer has no eos_token; responses must end with one")
        self.tokenizer = tokenizer
        self.eos_token: str = tokenizer.eos_token
        self.input_template = input_template
        self.apply_chat_template = apply_chat_template
        self.max_len = max_len
        self.prefix = _special_prefix(tokenizer)

    @classmethod
    def from_config(cls, data: Any, tokenizer: Tokenizer) -> TextFormatter:
        """From the offline trainers' ``data`` section."""
        return cls(tokenizer, input_template=data.input_template, apply_chat_template=data.apply_chat_template,
                   max_len=data.max_len)

    # -- text -----------------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool, path: str, row: int, key: str) -> str:
        try:
            return render_chat_text(self.tokenizer, messages, add_generation_prompt)
        except Exception as err:  # jinja raises on e.g. roles that do not alternate
            raise row_error(path, row, key, f"chat template failed: {type(err).__name__}: {err}") from err

    def prompt_messages(self, prompt: str | list) -> list[dict]:
        if isinstance(prompt, str):
            return [{"role": "user", "content": self.input_template.format(prompt) if self.input_template else prompt}]
        messages = [dict(m) for m in prompt]
        users = [i for i, m in enumerate(messages) if m["role"] == "user" and isinstance(m["content"], str)]
        if self.input_template and users:
            messages[users[-1]]["content"] = self.input_template.format(messages[users[-1]]["content"])
        return messages

    def prompt_response(self, prompt: str | list, response: str, path: str, row: int, key: str) -> list[Piece]:
        """Pieces ``[(prompt, False), (response + EOS, True)]`` for one prompt and one response."""
        if not self.apply_chat_template:
            if not isinstance(prompt, str):
                raise row_error(path, row, key, "a list of messages needs data.apply_chat_template=true")
            text = self.input_template.format(prompt) if self.input_template else prompt
            return [(text, False), (response + self.eos_token, True)]
        messages = self.prompt_messages(prompt)
        prompt_text = self.render(messages, True, path, row, key)
        full = self.render([*messages, {"role": "assistant", "content": response}], False, path, row, key)
        return self.split_prefix(prompt_text, full, path, row, key)

    def split_prefix(self, prompt_text: str, full: str, path: str, row: int, key: str) -> list[Piece]:
        if not full.startswith(prompt_text):
            raise row_error(path, row, key, "the chat template does not render the prompt as a prefix of the "
                                            "conversation; cannot tell prompt from response tokens")
        response = full[len(prompt_text):]
        if self.eos_token not in response:
            response += self.eos_token  # templates without EOS would never teach the model to stop
        return [(prompt_text, False), (response, True)]

    def conversation(self, messages: list, path: str, row: int, key: str) -> list[Piece]:
        """Multi-turn chat: every assistant turn is trained on, everything else is context."""
        _check_messages(messages, path, row, key)
        if not any(m["role"] == "assistant" for m in messages):
            raise row_error(path, row, key, "no assistant message to train on")
        full = self.render(messages, False, path, row, key)
        pieces: list[Piece] = []
        done = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self.render(messages[:i], True, path, row, key)) if i else 0
            end_text = self.render(messages[:i + 1], False, path, row, key)
            if not full.startswith(end_text) or start < done:
                raise row_error(path, row, key, f"the chat template does not render turn {i} as a prefix of the "
                                                "conversation; cannot locate the assistant tokens")
            pieces += [(full[done:start], False), (full[start:len(end_text)], True)]
            done = len(end_text)
        pieces.append((full[done:], False))
        return [p for p in pieces if p[0]]

    # -- tokens ---------------------------------------------------------------------------------
    def tokenize(self, pieces: list[Piece]) -> TokenSample | None:
        """Concatenate the pieces' tokens (special prefix such as BOS added once), truncate to ``max_len``.

        Returns None when no trained token survives truncation.
        """
        ids: list[int] = []
        mask: list[bool] = []
        for text, trained in pieces:
            piece = self.tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [trained] * len(piece)
        if self.prefix and ids[:len(self.prefix)] != self.prefix:
            ids = self.prefix + ids
            mask = [False] * len(self.prefix) + mask
        ids, mask = ids[:self.max_len], mask[:self.max_len]
        if len(ids) < 2 or not any(mask[1:]):
            return None
        return TokenSample(tuple(ids), tuple(mask))


def _text(row: dict, key: str, path: str, index: int, allow_list: bool = False) -> Any:
    if key not in row:
        raise row_error(path, index, key, f"missing (row has keys {sorted(row)[:10]})")
    value = row[key]
    if isinstance(value, str):
        if not value.strip():
            raise row_error(path, index, key, "empty text")
        return value
    if allow_list and isinstance(value, list):
        _check_messages(value, path, index, key)
        return value
    raise row_error(path, index, key, f"expected a string{' or chat messages' if allow_list else ''}, "
                                      f"got {type(value).__name__}")


def make_sft_example(formatter: TextFormatter, data: Any) -> Callable[[Any, str, int], TokenSample | None]:
    """Row -> TokenSample for the ``data`` section's SFT keys (see the module docstring)."""

    def make(row: Any, path: str, index: int) -> TokenSample | None:
        if not isinstance(row, dict):
            raise row_error(path, index, None, f"expected an object, got {type(row).__name__}")
        if data.messages_key:
            if not isinstance(row.get(data.messages_key), list):
                raise row_error(path, index, data.messages_key, "expected a list of chat messages")
            pieces = formatter.conversation(row[data.messages_key], path, index, data.messages_key)
        elif data.pretrain_mode:
            pieces = [(_text(row, data.input_key, path, index) + formatter.eos_token, True)]
        else:
            prompt = _text(row, data.input_key, path, index, allow_list=formatter.apply_chat_template)
            response = _text(row, data.output_key, path, index)
            pieces = formatter.prompt_response(prompt, response, path, index, data.output_key)
        return formatter.tokenize(pieces)

    return make


def load_train_and_eval(data: Any, make: Callable[[Any, str, int], Any], seed: int,
                        what: str) -> tuple[list[Any], list[Any]]:
    """(train, eval) examples of the ``data`` section's files; eval is [] without ``data.eval_data``.
    ``what`` names the examples in errors and logs: ``"SFT {} samples"`` -> "SFT train samples"."""
    train = load_examples(data.train_data, make, probs=data.train_data_probs, max_samples=data.max_samples,
                          seed=seed, skip_bad_rows=data.skip_bad_rows, what=what.format("train"))
    evals = load_examples(data.eval_data, make, max_samples=data.max_eval_samples, seed=seed,
                          skip_bad_rows=data.skip_bad_rows, what=what.format("eval")) if data.eval_data else []
    return train, evals


def build_sft_datasets(data: Any, tokenizer: Tokenizer, seed: int) -> tuple[list[TokenSample], list[TokenSample]]:
    """(train, eval) token samples from the ``data`` section; eval is [] without ``data.eval_data``."""
    return load_train_and_eval(data, make_sft_example(TextFormatter.from_config(data, tokenizer), data), seed,
                               "SFT {} samples")
