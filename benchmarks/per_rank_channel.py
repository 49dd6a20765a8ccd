"""The per-rank channel, kept as the baseline of ``controller_traffic.py``: rank 0 sends every rank of a role its
own copy of its replica's shard, the skeleton pickled and then one message per tensor (no replica leaders, no
packing). Not used by the package; ``hpc_rlhf.world.channel`` is the channel runs use.

A batch is any nest of dicts/lists/tuples holding tensors and picklable Python objects. The structure
and small objects travel pickled; tensors travel as raw collectives on the backend's device, so large
payloads never go through pickle. Works on nccl (tensors staged on the current CUDA device) and gloo.

Every function is collective over ``RoleGroups.controller_ranks`` (the role's ranks plus rank 0): each
of those ranks must call it, in the same order. Other ranks must not call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpc_rlhf.world.groups import RoleGroups, comm_device

CONTROLLER = 0


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``obj`` by a slot; append the tensors to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        items = [_fill(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def _slots(skeleton: Any) -> list[_TensorSlot]:
    found: list[_TensorSlot] = []

    def walk(node: Any) -> None:
        if isinstance(node, _TensorSlot):
            found.append(node)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(skeleton)
    return sorted(found, key=lambda s: s.index)


def _empty_like_slots(skeleton: Any, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in _slots(skeleton)]


def _require_member(groups: RoleGroups) -> int:
    rank = dist.get_rank()
    if rank not in groups.controller_ranks:
        raise RuntimeError(f"rank {rank} called a controller collective for role {groups.role!r} it is not part of")
    return rank


def broadcast_to_role(batch: Any, groups: RoleGroups) -> Any:
    """Rank 0 passes ``batch``; every rank of the role gets a copy (rank 0 gets its own back)."""
    rank = _require_member(groups)
    device = comm_device()
    tensors: list[torch.Tensor] = []
    box = [_split(batch, tensors) if rank == CONTROLLER else None]
    dist.broadcast_object_list(box, src=CONTROLLER, group=groups.controller_group, device=device)
    skeleton = box[0]
    if rank == CONTROLLER:
        payload = [t.detach().to(device).contiguous() for t in tensors]
    else:
        payload = _empty_like_slots(skeleton, device)
    for t in payload:
        dist.broadcast(t, src=CONTROLLER, group=groups.controller_group)
    return batch if rank == CONTROLLER else _fill(skeleton, payload)


def _send(obj: Any, dst: int, groups: RoleGroups, device: torch.device) -> None:
    tensors: list[torch.Tensor] = []
    skeleton = _split(obj, tensors)
    dist.send_object_list([skeleton], dst=dst, group=groups.controller_group, device=device)
    for t in tensors:
        dist.send(t.detach().to(device).contiguous(), dst=dst, group=groups.controller_group)


def _recv(src: int, groups: RoleGroups, device: torch.device) -> Any:
    box = [None]
    dist.recv_object_list(box, src=src, group=groups.controller_group, device=device)
    tensors = _empty_like_slots(box[0], device)
    for t in tensors:
        dist.recv(t, src=src, group=groups.controller_group)
    return _fill(box[0], tensors)


def scatter_to_role(shards: list[Any] | None, groups: RoleGroups) -> Any:
    """Deliver ``shards[dp_rank]`` to every rank of the role (tensor/sequence peers get the same shard).

    Args:
        shards: on rank 0, one entry per data-parallel replica; ignored elsewhere.

    Returns:
        This rank's shard; on rank 0 its own shard if it is in the role, else ``None``.
    """
    rank = _require_member(groups)
    device = comm_device()
    dp_rank_of = groups.dp_rank_of
    if rank == CONTROLLER:
        num_dp = len(set(dp_rank_of.values()))
        if shards is None or len(shards) != num_dp:
            raise ValueError(f"role {groups.role!r} has {num_dp} data-parallel ranks but got "
                             f"{None if shards is None else len(shards)} shards")
        for dst in groups.ranks:
            if dst != CONTROLLER:
                _send(shards[dp_rank_of[dst]], dst, groups, device)
        return shards[dp_rank_of[CONTROLLER]] if CONTROLLER in groups.ranks else None
    if rank in groups.ranks:
        return _recv(CONTROLLER, groups, device)
    return None


def gather_from_role(result: Any, groups: RoleGroups) -> list[Any] | None:
    """Collect one result per data-parallel replica (from its leader) on rank 0, ordered by dp rank.

    Non-leader ranks (tp/sp peers) pass their result too; it is ignored, as their replica's leader
    holds the same values.
    """
    rank = _require_member(groups)
    device = comm_device()
    leaders, dp_rank_of = groups.dp_leaders, groups.dp_rank_of
    if rank == CONTROLLER:
        by_dp: dict[int, Any] = {}
        for src in leaders:
            by_dp[dp_rank_of[src]] = result if src == CONTROLLER else _recv(src, groups, device)
        return [by_dp[i] for i in sorted(by_dp)]
    if rank in leaders:
        _send(result, CONTROLLER, groups, device)
    return None
