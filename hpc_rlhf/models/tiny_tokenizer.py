"""The character-level tokenizer of the tiny models (``hpc_rlhf.models.tiny``, ``hpc_rlhf.models.tiny_vlm``): each
character a token, special tokens for padding and sequence ends, a plain chat template, and a tool-calling variant.
Built locally in milliseconds; nothing is downloaded.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARS = string.digits + string.ascii_letters + " +-*/=?.,:;!()'\"\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)
# The tool-calling variant (``build_tiny: tools``): the char tokenizer plus ONE added (not special) token that spells
# a whole Hermes tool call of a tool named ``solve`` with no arguments, and a template that renders system and tool
# messages and an assistant's tool calls in that same form. A random tiny model emits that token with probability
# ~1/vocab per position, so RL can teach it to call the tool within a few steps; the endpoint's Hermes parser reads
# it from the decoded text like any model's tool call. Other tool calls render with characters the tokenizer
# lacks (<unk>): this model knows one tool call, no more.
TOOL_CALL_TOKEN = '<tool_call>{"name": "solve", "arguments": {}}</tool_call>'
TOOLS_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}S: {{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}A: {{ m['content'] or '' }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% elif m['role'] == 'tool' %}T: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


def build_char_tokenizer(tools: bool = False) -> PreTrainedTokenizerFast:
    """Each character is a token; special tokens for padding, begin and end of sequence. ``tools``: also the
    one-token tool call :data:`TOOL_CALL_TOKEN` and :data:`TOOLS_CHAT_TEMPLATE`."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                  unk_token=UNK, padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    if tools:
        # Not special: decoding with skip_special_tokens (as the endpoint does) keeps it in the text.
        tok.add_tokens([TOOL_CALL_TOKEN], special_tokens=False)
        tok.chat_template = TOOLS_CHAT_TEMPLATE
    return tok
