"""Rank 0's part of an RL checkpoint as one typed record, and how it lies on disk.

Runs on rank 0 (the controller) only: it writes and reads the files below inside ``<ckpt.path>/step_<N>/``; every
other rank's part of a checkpoint (DeepSpeed states, RNG, per-rank buffers) is ``hpc_rlhf.trainers.rl.checkpoint``'s.

The format on disk is the one every earlier RL checkpoint has, so those still load:

- ``controller.json``: ``{"step", "stream", "kl", "reward_norm", "refill_stream"}`` (JSON; ``refill_stream`` is
  missing in checkpoints from before DAPO refill rounds existed);
- ``controller_buffers.pt``: the controller's Python objects too rich for JSON (an asynchronous run's generated but
  not yet trained trajectories and counters), pickled with ``torch.save``; only written when there are some.

A missing or unknown key in ``controller.json`` raises :class:`ControllerCheckpointError` naming the file and key,
rather than a ``KeyError`` halfway through a restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpc_rlhf.ckpt import load_json, save_json_atomic

CONTROLLER_FILE = "controller.json"
BUFFERS_FILE = "controller_buffers.pt"

Buffers = dict[str, Any]  # pickled with the checkpoint: trajectories and counters of an asynchronous run

_REQUIRED_KEYS = ("step", "stream", "kl", "reward_norm")
_OPTIONAL_KEYS = ("refill_stream",)


class ControllerCheckpointError(ValueError):
    """``controller.json`` is not a controller checkpoint this code can read (a key missing, unknown, mistyped)."""


@dataclass
class ControllerCheckpoint:
    """What the controller keeps across a restart.

    Each state is the owning object's own ``state_dict()``, kept opaque here so that its format stays that object's
    business. Rollout health (``RolloutHealth``'s failure window) is not kept: a resumed run starts its window empty.
    """

    step: int  # the last finished step; the run resumes at ``step + 1``
    stream: dict[str, Any]  # data position: ``PromptStream.state_dict()`` of the prompt stream (order, position)
    kl: dict[str, Any]  # the KL controller's coefficient (``FixedKLController`` / ``AdaptiveKLController``)
    reward_norm: dict[str, Any]  # the running reward statistics (``RunningRewardNormalizer``)
    refill_stream: dict[str, Any] | None = None  # the DAPO refill rounds' stream; None in older checkpoints
    buffers: Buffers | None = None  # ``controller_buffers.pt``: the asynchronous trainer's queue (None: none kept)

    def to_json(self) -> dict[str, Any]:
        """``controller.json``'s content."""
        out: dict[str, Any] = {"step": self.step, "stream": self.stream, "kl": self.kl,
                               "reward_norm": self.reward_norm}
        if self.refill_stream is not None:
            out["refill_stream"] = self.refill_stream
        return out

    @classmethod
    def from_json(cls, data: Any, path: str | Path, buffers: Buffers | None = None) -> ControllerCheckpoint:
        """The record of ``controller.json``'s content ``data`` (read from ``path``, named in errors)."""
        if not isinstance(data, dict):
            raise ControllerCheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
        missing = [key for key in _REQUIRED_KEYS if key not in data]
        if missing:
            raise ControllerCheckpointError(f"{path}: missing key {missing[0]!r} (a controller checkpoint has "
                                            f"{', '.join(_REQUIRED_KEYS + _OPTIONAL_KEYS)})")
        unknown = sorted(set(data) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS))
        if unknown:
            raise ControllerCheckpointError(f"{path}: unknown key {unknown[0]!r}: written by other code than this "
                                            f"version's (it knows {', '.join(_REQUIRED_KEYS + _OPTIONAL_KEYS)})")
        if not isinstance(data["step"], int) or isinstance(data["step"], bool):
            raise ControllerCheckpointError(f"{path}: key 'step' must be an integer, found {data['step']!r}")
        for key in ("stream", "kl", "reward_norm", "refill_stream"):
            if key in data and not isinstance(data[key], dict):
                raise ControllerCheckpointError(f"{path}: key {key!r} must be a JSON object, "
                                                f"found {type(data[key]).__name__}")
        return cls(step=data["step"], stream=data["stream"], kl=data["kl"], reward_norm=data["reward_norm"],
                   refill_stream=data.get("refill_stream"), buffers=buffers)

    def write(self, directory: Path) -> None:
        """Write into a checkpoint's (temporary) step directory; the checkpoint manager makes the whole atomic."""
        save_json_atomic(directory / CONTROLLER_FILE, self.to_json())
        if self.buffers is not None:
            torch.save(self.buffers, directory / BUFFERS_FILE)

    @classmethod
    def read(cls, directory: Path) -> ControllerCheckpoint:
        """Read what :meth:`write` wrote into ``directory`` (a verified checkpoint)."""
        path = directory / CONTROLLER_FILE
        buffers = None
        if (directory / BUFFERS_FILE).is_file():
            # Our own pickle of trajectories (dataclasses), written by rank 0 of this run's code.
            buffers = torch.load(directory / BUFFERS_FILE, weights_only=False)
        return cls.from_json(load_json(path), path, buffers)
