"""Typed access to the transformers model behind an engine wrapper (hpc_rlhf.models.hf_module)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from hpc_rlhf.models.hf_module import base_model, child_module, hf_model


class _Engine:
    """What the training engines look like to the forwards: the model in ``module``, called like it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _value_model() -> LlamaForSequenceClassification:
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    return LlamaForSequenceClassification(config)


def test_an_engine_is_unwrapped_and_a_model_is_its_own_model():
    model = _value_model()
    assert hf_model(model) is model
    assert hf_model(_Engine(model)) is model
    assert base_model(_Engine(model)) is model.model  # base_model_prefix "model": the decoder without the head


def test_child_module_names_what_is_missing_or_not_a_module():
    model = _value_model()
    assert child_module(model, "score") is model.score
    model.register_buffer("scale", torch.ones(1))
    with pytest.raises(TypeError, match="no child module 'scale' \\(found Tensor\\)"):
        child_module(model, "scale")
    with pytest.raises(TypeError, match="LlamaForSequenceClassification has no child module 'value_head'"):
        child_module(model, "value_head")
