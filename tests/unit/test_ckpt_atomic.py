"""Atomic checkpoint directories: commit, LATEST, rotation, crash safety, RNG state."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_rlhf.ckpt import (
    CheckpointManager,
    is_complete,
    load_json,
    read_manifest,
    save_json_atomic,
    verify_checkpoint,
)
from hpc_rlhf.ckpt.rng import capture_rng_state, load_rank_rng, restore_rng_state, save_rank_rng

REPO_ROOT = Path(__file__).resolve().parents[2]


def _save(mgr: CheckpointManager, step: int, payload: bytes | None = None) -> Path:
    with mgr.saving(step) as tmp:
        (tmp / "model.bin").write_bytes(payload if payload is not None else f"weights {step}".encode())
        (tmp / "sub").mkdir()
        (tmp / "sub" / "optim.bin").write_bytes(b"o" * (step + 1))
    return mgr.step_dir(step)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _temp_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp_"))


def test_commit_creates_step_dir_complete_marker_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", max_num=3)
    assert mgr.latest() is None and mgr.latest_step() is None
    final = _save(mgr, 7)

    assert final == tmp_path / "ckpt" / "step_7" and final.is_dir() and is_complete(final)
    assert (tmp_path / "ckpt" / "LATEST").read_text().strip() == "step_7"
    assert mgr.latest() == final and mgr.latest_step() == 7
    assert mgr.list_complete() == [(7, final)]
    manifest = read_manifest(final)
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["time"] > 0
    assert sorted((f["path"], f["size"]) for f in manifest["files"]) == [("model.bin", 9), ("sub/optim.bin", 8)]
    assert verify_checkpoint(final) == []
    assert _temp_entries(tmp_path / "ckpt") == []


def test_verify_detects_tampering(tmp_path):
    final = _save(CheckpointManager(tmp_path), 1)
    (final / "model.bin").write_bytes(b"trunc")
    (final / "sub" / "optim.bin").unlink()
    problems = verify_checkpoint(final)
    assert len(problems) == 2 and any("missing" in p for p in problems)


def test_verify_detects_same_size_corruption(tmp_path):
    final = _save(CheckpointManager(tmp_path), 1)
    model = final / "model.bin"
    model.write_bytes(b"x" * model.stat().st_size)  # same size, other bytes: only a content hash sees it
    problems = verify_checkpoint(final)
    assert len(problems) == 1 and str(model) in problems[0] and "content" in problems[0]


def test_digest_of_a_large_file_samples_it(tmp_path, monkeypatch):
    from hpc_rlhf.ckpt import atomic

    monkeypatch.setattr(atomic, "DIGEST_FULL_LIMIT", 1024)
    monkeypatch.setattr(atomic, "DIGEST_WINDOW", 64)
    final = _save(CheckpointManager(tmp_path), 1, payload=bytes(range(256)) * 40)
    assert read_manifest(final)["files"][0]["digest"].startswith("blake2b-sampled:")
    data = bytearray((final / "model.bin").read_bytes())
    data[-1] ^= 1  # in the tail window
    (final / "model.bin").write_bytes(bytes(data))
    assert "content" in verify_checkpoint(final)[0]


def test_latest_verified_skips_damaged_checkpoints_naming_the_file(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, max_num=5)
    good = _save(mgr, 1)
    same_size = _save(mgr, 2)
    truncated = _save(mgr, 3)
    (truncated / "sub" / "optim.bin").write_bytes(b"o")
    (same_size / "model.bin").write_bytes(b"W" * len(b"weights 2"))
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.ckpt.atomic"):
        assert mgr.latest_verified() == good
    assert str(truncated / "sub" / "optim.bin") in caplog.text and str(same_size / "model.bin") in caplog.text
    assert "resuming from step_1" in caplog.text
    assert mgr.latest() == truncated  # LATEST itself is left alone


def test_latest_verified_refuses_to_start_fresh_over_damaged_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path)
    only = _save(mgr, 1)
    (only / "model.bin").write_bytes(b"")
    with pytest.raises(RuntimeError, match="no checkpoint under .* verifies(.|\n)*model.bin(.|\n)*ckpt.load=false"):
        mgr.latest_verified()
    assert CheckpointManager(tmp_path / "empty").latest_verified() is None


@pytest.mark.parametrize("latest", [b"garbage\x00", b"step_9\n", None])
def test_latest_verified_falls_back_past_a_bad_latest_and_truncated_files(tmp_path, caplog, latest):
    """LATEST garbage / naming a missing directory / naming a step with a truncated file: the newest checkpoint that
    verifies is loaded, and the log says which was rejected and why."""
    mgr = CheckpointManager(tmp_path, max_num=5)
    good = _save(mgr, 1)
    truncated = _save(mgr, 2)
    (truncated / "sub" / "optim.bin").write_bytes(b"o")
    if latest is not None:
        (tmp_path / "LATEST").write_bytes(latest)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.ckpt.atomic"):
        assert mgr.latest_verified() == good
    assert f"size of {truncated / 'sub' / 'optim.bin'} is 1, manifest says 3" in caplog.text
    assert "resuming from step_1" in caplog.text
    if latest == b"step_9\n":
        assert "LATEST names step_9, which is not a complete checkpoint" in caplog.text
    elif latest is not None:
        assert "LATEST is corrupt" in caplog.text


@pytest.mark.parametrize("damage", ["latest_names_deleted_dir", "latest_garbage_only", "complete_marker_gone"])
def test_latest_verified_never_starts_fresh_over_traces_of_a_run(tmp_path, damage):
    mgr = CheckpointManager(tmp_path)
    step = _save(mgr, 4)
    if damage == "latest_names_deleted_dir":
        shutil.rmtree(step)
        expected = "LATEST names step_4, which is not a complete checkpoint"
    elif damage == "latest_garbage_only":
        shutil.rmtree(step)
        (tmp_path / "LATEST").write_bytes(b"\x00junk")
        expected = "LATEST is corrupt"
    else:
        (step / "COMPLETE").unlink()
        (tmp_path / "LATEST").unlink()
        expected = f"{step} has no COMPLETE marker"
    with pytest.raises(RuntimeError, match="no complete checkpoint under") as info:
        mgr.latest_verified()
    assert expected in str(info.value) and "ckpt.load=false" in str(info.value)
    # Only interrupted saves (.tmp_*) mean no save was ever committed: that is a fresh start.
    fresh = tmp_path / "fresh"
    (fresh / ".tmp_step_1").mkdir(parents=True)
    assert CheckpointManager(fresh).latest_verified() is None


def test_fresh_start_over_existing_checkpoints_is_announced(tmp_path, caplog):
    from hpc_rlhf.ckpt.resume import warn_if_starting_over

    mgr = CheckpointManager(tmp_path, rank=0)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.ckpt.resume"):
        warn_if_starting_over(mgr)
        assert caplog.text == ""  # nothing there: nothing to say
        _save(mgr, 5)
        warn_if_starting_over(CheckpointManager(tmp_path, rank=1))
        assert caplog.text == ""  # rank 0 speaks for all
        warn_if_starting_over(mgr)
    assert f"ckpt.load=false, but {tmp_path} holds 1 checkpoint(s) of an earlier run (newest step_5)" in caplog.text


def test_fallback_warning_is_printed_once_and_reads_well(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, max_num=5)
    _save(mgr, 3)
    newest = _save(mgr, 4)
    (tmp_path / "LATEST").write_text("step_99\n")
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.ckpt.atomic"):
        assert mgr.latest_verified() == newest
    assert caplog.text.count("falling back") == 1
    assert "LATEST names step_99, which is not a complete checkpoint" in caplog.text


def test_full_disk_during_save_names_the_root_and_keeps_the_previous_checkpoint(tmp_path):
    from hpc_rlhf.ckpt import CheckpointSpaceError

    mgr = CheckpointManager(tmp_path / "ckpt")
    previous = _save(mgr, 1)
    with pytest.raises(CheckpointSpaceError, match=f"no space left on {tmp_path / 'ckpt'}") as info:
        with mgr.saving(2) as tmp:
            (tmp / "model.bin").symlink_to("/dev/full")  # the kernel answers every write with ENOSPC
            (tmp / "model.bin").write_bytes(b"weights" * 1000)
    assert f"previous checkpoint {previous} is kept" in str(info.value)
    assert "No space left on device" in str(info.value)  # the original error stays in the message and chain
    assert mgr.latest() == previous and verify_checkpoint(previous) == []


def test_torch_save_on_a_full_filesystem_is_reported_as_out_of_space(tmp_path):
    """torch.save says only "unexpected pos" / "iostream error" on a full disk; a real small tmpfs."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        from hpc_rlhf.ckpt import CheckpointSpaceError

        mgr = CheckpointManager(mount / "ckpt")
        previous = _save(mgr, 1)
        with pytest.raises(CheckpointSpaceError, match=f"no space left on {mount / 'ckpt'}"):
            with mgr.saving(2) as tmp:
                torch.save({"w": torch.zeros(1 << 20)}, tmp / "model.pt")  # 4 MiB into 2 MiB
        assert mgr.latest() == previous
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_rotation_keeps_max_num_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=2)
    for step in (10, 20, 30, 40):
        _save(mgr, step)
    assert [s for s, _ in mgr.list_complete()] == [30, 40]
    assert not (tmp_path / "step_10").exists() and not (tmp_path / "step_20").exists()
    assert mgr.latest_step() == 40
    assert _temp_entries(tmp_path) == []


def test_rotation_never_deletes_latest_target(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=2)
    for step in (50, 60, 70):
        _save(mgr, step)
    # A resume from an older checkpoint saves a lower step than existing ones: LATEST's target must survive
    # even though it is not among the max_num newest by step number.
    _save(mgr, 55)
    assert mgr.latest_step() == 55
    assert [s for s, _ in mgr.list_complete()] == [55, 70]


def test_max_num_none_keeps_all_and_invalid_rejected(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=None)
    for step in range(5):
        _save(mgr, step)
    assert len(mgr.list_complete()) == 5
    with pytest.raises(ValueError, match="max_num"):
        CheckpointManager(tmp_path, max_num=0)


def test_exception_inside_saving_keeps_previous_checkpoint_byte_identical(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=1)
    previous = _save(mgr, 1)
    before = _snapshot(previous)

    with pytest.raises(RuntimeError, match="boom"):
        with mgr.saving(2) as tmp:
            (tmp / "model.bin").write_bytes(b"half")
            raise RuntimeError("boom")

    assert mgr.latest() == previous and (tmp_path / "LATEST").read_text().strip() == "step_1"
    assert _snapshot(previous) == before
    assert not (tmp_path / "step_2").exists()
    assert _temp_entries(tmp_path) == [".tmp_step_2"]  # left for the next save to clean
    _save(mgr, 3)
    assert _temp_entries(tmp_path) == [] and mgr.latest_step() == 3


def test_crash_between_rename_and_latest_update(tmp_path, monkeypatch):
    """LATEST is the commit point: the orphan new step dir is complete, but latest() keeps the previous one."""
    mgr = CheckpointManager(tmp_path, max_num=3)
    previous = _save(mgr, 1)
    before = _snapshot(previous)
    real_replace = os.replace

    def crashing_replace(src, dst):
        if Path(dst).name == "LATEST":
            raise OSError("simulated crash before LATEST moved")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        _save(mgr, 2)
    monkeypatch.setattr(os, "replace", real_replace)

    assert is_complete(tmp_path / "step_2")  # the rename happened
    assert mgr.latest() == previous and _snapshot(previous) == before
    latest = mgr.latest()
    assert latest is not None and is_complete(latest)
    # Re-saving the same step (what a resumed run does) replaces the orphan and moves LATEST.
    _save(mgr, 2, payload=b"second attempt")
    assert mgr.latest_step() == 2 and (tmp_path / "step_2" / "model.bin").read_bytes() == b"second attempt"
    assert _temp_entries(tmp_path) == []


def test_incomplete_step_dir_from_crashed_run_is_replaced_and_never_loaded(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    previous = _save(mgr, 1)
    stale = tmp_path / "step_2"
    stale.mkdir()
    (stale / "garbage.bin").write_bytes(b"x")
    assert mgr.latest() == previous and [s for s, _ in mgr.list_complete()] == [1]

    (tmp_path / "LATEST").write_text("step_2\n")  # pointer to an incomplete dir (e.g. hand-edited)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.ckpt.atomic"):
        assert mgr.latest() == previous
    assert "not a complete checkpoint" in caplog.text

    _save(mgr, 2)
    assert not (tmp_path / "step_2" / "garbage.bin").exists() and mgr.latest_step() == 2


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"step_\n", b"\xff\xfe\x00", b"step_99\n"])
def test_corrupt_latest_falls_back_to_newest_complete_with_warning(tmp_path, caplog, content):
    mgr = CheckpointManager(tmp_path, max_num=5)
    _save(mgr, 3)
    newest = _save(mgr, 4)
    (tmp_path / "LATEST").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.ckpt.atomic"):
        assert mgr.latest() == newest
    assert "falling back" in caplog.text


def test_missing_latest_falls_back_and_empty_root_is_none(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path / "never_created")
    assert mgr.latest() is None and mgr.list_complete() == []
    mgr = CheckpointManager(tmp_path)
    newest = _save(mgr, 5)
    (tmp_path / "LATEST").unlink()
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.ckpt.atomic"):
        assert mgr.latest() == newest
    assert "missing" in caplog.text


def test_tmp_dirs_ignored_by_loading(tmp_path):
    mgr = CheckpointManager(tmp_path)
    (tmp_path / ".tmp_step_9").mkdir()
    (tmp_path / ".tmp_step_9" / "COMPLETE").write_text("{}")  # even a temp dir with a marker is not a checkpoint
    assert mgr.latest() is None and mgr.list_complete() == []


_KILLED_SAVER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    from hpc_rlhf.ckpt import CheckpointManager
    mgr = CheckpointManager({root!r})
    with mgr.saving(2) as tmp:
        with open(tmp / "model.bin", "wb") as f:
            for i in range(64):
                f.write(os.urandom(64 * 1024))
                if i == 20:
                    f.flush()
                    print("MIDWAY", flush=True)
                    os._exit(1)
""")


def test_process_killed_mid_save_keeps_previous_and_next_save_cleans(tmp_path):
    mgr = CheckpointManager(tmp_path)
    previous = _save(mgr, 1, payload=os.urandom(256 * 1024))
    before = _snapshot(previous)

    script = _KILLED_SAVER.format(repo=str(REPO_ROOT), root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "MIDWAY" in proc.stdout, proc.stderr
    leftover = tmp_path / ".tmp_step_2" / "model.bin"
    assert leftover.is_file() and 0 < leftover.stat().st_size < 64 * 64 * 1024

    fresh = CheckpointManager(tmp_path)  # a restarted job
    assert fresh.latest() == previous and _snapshot(previous) == before
    _save(fresh, 2)
    assert _temp_entries(tmp_path) == [] and fresh.latest_step() == 2
    assert (tmp_path / "step_2" / "model.bin").read_bytes() == b"weights 2"


def test_invalid_step_rejected(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="step"):
            with mgr.saving(bad):
                pass


def test_barrier_called_on_entry_after_body_and_after_commit(tmp_path):
    calls = []
    mgr = CheckpointManager(tmp_path, barrier=lambda: calls.append(os.path.exists(tmp_path / "LATEST")))
    with mgr.saving(1) as tmp:
        assert calls == [False]
        (tmp / "x").write_bytes(b"x")
    assert calls == [False, False, True]  # the final barrier runs after LATEST moved


def test_nonzero_rank_commits_nothing_and_requires_shared_dir(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=1, world_size=2, visibility_timeout_s=0.2)
    with pytest.raises(RuntimeError, match="shared"):
        with mgr.saving(1):
            pass
    rank0 = CheckpointManager(tmp_path, rank=0, world_size=2)
    tmp_dir = rank0.tmp_dir(3)
    tmp_dir.mkdir(parents=True)
    with mgr.saving(3) as tmp:
        assert tmp == tmp_dir
        (tmp / "shard1.bin").write_bytes(b"1")
    assert not (tmp_path / "LATEST").exists() and mgr.list_complete() == []


def test_json_helpers_roundtrip_and_leave_no_temp_files(tmp_path):
    state = {"step": 3, "kl_coef": 0.05, "data": {"epoch": 1, "index": 17}}
    save_json_atomic(tmp_path / "state.json", state)
    save_json_atomic(tmp_path / "state.json", {**state, "step": 4})
    assert load_json(tmp_path / "state.json") == {**state, "step": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_json_helper_failure_keeps_old_file(tmp_path):
    save_json_atomic(tmp_path / "state.json", {"step": 1})
    with pytest.raises(TypeError):
        save_json_atomic(tmp_path / "state.json", {"step": object()})
    assert load_json(tmp_path / "state.json") == {"step": 1}


def _draws() -> tuple:
    return (random.random(), random.randint(0, 10**9), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_rng_capture_restore_reproduces_draws():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = capture_rng_state()
    expected = _draws()
    assert _draws() != expected  # the state really advances
    restore_rng_state(state)
    assert _draws() == expected


def test_rank_rng_files_roundtrip(tmp_path):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    for rank in (0, 1):
        _draws()  # different state per "rank"
        save_rank_rng(tmp_path, rank)
    expected_rank1 = _draws()
    load_rank_rng(tmp_path, 0)
    first = _draws()
    load_rank_rng(tmp_path, 1)
    assert _draws() == expected_rank1 and first != expected_rank1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rng_rank0.pt", "rng_rank1.pt"]
    # weights_only-safe: the file loads with the restricted unpickler.
    torch.load(tmp_path / "rng_rank0.pt", weights_only=True)
    with pytest.raises(FileNotFoundError, match="rank 2"):
        load_rank_rng(tmp_path, 2)


def test_ckpt_package_imports_no_torch():
    code = "import sys, hpc_rlhf.ckpt; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "False"
