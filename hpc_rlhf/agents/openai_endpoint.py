"""An OpenAI-compatible HTTP endpoint over this rank's rollout engine, recording every completion.

``OpenAIEndpoint`` serves ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` with FastAPI /
uvicorn in a daemon thread. By default it listens on a Unix socket in a folder of its own (mode 0700, so no other
user of the node can connect) and the executor's clients reach it through that socket
(:meth:`OpenAIEndpoint.async_client`); with ``listen="tcp"`` (``rollout.agent_endpoint=tcp``, for frameworks
that can only take a URL) it listens on ``127.0.0.1`` and a free port, which every user of the node can reach.
Either way the server holds at most ``max_connections`` connections and closes one whose first request has not
arrived within ``first_request_timeout_s`` (``hpc_rlhf.serving.connection_limits``; ``rollout.agent_endpoint_*``).

Requests are not generated in the server's thread: each becomes a ``GenerationRequest`` put on a queue, and
the thread that owns the engine (the executor's, which holds the ``generate`` callable) takes everything queued,
from every concurrent episode, into one batched ``generate`` call (``openai_batching``), then hands each request
its results.

Episode id: the API key. The executor gives each episode a client built with ``api_key=<episode id>``, so
every request of the episode carries ``Authorization: Bearer <episode id>`` whatever framework wraps the
client; a request with an unknown key is refused (401) and nothing unattributed is generated. The key and the
body size (``max_body_bytes``, 413 above it) are checked before the body is read, for every path
(``openai_guard``); there is no ``/docs`` or ``/openapi.json``.

Each request is checked before it reaches the engine (``openai_requests``): token ids within the vocabulary,
``1 <= n <= max_n``, finite numbers, 64-bit seeds, the messages' shape; a bad request is its own 400 naming the
field. If the engine still fails on a batch, the batch's requests are run again one by one, so only the
request that fails alone gets the error (500), and its episode ends as failed (``EpisodeRecorder.fail``); when
every request of a batch fails alone too, the engine itself is broken and the error ends the step.

Chat prompts (image decoding, the image processor, the chat template) are prepared in a pool of two threads beside
the server's event loop, so a request with large images delays no other episode's; each distinct image of an
episode is decoded once and its records point at it (``openai_images.EpisodeImages``).

Request fields honoured: ``messages`` / ``prompt`` (text or token ids), ``n``, ``temperature``, ``top_p``,
``max_tokens`` / ``max_completion_tokens`` (default ``rollout.generate_max_len``; capped so prompt + output fit
``data.max_len`` and the engine's context length, and at ``rollout.generate_max_len`` when ``data.max_len`` is
unset; a prompt that leaves no room is that request's 400), ``stop`` (strings; see
``openai_chat``), ``seed``, ``logprobs`` (chat: ``true``; completions: an int, only the sampled token's logprob is
reported), ``tools`` (passed to the chat template; ``tool_choice: "none"`` leaves them out), ``stream`` /
``stream_options.include_usage`` (see ``openai_stream``). Reported logprobs are the engine's (temperature-scaled,
see ``rollout.base``). Not supported (400): ``top_logprobs`` > 0, ``echo``, ``best_of`` other than ``n``.

Chat replies: the family's parsers (``tool_parsers``: ``rollout.tool_call_parser`` / ``rollout.reasoning_parser``)
split the output text, decoded with its special tokens (``<|python_tag|>``, ``[TOOL_CALLS]`` may be special
tokens) but without the stop tokens, into ``reasoning_content``, ``content`` and ``tool_calls`` (only when the
request offered ``tools``). The recorded ids are the engine's output whatever the parse.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' `Request` annotation at definition time.

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from typing import Any

from hpc_rlhf.agents.openai_batching import GenerationQueue, run_batch
from hpc_rlhf.agents.openai_chat import ChatTemplateError, apply_stop_strings, chat_prompt_ids, completion_prompt_ids
from hpc_rlhf.agents.openai_guard import DEFAULT_MAX_BODY_BYTES, EndpointGuard, bearer_token
from hpc_rlhf.agents.openai_images import (
    DEFAULT_MAX_EPISODE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_REQUEST_PIXELS,
    ChatImages,
    EpisodeImages,
    message_images,
    refuse_image_tokens,
)
from hpc_rlhf.agents.openai_recording import CompletionRecord, EpisodeRecorder
from hpc_rlhf.agents.openai_requests import (
    EndpointRequestError,
    check_messages,
    check_token_ids,
    check_tools,
    number,
    sample_count,
    seed_of,
    stop_list,
)
from hpc_rlhf.agents.openai_stream import sse_events
from hpc_rlhf.agents.tool_parsers import OutputParser
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, decode_text
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, SamplingParams
from hpc_rlhf.rollout.visual import PromptVisual
from hpc_rlhf.serving.connection_limits import (
    DEFAULT_FIRST_REQUEST_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    limited_http_protocol,
)

logger = logging.getLogger(__name__)
DEFAULT_MAX_N = 64
__all__ = ["EndpointRequestError", "GenerationQueue", "OpenAIEndpoint", "run_batch"]


# ---------------------------------------------------------------------- request handling


def _derive_seed(seed: int, episode_id: str, call_index: int) -> int:
    digest = hashlib.sha256(f"{seed}:{episode_id}:{call_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


class OpenAIEndpoint:
    """The endpoint of one rollout rank (module docstring). ``start()`` binds and serves; ``close()`` stops.

    Args:
        tokenizer: the actor's tokenizer (chat template, decoding).
        max_len: prompt + output token budget per call (``data.max_len``); None for none.
        model_name: the name ``/v1/models`` reports (any ``model`` value is accepted).
        batch_wait_s: how long a batch waits for running episodes that have no request queued yet.
        parser: splits chat output into reasoning, content and tool calls (default: both parsers ``auto``).
        max_body_bytes: the largest request body accepted (413 above it).
        max_n: the largest ``n`` of one request.
        vision: the actor's image encoder (a vision-language actor): chat messages may then hold image content
            parts (``openai_images``); None refuses them.
        max_images, max_image_pixels: images per request, pixels per image (``openai_images``;
            ``rollout.agent_max_images_per_request`` / ``agent_max_pixels_per_image``).
        max_request_pixels, max_episode_pixels: decoded pixels of the new images of one request, of the distinct
            images of one episode (``rollout.agent_max_image_pixels_per_request`` / ``_per_episode``).
        context_len: the rollout engine's context length (``RolloutEngine.max_context_len``): no call's prompt +
            output may pass it, whatever ``max_len``; None when unknown.
        listen: ``"unix"`` (a Unix socket in a private folder; the default) or ``"tcp"`` (``127.0.0.1``).
        max_connections, first_request_timeout_s: the server's connection bounds (``serving.connection_limits``;
            ``rollout.agent_endpoint_max_connections`` / ``agent_endpoint_first_request_timeout_s``).
        All the caps default to ``endpoint_limits``'s constants; ``EndpointLimits`` holds them under these names.
    """

    def __init__(self, tokenizer: Tokenizer, max_len: int | None = None, model_name: str = "policy",
                 batch_wait_s: float = 0.05, parser: OutputParser | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_n: int = DEFAULT_MAX_N,
                 vision: VisionPromptEncoder | None = None, max_images: int = DEFAULT_MAX_IMAGES,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
                 max_episode_pixels: int = DEFAULT_MAX_EPISODE_PIXELS, context_len: int | None = None,
                 listen: str = "unix",
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 first_request_timeout_s: float = DEFAULT_FIRST_REQUEST_TIMEOUT_S) -> None:
        if listen not in ("unix", "tcp"):
            raise ValueError(f"listen must be 'unix' or 'tcp', got {listen!r}")
        self.listen, self.max_connections = listen, max_connections
        self.first_request_timeout_s = first_request_timeout_s
        self.vision, self.max_images, self.max_image_pixels = vision, max_images, max_image_pixels
        self.max_request_pixels, self.max_episode_pixels = max_request_pixels, max_episode_pixels
        # Decoding images, running the processor and tokenizing a chat are CPU work: they run here, two at a time,
        # never on the server's event loop (where one large request would stall every other episode's).
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                                   thread_name_prefix="openai-endpoint-prepare")
        self.tokenizer, self.max_len, self.model_name = tokenizer, max_len, model_name
        self.context_len = context_len
        self.vocab_size = len(tokenizer)  # added tokens included; ids past it cannot be decoded
        self.max_body_bytes, self.max_n = max_body_bytes, max_n
        self.parser = parser if parser is not None else OutputParser(tokenizer)
        self.batch_wait_s = batch_wait_s
        self.recorder = EpisodeRecorder()
        self.queue = GenerationQueue()
        self.defaults = SamplingParams(max_new_tokens=16)
        self.stop_token_ids: list[int] = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._socket_dir: str | None = None
        self.port: int | None = None  # listen="tcp" only

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        """The API's URL. Over the Unix socket the host part is a placeholder: a client must be built with the
        socket as its transport (:meth:`async_client`, :meth:`http_client`)."""
        if self._sock is None:
            raise RuntimeError("OpenAIEndpoint.base_url before start()")
        return f"http://127.0.0.1:{self.port}/v1" if self.port is not None else "http://localhost/v1"

    @property
    def socket_path(self) -> str | None:
        """The Unix socket the endpoint listens on (None for ``listen="tcp"``)."""
        return os.path.join(self._socket_dir, "endpoint.sock") if self._socket_dir is not None else None

    def http_client(self, **kwargs: Any) -> Any:
        """An ``httpx.Client`` that reaches this endpoint whatever it listens on (``base_url`` set)."""
        import httpx  # comes with the openai package (the agents extra)

        transport = httpx.HTTPTransport(uds=self.socket_path) if self.socket_path else None
        return httpx.Client(transport=transport, base_url=self.base_url, **kwargs)

    def async_client(self, api_key: str, timeout: float | None) -> Any:
        """An ``openai.AsyncOpenAI`` for the episode ``api_key``, through the Unix socket when there is one. No
        retries: a retried request would generate (and record) a second time."""
        import importlib

        import openai

        http: Any = None
        if self.socket_path:
            # openai 3 builds on httpx2, older versions on httpx: the transport must come from the same package
            # as the client class openai gives (its DefaultAsyncHttpxClient keeps openai's own defaults).
            package = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
            http = openai.DefaultAsyncHttpxClient(transport=package.AsyncHTTPTransport(uds=self.socket_path),
                                                  timeout=timeout)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=timeout,
                                  http_client=http)

    def start(self, startup_timeout_s: float = 30.0) -> "OpenAIEndpoint":
        import uvicorn  # fastapi / uvicorn: the optional agents extra, imported only when an endpoint is served

        # Bound before the thread starts: the address is ours at once and no other process can take it.
        self._sock = self._bind()
        where = self.socket_path or f"127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(
            create_app(self), log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
            http=limited_http_protocol(self.max_connections, self.first_request_timeout_s)))
        self._thread = threading.Thread(target=self._serve, name=f"openai-endpoint-{where}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.close()
            raise RuntimeError(f"OpenAI endpoint on {where} did not start")
        return self

    def _bind(self) -> socket.socket:
        if self.listen == "tcp":
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            return sock
        # mkdtemp makes the folder 0700: only this user can reach the socket inside, whatever its own mode.
        self._socket_dir = tempfile.mkdtemp(prefix="hpc_rlhf-agents-")
        path = os.path.join(self._socket_dir, "endpoint.sock")
        if len(path.encode()) > 100:  # sun_path holds 108 bytes
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
            raise RuntimeError(f"the agents endpoint's socket path {path} is too long for a Unix socket: set TMPDIR "
                               "to a shorter folder, or rollout.agent_endpoint=tcp")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)
        return sock

    def _serve(self) -> None:
        with contextlib.suppress(SystemExit):  # uvicorn exits this way when startup fails; it logged why
            self._server.run(sockets=[self._sock])

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving (requests still waiting for the engine fail) and release the port or socket."""
        self.queue.fail_all(RuntimeError("the OpenAI endpoint is shutting down"))
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._sock is not None:
            self._sock.close()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self._server = self._thread = self._sock = self._socket_dir = None

    def set_defaults(self, sampling: SamplingParams) -> None:
        """The run's sampling parameters: defaults for fields a request leaves out (and the stop tokens)."""
        self.defaults = sampling
        self.stop_token_ids = list(dict.fromkeys([*sampling.stop_token_ids, *self.stop_token_ids]))

    # ------------------------------------------------------------------ requests

    def _sampling(self, body: dict, prompt_len: int, episode_id: str, call_index: int, max_key: str) -> SamplingParams:
        d = self.defaults
        max_tokens = number(body, max_key, int, None)
        if max_key == "max_completion_tokens" and max_tokens is None:
            max_tokens = number(body, "max_tokens", int, None)
        if max_tokens is not None and max_tokens < 1:
            raise EndpointRequestError(f"'{max_key}' must be >= 1, got {max_tokens}", param=max_key)
        limit = d.max_new_tokens if max_tokens is None else max_tokens
        if self.max_len is None:  # no run budget: the run's generate_max_len bounds what one request may ask for
            limit = min(limit, d.max_new_tokens)
        budget = self._context_budget()
        if budget is not None:
            context, source = budget
            room = context - prompt_len
            if room < 1:
                # This request's 400, and its episode's error when the agent lets it raise; the engine would
                # fail the whole batch on it (vLLM refuses a prompt past max_model_len).
                raise EndpointRequestError(
                    f"the prompt has {prompt_len} tokens, which leaves no room in the context of {context} tokens "
                    f"({source})", param="messages" if max_key == "max_completion_tokens" else "prompt")
            limit = min(limit, room)
        seed = seed_of(body)
        if seed is None and d.seed is not None:
            seed = _derive_seed(d.seed, episode_id, call_index)
        try:
            return SamplingParams(max_new_tokens=limit, temperature=number(body, "temperature", float, d.temperature),
                                  top_p=number(body, "top_p", float, d.top_p), top_k=d.top_k,
                                  stop_token_ids=list(self.stop_token_ids), seed=seed)
        except ValueError as err:
            param = "temperature" if "temperature" in str(err) else "top_p"
            raise EndpointRequestError(str(err), param=param) from None

    def _context_budget(self) -> tuple[int, str] | None:
        """(prompt + output tokens one call may hold, what sets it): ``data.max_len`` or the engine's context,
        whichever is smaller; None when neither is known."""
        budgets = []
        if self.max_len is not None:
            budgets.append((self.max_len, "data.max_len"))
        if self.context_len is not None:
            budgets.append((self.context_len, "the rollout engine's context length: vLLM's max_model_len, or the "
                                              "model's max_position_embeddings"))
        return min(budgets) if budgets else None

    def _episode(self, authorization: str | None) -> str:
        key = bearer_token(authorization)
        if not key or not self.recorder.is_open(key):
            raise EndpointRequestError("unknown episode: the API key must be the episode id the trainer gave this "
                                       "client (requests outside a running episode are refused)", status=401)
        return key

    def _check_unsupported(self, body: dict, is_chat: bool) -> int:
        options = body.get("stream_options")
        if options is not None and not (body.get("stream") and isinstance(options, dict)):
            raise EndpointRequestError("'stream_options' needs stream=true and must be an object",
                                       param="stream_options")
        if number(body, "top_logprobs", int, 0) > 0 or (not is_chat and number(body, "logprobs", int, 0) > 1):
            raise EndpointRequestError("only the sampled token's logprob is reported: top_logprobs / logprobs > 1 "
                                       "are not supported", param="top_logprobs")
        if body.get("echo"):
            raise EndpointRequestError("echo is not supported", param="echo")
        return sample_count(body, self.max_n)

    async def _generate(self, episode_id: str, prompt_ids: list[int], params: SamplingParams,
                        n: int, visual: PromptVisual | None = None) -> list[GenerationResult]:
        request = GenerationRequest(prompt_ids=prompt_ids, params=params, n=n, visual=visual)
        try:
            return await asyncio.wrap_future(self.queue.submit(episode_id, request))
        except Exception as err:
            # The engine failed on this request alone (run_batch): the episode ends, failed, with that cause.
            self.recorder.fail(episode_id, f"the rollout engine failed on this episode's request: "
                                           f"{type(err).__name__}: {str(err)[:300]}")
            raise

    async def chat(self, body: dict, authorization: str | None) -> dict:
        episode_id = self._episode(authorization)
        n = self._check_unsupported(body, is_chat=True)
        messages = check_messages(body.get("messages"))
        render_kwargs: dict[str, Any] = {}
        tools = check_tools(body.get("tools")) if body.get("tools") and body.get("tool_choice") != "none" else None
        if tools:  # as OpenAI sends them ({"type": "function", "function": {...}}), as vLLM gives templates
            render_kwargs["tools"] = tools
        images, prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self._prepare_pool, self._chat_prompt, episode_id, messages, render_kwargs)
        visual = images.visual if images is not None else None
        if not prompt_ids:
            raise EndpointRequestError("the chat template rendered an empty prompt", param="messages")
        call_index = self.recorder.next_call_index(episode_id)
        params = self._sampling(body, len(prompt_ids), episode_id, call_index, "max_completion_tokens")
        stop = stop_list(body)
        results = await self._generate(episode_id, prompt_ids, params, n, visual)
        choices, completion_tokens = [], 0
        for index, (ids, logprobs, text, finish) in enumerate(self._stopped(results, stop)):
            message = self._message(ids, text, tools)
            tool_calls = message.get("tool_calls")
            self.recorder.add(episode_id, CompletionRecord(
                call_index=call_index, prompt_ids=list(prompt_ids), output_ids=ids, output_logprobs=logprobs,
                finish_reason=finish, kind="chat", output_text=text, messages=messages, message=message,
                render_kwargs=render_kwargs, visual=images.kept if images is not None else None))
            completion_tokens += len(ids)
            choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None,
                                      "finish_reason": "tool_calls" if tool_calls else finish}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": decode_text(self.tokenizer, [t]), "logprob": lp,
                     "bytes": list(decode_text(self.tokenizer, [t]).encode()), "top_logprobs": []}
                    for t, lp in zip(ids, logprobs, strict=True)]}
            choices.append(choice)
        return self._response(body, "chatcmpl", "chat.completion", len(prompt_ids), choices, completion_tokens)

    def _chat_prompt(self, episode_id: str, messages: list[dict],
                     render_kwargs: dict) -> tuple[ChatImages | None, list[int]]:
        """(the request's images, its prompt ids): decoding, the processor and the template, off the event loop."""
        images = self._chat_images(episode_id, messages)
        try:
            prompt_ids, full_text = chat_prompt_ids(self.tokenizer, messages, self.recorder.records(episode_id),
                                                    render_kwargs, expand=images.expand if images else str)
        except ChatTemplateError as err:
            raise EndpointRequestError(str(err), param="messages") from None
        if images is not None:
            images.check_rendered(full_text)
        else:
            refuse_image_tokens(prompt_ids, self.vision, "messages")
        return images, prompt_ids

    def _chat_images(self, episode_id: str, messages: list[dict]) -> ChatImages | None:
        """The request's images through the actor's processor (None without image parts), each distinct image of
        the episode decoded once; a 400 for images on a text-only actor, or images the caps refuse
        (``openai_images``)."""
        images = message_images(messages, self.max_images, self.max_image_pixels)
        if not images:
            return None
        if self.vision is None:
            raise EndpointRequestError("the request holds image content parts but the actor (actor.pretrain) is a "
                                       "text-only model", param="messages")
        store = self.recorder.store(episode_id, lambda: EpisodeImages(self.max_episode_pixels))
        if store is None:  # the episode ended meanwhile
            raise EndpointRequestError("unknown episode: it ended", status=401)
        try:
            return ChatImages.encode(self.vision, images, store, self.max_request_pixels)
        except ValueError as err:  # an image whose header read but whose pixels do not decode
            if isinstance(err, EndpointRequestError):
                raise
            raise EndpointRequestError(f"an image of the request could not be decoded: {str(err)[:300]}",
                                       param="messages") from None

    def _message(self, ids: list[int], text: str, tools: list[dict] | None) -> dict[str, Any]:
        """The assistant message of output ``ids`` (``text``: their visible text, cut at a stop string)."""
        if not (self.parser.parses_reasoning or (tools and self.parser.parses_tool_calls)):
            return {"role": "assistant", "content": text}
        parsed = self.parser.parse(self._text_with_special_tokens(ids, text), tools)
        found = bool(parsed.tool_calls) or parsed.reasoning is not None
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content if found else text}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return message

    def _text_with_special_tokens(self, ids: list[int], text: str) -> str:
        """What the parsers read: the output decoded with its special tokens but not the stop / padding tokens
        (which end a turn, they are not part of it); ``text`` itself when a stop string cut inside a token."""
        ends = {*self.stop_token_ids, self.tokenizer.pad_token_id}
        kept = [t for t in ids if t not in ends]
        if decode_text(self.tokenizer, kept, skip_special_tokens=True) != text:
            return text
        return decode_text(self.tokenizer, kept)

    def _stopped(self, results: list, stop: list[str]) -> list[tuple[list[int], list[float], str, str]]:
        """Each result cut at its first stop string: (output ids, their logprobs, text, finish reason)."""
        return [apply_stop_strings(self.tokenizer, list(result.output_ids),
                                   [float(x) for x in result.output_logprobs], result.finish_reason, stop)
                for result in results]

    async def completion(self, body: dict, authorization: str | None) -> dict:
        episode_id = self._episode(authorization)
        n = self._check_unsupported(body, is_chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            prompt_text: str | None = prompt
            prompt_ids = completion_prompt_ids(self.tokenizer, prompt, self.recorder.records(episode_id))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            prompt_text, prompt_ids = None, check_token_ids(prompt, self.vocab_size)
        else:
            raise EndpointRequestError("'prompt' must be a non-empty string or list of token ids (one prompt per "
                                       "request)", param="prompt")
        refuse_image_tokens(prompt_ids, self.vision, "prompt")
        call_index = self.recorder.next_call_index(episode_id)
        params = self._sampling(body, len(prompt_ids), episode_id, call_index, "max_tokens")
        stop = stop_list(body)
        results = await self._generate(episode_id, prompt_ids, params, n)
        choices, completion_tokens = [], 0
        for index, (ids, logprobs, text, finish) in enumerate(self._stopped(results, stop)):
            self.recorder.add(episode_id, CompletionRecord(
                call_index=call_index, prompt_ids=list(prompt_ids), output_ids=ids, output_logprobs=logprobs,
                finish_reason=finish, kind="completion", prompt_text=prompt_text, output_text=text))
            completion_tokens += len(ids)
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if body.get("logprobs") is not None:
                tokens = [decode_text(self.tokenizer, [t]) for t in ids]
                offsets, at = [], 0
                for token in tokens:
                    offsets.append(at)
                    at += len(token)
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None,
                                      "text_offset": offsets}
            choices.append(choice)
        return self._response(body, "cmpl", "text_completion", len(prompt_ids), choices, completion_tokens)

    def _response(self, body: dict, id_prefix: str, object_name: str, num_prompt_tokens: int, choices: list[dict],
                  num_completion_tokens: int) -> dict:
        """The response object around ``choices``; ``total_tokens`` counts the prompt once per choice."""
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": object_name, "created": int(time.time()),
                "model": body.get("model") or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                          "total_tokens": num_prompt_tokens * len(choices) + num_completion_tokens}}


def _error(status: int, message: str, param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse  # the optional agents extra (see start)

    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


def create_app(endpoint: OpenAIEndpoint) -> Any:
    """The FastAPI app of ``endpoint`` behind its guard (``openai_guard``: key, then body size); errors use
    OpenAI's ``{"error": {...}}`` shape. No ``/docs`` / ``/openapi.json``: nothing is served but the API."""
    from fastapi import FastAPI, Request  # the optional agents extra (see start)
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="hpc-rlhf rollout (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)

    async def handle(request: Request, method: Any) -> Any:
        try:
            body = json.loads(await request.body())
        except RecursionError:
            return _error(400, "the request body nests too deeply")
        except ValueError:  # UnicodeDecodeError included
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            response = await method(body, request.headers.get("authorization"))
            if not body.get("stream"):
                return response
            # Generated and recorded exactly as without streaming, then sent as server-sent events.
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(sse_events(response, include_usage), media_type="text/event-stream")
        except EndpointRequestError as err:
            return _error(err.status, str(err), err.param)
        except Exception as err:  # an engine failure is the client's 500, logged here
            logger.exception("OpenAI endpoint request failed")
            return _error(500, f"{type(err).__name__}: {err}")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, endpoint.chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, endpoint.completion)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "created": 0,
                                            "owned_by": "hpc-rlhf"}]}

    return EndpointGuard(app, endpoint.recorder.is_open, endpoint.max_body_bytes)

