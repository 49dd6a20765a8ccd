from pathlib import Path

import pytest
import yaml

from hpc_rlhf.config import ConfigError, load_config, save_resolved_config

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))


SUPERVISED_KINDS = ("sft", "rm", "dpo", "kto")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    kind = path.name.split("_")[0]
    if kind in SUPERVISED_KINDS:
        from hpc_rlhf.config.supervised import load_supervised_config

        load_supervised_config(kind, path)
    else:
        load_config(path)


def test_overrides_take_precedence(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algo:\n  kl:\n    init_coef: 0.1\nrollout:\n  n_samples_per_prompt: 8\n")
    cfg = load_config(recipe, ["algo.kl.init_coef=0.02", "--actor.learning_rate", "1e-6", "--train.seed=7"])
    assert cfg.algo.kl.init_coef == 0.02
    assert cfg.actor.learning_rate == 1e-6
    assert cfg.train.seed == 7
    assert cfg.rollout.n_samples_per_prompt == 8


def test_unknown_key_names_key_and_alternatives(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algo:\n  kl:\n    init_cof: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    msg = str(err.value)
    assert "algo.kl.init_cof" in msg and "init_coef" in msg and str(recipe) in msg


def test_unknown_section():
    with pytest.raises(ConfigError, match=r"trainer: unknown key; allowed here: .*train"):
        load_config(None, ["trainer.seed=1"])


@pytest.mark.parametrize(
    "override,match",
    [
        ("algo.advantage_estimator=ppo", "algo.advantage_estimator"),
        ("vllm.gpu_memory_utilization=1.5", "vllm.gpu_memory_utilization"),
        ("ds.zero_stage=4", "ds.zero_stage"),
        ("train.colocate_all=perhaps", "train.colocate_all"),
        ("rollout.n_samples_per_prompt=1", "n_samples_per_prompt >= 2"),
        ("train.train_batch_size=7", "multiple of train.train_batch_size"),
        ("rollout.agent_max_images_per_request=0", "rollout.agent_max_images_per_request"),
        ("rollout.agent_max_pixels_per_image=0", "rollout.agent_max_pixels_per_image"),
        ("rollout.agent_endpoint_max_connections=0", "rollout.agent_endpoint_max_connections"),
        ("rollout.agent_endpoint_first_request_timeout_s=0", "rollout.agent_endpoint_first_request_timeout_s"),
        ("rollout.agent_endpoint_first_request_timeout_s=-1", "rollout.agent_endpoint_first_request_timeout_s"),
    ],
)
def test_bad_values_fail_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_async_with_colocation_rejected():
    with pytest.raises(ConfigError, match="async_train"):
        load_config(None, ["train.async_train=true"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["algo.gamma"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["algo.kl.init_coef=0.05", "train.output_dir=" + str(tmp_path)])
    path = save_resolved_config(cfg, cfg.train.output_dir)
    assert path.parent == tmp_path
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["algo"]["kl"]["init_coef"] == 0.05
