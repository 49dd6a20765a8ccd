"""Names that changed across the supported transformers range, behind one place.

transformers 5.24 renamed a decoder's KV-cache keyword ``past_key_values`` to ``cache`` (the old name warns on
every call and goes in 5.40) and ``gradient_checkpointing_enable`` / ``is_gradient_checkpointing`` to
``activation_checkpointing_enable`` / ``is_activation_checkpointing`` (the old names go in v6). Older versions
know only the old names, so each helper asks the model which one it has.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


@functools.cache
def _forward_takes_cache(model_class: type) -> bool:
    forward = getattr(model_class, "forward", None)  # every nn.Module class has one
    return forward is not None and "cache" in inspect.signature(forward).parameters


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword argument that passes ``cache`` (a ``transformers.Cache``) to ``model``'s forward: ``cache``
    where the forward takes it (transformers >= 5.24), else ``past_key_values``."""
    model_class: type = type(model)  # a plain type: mypy rejects type[Module] as unhashable (via Module.__hash__)
    return {"cache": cache} if _forward_takes_cache(model_class) else {"past_key_values": cache}


def enable_activation_checkpointing(model: torch.nn.Module, **checkpoint_kwargs: Any) -> None:
    """Turn on activation (gradient) checkpointing with ``checkpoint_kwargs`` for ``torch.utils.checkpoint``;
    a model without transformers' switch (neither name) is left as it is."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        legacy_enable = getattr(model, "gradient_checkpointing_enable", None)
        if legacy_enable is not None:
            legacy_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def is_activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on for ``model`` (False for other modules)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.24
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return bool(checkpointing)
