"""The GPU acceptance: GRPO colocated on one GPU with a locally built ~0.5B Llama in bf16 (transformers engine,
DeepSpeed), in four variants, each a real run (``acceptance_run.py`` under torchrun) measured from inside:

- full fine-tuning under ZeRO-3 with ``offload_states``: device memory while generating must be lower than
  while training by at least half the optimizer states (they are moved to the host between phases);
- LoRA, QLoRA (bitsandbytes NF4 base, ZeRO-2), and Liger kernels (skipped with a reason when not installed).

Each prints rollout tokens/s, train tokens/s, MFU, state-dict gather GB/s and ``plan``'s per-GPU estimate next to
``torch.cuda.max_memory_allocated``, and writes them to ``$HPC_RLHF_ACCEPTANCE_DIR`` (default ``runs/acceptance``). Run all GPU
tests with ``bash tests/gpu/acceptance.sh``.
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
    "lora": ["ds.zero_stage=3", "ds.lora.rank=16", "ds.lora.alpha=32", "actor.learning_rate=1e-4"],
    "qlora": ["ds.zero_stage=2", "ds.lora.rank=16", "ds.lora.alpha=32", "ds.lora.load_in_4bit=true",
              "actor.learning_rate=1e-4"],
    "liger": ["ds.zero_stage=3", "ds.use_liger_kernel=true"],
}
NEEDS = {"qlora": "bitsandbytes", "liger": "liger_kernel"}


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
    data = write_task_if_missing("arithmetic", base / "arith.jsonl", 512, seed=0)
    return {"model": str(model), "data": str(data), "base": base}


def _overrides(assets: dict, output_dir: Path, extra: list[str]) -> list[str]:
    return [
        f"actor.pretrain={assets['model']}", "actor.learning_rate=1e-6", "actor.lr_warmup_ratio=0",
        f"reward.reward_func_path={ROOT / 'examples/reward_funcs/arithmetic_shaped.py'}",
        "rollout.backend=transformers", "rollout.n_samples_per_prompt=8", "rollout.rollout_batch_size=16",
        "rollout.micro_rollout_batch_size=32", "rollout.generate_max_len=128", "algo.advantage_estimator=group_norm",
        "ds.param_dtype=bf16", "ds.gradient_checkpointing=true", "train.colocate_all=true",
        f"train.output_dir={output_dir}", "train.max_steps=3", "train.train_batch_size=128",
        "train.micro_train_batch_size=16", f"data.prompt_data=[{assets['data']}]", "data.input_key=input",
        "data.label_key=label", "data.prompt_max_len=64", "logger.use_tensorboard=false", *extra,
    ]


def _run(assets: dict, name: str) -> dict:
    report = report_dir() / f"{name}.json"
    report.unlink(missing_ok=True)
    torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
    cmd = [*torchrun.split(), "--nproc_per_node", "1", "--master_port", "29533",
           str(ROOT / "tests/gpu/acceptance_run.py"), "--report", str(report),
           *_overrides(assets, assets["base"] / name, VARIANTS[name])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert out.returncode == 0, f"{name} failed:\n{out.stdout[-4000:]}\n{out.stderr[-8000:]}"
    result = json.loads(report.read_text())
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


@pytest.mark.parametrize("name", ["lora", "qlora", "liger"])
def test_grpo_lora_qlora_liger(assets, name):
    if name in NEEDS and find_spec(NEEDS[name]) is None:
        pytest.skip(f"{NEEDS[name]} is not installed (add its wheel to the wheelhouse to run the {name} path)")
    _check_common(_run(assets, name))
