"""Fault points (``hpc_rlhf.resilience.fault_injection``): which points a run arms, and that each fires once. The
drivers that use them: ``tests/faults``."""

from __future__ import annotations

from hpc_rlhf.resilience import fault_injection
from hpc_rlhf.resilience.fault_injection import armed_points, fault_armed, fault_point


def test_a_run_may_arm_several_points():
    assert armed_points("engine_generating:2:1, engine_weight_round:3:1,") == {
        "engine_generating:2:1", "engine_weight_round:3:1"}
    assert armed_points(None) == set() and armed_points("") == set()


def test_each_armed_point_fires_once_and_no_other(tmp_path, monkeypatch):
    monkeypatch.setenv(fault_injection.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(fault_injection.AT_ENV, "generation:2:0,weight_sync:3:1")
    monkeypatch.setenv(fault_injection.WAIT_ENV, "0")  # nobody releases the point here: go on at once
    assert fault_armed("generation", 2, 0) and fault_armed("weight_sync", 3, 1)
    assert not fault_armed("generation", 3, 0) and not fault_armed("weight_sync", 3, 0)
    fault_point("generation", 3, 0)  # not armed: no marker
    assert not (tmp_path / "at_generation_3_0").exists()
    fault_point("generation", 2, 0)
    assert (tmp_path / "at_generation_2_0").exists() and (tmp_path / "done_generation_2_0").exists()
    assert not fault_armed("generation", 2, 0) and fault_armed("weight_sync", 3, 1)  # the other still waits
    (tmp_path / "at_generation_2_0").unlink()
    fault_point("generation", 2, 0)  # a resumed run passing it again does not stop
    assert not (tmp_path / "at_generation_2_0").exists()
