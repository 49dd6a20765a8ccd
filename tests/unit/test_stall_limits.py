"""Per-phase hang limits: the first step and checkpoints get their own allowance, steps adapt to the run."""

import pytest

from hpc_rlhf.resilience.stall_limits import StallLimits


def test_step_limit_follows_the_slowest_step_after_the_first():
    limits = StallLimits(floor_s=60, step_factor=4, first_step_s=900, checkpoint_s=1200, startup_s=1800)
    assert limits.for_phase("step") == 900  # nothing measured: the first step's allowance
    limits.observe_step(300.0)  # compilation and warm-up: does not size later steps once one exists
    assert limits.for_phase("step") == 1200  # only the first step so far: 4 x 300
    limits.observe_step(5.0)
    assert limits.for_phase("step") == 60  # 4 x 5 = 20 is under the floor
    limits.observe_step(40.0)
    assert limits.for_phase("step") == 160  # 4 x the slowest (40), not the latest
    limits.observe_step(10.0)
    assert limits.for_phase("step") == 160
    assert limits.for_phase("checkpoint") == 1200 and limits.for_phase("startup") == 1800
    assert limits.for_phase("first_step") == limits.for_phase("eval") == 900


def test_bad_limits_and_phases_fail_loudly():
    with pytest.raises(ValueError, match="floor_s"):
        StallLimits(floor_s=0)
    with pytest.raises(ValueError, match="step_factor"):
        StallLimits(floor_s=1, step_factor=0.5)
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        StallLimits(floor_s=1).for_phase("warmup")


def test_watchdog_is_on_by_default_and_zero_or_null_turns_it_off(tmp_path):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.supervised import load_supervised_config
    from hpc_rlhf.resilience.stall_guard import StallGuard

    for cfg in (load_config(None, [f"train.output_dir={tmp_path}"]),
                load_supervised_config("sft", None, [f"train.output_dir={tmp_path}", "model.pretrain=m", "data.train_data=[d.jsonl]"])):
        guard = StallGuard.from_config(cfg.train, rank=0, world_size=1)
        assert guard.watchdog is not None and guard.limits.floor_s == cfg.train.watchdog_timeout_s > 0
    for off in ("0", "null"):
        cfg = load_config(None, [f"train.watchdog_timeout_s={off}", f"train.output_dir={tmp_path}"])
        guard = StallGuard.from_config(cfg.train, rank=0, world_size=1)
        assert guard.watchdog is None
        with guard.phase("checkpoint"):  # a disabled guard does nothing, wherever it is used
            guard.step_done(1.0)
