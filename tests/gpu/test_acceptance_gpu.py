"""The GPU acceptance: GRPO colocated on one GPU with a locally built ~0.5B Llama in bf16 (transformers engine,
DeepSpeed), in five variants, each a real run (``acceptance_run.py`` under torchrun) measured from inside:

- full fine-tuning under ZeRO-3 with ``offload_states`` (DeepSpeed's FusedAdam, JIT-built by nvcc): device memory
  while generating must be lower than while training by at least half the optimizer states (they are moved to the
  host between phases);
- full fine-tuning with ``ds.zero_stage=2`` (on one rank DeepSpeed runs it as stage 0, stepping torch's fused
  AdamW; nothing is offloaded);
- Liger kernels, LoRA, QLoRA (bitsandbytes NF4 base, ZeRO-2; skipped with a reason when a package is missing);

and a checkpoint / exact-resume check in bf16 on a smaller model: a run stopped by the time-limit signal during
step 2 and resumed reproduces step 3 of the uninterrupted run (``RESUME_TOLERANCE``).

Each prints rollout tokens/s, train tokens/s, MFU, state-dict gather GB/s and ``plan``'s per-GPU estimate next to
``torch.cuda.max_memory_allocated``, and writes them to ``$HPC_RLHF_ACCEPTANCE_DIR`` (default ``runs/acceptance``).
Run all GPU tests with ``bash tests/gpu/acceptance.sh``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU acceptance: bf16 DeepSpeed runs)"),
    pytest.mark.skipif(find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (add its wheel to the wheelhouse: docs/gpu.md)"),
]

# ~0.45B parameters: 24 layers of hidden 1024 (GQA 16/8 heads) and MLP 5120; a char-level vocabulary.
MODEL_SIZES = {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 5120,
               "num_attention_heads": 16, "num_key_value_heads": 8}
VARIANTS = {
    "full_zero3_offload": ["ds.zero_stage=3"],
    "full_zero2": ["ds.zero_stage=2"],
    "liger": ["ds.zero_stage=3", "ds.use_liger_kernel=true"],
    "lora": ["ds.zero_stage=3", "ds.lora.rank=16", "ds.lora.alpha=32", "actor.learning_rate=1e-4"],
    "qlora": ["ds.zero_stage=2", "ds.lora.rank=16", "ds.lora.alpha=32", "ds.lora.load_in_4bit=true",
              "actor.learning_rate=1e-4"],
}
NEEDS = {"qlora": "bitsandbytes", "liger": "liger_kernel"}
# The resume check's model: small, so that its three runs cost little beside the variants above.
RESUME_MODEL_SIZES = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 1024,
                      "num_attention_heads": 4, "num_key_value_heads": 2}
RESUME_COMPARED = ("reward", "response_length", "policy_loss", "actor_grad_norm", "actor_lr", "kl")
# bf16 on CUDA: generation repeats the same tokens from the restored weights and RNG state, but the backward's
# atomic adds are not bit-reproducible, so gradient norms and losses agree to bf16 rounding, not bit for bit.
RESUME_TOLERANCE = {"rel": 2e-2, "abs": 1e-3}
TIMEOUT_S = int(os.environ.get("HPC_RLHF_ACCEPTANCE_RUN_TIMEOUT_S", "1800"))


def report_dir() -> Path:
    path = Path(os.environ.get("HPC_RLHF_ACCEPTANCE_DIR") or ROOT / "runs" / "acceptance")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from hpc_rlhf.data.synthetic import write_task_if_missing
    from hpc_rlhf.models.tiny import build_tiny_model

    base = tmp_path_factory.mktemp("acceptance")
    model = build_tiny_model(base / "llama-0.5b", seed=0, max_position_embeddings=1024, **MODEL_SIZES)
    small = build_tiny_model(base / "llama-small", seed=0, max_position_embeddings=1024, **RESUME_MODEL_SIZES)
    data = write_task_if_missing("arithmetic", base / "arith.jsonl", 512, seed=0)
    return {"model": str(model), "small_model": str(small), "data": str(data), "base": base}


def _overrides(assets: dict, output_dir: Path, extra: list[str], model_key: str = "model") -> list[str]:
    return [
        f"actor.pretrain={assets[model_key]}", "actor.learning_rate=1e-6", "actor.lr_warmup_ratio=0",
        f"reward.reward_func_path={ROOT / 'examples/reward_funcs/arithmetic_shaped.py'}",
        "rollout.backend=transformers", "rollout.n_samples_per_prompt=8", "rollout.rollout_batch_size=16",
        "rollout.micro_rollout_batch_size=32", "rollout.generate_max_len=128", "algo.advantage_estimator=group_norm",
        "ds.param_dtype=bf16", "ds.gradient_checkpointing=true", "train.colocate_all=true",
        f"train.output_dir={output_dir}", "train.max_steps=3", "train.train_batch_size=128",
        "train.micro_train_batch_size=16", f"data.prompt_data=[{assets['data']}]", "data.input_key=input",
        "data.label_key=label", "data.prompt_max_len=64", "logger.use_tensorboard=false", *extra,
    ]


def _launch(report: Path, overrides: list[str], stop_after: int | None = None) -> dict:
    """One ``acceptance_run.py`` under torchrun on one GPU; its JSON report."""
    report.unlink(missing_ok=True)
    torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
    cmd = [*torchrun.split(), "--nproc_per_node", "1", "--master_port", "29533",
           str(ROOT / "tests/gpu/acceptance_run.py"), "--report", str(report),
           *([] if stop_after is None else ["--stop-after", str(stop_after)]), *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert out.returncode == 0, f"{report.stem} failed:\n{out.stdout[-4000:]}\n{out.stderr[-8000:]}"
    return json.loads(report.read_text())


def _run(assets: dict, name: str) -> dict:
    result = _launch(report_dir() / f"{name}.json", _overrides(assets, assets["base"] / name, VARIANTS[name]))
    mfu = "n/a (GPU not in the peak table)" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    print(f"\n[{name}] {result['device']}: rollout {result['rollout_tokens_per_s']:.0f} tok/s, "
          f"train {result['train_tokens_per_s']:.0f} tok/s, MFU {mfu}, state-dict gather "
          f"{result['gather_gb_per_s']:.1f} GB/s ({result['gathered_gb']:.2f} GB); plan per-GPU training estimate "
          f"{result['plan_training_gib']:.1f} GiB vs max_memory_allocated {result['max_memory_allocated_gib']:.1f} GiB")
    return result


def _check_common(result: dict) -> None:
    assert result["steps"] == 3 and result["losses_finite"]
    for key in ("rollout_tokens_per_s", "train_tokens_per_s", "gather_gb_per_s"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    assert result["generation_allocated_gib"] and result["training_allocated_gib"]


def test_grpo_full_zero3_offload_frees_device_memory_while_generating(assets):
    result = _run(assets, "full_zero3_offload")
    _check_common(result)
    assert 0.35e9 < result["num_params"] < 0.6e9
    # fp32 master weights + Adam m and v: 12 bytes per parameter, on the host while the rollout engine generates.
    optimizer_gib = 12 * result["num_params"] / 2**30
    generating, training = max(result["generation_allocated_gib"][1:]), min(result["training_allocated_gib"])
    assert generating < training - optimizer_gib / 2, (generating, training, optimizer_gib)


def test_grpo_full_zero2_steps_with_torch_fused_adamw(assets):
    _check_common(_run(assets, "full_zero2"))


def test_grpo_liger(assets):
    if find_spec(NEEDS["liger"]) is None:
        pytest.skip("liger_kernel is not installed (add its wheel to the wheelhouse to run the liger path)")
    _check_common(_run(assets, "liger"))


def test_checkpoint_and_exact_resume_in_bf16(assets):
    """Stopped during step 2 (checkpoint, exit), resumed in a fresh process: step 3 as in the uninterrupted run."""
    from hpc_rlhf.utils.metrics import read_metrics

    extra = ["ds.zero_stage=3", "actor.learning_rate=1e-5"]
    full, cut = assets["base"] / "resume_full", assets["base"] / "resume_cut"
    _launch(report_dir() / "resume_full.json", _overrides(assets, full, extra, "small_model"))
    stopped = _launch(report_dir() / "resume_cut.json", _overrides(assets, cut, extra, "small_model"), stop_after=2)
    assert stopped["stopped_by_signal"] and [r["step"] for r in read_metrics(cut)] == [1, 2]
    _launch(report_dir() / "resume_resumed.json", _overrides(assets, cut, [*extra, "ckpt.load=true"], "small_model"))
    expected, got = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in got] == [1, 2, 3]
    differences = {key: abs(got[2][key] - expected[2][key]) / max(abs(expected[2][key]), 1e-12)
                   for key in RESUME_COMPARED if key in expected[2]}
    (report_dir() / "resume.json").write_text(json.dumps(
        {"step3_expected": expected[2], "step3_resumed": got[2], "relative_difference": differences}, indent=1))
    print(f"\n[resume] step 3 relative differences after resume (bf16, CUDA): {differences}")
    for key in differences:
        assert got[2][key] == pytest.approx(expected[2][key], **RESUME_TOLERANCE), key


@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_grpo_lora_qlora(assets, name):
    if name in NEEDS and find_spec(NEEDS[name]) is None:
        pytest.skip(f"{NEEDS[name]} is not installed (add its wheel to the wheelhouse to run the {name} path)")
    _check_common(_run(assets, name))
