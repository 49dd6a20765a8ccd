"""The recipe catalog (hpc_rlhf/config/recipe_catalog.py) against the files it describes: every recipe in configs/
is listed once, its size and entry point are the file's own, every CI run it claims is a test that exists and trains
with that recipe, and the docs' generated blocks (recipe tables, status paragraphs) are current."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hpc_rlhf.config import recipe_catalog
from hpc_rlhf.config.recipe_catalog import RECIPES, GpuRun, Recipe

ROOT = Path(__file__).resolve().parents[2]
BY_FILE = {r.file: r for r in RECIPES}


def test_every_recipe_file_is_listed_once():
    files = [r.file for r in RECIPES]
    assert len(files) == len(set(files)), "a recipe is listed twice"
    assert set(files) == {p.name for p in (ROOT / "configs").glob("*.yaml")}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.file)
def test_size_and_entry_point_are_the_files_own(recipe: Recipe):
    text = (ROOT / "configs" / recipe.file).read_text()
    assert (recipe.ranks is None) != (recipe.nodes is None), "give ranks (CPU) or nodes (GPU), not both"
    if recipe.on_gpu:
        assert yaml.safe_load(text)["slurm"]["nodes"] == recipe.nodes
        assert recipe.hardware.startswith(f"{recipe.nodes} node")
        sbatch = re.search(r"slurm/(\w+)\.sbatch", recipe.launch)
        assert sbatch, f"{recipe.file}: launch names no sbatch recipe"
        body = (ROOT / sbatch.group(0)).read_text()
        assert f"ENTRY={recipe.entry}\n" in body
        assert f"configs/{recipe.file}" in body or f"CONFIG=configs/{recipe.file}" in recipe.launch
    else:
        header = re.search(r"--nproc_per_node (\d+) -m hpc_rlhf\.cli\.(\w+) --config configs/" + re.escape(recipe.file),
                           text)
        assert header, f"{recipe.file}: no torchrun line in its header"
        assert (int(header.group(1)), header.group(2)) == (recipe.ranks, recipe.entry)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.ci is not None], ids=lambda r: r.file)
def test_a_ci_run_names_a_test_that_trains_with_the_recipe(recipe: Recipe):
    assert recipe.ci is not None
    path, function = recipe.ci.test.split("::")
    source = (ROOT / path).read_text()
    assert re.search(rf"^def {function}\(", source, flags=re.MULTILINE), f"{recipe.ci.test} does not exist"
    assert recipe.file in source, f"{path} never reads configs/{recipe.file}"


def test_every_label_says_where_or_never():
    for recipe in RECIPES:
        label = recipe.label()
        assert label, recipe.file
        ran = recipe.ci or recipe.gpu_runs or recipe.manual_runs
        assert ("never run" in label) == (not ran and not recipe.covered_by), recipe.file


def test_no_gpu_recipe_reads_as_run_until_a_gpu_run_is_recorded():
    status = recipe_catalog.gpu_status()
    assert "None of the 6 GPU recipes has run on a GPU yet" in status
    assert all(r.label() == "**never run**" for r in RECIPES if r.on_gpu)


def test_a_recorded_gpu_run_changes_the_status_everywhere(monkeypatch):
    ran = replace(BY_FILE["ppo_70b.yaml"], gpu_runs=(GpuRun("2027-01-02", "64x H100 80GB", "10 steps"),))
    monkeypatch.setattr(recipe_catalog, "RECIPES", tuple(ran if r.file == ran.file else r for r in RECIPES))
    assert "`ppo_70b.yaml` (2027-01-02, 64x H100 80GB)" in recipe_catalog.gpu_status()
    assert "GPU 2027-01-02, 64x H100 80GB: 10 steps" in "\n".join(recipe_catalog.gpu_table())
    # the committed pages now disagree with the catalog: --check fails, naming them
    assert set(recipe_catalog.stale_files()) == {"README.md", "docs/index.md", "docs/getting-started.md",
                                                 "docs/recipes.md"}


def test_generated_blocks_are_current():
    assert recipe_catalog.stale_files() == [], "run python -m hpc_rlhf.config.recipe_catalog"
    assert recipe_catalog.main(["--check"]) == 0


def test_a_page_without_its_block_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"docs/index\.md has no <!-- recipe-catalog:status-home -->"):
        recipe_catalog.render_file(ROOT / "docs/index.md", "# hpc-rlhf\n")


def test_plan_says_when_a_gpu_recipe_never_ran(capsys):
    from hpc_rlhf.cli.plan import plan

    assert plan(["--config", str(ROOT / "configs/grpo_qwen2.5_7b.yaml"), "--nodes", "1", "--gpus-per-node", "8"]) == 0
    assert "note: configs/grpo_qwen2.5_7b.yaml has never finished a run on GPUs" in capsys.readouterr().out
    assert recipe_catalog.untried_recipe_note(ROOT / "configs/grpo_tiny_cpu.yaml") is None  # CPU recipes: no note
    assert recipe_catalog.untried_recipe_note("my_recipe.yaml") is None


def test_a_recorded_gpu_run_silences_the_note(monkeypatch):
    ran = replace(BY_FILE["sft_llama3_8b.yaml"], gpu_runs=(GpuRun("2027-01-02", "8x H100 80GB", "1 epoch"),))
    monkeypatch.setattr(recipe_catalog, "RECIPES", tuple(ran if r.file == ran.file else r for r in RECIPES))
    assert recipe_catalog.untried_recipe_note(ROOT / "configs/sft_llama3_8b.yaml") is None
    assert recipe_catalog.untried_recipe_note(ROOT / "configs/dpo_llama3_8b.yaml") is not None


def _resolved(recipe: Recipe):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.config.supervised import load_supervised_config

    path = ROOT / "configs" / recipe.file
    kind = recipe.entry.removeprefix("train_")
    return load_config(path) if kind == "ppo" else load_supervised_config(kind, path)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.on_gpu], ids=lambda r: r.file)
def test_the_numbers_a_gpu_recipe_summary_gives_are_the_files(recipe: Recipe):
    """ZeRO stage, vLLM TP and engines, samples per prompt, lengths, ring size, host Adam, colocation: what the
    recipes table says of a GPU recipe is what its file runs."""
    cfg = _resolved(recipe)
    text = recipe.summary
    claims = 0
    if m := re.search(r"ZeRO-(\d)", text):
        assert int(m.group(1)) == cfg.ds.zero_stage
        claims += 1
    if m := re.search(r"vLLM TP (\d+)", text):
        assert int(m.group(1)) == cfg.rollout.tensor_parallel_size
        claims += 1
    if m := re.search(r"(\d+) engines", text):
        assert int(m.group(1)) == recipe.nodes * 8 // cfg.rollout.tensor_parallel_size  # type: ignore[operator]
        claims += 1
    if m := re.search(r"(\d+) samples per prompt", text):
        assert int(m.group(1)) == cfg.rollout.n_samples_per_prompt
        claims += 1
    if m := re.search(r"(\d+)k-token responses", text):
        assert int(m.group(1)) * 1024 == cfg.rollout.generate_max_len
        claims += 1
    if m := re.search(r"(\d+)k-token samples", text):
        assert int(m.group(1)) * 1024 == cfg.data.max_len
        claims += 1
    if m := re.search(r"ring attention over (\d+) GPUs", text):
        assert int(m.group(1)) == cfg.ds.ring_attn_size
        claims += 1
    assert ("Adam states on the host" in text) == bool(cfg.ds.adam_offload)
    if recipe.entry == "train_ppo":
        assert ("colocated" in text) == cfg.train.colocate_all
    assert claims >= 1, f"{recipe.file}: the summary states no number this test checks"
