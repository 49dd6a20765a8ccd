"""QLoRA on a GPU: bitsandbytes' CUDA NF4 kernels. The 4-bit base is quantised onto this process's GPU at load,
one LoRA step trains, and the merged plain weights (what the rollout engine receives) reproduce the quantised
model's outputs. Needs CUDA and bitsandbytes."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.models.loading import load_causal_lm
from hpc_rlhf.models.quantization import is_quantized
from hpc_rlhf.models.tiny import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bitsandbytes' NF4 CUDA kernels)"),
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("gpu_qlora") / "tiny", seed=0))


def test_qlora_on_gpu_trains_and_merges_to_the_quantised_policy(tiny_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'hpc-rlhf[gpu]')")
    pytest.importorskip("peft")
    from hpc_rlhf.models.lora import apply_lora, merged_named_tensors

    model = apply_lora(load_causal_lm(tiny_path, torch.bfloat16, load_in_4bit=True),
                       LoraConfig(rank=8, alpha=16, load_in_4bit=True))
    q = model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert is_quantized(q) and q.device.type == "cuda"
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(4, 60, (4, 32), device="cuda")
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    assert any(float(p.abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)

    plain = load_causal_lm(tiny_path, torch.bfloat16).cuda()
    plain.load_state_dict(dict(merged_named_tensors(model)), strict=True)
    model.eval(), plain.eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        got = torch.log_softmax(plain(input_ids=ids).logits.float(), -1)
    # bf16 matmuls in a different order (dequantise-then-matmul vs. bitsandbytes' fused kernel)
    torch.testing.assert_close(got, expected, rtol=0.0, atol=5e-2)
