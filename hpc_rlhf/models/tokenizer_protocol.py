"""What the package asks of a tokenizer: the :class:`Tokenizer` protocol and the narrowing helpers its callers use.

Every tokenizer the package loads is a transformers ``PreTrainedTokenizerBase`` (``AutoTokenizer``, the tiny
character tokenizer of :mod:`hpc_rlhf.models.tiny_tokenizer`); the protocol lists only the members the package calls,
so a reader sees what a tokenizer must do here and mypy checks every call against it. transformers types several
methods with one return type for all their input modes (``decode`` returns ``str | list[str]``, a chat template
``str | list[int] | ... | BatchEncoding``); the protocol keeps those honest unions and :func:`decode_text` /
:func:`render_chat_text` narrow them for the one mode the package uses, failing loudly on anything else.

This module imports nothing heavy (no torch, no transformers): light modules annotate with it.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """The members of a (transformers) tokenizer that the package uses.

    ``isinstance(x, Tokenizer)`` checks only that the members exist, not their signatures: mypy checks those.
    Special-token ids are ``None`` when the tokenizer defines no such token. ``chat_template`` is not a member: a
    tokenizer may have none, so its readers ask ``getattr(tokenizer, "chat_template", None)`` and say what to do.
    Transformers-only members stay with transformers' own type where they are used (``save_pretrained`` when a
    checkpoint is exported, ``name_or_path`` in the teacher check, ``truncation_side`` in the reward server).
    """

    pad_token_id: int | None
    eos_token_id: int | None
    eos_token: str | None  # appended to SFT responses so the model learns to stop

    @property
    def all_special_ids(self) -> list[int]: ...

    def __call__(self, text: list[str], *, add_special_tokens: bool = ...) -> Any:
        """Batch encode: ``tokenizer(texts)["input_ids"]`` is one id list per text (a transformers
        ``BatchEncoding``, kept ``Any`` so this module needs no transformers import)."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = ...) -> list[str]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool = ...,
                            tokenize: bool = ..., **kwargs: Any) -> object:
        """With ``tokenize=False`` the rendered text; :func:`render_chat_text` narrows it."""

    def convert_tokens_to_ids(self, tokens: str) -> int | list[int]: ...

    def convert_ids_to_tokens(self, ids: int) -> str | list[str]: ...

    def get_vocab(self) -> dict[str, int]: ...

    def __len__(self) -> int:
        """The vocabulary size, added tokens included."""


def eos_id(tokenizer: Tokenizer) -> int:
    """The end-of-sequence id, which ends every generation and pads an empty response."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no eos_token_id: generation needs one to "
                         "stop; use a model whose tokenizer_config.json sets eos_token")
    return tokenizer.eos_token_id


_Narrowed = TypeVar("_Narrowed", str, int)


def _narrow(result: object, expected: type[_Narrowed], tokenizer: Tokenizer, call: str) -> _Narrowed:
    """``result`` if it is of the one type the package asked for; else a TypeError naming the tokenizer and call."""
    if not isinstance(result, expected):
        raise TypeError(f"{type(tokenizer).__name__}.{call} returned {type(result).__name__}, "
                        f"not {expected.__name__}")
    return result


def decode_text(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of one id list (``token_ids``: (L,) ids); a tokenizer that returns anything but a ``str`` for one
    id list is refused rather than passed on as text."""
    return _narrow(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens), str, tokenizer,
                   "decode of one id list")


def render_chat_text(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     **render_kwargs: Any) -> str:
    """``messages`` rendered by the tokenizer's chat template as text (``tokenize=False``)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **render_kwargs)
    return _narrow(text, str, tokenizer, "apply_chat_template(tokenize=False)")


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of one token string."""
    return _narrow(tokenizer.convert_tokens_to_ids(token), int, tokenizer, f"convert_tokens_to_ids({token!r})")


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The token string of one id."""
    return _narrow(tokenizer.convert_ids_to_tokens(token_id), str, tokenizer, f"convert_ids_to_tokens({token_id})")
