"""``hpc-rlhf submit``: submit a training run to SLURM from a login node, with submitit.

    hpc-rlhf submit --config configs/ppo_70b.yaml --nodes 8 --gpus-per-node 8 --partition gpu --time 48:00:00
    hpc-rlhf submit --config configs/grpo_tiny_cpu.yaml --partition debug --gpus-per-node 0 \
        --tasks-per-node 2 --time 00:20:00 train.max_steps=2

One job, one ``srun`` step, one task per GPU (``--tasks-per-node`` tasks on CPU). Every task runs the
training entry (``hpc_rlhf.cli.<entry>.main``) in-process, so it is the same program as under
``sbatch slurm/*.sbatch``: ``hpc_rlhf.world.launch_env`` reads the rank from the srun step and derives
the master port from the job id; the sbatch script generates the job's secret, which seals the rendezvous
(docs/reliability.md, "Shared clusters"). (We do not call submitit's ``TorchDistributedEnvironment().export()``:
it would set ``CUDA_VISIBLE_DEVICES`` to one GPU per task and use a second port formula.)

Preemption belongs to the trainer, not to submitit: ``--signal=USR1@<grace>`` reaches every rank, the
ranks agree at a step boundary, write an atomic checkpoint and rank 0 runs ``scontrol requeue``.
SLURM then restarts the same job; submitit re-runs the same pickled submission, which adds
``ckpt.load=true`` because ``SLURM_RESTART_COUNT > 0``, so training resumes from ``LATEST``.

Unset flags come from the recipe's ``slurm:`` section. ``plan`` validates the layout before anything is
submitted; ``--dry-run`` prints, without submitting, the parameters handed to submitit's
``SlurmExecutor.update_parameters`` and the command every task runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hpc_rlhf.cli.plan import plan
from hpc_rlhf.cli.startup import prepare_local_assets
from hpc_rlhf.config import ConfigError, RunConfig, load_config
from hpc_rlhf.config.supervised import load_supervised_config
from hpc_rlhf.planning.time_budget import slurm_time_seconds
from hpc_rlhf.resilience.preemption import requeue_slurm_job

log = logging.getLogger(__name__)
ENTRIES = ("train_ppo", "train_sft", "train_rm", "train_dpo", "train_kto")
# The job's secret (hpc_rlhf.world.job_secret): generated in the sbatch script on the job's first node at each start,
# then passed by srun to every rank in its environment. Neither the submitit folder nor the pickled task holds it.
JOB_SECRET_SETUP = "export HPC_RLHF_JOB_SECRET=\"$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')\""


# --------------------------------------------------------------------------------------- parsing
def load_entry_config(entry: str, path: str, overrides: list[str]):
    """The RL tree for ``train_ppo``, the offline trainers' tree for the others (both have ``slurm``)."""
    if entry == "train_ppo":
        return load_config(path, overrides)
    return load_supervised_config(entry.removeprefix("train_"), path, overrides)


def parse_slurm_time(value: str) -> int:
    """SLURM ``--time`` syntax -> whole minutes (rounded up).

    Accepts ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.
    """
    try:
        seconds = slurm_time_seconds(value)
    except ValueError as err:
        raise ValueError(f"--time: {err}") from err
    if seconds <= 0:
        raise ValueError(f"--time {value!r} must be positive")
    return math.ceil(seconds / 60)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpc-rlhf submit", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML recipe")
    p.add_argument("--entry", default="train_ppo", choices=ENTRIES, help="training entry (default train_ppo)")
    p.add_argument("--nodes", type=int, help="default: slurm.nodes")
    p.add_argument("--gpus-per-node", type=int, help="one rank per GPU; 0 = CPU job (default: slurm.gpus_per_node)")
    p.add_argument("--tasks-per-node", type=int, help="ranks per node when --gpus-per-node 0 (default 1)")
    p.add_argument("--cpus-per-task", type=int, help="default: slurm.cpus_per_task, else 1")
    p.add_argument("--partition", help="default: slurm.partition (else the cluster's default)")
    p.add_argument("--time", help="time limit in SLURM syntax, e.g. 04:00:00 (default: slurm.time)")
    p.add_argument("--account", help="default: slurm.account")
    p.add_argument("--qos")
    p.add_argument("--constraint")
    p.add_argument("--job-name", help="default: hpc-rlhf-<entry>")
    p.add_argument("--signal-grace", type=int,
                   help="USR1 this many seconds before the time limit (default: slurm.signal_grace_s)")
    p.add_argument("--no-requeue", action="store_true", help="do not mark the job requeueable")
    p.add_argument("--exclusive", action="store_true", help="whole nodes (recommended for multi-GPU nodes)")
    p.add_argument("--folder", help="submitit folder for logs and pickles (default: <train.output_dir>/submitit)")
    p.add_argument("--chdir", default=None, help="working directory of the job (default: the current one)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GPU memory for the plan check (default 80)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the submitit parameters and the per-task command; submit nothing")
    p.add_argument("--wait", action="store_true", help="block until the job ends; exit 1 if it failed")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10")
    return p


@dataclass
class Submission:
    """Everything that goes into the sbatch script, resolved from flags and the recipe."""

    entry: str
    config: str
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    cpus_per_task: int
    time_min: int
    signal_grace_s: int
    requeue: bool
    chdir: str
    folder: str
    job_name: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    setup: list[str] = field(default_factory=list)

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.tasks_per_node

    def executor_parameters(self) -> dict:
        """Keyword arguments of ``submitit.SlurmExecutor.update_parameters``."""
        params: dict = dict(
            job_name=self.job_name, time=self.time_min, nodes=self.nodes, ntasks_per_node=self.tasks_per_node,
            cpus_per_task=self.cpus_per_task, signal_delay_s=self.signal_grace_s, setup=self.setup,
            srun_args=["--kill-on-bad-exit=1", f"--cpus-per-task={self.cpus_per_task}"],
            # submitit's own flag is --signal=USR2@delay for its checkpoint handler; ours goes to the
            # trainer's handler on every rank instead.
            additional_parameters={"signal": f"USR1@{self.signal_grace_s}", "chdir": self.chdir,
                                   **({"requeue": True} if self.requeue else {"no-requeue": True})},
        )
        if self.gpus_per_node > 0:
            params["gpus_per_node"] = self.gpus_per_node
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(self, key):
                params[key] = getattr(self, key)
        if self.exclusive:
            params["exclusive"] = True
        return params


def resolve(args: argparse.Namespace, cfg) -> Submission:
    """Flags win over the recipe's ``slurm:`` section. Raises ValueError on a contradiction."""
    s = cfg.slurm
    nodes = args.nodes if args.nodes is not None else s.nodes
    gpus = args.gpus_per_node if args.gpus_per_node is not None else s.gpus_per_node
    if nodes < 1 or gpus < 0:
        raise ValueError(f"--nodes {nodes} must be >= 1 and --gpus-per-node {gpus} >= 0")
    if gpus > 0:
        if args.tasks_per_node is not None and args.tasks_per_node != gpus:
            raise ValueError(f"--tasks-per-node {args.tasks_per_node} != --gpus-per-node {gpus}: hpc-rlhf runs "
                             "one rank per GPU; use --gpus-per-node 0 for a CPU job")
        tasks = gpus
    else:
        tasks = args.tasks_per_node if args.tasks_per_node is not None else 1
        if tasks < 1:
            raise ValueError(f"--tasks-per-node {tasks} must be >= 1")
    cpus = args.cpus_per_task or s.cpus_per_task or 1
    chdir = str(Path(args.chdir or os.getcwd()).resolve())
    out_dir = Path(cfg.train.output_dir)
    run_dir = out_dir if out_dir.is_absolute() else Path(chdir) / out_dir
    folder = Path(args.folder) if args.folder else run_dir / "submitit"
    setup = ["export PYTHONUNBUFFERED=1", f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{cpus}}}",
             "export TOKENIZERS_PARALLELISM=false", JOB_SECRET_SETUP]
    if gpus > 0:
        setup += ["export TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}"]
    return Submission(
        entry=args.entry, config=args.config, overrides=list(args.overrides), nodes=nodes, gpus_per_node=gpus,
        tasks_per_node=tasks, cpus_per_task=cpus, time_min=parse_slurm_time(args.time or s.time),
        signal_grace_s=args.signal_grace if args.signal_grace is not None else s.signal_grace_s,
        requeue=s.requeue and not args.no_requeue, chdir=chdir, folder=str(folder.resolve()),
        job_name=args.job_name or f"hpc-rlhf-{args.entry.removeprefix('train_')}",
        partition=args.partition or s.partition, account=args.account or s.account, qos=args.qos,
        constraint=args.constraint, exclusive=args.exclusive, setup=setup,
    )


@contextlib.contextmanager
def _working_dir(path: str) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def check_plan(sub: Submission, cfg, gpu_mem_gb: float) -> int:
    """``hpc-rlhf plan`` for this layout (paths resolve against the job's working directory).

    ``plan`` sizes RL recipes; for the offline trainers the config was validated when it was loaded.
    """
    if not isinstance(cfg, RunConfig):
        print(f"plan: {sub.entry} config {sub.config} is valid (placement/memory planning covers RL recipes)")
        return 0
    with _working_dir(sub.chdir):
        if cfg.actor.build_tiny:  # a CPU recipe's tiny model must exist before plan can size it
            prepare_local_assets(cfg)
        return plan(["--config", sub.config, "--nodes", str(sub.nodes), "--gpus-per-node", str(sub.tasks_per_node),
                     "--gpu-mem-gb", str(gpu_mem_gb), *sub.overrides])


# --------------------------------------------------------------------------------- the job side
def _early_preemption(signum: int, _frame) -> None:
    """USR1 before the trainer installed its own handler: nothing new to save, so just requeue."""
    name = signal.Signals(signum).name
    print(f"[hpc-rlhf submit] {name} before training started: requeueing without a new checkpoint",
          file=sys.stderr, flush=True)
    if os.environ.get("SLURM_PROCID", "0") == "0":
        requeue_slurm_job()


@dataclass
class TrainingTask:
    """The callable submitit pickles and runs once per task (rank)."""

    entry: str
    config: str
    overrides: list[str]

    def argv(self, environ: dict[str, str] | os._Environ = os.environ) -> list[str]:
        # A requeued job (preemption, time limit, node failure) resumes from LATEST.
        resume = ["ckpt.load=true"] if int(environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0 else []
        return ["--config", self.config, *resume, *self.overrides]

    def __call__(self) -> dict:
        # submitit's job wrapper makes SIGTERM a no-op and binds USR2 to its own requeue. Give SIGTERM
        # back its default (scancel must end a rank that is still loading) and catch an early USR1;
        # the trainer replaces both with its preemption handler once it runs.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, _early_preemption)
        module = importlib.import_module(f"hpc_rlhf.cli.{self.entry}")
        try:
            module.main(self.argv())
        except SystemExit as exc:  # an entry point that exits: make the task fail in submitit's eyes
            if exc.code not in (None, 0):
                raise RuntimeError(f"hpc_rlhf.cli.{self.entry} exited with status {exc.code}") from None
        return {"rank": int(os.environ.get("SLURM_PROCID", "0")), "entry": self.entry}

    def __repr__(self) -> str:
        return f"python -m hpc_rlhf.cli.{self.entry} " + shlex.join(self.argv({}))


# ------------------------------------------------------------------------------ submit / dry-run
DRY_RUN_PARAMETERS = "# submitit.SlurmExecutor(folder).update_parameters(**parameters), parameters (JSON):"


def dry_run_text(sub: Submission, task: TrainingTask) -> str:
    """What ``--dry-run`` prints: the task command, then ``executor_parameters()`` as JSON.

    These are the inputs of the sbatch script, not the script: submitit renders it only in a private
    function (``submitit.slurm.slurm._make_sbatch_string``), which a dry run should not depend on.
    """
    return "\n".join([
        f"# dry run: nothing submitted. {sub.num_ranks} ranks; each task runs:",
        f"#   {task!r}",
        "#   (plus ckpt.load=true after a requeue)",
        f"# submitit folder: {sub.folder}",
        DRY_RUN_PARAMETERS,
        json.dumps(sub.executor_parameters(), indent=2, sort_keys=True),
    ])


def submit(sub: Submission):
    import submitit  # only a real submission needs it (not --dry-run, not the job side)

    executor = submitit.SlurmExecutor(folder=sub.folder)
    executor.update_parameters(**sub.executor_parameters())
    return executor.submit(TrainingTask(sub.entry, sub.config, sub.overrides))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec(f"hpc_rlhf.cli.{args.entry}") is None:
        print(f"submit: entry {args.entry!r} does not exist (no hpc_rlhf/cli/{args.entry}.py)", file=sys.stderr)
        sys.exit(2)
    try:
        with _working_dir(args.chdir or os.getcwd()):
            cfg = load_entry_config(args.entry, args.config, args.overrides)
        sub = resolve(args, cfg)
    except (ConfigError, ValueError) as err:
        print(f"submit: {err}", file=sys.stderr)
        sys.exit(2)

    if check_plan(sub, cfg, args.gpu_mem_gb) != 0:
        print(f"submit: plan rejected {sub.nodes} nodes x {sub.tasks_per_node} ranks for {sub.config} "
              "(reason above); nothing submitted", file=sys.stderr)
        sys.exit(1)

    task = TrainingTask(sub.entry, sub.config, sub.overrides)
    if args.dry_run:
        print("\n" + dry_run_text(sub, task))
        return

    job = submit(sub)
    print(f"submitted job {job.job_id}: {sub.nodes} node(s) x {sub.tasks_per_node} rank(s), {task!r}")
    print(f"  stdout: {job.paths.stdout}")
    print(f"  stderr: {job.paths.stderr}")
    print(f"  (one pair per rank: {Path(sub.folder) / (job.job_id + '_<rank>_log.{out,err}')})")
    print(f"  follow: squeue -j {job.job_id}; tail -f {job.paths.stdout}")
    sys.stdout.flush()
    if args.wait:
        try:
            job.results()
        except Exception as err:  # noqa: BLE001 - submitit raises FailedJobError / UncompletedJobError with the log tail
            print(f"submit: job {job.job_id} failed: {err}", file=sys.stderr)
            sys.exit(1)
        print(f"job {job.job_id} finished")


if __name__ == "__main__":
    main()
