"""Load the models of each role from local HF folders (their forwards: ``hpc_rlhf.models.forward``).

The critic and the reward model are ``AutoModelForSequenceClassification`` with one label: their linear
head is called ``score`` in memory; a checkpoint whose head has another name (OpenRLHF's ``value_head``)
loads through ``value_head_prefix``.
"""

from __future__ import annotations

import os
import re

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

# resolve_attn_implementation is re-exported: the trainers import it from here.
from hpc_rlhf.models.kernels import apply_liger_kernel, resolve_attn_implementation  # noqa: F401
from hpc_rlhf.models.quantization import bnb_4bit_load_kwargs, keep_cpu_numerics_exact, warn_unquantized_weights
from hpc_rlhf.models.value_head import check_value_head
from hpc_rlhf.models.vision import freeze_vision_tower as freeze_tower
from hpc_rlhf.models.vision import is_vision_language, vision_value_class


def require_local_model(path: str | None, key: str) -> None:
    """Fail naming ``key`` unless ``path`` is an existing local folder. transformers would take a missing path
    for a Hugging Face Hub repo id and fail with "Repo id must be in the form ...", which names neither."""
    if path is None:
        raise ValueError(f"{key} is not set: give a local HF model folder")
    if not os.path.isdir(path):
        state = "is a file, not a folder" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"{key}={path}: the local path {state} (relative paths count from "
                                f"{os.getcwd()}); give a local Hugging Face model folder (config.json, weights, "
                                "tokenizer)")


def import_model_code(*paths: str | None) -> None:
    """Import the transformers modeling module of each local model folder in ``paths`` (None: skipped) now.

    Call it before the first ``deepspeed.zero.Init`` that builds one of them. A module first imported inside
    zero.Init has its ``nn.Module`` classes hooked as they are created, before a class decorator runs, and the
    hook puts that pre-decorator ``__init__`` back when the context exits: transformers' experts decorator
    (``use_experts_implementation``, on every MoE experts class) is lost, so the next model built in the process
    (a DPO reference after the policy) has experts without ``config`` and its first forward fails with
    "'Qwen3MoeExperts' object has no attribute 'config'" (DeepSpeed 0.19, transformers 5).
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    for path in paths:
        if path is None:
            continue
        config_class = type(AutoConfig.from_pretrained(path))
        for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING):
            if config_class in mapping:
                mapping[config_class]  # the lookup imports the class's module (transformers loads them lazily)


def load_tokenizer(path: str | None, key: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the local HF folder ``path`` (config key ``key``); pad token = EOS when it has none."""
    require_local_model(path, key)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_same_tokenizer(student: PreTrainedTokenizerBase, student_key: str, teacher_path: str,
                         teacher_key: str) -> None:
    """Refuse a teacher whose tokenizer maps any token differently from the student's.

    The teacher scores the student's token ids as they are, so the two vocabularies (and the special tokens
    that end a turn) must agree id for id; distilling across tokenizers would need the sequences re-tokenized
    and the scores aligned between two tokenizations, which this does not do. The error names both folders
    and the first difference."""
    teacher = load_tokenizer(teacher_path, teacher_key)
    where = f"{teacher_key}={teacher_path} and {student_key}={student.name_or_path}"
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        diff = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda kv: kv[1])[0]
        raise ValueError(f"the tokenizers of {where} differ ({len(teacher_vocab)} vs {len(student_vocab)} tokens; "
                         f"first difference: token {diff[0]!r} -> id {diff[1]} in only one of them): on-policy "
                         "distillation scores the student's token ids with the teacher, so both must use the same "
                         "tokenizer (a teacher of the same model family)")
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            raise ValueError(f"the tokenizers of {where} have different {name} ({getattr(teacher, name)} vs "
                             f"{getattr(student, name)}): use a teacher with the student's tokenizer")


def _from_pretrained(auto_class, path: str, dtype: torch.dtype, attn_implementation: str, use_liger_kernel: bool,
                     load_in_4bit: bool, **kwargs) -> PreTrainedModel:
    """``auto_class.from_pretrained`` with the options every role shares: QLoRA's 4-bit base, Liger kernels."""
    if load_in_4bit:
        kwargs.update(bnb_4bit_load_kwargs(dtype, on_gpu=torch.cuda.is_available()))
    model = auto_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **kwargs)
    if load_in_4bit:
        keep_cpu_numerics_exact(model)
        warn_unquantized_weights(model)
    if use_liger_kernel:
        apply_liger_kernel(model)
    return model


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa",
                   use_liger_kernel: bool = False, load_in_4bit: bool = False,
                   freeze_vision_tower: bool = False) -> PreTrainedModel:
    """An actor / reference policy. ``use_liger_kernel``: Liger's kernels when they can run (``kernels``).
    ``load_in_4bit``: NF4 base weights for QLoRA (``hpc_rlhf.models.quantization``). A vision-language model
    (``hpc_rlhf.models.vision``) loads as ``AutoModelForImageTextToText``; ``freeze_vision_tower`` then stops
    gradients into its vision encoder (``actor.freeze_vision_tower``)."""
    if not is_vision_language(AutoConfig.from_pretrained(path)):
        return _from_pretrained(AutoModelForCausalLM, path, dtype, attn_implementation, use_liger_kernel,
                                load_in_4bit)
    from transformers import AutoModelForImageTextToText

    model = _from_pretrained(AutoModelForImageTextToText, path, dtype, attn_implementation, use_liger_kernel,
                             load_in_4bit)
    if freeze_vision_tower:
        freeze_tower(model)
    return model


def load_value_model(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa",
                     use_liger_kernel: bool = False, load_in_4bit: bool = False, value_head_prefix: str = "score",
                     require_head: bool = False, key: str = "value_head_prefix") -> PreTrainedModel:
    """A critic or reward model: base transformer + linear ``score`` head with one output (kept in full
    precision under ``load_in_4bit``: bitsandbytes skips the modules transformers marks as heads).

    ``value_head_prefix``: the head's name in the checkpoint, loaded into ``score`` (renamed while the
    weights load, so it works under ZeRO-3's partitioned init too). A name other than ``score`` must exist
    in the checkpoint, and so must ``score`` with ``require_head``; otherwise a missing ``score`` head starts
    fresh, as a critic initialised from a causal LM needs. ``key``: the option named in errors. A vision-language
    checkpoint (``hpc_rlhf.models.vision``) loads as its multimodal model with a ``score`` head
    (:func:`hpc_rlhf.models.vision.vision_value_class`), whose forward takes the rows' images.
    """
    kwargs = {}
    if value_head_prefix != "score" or require_head:
        check_value_head(path, value_head_prefix, key)
    if value_head_prefix != "score":
        kwargs["key_mapping"] = {rf"^{re.escape(value_head_prefix)}\.": "score."}
    config = AutoConfig.from_pretrained(path)
    if is_vision_language(config):
        # the VLM's multimodal model with a ``score`` head (transformers has no sequence classifier for Qwen-VL)
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        value_class = vision_value_class(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)])
        return _from_pretrained(value_class, path, dtype, attn_implementation, use_liger_kernel, load_in_4bit,
                                **kwargs)
    model = _from_pretrained(AutoModelForSequenceClassification, path, dtype, attn_implementation, use_liger_kernel,
                             load_in_4bit, num_labels=1, **kwargs)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model
