"""What start-up and ``hpc-rlhf plan`` warn about in a valid RL config: keys another key switched off
(:mod:`hpc_rlhf.config.switched_off`) and loss settings that differ from the loss's paper."""

from __future__ import annotations

from typing import Any

from hpc_rlhf.config.switched_off import switched_off_warnings


def cispo_lower_bound_warning(cfg: Any) -> str | None:
    """CISPO with a floor on its weight: MiniMax-M1 (arXiv:2506.13585) and TRL cap the weight from above only."""
    algo = cfg.algo
    if algo.policy_loss_type != "cispo" or algo.eps_clip_low >= 1:
        return None
    return (f"algo.policy_loss_type=cispo with algo.eps_clip_low={algo.eps_clip_low} floors every token's weight at "
            f"{1 - algo.eps_clip_low:g}; MiniMax-M1 and TRL's cispo keep no lower bound: set algo.eps_clip_low=1 "
            "(docs/migrating.md maps TRL's epsilon_high to algo.eps_clip_high = epsilon_high - 1)")


def config_warnings(cfg: Any) -> list[str]:
    """One line per warning about ``cfg`` (a ``RunConfig``); empty when there is nothing to say."""
    lines = switched_off_warnings(cfg)
    cispo = cispo_lower_bound_warning(cfg)
    return lines + ([cispo] if cispo else [])


__all__ = ["cispo_lower_bound_warning", "config_warnings"]
