"""Typed config tree, YAML recipes and dotted overrides. Imports no torch."""

from hpc_rlhf.config.loader import ConfigError, load_config, normalize_overrides, save_resolved_config
from hpc_rlhf.config.schema import GROUP_ESTIMATORS, RunConfig

__all__ = [
    "GROUP_ESTIMATORS",
    "ConfigError",
    "RunConfig",
    "load_config",
    "normalize_overrides",
    "save_resolved_config",
]
