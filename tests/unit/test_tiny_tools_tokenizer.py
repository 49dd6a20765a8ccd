"""The tiny tool-calling tokenizer (``build_tiny: tools``): one token is a whole Hermes call of ``solve``, which the
template writes back exactly as generated and the endpoint's parser reads."""

from __future__ import annotations

from hpc_rlhf.agents.tool_parsers import parse_hermes
from hpc_rlhf.models.tiny import TOOL_CALL_TOKEN, build_char_tokenizer


def test_tool_call_is_one_token_rendered_and_parsed_back():
    tok = build_char_tokenizer(tools=True)
    assert len(tok) == len(build_char_tokenizer()) + 1
    (tool_id,) = tok.encode(TOOL_CALL_TOKEN, add_special_tokens=False)
    assert tok.decode([tool_id, tok.eos_token_id], skip_special_tokens=True) == TOOL_CALL_TOKEN

    content, calls = parse_hermes(TOOL_CALL_TOKEN)
    assert content is None and [c["function"]["name"] for c in calls] == ["solve"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4="},
                {"role": "assistant", "content": None, "tool_calls": calls}, {"role": "tool", "content": "7"}]
    for call in calls:  # HF templates take the arguments as a dict
        call["function"]["arguments"] = {}
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"S: be brief\nQ: 3+4=\nA: {TOOL_CALL_TOKEN}<eos>\nT: 7\nA: "
    assert tool_id in tok.encode(text, add_special_tokens=False)  # the rendered call is the token the model made
