"""Rollout routing replay (R3) for mixture-of-experts models: record the experts each token was routed to
while the rollout engine generated, and make the trainer's forward use them.

Why: a top-k router is discontinuous. After a weight update (asynchronous training), or only from different
kernels and batch shapes, the trainer's router can pick other experts than the rollout engine's for the same
token; the token's log-prob then comes from a different sub-network, and the importance ratio of the policy
loss blows up. Replaying the rollout's experts removes that source of mismatch (Ma et al. 2025, "Stabilizing
MoE Reinforcement Learning by Aligning Training and Inference Routers", arXiv:2510.11370).

Layout of recorded routes: ``(T, L, k)`` per sequence, the ``k`` expert ids of each of its ``T`` token
positions in each of the ``L`` MoE layers (model order), the layout vLLM returns as
``CompletionOutput.routed_experts``. Position ``t`` holds the routing of the forward over token ``t`` (whose
output predicts token ``t + 1``). Stored as ``uint8`` when the ids fit (``num_experts < 255``), else ``int16``:
``L * k`` bytes per token (Qwen3-30B-A3B: 48 layers x top-8 = 384 B). The dtype's largest value
(:func:`not_recorded`, never a real expert id) marks a position that was not recorded (padding, the last
sampled token, which is never fed forward); the trainer routes such a position with its own router.

Replay (:func:`replay_routes`): the experts are the recorded ones; their gate weights come from the *current*
router, ``softmax(router_logits)`` at the recorded experts, renormalised over them when the router renormalises
its top-k (Qwen3-MoE's ``norm_topk_prob``, Mixtral always) - what the model would compute had its own top-k
picked those experts, so the router still gets a gradient. Supported routers: the softmax-then-top-k routers
listed in :data:`REPLAYABLE_ROUTERS`; others (grouped or sigmoid routing: DeepSeek-V3, gpt-oss) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hpc_rlhf.algos.moe import not_recorded, was_recorded
from hpc_rlhf.models.hf_module import ModelOrEngine, hf_model
from hpc_rlhf.models.moe import router_class

# transformers router classes that compute ``(logits, top-k softmax weights, top-k ids)`` from one linear
# layer, renormalising the top-k weights when ``norm_topk_prob`` is set (Mixtral's and OLMoE's: always, with
# no such attribute). Their weights over given experts are :func:`replay_gate_weights`.
REPLAYABLE_ROUTERS = {"Qwen3MoeTopKRouter": None, "Qwen2MoeTopKRouter": None, "MixtralTopKRouter": True,
                      "OlmoeTopKRouter": None}


def route_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype holding the expert ids and the not-recorded marker ``num_experts``."""
    return torch.uint8 if num_experts < 255 else torch.int16


def continue_routes(earlier: torch.Tensor | None, continued: torch.Tensor | None) -> torch.Tensor | None:
    """Routes of a sample whose generation was continued (a partial rollout's next chunk, an agent's next turn):
    ``continued`` (T2, L, k) covers the whole sequence, routing its first ``T1`` positions again in the new call's
    prefill (under newer weights, or only other batch shapes); ``earlier`` (T1, L, k) holds the routes those tokens
    were sampled with, and wins where it was recorded (vLLM's ``routed_experts_prompt_start`` makes the same
    choice for multi-turn agents). Positions past ``T1`` (an agent's feedback, the new output) come from
    ``continued``. None if either is."""
    if earlier is None or continued is None:
        return None
    head = torch.where(was_recorded(earlier)[:, None, None], earlier, continued[: len(earlier)])
    return torch.cat([head, continued[len(earlier):]])


def pad_routes(routes: torch.Tensor | None, num_positions: int) -> torch.Tensor | None:
    """``routes`` (T, L, k) extended to ``num_positions`` rows marked not recorded (tokens appended after the last
    generation, e.g. an environment's final feedback, which no trained log-prob depends on)."""
    if routes is None or len(routes) >= num_positions:
        return routes
    tail = torch.full((num_positions - len(routes), *routes.shape[1:]), not_recorded(routes.dtype), dtype=routes.dtype)
    return torch.cat([routes, tail])


def routers(model: ModelOrEngine) -> list[torch.nn.Module]:
    """The model's router modules in model order (one per MoE layer); empty for a dense model. ``model`` may be
    a training engine wrapping the transformers model (``.module``)."""
    module = hf_model(model)
    cls = router_class(module)
    return [m for m in module.modules() if isinstance(m, cls)] if cls is not None else []


def renormalises_top_k(router: torch.nn.Module) -> bool:
    """Whether ``router`` renormalises its top-k softmax weights to sum to 1.

    Raises:
        TypeError: a router whose gate weights are not softmax-then-top-k (:data:`REPLAYABLE_ROUTERS`).
    """
    name = type(router).__name__
    if name not in REPLAYABLE_ROUTERS:
        raise TypeError(f"routing replay (algo.routing_replay=rollout) does not support {name}: its gate weights are "
                        f"not computed as softmax-then-top-k; supported routers: {', '.join(REPLAYABLE_ROUTERS)}")
    fixed = REPLAYABLE_ROUTERS[name]
    return fixed if fixed is not None else bool(router.norm_topk_prob)


def replay_gate_weights(router_logits: torch.Tensor, experts: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """Gate weights of the given experts under the current router: (N, E) logits, (N, k) long ids -> (N, k) fp32.

    ``softmax(router_logits)`` (fp32) at ``experts``, divided by its sum over them when ``renormalise``.
    Differentiable in the logits.
    """
    weights = torch.softmax(router_logits, dim=-1, dtype=torch.float32).gather(-1, experts)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def merge_routes(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """Each position's recorded experts where it was recorded, else the router's own: (N, k) x 2 -> (N, k) long."""
    recorded = recorded.to(own.device)
    return torch.where(was_recorded(recorded.unsqueeze(1)).unsqueeze(-1), recorded.long(), own)


class RouteRecorder:
    """Records the experts each forward of ``model`` routed its tokens to (a forward hook per router).

    Use as a context manager around forwards; after each forward, :meth:`take` returns its routes ``(N, L, k)``
    (N: the forward's flattened token positions, row-major over its (batch, sequence) input) in
    :func:`route_dtype`, and forgets them.
    """

    def __init__(self, model: torch.nn.Module, num_experts: int) -> None:
        self._routers = routers(model)
        if not self._routers:
            raise TypeError(f"{type(model).__name__} has no router modules: only mixture-of-experts models route")
        self._dtype = route_dtype(num_experts)
        self._layers: list[torch.Tensor] = []
        self._handles: list = []

    def _record(self, _module, _args, output) -> None:
        self._layers.append(output[2].detach().to(self._dtype))

    def __enter__(self) -> RouteRecorder:
        self._handles = [r.register_forward_hook(self._record) for r in self._routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> torch.Tensor:
        """Routes of the forward since the last call: (N, L, k)."""
        if len(self._layers) != len(self._routers):
            raise RuntimeError(f"recorded {len(self._layers)} router calls for {len(self._routers)} MoE layers: take() "
                               "must follow exactly one forward")
        routes = torch.stack(self._layers, dim=1)
        self._layers = []
        return routes


@contextlib.contextmanager
def replay_routes(model: ModelOrEngine, routes: torch.Tensor) -> Iterator[None]:
    """Forwards of ``model`` inside the block route token ``n`` of each MoE layer ``l`` to ``routes[n, l]``.

    ``routes``: (N, L, k), aligned with the forward's flattened token positions (one forward per block);
    unrecorded positions (:func:`not_recorded`) keep the router's own choice. The router's logits (what
    transformers records as ``router_logits``, and the load-balancing loss reads) are unchanged; its gate
    weights are :func:`replay_gate_weights` of the replayed experts.
    """
    layers = routers(model)
    if routes.dim() != 3 or routes.shape[1] != len(layers):
        raise ValueError(f"recorded routes of shape {tuple(routes.shape)} do not match {len(layers)} MoE layers "
                         "(expected (tokens, layers, top_k)); were they recorded with another model?")
    renormalise = [renormalises_top_k(r) for r in layers]

    def hook_for(layer: int):
        def replace(_module, _args, output):
            logits, own_weights, own = output
            if own.shape[0] != routes.shape[0]:
                raise ValueError(f"MoE layer {layer} routes {own.shape[0]} tokens but {routes.shape[0]} recorded "
                                 "routes were given: routes must follow the forward's token order")
            experts = merge_routes(own, routes[:, layer])
            weights = replay_gate_weights(logits, experts, renormalise[layer]).to(own_weights.dtype)
            return logits, weights, experts
        return replace

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
