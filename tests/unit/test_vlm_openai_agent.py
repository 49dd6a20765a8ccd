"""Image content parts through the OpenAI-compatible endpoint, on a tiny Qwen2.5-VL: an OpenAI-client agent that sends
base64 screenshots gets one training row per chain of calls holding every image it sent, image tokens masked, the
engine's log-probs equal to the trainer's; remote URLs, files, oversized images and text-only actors are refused."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

openai = pytest.importorskip("openai")

from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint  # noqa: E402
from hpc_rlhf.agents.openai_executor import OpenAIAgentExecutor  # noqa: E402
from hpc_rlhf.agents.openai_recording import CompletionRecord, episode_sequences  # noqa: E402
from hpc_rlhf.agents.openai_requests import EndpointRequestError  # noqa: E402
from hpc_rlhf.data.prompts import Prompt  # noqa: E402
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder  # noqa: E402
from hpc_rlhf.models.forward import policy_logprobs  # noqa: E402
from hpc_rlhf.models.tiny_vlm import build_tiny_vlm  # noqa: E402
from hpc_rlhf.rollout.base import SamplingParams  # noqa: E402
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine  # noqa: E402
from hpc_rlhf.trainers.rl.step_batch import StepBatch  # noqa: E402


def data_url(colour, side=56, fmt="PNG"):
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url, text):
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


async def two_screens(client, prompt, label):
    """Shows a screenshot, reads the answer, shows a second one (a different size) and reads again."""
    messages = [image_message(data_url((200, 20, 20)), "colour?")]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 image_message(data_url((20, 20, 200), side=84), "and now?")]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    return 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm_openai") / "model", "qwen2_5_vl", initializer_range=0.1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    vision = VisionPromptEncoder.from_pretrained(str(path), tok, model.config, min_pixels=56 * 56,
                                                 max_pixels=84 * 84)
    return model, tok, vision


def test_an_openai_agent_sending_screenshots_trains_on_every_image(tiny):
    model, tok, vision = tiny
    engine = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    executor = OpenAIAgentExecutor(two_screens, tok, prompt_max_len=64, max_len=256, num_concurrent=4)
    executor.vision = vision
    try:
        sampling = SamplingParams(max_new_tokens=3, temperature=0.9, stop_token_ids=[tok.eos_token_id], seed=4)
        prompts = [Prompt(text="look", label="r", source="t", index=i) for i in range(2)]
        trajectories = executor.run(prompts, engine.generate, sampling, n_samples_per_prompt=2)
    finally:
        executor.close()
    assert len(trajectories) == 4
    image_id = model.config.image_token_id
    for t in trajectories:
        assert t.failure is None and t.extra_logs["num_branches"] == 1  # a linear chat: one row
        assert t.visual.num_images == 2 and all(r.startswith("sha256:") for r in t.visual.refs)
        assert [int(g.prod()) // 4 for g in t.visual.image_grid_thw] == [4, 9]
        assert t.prompt_ids.count(image_id) == 4  # the first screenshot, in the first call's prompt
        in_response = [k for k, token in enumerate(t.response_ids) if token == image_id]
        assert len(in_response) == 9 and not any(t.action_mask[k] for k in in_response)
        t.reward = 1.0
    batch = StepBatch.from_trajectories(trajectories, tok.pad_token_id)
    visual = {k: v for k, v in batch.forward_inputs().items() if k in ("pixel_values", "image_grid_thw",
                                                                        "mrope_position_ids")}
    mask = batch.action_mask
    assert int(mask.sum()) > 0
    with torch.no_grad():
        for packed in (False, True):
            logprobs, _ = policy_logprobs(model, batch.sequences, batch.attention_mask, mask.shape[1],
                                          temperature=0.9, packed=packed, visual=visual)
            torch.testing.assert_close(logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=1e-4)


def _refused(endpoint, messages, match):
    endpoint.recorder.open("ep")
    try:
        with pytest.raises(EndpointRequestError, match=match) as caught:
            asyncio.run(endpoint.chat({"messages": messages}, "Bearer ep"))
    finally:
        endpoint.recorder.close("ep")
    assert caught.value.status == 400
    assert endpoint.queue._queue.empty()  # nothing reached the engine


def test_bad_images_are_refused_before_the_engine(tiny):
    _, tok, vision = tiny
    endpoint = OpenAIEndpoint(tok, max_len=256, vision=vision, max_image_pixels=100 * 100, max_images=2)
    _refused(endpoint, [image_message("https://example.com/screen.png", "x")], "remote image URL .* refused")
    _refused(endpoint, [image_message("file:///etc/passwd", "x")], "file URLs are refused")
    _refused(endpoint, [image_message("/tmp/screen.png", "x")], "only base64 data URLs")
    _refused(endpoint, [image_message("data:image/png;base64,@@@", "x")], "invalid base64")
    _refused(endpoint, [image_message("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "x")],
             "not a readable image")
    _refused(endpoint, [image_message(data_url((1, 2, 3), side=101), "x")], r"101x101 image .* over the endpoint")
    _refused(endpoint, [image_message(data_url((1, 2, 3)), "x")] * 3, "more than 2 images")
    _refused(endpoint, [{"role": "user", "content": "sneaky <|image_pad|>"}], "placeholder tokens")
    _refused(endpoint, [image_message(data_url((1, 2, 3)), "two <|image_pad|>")], "placeholder")
    text_only = OpenAIEndpoint(tok, max_len=256)
    _refused(text_only, [image_message(data_url((1, 2, 3)), "x")], "text-only model")


def test_calls_with_the_same_tokens_but_other_images_are_separate_branches():
    def record(i, prompt, out, refs):
        return CompletionRecord(call_index=i, prompt_ids=prompt, output_ids=out, output_logprobs=[0.0] * len(out),
                                finish_reason="stop", visual=SimpleNamespace(refs=refs))

    records = [record(0, [1, 9, 9], [5], ("sha256:a",)),
               record(1, [1, 9, 9, 5, 2, 9, 9], [6], ("sha256:a", "sha256:b")),
               record(2, [1, 9, 9, 5, 2, 9, 9], [7], ("sha256:c", "sha256:b"))]
    sequences = episode_sequences(records)
    assert [s.calls for s in sequences] == [[0, 1], [2]]
    assert sequences[0].visual.refs == ("sha256:a", "sha256:b")
