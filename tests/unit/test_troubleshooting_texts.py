"""docs/troubleshooting.md quotes the errors and warnings the code prints: each line of its plain fenced blocks
(no language tag) is produced here by the real code path, and must match the real text.

A doc line becomes a regex: ``<...>`` placeholders (they may nest) and a trailing or inner ``...`` match any
text, a run of digits (``99.4``, ``step_200``) matches any number, everything else is literal. The line must
match the whole message or one whole line of it. ``TRIGGERS`` maps a distinctive prefix of each doc line to a
cheap call that makes the code say it; a quote without a trigger, or a trigger whose quote left the doc, fails.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "troubleshooting.md"

_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
ELLIPSIS = "..."


# ----------------------------------------------------------------------------- reading the doc


def quoted_lines(markdown: str) -> list[str]:
    """The non-blank lines of every fenced block opened without a language tag (a bare ```` ``` ````), in
    order; blocks tagged ``bash``, ``yaml``... are commands or files, not texts the code prints."""
    lines: list[str] = []
    fence: str | None = None  # the opening fence of the block we are in
    plain = False
    for line in markdown.splitlines():
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, plain = match.group(1), not match.group(2).strip()
            continue
        closing = match is not None and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)
        if closing and not match.group(2).strip():
            fence = None
            continue
        if plain and line.strip():
            lines.append(line)
    return lines


def _placeholder_end(line: str, start: int) -> int | None:
    """Index just past the ``>`` closing the placeholder opened at ``line[start] == '<'`` (placeholders nest:
    ``<a free port in [<floor>, <first>)>``); None when it is never closed (then ``<`` is literal text)."""
    depth = 0
    for i in range(start, len(line)):
        if line[i] == "<":
            depth += 1
        elif line[i] == ">":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def doc_line_pattern(line: str) -> re.Pattern[str]:
    """The regex a doc line stands for: a ``<...>`` placeholder (outermost, nesting included) or ``...`` matches
    any text, a number matches any number, every other character is itself."""
    parts: list[str] = []
    i = 0
    while i < len(line):
        end = _placeholder_end(line, i) if line[i] == "<" else None
        number = _NUMBER.match(line, i)
        if end is not None:
            parts.append(".+")
            i = end
        elif line.startswith(ELLIPSIS, i):
            parts.append(".*")
            i += len(ELLIPSIS)
        elif number:
            parts.append(r"\d+(?:\.\d+)?")
            i = number.end()
        else:
            parts.append(re.escape(line[i]))
            i += 1
    return re.compile("".join(parts))


def doc_line_matches(line: str, message: str) -> bool:
    """True when ``line`` (a doc quote) matches the whole ``message`` or one whole line of it."""
    pattern = doc_line_pattern(line)
    return any(pattern.fullmatch(candidate) for candidate in [message, *message.splitlines()])


# ----------------------------------------------------------------------------- capturing what the code says


@contextlib.contextmanager
def _logged(logger_name: str) -> Iterator[list[str]]:
    """The messages logged (WARNING and up) under ``logger_name`` while the block runs."""
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, level = _Keep(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _raised(call: Callable[[], object], kind: type[BaseException] = Exception) -> str:
    """The message of the ``kind`` error ``call`` raises (fails when it raises none)."""
    with pytest.raises(kind) as info:
        call()
    return str(info.value)


def _plan_stderr(*argv: str) -> str:
    """``hpc-rlhf plan``'s stderr, run in-process (pure Python: no model is loaded)."""
    from hpc_rlhf.cli.plan import plan

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert plan(list(argv)) == 1
    return err.getvalue()


def _config(recipe: str, *overrides: str):
    from hpc_rlhf.config import load_config

    return load_config(ROOT / "configs" / recipe, overrides)


def _placement_error(recipe: str, world_size: int, *overrides: str) -> str:
    from hpc_rlhf.world.placement import PlacementError, build_placement

    cfg = _config(recipe, *overrides)
    return _raised(lambda: build_placement(cfg, world_size), PlacementError)


# ----------------------------------------------------------------------------- triggers, one per message


def unknown_config_key(tmp_path: Path) -> str:
    from hpc_rlhf.config import ConfigError, load_config

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the message names the recipe as given, relative here
        return _raised(lambda: load_config("configs/grpo_tiny_cpu.yaml", ["algo.kl.init_cof=0.1"]), ConfigError)


def roles_do_not_add_up(tmp_path: Path) -> str:
    return _placement_error("grpo_tiny_cpu.yaml", 2, "train.colocate_all=false", "actor.num_ranks=2",
                            "rollout.num_engines=1")


def roles_left_unsized(tmp_path: Path) -> str:
    return _placement_error("ppo_tiny_cpu.yaml", 4, "train.colocate_all=false", "actor.num_ranks=2")


def role_sized_while_colocated(tmp_path: Path) -> str:
    return _placement_error("grpo_tiny_cpu.yaml", 8, "actor.num_ranks=4")


def role_not_split_by_parallel_sizes(tmp_path: Path) -> str:
    return _placement_error("grpo_tiny_cpu.yaml", 3, "ds.tensor_parallel_size=2")


def zero3_on_a_subset(tmp_path: Path) -> str:
    # ppo_70b (ZeRO-3) with actor+ref on 24 ranks, critic+reward on 24, vLLM on 16
    return _placement_error("ppo_70b.yaml", 64, "train.colocate_all=false", "train.colocate_actor_ref=true",
                            "train.colocate_critic_reward=true", "actor.num_ranks=24", "critic.num_ranks=24",
                            "vllm.enable_sleep=false")


def external_launcher_on_a_subset(tmp_path: Path) -> str:
    return _placement_error("grpo_vllm_tiny_cpu.yaml", 3, "train.colocate_all=false", "actor.num_ranks=1",
                            "rollout.vllm_mode=external_launcher")


def server_process_over_several_gpus(tmp_path: Path) -> str:
    return _placement_error("grpo_vllm_tiny_cpu.yaml", 3, "train.colocate_all=false", "actor.num_ranks=1",
                            "rollout.vllm_mode=server_process", "rollout.tensor_parallel_size=2")


def plan_does_not_fit(tmp_path: Path) -> str:
    # 24 GB GPUs less the 10 % headroom: 21.6 GiB usable
    return _plan_stderr("--config", str(ROOT / "configs/grpo_qwen2.5_7b.yaml"), "--nodes", "1", "--gpus-per-node",
                        "8", "--gpu-mem-gb", "24")


def plan_grace_too_short(tmp_path: Path) -> str:
    return _plan_stderr("--config", str(ROOT / "configs/grpo_qwen2.5_7b.yaml"), "--nodes", "1", "--gpus-per-node",
                        "8", "slurm.signal_grace_s=30")


def _watchdog_header(stream: io.StringIO) -> str:
    """The ``[rank N] watchdog: ...`` lines of a dump, without the stacks."""
    return "\n".join(line for line in stream.getvalue().splitlines() if line.startswith("[rank "))


def watchdog_fires(tmp_path: Path) -> str:
    from hpc_rlhf.resilience.watchdog import STALL_EXIT_CODE, Watchdog

    stream = io.StringIO()
    watchdog = Watchdog(60, rank=3, exit_code=STALL_EXIT_CODE, stream=stream, backstop=False)
    watchdog.set_limit(90, "step")  # what StallGuard does entering a phase
    watchdog.dump(idle_s=92.0)  # what the watchdog thread calls after 92 s without a beat (never started here)
    return _watchdog_header(stream)


def _heartbeats(directory: Path, world_size: int, stale_rank: int, stale_s: float, beats: int) -> None:
    """Heartbeat files as the watchdogs of ``world_size`` ranks write them, ``stale_rank``'s ``stale_s`` old."""
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for rank in range(world_size):
        written = now - stale_s if rank == stale_rank else now
        (directory / f"rank_{rank}").write_text(f"{beats} {written:.3f}\n")


def watchdog_names_a_silent_rank(tmp_path: Path) -> str:
    from hpc_rlhf.resilience.watchdog import Watchdog

    _heartbeats(tmp_path / "heartbeats", 6, stale_rank=5, stale_s=95, beats=1230)
    stream = io.StringIO()
    Watchdog(90, rank=0, stream=stream, backstop=False, heartbeat_dir=tmp_path / "heartbeats",
             world_size=6).dump(idle_s=92.0)
    return _watchdog_header(stream)


def survivor_names_the_dead_peer(tmp_path: Path) -> str:
    import torch.distributed as dist

    from hpc_rlhf.resilience.stall_guard import HEARTBEAT_DIR, StallGuard
    from hpc_rlhf.resilience.stall_limits import StallLimits

    guard = StallGuard(StallLimits(floor_s=60), tmp_path, rank=2, world_size=6)
    _heartbeats(tmp_path / HEARTBEAT_DIR, 6, stale_rank=5, stale_s=31, beats=880)
    with _logged("hpc_rlhf.resilience.stall_guard") as messages:
        guard.explain_failure(dist.DistBackendError("Connection reset by peer"), wait_s=0)
    return "\n".join(messages)


def master_port_in_use(tmp_path: Path) -> str:
    from hpc_rlhf.world.launch_env import MasterPortInUseError, detect_launch_env, listen_on_master_port

    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(port)})
        with pytest.raises(MasterPortInUseError) as info:
            listen_on_master_port(env)
    return f"{type(info.value).__name__}: {info.value}"  # the last line of the traceback


def no_route_to_another_node(tmp_path: Path) -> str:
    from hpc_rlhf.world import network
    from hpc_rlhf.world.launch_env import LaunchEnv

    env = LaunchEnv(launcher="slurm", rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0,
                    num_nodes=2, master_addr="127.0.0.1", master_port=20001, nodes=("127.0.0.1", "localhost"))

    class Store:  # node 1 reported no address either
        def set(self, key: str, value: str) -> None:
            pass

        def get(self, key: str) -> bytes:
            return b""

    with _logged("hpc_rlhf.world.network") as messages:
        choice = network.configure_socket_interfaces(env, {})
        network.learn_interface_from_peers(env, choice, Store(), {})
    return "\n".join(messages)


def _checkpoints(root: Path, *steps: int):
    from hpc_rlhf.ckpt import CheckpointManager

    manager = CheckpointManager(root, max_num=None)
    for step in steps:
        with manager.saving(step) as tmp:
            (tmp / "model.bin").write_bytes(b"weights %d" % step)
    return manager


def damaged_checkpoint_skipped(tmp_path: Path) -> str:
    manager = _checkpoints(tmp_path / "ckpt", 100, 200)
    (manager.step_dir(200) / "model.bin").write_bytes(b"trunc")
    with _logged("hpc_rlhf.ckpt.atomic") as messages:
        assert manager.latest_verified() == manager.step_dir(100)
    return "\n".join(messages)


def no_checkpoint_verifies(tmp_path: Path) -> str:
    manager = _checkpoints(tmp_path / "ckpt", 200)
    model = manager.step_dir(200) / "model.bin"
    model.write_bytes(b"x" * model.stat().st_size)  # same size, other bytes
    return _raised(manager.latest_verified, RuntimeError)


def traces_of_an_earlier_run(tmp_path: Path) -> str:
    manager = _checkpoints(tmp_path / "ckpt", 200)
    (manager.step_dir(200) / "COMPLETE").unlink()
    return _raised(manager.latest_verified, RuntimeError)


def vllm_not_installed(tmp_path: Path) -> str:
    from hpc_rlhf.rollout.vllm_external_launcher import import_vllm

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
        return _raised(import_vllm, ImportError)


def _bad_prompt_file(tmp_path: Path, bad_line: int, bad_row: str) -> str:
    """The DataError of ``data/prompts.jsonl`` (relative, as a config names it) whose line ``bad_line`` is bad."""
    from hpc_rlhf.data.prompts import PromptDataset
    from hpc_rlhf.data.sources import DataError

    good = '{"input": "What is 2 + 2?", "label": "4"}'
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text("\n".join([good] * (bad_line - 1) + [bad_row]) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        return _raised(lambda: PromptDataset(["data/prompts.jsonl"], input_key="input", label_key="label"),
                       DataError)


def prompt_key_missing(tmp_path: Path) -> str:
    return _bad_prompt_file(tmp_path, 7, '{"question": "What is 2 + 2?", "label": "4"}')


def prompt_line_not_json(tmp_path: Path) -> str:
    return _bad_prompt_file(tmp_path, 12, '{"input": "What is 2 + 2?" "label": "4"}')


def prompt_empty(tmp_path: Path) -> str:
    return _bad_prompt_file(tmp_path, 3, '{"input": "  ", "label": "4"}')


def no_reward_source(tmp_path: Path) -> str:
    from hpc_rlhf.trainers.rl.setup import ControllerState, SetupError

    cfg = _config("grpo_tiny_cpu.yaml", "reward.reward_func_path=null")
    return _raised(lambda: ControllerState(cfg, tokenizer=None), SetupError)


# A distinctive prefix of each quoted doc line -> the call that makes the code print it.
TRIGGERS: dict[str, Callable[[Path], str]] = {
    "invalid config (": unknown_config_key,
    "  algo.kl.init_cof: unknown key": unknown_config_key,
    "disaggregated layout needs": roles_do_not_add_up,
    "disaggregated layout: set the rank counts": roles_left_unsized,
    "train.colocate_all puts every role": role_sized_while_colocated,
    "<role> has <N> ranks, not a multiple": role_not_split_by_parallel_sizes,
    "ds.zero_stage=3 needs train.colocate_all=true": zero3_on_a_subset,
    "rollout.vllm_mode=external_launcher needs": external_launcher_on_a_subset,
    "rollout.vllm_mode=server_process runs one single-GPU engine": server_process_over_several_gpus,
    "plan: does not fit": plan_does_not_fit,
    "plan: the USR1 warning comes": plan_grace_too_short,
    "[rank 3] watchdog: no progress": watchdog_fires,
    "[rank 0] watchdog: rank 5 stopped checking in": watchdog_names_a_silent_rank,
    "rank 2 stops after DistBackendError": survivor_names_the_dead_peer,
    "MasterPortInUseError: master port": master_port_in_use,
    "checkpoint <root>/step_200 is damaged": damaged_checkpoint_skipped,
    "checkpoint root <root>: resuming from": damaged_checkpoint_skipped,
    "no checkpoint under <root> verifies": no_checkpoint_verifies,
    "  step_200: ": no_checkpoint_verifies,
    "restore the damaged files": no_checkpoint_verifies,
    "no complete checkpoint under <root>": traces_of_an_earlier_run,
    "restore the checkpoint, point ckpt.path elsewhere": traces_of_an_earlier_run,
    "rollout.backend=vllm needs vLLM": vllm_not_installed,
    "data/prompts.jsonl: line 7: key 'input': missing": prompt_key_missing,
    "data/prompts.jsonl: line 12: invalid JSON": prompt_line_not_json,
    "data/prompts.jsonl: line 3: key 'input': empty prompt": prompt_empty,
    "no reward source": no_reward_source,
    "rank <r> of a <n>-node job: no route": no_route_to_another_node,
}

DOC_LINES = quoted_lines(DOC.read_text(encoding="utf-8"))


def _trigger_of(line: str) -> Callable[[Path], str]:
    owners = [prefix for prefix in TRIGGERS if line.startswith(prefix)]
    assert len(owners) == 1, f"doc line {line!r} needs exactly one entry in TRIGGERS, has {owners}"
    return TRIGGERS[owners[0]]


# ----------------------------------------------------------------------------- tests


def test_the_doc_quotes_messages_and_every_entry_is_quoted():
    assert len(DOC_LINES) >= len(TRIGGERS) > 20  # the doc's blocks were found
    for line in DOC_LINES:
        _trigger_of(line)  # a new quote needs a trigger
    stale = [prefix for prefix in TRIGGERS if not any(line.startswith(prefix) for line in DOC_LINES)]
    assert not stale, f"TRIGGERS entries whose doc line is gone from {DOC.name}: {stale}"


@pytest.mark.parametrize("line", DOC_LINES, ids=[line.strip()[:60] for line in DOC_LINES])
def test_quoted_line_is_what_the_code_says(line, tmp_path):
    message = _trigger_of(line)(tmp_path)
    assert doc_line_matches(line, message), (
        f"{DOC.name} quotes:\n  {line}\nbut the code says:\n  " + message.replace("\n", "\n  "))


def test_quoted_lines_come_from_untagged_blocks_only():
    markdown = "text\n```\nerror one\n\n  indented two\n```\n```bash\nls\n```\n````\nfour ``` ticks\n````\n"
    assert quoted_lines(markdown) == ["error one", "  indented two", "four ``` ticks"]


def test_placeholders_nest_and_numbers_and_ellipses_match_anything():
    line = "port <p> outside <a free port in [<floor>, <first>) or more>; took 99.4 GiB > 21.6 GiB; ..."
    assert doc_line_matches(line, "port 29500 outside 30000-32767 (a range); took 7 GiB > 70.25 GiB; then more")
    assert not doc_line_matches(line, "port 29500 outside x; took 7 GiB >= 70 GiB; more")  # literal text counts
    assert not doc_line_matches("rank 5 stopped", "rank five stopped")  # a number matches numbers only
    assert doc_line_matches("a <b> c", "first line\na b c") and not doc_line_matches("a <b> c", "xa b c")
    assert doc_line_matches("x < y", "x < y")  # an unclosed '<' is literal
