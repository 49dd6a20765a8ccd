"""Reward-model HTTP server speaking OpenRLHF's protocol, with micro-batching of concurrent requests.

    python -m hpc_rlhf.cli.serve_rm --reward_pretrain /ckpt/rm --port 5000
    curl -s localhost:5000/get_reward -d '{"query": ["Q: 1+1=\\nA: 2"]}'   # {"rewards": [...], "scores": [...]}

Pieces, each testable alone:

* ``RewardScorer``: tokenises texts (no special tokens added: a query is the decoded prompt + response
  with its special tokens kept; truncated on the left to ``max_len`` so the end, where the score is read,
  survives) and scores them with ``sequence_scores`` (value at the last real token), in micro-batches of
  ``batch_size`` sorted by length to cut padding. Optionally normalises with ``reward_mean`` /
  ``reward_std`` from the model's ``config.json``. No HTTP.
* ``MicroBatcher``: an asyncio queue plus one background task. Requests arriving within
  ``max_wait_s`` of each other (up to ``max_batch_size`` texts) are scored in one call, in a worker
  thread so the event loop keeps accepting requests (and ``/health``) during a forward; each request
  gets back its own slice.
* ``create_app``: the FastAPI app: ``POST /get_reward``, ``GET /health``. Malformed bodies get 422 (or
  400 for a query that tokenises to nothing) with the reason. Bounds, so one request cannot stall or exhaust
  the server: a body over ``max_body_bytes`` or with more than ``max_texts`` texts gets 413 naming the
  limit; parsing and tokenising run in one worker thread (never on the event loop, which keeps answering
  ``/health``); a request is scored in slices of the batch size, so other requests interleave, and the
  rest is dropped once its client has disconnected. ``request_timeout_s`` bounds a request from admission to
  answer (408 while its body arrives, 504 once queued or scoring). Before any of this, ``RequestGuard``
  (:mod:`hpc_rlhf.serving.guards`) checks the bearer token when one is set (401) and admits at most
  ``max_pending`` requests at once (503 with ``Retry-After`` beyond), so the queue and its memory are bounded.
* ``BackgroundServer``: uvicorn in a thread on a pre-bound socket (tests, embedding in a driver).

Shutdown: uvicorn stops accepting on SIGTERM/SIGINT, lets in-flight requests finish, then the app's
lifespan cancels the batcher task; requests still queued (none after a graceful drain) get an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from transformers import AutoTokenizer

from hpc_rlhf.models.forward import sequence_scores
from hpc_rlhf.models.hf_module import to_device
from hpc_rlhf.models.loading import load_value_model, resolve_attn_implementation
from hpc_rlhf.models.precision import resolve_dtype
from hpc_rlhf.models.value_head import ValueHeadError, read_reward_normalization
from hpc_rlhf.serving.connection_limits import (
    DEFAULT_FIRST_REQUEST_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    limited_http_protocol,
)
from hpc_rlhf.serving.guards import (
    DEFAULT_MAX_PENDING,
    DEFAULT_REQUEST_TIMEOUT_S,
    GuardCounters,
    RequestGuard,
    check_guard_settings,
)

log = logging.getLogger(__name__)


class RewardServerError(RuntimeError):
    """The reward model cannot be served as asked (missing files, head or normalisation stats)."""


# ----------------------------------------------------------------------------------------------- scoring


class RewardScorer:
    """Score texts with a reward model (``AutoModelForSequenceClassification``, one label). No HTTP.

    ``score(texts)`` = ``score_ids(encode(texts))``; the server tokenises per request (so a bad query
    fails only its request) and hands token ids to the batcher. ``num_forwards`` counts model forwards.
    """

    def __init__(self, model_path: str | Path, max_len: int = 2048, device: str | torch.device | None = None,
                 normalize: bool = False, batch_size: int = 16, value_head_prefix: str = "score",
                 param_dtype: str = "auto", attn_implementation: str = "auto"):
        self.model_path = Path(model_path).expanduser().resolve()
        if not (self.model_path / "config.json").is_file():
            raise RewardServerError(f"--reward_pretrain {self.model_path} is not a model folder (no config.json)")
        if max_len < 1 or batch_size < 1:
            raise ValueError(f"max_len and batch_size must be >= 1, got {max_len} and {batch_size}")
        # Normalisation stats first: a missing key fails before minutes of weight loading.
        self.normalize = normalize
        try:
            self.reward_mean, self.reward_std = (read_reward_normalization(self.model_path, "--normalize")
                                                 if normalize else (0.0, 1.0))
        except ValueHeadError as err:
            raise RewardServerError(str(err)) from None
        self.max_len = max_len
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        on_gpu = self.device.type == "cuda"

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.tokenizer.truncation_side = "left"
        try:
            self.model = load_value_model(str(self.model_path), resolve_dtype(param_dtype, on_gpu),
                                          resolve_attn_implementation(attn_implementation, on_gpu),
                                          value_head_prefix=value_head_prefix, require_head=True,
                                          key="--value_head_prefix")
        except ValueHeadError as err:
            raise RewardServerError(str(err)) from None
        to_device(self.model, self.device)
        self.model.eval()
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = pad_id if pad_id is not None else self.model.config.pad_token_id
        # Padding never carries content: strip it from a query's ends. When pad == eos it is left alone,
        # since stripping would drop the EOS the score is read at.
        pad, eos = self.tokenizer.pad_token, self.tokenizer.eos_token
        self._strip_token = pad if pad and pad != eos else None
        self.num_forwards = 0
        self._lock = threading.Lock()

    @property
    def model_name(self) -> str:
        return self.model_path.name

    def encode(self, texts: Sequence[str], first_index: int = 0) -> list[list[int]]:
        """Token ids per text (left-truncated to ``max_len``); ``ValueError`` naming an empty one (counted from
        ``first_index``, for a slice of a longer query)."""
        if self._strip_token:
            texts = [_strip(t, self._strip_token) for t in texts]
        ids = self.tokenizer(list(texts), add_special_tokens=False, truncation=True,
                             max_length=self.max_len)["input_ids"] if texts else []
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"query[{first_index + i}] has no tokens (empty text, or only padding); "
                                 "cannot score it")
        return ids

    @torch.inference_mode()
    def score_ids(self, ids: Sequence[Sequence[int]]) -> list[float]:
        """(Normalised) score per token-id list, in order; forwards of <= ``batch_size`` rows."""
        scores = [0.0] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a forward
        with self._lock:
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                width = max(len(ids[i]) for i in rows)
                input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
                attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
                for r, i in enumerate(rows):  # left padding; sequence_scores reads the mask either way
                    input_ids[r, width - len(ids[i]):] = torch.as_tensor(ids[i], dtype=torch.long)
                    attention_mask[r, width - len(ids[i]):] = 1
                values = sequence_scores(self.model, input_ids.to(self.device), attention_mask.to(self.device))
                self.num_forwards += 1
                normalised = ((values - self.reward_mean) / self.reward_std).tolist()
                for r, i in enumerate(rows):
                    scores[i] = float(normalised[r])
        return scores

    def score(self, texts: Sequence[str]) -> list[float]:
        return self.score_ids(self.encode(texts))


def _strip(text: str, token: str) -> str:
    while text.startswith(token):
        text = text[len(token):]
    while text.endswith(token):
        text = text[: -len(token)]
    return text


# ----------------------------------------------------------------------------------------------- batching


class MicroBatcher:
    """Merge concurrent ``submit`` calls into one ``score_fn`` call (see the module docstring).

    Must be started and used inside one running event loop. ``num_batches`` counts ``score_fn`` calls,
    ``num_requests`` the submits.
    """

    def __init__(self, score_fn: Callable[[list[Any]], list[float]], max_batch_size: int = 16,
                 max_wait_s: float = 0.005):
        if max_batch_size < 1 or max_wait_s < 0:
            raise ValueError(f"max_batch_size must be >= 1 and max_wait_s >= 0, got {max_batch_size}, {max_wait_s}")
        self.score_fn = score_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.num_batches = 0
        self.num_requests = 0
        self._queue: asyncio.Queue[tuple[list[Any], asyncio.Future]] | None = None
        self._carry: tuple[list[Any], asyncio.Future] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="reward-batcher")

    def _started_queue(self) -> asyncio.Queue[tuple[list[Any], asyncio.Future]]:
        if self._queue is None:
            raise RuntimeError("reward batcher is not running")
        return self._queue

    async def close(self) -> None:
        """Cancel the batcher task and fail whatever is still queued."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        pending = [self._carry] if self._carry else []
        while self._queue is not None and not self._queue.empty():
            pending.append(self._queue.get_nowait())
        for _, future in pending:
            if not future.done():
                future.set_exception(RuntimeError("reward server is shutting down"))
        self._carry = None

    async def submit(self, items: list[Any]) -> list[float]:
        if self._task is None or self._task.done():
            raise RuntimeError("reward batcher is not running")
        self.num_requests += 1
        if not items:
            return []
        future = asyncio.get_running_loop().create_future()
        await self._started_queue().put((items, future))
        return await future

    async def _collect(self) -> list[tuple[list[Any], asyncio.Future]]:
        """The next batch: the first waiting request, plus any arriving within ``max_wait_s``."""
        loop = asyncio.get_running_loop()
        queue = self._started_queue()
        first, self._carry = (self._carry, None) if self._carry else (await queue.get(), None)
        batch, size = [first], len(first[0])
        deadline = loop.time() + self.max_wait_s
        while size < self.max_batch_size:
            remaining = deadline - loop.time()
            try:
                if remaining > 0:
                    item = await asyncio.wait_for(queue.get(), remaining)
                else:
                    item = queue.get_nowait()  # already waiting: no reason to leave it
            except (asyncio.TimeoutError, asyncio.QueueEmpty):
                break
            if size + len(item[0]) > self.max_batch_size:
                self._carry = item  # starts the next batch instead of overfilling this one
                break
            batch.append(item)
            size += len(item[0])
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            batch = [(items, fut) for items, fut in batch if not fut.done()]  # clients that went away
            if not batch:
                continue
            flat = [x for items, _ in batch for x in items]
            try:
                scores = await asyncio.to_thread(self.score_fn, flat)
                self.num_batches += 1
            except Exception as err:  # a failed forward fails its requests, not the server
                log.exception("scoring a batch of %d texts failed", len(flat))
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            start = 0
            for items, fut in batch:
                if not fut.done():
                    fut.set_result(scores[start:start + len(items)])
                start += len(items)


# ----------------------------------------------------------------------------------------------- HTTP


class RewardRequest(BaseModel):
    """OpenRLHF's request body; ``prompts``, ``labels`` and other keys are accepted and unused."""

    model_config = ConfigDict(extra="allow")

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


DEFAULT_MAX_BODY_BYTES = 16 << 20  # 16 MiB: ~16k texts of 1k characters
DEFAULT_MAX_TEXTS = 8192  # texts per request; OpenRLHF sends one micro-batch of rollouts per request


class ClientGone(Exception):
    """The client disconnected while its request was being scored."""


async def read_body_capped(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed ``max_bytes`` (by Content-Length, or while
    streaming a chunked body), before it is all held in memory."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(status_code=413, detail=f"request body of {int(declared)} bytes is over the limit of "
                                                    f"{max_bytes} bytes (max_body_bytes); send fewer texts per request")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPException(status_code=413, detail=f"request body is over the limit of {max_bytes} bytes "
                                                        "(max_body_bytes); send fewer texts per request")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_reward_request(body: bytes, max_texts: int | None = None) -> RewardRequest:
    """JSON whatever the Content-Type (``curl -d`` sends a form type); 400 for bad JSON, 422 for a bad shape
    (including more ``prompts`` than ``query`` texts), 413 for more than ``max_texts`` texts."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HTTPException(status_code=400, detail=f"request body is not valid JSON: {err}") from err
    except RecursionError:
        raise HTTPException(status_code=400, detail="request body is JSON nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise HTTPException(status_code=422, detail=f"request body must be a JSON object with 'query' (a list of "
                                                    f"strings), got {type(data).__name__}")
    query = data.get("query")
    if max_texts is not None and isinstance(query, list) and len(query) > max_texts:  # before validating them all
        raise HTTPException(status_code=413, detail=f"request has {len(query)} texts in 'query', over the "
                                                    f"limit of {max_texts} (max_texts); split it into smaller requests")
    try:
        request = RewardRequest.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
        raise HTTPException(status_code=422, detail=f"malformed /get_reward request: {problems}") from err
    if request.prompts is not None and len(request.prompts) > len(request.query):
        raise HTTPException(status_code=422, detail=f"'prompts' has {len(request.prompts)} entries but 'query' has "
                                                    f"{len(request.query)}; send one prompt per query text")
    return request


def create_app(scorer: RewardScorer, max_batch_size: int | None = None, max_wait_s: float = 0.005,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_texts: int = DEFAULT_MAX_TEXTS,
               api_key: str | None = None, max_pending: int = DEFAULT_MAX_PENDING,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, retry_after_s: int = 1) -> FastAPI:
    """The FastAPI app serving ``scorer``; the batcher lives as long as the app's lifespan.

    ``api_key``, ``max_pending``, ``retry_after_s``: see :mod:`hpc_rlhf.serving.guards`. ``request_timeout_s``
    bounds one request from admission to answer: 408 while its body is still arriving, 504 once it is queued
    or being scored (its remaining texts are then dropped).
    """
    if max_body_bytes < 1 or max_texts < 1:
        raise ValueError(f"max_body_bytes and max_texts must be >= 1, got {max_body_bytes} and {max_texts}")
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
    check_guard_settings(api_key, max_pending, retry_after_s)
    batcher = MicroBatcher(scorer.score_ids, max_batch_size or scorer.batch_size, max_wait_s)
    # One thread for parsing and tokenising: off the event loop, and fast tokenizers are not safe to call
    # from several threads at once.
    prepare_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-tokenize")

    def encode(texts: list[str], first_index: int) -> list[list[int]]:
        try:
            return scorer.encode(texts, first_index)
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from err

    async def score_while_connected(http_request: Request, texts: list[str]) -> list[float]:
        """Tokenise and score ``texts`` a batch at a time, so other requests interleave with a large one, and
        stop once the client is gone."""
        loop = asyncio.get_running_loop()
        scores: list[float] = []
        step = batcher.max_batch_size
        for start in range(0, len(texts), step):
            if await http_request.is_disconnected():
                raise ClientGone(f"client disconnected; dropped {len(texts) - start} of {len(texts)} texts unscored")
            ids = await loop.run_in_executor(prepare_pool, encode, texts[start:start + step], start)
            scores.extend(await batcher.submit(ids))
        return scores

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        log.info("serving reward model %s on %s (batch %d, wait %.1f ms, normalize=%s)", scorer.model_path,
                 scorer.device, batcher.max_batch_size, 1000 * max_wait_s, scorer.normalize)
        try:
            yield
        finally:
            await batcher.close()
            prepare_pool.shutdown(wait=False, cancel_futures=True)

    # No /docs or /openapi.json: an API for programs, and nothing else to expose on a shared node.
    app = FastAPI(title="hpc_rlhf reward model", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scorer = scorer
    app.state.batcher = batcher
    counters = app.state.guard = GuardCounters()
    app.add_middleware(RequestGuard, counters=counters, api_key=api_key, max_pending=max_pending,
                       retry_after_s=retry_after_s)

    @app.post("/get_reward")
    async def get_reward(http_request: Request) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request_timeout_s
        try:
            body = await asyncio.wait_for(read_body_capped(http_request, max_body_bytes), request_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPException(status_code=408, detail=f"request body not received within {request_timeout_s:g}s "
                                                        "(request_timeout_s)") from None
        request = await loop.run_in_executor(prepare_pool, parse_reward_request, body, max_texts)
        try:
            rewards = await asyncio.wait_for(score_while_connected(http_request, request.query),
                                             max(deadline - loop.time(), 0.0))
        except HTTPException:
            raise
        except asyncio.TimeoutError:
            log.warning("/get_reward: %d texts not scored within %gs; answered 504", len(request.query),
                        request_timeout_s)
            raise HTTPException(status_code=504, detail=f"{len(request.query)} texts not scored within "
                                                        f"{request_timeout_s:g}s (request_timeout_s): the server is "
                                                        "overloaded; retry later or send fewer texts") from None
        except ClientGone as gone:
            log.info("/get_reward: %s", gone)
            raise HTTPException(status_code=499, detail=str(gone)) from None  # nobody reads it; ends the handler
        except Exception as err:
            raise HTTPException(status_code=500, detail=f"scoring failed: {type(err).__name__}: {err}") from err
        return {"rewards": rewards, "scores": rewards, "extra_logs": {}}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": scorer.model_name, "device": str(scorer.device),
                "normalize": scorer.normalize, "num_requests": batcher.num_requests,
                "num_batches": batcher.num_batches, "num_forwards": scorer.num_forwards,
                "pending": counters.pending, "rejected_busy": counters.rejected_busy,
                "rejected_auth": counters.rejected_auth}

    return app


class BackgroundServer:
    """Run an ASGI app with uvicorn in a daemon thread on ``host:port`` (0: a free port).

    The socket is bound before the thread starts, so ``url`` is valid at once and no other process
    can take the port in between. ``start`` returns when the app has started (bounded wait). The server holds
    at most ``max_connections`` connections and closes one that sends no request within
    ``first_request_timeout_s`` (``connection_limits``).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 startup_timeout_s: float = 30.0, graceful_timeout_s: float = 10.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 first_request_timeout_s: float = DEFAULT_FIRST_REQUEST_TIMEOUT_S):
        import uvicorn  # the serve extra, like fastapi; imported where the server starts

        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.startup_timeout_s = startup_timeout_s
        # uvicorn annotates the timeout as an int but hands it to asyncio.wait_for, which takes any float
        config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=graceful_timeout_s,  # type: ignore[arg-type]
                                http=limited_http_protocol(max_connections, first_request_timeout_s))
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=f"uvicorn-{self.port}", daemon=True)

    def _serve(self) -> None:
        # uvicorn raises SystemExit when the app's startup fails; it has logged why
        with contextlib.suppress(SystemExit):
            self.server.run(sockets=[self._sock])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            died = not self._thread.is_alive()
            self.stop()
            reason = "failed during startup (see the log above)" if died else \
                f"did not start within {self.startup_timeout_s:g}s"
            raise RewardServerError(f"server on {self.url} {reason}")
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
