"""Another user on the node against the LoRA adapter folder of a vLLM engine (``ds.lora.sync=adapter``).

The folder lives in a directory every user may write to (``/tmp``): if it vanishes, another user can put a link or
a folder of theirs under its name, and a writer that re-creates it in place would hand them the adapter (and let
them swap it under the engine). Each test plays that with the real ``VllmAdapterSlot``.
"""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.rollout.vllm_lora import AdapterFolderUnsafeError, VllmAdapterSlot

pytestmark = pytest.mark.security

_TENSORS = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(4, 16)),
            ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(16, 4))]


@pytest.fixture
def slot(tmp_path):
    shared = tmp_path / "tmp"
    shared.mkdir(mode=0o1777)
    slot = VllmAdapterSlot(LoraConfig(rank=4, alpha=8), parent=str(shared))
    slot.write(_TENSORS)
    yield slot
    slot.remove()


def test_a_link_in_place_of_the_folder_receives_nothing(slot, tmp_path):
    theirs = tmp_path / "attacker"
    theirs.mkdir()
    shutil.rmtree(slot.folder)  # the folder vanished (a cleaner, a full disk) ...
    os.symlink(theirs, slot.folder)  # ... and another user took its name
    with pytest.raises(AdapterFolderUnsafeError, match="symbolic link"):
        slot.write(_TENSORS)
    assert list(theirs.iterdir()) == [], "the adapter was written through the link into another user's folder"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_in_its_place_is_refused(slot):
    shutil.rmtree(slot.folder)
    os.mkdir(slot.folder, 0o777)
    os.chown(slot.folder, 12345, 12345)
    with pytest.raises(AdapterFolderUnsafeError, match="uid 12345"):
        slot.write(_TENSORS)
    assert os.listdir(slot.folder) == []


def test_a_vanished_folder_is_replaced_by_a_fresh_private_one(slot):
    lost = slot.folder
    shutil.rmtree(lost)
    slot.write(_TENSORS)
    assert slot.folder != lost and not os.path.exists(lost), "the folder was created again under its old name"
    assert stat.S_IMODE(os.stat(slot.folder).st_mode) == 0o700
    assert sorted(os.listdir(slot.folder)) == ["adapter_config.json", "adapter_model.safetensors"]
