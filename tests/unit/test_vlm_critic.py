"""A critic on rows with images: the value model built from a tiny Qwen2.5-VL / Qwen3-VL (its multimodal model and a
``score`` head), padded == packed == the model's own per-row forward (values and gradients), values that read the
pixels, and a save / load round trip."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.models.loading import load_causal_lm, load_value_model
from hpc_rlhf.models.micro_forward import forward_scope
from hpc_rlhf.models.tiny_vlm import build_tiny_vlm
from tests.unit.test_vlm_forward import _rows, row_inputs


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def tiny(request, tmp_path_factory):
    from transformers import AutoImageProcessor, AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / request.param, request.param, initializer_range=0.1)
    critic = load_value_model(str(path), torch.float32, "sdpa")
    with torch.no_grad():  # a fresh head is drawn small; make the values differ clearly between inputs
        critic.score.weight.normal_(std=1.0)
    return path, critic, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)


def _reference(critic, seq, mask, num_actions, visuals):
    """Each row alone through the multimodal model's own forward (its own M-RoPE): (B, R) values, 0 on padding."""
    out = torch.zeros(seq.shape[0], num_actions)
    for b in range(seq.shape[0]):
        ids, extra = row_inputs(seq, mask, visuals, b, critic.config.image_token_id)
        hidden = critic.model(input_ids=ids, **extra).last_hidden_state[0]
        resp = int(mask[b, -num_actions:].sum())
        out[b, :resp] = critic.score(hidden[-resp - 1:-1]).squeeze(-1)
    return out


def test_value_model_is_the_vlm_with_a_score_head(tiny):
    path, critic, _, _ = tiny
    actor = load_causal_lm(str(path), torch.float32, "sdpa")
    assert critic.get_output_embeddings() is None and not hasattr(critic, "lm_head")
    assert critic.score.weight.shape == (1, critic.config.text_config.hidden_size)
    actor_weights = dict(actor.model.named_parameters())
    for name, param in critic.model.named_parameters():  # vision tower, projector and language model all loaded
        torch.testing.assert_close(param, actor_weights[name], rtol=0, atol=0, msg=name)


def test_padded_and_packed_values_and_gradients_agree_with_the_model(tiny):
    _, critic, tok, processor = tiny
    seq, mask, r, visuals, fields = _rows(critic, tok, processor)
    with torch.no_grad():
        ref = _reference(critic, seq, mask, r, visuals)
    rows = {"sequences": seq, "attention_mask": mask, "action_mask": mask[:, -r:], **fields}
    grads = {}
    for packed in (False, True):
        critic.zero_grad()
        with forward_scope(critic, rows, packed=packed) as fwd:
            values = fwd.critic_values()
        torch.testing.assert_close(values.detach(), ref, atol=1e-5, rtol=1e-5)
        (values * mask[:, -r:]).sum().backward()
        grads[packed] = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.visual.blocks") for n in grads[True]), "the vision tower gets gradients"
    assert "score.weight" in grads[True]
    assert grads[False].keys() == grads[True].keys()
    for name in grads[False]:
        scale = max(float(grads[False][name].abs().max()), 1.0)  # fp32 summation order differs: relative to the max
        torch.testing.assert_close(grads[False][name], grads[True][name], atol=1e-5 * scale, rtol=1e-4, msg=name)


def test_values_read_the_pixels(tiny):
    _, critic, tok, processor = tiny
    seq, mask, r, _, fields = _rows(critic, tok, processor)
    blank = dict(fields, pixel_values=torch.zeros_like(fields["pixel_values"]))
    with torch.no_grad():
        seen = {}
        for name, visual in (("images", fields), ("zeroed", blank)):
            rows = {"sequences": seq, "attention_mask": mask, "action_mask": mask[:, -r:], **visual}
            with forward_scope(critic, rows) as fwd:
                seen[name] = fwd.critic_values()
    real = mask[:, -r:].bool()
    assert (seen["images"][0] - seen["zeroed"][0])[real[0]].abs().max() > 1e-3  # row 0 has an image
    torch.testing.assert_close(seen["images"][1], seen["zeroed"][1])  # row 1 is text only


def test_saved_critic_loads_back_with_its_head(tiny, tmp_path):
    _, critic, _, _ = tiny
    critic.save_pretrained(tmp_path / "critic")
    again = load_value_model(str(tmp_path / "critic"), torch.float32, "sdpa", require_head=True)
    torch.testing.assert_close(again.score.weight, critic.score.weight, rtol=0, atol=0)


def test_lora_critic_adapts_the_language_model_and_trains_the_head(tiny):
    from hpc_rlhf.config.schema import LoraConfig
    from hpc_rlhf.models.lora import apply_lora

    path, _, tok, processor = tiny
    critic = apply_lora(load_value_model(str(path), torch.float32, "sdpa"), LoraConfig(rank=4, alpha=8))
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    adapted = {n for n in trainable if "lora_" in n}
    assert adapted and all(n.startswith("model.language_model.") for n in adapted)
    assert trainable - adapted and all("score" in n for n in trainable - adapted), sorted(trainable - adapted)
    seq, mask, r, _, fields = _rows(critic, tok, processor)
    rows = {"sequences": seq, "attention_mask": mask, "action_mask": mask[:, -r:], **fields}
    with forward_scope(critic, rows, packed=True) as fwd:
        fwd.critic_values().sum().backward()
    assert all(p.grad is not None for n, p in critic.named_parameters()
               if "lora_B" in n or ("score" in n and p.requires_grad))


def test_text_only_critic_reference_or_teacher_beside_a_vlm_actor_is_refused(tmp_path):
    import json

    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.setup import SetupError, check_vision_language

    for name, config in (("vlm", {"model_type": "qwen2_5_vl", "vision_config": {"depth": 1}, "image_token_id": 3}),
                         ("text", {"model_type": "llama"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    vlm, text = tmp_path / "vlm", tmp_path / "text"
    base = [f"actor.pretrain={vlm}", "algo.advantage_estimator=gae", "rollout.n_samples_per_prompt=1"]
    check_vision_language(load_config(None, base), on_gpu=False)  # the critic starts from the actor
    check_vision_language(load_config(None, [*base, f"critic.pretrain={vlm}", f"teacher.pretrain={vlm}",
                                             "algo.kl.init_coef=0.01", f"ref.pretrain={vlm}"]), on_gpu=False)
    for key in ("critic.pretrain", "ref.pretrain", "teacher.pretrain"):
        with pytest.raises(SetupError, match=rf"{key}=.*text.* is a text-only model but actor.pretrain"):
            check_vision_language(load_config(None, [*base, "algo.kl.init_coef=0.01", f"{key}={text}"]),
                                  on_gpu=False)
