"""GRPO step time and rollout tokens/s with images vs text-only prompts of the same token count (tiny Qwen2.5-VL).

    python benchmarks/vlm_images.py                      # 2 CPU ranks, 20 steps per run, ~2 minutes on 2 cores
    python benchmarks/vlm_images.py --max-pixels 12544   # 112x112 images: 16 image tokens per prompt

Both runs are ``configs/grpo_vlm_tiny_cpu.yaml`` (colocated, transformers rollout engine, 64 samples per step) on
the same tiny model with ``rollout.generate_max_len`` raised so that generation has work to do. "images": the colour
task's prompts (one image each, ``data.min_pixels = data.max_pixels``: every image has the same number of tokens).
"text": the same question with the image part replaced by as many plain characters as the image's placeholder
tokens (vision start, image tokens, vision end), so both prompts are the same number of tokens; the model never
sees pixels then. The difference between the rows is the price of the images: the vision tower in every prefill and
training forward, the M-RoPE positions, and moving pixel values through the step batch.

Reported per run: medians over steps 2..N of ``timing/step``, ``timing/generation``, ``timing/train``,
``rollout_tokens_per_s`` (from ``metrics.jsonl``), and the mean response length (responses stop at EOS, so the two
runs' token counts can differ a little).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "grpo_vlm_tiny_cpu.yaml"


def _data(out: Path, model: Path, num: int, side: int) -> tuple[Path, Path, int]:
    """The image prompt file and its text-only twin; returns their paths and the prompt's token count."""
    from transformers import AutoTokenizer

    from hpc_rlhf.data.synthetic import write_jsonl_if_missing
    from hpc_rlhf.data.synthetic_images import colour_rows
    from hpc_rlhf.models.tiny_vlm import IMAGE_PAD, VISION_END, VISION_START

    images = write_jsonl_if_missing(out / f"images_{side}.jsonl",
                                    lambda: colour_rows(num, 0, out / f"images_{side}_png", side=side))
    rows = [json.loads(line) for line in images.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model)
    num_image_tokens = (side // 28) ** 2  # one token per 28x28 pixels (patch 14, merge 2)
    placeholder = VISION_START + IMAGE_PAD * num_image_tokens + VISION_END
    filler = "x" * len(tok.encode(placeholder, add_special_tokens=False))
    text_rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": filler + r["messages"][0][
        "content"][1]["text"]}]}], "label": r["label"]} for r in rows]
    text = write_jsonl_if_missing(out / f"text_{side}.jsonl", lambda: text_rows)
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    with_image = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True).replace(
        VISION_START + IMAGE_PAD + VISION_END, placeholder)
    plain = tok.apply_chat_template(text_rows[0]["messages"], tokenize=False, add_generation_prompt=True)
    lengths = {len(tok.encode(t, add_special_tokens=False)) for t in (with_image, plain)}
    if len(lengths) != 1:
        raise SystemExit(f"prompt token counts differ: {lengths}")
    return images, text, lengths.pop()


def _run(name: str, data: Path, out: Path, args) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks), "-m",
           "hpc_rlhf.cli.train_ppo", "--config", str(RECIPE), f"actor.pretrain={args.model}",
           f"data.prompt_data=[{data}]", "data.synthetic_task=null", "eval.data=[]", f"train.output_dir={run_dir}",
           f"train.max_steps={args.steps}", f"rollout.generate_max_len={args.generate_max_len}",
           f"data.max_pixels={args.max_pixels}", f"data.min_pixels={args.max_pixels}",
           f"data.prompt_max_len={args.prompt_max_len}", "logger.use_tensorboard=false",
           f"reward.reward_func_path={ROOT / 'examples' / 'reward_funcs' / 'colour.py'}"]
    log = out / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ)).returncode
    if rc:
        raise SystemExit(f"{name} failed (rc={rc}); see {log}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][1:]  # steps 2..N

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {"name": name, "step_s": med("timing/step"), "gen_s": med("timing/generation"),
            "train_s": med("timing/train"), "tok_s": med("rollout_tokens_per_s"),
            "resp_len": statistics.mean(r["response_length"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--generate-max-len", type=int, default=16)
    p.add_argument("--max-pixels", type=int, default=3136, help="image area: 3136 = 56x56 = 4 image tokens")
    p.add_argument("--prompt-max-len", type=int, default=64)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--model", default=str(ROOT / "runs" / "models" / "tiny-qwen2.5-vl"))
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_vlm"))
    args = p.parse_args()
    from hpc_rlhf.models.tiny_vlm import build_tiny_vlm

    build_tiny_vlm(args.model, "qwen2_5_vl", seed=42, initializer_range=0.1)  # as the recipe's build_tiny does
    side = int(args.max_pixels ** 0.5)
    out = Path(args.out)
    images, text, prompt_tokens = _data(out, Path(args.model), args.samples, side)
    results = [_run("images", images, out, args), _run("text", text, out, args)]
    print(f"prompt tokens {prompt_tokens} ({(side // 28) ** 2} image tokens), {args.ranks} ranks, "
          f"{args.steps} steps, generate_max_len {args.generate_max_len}")
    print("| prompts | s/step (median, steps 2..N) | generation s | train s | rollout tok/s | mean response len |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['step_s']:.3f} | {r['gen_s']:.3f} | {r['train_s']:.3f} | {r['tok_s']:.0f} | "
              f"{r['resp_len']:.1f} |")


if __name__ == "__main__":
    main()
