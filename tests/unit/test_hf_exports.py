"""HF exports: atomic commit, the BEST pointer moves only on improvement, rotation keeps the best."""

from __future__ import annotations

import math

from hpc_rlhf.ckpt.hf_exports import HFExports, improves


def test_improves():
    assert improves(0.5, None, "max") and improves(0.6, 0.5, "max") and not improves(0.5, 0.5, "max")
    assert improves(0.4, 0.5, "min") and not improves(0.6, 0.5, "min")
    assert not improves(math.nan, None, "max")


def _export(exports: HFExports, step: int) -> None:
    tmp = exports.prepare(step)
    (tmp / "model.safetensors").write_text(str(step))
    exports.commit(step)


def test_best_pointer_and_rotation(tmp_path):
    exports = HFExports(tmp_path, max_num=1)
    moved = []
    for step, value in [(1, 0.2), (2, 0.5), (3, 0.4), (4, 0.5), (5, 0.1)]:
        _export(exports, step)
        moved.append(exports.update_best(step, "eval/all/pass@1", value, "max"))
        exports.rotate()
    assert moved == [True, True, False, False, False]
    assert exports.best() == {"step": 2, "path": "step_2", "metric": "eval/all/pass@1", "value": 0.5}
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["BEST", "step_2", "step_5"]
    assert (tmp_path / "hf" / "step_2" / "model.safetensors").read_text() == "2"


def test_prepare_removes_an_interrupted_export_and_commit_replaces(tmp_path):
    exports = HFExports(tmp_path, max_num=None)
    exports.prepare(3)  # interrupted: never committed
    _export(exports, 3)
    _export(exports, 3)  # re-saved after a resume
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step_3"]
