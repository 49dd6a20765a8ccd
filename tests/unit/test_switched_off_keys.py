"""Keys that another key switches off are refused or warned about (``hpc_rlhf.config.switched_off``); the loss
settings that differ from their papers (SAPO's aggregation, CISPO's lower bound) follow the papers or warn."""

from __future__ import annotations

import pytest

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.config.advice import config_warnings
from hpc_rlhf.config.switched_off import RULES

# a valid asynchronous layout
ASYNC = ["train.async_train=true", "train.colocate_all=false", "actor.num_ranks=1", "rollout.num_engines=1"]
# dependent key -> (a non-default value, overrides that switch its gate on)
CASES = {
    "algo.kl.use_loss": ("true", ["algo.kl.init_coef=0.01"]),
    "algo.kl.target": ("6.0", ["algo.kl.init_coef=0.01"]),
    "algo.kl.estimator": ("k3", ["algo.kl.init_coef=0.01"]),
    "algo.kl.horizon": ("500", ["algo.kl.init_coef=0.01", "algo.kl.target=6.0"]),
    "algo.sapo_tau_pos": ("2.0", ["algo.policy_loss_type=sapo"]),
    "algo.sapo_tau_neg": ("2.0", ["algo.policy_loss_type=sapo"]),
    "algo.eps_clip_low": ("0.1", ["algo.policy_loss_type=ppo"]),
    "algo.eps_clip_high": ("0.28", ["algo.policy_loss_type=ppo"]),
    "algo.is_truncation": ("[0.1,5.0]", ["algo.is_correction=tis"]),
    "algo.dynamic_filtering_reward_range": ("[0.1,0.9]", ["algo.dynamic_filtering=true"]),
    "rollout.dynamic_filtering_max_rounds": ("7", ["algo.dynamic_filtering=true"]),
    "algo.overlong_penalty_factor": ("0.5", ["algo.overlong_buffer_len=4"]),
    "vllm.sleep_level": ("2", []),
    "logger.wandb_project": ("mine", ["logger.use_wandb=true"]),
    "logger.wandb_run_name": ("run1", ["logger.use_wandb=true"]),
    "train.partial_rollout": ("true", [*ASYNC, "train.max_staleness=2"]),
    "train.async_queue_size": ("2", [*ASYNC, "train.max_staleness=2"]),
    "train.max_staleness": ("3", ASYNC),
    "train.staleness_policy": ("drop", ASYNC),
    "rollout.partial_chunk_tokens": ("4", [*ASYNC, "train.partial_rollout=true", "train.max_staleness=2"]),
    "eval.steps": ("5", ["eval.data=[held.jsonl]"]),
    "eval.n_samples_per_prompt": ("4", ["eval.data=[held.jsonl]"]),
    "eval.temperature": ("0.3", ["eval.data=[held.jsonl]"]),
    "eval.max_samples": ("10", ["eval.data=[held.jsonl]"]),
    "eval.at_start": ("true", ["eval.data=[held.jsonl]"]),
    "eval.pass_threshold": ("0.9", ["eval.data=[held.jsonl]"]),
    "ckpt.best_mode": ("min", ["ckpt.best_metric=eval/reward", "ckpt.save_hf=true"]),
    "algo.distill_coef": ("2.0", ["teacher.pretrain=/models/teacher"]),
    "ds.lora.alpha": ("32", ["ds.lora.rank=8"]),
    "ds.lora.dropout": ("0.1", ["ds.lora.rank=8"]),
    "ds.lora.target_modules": ("[q_proj]", ["ds.lora.rank=8"]),
    "train.agent_max_turns": ("3", ["train.agent_func_path=agent.py"]),
    "train.agent_step_timeout_s": ("5", ["train.agent_func_path=agent.py"]),
    "train.agent_episode_timeout_s": ("50", ["train.agent_func_path=agent.py"]),
    "train.agent_kwargs": ("{a: 1}", ["train.agent_func_path=agent.py"]),
}
# what switches each one off, where the default does not
GATE_OFF = {"algo.eps_clip_low": ["algo.policy_loss_type=sapo"], "algo.eps_clip_high": ["algo.policy_loss_type=sapo"],
            "vllm.sleep_level": ["vllm.enable_sleep=false"]}


def test_every_rule_has_a_case_here():
    assert {rule.key for rule in RULES} == set(CASES)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.key)
def test_a_switched_off_key_is_refused_or_warned_naming_both_keys_and_only_then(rule):
    value, gate_on = CASES[rule.key]
    overrides = [f"{rule.key}={value}", *GATE_OFF.get(rule.key, [])]
    if rule.refuse:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert rule.key in str(err.value) and rule.gate_key in str(err.value)
    else:
        lines = [w for w in config_warnings(load_config(None, overrides)) if w.startswith(rule.key + "=")]
        assert len(lines) == 1 and rule.gate_key in lines[0]
    on = load_config(None, [f"{rule.key}={value}", *gate_on])
    assert not [w for w in config_warnings(on) if w.startswith(rule.key + "=")]
    # the default value never fires, even with the gate off
    assert not [w for w in config_warnings(load_config(None, GATE_OFF.get(rule.key, [])))
                if w.startswith(rule.key + "=")]


def test_kl_loss_with_a_zero_coefficient_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"algo\.kl\.use_loss=True has no effect with algo\.kl\.init_coef=0"):
        load_config(None, ["algo.kl.use_loss=true"])
    assert load_config(None, ["algo.kl.use_loss=true", "algo.kl.init_coef=0.001"]).algo.kl.use_loss


def test_sapo_averages_per_sequence_unless_told_otherwise():
    assert load_config(None, ["algo.policy_loss_type=sapo"]).algo.agg_mode == "seq_mean_token_mean"
    assert load_config(None, ["algo.policy_loss_type=sapo", "algo.loss_agg_mode=token_mean"]).algo.agg_mode \
        == "token_mean"
    for loss in ("ppo", "gspo", "cispo"):
        assert load_config(None, [f"algo.policy_loss_type={loss}"]).algo.agg_mode == "token_mean"


def test_cispo_with_a_lower_bound_warns_and_without_one_does_not():
    warned = [w for w in config_warnings(load_config(None, ["algo.policy_loss_type=cispo"])) if "cispo" in w]
    assert len(warned) == 1 and "algo.eps_clip_low=0.2" in warned[0] and "0.8" in warned[0]
    assert not config_warnings(load_config(None, ["algo.policy_loss_type=cispo", "algo.eps_clip_low=1",
                                                  "algo.eps_clip_high=4"]))


def test_plan_prints_the_warnings_and_refuses_the_refused(capsys):
    from pathlib import Path

    from hpc_rlhf.cli.plan import plan

    recipe = str(Path(__file__).resolve().parents[2] / "configs/ppo_70b.yaml")
    plan(["--config", recipe, "--nodes", "8", "--gpus-per-node", "8", "algo.policy_loss_type=cispo",
          "algo.sapo_tau_pos=2"])
    out = capsys.readouterr().out
    assert "plan: warning: algo.sapo_tau_pos=2.0 has no effect with algo.policy_loss_type='cispo'" in out
    assert "plan: warning: algo.policy_loss_type=cispo with algo.eps_clip_low=0.2" in out
    assert plan(["--config", recipe, "--nodes", "8", "--gpus-per-node", "8", "algo.kl.init_coef=0",
                 "algo.kl.use_loss=true"]) == 1
    assert "algo.kl.use_loss=True has no effect with algo.kl.init_coef=0.0" in capsys.readouterr().err
