"""plan sizes mixture-of-experts models: memory from the total parameters, FLOPs from the active ones, and
refuses AutoTP for them (DeepSpeed 0.19.8 cannot shard the experts of transformers' MoE models)."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.cli.plan import plan
from hpc_rlhf.planning.model_shape import ModelShape, ModelSizeError, check_moe_tensor_parallel
from hpc_rlhf.planning.step_time import forward_flops

# Public config.json values (the keys that sizing reads).
QWEN3_30B_A3B = {"hidden_size": 2048, "num_hidden_layers": 48, "intermediate_size": 6144, "vocab_size": 151936,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False, "model_type": "qwen3_moe"}
MIXTRAL_8X7B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 32000,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "tie_word_embeddings": False, "model_type": "mixtral"}


@pytest.mark.parametrize("cfg,total_b,active_b", [(QWEN3_30B_A3B, 30.5, 3.3), (MIXTRAL_8X7B, 46.7, 12.9)])
def test_total_and_active_parameters_match_the_published_sizes(cfg, total_b, active_b):
    shape = ModelShape.from_hf_config(cfg)
    assert shape.is_moe
    assert shape.num_params / 1e9 == pytest.approx(total_b, rel=0.01)
    assert shape.active_params / 1e9 == pytest.approx(active_b, rel=0.02)
    assert "total" in shape.describe() and "active" in shape.describe()


def test_flops_count_active_parameters_and_dense_layers_stay_dense():
    shape = ModelShape.from_hf_config(MIXTRAL_8X7B)
    body_active = shape.active_params - shape.embedding_params
    assert forward_flops(shape, shape.num_params, tokens=10, logit_tokens=0) == pytest.approx(2 * body_active * 10)
    # Qwen3-MoE's mlp_only_layers are dense MLPs intermediate_size wide.
    two_dense = ModelShape.from_hf_config({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]})
    assert two_dense.num_sparse_layers == 46
    dense = ModelShape.from_hf_config({k: v for k, v in MIXTRAL_8X7B.items() if "expert" not in k})
    assert not dense.is_moe and dense.active_params == dense.num_params and dense.active_fraction == 1.0


def test_autotp_is_refused_for_moe_naming_the_key():
    check_moe_tensor_parallel(MIXTRAL_8X7B, 1, "actor.pretrain")
    check_moe_tensor_parallel({**MIXTRAL_8X7B, "num_local_experts": 0}, 4, "actor.pretrain")
    with pytest.raises(ModelSizeError, match="ds.tensor_parallel_size=2 with a mixture-of-experts model "
                                             r"\(actor.pretrain\)"):
        check_moe_tensor_parallel(QWEN3_30B_A3B, 2, "actor.pretrain")


def test_deepspeed_autotp_rejects_the_moe_tp_plans(tmp_path):
    """Why AutoTP is refused: DeepSpeed 0.19.8 turns the HF tp_plan into layer specs and rejects the MoE
    styles of Qwen3-MoE and Mixtral (should a later DeepSpeed accept them, this fails and the refusal can go)."""
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.tiny import build_tiny_moe_model

    for family in ("qwen3_moe", "mixtral"):
        model = AutoModelForCausalLM.from_pretrained(build_tiny_moe_model(tmp_path / family, family=family))
        with pytest.raises(ValueError, match="moe_tp_experts"):
            TPPlanConverter.convert(_get_hf_tp_plan(model))


def test_plan_prints_total_and_active_and_refuses_tp(tmp_path, capsys):
    model = tmp_path / "qwen3-30b-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    common = ["--config", "configs/grpo_qwen2.5_7b.yaml", "--nodes", "1", "--gpus-per-node", "8",
              f"actor.pretrain={model}", "actor.num_params_b=null"]
    code = plan([*common, "ds.tensor_parallel_size=1"])
    out = capsys.readouterr().out
    assert "MoE 128 experts (top-8" in out and "30.53B total / 3.35B active" in out, (code, out)
    assert plan([*common, "ds.tensor_parallel_size=2"]) == 1
    assert "ds.tensor_parallel_size=2 with a mixture-of-experts model (actor.pretrain)" in capsys.readouterr().err
