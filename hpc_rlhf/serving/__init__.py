"""HTTP services around models (the only place that imports fastapi / uvicorn).

* ``rm_server``: ``RewardScorer`` (tokenise + score texts with a reward model, no HTTP),
  ``MicroBatcher`` (merges concurrent requests into one forward), ``create_app`` (the OpenRLHF-compatible
  ``POST /get_reward`` + ``GET /health`` FastAPI app), ``BackgroundServer`` (uvicorn in a thread).
  Started by ``python -m hpc_rlhf.cli.serve_rm``.
* ``guards``: ``RequestGuard``, the ASGI middleware in front of it (bearer token, bounded admission with
  503 + Retry-After); imports no fastapi.
* ``loadtest``: ``python -m hpc_rlhf.serving.loadtest``, concurrent requests against a server, p50/p99
  latency, errors, answers checked against one-at-a-time scores.

Import the submodule directly; this package imports nothing so that ``hpc_rlhf`` stays light.
"""
