"""Multi-turn agents whose feedback holds images (screenshots) on a tiny Qwen2.5-VL: every image of an episode (the
prompt's, then each feedback's) travels with its trajectory in sequence order, image tokens are never actions, the
engine's and the trainer's log-probs of multi-image trajectories agree (padded and packed), and bad images end only
their episode."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from PIL import Image

from hpc_rlhf.agents.images import feedback_tokens, image_placeholder
from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
from hpc_rlhf.data.prompts import Prompt, PromptDataset
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.forward import policy_logprobs
from hpc_rlhf.models.tiny_vlm import build_tiny_vlm
from hpc_rlhf.rollout.base import SamplingParams
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine
from hpc_rlhf.trainers.rl.step_batch import StepBatch

COLOURS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (30, 30, 220), "y": (230, 220, 30)}


def _screenshot(colour: str, side: int = 56) -> Image.Image:
    image = Image.new("RGB", (side, side), (128, 128, 128))
    image.paste(COLOURS[colour], (8, 8, side - 8, side - 8))
    return image


class ScreenshotAgent(AgentInstanceBase):
    """Turn 1 answers anything; the environment shows a screenshot of the label's colour (a PIL image, or a data
    URL / a path on the second turn); turn 3 is judged."""

    async def step(self, states, **kwargs):
        turn = states["observation_text"].count("colour?") + 1
        if turn < 3:
            label = states["label"]
            image = _screenshot(label if turn == 1 else "y", 56 if turn == 1 else 84)
            return {"rewards": 0.0, "done": False, "environment_feedback": "\ncolour?\nA: ",
                    "environment_images": [image]}
        return {"rewards": float(states["action_text"][:1] == states["label"]), "done": True}


class BadImageAgent(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 0.0, "done": False, "environment_feedback": "look",
                "environment_images": ["/nonexistent/screen.png"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    root = tmp_path_factory.mktemp("vlm_agents")
    path = build_tiny_vlm(root / "model", "qwen2_5_vl", initializer_range=0.1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    vision = VisionPromptEncoder.from_pretrained(str(path), tok, model.config, min_pixels=56 * 56, max_pixels=84 * 84)
    _screenshot("b", 80).save(root / "start.png")
    rows = [{"messages": "look", "label": "r"},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "start.png"}},
                                                       {"type": "text", "text": "look"}]}], "label": "g"}]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = list(PromptDataset([str(data)], input_key="messages", label_key="label", apply_chat_template=True,
                                 tokenizer=tok))
    return model, tok, vision, prompts


def _executor(tok, vision, agent_cls=ScreenshotAgent):
    executor = MultiTurnAgentExecutor(agent_cls, tok, 256, max_len=512, max_turns=4)
    executor.vision = vision
    return executor


def test_every_image_of_an_episode_travels_with_its_trajectory(setup):
    model, tok, vision, prompts = setup
    engine = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=0)
    trajectories = _executor(tok, vision).run(prompts, engine.generate, params, n_samples_per_prompt=2)
    assert len(trajectories) == 4 and all(t.failure is None for t in trajectories)
    image_id = model.config.image_token_id
    for i, t in enumerate(trajectories):
        visual = t.visual
        # the prompt's own image (row 1 only), then two screenshots: 56x56 -> 4 tokens, 84x84 -> 9 tokens
        assert visual.num_images == (3 if i >= 2 else 2)
        assert [int(g.prod()) // 4 for g in visual.image_grid_thw[-2:]] == [4, 9]
        ids = t.prompt_ids + t.response_ids
        assert ids.count(image_id) == visual.num_image_tokens()
        assert all(r.startswith("sha256:") for r in visual.refs[-2:])  # a reference, never the pixels
        image_positions = [k for k, token in enumerate(t.response_ids) if token == image_id]
        assert len(image_positions) == 13 and not any(t.action_mask[k] for k in image_positions)
    assert trajectories[2].visual.refs[0].endswith("start.png")
    # the two samples of a prompt saw different screenshots of one colour: same refs, separate visuals
    assert trajectories[0].visual is not trajectories[1].visual


def test_engine_and_trainer_logprobs_agree_on_multi_image_trajectories(setup):
    model, tok, vision, prompts = setup
    trained = copy.deepcopy(model)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine = TransformersRolloutEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=0)
    engine.update_weights(trained.state_dict().items())
    params = SamplingParams(max_new_tokens=4, temperature=0.9, stop_token_ids=[tok.eos_token_id], seed=7)
    trajectories = _executor(tok, vision).run(prompts, engine.generate, params, n_samples_per_prompt=2)
    for t in trajectories:
        t.reward = 0.0
    batch = StepBatch.from_trajectories(trajectories, tok.pad_token_id)
    visual = {k: v for k, v in batch.forward_inputs().items() if k in ("pixel_values", "image_grid_thw",
                                                                        "mrope_position_ids")}
    assert int((batch.image_grid_thw.prod(-1) > 0).sum()) == 10  # 2 + 2 + 3 + 3 images
    mask = batch.action_mask
    with torch.no_grad():
        for packed in (False, True):
            logprobs, _ = policy_logprobs(trained, batch.sequences, batch.attention_mask, mask.shape[1],
                                          temperature=0.9, packed=packed, visual=visual)
            torch.testing.assert_close(logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=1e-4)
        # the feedback images matter: the same rows with the screenshots' pixels zeroed score differently
        blind = dict(visual, pixel_values=torch.zeros_like(visual["pixel_values"]))
        other, _ = policy_logprobs(trained, batch.sequences, batch.attention_mask, mask.shape[1], temperature=0.9,
                                   visual=blind)
    assert (other[mask] - batch.rollout_logprobs[mask]).abs().max() > 1e-3


def test_feedback_placeholders_and_errors(setup):
    _, tok, vision, prompts = setup
    image = _screenshot("r")
    ids, visual = feedback_tokens(vision, tok, "see " + image_placeholder(vision) + " now", [image], prompts[0], None)
    assert ids.count(vision.image_token_id) == 4 and visual.num_images == 1
    text_ids, none = feedback_tokens(vision, tok, "plain", [], prompts[0], None)
    assert none is None and text_ids == list(tok.encode("plain", add_special_tokens=False))
    with pytest.raises(ValueError, match=r"2 image placeholders .* for 1 environment_images"):
        feedback_tokens(vision, tok, vision.image_token * 2, [image], prompts[0], None)
    with pytest.raises(ValueError, match="text-only model"):
        feedback_tokens(None, tok, "x", [image], prompts[0], None)
    with pytest.raises(ValueError, match="remote image"):
        feedback_tokens(vision, tok, "x", ["https://example.com/a.png"], prompts[0], None)


def test_an_unreadable_screenshot_ends_only_its_episode(setup):
    model, tok, vision, _ = setup
    engine = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=0)
    executor = _executor(tok, vision, BadImageAgent)
    trajectories = executor.run([Prompt("Q: look\nA: ", "r", "mem", 0)], engine.generate, params, 1)
    assert trajectories[0].failure is not None and "file not found" in trajectories[0].failure
    assert "/nonexistent/screen.png" in trajectories[0].failure and not any(trajectories[0].action_mask)
