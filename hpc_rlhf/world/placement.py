"""Assign ranks of the world to roles. Pure Python: `plan` runs it on a login node.

Layouts:
- fully colocated (``train.colocate_all``): every enabled role on every rank, time-shared;
- partially colocated (``train.colocate_actor_ref`` / ``train.colocate_critic_reward``): ref (and the
  distillation teacher) share the actor's ranks, reward shares the critic's;
- disaggregated: disjoint consecutive rank ranges, in the order actor, ref, teacher, critic, reward, rollout.

Inside a training role the ranks form a (dp, sp, tp) grid with tp fastest: tensor-parallel peers are
neighbours (same node, fast links), then sequence-parallel (ring attention), then data-parallel.
A rollout group is split into engines of ``rollout.tensor_parallel_size`` consecutive ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypedDict

from hpc_rlhf.config.rollout import rollout_engine_kind
from hpc_rlhf.config.schema import RunConfig


class Role(str, Enum):
    """A role of the placement, in the disaggregated layout's rank order; its value is the role's name in configs,
    placements, checkpoints and metric names (a ``str``: it equals, hashes and formats as that name, so it keys the
    placement's dicts and the ``timing/*`` metrics)."""

    ACTOR = "actor"
    REF = "ref"
    TEACHER = "teacher"
    CRITIC = "critic"
    REWARD = "reward"
    ROLLOUT = "rollout"

    def __str__(self) -> str:  # Python 3.12 formats a str-mixin enum as "Role.ACTOR" otherwise
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)


# The role lists as plain names (what YAML, JSON and checkpoints hold), each written out once, from Role.
ROLES = tuple(role.value for role in Role)
FROZEN_POLICY_ROLES = (Role.REF.value, Role.TEACHER.value)  # causal LMs that score the rollout's tokens, untrained
POLICY_ROLES = (Role.ACTOR.value, *FROZEN_POLICY_ROLES)  # roles whose LM head runs over the response tokens
TRAINED_ROLES = (Role.ACTOR.value, Role.CRITIC.value)


class RoleRow(TypedDict):
    """One role of a placement as :meth:`Placement.describe` lists it."""

    role: str
    ranks: str  # compact ranges, e.g. "0-3,8"
    num_ranks: int
    dp: int
    tp: int
    sp: int


class PlacementError(ValueError):
    """The requested layout cannot be built; the message says what to change."""


@dataclass(frozen=True)
class RoleGrid:
    """Ranks of one role and how they split into parallel subgroups.

    ``tp_groups`` are consecutive runs of ``tp_size`` ranks; ``sp_groups`` collect ranks with the same
    (dp, tp) index; ``dp_groups`` collect ranks with the same (sp, tp) index.
    """

    role: str
    ranks: tuple[int, ...]
    tp_size: int = 1
    sp_size: int = 1

    @property
    def dp_size(self) -> int:
        return len(self.ranks) // (self.tp_size * self.sp_size)

    def _coords(self, rank: int) -> tuple[int, int, int]:
        i = self.ranks.index(rank)
        tp = i % self.tp_size
        sp = (i // self.tp_size) % self.sp_size
        dp = i // (self.tp_size * self.sp_size)
        return dp, sp, tp

    def dp_rank(self, rank: int) -> int:
        return self._coords(rank)[0]

    def sp_rank(self, rank: int) -> int:
        return self._coords(rank)[1]

    def tp_rank(self, rank: int) -> int:
        return self._coords(rank)[2]

    def _group(self, keep: tuple[bool, bool, bool]) -> list[tuple[int, ...]]:
        """Groups of ranks sharing the coordinates where ``keep`` is True."""
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in self.ranks:
            key = tuple(c for c, k in zip(self._coords(r), keep, strict=True) if k)
            buckets.setdefault(key, []).append(r)
        return [tuple(v) for _, v in sorted(buckets.items())]

    @property
    def tp_groups(self) -> list[tuple[int, ...]]:
        return self._group((True, True, False))

    @property
    def sp_groups(self) -> list[tuple[int, ...]]:
        return self._group((True, False, True))

    @property
    def dp_groups(self) -> list[tuple[int, ...]]:
        return self._group((False, True, True))

    @property
    def dp_sp_groups(self) -> list[tuple[int, ...]]:
        """Ranks with the same tp index: sp peers hold the same parameters, so ZeRO shards them and
        reduces gradients over data and sequence parallel ranks together."""
        return self._group((False, False, True))

    def dp_leaders(self) -> tuple[int, ...]:
        """One rank per data-parallel replica (tp rank 0, sp rank 0): where shards are delivered."""
        return tuple(r for r in self.ranks if self._coords(r)[1:] == (0, 0))


@dataclass(frozen=True)
class Placement:
    world_size: int
    layout: str  # "colocated" | "partial" | "disaggregated"
    roles: dict[str, RoleGrid] = field(default_factory=dict)

    @property
    def controller_rank(self) -> int:
        return 0

    def roles_of(self, rank: int) -> list[str]:
        return [name for name, grid in self.roles.items() if rank in grid.ranks]

    def describe(self) -> list[RoleRow]:
        """One row per role, for the start-up log and ``plan``'s table."""
        rows: list[RoleRow] = []
        for name, grid in self.roles.items():
            rows.append(
                {
                    "role": name,
                    "ranks": _compact_ranges(grid.ranks),
                    "num_ranks": len(grid.ranks),
                    "dp": grid.dp_size,
                    "tp": grid.tp_size,
                    "sp": grid.sp_size,
                }
            )
        return rows


def _compact_ranges(ranks: tuple[int, ...]) -> str:
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def enabled_roles(cfg: RunConfig) -> list[str]:
    """Roles the run needs; the others get no ranks."""
    roles = ["actor"]
    if cfg.algo.needs_ref:
        roles.append("ref")
    if cfg.needs_teacher:
        roles.append("teacher")
    if cfg.algo.needs_critic:
        roles.append("critic")
    if cfg.needs_reward_model:
        roles.append("reward")
    roles.append("rollout")
    return roles


def _grid(cfg: RunConfig, role: str, ranks: tuple[int, ...]) -> RoleGrid:
    if role == "rollout":
        tp = cfg.rollout.tensor_parallel_size
        grid = RoleGrid(role, ranks, tp_size=tp)
        if len(ranks) % tp:
            raise PlacementError(
                f"rollout has {len(ranks)} ranks, not a multiple of rollout.tensor_parallel_size={tp}"
            )
        engines = cfg.rollout.num_engines
        if engines is not None and engines * tp != len(ranks):
            raise PlacementError(
                f"rollout.num_engines={engines} x rollout.tensor_parallel_size={tp} = {engines * tp} "
                f"but the rollout role has {len(ranks)} ranks; set rollout.num_engines={len(ranks) // tp}"
            )
        return grid
    tp, sp = cfg.ds.tensor_parallel_size, cfg.ds.ring_attn_size
    if len(ranks) % (tp * sp):
        raise PlacementError(
            f"{role} has {len(ranks)} ranks, not a multiple of ds.tensor_parallel_size={tp} x "
            f"ds.ring_attn_size={sp}; change {role}.num_ranks or the parallel sizes"
        )
    return RoleGrid(role, ranks, tp_size=tp, sp_size=sp)


def _role_size(cfg: RunConfig, role: str) -> int | None:
    if role == "rollout":
        n = cfg.rollout.num_engines
        return None if n is None else n * cfg.rollout.tensor_parallel_size
    return getattr(cfg, role).num_ranks


def build_placement(cfg: RunConfig, world_size: int) -> Placement:
    """Map ``world_size`` ranks to the roles that ``cfg`` enables.

    Raises:
        PlacementError: sizes do not add up; the message names the keys to change.
    """
    if world_size < 1:
        raise PlacementError(f"world size must be >= 1, got {world_size}")
    roles = enabled_roles(cfg)
    everyone = tuple(range(world_size))
    if cfg.train.colocate_all:
        for role in roles:
            size = _role_size(cfg, role)
            if size is not None and size != world_size and role == "rollout":
                tp = cfg.rollout.tensor_parallel_size
                raise PlacementError(
                    f"train.colocate_all: rollout.num_engines={cfg.rollout.num_engines} x "
                    f"rollout.tensor_parallel_size={tp} = {size} ranks, but every rank hosts rollout "
                    f"({world_size}); set rollout.num_engines={world_size // tp} or drop it"
                )
            if size is not None and size != world_size:
                key = f"{role}.num_ranks"
                raise PlacementError(
                    f"train.colocate_all puts every role on all {world_size} ranks, but {key} asks for "
                    f"{size}; drop {key} or set train.colocate_all=false"
                )
        placement = Placement(world_size, "colocated", {r: _grid(cfg, r, everyone) for r in roles})
        check_engines_can_run(cfg, placement)
        return placement

    shares = {}
    if cfg.train.colocate_actor_ref:
        shares.update({role: "actor" for role in FROZEN_POLICY_ROLES if role in roles})
    if cfg.train.colocate_critic_reward and "reward" in roles and "critic" in roles:
        shares["reward"] = "critic"
    owners = [r for r in roles if r not in shares]
    sizes = {r: _role_size(cfg, r) for r in owners}
    missing = [r for r, s in sizes.items() if s is None]
    fixed = sum(s for s in sizes.values() if s is not None)
    if len(missing) > 1:
        keys = ", ".join("rollout.num_engines" if r == "rollout" else f"{r}.num_ranks" for r in missing)
        raise PlacementError(f"disaggregated layout: set the rank counts of all but one role (missing: {keys})")
    left = world_size - fixed  # the size of the one role without a fixed size
    if missing and left < 1:
        raise PlacementError(
            f"the roles with fixed sizes use {fixed} of {world_size} ranks, leaving none for {missing[0]}"
        )
    resolved = {r: left if s is None else s for r, s in sizes.items()}
    total = sum(resolved.values())
    if total != world_size:
        detail = ", ".join(f"{r}={s}" for r, s in resolved.items())
        raise PlacementError(
            f"disaggregated layout needs {total} ranks ({detail}) but the world has {world_size}; "
            "change the role sizes or the number of tasks"
        )
    grids: dict[str, RoleGrid] = {}
    start = 0
    for role in owners:
        ranks = tuple(range(start, start + resolved[role]))
        grids[role] = _grid(cfg, role, ranks)
        start += resolved[role]
    for role, owner in shares.items():
        own_size = _role_size(cfg, role)
        if own_size is not None and own_size != len(grids[owner].ranks):
            raise PlacementError(
                f"{role} is colocated with {owner} ({len(grids[owner].ranks)} ranks) but {role}.num_ranks="
                f"{own_size}; drop {role}.num_ranks"
            )
        grids[role] = _grid(cfg, role, grids[owner].ranks)
    placement = Placement(world_size, "partial" if shares else "disaggregated", {r: grids[r] for r in roles})
    check_engines_can_run(cfg, placement)
    return placement


def check_engines_can_run(cfg: RunConfig, placement: Placement) -> None:
    """Refuse a layout the engines cannot run, naming the key to change. Pure: ``plan`` and start-up
    (``build_placement``, which both call) apply the same rules before any model is loaded.

    Raises:
        PlacementError: ZeRO-3 on a subset of the ranks, a vLLM mode that does not fit the layout, or
            ``server_process`` engines over several GPUs.
    """
    subset_roles = [r for r, grid in placement.roles.items() if len(grid.ranks) < placement.world_size]
    _refuse_zero3_on_subset(cfg, [r for r in subset_roles if r != "rollout"])
    _check_vllm_mode(cfg, placement, "rollout" in subset_roles)


def _check_vllm_mode(cfg: RunConfig, placement: Placement, rollout_on_subset: bool) -> None:
    """vLLM's external launcher takes the torch.distributed world as its own and builds its tensor/data-parallel
    groups over all of it, so every rank must construct the engine: only the colocated layout fits. Where rollout
    ranks are a subset (disaggregated, partial, async), each engine runs vLLM in processes of its own
    (``server_process``) and the main world stays the control plane. A colocated layout keeps vLLM in-process:
    weights load from the gathered actor state without a copy and sleep/wake time-share the GPU with training."""
    kind = rollout_engine_kind(cfg.rollout, cfg.train.colocate_all)
    if kind == "transformers":
        return
    if rollout_on_subset and kind == "vllm_external_launcher":
        rollout = placement.roles["rollout"]
        raise PlacementError(
            "rollout.vllm_mode=external_launcher needs every rank of the world to host rollout, but the "
            f"{placement.layout} layout puts rollout on {len(rollout.ranks)} of {placement.world_size} ranks; set "
            "rollout.vllm_mode=server_process (each engine's vLLM in its own processes) or train.colocate_all=true")
    if kind == "vllm_server_process" and cfg.rollout.tensor_parallel_size > 1:
        # Every rollout rank starts its own engine on its own GPU; an engine over several GPUs would need the
        # other ranks of its group to start none, and its sender to feed all its workers: not arranged yet.
        raise PlacementError(
            f"rollout.vllm_mode=server_process runs one single-GPU engine per rollout rank: "
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} is not supported there yet; set "
            "rollout.tensor_parallel_size=1 (more engines: rollout.num_engines), or colocate "
            "(train.colocate_all=true, vLLM's external launcher)")
    if not rollout_on_subset and kind == "vllm_server_process":
        raise PlacementError(
            "rollout.vllm_mode=server_process is for layouts where rollout ranks are a subset of the world; the "
            "colocated layout runs vLLM in-process (weights loaded without a copy, sleep/wake around training): set "
            "rollout.vllm_mode=external_launcher")


def _refuse_zero3_on_subset(cfg: RunConfig, subset_roles: list[str]) -> None:
    """ZeRO-3 only in the colocated layout, where every DeepSpeed role holds every rank (``subset_roles``: the
    model roles of a partial or disaggregated layout, each on a subset of the ranks).

    DeepSpeed 0.19's ZeRO-3 runs collectives on the whole world, not on the engine's group: ``dist.barrier()``
    while the optimizer builds its partitions, a broadcast from rank 0 that checks the parameter trace on the
    first forward passes, and transformers' ZeRO-3 ``from_pretrained`` fills weights on global rank 0 only.
    A role on a subset of the ranks would hang there (until the gloo / NCCL timeout) or keep random weights.
    ZeRO-2 with ``ds.adam_offload`` and ``ds.tensor_parallel_size`` is how disaggregated roles scale.
    """
    if cfg.ds.zero_stage != 3 or not subset_roles:
        return
    raise PlacementError(
        f"ds.zero_stage=3 needs train.colocate_all=true: DeepSpeed's ZeRO-3 runs world-wide collectives that "
        f"ranks of other roles never join, and {', '.join(subset_roles)} run on a subset of the ranks; use "
        "ds.zero_stage=2 (with ds.adam_offload=true and/or ds.tensor_parallel_size to fit) or colocate all roles")
