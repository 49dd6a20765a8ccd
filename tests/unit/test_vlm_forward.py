"""Vision-language forwards on a tiny Qwen2.5-VL / Qwen3-VL: M-RoPE positions, padded == packed == the model's own
forward (log-probs and gradients), image tokens never scored, and the frozen vision tower."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from hpc_rlhf.models.forward import policy_logprobs
from hpc_rlhf.models.mrope import mrope_positions
from hpc_rlhf.models.tiny_vlm import IMAGE_PAD, build_tiny_vlm
from hpc_rlhf.models.vision import flat_images, freeze_vision_tower, visual_row_fields
from hpc_rlhf.rollout.visual import PromptVisual


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def tiny(request, tmp_path_factory):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / request.param, request.param, initializer_range=0.1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)


def _visual(model, processor, colour, size) -> PromptVisual:
    out = processor(images=[Image.new("RGB", size, colour)], return_tensors="pt")
    return PromptVisual(out["pixel_values"].float(), out["image_grid_thw"], model.config.image_token_id,
                        model.config.vision_config.spatial_merge_size)


def _rows(model, tok, processor):
    """Three left-padded prompts (two with an image of different sizes, one text only) + right-padded responses."""
    visuals = [_visual(model, processor, (255, 0, 0), (56, 56)), None, _visual(model, processor, (0, 0, 255), (90, 40))]
    prompts, responses = [], [[30, 31, 2], [40, 41, 42, 43], [50]]
    for v in visuals:
        image = "<|vision_start|>" + IMAGE_PAD * v.num_image_tokens() + "<|vision_end|>" if v else ""
        text = "Q: " + image + "hi?\nA: "
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    p, r = max(map(len, prompts)), max(map(len, responses))
    seq = torch.zeros(3, p + r, dtype=torch.long)
    mask = torch.zeros_like(seq)
    for i, (a, b) in enumerate(zip(prompts, responses, strict=True)):
        seq[i, p - len(a):p], seq[i, p:p + len(b)] = torch.tensor(a), torch.tensor(b)
        mask[i, p - len(a):p + len(b)] = 1
    return seq, mask, r, visuals, visual_row_fields(visuals, seq, mask)


def test_mrope_matches_the_models_get_rope_index(tiny):
    model, tok, processor = tiny
    seq, mask, _, visuals, fields = _rows(model, tok, processor)
    for b in (0, 2):
        real = seq[b][mask[b].bool()]
        theirs, _ = model.model.get_rope_index(real[None], mm_token_type_ids=(real == model.config.image_token_id)[None]
                                               .int(), image_grid_thw=visuals[b].image_grid_thw)
        assert torch.equal(mrope_positions(real, visuals[b].image_grid_thw, model.config.image_token_id, 2),
                           theirs[:, 0].T)
        assert torch.equal(fields["mrope_position_ids"][b][mask[b].bool()], theirs[:, 0].T)


def row_inputs(seq, mask, visuals, b, image_token_id):
    """Row ``b`` alone, unpadded, as the multimodal model's own forward takes it: ((1, T) ids, its image inputs)."""
    ids = seq[b][mask[b].bool()][None]
    if visuals[b] is None:
        return ids, {}
    return ids, {"pixel_values": visuals[b].pixel_values, "image_grid_thw": visuals[b].image_grid_thw,
                 "mm_token_type_ids": (ids == image_token_id).int()}


def _reference(model, seq, mask, num_actions, visuals):
    """Each row alone through the model's own forward (its own M-RoPE): (B, R) log-probs of the response."""
    out = torch.zeros(seq.shape[0], num_actions)
    for b in range(seq.shape[0]):
        ids, extra = row_inputs(seq, mask, visuals, b, model.config.image_token_id)
        logits = model(input_ids=ids, **extra).logits[0].log_softmax(-1)
        resp = int(mask[b, -num_actions:].sum())
        targets = ids[0, -resp:]
        out[b, :resp] = logits[-resp - 1:-1].gather(1, targets[:, None]).squeeze(1)
    return out


def test_padded_and_packed_logprobs_and_gradients_agree_with_the_model(tiny):
    model, tok, processor = tiny
    seq, mask, r, visuals, fields = _rows(model, tok, processor)
    with torch.no_grad():
        ref = _reference(model, seq, mask, r, visuals)
    grads = {}
    for packed in (False, True):
        model.zero_grad()
        lp, ent = policy_logprobs(model, seq, mask, r, packed=packed, with_entropy=True, visual=fields)
        torch.testing.assert_close(lp.detach(), ref, atol=1e-5, rtol=1e-5)
        assert ent is not None and bool((ent[mask[:, -r:].bool()] > 0).all())
        lp.sum().backward()
        grads[packed] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.visual.blocks") for n in grads[True]), "the vision tower gets gradients"
    assert grads[False].keys() == grads[True].keys()
    for name in grads[False]:
        torch.testing.assert_close(grads[False][name], grads[True][name], atol=1e-5, rtol=1e-4, msg=name)


def _feedback_image_rows(model, tok, processor):
    """Two trajectories as a multi-turn agent leaves them: row 0's prompt holds an image and its response a second
    one (a screenshot in the environment's feedback, ``action_mask`` 0) between generated tokens; row 1 is text."""
    from hpc_rlhf.rollout.base import Trajectory

    out = processor(images=[Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (56, 84), (0, 255, 0))],
                    return_tensors="pt")
    visual = PromptVisual(out["pixel_values"].float(), out["image_grid_thw"], model.config.image_token_id,
                          model.config.vision_config.spatial_merge_size)
    first, second = (int(g.prod()) // visual.spatial_merge_size ** 2 for g in visual.image_grid_thw)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = ids("Q: <|vision_start|>" + IMAGE_PAD * first + "<|vision_end|>hi?\nA: ")
    feedback = ids("\nsee: <|vision_start|>" + IMAGE_PAD * second + "<|vision_end|>\nA: ")
    response = [30] + feedback + [31, 2]
    mask = [1] + [0] * len(feedback) + [1, 1]
    rows = [Trajectory("q0", None, prompt, response, mask, [-1.0] * len(response), reward=1.0, visual=visual),
            Trajectory("q1", None, ids("Q: hi?\nA: "), [40, 41], [1, 1], [-1.0, -1.0], reward=0.0)]
    return rows, second


def test_image_tokens_never_enter_the_loss(tiny):
    """A response that holds image tokens (a feedback screenshot, as multi-turn agents append it): the step batch
    masks them, and the policy loss has exactly zero gradient through their columns, while every generated token
    has some. Checked on a loss over the real step batch and the model's log-probs, so a mask that let feedback
    (image) tokens in would fail here."""
    from hpc_rlhf.algos.aggregation import aggregate_loss
    from hpc_rlhf.algos.losses import policy_loss
    from hpc_rlhf.trainers.rl.step_batch import StepBatch

    model, tok, processor = tiny
    image_id = model.config.image_token_id
    rows, num_feedback_image_tokens = _feedback_image_rows(model, tok, processor)
    batch = StepBatch.from_trajectories(rows, tok.pad_token_id)
    r = batch.action_mask.shape[1]
    responses = batch.sequences[:, -r:]
    image_columns = responses == image_id
    assert int(image_columns.sum()) == num_feedback_image_tokens > 0  # the response really holds image tokens
    fields = {k: v for k, v in batch.forward_inputs().items()
              if k in ("pixel_values", "image_grid_thw", "mrope_position_ids")}
    logprobs, _ = policy_logprobs(model, batch.sequences, batch.attention_mask, r, visual=fields)
    logprobs.retain_grad()
    advantages = torch.ones_like(logprobs)
    per_token, _ = policy_loss(logprobs, logprobs.detach(), advantages, batch.action_mask)
    aggregate_loss(per_token, batch.action_mask, "token_mean",
                   global_num_tokens=int(batch.action_mask.sum())).backward()
    grad = logprobs.grad
    assert grad is not None
    assert bool((grad[image_columns] == 0).all()), "an image token of the response entered the loss"
    assert bool((grad[batch.action_mask] != 0).all()), "every generated token is trained"
    assert not bool(batch.action_mask[image_columns].any())


def test_flat_images_orders_rows(tiny):
    model, tok, processor = tiny
    _, _, _, visuals, fields = _rows(model, tok, processor)
    pixels, grid = flat_images(fields["pixel_values"], fields["image_grid_thw"], [2, 1, 0])
    assert torch.equal(grid, torch.cat([visuals[2].image_grid_thw, visuals[0].image_grid_thw]))
    assert torch.equal(pixels, torch.cat([visuals[2].pixel_values, visuals[0].pixel_values]))


def test_freeze_vision_tower_keeps_the_projector_trainable(tiny):
    model, _, _ = tiny
    frozen = freeze_vision_tower(model)
    try:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert frozen > 0
        assert not any(n.startswith("model.visual.blocks") or n.startswith("model.visual.patch_embed")
                       for n in trainable)
        assert any(n.startswith("model.visual.merger") for n in trainable)
        assert any(n.startswith("model.language_model") for n in trainable)
    finally:
        for p in model.parameters():
            p.requires_grad_(True)


def test_lora_adapts_the_language_model_only(tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from hpc_rlhf.config.schema import LoraConfig
    from hpc_rlhf.models.lora import apply_lora

    path = build_tiny_vlm(tmp_path / "m", "qwen2_5_vl", initializer_range=0.1)
    model = apply_lora(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32),
                       LoraConfig(rank=4, alpha=8))
    adapted = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert adapted and all(n.startswith("model.language_model.") for n in adapted)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapted
    tok, processor = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    seq, mask, r, _, fields = _rows(model, tok, processor)
    lp, _ = policy_logprobs(model, seq, mask, r, packed=True, visual=fields)
    lp.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)
