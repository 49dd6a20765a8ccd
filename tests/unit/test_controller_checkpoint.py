"""The controller's typed checkpoint record reads the ``controller.json`` (and ``controller_buffers.pt``) that RL
checkpoints have always had, writes the same, and names the file and key when one is missing or unknown."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.trainers.rl.controller_checkpoint import (
    BUFFERS_FILE,
    CONTROLLER_FILE,
    ControllerCheckpoint,
    ControllerCheckpointError,
)

# controller.json as checkpoints before the typed record wrote it: {"step": N, **ControllerState.checkpoint_state()}
STREAM = {"version": 2, "seed": 42, "episode": 0, "position": 4, "num_consumed": 4, "dataset_size": 8,
          "order": [3, 1, 0, 2, 7, 5, 4, 6]}
OLD_FORMAT = {"step": 2, "stream": STREAM, "kl": {"coef": 0.05}, "reward_norm": {"count": 8, "mean": 0.5, "m2": 1.0},
              "refill_stream": {**STREAM, "seed": 43, "position": 0, "num_consumed": 0}}


def test_reads_todays_format_and_writes_it_back(tmp_path):
    (tmp_path / CONTROLLER_FILE).write_text(json.dumps(OLD_FORMAT))
    saved = ControllerCheckpoint.read(tmp_path)
    assert (saved.step, saved.stream, saved.kl, saved.reward_norm) == (2, STREAM, {"coef": 0.05}, OLD_FORMAT[
        "reward_norm"])
    assert saved.refill_stream == OLD_FORMAT["refill_stream"] and saved.buffers is None

    out = tmp_path / "again"
    out.mkdir()
    saved.write(out)
    assert json.loads((out / CONTROLLER_FILE).read_text()) == OLD_FORMAT
    assert not (out / BUFFERS_FILE).exists()  # nothing to keep beyond the JSON: no pickle, as before


def test_a_checkpoint_from_before_refill_rounds_loads_without_them(tmp_path):
    old = {k: v for k, v in OLD_FORMAT.items() if k != "refill_stream"}
    (tmp_path / CONTROLLER_FILE).write_text(json.dumps(old))
    saved = ControllerCheckpoint.read(tmp_path)
    assert saved.refill_stream is None and saved.to_json() == old


def test_buffers_round_trip_through_their_own_file(tmp_path):
    buffers = {"ready": [[1, 2], [3]], "generated": 3, "partial_in_flight": True}
    ControllerCheckpoint.from_json(OLD_FORMAT, "x", buffers=buffers).write(tmp_path)
    assert (tmp_path / BUFFERS_FILE).is_file()
    assert ControllerCheckpoint.read(tmp_path).buffers == buffers


@pytest.mark.parametrize(("change", "says"), [
    ({"kl": None}, "missing key 'kl'"),
    ({"policy_version": 3}, "unknown key 'policy_version'"),
    ({"step": "2"}, "key 'step' must be an integer"),
    ({"stream": [1, 2]}, "key 'stream' must be a JSON object"),
])
def test_a_bad_key_is_named_with_the_file(tmp_path, change, says):
    data = {**OLD_FORMAT, **change}
    data = {k: v for k, v in data.items() if v is not None}
    (tmp_path / CONTROLLER_FILE).write_text(json.dumps(data))
    with pytest.raises(ControllerCheckpointError, match=says) as error:
        ControllerCheckpoint.read(tmp_path)
    assert str(tmp_path / CONTROLLER_FILE) in str(error.value)
