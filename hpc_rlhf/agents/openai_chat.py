"""Text <-> token rules of the OpenAI-compatible endpoint: chat prompts, stop strings.

Chat prompts (:func:`chat_prompt_ids`)
--------------------------------------
A chat request is rendered with the actor tokenizer's chat template (``tools`` passed to it) and
tokenised without adding special tokens (the template writes them), as vLLM's server does. When the
request *continues* an earlier call of the same episode - its messages are that call's messages, then the
assistant message that call returned (same content and tool calls), then anything - the prompt is built
from tokens instead: the earlier call's prompt ids + its output ids exactly as generated + the tokens of
the text the template adds after that assistant message. Re-tokenising the model's own answer could give
different ids than it sampled (and the trained tokens would not be the sampled ones); this way a linear
chat is one token sequence (see ``openai_recording``). The text the template puts after the assistant
content (e.g. ``<eos>\\n`` or ``<|im_end|>\\n``) is bridged: an end-of-turn token the model already
generated is not added twice, and special tokens the model generated stay where they are (they are not in
the returned text). Where the template re-renders the assistant turn differently from what the
model generated (tool-call JSON re-serialised, reasoning stripped), the prompt is rendered from text and the
episode branches there.

Stop strings: the engine stops on token ids only, so a stop string is applied after generation: the output
is cut before the first occurrence, as OpenAI does, and the recorded tokens are the longest prefix of the
output whose text lies within the returned text (the stop string's tokens are neither returned nor trained).

Tool calls and reasoning are split out of the text by the family's parser (``tool_parsers``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from hpc_rlhf.agents.openai_recording import CompletionRecord
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, decode_text, render_chat_text


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template or the template rejected the request."""


def render_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool, **render_kwargs: Any) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the actor tokenizer has no chat_template: use /v1/completions, or a model whose "
                                "tokenizer_config.json has one")
    try:
        return render_chat_text(tokenizer, messages, add_generation_prompt, **render_kwargs)
    except Exception as err:  # template errors (jinja raise_exception) become a 400
        raise ChatTemplateError(f"chat template failed: {type(err).__name__}: {err}") from err


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _normalise_tool_calls(calls: Any) -> list[tuple[str | None, Any]]:
    """``[(name, arguments)]`` of a message's tool calls, JSON arguments parsed, for comparing two messages."""
    out = []
    for call in calls or []:
        fn = (call or {}).get("function", call) or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                args = json.loads(args)
        out.append((fn.get("name"), args))
    return out


def _same_assistant(sent: dict, returned: dict | None) -> bool:
    if returned is None or sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "") != (returned.get("content") or ""):
        return False
    return _normalise_tool_calls(sent.get("tool_calls")) == _normalise_tool_calls(returned.get("tool_calls"))


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as HF chat templates expect them: tool call arguments as dicts, not JSON strings."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(ValueError):
                        fn["arguments"] = json.loads(fn["arguments"])
                call["function"] = fn
                calls.append(call)
            message["tool_calls"] = calls
        out.append(message)
    return out


def _continuation(tokenizer: Tokenizer, record: CompletionRecord, messages: list[dict], full_text: str,
                  render_kwargs: dict, expand: Callable[[str], str] = str) -> list[int] | None:
    """Prompt ids for ``messages`` continuing ``record`` (module docstring), or None if it does not."""
    earlier = record.messages or []
    if record.render_kwargs != render_kwargs or len(messages) <= len(earlier):
        return None
    if messages[: len(earlier)] != earlier or not _same_assistant(messages[len(earlier)], record.message):
        return None
    head = render_chat(tokenizer, template_messages(earlier), True, **render_kwargs)
    through = render_chat(tokenizer, template_messages(messages[: len(earlier) + 1]), False, **render_kwargs)
    if not through.startswith(head) or not full_text.startswith(through):
        return None
    rendered_turn = through[len(head):]  # the assistant turn as the template writes it
    output_ids = list(record.output_ids)
    # Special tokens the model generated are in the token sequence but not in the returned text: compare the
    # visible text, then skip an end-of-turn token the model already produced (it is in ``output_ids``).
    visible = decode_text(tokenizer, output_ids, skip_special_tokens=True)
    if not rendered_turn.startswith(visible):
        return None
    bridge = rendered_turn[len(visible):]
    if output_ids and output_ids[-1] in set(tokenizer.all_special_ids):
        last = decode_text(tokenizer, output_ids[-1:])
        if bridge.startswith(last):
            bridge = bridge[len(last):]
    return list(record.prompt_ids) + output_ids + encode(tokenizer, expand(bridge + full_text[len(through):]))


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], earlier: list[CompletionRecord],
                    render_kwargs: dict, add_generation_prompt: bool = True,
                    expand: Callable[[str], str] = str) -> tuple[list[int], str]:
    """(prompt ids, prompt text) for a chat request; exact earlier tokens when it continues ``earlier``.
    ``expand``: applied to a suffix of the rendered text before it is tokenized (image placeholders -> each image's
    tokens, ``openai_images.ChatImages.expand``); the earlier calls' ids already hold their images' tokens."""
    full_text = render_chat(tokenizer, template_messages(messages), add_generation_prompt, **render_kwargs)
    for record in sorted(earlier, key=lambda r: -r.call_index):  # the latest matching call first
        if record.kind != "chat":
            continue
        ids = _continuation(tokenizer, record, messages, full_text, render_kwargs, expand)
        if ids is not None:
            return ids, full_text
    return encode(tokenizer, expand(full_text)), full_text


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str, earlier: list[CompletionRecord]) -> list[int]:
    """A completion prompt that extends an earlier completion's prompt + returned text keeps its exact ids."""
    for record in sorted(earlier, key=lambda r: -r.call_index):
        if record.kind != "completion" or record.prompt_text is None:
            continue
        head = record.prompt_text + record.output_text
        if prompt.startswith(head):
            return list(record.prompt_ids) + list(record.output_ids) + encode(tokenizer, prompt[len(head):])
    return list(tokenizer.encode(prompt))


def apply_stop_strings(tokenizer: Tokenizer, output_ids: list[int], logprobs: list[float], finish_reason: str,
                       stop: list[str]) -> tuple[list[int], list[float], str, str]:
    """(kept ids, their logprobs, text, finish reason) after cutting at the first stop string."""
    text = decode_text(tokenizer, output_ids, skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if not cuts:
        return output_ids, logprobs, text, finish_reason
    text = text[: min(cuts)]
    keep = 0
    # The longest token prefix whose text lies within the returned text (decoding is prefix-monotone).
    while keep < len(output_ids) and text.startswith(
            decode_text(tokenizer, output_ids[: keep + 1], skip_special_tokens=True)):
        keep += 1
    return output_ids[:keep], logprobs[:keep], text, "stop"
