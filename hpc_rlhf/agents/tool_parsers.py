"""Tool-call and reasoning parsers of the OpenAI-compatible endpoint, chosen per model family.

A chat completion's text is split into ``reasoning_content`` (a ``<think>`` block), ``content`` and
``tool_calls`` the way an OpenAI client expects; the recorded tokens are never touched (they are the engine's).

Which parser: ``rollout.tool_call_parser`` / ``rollout.reasoning_parser`` name one. vLLM's parsers
(``vllm.tool_parsers.ToolParserManager``, ``vllm.reasoning.ReasoningParserManager``: dozens of families) are
used when vLLM imports and knows the name; otherwise a small built-in set with the same names and output:

* tool calls: ``hermes`` (``<tool_call>{json}</tool_call>``: Hermes, Qwen2.5, Qwen3), ``llama3_json``
  (``<|python_tag|>`` or bare ``{"name": ..., "parameters": ...}`` objects, ``;``-separated: Llama 3.x),
  ``mistral`` (``[TOOL_CALLS][{...}]``), ``qwen3_coder`` / ``qwen3_xml`` (``<tool_call><function=NAME>
  <parameter=P>value</parameter></function></tool_call>``: Qwen3-Coder).
* reasoning: ``qwen3`` / ``deepseek_r1``: the text up to ``</think>`` (an opening ``<think>`` dropped) is the
  reasoning, the rest the content; without ``</think>`` the whole output is reasoning (vLLM 0.32 does the
  same: these templates open the think block in the prompt).

``none`` turns a parser off. ``auto`` reads the chat template (:func:`auto_tool_call_parser`,
:func:`auto_reasoning_parser`): a substring each family's template writes and the others do not; a template
with none of them gets ``hermes`` (harmless on text without ``<tool_call>``) and no reasoning parser.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpc_rlhf.models.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_TOOL_CALL_PARSER = "hermes"

# (template substring, parser): the first match wins, so more specific forms come first (Qwen3-Coder's template
# also writes <tool_call>). Only families whose parser the tests exercise are detected.
_TOOL_TEMPLATE_MARKERS = (("<function=", "qwen3_coder"), ("<arg_key>", "glm45"), ("<tool_call>", "hermes"),
                          ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
_REASONING_TEMPLATE_MARKERS = (("</think>", "qwen3"),)


class ParserConfigError(ValueError):
    """An unknown parser name; the message names the config key and the available names."""


@dataclass
class ParsedOutput:
    """A generated text split for the client: ``tool_calls`` in OpenAI's shape (``id``, ``type``, ``function``
    with ``name`` and ``arguments`` as a JSON string)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)


def _call(name: str, arguments: Any) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------- built-in tool-call parsers

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>|<tool_call>\s*(\{.*)\Z", re.DOTALL)


def parse_hermes(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text before the first is content."""
    calls = []
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1) or match.group(2))
        except ValueError:
            continue
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            calls.append(_call(body["name"], body.get("arguments", body.get("parameters", {}))))
    if not calls:
        return text, []
    return text[: text.find("<tool_call>")] or None, calls


def _json_objects(text: str, separator: str) -> list[Any] | None:
    """Consecutive JSON values in ``text`` separated by ``separator`` (and spaces); None unless all of it is."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            return None
        at = len(text) - len(rest[len(separator):].lstrip())


def parse_llama3_json(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """Llama 3.x: the whole output (after an optional ``<|python_tag|>``) is ``;``-separated JSON objects with
    ``name`` and ``parameters`` (or ``arguments``)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    values = _json_objects(body, ";") if body.startswith("{") else None
    if not values or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in values):
        return text, []
    return None, [_call(v["name"], v.get("parameters", v.get("arguments", {}))) for v in values]


def parse_mistral(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``; the text before it is content."""
    head, marker, tail = text.partition("[TOOL_CALLS]")
    if not marker:
        return text, []
    values = _json_objects(tail.strip(), ",")
    if values and len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    if not values or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in values):
        return text, []
    return head or None, [_call(v["name"], v.get("arguments", {})) for v in values]


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _typed(value: str, schema: dict) -> Any:
    """A parameter's text as its declared JSON type (strings stay text; anything unparsable stays text)."""
    if schema.get("type", "string") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _parameter_schemas(tools: list[dict] | None, name: str) -> dict:
    for tool in tools or []:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return {}


def parse_qwen3_xml(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """Qwen3-Coder: ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``;
    values typed by the request's tool schema."""
    calls = []
    for match in _XML_CALL.finditer(text):
        name = match.group(1).strip()
        schemas = _parameter_schemas(tools, name)
        arguments = {p.strip(): _typed(v, schemas.get(p.strip(), {})) for p, v in _XML_PARAM.findall(match.group(2))}
        calls.append(_call(name, arguments))
    if not calls:
        return text, []
    return text[: text.find("<tool_call>")].rstrip() or None, calls


BUILTIN_TOOL_CALL_PARSERS: dict[str, Callable[[str, list[dict] | None], tuple[str | None, list[dict]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral,
    "qwen3_coder": parse_qwen3_xml, "qwen3_xml": parse_qwen3_xml}


def parse_think(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content): the text before ``</think>`` (an opening ``<think>`` dropped) and after it; all of
    it reasoning when there is no ``</think>`` (the template opened the block)."""
    body = text.removeprefix("<think>")
    reasoning, end, content = body.partition("</think>")
    if not end:
        return body, None
    return reasoning, content or None


BUILTIN_REASONING_PARSERS = {"qwen3": parse_think, "deepseek_r1": parse_think}


# ---------------------------------------------------------------------- vLLM's parsers


def _vllm_managers() -> tuple[Any, Any] | None:
    """vLLM's parser registries, or None when vLLM does not import (a CPU login node, the transformers engine)."""
    try:
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager
    except Exception as err:  # noqa: BLE001 - any failure to import vLLM means: use the built-in parsers
        logger.info("vLLM's parsers are not available (%s: %s): the endpoint uses its built-in parsers",
                    type(err).__name__, err)
        return None
    return ToolParserManager, ReasoningParserManager


def _vllm_request(tools: list[dict] | None) -> Any:
    """The ``ChatCompletionRequest`` vLLM's parsers read (some type arguments by the request's tool schema)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": ""}]
    try:
        return ChatCompletionRequest(model="policy", messages=messages, tools=tools or None)
    except ValueError:  # a tool vLLM's schema rejects: parse without the schema rather than fail the call
        return ChatCompletionRequest(model="policy", messages=messages)


# ---------------------------------------------------------------------- selection


def _template_text(tokenizer: Tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def auto_tool_call_parser(tokenizer: Tokenizer) -> str:
    """The tool-call parser a chat template implies (module docstring); ``hermes`` when it implies none."""
    template = _template_text(tokenizer)
    return next((name for marker, name in _TOOL_TEMPLATE_MARKERS if marker in template), DEFAULT_TOOL_CALL_PARSER)


def auto_reasoning_parser(tokenizer: Tokenizer) -> str:
    """``qwen3`` when the chat template writes ``</think>``; otherwise ``none``."""
    template = _template_text(tokenizer)
    return next((name for marker, name in _REASONING_TEMPLATE_MARKERS if marker in template), "none")


class OutputParser:
    """Reasoning then tool calls, for one tokenizer (module docstring).

    Args:
        tokenizer: the actor's tokenizer (vLLM's parsers look their marker tokens up in its vocabulary).
        tool_call_parser, reasoning_parser: a name, ``auto`` or ``none`` (``rollout.tool_call_parser`` /
            ``rollout.reasoning_parser``).
        use_vllm: take vLLM's parser when vLLM imports and has the name (False: the built-in one).
    """

    def __init__(self, tokenizer: Tokenizer, tool_call_parser: str = "auto", reasoning_parser: str = "auto",
                 use_vllm: bool = True) -> None:
        self.tokenizer = tokenizer
        managers = _vllm_managers() if use_vllm else None
        tool_name = auto_tool_call_parser(tokenizer) if tool_call_parser == "auto" else tool_call_parser
        reasoning_name = auto_reasoning_parser(tokenizer) if reasoning_parser == "auto" else reasoning_parser
        vllm_tools = set(managers[0].list_registered()) if managers else set()
        vllm_reasoning = set(managers[1].list_registered()) if managers else set()
        if tool_call_parser == "auto" and tool_name not in vllm_tools | set(BUILTIN_TOOL_CALL_PARSERS):
            logger.warning("rollout.tool_call_parser=auto: the chat template looks like %s, whose parser needs vLLM; "
                           "using %s", tool_name, DEFAULT_TOOL_CALL_PARSER)
            tool_name = DEFAULT_TOOL_CALL_PARSER
        self.tool_call_parser = self._pick("rollout.tool_call_parser", tool_name, vllm_tools,
                                           BUILTIN_TOOL_CALL_PARSERS)
        self.reasoning_parser = self._pick("rollout.reasoning_parser", reasoning_name, vllm_reasoning,
                                           BUILTIN_REASONING_PARSERS)
        # A "vllm" pick implies managers: its names came from them.
        self._tool_cls = (managers[0].get_tool_parser(tool_name)
                          if managers is not None and self.tool_call_parser[1] == "vllm" else None)
        self._reasoning_cls = (managers[1].get_reasoning_parser(reasoning_name)
                               if managers is not None and self.reasoning_parser[1] == "vllm" else None)
        logger.info("OpenAI endpoint parsers: tool calls %s, reasoning %s", self.tool_call_parser,
                    self.reasoning_parser)

    @staticmethod
    def _pick(key: str, name: str, vllm_names: set[str], builtin: dict) -> tuple[str, str]:
        """(name, "vllm" | "built-in" | "off")."""
        if name == "none":
            return name, "off"
        if name in vllm_names:
            return name, "vllm"
        if name in builtin:
            return name, "built-in"
        available = sorted(vllm_names | set(builtin))
        where = "" if vllm_names else " (vLLM is not installed; with it, vLLM's parsers are available too)"
        raise ParserConfigError(f"{key}={name!r} is not a parser here{where}: use auto, none or one of "
                                f"{', '.join(available)}")

    @property
    def parses_reasoning(self) -> bool:
        return self.reasoning_parser[1] != "off"

    @property
    def parses_tool_calls(self) -> bool:
        return self.tool_call_parser[1] != "off"

    def parse(self, text: str, tools: list[dict] | None) -> ParsedOutput:
        """Split ``text`` (special tokens kept); tool calls only when the request offered ``tools``."""
        reasoning, content = self._reasoning(text) if self.parses_reasoning else (None, text)
        if not tools or not self.parses_tool_calls or content is None:
            return ParsedOutput(content, reasoning)
        content, calls = self._tool_calls(content, tools)
        return ParsedOutput(content, reasoning, calls)

    def _reasoning(self, text: str) -> tuple[str | None, str | None]:
        if self._reasoning_cls is None:
            return BUILTIN_REASONING_PARSERS[self.reasoning_parser[0]](text)
        return self._reasoning_cls(self.tokenizer).extract_reasoning(text, _vllm_request(None))

    def _tool_calls(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        if self._tool_cls is None:
            return BUILTIN_TOOL_CALL_PARSERS[self.tool_call_parser[0]](text, tools)
        # A fresh parser per call: vLLM's parsers keep streaming state on the instance.
        info = self._tool_cls(self.tokenizer).extract_tool_calls(text, _vllm_request(tools))
        if not info.tools_called:
            return text, []
        calls = [{"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": call.function.name, "arguments": call.function.arguments}}
                 for call in info.tool_calls]
        return info.content or None, calls
