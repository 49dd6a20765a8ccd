"""Shared pieces of the RL end-to-end tests: a tiny local model, prompt data and run configs."""

from __future__ import annotations

from pathlib import Path

from hpc_rlhf.config import load_config
from hpc_rlhf.data.synthetic import write_task_if_missing
from hpc_rlhf.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SHAPED_REWARD = str(ROOT / "examples/reward_funcs/arithmetic_shaped.py")


def make_assets(base: Path, initializer_range: float = 0.02) -> dict[str, str]:
    """The tiny model and the arithmetic prompts under ``base``. ``initializer_range``: the model's init std
    (``build_tiny_model``: LoRA runs that must learn need a larger one than Llama's 0.02)."""
    model = build_tiny_model(base / "tiny-model", seed=0, initializer_range=initializer_range)
    data = write_task_if_missing("arithmetic", base / "arith.jsonl", 256, seed=0)
    return {"model": str(model), "data": str(data)}


def grpo_overrides(assets: dict[str, str], output_dir: Path, *extra: str) -> list[str]:
    return [
        f"actor.pretrain={assets['model']}", "actor.learning_rate=2e-3", "actor.lr_warmup_ratio=0",
        "actor.min_lr_ratio=1", f"reward.reward_func_path={SHAPED_REWARD}",
        "rollout.n_samples_per_prompt=8", "rollout.rollout_batch_size=8", "rollout.micro_rollout_batch_size=32",
        "rollout.generate_max_len=4", "ds.zero_stage=2", "algo.advantage_estimator=group_norm",
        f"train.output_dir={output_dir}", "train.num_episodes=8", "train.train_batch_size=64",
        "train.micro_train_batch_size=32", f"data.prompt_data=[{assets['data']}]", "data.input_key=input",
        "data.label_key=label", "data.prompt_max_len=16", "logger.use_tensorboard=false", *extra,
    ]


def run_trainer(rank: int, world_size: int, overrides: list[str]):
    """Build the world groups and the trainer the CLI would (``train.async_train``: the asynchronous one) from
    overrides (inside a spawned rank)."""
    from hpc_rlhf.trainers.rl.async_loop import trainer_class
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, overrides)
    world = build_world_groups(build_placement(cfg, world_size))
    return trainer_class(cfg)(cfg, world)


def fit_addition_model(path: Path, facts_path: Path, steps: int, seed: int) -> dict[str, str]:
    """A tiny model (the character tokenizer of every tiny model here) fitted by full-batch AdamW to all 100
    single-digit sums ``a+b=`` -> ``a+b<eos>``, and the facts as prompt rows ``{"input", "label"}``. 300 steps
    (a few seconds) give greedy accuracy 1.0 on them: a distillation teacher; fewer, a weaker student."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    facts = [(a, b) for a in range(10) for b in range(10)]
    Path(facts_path).write_text("".join(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                                        for a, b in facts))
    if not (Path(path) / "model.safetensors").is_file() or not (Path(path) / "fitted").is_file():
        build_tiny_model(path, seed=seed)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        rows = [(tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"],
                 tok(str(a + b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for a, b in facts]
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id)
        labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
        for i, (prompt, answer) in enumerate(rows):
            n = len(prompt) + len(answer)
            ids[i, :n], attention[i, :n] = torch.tensor(prompt + answer), 1
            labels[i, len(prompt):n] = torch.tensor(answer)
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.save_pretrained(path)
        (Path(path) / "fitted").write_text("ok")
    return {"model": str(path), "facts": str(facts_path)}
