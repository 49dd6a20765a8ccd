"""The LoRA adapter of a vLLM rollout engine under ``ds.lora.sync=adapter``: both vLLM engines (in-process and
in processes of their own) keep the base weights they loaded once and apply one adapter to every request.

vLLM 0.32's LoRA API takes an adapter only as a folder (``LoRARequest.lora_path``; no in-memory tensors), so each
sync writes the adapter the trainer sent (``hpc_rlhf.models.lora.write_adapter_folder``) into a folder of this
run on node-local storage (``$SLURM_TMPDIR``, else the system temporary directory), then asks vLLM to load it
again under the same id (``add_lora`` with ``load_inplace=True``). Requests carry that id (``load_inplace`` off,
or every scheduling step would reload it): requests in flight during a sync continue under the new adapter, as
under a full weight update. The folder is removed when the engine closes, not when its processes die: a restarted
engine (``vllm_server.VllmServerEngine.restart``) loads the last adapter written there again before it generates
(:class:`AdapterFolderLostError` when something else removed it).

The folder sits in a directory other users can write to (``/tmp``), so every write checks it first: still a
directory of this user's, private (0700, as ``mkdtemp`` made it), not a symbolic link. Where it vanished, a fresh
private folder of another name takes its place; it is never created again under the old name, which another user
could have taken meanwhile (a link to a folder of theirs would receive the adapter, and they could swap it).
Anything else at the old name is refused (:class:`AdapterFolderUnsafeError`).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hpc_rlhf.rollout.vllm_api import resolve

if TYPE_CHECKING:
    import torch

    from hpc_rlhf.config.schema import LoraConfig

# vLLM's ``LoRAConfig.max_lora_rank`` accepts these values only (vLLM 0.32 ``MaxLoRARanks``).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_NAME = "policy"
ADAPTER_ID = 1  # one adapter, loaded again in place at every sync
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what vLLM reads from the folder


log = logging.getLogger(__name__)


class AdapterFolderUnsafeError(RuntimeError):
    """The adapter's folder was replaced by something this run did not make (a link, another user's folder, a
    folder others may write to): writing the adapter there could hand it to another user, who could swap it."""


class AdapterFolderLostError(RuntimeError):
    """A restarted engine cannot get its LoRA adapter back: the node-local folder of the last synced adapter lost
    its files. Only the trainer holds the adapter then; generating without it would sample from another policy."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank`` (``ds.lora.rank``)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"ds.lora.rank={rank}: vLLM serves LoRA adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}; lower "
                     "ds.lora.rank, or set ds.lora.sync=merged")


def lora_engine_kwargs(lora: LoraConfig) -> dict[str, Any]:
    """vLLM engine keywords (``LLM`` / ``AsyncEngineArgs``) of an engine that serves one adapter of ``lora``."""
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora.rank), "max_loras": 1}


def node_local_dir(environ: dict[str, str] | None = None) -> str:
    """Where per-run scratch folders go: ``$SLURM_TMPDIR`` (node-local on most clusters) when set and present,
    else the system temporary directory."""
    environ = dict(os.environ) if environ is None else environ
    slurm_tmp = environ.get("SLURM_TMPDIR")
    return slurm_tmp if slurm_tmp and os.path.isdir(slurm_tmp) else tempfile.gettempdir()


class VllmAdapterSlot:
    """One engine's adapter: the folder vLLM loads it from and the ``LoRARequest`` every request carries.

    ``write`` replaces the folder's adapter (returns its bytes); ``load_request`` asks vLLM to load it again in
    place; ``request`` (None until an adapter was loaded: before the first sync the engine samples from the base,
    which an adapter whose ``lora_B`` starts at zero equals) goes with every generation; ``require_files`` checks
    that a restarted engine can load the folder's adapter again; ``remove`` deletes the folder (idempotent).

    ``written`` counts the adapters written (the folder holds the latest: the one a restarted engine loads, also
    when its predecessor died while loading it); ``loaded`` says that an engine has loaded one."""

    def __init__(self, lora: LoraConfig, parent: str | None = None) -> None:
        self.lora = lora
        self._parent = parent or node_local_dir()
        self.folder = tempfile.mkdtemp(prefix="hpc-rlhf-lora-", dir=self._parent)  # 0700, a name no one had
        self.written = 0
        self.loaded = False

    def _check_folder(self) -> None:
        """Make sure :attr:`folder` is still this user's private directory (see the module docstring): a fresh
        one where it vanished, :class:`AdapterFolderUnsafeError` where something else stands in its place."""
        try:
            info = os.lstat(self.folder)
        except FileNotFoundError:
            lost, self.folder = self.folder, tempfile.mkdtemp(prefix="hpc-rlhf-lora-", dir=self._parent)
            log.warning("the LoRA adapter folder %s vanished; the adapter goes to a fresh private folder %s",
                        lost, self.folder)
            return
        problem = None
        if stat.S_ISLNK(info.st_mode):
            problem = f"is now a symbolic link to {os.readlink(self.folder)!r}"
        elif not stat.S_ISDIR(info.st_mode):
            problem = "is no longer a directory"
        elif info.st_uid != os.getuid():
            problem = f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
        elif info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            problem = f"has mode {stat.filemode(info.st_mode)}; this run made it 0700"
        if problem is not None:
            raise AdapterFolderUnsafeError(
                f"the LoRA adapter folder {self.folder} {problem}: another process replaced it, and the adapter "
                "written there could reach another user, who could swap it. The run stops rather than write it; "
                "check who changed the folder, and set SLURM_TMPDIR to a directory of the job's own")

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        from hpc_rlhf.models.lora import write_adapter_folder  # torch and safetensors: only once an adapter comes

        self._check_folder()
        num_bytes = write_adapter_folder(self.folder, self.lora, named_tensors)
        self.written += 1
        return num_bytes

    def require_files(self, engine_name: str) -> None:
        """Raise :class:`AdapterFolderLostError` naming ``engine_name``, the folder and the missing files when the
        folder no longer holds the last adapter written (a restarted engine could not load it)."""
        missing = [name for name in ADAPTER_FILES if not os.path.isfile(os.path.join(self.folder, name))]
        if missing:
            raise AdapterFolderLostError(
                f"{engine_name} was restarted, but the folder of its LoRA adapter {self.folder} lost "
                f"{', '.join(missing)} (ds.lora.sync=adapter): the last adapter synced to it is gone from this rank, "
                "and generating without it would sample from another policy. Something removed the folder "
                "while the run went on (a cleaner of $SLURM_TMPDIR or of the temporary directory?); keep it for "
                "the run's duration and resume from the last checkpoint (ckpt.load=true)")

    def _request(self, load_inplace: bool) -> Any:
        return resolve("vllm.lora.request:LoRARequest")(lora_name=ADAPTER_NAME, lora_int_id=ADAPTER_ID,
                                                        lora_path=self.folder, load_inplace=load_inplace)

    def load_request(self) -> Any:
        """The request of ``add_lora`` after a ``write``: load the folder again under the same id."""
        return self._request(load_inplace=True)

    @property
    def request(self) -> Any:
        return self._request(load_inplace=False) if self.loaded else None

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
