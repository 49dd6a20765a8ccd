"""The tokenizers the package loads satisfy the :class:`Tokenizer` protocol, and its narrowing helpers refuse what
is not the one mode the package uses. (mypy checks the signatures; ``isinstance`` checks that the members exist.)"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as CoreTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hpc_rlhf.models.tiny_tokenizer import build_char_tokenizer
from hpc_rlhf.models.tokenizer_protocol import (
    Tokenizer,
    decode_text,
    eos_id,
    render_chat_text,
    token_id,
    token_text,
)


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level transformers tokenizer built here (not the package's own char tokenizer)."""
    vocab = {w: i for i, w in enumerate(["[PAD]", "[EOS]", "[UNK]", "hello", "world", "again"])}
    core = CoreTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


@pytest.fixture(scope="module", params=["char", "word"])
def tokenizer_and_token(request) -> tuple[PreTrainedTokenizerFast, str]:
    """A tokenizer and one of its tokens."""
    return (build_char_tokenizer(), "h") if request.param == "char" else (_word_tokenizer(), "hello")


def test_transformers_tokenizers_satisfy_the_protocol(tokenizer_and_token):
    tokenizer, one_token = tokenizer_and_token
    assert isinstance(tokenizer, Tokenizer)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert decode_text(tokenizer, ids) == "hello world"
    assert tokenizer(["hello", "world again"], add_special_tokens=False)["input_ids"][1] == \
        tokenizer.encode("world again", add_special_tokens=False)
    assert eos_id(tokenizer) == tokenizer.eos_token_id in tokenizer.all_special_ids
    assert token_text(tokenizer, token_id(tokenizer, one_token)) == one_token


def test_an_object_missing_a_member_is_not_a_tokenizer():
    class EncodeOnly:
        pad_token_id = eos_token_id = 0
        eos_token = "<eos>"

        def encode(self, text, add_special_tokens=True):
            return [0]

    assert not isinstance(EncodeOnly(), Tokenizer)


def test_the_chat_template_renders_text():
    messages = [{"role": "user", "content": "2+2?"}]
    assert render_chat_text(build_char_tokenizer(), messages, add_generation_prompt=True) == "Q: 2+2?\nA: "


class _ListDecoding:
    """Returns the other mode of each union: a list where the package expects one string or id."""

    eos_token_id = None

    def decode(self, token_ids, skip_special_tokens=False):
        return ["a", "b"]

    def apply_chat_template(self, conversation, **kwargs):
        return [1, 2, 3]

    def convert_tokens_to_ids(self, tokens):
        return [1]

    def convert_ids_to_tokens(self, ids):
        return ["a"]


@pytest.mark.parametrize("call", [
    lambda tok: decode_text(tok, [1, 2]),
    lambda tok: render_chat_text(tok, [{"role": "user", "content": "x"}], add_generation_prompt=True),
    lambda tok: token_id(tok, "a"),
    lambda tok: token_text(tok, 1),
], ids=["decode", "chat_template", "token_id", "token_text"])
def test_the_helpers_refuse_a_result_of_the_wrong_mode(call):
    with pytest.raises(TypeError, match="_ListDecoding"):
        call(_ListDecoding())


def test_a_tokenizer_without_eos_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\(_ListDecoding\) has no eos_token_id"):
        eos_id(_ListDecoding())
