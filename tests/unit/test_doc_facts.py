"""Facts the user guides state about the code, checked against the code (as test_troubleshooting_texts.py does for
quoted messages): the order of reward sources in docs/rewards.md, the time-limit warnings of the sbatch recipes in
docs/slurm.md, and every configuration default a guide writes next to its key."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.config.reference import all_key_docs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


# ----------------------------------------------------------------------------- reward sources (docs/rewards.md)

# One setting that turns each source on (keys as the doc names them, first backticked key of each list item).
SOURCE_SETTINGS = {
    "reward.reward_func_path": [f"reward.reward_func_path={ROOT / 'examples/reward_funcs/arithmetic.py'}"],
    "reward.remote_url": ["reward.remote_url=[http://127.0.0.1:5000/get_reward]"],
    "reward.pretrain": ["reward.pretrain=/models/rm"],
    "train.agent_func_path": [f"train.agent_func_path={ROOT / 'examples/agents/math_retry_agent.py'}"],
    "data.reasoning_gym.task": ["data.reasoning_gym.task=basic_arithmetic"],
}


def documented_reward_order(markdown: str) -> list[str]:
    """The keys of the numbered list after "needs one reward source", in the doc's order."""
    section = markdown[markdown.index("needs one reward source"):]
    section = section[:section.index("\n\n", section.index("\n1. "))]
    return [re.search(r"`([\w.]+)`", item).group(1)  # type: ignore[union-attr]
            for item in re.findall(r"^\d+\. (.*)$", section, flags=re.MULTILINE)]


def scoring_source(overrides: list[str]) -> str:
    """Which source the trainer's own set-up makes score a run with these overrides."""
    from hpc_rlhf.data.reasoning_gym import reasoning_gym_reward
    from hpc_rlhf.rewards.functions import RewardFunction
    from hpc_rlhf.rewards.remote_rm import RemoteRewardModel
    from hpc_rlhf.trainers.rl.setup import reward_function

    cfg = load_config(None, overrides)
    scorer = reward_function(cfg)
    if isinstance(scorer, RewardFunction):
        return "reward.reward_func_path"
    if isinstance(scorer, RemoteRewardModel):
        return "reward.remote_url"
    if cfg.needs_reward_model:  # its scores replace every row's reward (controller_steps.attach_rewards)
        return "reward.pretrain"
    if scorer is reasoning_gym_reward:
        return "data.reasoning_gym.task"
    assert scorer is None and cfg.train.agent_func_path
    return "train.agent_func_path"


def test_the_documented_reward_order_is_the_codes():
    order = documented_reward_order((DOCS / "rewards.md").read_text())
    assert sorted(order) == sorted(SOURCE_SETTINGS), order
    for source in order:
        assert scoring_source(SOURCE_SETTINGS[source]) == source
    for first, second in itertools.combinations(order, 2):  # every pair, the earlier one in the doc first
        overrides = SOURCE_SETTINGS[first] + SOURCE_SETTINGS[second]
        if {first, second} == {"reward.reward_func_path", "reward.remote_url"}:
            with pytest.raises(ValueError, match="set only one of reward.remote_url and reward.reward_func_path"):
                load_config(None, overrides)
            continue
        assert scoring_source(overrides) == first, f"{first} and {second} both set"


def test_the_reward_order_parser_sees_a_swap():
    text = (DOCS / "rewards.md").read_text()
    order = documented_reward_order(text)
    swapped = text.replace(f"`{order[0]}`", "@@").replace(f"`{order[2]}`", f"`{order[0]}`").replace(
        "@@", f"`{order[2]}`")
    assert documented_reward_order(swapped)[0] == order[2]


# ----------------------------------------------------------------------------- sbatch recipes (docs/slurm.md)


def _signal_grace(sbatch: str) -> int:
    match = re.search(r"^#SBATCH --signal=USR1@(\d+)$", (ROOT / "slurm" / sbatch).read_text(), flags=re.MULTILINE)
    assert match, f"slurm/{sbatch} asks for no USR1 before its time limit"
    return int(match.group(1))


def documented_graces(markdown: str) -> dict[str, int]:
    """``{sbatch file: seconds}`` from the doc's "the recipes use N s in `a.sbatch`, M s in `b.sbatch` and ..." """
    sentence = re.search(r"the recipes use ([^)]*)\)", markdown)
    assert sentence, "docs/slurm.md no longer says which grace each recipe uses"
    graces = {}
    for seconds, files in re.findall(r"(\d+) s in ((?:`[\w.]+\.sbatch`(?:,? and |, )?)+)", sentence.group(1)):
        for name in re.findall(r"`([\w.]+\.sbatch)`", files):
            graces[name] = int(seconds)
    return graces


def test_the_documented_signal_graces_are_the_recipes():
    graces = documented_graces((DOCS / "slurm.md").read_text())
    gpu_recipes = {p.name for p in (ROOT / "slurm").glob("*.sbatch")} - {"cpu_debug.sbatch"}
    assert set(graces) == gpu_recipes
    assert {name: _signal_grace(name) for name in graces} == graces


# ----------------------------------------------------------------------------- defaults written next to their key

# `key` (default V ...  |  `key` (N s)  |  `key` (N)  |  `key` seconds (default N) | `key` times (N) -- in any guide
_DEFAULT_AFTER_KEY = re.compile(r"`([a-z_]+(?:\.[a-z_]+)+)`,?(?:\s+(?:seconds|times))?\s+"
                                r"\((?:default:?\s+`?([^`),;\s]+)`?|(\d[\d.e+-]*)(?: s)?\))")


def documented_defaults() -> list[tuple[str, str, str]]:
    """``(page, key, value)`` for every default a page under docs/ writes right after a configuration key."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        if page.parent.name == "reference":
            continue  # generated from the schema
        for match in _DEFAULT_AFTER_KEY.finditer(page.read_text()):
            found.append((page.name, match.group(1), match.group(2) or match.group(3)))
    return found


def _same(doc_value: str, code_default: str) -> bool:
    code = json.loads(code_default.strip("`"))
    if isinstance(code, bool) or not isinstance(code, (int, float)):
        return doc_value == str(code)
    try:
        return float(doc_value) == float(code)
    except ValueError:
        return False


def test_every_default_a_guide_states_is_the_schemas():
    defaults = {d.key: d.default for d in all_key_docs()}
    # a null default means "derived from another key", which the guides spell out in words: not compared here
    checked = [(page, key, value) for page, key, value in documented_defaults()
               if key in defaults and defaults[key] != "`null`"]
    assert len(checked) >= 8, checked  # the pattern still finds the guides' defaults
    wrong = [f"{page}: `{key}` says {value}, the code's default is {defaults[key]}"
             for page, key, value in checked if not _same(value, defaults[key])]
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------- resubmitting (docs/checkpoints.md)


def _doc_commands(page: str, start: str) -> list[list[str]]:
    """The shell commands (backslash continuations joined, split by shlex) of ``page``'s bash blocks that begin
    with ``start``."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (DOCS / page).read_text(), flags=re.DOTALL):
        line = block.replace("\\\n", " ").strip()
        if line.startswith(start):
            commands.append(shlex.split(line))
    return commands


def _run_sbatch_here(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``[VAR=value ...] sbatch [--nodes N] [other flags] slurm/<recipe>.sbatch [overrides]`` as SLURM would start
    it on N nodes of 8 GPUs, with ``srun`` stubbed to print its command line (the plan guard runs for real)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("CONFIG", "PLAN_ARGS")}
    while "=" in argv[0]:
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    assert argv.pop(0) == "sbatch"
    nodes = 1
    while argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag.startswith("--nodes"):
            nodes = int(flag.split("=", 1)[1]) if "=" in flag else int(argv.pop(0))
    script, overrides = argv[0], argv[1:]
    env.update(PYTHON=sys.executable, SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS_PER_NODE="8",
               SLURM_TASKS_PER_NODE=f"8(x{nodes})" if nodes > 1 else "8", SLURM_NTASKS=str(8 * nodes),
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="gpu01", SLURM_CPUS_PER_TASK="12", SLURM_RESTART_COUNT="0",
               SLURM_SUBMIT_DIR=str(cwd))
    stub = 'srun() { echo "SRUN $*"; }; export -f srun; bash "$0" "$@"'
    return subprocess.run(["bash", "-c", stub, str(ROOT / script), *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_resubmit_commands_start_a_job_that_loads_the_checkpoint():
    sbatch = [c for c in _doc_commands("checkpoints.md", "PLAN_ARGS=") if "sbatch" in c]
    assert sbatch, "docs/checkpoints.md lost its sbatch resubmit command"
    out = _run_sbatch_here(list(sbatch[0]), ROOT)
    srun = [line for line in out.stdout.splitlines() if line.startswith("SRUN ")]
    assert out.returncode == 0 and srun, out.stdout[-2000:] + out.stderr[-2000:]
    assert srun[0].endswith("ckpt.load=true")
    # the guard checked how this layout loads the checkpoint (none written here yet: a fresh start)
    assert re.search(r"^resume: ", out.stdout, flags=re.MULTILINE), out.stdout[-2000:]
    # without PLAN_ARGS the guard checks the recipe's own, shorter warning and refuses: why the doc gives it
    refused = _run_sbatch_here([arg for arg in sbatch[0] if not arg.startswith("PLAN_ARGS=")], ROOT)
    assert refused.returncode != 0 and "USR1 warning comes" in refused.stdout + refused.stderr


def test_the_submitit_resubmit_command_submits_a_resuming_job(monkeypatch):
    from hpc_rlhf.cli.submit import main as submit

    monkeypatch.chdir(ROOT)  # the doc's paths are relative to the repository root
    commands = _doc_commands("checkpoints.md", "hpc-rlhf submit")
    assert commands, "docs/checkpoints.md lost its submitit resubmit command"
    args = [a.replace("<p>", "gpu") for a in commands[0][2:]]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        submit([*args, "--dry-run"])  # a refused plan exits non-zero (SystemExit)
    printed = buffer.getvalue()
    assert '"signal": "USR1@2400"' in printed
    assert re.search(r"train_ppo --config \S+ .*ckpt\.load=true", printed)


# ----------------------------------------------------------------------------- test paths the docs cite

_TEST_REF = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


def test_every_test_the_docs_cite_exists():
    missing = []
    for page in sorted(DOCS.rglob("*.md")):
        for path, function in set(_TEST_REF.findall(page.read_text())):
            source = ROOT / path
            if not source.is_file():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
            elif function and not re.search(rf"^(?:async )?def {function}\(", source.read_text(), flags=re.MULTILINE):
                missing.append(f"{page.relative_to(ROOT)}: {path}::{function}")
    assert not missing, "\n".join(missing)
