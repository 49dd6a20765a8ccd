"""The transformers rollout engine with images: batched prompts with and without images, n samples sharing a
prompt's prefill, no image placeholder ever sampled, and the engine's log-probs equal to the trainer's forward of
the same rows after a weight sync that changes every weight, the vision tower's included."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from PIL import Image

from hpc_rlhf.agents.executor import SingleTurnExecutor
from hpc_rlhf.data.prompts import PromptDataset
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.forward import policy_logprobs
from hpc_rlhf.models.tiny_vlm import build_tiny_vlm
from hpc_rlhf.rollout.base import SamplingParams
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine
from hpc_rlhf.trainers.rl.step_batch import StepBatch


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def setup(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    root = tmp_path_factory.mktemp("vlm_rollout")
    path = build_tiny_vlm(root / request.param, request.param, initializer_range=0.1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    Image.new("RGB", (56, 56), (255, 0, 0)).save(root / "red.png")
    Image.new("RGB", (80, 40), (0, 0, 255)).save(root / "blue.png")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "red.png"}},
                                                       {"type": "text", "text": "colour?"}]}]},
            {"messages": "plain text?"},
            {"messages": "which?", "images": ["blue.png", "red.png"]}]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = list(PromptDataset([str(data)], input_key="messages", apply_chat_template=True, tokenizer=tok))
    executor = SingleTurnExecutor(tok, 256)
    executor.vision = VisionPromptEncoder.from_pretrained(str(path), tok, model.config)
    return model, tok, prompts, executor


def _trajectories(model, tok, prompts, executor, seed=0):
    engine = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, seed=seed)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=seed)
    return engine, executor.run(prompts, engine.generate, params, n_samples_per_prompt=3)


def test_generates_with_images_and_samples_share_the_prompt(setup):
    model, tok, prompts, executor = setup
    assert [len(p.images) for p in prompts] == [1, 0, 2]
    _, trajectories = _trajectories(model, tok, prompts, executor)
    assert len(trajectories) == 9
    image_id = model.config.image_token_id
    for i, t in enumerate(trajectories):
        group = i // 3
        assert (t.visual is None) == (group == 1)
        if t.visual is not None:
            assert t.visual is trajectories[group * 3].visual  # one encoding per prompt
            assert t.prompt_ids.count(image_id) == t.visual.num_image_tokens()
        banned = {model.config.image_token_id, model.config.video_token_id, model.config.vision_start_token_id,
                  model.config.vision_end_token_id}
        assert not banned & set(t.response_ids)


def test_engine_and_trainer_logprobs_agree_after_a_weight_sync(setup):
    model, tok, prompts, executor = setup
    trained = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():  # an "update" that moves every weight, the vision tower's too
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine_model = copy.deepcopy(model)
    engine = TransformersRolloutEngine(engine_model, tok.eos_token_id, tok.pad_token_id, seed=0)
    engine.update_weights(trained.state_dict().items())
    assert any(n.startswith("model.visual") for n in trained.state_dict())
    params = SamplingParams(max_new_tokens=6, temperature=0.9, stop_token_ids=[tok.eos_token_id], seed=3)
    trajectories = executor.run(prompts, engine.generate, params, n_samples_per_prompt=2)
    for t in trajectories:
        t.reward = 0.0
    batch = StepBatch.from_trajectories(trajectories, tok.pad_token_id)
    assert batch.pixel_values is not None and batch.mrope_position_ids is not None
    visual = {k: v for k, v in batch.forward_inputs().items() if k in ("pixel_values", "image_grid_thw",
                                                                        "mrope_position_ids")}
    with torch.no_grad():
        for packed in (False, True):
            logprobs, _ = policy_logprobs(trained, batch.sequences, batch.attention_mask, batch.action_mask.shape[1],
                                          temperature=0.9, packed=packed, visual=visual)
            mask = batch.action_mask
            torch.testing.assert_close(logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=1e-4)
        stale, _ = policy_logprobs(model, batch.sequences, batch.attention_mask, batch.action_mask.shape[1],
                                   temperature=0.9, visual=visual)
    assert (stale[batch.action_mask] - batch.rollout_logprobs[batch.action_mask]).abs().max() > 1e-3


def test_step_batch_rows_keep_their_images(setup):
    model, tok, prompts, executor = setup
    _, trajectories = _trajectories(model, tok, prompts, executor, seed=5)
    for t in trajectories:
        t.reward = 1.0
    batch = StepBatch.from_trajectories(trajectories, tok.pad_token_id)
    parts = batch.take_rows([8, 0]), batch.take_rows([3])
    joined = StepBatch.cat([parts[0], parts[1]])  # row 3 is a text prompt: its image fields are all padding
    assert joined.num_rows == 3
    assert torch.equal(joined.image_grid_thw[0, :2], trajectories[8].visual.image_grid_thw)
    assert int(joined.image_grid_thw[2].abs().sum()) == 0
