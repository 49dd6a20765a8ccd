"""The configuration reference page (docs/reference/configuration.md) is generated from the typed schema: it must
equal a fresh generation, cover every key, and give every key a description; the OpenRLHF migration table may only
name keys that exist."""

from __future__ import annotations

from hpc_rlhf.config.reference import LOSS_SECTIONS, PAGE, all_key_docs, iter_keys, main, openrlhf_flags, render
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.config.supervised import SupervisedRunConfig


def test_page_is_the_generated_one():
    assert PAGE.read_text() == render(), "docs/reference/configuration.md is stale: python -m hpc_rlhf.config.reference"
    assert main(["--check"]) == 0


def test_every_key_is_on_the_page_with_a_description():
    page = PAGE.read_text()
    rl_keys = [key for key, _ in iter_keys(RunConfig)]
    offline_keys = [key for key, _ in iter_keys(SupervisedRunConfig)]
    assert len(rl_keys) > 150 and offline_keys
    for key in [*rl_keys, *offline_keys]:
        assert f"| `{key}` |" in page, key
    undescribed = sorted({d.key for d in all_key_docs() if not d.description})
    assert not undescribed, f"keys without a description (add Field(description=...)): {undescribed}"


def test_the_openrlhf_table_names_only_real_keys():
    known = {key for key, _ in iter_keys(RunConfig)} | {key for key, _ in iter_keys(SupervisedRunConfig)}
    known |= {key for loss in LOSS_SECTIONS.values() for key, _ in iter_keys(loss, "loss.")}
    flags = openrlhf_flags()
    assert flags["actor.learning_rate"] == ["--actor_learning_rate"] and "ds.zero_stage" in flags
    unknown = sorted(key for key in flags if key not in known)
    assert not unknown, f"docs/openrlhf_flags.md maps flags to keys that do not exist: {unknown}"
