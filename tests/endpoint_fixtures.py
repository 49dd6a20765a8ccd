"""Shared pieces of the tests that serve the OpenAI-compatible endpoint: a tiny engine built locally, and the
thread that drains the endpoint's queue into an engine (as the executor's engine thread does in a run)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def tiny_tokenizer_and_engine(directory: Path) -> tuple[Any, Any]:
    """A tiny local model's tokenizer and a transformers rollout engine over it (fp32, CPU, seeded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    path = build_tiny_model(directory / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    engine = TransformersRolloutEngine(model, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id, device="cpu", seed=3)
    return tokenizer, engine


@contextmanager
def queue_drained_into(endpoint: Any, generate: Callable[[list[Any]], list[Any]]) -> Iterator[None]:
    """While the block runs, a background thread runs the endpoint's queued requests through ``generate``."""
    from hpc_rlhf.agents.openai_endpoint import run_batch

    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            run_batch(endpoint.queue.take(set(), 0.02, 0.0), generate)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
