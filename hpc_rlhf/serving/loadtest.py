"""Load test for a ``/get_reward`` server: many concurrent requests, latency percentiles, every answer checked.

    python -m hpc_rlhf.serving.loadtest --tiny                      # builds a tiny RM, serves it on 127.0.0.1
    python -m hpc_rlhf.serving.loadtest --url http://node1:5000 --requests 2000 --concurrency 32

What it does: draws a pool of distinct texts (``Q: a+b=\\nA: c``), asks the server for each one alone (the
reference scores, one request at a time), then sends ``--requests`` requests of ``--texts_per_request`` texts
drawn from the pool (seeded), ``--concurrency`` in flight at once, and checks every answer against the
references (micro-batching and padding must not change a score beyond ``--tolerance``). Rejections with
back-pressure (503/429) are counted and retried after ``Retry-After``, as the trainer's client does; any other
failure is an error. It finishes with ``GET /health`` (the server is still up) and prints one JSON report:
latency p50 / p99 / max of the successful requests (first send to answer, busy answers and waits included),
throughput, errors, wrong answers, busy rejections.

With ``--tiny`` the server is ``python -m hpc_rlhf.cli.serve_rm`` in its own process (so client and server do
not share a GIL), on a free loopback port, stopped with SIGTERM at the end. The API key, if any, comes from
``$HPC_RLHF_RM_API_KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hpc_rlhf.models.tiny import build_tiny_reward_model
from hpc_rlhf.serving.guards import API_KEY_ENV
from hpc_rlhf.world.launch_env import free_port

BUSY_STATUS = (429, 503)


@dataclass
class LoadReport:
    """Outcome of one load run; ``ok`` = the server stayed up and every request got its correct answer."""

    num_requests: int
    concurrency: int
    texts_per_request: int
    num_ok: int = 0
    num_wrong: int = 0  # answered 200 with a score off the reference
    errors: dict[str, int] = field(default_factory=dict)  # cause -> count (not retried further)
    busy_retries: int = 0  # 503/429 answers retried after Retry-After
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    max_ms: float = float("nan")
    wall_s: float = 0.0
    requests_per_s: float = 0.0
    healthy_after: bool = False

    @property
    def ok(self) -> bool:
        return self.healthy_after and self.num_ok == self.num_requests and not self.num_wrong and not self.errors


def text_pool(size: int, seed: int = 0) -> list[str]:
    """``size`` distinct arithmetic texts (seeded; some answers wrong, so scores spread)."""
    rng = random.Random(seed)
    pool: dict[str, None] = {}
    while len(pool) < size:
        a, b = rng.randrange(100), rng.randrange(100)
        pool[f"Q: {a}+{b}=\nA: {a + b + rng.choice((0, 0, 1, -1))}"] = None
    return list(pool)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest-rank method; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


async def reference_scores(client: httpx.AsyncClient, url: str, pool: list[str]) -> dict[str, float]:
    """Each text scored alone, one request at a time."""
    scores = {}
    for text in pool:
        response = await client.post(url, json={"query": [text]})
        response.raise_for_status()
        scores[text] = response.json()["rewards"][0]
    return scores


async def run_load(base_url: str, num_requests: int = 2000, concurrency: int = 32, texts_per_request: int = 4,
                   pool_size: int = 64, seed: int = 0, tolerance: float = 1e-4, timeout_s: float = 120.0,
                   api_key: str | None = None, max_busy_retries: int = 20) -> LoadReport:
    """Run the load described in the module docstring against ``base_url`` (``http://host:port``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/get_reward"
    pool = text_pool(pool_size, seed)
    rng = random.Random(seed + 1)
    bodies = [rng.choices(pool, k=texts_per_request) for _ in range(num_requests)]
    report = LoadReport(num_requests, concurrency, texts_per_request)
    errors: Counter[str] = Counter()
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers, limits=limits) as client:
        expected = await reference_scores(client, url, pool)
        gate = asyncio.Semaphore(concurrency)

        async def one(texts: list[str]) -> None:
            async with gate:
                start = time.perf_counter()  # latency as the caller sees it: busy answers and waits included
                for _ in range(max_busy_retries + 1):
                    try:
                        response = await client.post(url, json={"query": texts})
                    except httpx.HTTPError as err:
                        errors[type(err).__name__] += 1
                        return
                    if response.status_code not in BUSY_STATUS:
                        break
                    report.busy_retries += 1
                    await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                if response.status_code != 200:
                    errors[f"HTTP {response.status_code}"] += 1
                    return
                rewards = response.json().get("rewards", [])
                if len(rewards) != len(texts) or any(
                        abs(r - expected[t]) > tolerance for r, t in zip(rewards, texts, strict=True)):
                    report.num_wrong += 1
                    return
                latencies.append(time.perf_counter() - start)
                report.num_ok += 1

        start = time.perf_counter()
        await asyncio.gather(*(one(texts) for texts in bodies))
        report.wall_s = time.perf_counter() - start
        try:
            health = await client.get(base_url.rstrip("/") + "/health")
            report.healthy_after = health.status_code == 200 and health.json().get("status") == "ok"
        except httpx.HTTPError:
            report.healthy_after = False
    report.errors = dict(errors)
    report.p50_ms, report.p99_ms = 1000 * percentile(latencies, 0.50), 1000 * percentile(latencies, 0.99)
    report.max_ms = 1000 * max(latencies, default=float("nan"))
    report.requests_per_s = report.num_ok / report.wall_s if report.wall_s else 0.0
    return report


# ----------------------------------------------------------------------------------------------- --tiny


def start_server(model: Path, port: int, extra: list[str], startup_timeout_s: float = 120.0,
                 api_key: str | None = None, **popen_kwargs: Any) -> subprocess.Popen:
    """``serve_rm`` on 127.0.0.1:``port`` in a child process (``extra`` flags win over the defaults here);
    returns once ``/health`` answers."""
    proc = subprocess.Popen([sys.executable, "-m", "hpc_rlhf.cli.serve_rm", "--reward_pretrain", str(model),
                             "--port", str(port), "--device", "cpu", "--log_level", "warning", *extra],
                            **popen_kwargs)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", headers=headers, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"serve_rm on port {port} did not answer /health within {startup_timeout_s:g}s "
                       f"(exit status {proc.returncode})")


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hpc_rlhf.serving.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, http://host:port")
    target.add_argument("--tiny", action="store_true", help="build a tiny RM and serve it on 127.0.0.1")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--texts_per_request", type=int, default=4)
    p.add_argument("--pool_size", type=int, default=64, help="distinct texts the requests are drawn from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest accepted |score - reference|")
    p.add_argument("--server_args", default="", help="--tiny: extra serve_rm flags, e.g. '--max_pending 8'")
    args = p.parse_args(argv)
    api_key = os.environ.get(API_KEY_ENV) or None
    proc = None
    with tempfile.TemporaryDirectory(prefix="rm_loadtest_") as tmp:
        if args.tiny:
            port = free_port()
            proc = start_server(build_tiny_reward_model(Path(tmp) / "rm"), port, args.server_args.split(),
                                api_key=api_key)
            url = f"http://127.0.0.1:{port}"
        else:
            url = args.url
        try:
            report = asyncio.run(run_load(url, args.requests, args.concurrency, args.texts_per_request,
                                          args.pool_size, args.seed, args.tolerance, api_key=api_key))
        finally:
            if proc is not None:
                stop_server(proc)
    out: dict[str, Any] = {**asdict(report), "ok": report.ok}
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}, indent=2))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
