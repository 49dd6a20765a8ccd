"""Typed access to the transformers model behind a training-engine wrapper, and to its child modules.

torch types ``nn.Module.__getattr__`` as returning ``Tensor | Module``, so every transformers attribute read
through a plain ``nn.Module`` (``config``, ``get_decoder``, ``score``, ``base_model_prefix``) reaches a type
checker as that union. The forwards take "a model or an engine wrapping it" (DeepSpeed's engine and
``training.deepspeed_engine`` keep the model in ``.module``); :func:`hf_model` unwraps it once and gives it the
type ``PreTrainedModel``, and :func:`child_module` / :func:`base_model` fetch a named child and check that it is
a module, failing with the name of the missing child rather than later with an ``AttributeError`` on a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class EngineWrapper(Protocol):
    """A training engine wrapping a model (``training.deepspeed_engine``): called like the model, which it keeps
    in ``module``."""

    @property
    def module(self) -> torch.nn.Module: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


# What the forwards take: a model, or an engine wrapping one (ZeRO-3's parameter hooks live on the inner modules).
ModelOrEngine = torch.nn.Module | EngineWrapper


def hf_model(model: ModelOrEngine) -> PreTrainedModel:
    """The transformers model in ``model``: its ``.module`` for a training-engine wrapper, else ``model`` itself.

    A cast, not an ``isinstance`` check, at the transformers boundary: a LoRA-adapted model is peft's
    ``PeftModel``, which is no ``PreTrainedModel`` subclass but forwards every attribute to the one it wraps (and
    tests pass plain modules that have the attributes a forward reads).
    """
    return cast("PreTrainedModel", getattr(model, "module", model))


def child_module(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """``module``'s child module ``name`` (e.g. a value model's ``score`` head).

    Raises:
        TypeError: ``module`` has no attribute ``name``, or it is not a module (a tensor, a config value).
    """
    child = getattr(module, name, None)
    if not isinstance(child, torch.nn.Module):
        raise TypeError(f"{type(module).__name__} has no child module {name!r} "
                        f"(found {type(child).__name__})")
    return child


def base_model(model: ModelOrEngine) -> torch.nn.Module:
    """The decoder stack of a transformers model (or engine wrapper): the child named by ``base_model_prefix``
    (``model`` for Llama / Qwen), without the LM head or the value head."""
    module = hf_model(model)
    return child_module(module, module.base_model_prefix)


def to_device(model: PreTrainedModel, device: torch.device | str) -> None:
    """``model.to(device)``, in place.

    transformers declares ``PreTrainedModel.to`` with ``functools.wraps(nn.Module.to)``, which typeshed types as
    the unbound ``nn.Module.to`` (wanting the model as first argument). Through an ``nn.Module`` reference the
    call is checked against ``nn.Module.to``, and Python still runs transformers' override.
    """
    module: torch.nn.Module = model
    module.to(device)
