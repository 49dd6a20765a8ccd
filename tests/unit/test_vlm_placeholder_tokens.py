"""A vision-language model's placeholder tokens (``<|image_pad|>`` ...) never reach a step batch that they would
break: every engine forbids them, a sample that still carries one fails alone (counted), and agent text that holds
the placeholder string fails its episode, not the step (``hpc_rlhf.rollout.placeholder_tokens``)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from hpc_rlhf.agents.executor import SingleTurnExecutor
from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
from hpc_rlhf.data.prompts import Prompt, PromptDataset
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.tiny_vlm import build_tiny_vlm
from hpc_rlhf.rollout import vllm_external_launcher
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.placeholder_tokens import placeholder_token_ids, read_placeholder_token_ids
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine, vision_placeholder_mask
from hpc_rlhf.rollout.vllm_external_launcher import VllmRolloutEngine
from hpc_rlhf.rollout.vllm_server import VllmServerEngine
from hpc_rlhf.trainers.rl.controller_steps import rollout_metrics
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from tests.unit.test_vllm_external_launcher_contract import FakeRequestOutput, RecordingSamplingParams, completion
from tests.unit.test_vllm_server import FakeAsyncEngine, install_fake_vllm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("placeholders") / "model", "qwen2_5_vl", initializer_range=0.1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    vision = VisionPromptEncoder.from_pretrained(str(path), tok, model.config, min_pixels=56 * 56, max_pixels=84 * 84)
    root = path.parent
    Image.new("RGB", (56, 56), (200, 30, 30)).save(root / "red.png")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "red.png"}},
                                                       {"type": "text", "text": "Q"}]}], "label": "x"},
            {"messages": "Q", "label": "y"}]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = list(PromptDataset([str(data)], input_key="messages", label_key="label", apply_chat_template=True,
                                 tokenizer=tok))
    assert prompts[0].images and not prompts[1].images
    return str(path), model, tok, vision, prompts


def _outputs_with_a_placeholder(image_id: int):
    """``LLM.generate`` of a vLLM that sampled ``image_id`` in sample 0 of every request (vLLM cannot be made to
    on CPU: it runs no vision-language model there)."""
    def generate(prompts, sampling_params, use_tqdm=False):
        outputs = []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params, strict=True)):
            samples = [completion(0, [5, image_id, 6], [-0.1, -0.2, -0.3], "length")]
            samples += [completion(j, [5, 6], [-0.1, -0.3], "stop") for j in range(1, sp.kwargs["n"])]
            outputs.append(FakeRequestOutput(str(i), prompt["prompt_token_ids"], samples))
        return outputs
    return generate


def _fake_vllm_engine(monkeypatch, model_path: str, image_id: int) -> VllmRolloutEngine:
    class LLM:
        def __init__(self, **kwargs):
            self.calls = []

        def generate(self, prompts, sampling_params, use_tqdm=False):
            self.calls.append([sp.kwargs for sp in sampling_params])
            return _outputs_with_a_placeholder(image_id)(prompts, sampling_params)

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM, SamplingParams=RecordingSamplingParams,
                                                             TokensPrompt=dict))
    return VllmRolloutEngine(model_path)


def test_the_placeholder_ids_are_read_from_the_model_and_empty_for_a_text_model(vlm, tmp_path):
    path, model, _, _, _ = vlm
    ids = read_placeholder_token_ids(path)
    cfg = model.config
    assert ids == sorted({cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id})
    assert placeholder_token_ids(cfg) == ids  # the transformers config and its config.json agree
    mask = vision_placeholder_mask(cfg, torch.device("cpu"))
    assert mask is not None and mask.nonzero().flatten().tolist() == ids  # the transformers engine's ban
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 10}))
    assert read_placeholder_token_ids(str(tmp_path)) == []


def test_both_vllm_engines_forbid_the_placeholders_with_a_logit_bias(vlm, monkeypatch):
    path, model, _, _, _ = vlm
    ids = read_placeholder_token_ids(path)
    engine = _fake_vllm_engine(monkeypatch, path, model.config.image_token_id)
    engine.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=3), n=2)])
    assert engine.llm.calls[0][0]["logit_bias"] == {i: -100.0 for i in ids}

    install_fake_vllm(monkeypatch)
    seen = []

    class Recording(FakeAsyncEngine):
        async def generate(self, prompt, sampling_params, request_id):
            seen.append(sampling_params.kwargs)
            yield FakeRequestOutput(request_id, prompt["prompt_token_ids"],
                                    [completion(0, [5, model.config.image_token_id, 6], [-0.1] * 3, "stop")])

    monkeypatch.setattr(sys.modules["vllm"], "AsyncLLMEngine", Recording)
    server = VllmServerEngine(path, weight_transfer_backend="gloo")
    try:
        results = server.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=3))])
    finally:
        server.close()
    assert seen[0]["logit_bias"] == {i: -100.0 for i in ids}
    # what still came back with a placeholder is cut before it
    assert results[0].output_ids == [5] and results[0].finish_reason == "placeholder"


def test_a_sampled_placeholder_fails_its_sample_alone_and_the_step_batch_builds(vlm, monkeypatch):
    path, model, tok, vision, prompts = vlm
    image_id = model.config.image_token_id
    engine = _fake_vllm_engine(monkeypatch, path, image_id)
    # vLLM runs images on a GPU only; the fake engine here takes them on CPU
    monkeypatch.setattr(vllm_external_launcher, "require_vllm_images_supported", lambda requests, on_gpu: None)
    executor = SingleTurnExecutor(tok, 256)
    executor.vision = vision
    trajectories = executor.run(prompts[:1], engine.generate, SamplingParams(max_new_tokens=3),
                                n_samples_per_prompt=2)
    failed, kept = trajectories
    assert failed.response_ids == [5] and failed.finish_reason == "placeholder"
    assert failed.action_mask == [0] and failed.reward == 0.0 and "placeholder" in (failed.failure or "")
    assert kept.response_ids == [5, 6] and kept.action_mask == [1, 1] and kept.failure is None
    assert all(image_id not in t.response_ids for t in trajectories)
    kept.reward = 1.0
    StepBatch.from_trajectories(trajectories, tok.pad_token_id)  # raised "image token at position ..." before
    assert rollout_metrics(trajectories, None, 1.0)["placeholder_fraction"] == 0.5


class TwoTurns(AgentInstanceBase):
    """Feedback "+" after turn 1; done after turn 2 with reward 1."""

    async def step(self, states, **kwargs):
        done = "+" in states["observation_text"]
        return {"rewards": 1.0 if done else 0.0, "done": done, "environment_feedback": "" if done else "+"}


class PlaceholderFeedback(AgentInstanceBase):
    """For label "x" a text feedback holding the image placeholder string, and no image."""

    async def step(self, states, **kwargs):
        done = "+" in states["observation_text"]
        text = "+ <|image_pad|>" if states["label"] == "x" else "+"
        return {"rewards": 1.0 if done else 0.0, "done": done, "environment_feedback": "" if done else text}


class PlaceholderReset(TwoTurns):
    """For label "x" a ``reset`` observation holding the image placeholder string, and no image."""

    async def reset(self, states, **kwargs):
        extra = " <|image_pad|>" if states["label"] == "x" else ""
        return {"observation": states["observation"] + extra}


def _agent_run(vlm, agent_cls, generate=None):
    """Prompt 0 (label "x", with an image) and prompt 1 (label "y", text): the step batch then needs M-RoPE
    positions, which a stray placeholder breaks for every row."""
    _, model, tok, vision, prompts = vlm
    executor = MultiTurnAgentExecutor(agent_cls, tok, 256, max_len=512, max_turns=4)
    executor.vision = vision
    engine = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=0)
    trajectories = executor.run(prompts, generate or engine.generate, params, 1)
    StepBatch.from_trajectories(trajectories, tok.pad_token_id)
    return trajectories


def test_an_agent_turn_that_sampled_a_placeholder_fails_its_episode_alone(vlm):
    _, model, tok, _, _ = vlm
    real = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)

    calls = []

    def generate(requests):  # in the first round, the engine sampled a placeholder in prompt 0's turn (and cut it)
        results = real.generate(requests)
        if not calls:
            results[0].output_ids, results[0].output_logprobs, results[0].finish_reason = [5], [-0.1], "placeholder"
        calls.append(len(requests))
        return results

    failed, kept = _agent_run(vlm, TwoTurns, generate)
    assert failed.finish_reason == "placeholder" and not any(failed.action_mask) and failed.reward == 0.0
    assert "placeholder" in (failed.failure or "") and failed.extra_logs["num_turns"] == 1.0
    assert kept.failure is None and kept.extra_logs["num_turns"] == 2.0 and kept.reward == 1.0


@pytest.mark.parametrize("agent_cls", [PlaceholderFeedback, PlaceholderReset], ids=["feedback", "reset"])
def test_agent_text_with_the_placeholder_string_fails_its_episode_not_the_step(vlm, agent_cls):
    _, model, _, _, _ = vlm
    failed, kept = _agent_run(vlm, agent_cls)
    assert failed.finish_reason == "agent_error" and "image placeholder" in (failed.failure or "")
    # only the image's own placeholders remain
    assert (failed.prompt_ids + failed.response_ids).count(model.config.image_token_id) \
        == failed.visual.num_image_tokens()
    assert kept.failure is None and kept.reward == 1.0


async def one_call(client, prompt, label):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=2)
    return 1.0


def test_an_openai_agent_call_cut_at_a_placeholder_fails_its_episode_alone(vlm):
    pytest.importorskip("openai")
    from hpc_rlhf.agents.openai_executor import OpenAIAgentExecutor

    _, model, tok, vision, _ = vlm
    real = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    cut = []

    def generate(requests):  # the first call the engine serves: cut at a sampled placeholder
        results = real.generate(requests)
        if not cut:
            first = results[0]
            first.output_ids, first.output_logprobs = first.output_ids[:1], first.output_logprobs[:1]
            first.finish_reason = "placeholder"
            cut.append(results[0].prompt_ids)
        return results

    executor = OpenAIAgentExecutor(one_call, tok, prompt_max_len=64, max_len=256, num_concurrent=1)
    executor.vision = vision
    try:
        sampling = SamplingParams(max_new_tokens=2, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=0)
        trajectories = executor.run([Prompt(text="look", label="r", source="t", index=0)], generate, sampling,
                                    n_samples_per_prompt=2)
    finally:
        executor.close()
    failed = [t for t in trajectories if t.failure is not None]
    assert len(failed) == 1 and "placeholder" in (failed[0].failure or "")
    assert failed[0].reward == 0.0 and not any(failed[0].action_mask)
    kept = [t for t in trajectories if t.failure is None]
    assert len(kept) == 1 and kept[0].reward == 1.0 and any(kept[0].action_mask)
