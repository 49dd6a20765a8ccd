"""The one torch.distributed world: launch environment, role placement, process groups, controller channel.

``launch_env`` and ``placement`` are torch-free (``plan`` runs them on a login node); import ``groups`` /
``channel`` explicitly when a process group is needed.
"""

from hpc_rlhf.world.launch_env import LaunchEnv, LaunchEnvError, detect_launch_env, expand_nodelist
from hpc_rlhf.world.placement import Placement, PlacementError, RoleGrid, build_placement, enabled_roles

__all__ = [
    "LaunchEnv",
    "LaunchEnvError",
    "Placement",
    "PlacementError",
    "RoleGrid",
    "build_placement",
    "detect_launch_env",
    "enabled_roles",
    "expand_nodelist",
]
