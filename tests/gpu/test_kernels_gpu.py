"""Real flash-attn / Liger kernels on a GPU: selected when installed, and the model's outputs match SDPA /
plain modules. Needs CUDA; each kernel package is skipped with a reason when it is not installed."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.models import kernels
from hpc_rlhf.models.loading import load_causal_lm, load_value_model
from hpc_rlhf.models.tiny import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash-attn / Liger Triton kernels)"),
]

# bf16 kernels vs. SDPA / eager PyTorch ops on a tiny model.
TOL = {"rtol": 0.0, "atol": 5e-2}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("gpu_kernels") / "tiny", seed=0))


def _logprobs(model, ids):
    return torch.log_softmax(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float(), -1)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_selected_and_matches_sdpa(tiny_path, implementation):
    reason = kernels.flash_unavailable_reason(implementation, on_gpu=True)
    if reason is not None:
        pytest.skip(f"{implementation}: {reason}")
    assert kernels.resolve_attn_implementation(implementation, on_gpu=True) == implementation
    if implementation == "flash_attention_2":
        assert kernels.resolve_attn_implementation("auto", on_gpu=True) == implementation
    ids = torch.randint(4, 60, (2, 48), device="cuda")
    flash = load_causal_lm(tiny_path, torch.bfloat16, implementation).cuda().eval()
    sdpa = load_causal_lm(tiny_path, torch.bfloat16, "sdpa").cuda().eval()
    assert flash.config._attn_implementation == implementation
    with torch.no_grad():
        torch.testing.assert_close(_logprobs(flash, ids), _logprobs(sdpa, ids), **TOL)


def test_liger_kernels_applied_and_match_plain_modules(tiny_path):
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install 'hpc-rlhf[gpu]')")
    ids = torch.randint(4, 60, (2, 48), device="cuda")
    plain = load_causal_lm(tiny_path, torch.bfloat16, "sdpa").cuda()
    liger = load_causal_lm(tiny_path, torch.bfloat16, "sdpa", use_liger_kernel=True).cuda()
    critic = load_value_model(tiny_path, torch.bfloat16, "sdpa", use_liger_kernel=True).cuda()
    # Instance patching rebinds forward on the module objects.
    assert "forward" in vars(liger.model.norm) and "forward" in vars(liger.model.layers[0].mlp)
    assert "forward" in vars(critic.model.norm)
    with torch.no_grad():
        torch.testing.assert_close(_logprobs(liger, ids), _logprobs(plain, ids), **TOL)
        assert critic(input_ids=ids).logits.shape == (2, 1)
    # Gradients flow through the Triton kernels.
    liger.train()
    _logprobs(liger, ids)[..., 5].mean().backward()
    assert all(p.grad is not None for p in liger.parameters() if p.requires_grad)


def test_chunked_logprobs_on_cuda_match_the_plain_head_with_less_memory():
    """``linear_logprobs`` (the vocabulary chunked) against ``log_softmax(hidden @ W.T)`` in bf16 on CUDA: equal
    log-probs and gradients, and a lower peak of device memory for forward + backward (the (N, V) logits are
    never whole). The numbers land in ``$HPC_RLHF_ACCEPTANCE_DIR/chunked_logprobs.json``."""
    import json
    import os
    from pathlib import Path

    from hpc_rlhf.models.chunked_logprobs import linear_logprobs

    num_tokens, hidden_size, vocab = 8192, 1024, 151936  # a Qwen2.5-sized vocabulary
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden0 = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight0 = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)

    def run(chunked: bool):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if chunked:
            logprobs, _ = linear_logprobs(hidden, weight, targets)
        else:
            logprobs = torch.log_softmax((hidden @ weight.T).float(), -1).gather(1, targets[:, None]).squeeze(1)
        logprobs.sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return logprobs.detach(), hidden.grad, weight.grad, peak

    plain_lp, plain_gh, plain_gw, plain_peak = run(False)
    chunk_lp, chunk_gh, chunk_gw, chunk_peak = run(True)
    report = {"num_tokens": num_tokens, "vocab": vocab, "hidden": hidden_size,
              "plain_peak_gib": plain_peak / 2**30, "chunked_peak_gib": chunk_peak / 2**30,
              "max_abs_logprob_diff": float((chunk_lp - plain_lp).abs().max())}
    out = Path(os.environ.get("HPC_RLHF_ACCEPTANCE_DIR") or "runs/acceptance")
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunked_logprobs.json").write_text(json.dumps(report, indent=1))
    print(f"\n[chunked log-probs] {report}")
    torch.testing.assert_close(chunk_lp, plain_lp, rtol=0.0, atol=5e-2)
    torch.testing.assert_close(chunk_gh.float(), plain_gh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(chunk_gw.float(), plain_gw.float(), rtol=2e-2, atol=2e-2)
    assert chunk_peak < plain_peak / 2, report
