"""Exact resume from atomic checkpoints: an interrupted run continues as if it never stopped."""

from __future__ import annotations

import shutil

import pytest

from hpc_rlhf.ckpt import CheckpointManager
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_each_on_ranks, run_on_ranks, signal_after

pytestmark = pytest.mark.slow
COMPARED = ("reward", "score", "response_length", "policy_loss", "actor_grad_norm", "actor_lr", "kl", "kl_coef",
            "critic_loss")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _fit(rank, world_size, overrides, stop_after=None, fail_save_at=None, log_file=None):
    """Train; optionally behave as if SLURM signalled after ``stop_after`` steps, or fail a save."""
    import logging

    if log_file is not None and rank == 0:
        handler = logging.FileHandler(log_file)
        handler.setLevel(logging.WARNING)
        logging.getLogger("hpc_rlhf").addHandler(handler)

    signal_after(stop_after)
    trainer = run_trainer(rank, world_size, overrides)
    if fail_save_at is not None:
        save = trainer.save_checkpoint

        def failing_save(step):
            if step == fail_save_at:
                # Every rank's write fails (a full filesystem), after part of the files were written.
                def broken(path, tag, client_state=None):
                    raise OSError(28, "No space left on device")
                trainer.roles.actor.save_checkpoint = broken
            save(step)
        trainer.save_checkpoint = failing_save
    trainer.fit()
    return trainer.stopped_by_signal


def _ppo(assets, out, *extra):
    return grpo_overrides(
        assets, out, "algo.advantage_estimator=gae", "rollout.n_samples_per_prompt=1", "rollout.rollout_batch_size=16",
        "train.train_batch_size=8", "train.micro_train_batch_size=4", "algo.kl.init_coef=0.05", "algo.kl.target=0.1",
        "actor.lr_warmup_ratio=0.25", "actor.min_lr_ratio=0.1", "critic.learning_rate=1e-3", "ds.zero_stage=3",
        "train.max_steps=4", "ckpt.save_steps=2", *extra)


def _assert_same_rows(expected, got, steps):
    for step in steps:
        a, b = expected[step - 1], got[step - 1]
        assert a["step"] == b["step"] == step
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (step, key, a[key], b[key])


def test_resume_after_signal_reproduces_the_uninterrupted_run(assets, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    # The uninterrupted run, then (signal during step 3: checkpoint at 3, stop) the cut one, in one spawn; the
    # resume below starts fresh processes, as a requeued job does.
    stopped = run_each_on_ranks(_fit, 2, {"full": (_ppo(assets, full),), "cut": (_ppo(assets, cut), 3)})
    assert stopped == {"full": [False, False], "cut": [True, True]}
    assert [r["step"] for r in read_metrics(cut)] == [1, 2, 3]
    assert not (cut / "model").exists()  # an interrupted run does not export
    assert CheckpointManager(cut / "ckpt").latest_step() == 3
    run_on_ranks(_fit, 2, _ppo(assets, cut, "ckpt.load=true"))
    expected, got = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    _assert_same_rows(expected, got, steps=(4,))
    assert (cut / "model" / "config.json").is_file()


def test_resume_disaggregated_roles(assets, tmp_path):
    overrides = grpo_overrides(
        assets, tmp_path / "x", "train.colocate_all=false", "actor.num_ranks=2", "ref.num_ranks=1",
        "rollout.num_engines=1", "algo.kl.init_coef=0.01", "train.max_steps=3", "ckpt.save_steps=1",
        "rollout.n_samples_per_prompt=4", "train.train_batch_size=32", "train.micro_train_batch_size=16")
    full = [o if not o.startswith("train.output_dir=") else f"train.output_dir={tmp_path / 'full'}" for o in overrides]
    cut = [o if not o.startswith("train.output_dir=") else f"train.output_dir={tmp_path / 'cut'}" for o in overrides]
    run_each_on_ranks(_fit, 4, {"full": (full,), "cut": (cut, 1)})  # one spawn; the resume starts fresh ranks
    run_on_ranks(_fit, 4, [*cut, "ckpt.load=true"])
    _assert_same_rows(read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut"), steps=(2, 3))


def test_failed_save_leaves_previous_checkpoint_usable(assets, tmp_path):
    overrides = _ppo(assets, tmp_path, "ckpt.save_steps=1", "train.max_steps=3")
    with pytest.raises(Exception, match="No space left on device"):
        run_on_ranks(_fit, 2, overrides, None, 2)
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.latest_step() == 1
    assert not manager.step_dir(2).exists()
    run_on_ranks(_fit, 2, [*overrides, "ckpt.load=true"])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert manager.latest_step() == 3


def test_fresh_start_under_load_then_damaged_checkpoints_fall_back(assets, tmp_path):
    """ckpt.load=true with nothing to load starts fresh with a fresh metrics.jsonl; a resume past a garbage LATEST
    skips checkpoints that fail verification (a truncated DeepSpeed shard, a same-size garbage controller.json),
    naming the files."""
    log_file = tmp_path / "warnings.log"
    overrides = grpo_overrides(assets, tmp_path, "ckpt.load=true", "ckpt.save_steps=1", "train.max_steps=2")
    run_on_ranks(_fit, 2, overrides)
    root = tmp_path / "ckpt"
    shutil.rmtree(root)  # no checkpoint was ever committed: the next run starts fresh
    run_on_ranks(_fit, 2, [*overrides, "train.max_steps=3"])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]

    shard = root / "step_3" / "actor" / "ds" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    controller = root / "step_2" / "controller.json"
    controller.write_bytes(b"#" * controller.stat().st_size)
    (root / "LATEST").write_bytes(b"\x00garbage")
    run_on_ranks(_fit, 2, [*overrides, "train.max_steps=3"], None, None, str(log_file))
    warnings = log_file.read_text()
    assert str(shard) in warnings and str(controller) in warnings, warnings
    assert "LATEST is corrupt" in warnings and "resuming from step_1" in warnings
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert CheckpointManager(root).latest_step() == 3
