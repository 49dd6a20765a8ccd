"""LoRA for the trained roles (actor, critic, reward model), on top of peft.

``apply_lora`` injects LoRA layers *in place* into the HF model (``peft.get_peft_model`` mutates the model it
wraps) and returns that same HF model, not the ``PeftModel`` wrapper: every trainer keeps calling the model it
knows (``model.model`` is still the backbone, ``model.score`` still the value head, ``model.config`` the HF
config). Only LoRA parameters (and, for value models, the ``score`` head through peft's ``modules_to_save``)
require grad.

``merged_named_tensors`` turns the LoRA model back into the plain HF state dict, ``W + scale * B @ A`` under
the names of a model loaded with ``AutoModelFor*.from_pretrained`` (``q_proj.base_layer.weight`` ->
``q_proj.weight``; ``score.modules_to_save.default.weight`` -> ``score.weight``; LoRA factors dropped). It
computes merged *copies* (a QLoRA base weight is dequantised first): the training weights are never touched
(peft's ``merge_adapter`` would add the delta into the frozen weights in place and subtract it later, which is
lossy in bf16 and races with ZeRO's flat buffers). This is what weight sync to the rollout engine and the HF
export consume.

``save_adapter`` writes a standard peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
that ``peft.PeftModel.from_pretrained`` and ``hpc-rlhf lora-merge`` load.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeGuard

import torch
from safetensors.torch import save_file

from hpc_rlhf.config.schema import LoraConfig as LoraSettings
from hpc_rlhf.models.hf_module import child_module
from hpc_rlhf.models.quantization import dequantized, plain_copy
from hpc_rlhf.models.vision import is_vision_language, multimodal_model

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

# peft is imported inside the functions: importing it takes seconds (and pulls in bitsandbytes where installed),
# and only runs with ds.lora.rank > 0 need it.

VALUE_HEAD = "score"
PEFT_PREFIX = "base_model.model."
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")
_BASE_LAYERS = re.compile(r"(?:\.base_layer)+\.")
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
               "lora_dropout", "original_module")


def lora_enabled(lora_cfg: LoraSettings | None) -> bool:
    return lora_cfg is not None and lora_cfg.rank > 0


def _is_value_model(model: torch.nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification") or (
        hasattr(model, VALUE_HEAD) and getattr(model, "get_output_embeddings", lambda: None)() is None)


def apply_lora(model: torch.nn.Module, lora_cfg: LoraSettings, task_type: str | None = None) -> torch.nn.Module:
    """Inject LoRA into ``model`` in place and return it (the HF model, not a ``PeftModel``).

    ``task_type``: ``"CAUSAL_LM"`` (actor) or ``"SEQ_CLS"`` (critic / reward model: the ``score`` head stays
    fully trainable and is saved with the adapter); default: inferred from the model class.
    """
    if not lora_enabled(lora_cfg):
        raise ValueError("apply_lora needs ds.lora.rank > 0")
    from peft import LoraConfig, get_peft_model

    if lora_cfg.load_in_4bit:
        if not getattr(model, "is_loaded_in_4bit", False):
            raise ValueError("ds.lora.load_in_4bit=true but the model was not loaded in 4 bit: load it with "
                             "hpc_rlhf.models.loading.load_causal_lm / load_value_model(..., load_in_4bit=True)")
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if task_type is None:
        task_type = "SEQ_CLS" if _is_value_model(model) else "CAUSAL_LM"
    targets = list(lora_cfg.target_modules)
    target_modules: str | list[str] = "all-linear" if targets == ["all-linear"] else targets
    if is_vision_language(getattr(model, "config", None)):
        target_modules = language_model_targets(model, targets)
    peft_cfg = LoraConfig(
        r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=target_modules,
        task_type=task_type, modules_to_save=[VALUE_HEAD] if task_type == "SEQ_CLS" else None, bias="none",
    )
    # get_peft_model injects the LoRA layers into ``model`` itself; the wrapper is dropped on purpose (the
    # adapter config stays reachable as ``model.peft_config`` for save_adapter).
    try:
        model = child_module(get_peft_model(model, peft_cfg).base_model, "model")
    except ValueError as err:
        if "ParamWrapper" in str(err) and "dropout" in str(err):
            raise ValueError(f"ds.lora.dropout={lora_cfg.dropout}: peft adapts this mixture-of-experts model's fused "
                             "expert weights (ParamWrapper), which take no LoRA dropout; set ds.lora.dropout=0, or "
                             "list ds.lora.target_modules without the experts (e.g. [q_proj, k_proj, v_proj, "
                             "o_proj])") from err
        raise
    _check_tied_output_not_adapted(model)
    return model


def language_model_targets(model: torch.nn.Module, targets: list[str]) -> str:
    """peft's ``target_modules`` regex for a vision-language model: the named (or, for ``all-linear``, every)
    linear layers of its language model only; the vision tower (whose MLP reuses names like ``gate_proj``) and the
    projector keep their weights."""
    names = set(targets)
    if targets == ["all-linear"]:
        language = multimodal_model(model).language_model
        names = {n.rsplit(".", 1)[-1] for n, m in language.named_modules() if isinstance(m, torch.nn.Linear)}
    if not names:
        raise ValueError("ds.lora.target_modules names no linear layer of the language model")
    return r"^model\.language_model\..*\.(" + "|".join(sorted(map(re.escape, names))) + r")$"


def _check_tied_output_not_adapted(model: torch.nn.Module) -> None:
    """A LoRA on a tied lm_head would change the output layer but not the input embedding it shares weights
    with: no plain HF model can hold that merge. ("all-linear" never targets the output layer.)"""
    from peft.tuners.lora import LoraLayer

    output = getattr(model, "get_output_embeddings", lambda: None)()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and isinstance(output, LoraLayer):
        raise ValueError("ds.lora.target_modules adapts the output layer (lm_head), whose weight is tied to the "
                         "input embeddings (tie_word_embeddings=true); remove it from ds.lora.target_modules")


def is_lora_model(model: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def hf_name(name: str) -> str | None:
    """peft parameter name -> plain HF name; None for tensors that only exist because of LoRA."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    parts = name.split(".")
    if any(p in _LORA_PARTS for p in parts):
        return None
    name = _MODULES_TO_SAVE.sub(".", name)
    return _BASE_LAYERS.sub(".", name)  # nested under one base_layer per LoRA layer (ParamWrapper)


def _is_param_wrapper(layer: object) -> TypeGuard[ParamWrapper]:
    """peft's LoRA on a bare parameter (``ParamWrapper``): the fused 3-D experts and the router weight of
    transformers 5's MoE blocks, which ``all-linear`` targets since peft 0.17."""
    return type(layer).__name__ == "ParamWrapper" and hasattr(layer, "parameter_name")


def _adapted_weight_name(path: str, layer: LoraLayer) -> str:
    """The state-dict name of the base tensor a LoRA layer at ``path`` adapts.

    A layer's own base sits under ``base_layer``; peft nests one ``ParamWrapper`` per adapted parameter of the same
    module (``experts.base_layer.base_layer.gate_up_proj``), so the name descends through every LoRA layer below.
    """
    from peft.tuners.lora import LoraLayer

    name = path
    inner: object = layer  # each base_layer below is a module, a LoRA layer itself when peft nested one
    while isinstance(inner, LoraLayer):
        name, inner = f"{name}.base_layer", inner.base_layer
    return f"{name}.{layer.parameter_name if _is_param_wrapper(layer) else 'weight'}"


def _lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """``{state-dict name of an adapted base tensor: its LoRA layer}``."""
    from peft.tuners.lora import LoraLayer

    return {_adapted_weight_name(n, m): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def _merged_weight(layer: LoraLayer, base: torch.Tensor) -> torch.Tensor:
    """``W + sum_active delta`` of one peft LoRA layer (``base``: its adapted tensor ``W``), computed in fp32 into a
    new tensor: ``scale * B @ A`` for Linear and Embedding, peft's own per-expert delta for a ``ParamWrapper``."""
    from peft.tuners.lora import Embedding

    base = dequantized(base)
    merged = base.to(torch.float32, copy=True)
    for adapter in layer.active_adapters:
        factored = adapter in getattr(layer, "lora_A", {})
        if factored and (layer.use_dora.get(adapter) or layer.lora_bias.get(adapter)):
            raise NotImplementedError("merged weights support plain LoRA only (no DoRA, no lora_bias)")
        if factored and _is_param_wrapper(layer):
            merged += layer.get_delta_weight(adapter).float()
        # A 2-D base with factors in lora_A: peft's Linear and its bitsandbytes variants (lora.bnb.Linear4bit holds
        # its factors the same way without subclassing lora.Linear); conv layers have 3-5-D weights.
        elif factored and merged.dim() == 2:
            delta = (layer.lora_B[adapter].get_parameter("weight").float()
                     @ layer.lora_A[adapter].get_parameter("weight").float())
            merged += (delta.T if getattr(layer, "fan_in_fan_out", False) else delta) * layer.scaling[adapter]
        elif isinstance(layer, Embedding) and adapter in layer.lora_embedding_A:
            delta = layer.lora_embedding_B[adapter].float() @ layer.lora_embedding_A[adapter].float()
            merged += delta.T * layer.scaling[adapter]
        elif factored or adapter in getattr(layer, "lora_embedding_A", {}):
            raise NotImplementedError(f"merging LoRA into {type(layer).__name__} is not supported; "
                                      "target Linear or Embedding modules or parameters only")
    return merged.to(base.dtype)


def lora_factors(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """``{state-dict name of an adapted base tensor: [its LoRA parameters]}``: what a merge of that tensor reads."""
    from peft.tuners.lora import LoraLayer

    factors: dict[str, list[torch.nn.Parameter]] = {}
    module: torch.nn.Module  # named_modules is untyped: a LoRA layer is both a module and a peft LoraLayer
    for path, module in model.named_modules():
        if isinstance(module, LoraLayer):
            factors[_adapted_weight_name(path, module)] = [p for pn, p in module.named_parameters()
                                                           if not pn.startswith("base_layer.")]
    return factors


def merge_lora_entries(model: torch.nn.Module,
                       entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Map ``(peft name, tensor)`` entries of ``model`` to ``(HF name, merged copy)``; LoRA-only entries vanish.

    ``entries`` may be any subset of ``model.state_dict(keep_vars=True).items()`` (e.g. deduplicated, bucketed).
    """
    layers = _lora_layers(model)
    for name, tensor in entries:
        target = hf_name(name)
        if target is None:
            continue
        layer = layers.get(name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name)
        yield target, _merged_weight(layer, tensor) if layer is not None else plain_copy(tensor)


def merged_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain HF state dict of a LoRA model (a ``PeftModel`` or the model ``apply_lora`` returned), merged.

    Names match ``AutoModelFor*.from_pretrained(...).state_dict()`` (tied weights under every name, as there).
    The training weights are not modified.
    """
    inner = child_module(model.base_model, "model") if _is_peft_model(model) else model
    # A 4-bit model's state dict also carries bitsandbytes' quantisation state (``*.weight.absmax``, ...):
    # only real parameters and buffers have a plain counterpart.
    tensors = {*dict(inner.named_parameters(remove_duplicate=False)),
               *dict(inner.named_buffers(remove_duplicate=False))}
    entries = [(name, t) for name, t in inner.state_dict(keep_vars=True).items() if name in tensors]
    yield from merge_lora_entries(inner, entries)


def _is_peft_model(model: torch.nn.Module) -> TypeGuard[PeftModel]:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def save_adapter(model: torch.nn.Module, output_dir: str, adapter_name: str = "default") -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` in peft's own layout."""
    from peft.utils import get_peft_model_state_dict

    if _is_peft_model(model):
        model.save_pretrained(output_dir, selected_adapters=[adapter_name], save_embedding_layers=False)
        return
    configs: dict[str, PeftConfig] | None = getattr(model, "peft_config", None)  # set by apply_lora
    if configs is None:
        raise ValueError(f"save_adapter: {type(model).__name__} carries no LoRA adapter (apply_lora was not applied)")
    config = configs[adapter_name]
    state = get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
    state = {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()}
    os.makedirs(output_dir, exist_ok=True)
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None)
    config.save_pretrained(output_dir)
    save_file(state, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def load_trainable_state(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """Copy a LoRA checkpoint's trainable tensors into ``dst`` (DeepSpeed's ``custom_load_fn``).

    LoRA checkpoints are written without the frozen base (``exclude_frozen_parameters``): it never changes
    and is reloaded from ``pretrain`` (a 70B base would otherwise be rewritten at every save). What the
    module state still holds besides the adapters (buffers; bitsandbytes' quantisation state of a 4-bit base,
    ~1/64 byte per weight, which DeepSpeed writes because it is not a parameter) is left alone: the model was
    rebuilt from the same checkpoint. A missing adapter is an error, not a silently fresh one.
    """
    trainable = {name: p for name, p in dst.named_parameters() if p.requires_grad}
    missing = sorted(set(trainable) - set(src))
    if missing:
        raise KeyError(f"LoRA checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[:3]}: it was "
                       "written for a different ds.lora (rank, target_modules) or model")
    for name, param in trainable.items():
        if src[name].shape != param.shape:
            raise ValueError(f"LoRA checkpoint tensor {name} has shape {tuple(src[name].shape)}, the model "
                             f"{tuple(param.shape)}: ds.lora.rank or the model differs from the saved run")
        param.copy_(src[name])


# ---------------------------------------------------------------------------- adapter-only weight sync
# With ``ds.lora.sync=adapter`` the rollout engine keeps the base it loaded once and receives only the adapter:
# the tensors ``get_peft_model_state_dict`` returns (peft's saved names, without the adapter name and without the
# ``base_model.model.`` prefix of the file layout), the same ones ``save_adapter`` writes.


def adapter_state_dict(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """``{peft's saved name: tensor}`` of the adapter of ``model`` (the model ``apply_lora`` returned): each LoRA
    factor (``...q_proj.lora_A.weight`` [rank, in], ``...lora_B.weight`` [out, rank]; a ``ParamWrapper``'s factors
    likewise), plus a value model's ``score`` copy. The tensors are the live ones (detach and copy before moving
    them); under ZeRO-3 call it inside a gather of the trainable parameters."""
    from peft.utils import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False))


@torch.no_grad()
def load_adapter_state(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                       adapter_name: str = "default") -> int:
    """Load ``tensors`` (names as :func:`adapter_state_dict` gives them) into the LoRA layers of ``model`` with peft's
    own loader, the base weights untouched (no merge). Every adapter tensor of ``model`` must come, and nothing
    else: a missing or unknown name or a shape mismatch raises, naming it. Returns the number of tensors loaded."""
    from peft.utils import set_peft_model_state_dict

    state = dict(tensors)
    expected = adapter_state_dict(model, adapter_name)
    unknown, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if unknown or missing:
        raise KeyError(f"adapter sync: {len(unknown)} unknown tensor names (e.g. {unknown[:3]}) and {len(missing)} "
                       f"missing (e.g. {missing[:3]}): the trainer's and the rollout engine's ds.lora (rank, "
                       "target_modules) or models differ")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"adapter sync: {name} has shape {tuple(tensor.shape)}, the rollout engine's adapter "
                             f"{tuple(expected[name].shape)}: ds.lora.rank or the model differs")
    set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    return len(state)


def adapter_config_dict(lora_cfg: LoraSettings) -> dict[str, object]:
    """The ``adapter_config.json`` of a causal-LM adapter trained with ``lora_cfg`` (what vLLM's LoRA loader reads:
    rank, alpha, targets; vLLM takes the adapted modules from the tensor names)."""
    targets = list(lora_cfg.target_modules)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
            "lora_dropout": lora_cfg.dropout, "target_modules": "all-linear" if targets == ["all-linear"] else targets,
            "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "base_model_name_or_path": None}


def write_adapter_folder(folder: str, lora_cfg: LoraSettings, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Write ``tensors`` (names as :func:`adapter_state_dict`) as a peft adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``, names under ``base_model.model.``), replacing what ``folder`` held: the tensors
    go to a temporary file renamed into place, so a reader never sees half a file. Returns the bytes written."""
    import json

    os.makedirs(folder, exist_ok=True)
    state = {PEFT_PREFIX + name: t.detach().to("cpu").contiguous() for name, t in tensors}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(adapter_config_dict(lora_cfg), f)
    partial = os.path.join(folder, "adapter_model.safetensors.partial")
    save_file(state, partial, metadata={"format": "pt"})
    os.replace(partial, os.path.join(folder, "adapter_model.safetensors"))
    return sum(t.numel() * t.element_size() for t in state.values())
