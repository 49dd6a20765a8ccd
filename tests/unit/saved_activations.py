"""Measure what autograd saves per token and decoder layer, for the activation-memory formulas' tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_elements_per_layer(build: Callable[[int], torch.nn.Module], tokens: int = 32) -> float:
    """fp32 elements autograd saves per token for one more decoder layer: ``build(num_layers)`` with 2 and 3
    layers (from layer 1 on every input requires grad; layer 0 may keep less), forward in training mode, the
    parameters themselves not counted."""
    saved = []
    for layers in (2, 3):
        torch.manual_seed(0)
        model = build(layers).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(t, storages=storages, params=params):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(0, 100, (1, tokens)), use_cache=False, logits_to_keep=1)
        saved.append(sum(storages.values()))
    return (saved[1] - saved[0]) / tokens / 4
