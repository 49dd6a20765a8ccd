"""vLLM plugin entry point (``vllm.general_plugins`` in pyproject.toml): vLLM calls :func:`register` in each of
its processes (front end, engine core, workers), so backends registered here exist where vLLM builds them.

It registers the ``gloo`` weight-transfer backend (:mod:`hpc_rlhf.weight_sync.vllm_gloo_transfer`): the same
start / update / finish rounds as vLLM's ``nccl`` backend, over a gloo group, for engines in processes of their
own on machines without NCCL (CPU). Registration is by module path, so nothing is imported until vLLM builds the
engine. This module imports no vLLM at import time.
"""

from __future__ import annotations

GLOO_BACKEND = "gloo"


def register() -> None:
    """Register our weight-transfer backend with vLLM's factory (idempotent: vLLM may load plugins twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "hpc_rlhf.weight_sync.vllm_gloo_transfer", "GlooWeightTransferEngine")
