"""Which layouts can load a checkpoint (``hpc_rlhf.ckpt.layout``) and ``plan --resume``, which tells before a job
starts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hpc_rlhf.ckpt.layout import (
    CheckpointLayout,
    CheckpointLayoutError,
    RoleLayout,
    compare_layouts,
    rl_layout,
    write_layout,
)
from hpc_rlhf.cli.plan import plan
from hpc_rlhf.config import load_config
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.world.placement import build_placement

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 83}


def _layout(world=2, dp=2, tp=1, stage=2, **role) -> CheckpointLayout:
    role = {"model": MODEL, **role}
    return CheckpointLayout(world, {"actor": RoleLayout(dp=dp, tp=tp, sp=1, zero_stage=stage, **role)})


def test_same_layout_loads_as_saved():
    change = compare_layouts(_layout(), _layout())
    assert change.exact and change.resharded == () and change.notes == ()


def test_more_ranks_reshard_and_say_what_is_not_reproduced():
    change = compare_layouts(_layout(world=2, dp=2), _layout(world=3, dp=3))
    assert change.resharded == ("actor",) and not change.same_world
    assert "dp 2 -> 3" in change.notes[0] and "RNG" in change.notes[1]


def test_without_zero_the_states_do_not_depend_on_the_number_of_replicas():
    change = compare_layouts(_layout(world=2, dp=2, stage=0), _layout(world=3, dp=3, stage=0))
    assert change.resharded == () and not change.same_world and "loaded as saved" in change.notes[0]


def test_another_tp_size_reshards():
    assert compare_layouts(_layout(world=4, dp=2, tp=2), _layout(world=4, dp=4, tp=1)).resharded == ("actor",)


@pytest.mark.parametrize(("saved", "wanted", "names"), [
    (_layout(), _layout(model={**MODEL, "hidden_size": 128}), ("actor.pretrain", "hidden_size=64", "128")),
    (_layout(), _layout(lora={"rank": 8, "target_modules": ["all-linear"]}), ("ds.lora", "no LoRA", "rank 8")),
    (_layout(dp=2), _layout(world=1, dp=1, stage=0), ("ZeRO stage 1-3 on both sides",)),
    (_layout(stage=2), _layout(world=3, dp=3, stage=3), ("ds.zero_stage=2", "stage 2", "stage 3")),
    (_layout(stage=3, weight_decay=0.1), _layout(world=3, dp=3, stage=3, weight_decay=0.1),
     ("actor.weight_decay=0.1", "ZeRO-3")),
])
def test_an_incompatible_checkpoint_is_refused_naming_the_key(saved, wanted, names):
    with pytest.raises(CheckpointLayoutError) as err:
        compare_layouts(saved, wanted, "ck/step_2")
    assert "ck/step_2" in str(err.value)
    for name in names:
        assert name in str(err.value)


def test_a_critic_checkpoint_needs_a_critic():
    with_critic = CheckpointLayout(2, {**_layout().roles, "critic": _layout().roles["actor"]})
    with pytest.raises(CheckpointLayoutError, match="trained roles"):
        compare_layouts(with_critic, _layout())


def test_rl_layout_reads_the_model_and_the_effective_zero_stage(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    cfg = load_config(None, [f"actor.pretrain={model}", "ds.zero_stage=2"])
    two = rl_layout(cfg, build_placement(cfg, 2)).roles["actor"]
    assert (two.dp, two.zero_stage, two.model["vocab_size"]) == (2, 2, 83)
    one = rl_layout(cfg, build_placement(cfg, 1), on_gpu=False).roles["actor"]
    assert (one.dp, one.zero_stage) == (1, 0)  # fp32: ZeRO-2 falls back to 0 on one replica, as the engine does
    # bf16 (ds.param_dtype=auto on a GPU) needs DeepSpeed's ZeRO optimizer: stage 2 on one replica too.
    assert rl_layout(cfg, build_placement(cfg, 1), on_gpu=True).roles["actor"].zero_stage == 2


def _checkpoint(tmp_path, layout: CheckpointLayout):
    step = tmp_path / "ckpt" / "step_2"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"step": 2, "files": []}))
    (tmp_path / "ckpt" / "LATEST").write_text("step_2")
    write_layout(step, layout)
    return step


def test_plan_resume_tells_how_a_checkpoint_loads_and_refuses_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    base = ["--config", str(ROOT / "configs/grpo_tiny_cpu.yaml"), "--nodes", "1"]
    overrides = [f"actor.pretrain={model}", "actor.build_tiny=false", "rollout.rollout_batch_size=6",
                 "train.train_batch_size=48", "train.micro_train_batch_size=4"]
    cfg = load_config(ROOT / "configs/grpo_tiny_cpu.yaml", overrides)
    saved = rl_layout(cfg, build_placement(cfg, 2))
    _checkpoint(tmp_path / "run", saved)

    assert plan([*base, "--gpus-per-node", "2", "--resume", str(tmp_path / "run"), *overrides]) == 0
    assert "the same layout, loaded as saved" in capsys.readouterr().out
    assert plan([*base, "--gpus-per-node", "3", "--resume", str(tmp_path / "run"), *overrides]) == 0
    assert "dp 2 -> 3" in capsys.readouterr().out

    other = replace(saved.roles["actor"], model={**saved.roles["actor"].model, "num_hidden_layers": 12})
    write_layout(tmp_path / "run" / "ckpt" / "step_2", replace(saved, roles={"actor": other}))
    assert plan([*base, "--gpus-per-node", "2", "--resume", str(tmp_path / "run"), *overrides]) == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and "num_hidden_layers=12" in err and "actor.pretrain" in err

    assert plan([*base, "--gpus-per-node", "2", "--resume", str(tmp_path / "nothing"), *overrides]) == 1
    assert "no checkpoint there" in capsys.readouterr().err


def test_plan_resume_auto_reads_the_configs_checkpoint_root(tmp_path, capsys):
    """What a requeued sbatch job runs: no checkpoint yet is a fresh start, not an error."""
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    args = ["--config", str(ROOT / "configs/grpo_tiny_cpu.yaml"), "--nodes", "1", "--gpus-per-node", "2",
            "--resume", "auto", f"actor.pretrain={model}", "actor.build_tiny=false",
            f"train.output_dir={tmp_path / 'run'}"]
    assert plan(args) == 0
    assert f"no checkpoint under {tmp_path / 'run' / 'ckpt'} yet" in capsys.readouterr().out
    cfg = load_config(ROOT / "configs/grpo_tiny_cpu.yaml", args[8:])
    _checkpoint(tmp_path / "run", rl_layout(cfg, build_placement(cfg, 2)))
    assert plan(args) == 0
    assert "the same layout, loaded as saved" in capsys.readouterr().out
