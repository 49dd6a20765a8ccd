"""Prompt rows with images: every accepted form, the errors that name file / row / key, the text-only refusal, the
pixel bounds, the colour task, and the vLLM prompt keywords checked against vLLM's ``TokensPrompt``."""

from __future__ import annotations

import base64
import io
import json
import typing

import pytest
import torch
from PIL import Image

from hpc_rlhf.data.images import image_ref
from hpc_rlhf.data.prompts import PromptDataset
from hpc_rlhf.data.sources import DataError
from hpc_rlhf.data.synthetic import write_task_if_missing
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.tiny_vlm import build_tiny_vlm, build_vlm_tokenizer
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.vllm_images import require_vllm_images_supported, tokens_prompt_kwargs


def _png(colour=(255, 0, 0), size=(20, 20)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _dataset(tmp_path, rows, **kwargs):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset([str(path)], input_key="messages", apply_chat_template=True,
                         tokenizer=build_vlm_tokenizer(), **kwargs)


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_every_image_form_is_read(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png())
    data_url = "data:image/png;base64," + base64.b64encode(_png((0, 255, 0))).decode()
    rows = [
        {"messages": _user({"type": "image_url", "image_url": {"url": "img/a.png"}}, {"type": "text", "text": "x"})},
        {"messages": _user({"type": "image_url", "image_url": {"url": f"file://{tmp_path}/img/a.png"}})},
        {"messages": _user({"type": "image_url", "image_url": data_url})},
        {"messages": _user({"type": "image"}, {"type": "text", "text": "y"}), "images": ["img/a.png"]},
        {"messages": "plain with column", "images": ["img/a.png"]},
        {"messages": "text only"},
    ]
    prompts = _dataset(tmp_path, rows)
    assert [len(p.images) for p in prompts] == [1, 1, 1, 1, 1, 0]
    # HF datasets.Image values (parquet / save_to_disk rows): {"bytes", "path"} dicts and decoded PIL images
    from_dict = image_ref({"bytes": _png((0, 0, 255)), "path": None}, "d.parquet", 0, "images")
    from_pil = image_ref(Image.new("RGB", (8, 8), (9, 9, 9)), "d.parquet", 1, "images")
    assert from_dict.load().getpixel((0, 0)) == (0, 0, 255) and from_pil.load().getpixel((0, 0)) == (9, 9, 9)
    assert prompts[0].images[0].path == str(tmp_path / "img" / "a.png")
    assert prompts[2].images[0].path is None and prompts[2].images[0].describe().startswith("sha256:")
    for p in prompts[:5]:
        assert p.text.count("<|image_pad|>") == 1
        assert p.images[0].load().mode == "RGB"
    assert prompts[2].images[0].load().getpixel((0, 0)) == (0, 255, 0)


@pytest.mark.parametrize("row, match", [
    ({"messages": _user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})},
     r"data.jsonl: line 1: key 'messages': remote image 'https://example.com/a.png' refused"),
    ({"messages": _user({"type": "image_url", "image_url": {"url": "missing.png"}})},
     r"data.jsonl: line 1: key 'messages': image .*missing.png: file not found"),
    ({"messages": "q", "images": ["bad.png"]}, r"data.jsonl: line 1: key 'images': image .*bad.png: unreadable"),
    ({"messages": _user({"type": "image"})}, r"line 1: key 'messages': image part 0 has no image"),
    ({"messages": _user({"type": "image_url", "image_url": "data:image/png;base64,@@@"})}, r"invalid base64"),
])
def test_bad_images_name_file_row_and_key(tmp_path, row, match):
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(DataError, match=match):
        _dataset(tmp_path, [row])


def test_a_text_only_model_refuses_image_prompts_naming_the_key(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    rows = [{"messages": "fine"}, {"messages": "q", "images": ["a.png"]}]
    with pytest.raises(DataError, match=r"line 2: key 'images': .* actor.pretrain='llama' is a text-only model"):
        _dataset(tmp_path, rows, text_only_model="llama")
    assert len(_dataset(tmp_path, [{"messages": "fine"}], text_only_model="llama")) == 1


def test_pixel_bounds_set_the_image_tokens_and_long_prompts_are_refused(tmp_path):
    model = build_tiny_vlm(tmp_path / "m", "qwen2_5_vl")
    (tmp_path / "big.png").write_bytes(_png(size=(300, 200)))
    prompts = _dataset(tmp_path, [{"messages": "q", "images": ["big.png"]}])
    from transformers import AutoConfig, AutoTokenizer

    tok, config = AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model)
    tokens = {}
    for max_pixels in (56 * 56, 112 * 112):
        encoder = VisionPromptEncoder.from_pretrained(str(model), tok, config, min_pixels=28 * 28,
                                                      max_pixels=max_pixels)
        ids, visual = encoder.encode(prompts[0], prompt_max_len=512)
        assert ids.count(config.image_token_id) == visual.num_image_tokens()
        h, w = visual.image_grid_thw[0, 1:].tolist()
        assert h * w * 14 * 14 <= max_pixels  # resized as the processor does, never cut
        tokens[max_pixels] = visual.num_image_tokens()
    assert tokens[56 * 56] < tokens[112 * 112]
    with pytest.raises(DataError, match=r"row 1: key 'images': the prompt is \d+ tokens with its images, over "
                                         r"data.prompt_max_len=8"):
        encoder.encode(prompts[0], prompt_max_len=8)


def test_colour_task_writes_images_beside_the_prompts(tmp_path):
    path = write_task_if_missing("colour", tmp_path / "train.jsonl", 12, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 12 and {r["label"] for r in rows} <= set("rgby")
    prompts = PromptDataset([str(path)], input_key="messages", label_key="label", apply_chat_template=True,
                            tokenizer=build_vlm_tokenizer())
    assert all(len(p.images) == 1 for p in prompts)
    assert prompts[0].images[0].load().size == (56, 56)


def test_vllm_prompt_keywords_match_vllms_tokens_prompt(tmp_path):
    from hpc_rlhf.rollout.visual import PromptVisual

    visual = PromptVisual(torch.zeros(16, 8), torch.tensor([[1, 4, 4]]), 5, 2, ("a.png",),
                          (Image.new("RGB", (56, 56)),), (3136, 3136))
    request = GenerationRequest([1, 5, 5, 5, 5, 2], SamplingParams(max_new_tokens=2), visual=visual)
    kwargs = tokens_prompt_kwargs(request)
    assert kwargs["multi_modal_data"]["image"] == list(visual.images)
    assert kwargs["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 3136}
    assert tokens_prompt_kwargs(GenerationRequest([1, 2], SamplingParams(max_new_tokens=1))) == {
        "prompt_token_ids": [1, 2]}
    with pytest.raises(NotImplementedError, match="needs a GPU"):
        require_vllm_images_supported([request], on_gpu=False)
    llm_inputs = pytest.importorskip("vllm.inputs.llm", reason="vLLM is not installed")
    assert set(kwargs) <= set(typing.get_type_hints(llm_inputs.TokensPrompt))
