"""Shared start-up of the training entry points: config, world, placement, run directory."""

from __future__ import annotations

import argparse
import logging
import sys

from hpc_rlhf.config import ConfigError, RunConfig, load_config


def parse_run_args(prog: str, argv: list[str] | None) -> RunConfig:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", help="YAML recipe")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="dotted overrides, e.g. train.seed=1")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        sys.exit(2)


def prepare_local_assets(cfg: RunConfig) -> None:
    """Build the tiny model / synthetic prompts a CPU recipe asks for (once; file-locked)."""
    if cfg.actor.build_tiny and cfg.actor.pretrain:
        from hpc_rlhf.models.tiny import build_tiny_model

        build_tiny_model(cfg.actor.pretrain, seed=cfg.train.seed)
    if cfg.data.synthetic_task and cfg.data.prompt_data:
        from hpc_rlhf.data.synthetic import write_task_if_missing

        write_task_if_missing(cfg.data.synthetic_task, cfg.data.prompt_data[0], cfg.data.synthetic_num_samples,
                              cfg.train.seed)


def start_world(cfg: RunConfig):
    """Initialise torch.distributed, validate the placement, build the role groups."""
    from hpc_rlhf.world.placement import build_placement
    from hpc_rlhf.world.groups import build_world_groups, init_world

    env = init_world(timeout_s=cfg.train.collective_timeout_s)
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING,
                        format=f"[rank{env.rank}] %(asctime)s %(name)s: %(message)s")
    placement = build_placement(cfg, env.world_size)
    world = build_world_groups(placement)
    if env.rank == 0:
        for row in placement.describe():
            logging.getLogger("hpc_rlhf").info("role %(role)s on ranks %(ranks)s (dp %(dp)s, tp %(tp)s)", row)
    return env, world
