"""SFT with images on a tiny Qwen2.5-VL / Qwen3-VL: rows -> samples (image tokens expanded, never trained on),
padded == packed == the model's own forward (log-probs and gradients), bad rows, and exports with the processor."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from hpc_rlhf.config.supervised import SupervisedDataConfig
from hpc_rlhf.data.images import DataError
from hpc_rlhf.data.packing import collate
from hpc_rlhf.data.sft import TextFormatter, load_examples, make_sft_example
from hpc_rlhf.data.synthetic_images import colour_sft_rows
from hpc_rlhf.data.vision_sft import (
    VisionTokenSample,
    make_vision_sft_example,
    refuse_images,
    sft_vision_encoder,
    visual_inputs,
)
from hpc_rlhf.models.tiny_vlm import IMAGE_PAD, build_tiny_vlm
from hpc_rlhf.models.vision import copy_processor_files
from hpc_rlhf.models.vision_forward import vision_causal_lm_forward


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / request.param, request.param, initializer_range=0.1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return str(path), model, AutoTokenizer.from_pretrained(path)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(tmp_path):
    """A chat row with a bare image part + images column, a prompt/response-like chat with an inline data-less
    file:// image and two images, and a text-only chat row."""
    (tmp_path / "img").mkdir(exist_ok=True)
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "img" / "a.png")
    Image.new("RGB", (90, 40), (0, 0, 255)).save(tmp_path / "img" / "b.png")
    user = [{"type": "image"}, {"type": "text", "text": "colour?"}]
    return [
        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "red"}],
         "images": ["img/a.png"]},
        {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'img' / 'b.png'}"}},
            {"type": "text", "text": "and"}, {"type": "image"}]},
            {"role": "assistant", "content": "blue, red"}], "images": ["img/a.png"]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]


def _samples(path, tok, tmp_path, rows=None, **data_kw):
    data = SupervisedDataConfig(train_data=[_write(tmp_path / "sft.jsonl", rows or _rows(tmp_path))],
                                messages_key="messages", apply_chat_template=True, max_len=64, **data_kw)
    encoder = sft_vision_encoder(path, tok, data)
    assert encoder is not None
    make = make_vision_sft_example(TextFormatter.from_config(data, tok), data, encoder)
    return load_examples(data.train_data, make), encoder


def test_rows_expand_images_and_train_only_the_answers(tiny, tmp_path):
    path, model, tok = tiny
    samples, encoder = _samples(path, tok, tmp_path)
    image_id = model.config.image_token_id
    first, second, text = samples
    assert isinstance(first, VisionTokenSample) and isinstance(second, VisionTokenSample)
    assert not isinstance(text, VisionTokenSample)
    side = 14 if "2_5" in path else 16
    assert [len(s.images) for s in (first, second)] == [1, 2]
    for sample in (first, second):
        tokens = sum(t * h * w for t, h, w in sample.image_grid_thw) // 4
        assert sum(i == image_id for i in sample.input_ids) == tokens
        # no image token (nor any prompt token) is trained on: exactly the answer and its end of turn
        assert not any(m for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if i == image_id)
    trained = tok.decode([i for i, m in zip(second.input_ids, second.loss_mask, strict=True) if m])
    assert trained.startswith("blue, red")
    # the b.png (90x40) image comes first in the second row: its grid is not square, a.png's is 4x4 patches
    assert second.image_grid_thw[1] == (1, 4, 4) and second.image_grid_thw[0] != (1, 4, 4)
    assert first.image_grid_thw == ((1, 4, 4),) and side in (14, 16)


def test_padded_and_packed_sft_forwards_agree_with_the_model(tiny, tmp_path):
    path, model, tok = tiny
    samples, encoder = _samples(path, tok, tmp_path)
    image_id = model.config.image_token_id
    # the model's own forward of each sample alone (its own M-RoPE from get_rope_index)
    expected = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(s.input_ids)[None]
            extra = {}
            if getattr(s, "images", ()):
                inputs = visual_inputs([s], collate([s], 0), encoder)
                extra = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
                         "mm_token_type_ids": (ids == image_id).int()}
            logps = model(input_ids=ids, **extra).logits[0, :-1].log_softmax(-1)
            expected.append(logps.gather(1, ids[0, 1:, None]).squeeze(1)[torch.tensor(s.loss_mask[1:])])
    grads = {}
    for packed in (False, True):
        model.zero_grad()
        batch = collate(samples, tok.pad_token_id, packing=packed, max_tokens_per_row=200)
        assert batch["input_ids"].shape[0] == (1 if packed else 3)
        logps = vision_causal_lm_forward(model, batch, visual_inputs(samples, batch, encoder))
        for i, want in enumerate(expected):
            got = logps[(batch["segment_ids"] == i) & batch["target_mask"]]
            torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5)
        # no target is an image token, and exactly the trained tokens are scored
        assert not bool((batch["target_ids"][batch["target_mask"]] == image_id).any())
        assert torch.equal(logps != 0, batch["target_mask"])
        logps.sum().backward()
        grads[packed] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.visual.blocks") for n in grads[True]), "the vision tower gets gradients"
    for name in grads[False]:
        torch.testing.assert_close(grads[False][name], grads[True][name], atol=1e-5, rtol=1e-4, msg=name)


def test_image_order_in_a_packed_batch_follows_the_rows(tiny, tmp_path):
    path, _, tok = tiny
    samples, encoder = _samples(path, tok, tmp_path)
    batch = collate(samples, tok.pad_token_id, packing=True, max_tokens_per_row=200)
    inputs = visual_inputs(samples, batch, encoder)
    order = []
    for s in batch["segment_ids"][0].tolist():
        if s >= 0 and (not order or order[-1] != s):
            order.append(s)
    grids = [g for s in order for g in getattr(samples[s], "image_grid_thw", ())]
    assert inputs["image_grid_thw"].tolist() == [list(g) for g in grids]
    assert inputs["pixel_values"].shape[0] == sum(t * h * w for t, h, w in grids)


def test_bad_rows_name_file_row_and_key(tiny, tmp_path):
    path, _, tok = tiny
    rows = _rows(tmp_path)
    missing = [rows[0] | {"images": ["img/nope.png"]}]
    with pytest.raises(DataError, match=r"sft\.jsonl: line 1: key .images.*nope\.png.*not found"):
        _samples(path, tok, tmp_path, missing)
    remote = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "https://x/y.png"}]},
                            {"role": "assistant", "content": "a"}]}]
    with pytest.raises(DataError, match="remote image"):
        _samples(path, tok, tmp_path, remote)
    # image tokens are never cut: a sample over data.max_len with its images is refused, naming the row
    data = SupervisedDataConfig(train_data=[_write(tmp_path / "sft.jsonl", rows[:1])], messages_key="messages",
                                apply_chat_template=True, max_len=8)
    make = make_vision_sft_example(TextFormatter.from_config(data, tok), data, sft_vision_encoder(path, tok, data))
    with pytest.raises(DataError, match=r"line 1.*data\.max_len=8.*never cut"):
        load_examples(data.train_data, make)


def test_text_only_model_refuses_image_rows(tmp_path):
    from hpc_rlhf.models.tiny import build_char_tokenizer, build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "llama"))
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    data = SupervisedDataConfig(train_data=[_write(tmp_path / "sft.jsonl", _rows(tmp_path))],
                                messages_key="messages", apply_chat_template=True)
    assert sft_vision_encoder(model_dir, tok, data) is None
    make = refuse_images(make_sft_example(TextFormatter.from_config(data, tok), data), data, model_dir)
    with pytest.raises(DataError, match=r"line 1.*images.*model\.pretrain=.*text-only"):
        load_examples(data.train_data, make)


def test_colour_sft_rows_answer_with_the_label(tmp_path):
    rows = colour_sft_rows(tmp_path / "t.jsonl", 4, seed=3)
    assert all(r["messages"][-1] == {"role": "assistant", "content": r["label"]} for r in rows)
    assert all((tmp_path / r["images"][0]).is_file() for r in rows)
    assert IMAGE_PAD not in json.dumps(rows)


def test_copy_processor_files_beside_an_export(tiny, tmp_path):
    path, model, _ = tiny
    out = tmp_path / "export"
    out.mkdir()
    assert sorted(copy_processor_files(model.config, out)) == ["preprocessor_config.json", "processor_config.json"]
    from transformers import AutoImageProcessor

    assert AutoImageProcessor.from_pretrained(out).merge_size == 2
    from transformers import LlamaConfig

    assert copy_processor_files(LlamaConfig(), out / "none") == []


def test_preference_pairs_share_the_prompts_images(tiny, tmp_path):
    from hpc_rlhf.data.vision_sft import make_vision_pair

    path, model, tok = tiny
    rows = _rows(tmp_path)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    pairs = [{"prompt": prompt, "images": ["img/a.png"], "chosen": "red", "rejected": "blue"},
             {"prompt": "colour?", "images": ["img/b.png"], "chosen": "blue", "rejected": "red"},
             {"prompt": "hi", "chosen": "yo", "rejected": "no"}]
    assert rows  # the images exist
    data = SupervisedDataConfig(train_data=[_write(tmp_path / "pref.jsonl", pairs)], apply_chat_template=True,
                                max_len=64)
    encoder = sft_vision_encoder(path, tok, data)
    first, second, text = load_examples(data.train_data, make_vision_pair(TextFormatter.from_config(data, tok), data,
                                                                          encoder))
    image_id = model.config.image_token_id
    for pair in (first, second):
        chosen, rejected = pair.chosen, pair.rejected
        assert isinstance(chosen, VisionTokenSample) and chosen.images == rejected.images
        assert chosen.image_grid_thw == rejected.image_grid_thw
        prompt_len = chosen.loss_mask.index(True)
        assert chosen.input_ids[:prompt_len] == rejected.input_ids[:prompt_len]
        assert sum(i == image_id for i in chosen.input_ids[:prompt_len]) == sum(
            t * h * w for t, h, w in chosen.image_grid_thw) // 4
        assert not any(m for i, m in zip(chosen.input_ids, chosen.loss_mask, strict=True) if i == image_id)
    assert tok.decode([i for i, m in zip(first.chosen.input_ids, first.chosen.loss_mask, strict=True) if m]) \
        .startswith("red")
    assert not isinstance(text.chosen, VisionTokenSample)
    no_prompt = SupervisedDataConfig(train_data=[_write(tmp_path / "chat.jsonl", [
        {"chosen": [*prompt, {"role": "assistant", "content": "a"}], "rejected": [*prompt, {"role": "assistant",
                                                                                           "content": "b"}],
         "images": ["img/a.png"]}])], apply_chat_template=True, prompt_key=None)
    with pytest.raises(DataError, match="need data.prompt_key"):
        load_examples(no_prompt.train_data, make_vision_pair(TextFormatter.from_config(no_prompt, tok), no_prompt,
                                                             encoder))
