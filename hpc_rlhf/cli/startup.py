"""The one start-up path of every training entry point (``train_ppo``, ``train_sft`` / ``rm`` / ``dpo`` / ``kto``).

    cfg, env = start_run("train_sft", argv, load_sft_config)

in this order: the preemption guard (a SLURM signal during start-up is remembered, not fatal), the
config (a bad key exits with status 2 naming it), the umask of ``train.output_access`` (run outputs private by
default, ``hpc_rlhf.utils.output_access``), torch.distributed from the launcher's variables with
the configured collective timeout, per-rank logging, on CPU glibc's malloc thresholds
(``hpc_rlhf.utils.host_malloc``), then the local assets a CPU recipe asks for (tiny
model, synthetic data), written once by rank 0 on the shared filesystem while the others wait.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

# Only torch-free imports at the top: `hpc-rlhf submit` imports this module on a login node, and an entry point
# installs the preemption guard before the seconds of importing torch (a SLURM signal then is remembered, not
# fatal). torch, the process groups and the tiny model load inside the functions that need them.
from hpc_rlhf.config import ConfigError, RunConfig
from hpc_rlhf.config.advice import config_warnings
from hpc_rlhf.config.supervised import load_supervised_config
from hpc_rlhf.data.synthetic import write_task_if_missing
from hpc_rlhf.data.synthetic_preference import prepare_supervised_assets
from hpc_rlhf.resilience.preemption import exit_if_stopped, preemption_guard
from hpc_rlhf.utils.host_malloc import retain_freed_host_memory
from hpc_rlhf.utils.output_access import apply_output_access


def parse_config_args(prog: str, argv: list[str] | None, load: Callable[[str | None, list[str]], Any]) -> Any:
    """``--config CFG key=value ...`` -> the typed config ``load`` builds; exits with status 2 on a bad key."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", help="YAML recipe")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="dotted overrides, e.g. train.seed=1")
    args = parser.parse_args(argv)
    try:
        return load(args.config, args.overrides)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        sys.exit(2)


def prepare_local_assets(cfg: Any) -> None:
    """Build the tiny model / synthetic data a CPU recipe asks for (no-op for real recipes; idempotent)."""
    if not isinstance(cfg, RunConfig):
        prepare_supervised_assets(cfg)
        return
    if cfg.actor.build_tiny and cfg.actor.pretrain:
        from hpc_rlhf.models.tiny import build_tiny_for  # torch: see the note on the imports

        build_tiny_for(cfg.actor.pretrain, cfg.actor.build_tiny, seed=cfg.train.seed,
                       rollout_backend=cfg.rollout.backend)
    if cfg.data.synthetic_task and cfg.data.prompt_data:
        write_task_if_missing(cfg.data.synthetic_task, cfg.data.prompt_data[0], cfg.data.synthetic_num_samples,
                              cfg.train.seed)
    if cfg.data.synthetic_task == "colour" and cfg.eval.data:
        # the held-out split: other images (another seed), the same size as the eval prompt budget
        write_task_if_missing("colour", cfg.eval.data[0], cfg.eval.max_samples or 64, cfg.train.seed + 10_000)
    if cfg.data.synthetic_task == "code":
        # eval.data[0]: the functions neither stage trains on; [1]: GRPO's own (never shown to SFT); each once
        for task, path in zip(("code_heldout", "code_rl_eval"), cfg.eval.data, strict=False):
            write_task_if_missing(task, path, cfg.eval.max_samples or 64, cfg.train.seed)


def start_run(prog: str, argv: list[str] | None, load: Callable[[str | None, list[str]], Any]):
    """Guard, config, world, logging, local assets (see the module docstring). Returns ``(cfg, LaunchEnv)``."""
    preemption_guard()
    # torch and the process groups load after the guard is installed (see the note on the imports).
    import torch
    import torch.distributed as dist

    from hpc_rlhf.world.groups import init_world, log_world_peers

    cfg = parse_config_args(prog, argv, load)
    # Before the first file: the run's outputs (and the files of the processes it starts) private by default.
    apply_output_access(cfg.train.output_access)
    env = init_world(timeout_s=cfg.train.collective_timeout_s)
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING,
                        format=f"[rank{env.rank}] %(asctime)s %(name)s: %(message)s")
    log_world_peers(env)
    retain_freed_host_memory(on_gpu=torch.cuda.is_available())
    if env.rank == 0:
        if isinstance(cfg, RunConfig):
            for line in config_warnings(cfg):
                logging.getLogger(prog).warning("config: %s", line)
        prepare_local_assets(cfg)
    dist.barrier()
    return cfg, env


def run_offline_trainer(kind: str, module: str, class_name: str, argv: list[str] | None = None) -> None:
    """Entry point body of ``train_sft`` / ``train_rm`` / ``train_dpo`` / ``train_kto``: start, fit, tear down."""
    import torch.distributed as dist  # torch: see the note on the imports

    cfg, _ = start_run(f"train_{kind}", argv, functools.partial(load_supervised_config, kind))
    trainer_cls = getattr(importlib.import_module(module), class_name)
    trainer = trainer_cls(cfg)
    trainer.fit()
    dist.destroy_process_group()
    exit_if_stopped(trainer)  # status 75: stopped on a signal, resume with ckpt.load=true
