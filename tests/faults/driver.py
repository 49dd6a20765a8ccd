"""Fault-injection driver: run the tiny GRPO recipe on 2 ranks, inject one fault at a chosen point, resume to the end.

A fault is injected where a rank *is*, not after a guessed sleep: the run is started with
``HPC_RLHF_FAULT_AT=<phase>:<step>:<rank>`` (``hpc_rlhf.resilience.fault_injection``); that rank writes a marker
and waits when it reaches the point; the driver then signals the rank(s), records the time, and releases the
marker. Then it checks what the fault left behind and resumes (``ckpt.load=true``) until the run completes.

What a scenario asserts (``run_scenario``):
- the faulted job exited, within the bound of its kind, and none of its rank processes is left (by PID);
- every checkpoint that was complete before the fault is still there, unchanged (manifest digests);
- every resume started from a complete checkpoint that verifies against its manifest (the one it logs);
- the resumed run's metrics equal the uninterrupted reference run's, step for step.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hpc_rlhf.ckpt.atomic import CheckpointManager, read_manifest, verify_checkpoint
from tests.multiproc.spawn import _free_port

ROOT = Path(__file__).resolve().parents[2]
NUM_STEPS = 6
SAVE_STEPS = 2
# The limits the fault runs use: short, so a hang costs seconds, but far above a step of the tiny recipe (< 2 s
# on a loaded 2-core box).
WATCHDOG_FLOOR_S = 15
PHASE_ALLOWANCE_S = 40  # first step and checkpoint saves
# Bounds on fault -> job exit. Deaths: 30 s. A stopped rank: its phase limit (at most PHASE_ALLOWANCE_S), the
# peers' dumps (py-spy, up to 5 s of waiting for each other) and torchrun's SIGTERM -> SIGKILL grace (30 s) for the
# stopped process, with room for a loaded machine (measured: 46-73 s).
DEATH_BOUND_S = 30.0
STOP_BOUND_S = PHASE_ALLOWANCE_S + 70.0
SIGNAL_STOP_BOUND_S = 60.0  # SIGUSR1/SIGTERM: finish the step, checkpoint, exit
JOB_TIMEOUT_S = 600
COMPARED = ("reward", "score", "response_length", "policy_loss", "actor_grad_norm", "actor_lr")

KINDS = ("sigkill_one", "sigkill_all", "sigstop_one", "sigusr1_all", "sigterm_all", "enospc_save")
# Faults whose job is idle for most of its injection: a stopped rank's job waits out the running rank's phase limit
# and then torchrun's 30 s SIGTERM -> SIGKILL grace (its --shutdown-timeout does not apply to a failed worker group).
# The suite starts these injections at the start of the module, beside the others, and checks them last.
IDLE_KINDS = ("sigstop_one",)
PHASES = ("generation", "train", "weight_sync", "checkpoint_write")


@dataclass(frozen=True)
class Fault:
    kind: str
    phase: str
    step: int
    rank: int

    def __str__(self) -> str:
        return f"{self.kind}@{self.phase}:{self.step}:rank{self.rank}"

    @property
    def bound_s(self) -> float:
        if self.kind == "sigstop_one":
            return STOP_BOUND_S
        if self.kind in ("sigusr1_all", "sigterm_all"):
            return SIGNAL_STOP_BOUND_S
        return DEATH_BOUND_S


def seeded_faults(num: int, seed: int) -> list[Fault]:
    """``num`` faults: every kind in turn (USR1 and TERM alternate), each at a seeded random point."""
    rng = random.Random(seed)
    order = ["sigkill_one", "sigkill_all", "sigstop_one", rng.choice(["sigusr1_all", "sigterm_all"]), "enospc_save"]
    order += [k for k in KINDS if k not in order]
    phases = list(PHASES)
    rng.shuffle(phases)  # the first injections hit different phases
    faults = []
    for i in range(num):
        kind = order[i % len(order)]
        phase = "checkpoint_write" if kind == "enospc_save" else phases[i % len(phases)]
        if phase == "checkpoint_write":
            step = rng.choice(range(SAVE_STEPS, NUM_STEPS + 1, SAVE_STEPS))
        else:
            step = rng.randint(1, NUM_STEPS)
        faults.append(Fault(kind, phase, step, rng.randint(0, 1)))
    return faults


def overrides(assets: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [f"actor.pretrain={assets['model']}", f"data.prompt_data=[{assets['data']}]", f"train.output_dir={out}",
            f"train.max_steps={NUM_STEPS}", f"ckpt.save_steps={SAVE_STEPS}", "ckpt.max_num=100",
            "logger.use_tensorboard=false", f"train.watchdog_timeout_s={WATCHDOG_FLOOR_S}",
            f"train.watchdog_first_step_s={PHASE_ALLOWANCE_S}", f"train.watchdog_checkpoint_s={PHASE_ALLOWANCE_S}",
            *extra]


def start_job(args: list[str], log: Path, env: dict[str, str] | None = None, launcher: str = "torchrun"
              ) -> subprocess.Popen:
    """2 ranks of the tiny GRPO recipe in their own session (so a leftover can be killed by group): under
    torchrun, or under ``srun`` as slurm/launch.sh starts them (one task per rank, --kill-on-bad-exit)."""
    if launcher == "srun":
        start = ["srun", "--partition=debug", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", "--kill-on-bad-exit=1",
                 "--label", "--time=00:15:00", sys.executable]
    else:
        start = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", str(_free_port())]
    cmd = [*start, "-m", "hpc_rlhf.cli.train_ppo", "--config", str(ROOT / "configs/grpo_tiny_cpu.yaml"), *args]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_job(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own process group: the job we started
        proc.wait()
        raise AssertionError(f"job pid {proc.pid} did not end within {timeout} s") from None


def run_to_completion(args: list[str], log: Path, max_attempts: int = 3) -> list[int]:
    """Run (resuming) until the job exits 0; returns the step each attempt resumed from."""
    resumed_from = []
    for _ in range(max_attempts):
        start = log.stat().st_size if log.exists() else 0
        rc = wait_job(start_job([*args, "ckpt.load=true"], log))
        text = log.read_text(errors="replace")[start:]
        found = re.findall(r"resumed from (\S+) \(step (\d+)\)", text)
        resumed_from.append(int(found[-1][1]) if found else 0)
        if rc == 0:
            return resumed_from
    raise AssertionError(f"the run did not complete in {max_attempts} attempts; see {log}")


def manifests(root: Path) -> dict[int, dict]:
    """Complete checkpoints under ``root``: step -> its manifest's file list."""
    return {step: read_manifest(path)["files"] for step, path in CheckpointManager(root, rank=0).list_complete()}


def _pids(fault_dir: Path) -> dict[int, int]:
    return {int(p.name.split("_")[1]): int(p.read_text()) for p in fault_dir.glob("pid_*")}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Outcome:
    fault: Fault
    exit_s: float
    exit_code: int
    log: str
    checkpoints_before: dict[int, list] = field(default_factory=dict)
    resumed_from: list[int] = field(default_factory=list)
    survived: bool = False
    launcher: str = "torchrun"


def inject(fault: Fault, assets: dict[str, str], out: Path, launcher: str = "torchrun") -> Outcome:
    """Start the run with the fault armed, deliver it at the point, wait for the job to end."""
    fault_dir = out / "fault"
    fault_dir.mkdir(parents=True)
    log = out / "job.log"
    env = {"HPC_RLHF_FAULT_DIR": str(fault_dir), "HPC_RLHF_FAULT_AT": f"{fault.phase}:{fault.step}:{fault.rank}"}
    if fault.kind == "enospc_save":
        env["HPC_RLHF_FAULT_ACTION"] = "enospc"
    proc = start_job(overrides(assets, out), log, env, launcher)
    marker = fault_dir / f"at_{fault.phase}_{fault.step}_{fault.rank}"
    done = fault_dir / f"done_{fault.phase}_{fault.step}_{fault.rank}"
    # The point writes ``done`` and then ``marker``: wait for the file this fault acts on (an ENOSPC fault writes no
    # marker), not for either one, or a poll between the two writes would find the point reached without its marker.
    reached = done if fault.kind == "enospc_save" else marker
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not reached.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if fault.kind == "enospc_save":
        while not done.exists() and proc.poll() is None:
            time.sleep(0.02)
        assert done.exists(), f"{fault}: the run never reached the point (exit {proc.poll()}); see {log}"
        t0 = float(done.read_text())
        before = manifests(out / "ckpt")
    else:
        assert marker.exists(), f"{fault}: the run never reached the point (exit {proc.poll()}); see {log}"
        before = manifests(out / "ckpt")
        pids = _pids(fault_dir)
        targets = [pids[fault.rank]] if fault.kind.endswith("_one") else list(pids.values())
        sig = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigusr1": signal.SIGUSR1,
               "sigterm": signal.SIGTERM}[fault.kind.split("_")[0]]
        t0 = time.time()
        for pid in targets:
            os.kill(pid, sig)
        marker.unlink()  # release: a signalled-but-running rank goes on from the point
    rc = wait_job(proc)
    exit_s = time.time() - t0
    leftovers = [f"rank {r} (pid {pid})" for r, pid in _pids(fault_dir).items() if _alive(pid)]
    for pid in _pids(fault_dir).values():  # never leave a stopped test process behind, whatever was found
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"{fault}: orphan rank processes after the job ended: {leftovers}"
    return Outcome(fault, exit_s, rc, log.read_text(errors="replace"), checkpoints_before=before, launcher=launcher)


def check_checkpoints(out: Path, kept: dict[int, dict]) -> None:
    """Every checkpoint in ``kept`` is still complete and unchanged; every complete one verifies."""
    now = manifests(out / "ckpt")
    for step, files in kept.items():
        assert step in now, f"complete checkpoint step_{step} was lost"
        assert now[step] == files, f"checkpoint step_{step}'s manifest changed"
    for step, path in CheckpointManager(out / "ckpt", rank=0).list_complete():
        problems = verify_checkpoint(path)
        assert not problems, f"step_{step} does not verify: {problems}"


def dump_table(outcomes: list[Outcome]) -> str:
    """Markdown table: fault kind and launcher, injections, survived, worst time from fault to exit (and its bound)."""
    rows = {}
    for o in outcomes:
        key = (KINDS.index(o.fault.kind), o.launcher)
        row = rows.setdefault(key, {"n": 0, "ok": 0, "worst": 0.0, "bound": o.fault.bound_s, "at": set()})
        row["n"] += 1
        row["ok"] += int(o.survived)
        row["worst"] = max(row["worst"], o.exit_s)
        row["at"].add(o.fault.phase)
    lines = ["| fault | launcher | injections | survived | worst time to exit (s) | bound (s) | phases hit |",
             "|---|---|---|---|---|---|---|"]
    for (kind, launcher), r in sorted(rows.items()):
        lines.append(f"| {KINDS[kind]} | {launcher} | {r['n']} | {r['ok']} | {r['worst']:.1f} | {r['bound']:.0f} | "
                     f"{', '.join(sorted(r['at']))} |")
    return "\n".join(lines)


def same_metrics(expected: list[dict], got: list[dict]) -> list[str]:
    """Differences between two runs' metrics rows on the COMPARED keys (exact up to float noise)."""
    if [r["step"] for r in expected] != [r["step"] for r in got]:
        return [f"steps differ: {[r['step'] for r in expected]} vs {[r['step'] for r in got]}"]
    return [f"step {a['step']} {key}: {a[key]} vs {b.get(key)}" for a, b in zip(expected, got) for key in COMPARED
            if key in a and (b.get(key) is None or abs(a[key] - b[key]) > 1e-6 + 1e-5 * abs(a[key]))]


def engine_core_pid(rank_pid: int) -> int:
    """The vLLM engine-core process a rank started (``rollout.vllm_mode=server_process``; vLLM titles it
    ``VLLM::EngineCore``)."""
    children = psutil.Process(rank_pid).children(recursive=True)
    # a core killed earlier may linger as a zombie until it is reaped
    cores = [p.pid for p in children if p.name().startswith("VLLM::EngineCore") and _alive(p.pid)]
    assert len(cores) == 1, f"rank pid {rank_pid}: expected one vLLM engine-core child, found {cores}"
    return cores[0]
