"""Images sent to the agents' endpoint, on a tiny Qwen2.5-VL: decoding runs off the server's event loop, decoded
pixels are capped per request and per episode (a 400 naming the key), and an episode holds each image once.

A screenshot agent re-sends every earlier image with each call; before, every call decoded all of them again on the
event loop (one large request stalled every episode) and every call's record kept its own decoded copies (memory
growing with the square of the turns).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import threading
from types import FunctionType, ModuleType

import httpx
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint  # noqa: E402
from hpc_rlhf.agents.openai_requests import EndpointRequestError  # noqa: E402
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder  # noqa: E402
from hpc_rlhf.models.tiny_vlm import build_tiny_vlm  # noqa: E402
from hpc_rlhf.rollout.base import GenerationResult, SamplingParams  # noqa: E402
from tests.endpoint_fixtures import queue_drained_into  # noqa: E402

SIDE = 56  # one image: 56 x 56 = 3136 pixels


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm_images") / "model", "qwen2_5_vl")
    tok = AutoTokenizer.from_pretrained(path)
    vision = VisionPromptEncoder.from_pretrained(str(path), tok, AutoConfig.from_pretrained(path),
                                                 min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE)
    return tok, vision


def _url(shade: int, side: int = SIDE) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (shade, 255 - shade, 7)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _user(urls: list[str], text: str = "what now?") -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}


def _one_token(tok):
    def generate(requests):
        return [GenerationResult(prompt_ids=r.prompt_ids, output_ids=[tok.eos_token_id], output_logprobs=[0.0],
                                 finish_reason="stop", request_index=i) for i, r in enumerate(requests)
                for _ in range(r.n)]
    return generate


def _endpoint(tok, vision, **caps) -> OpenAIEndpoint:
    endpoint = OpenAIEndpoint(tok, max_len=4096, vision=vision, **caps)
    endpoint.set_defaults(SamplingParams(max_new_tokens=1, stop_token_ids=[tok.eos_token_id]))
    return endpoint


def test_a_large_image_request_does_not_stall_a_small_one(tiny_vlm, monkeypatch):
    tok, vision = tiny_vlm
    decoding, release = threading.Event(), threading.Event()
    encode = vision.encode_images

    def slow_encode(images):  # stands for 32 large PNGs: holds its thread until the small request is answered
        decoding.set()
        release.wait(60)
        return encode(images)

    monkeypatch.setattr(vision, "encode_images", slow_encode)
    endpoint = _endpoint(tok, vision).start()
    for episode in ("ep-large", "ep-small"):
        endpoint.recorder.open(episode)
    answers: dict = {}

    def send_large() -> None:
        with endpoint.http_client(timeout=90) as client:
            answers["large"] = client.post("/chat/completions", json={"messages": [_user([_url(9)])]},
                                           headers={"Authorization": "Bearer ep-large"})

    try:
        with queue_drained_into(endpoint, _one_token(tok)):
            large = threading.Thread(target=send_large)
            large.start()
            assert decoding.wait(60), "the image request never reached its decoding"
            try:
                with endpoint.http_client(timeout=20) as client:
                    small = client.post("/completions", json={"prompt": "1+1=", "max_tokens": 1},
                                        headers={"Authorization": "Bearer ep-small"})
            except httpx.TimeoutException:
                pytest.fail("a text request was not served while another request's images decoded: the decoding "
                            "holds the endpoint's event loop")
            finally:
                served_before_release = not release.is_set()
                release.set()
                large.join(90)
    finally:
        endpoint.close()
    assert small.status_code == 200 and served_before_release
    assert answers["large"].status_code == 200, answers["large"].text


def _chat(endpoint, episode, messages):
    return asyncio.run(endpoint.chat({"messages": messages}, f"Bearer {episode}"))


def test_decoded_pixels_are_capped_per_request_and_per_episode(tiny_vlm):
    tok, vision = tiny_vlm
    endpoint = _endpoint(tok, vision, max_request_pixels=SIDE * SIDE, max_episode_pixels=2 * SIDE * SIDE)
    endpoint.recorder.open("ep")
    with queue_drained_into(endpoint, _one_token(tok)):
        with pytest.raises(EndpointRequestError, match="rollout.agent_max_image_pixels_per_request") as caught:
            _chat(endpoint, "ep", [_user([_url(1), _url(2)])])  # two new images: 6272 pixels in one request
        assert caught.value.status == 400 and "3136 decoded pixels per request" in str(caught.value)
        first = [_user([_url(1)])]
        _chat(endpoint, "ep", first)
        second = [*first, {"role": "assistant", "content": ""}, _user([_url(2)])]
        _chat(endpoint, "ep", second)  # re-sends the first: only the new one counts
        with pytest.raises(EndpointRequestError, match="rollout.agent_max_image_pixels_per_episode") as caught:
            _chat(endpoint, "ep", [*second, {"role": "assistant", "content": ""}, _user([_url(3)])])
        assert caught.value.status == 400 and "6272 decoded pixels per episode" in str(caught.value)
    endpoint.recorder.close("ep")


def _held_images(records) -> tuple[int, int]:
    """(decoded PIL images, bytes of image tensors) reachable from ``records``, each object counted once."""
    seen: set[int] = set()
    storages: set[int] = set()
    num_images = tensor_bytes = 0
    stack: list = list(records)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, ModuleType, FunctionType, VisionPromptEncoder)):
            continue
        seen.add(id(obj))
        if isinstance(obj, Image.Image):
            num_images += 1
        elif isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                tensor_bytes += storage.nbytes()
        else:
            stack.extend(gc.get_referents(obj))
    return num_images, tensor_bytes


def _screenshot_episode(endpoint, episode: str, num_turns: int):
    """A screenshot agent: each call re-sends every earlier screenshot and adds a new one."""
    endpoint.recorder.open(episode)
    messages: list[dict] = []
    for turn in range(num_turns):
        messages.append(_user([_url(turn * 20)]))
        reply = _chat(endpoint, episode, messages)
        messages.append(reply["choices"][0]["message"])
    return endpoint.recorder.close(episode)


def test_an_episode_holds_each_image_once(tiny_vlm):
    tok, vision = tiny_vlm
    endpoint = _endpoint(tok, vision)
    with queue_drained_into(endpoint, _one_token(tok)):
        short = _screenshot_episode(endpoint, "ep-short", 3)
        long = _screenshot_episode(endpoint, "ep-long", 9)
    images_short, bytes_short = _held_images(short)
    images_long, bytes_long = _held_images(long)
    assert (images_short, images_long) == (3, 9), "decoded images held by the records (one per distinct image)"
    assert bytes_long <= 3 * bytes_short * 1.1, f"{bytes_short} bytes for 3 turns but {bytes_long} for 9"
