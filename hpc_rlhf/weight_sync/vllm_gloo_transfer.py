"""The ``gloo`` weight-transfer backend: actor rank -> vLLM engine in processes of its own, without NCCL (CPU).

vLLM's ``nccl`` backend cannot run where there is no NCCL, so on CPU machines ``VllmServerEngine`` asks vLLM for
``WeightTransferConfig(backend="gloo")``, a backend of ours: :mod:`hpc_rlhf.rollout.vllm_plugin` registers
``GlooWeightTransferEngine`` with vLLM's ``WeightTransferEngineFactory`` in every vLLM process (a
``vllm.general_plugins`` entry point), and vLLM builds it inside each of its workers. The rounds are vLLM's
(``start_weight_update`` -> ``update_weights`` per bucket -> ``finish_weight_update``, driven by the engine's
owner); only the transport differs from the ``nccl`` backend.

The group: the sending actor rank is rank 0 and hosts the rendezvous ``TCPStore``; the engine's workers are ranks
``rank_offset .. rank_offset + tp - 1``. Both ends build a ``ProcessGroupGloo`` straight on that store, so neither
side's default process group, nor vLLM's own groups, are touched. The sender binds the store on a port the kernel
picks and keeps it (no gap between choosing a port and binding it for another process to take it), then tells the
engine where it is. The store is sealed with the job's secret (:mod:`hpc_rlhf.world.sealed_store`), which the
rank that starts vLLM's processes hands to them alone (:func:`hpc_rlhf.rollout.vllm_server_launch.server_process_env`),
under a namespace of its own per channel (``channel``, fresh random bytes): another user who reaches the port can
neither read the group's rendezvous nor join it, and a value sealed for one channel does not open in another.

One bucket on the wire: the engine's owner sends ``update_info`` (names, dtype names, shapes; the same fields as
vLLM's NCCL update info, so ``vllm_transfer_info.bucket_update_info`` serves both backends) through vLLM's control
plane; the sender broadcasts the tensors as one flat buffer per dtype (:func:`bucket_layout`: dtypes in order of first
appearance, each dtype's tensors in bucket order), so a bucket costs one broadcast per dtype, not one per tensor.

Loading (every worker): ``start_weight_update`` starts vLLM's layerwise reload, each bucket goes to
``model.load_weights`` (vLLM's loader maps HF names, fuses qkv / gate_up, and the layerwise reload processes a
layer once all its tensors arrived, even when a fused layer's parts come in different buckets of the round),
``finish_weight_update`` finalises the reload, then processes a tied LM head again
(``vllm_external_launcher.refresh_tied_layers``: on CPU it would otherwise keep a packed copy of the old
embedding). A plain second ``load_weights`` outside a reload fails on CPU: vLLM repacks linear weights after
loading.

Imports: this module imports no vLLM when it is imported. The sender side (:class:`GlooSenderChannel`) runs on actor
ranks and the wire format is unit-tested without vLLM, so both live here beside the receiver, one protocol in one
file. The worker-side class must subclass vLLM's ``WeightTransferEngine``; it is therefore built on first access
(PEP 562 module ``__getattr__``) from :class:`GlooWeightTransferReceiver`, which holds all its logic, and vLLM's
base class. vLLM's factory reaches it with ``getattr(module, "GlooWeightTransferEngine")``.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc_rlhf.rollout.vllm_api import resolve
from hpc_rlhf.rollout.vllm_external_launcher import refresh_after_reload  # imports no vLLM
from hpc_rlhf.world.job_secret import held_job_secret
from hpc_rlhf.world.sealed_store import sealed_tcp_store

GLOO_BACKEND = "gloo"
# A broadcast waits this long for its peer. The sender's peer is a worker that may still be pausing the engine or
# processing the previous bucket; a worker's peer is an actor rank that may still be gathering a bucket (ZeRO).
DEFAULT_TIMEOUT_S = 1800.0
_STORE_NAMESPACE = "weight_transfer"
_CHANNEL_ID_BYTES = 16


# ---------------------------------------------------------------------------- payloads (vLLM's dict <-> ours)


@dataclass
class GlooWeightTransferInitInfo:
    """``init_info`` of ``init_weight_transfer_engine`` (vLLM builds it from the dict our engine sends).

    Attributes:
        master_address, master_port: the rendezvous store, hosted by the sender (rank 0).
        channel: this channel's store namespace (hex; fresh per channel, so sealed values do not replay across them).
        rank_offset: group rank of the engine's first worker (1: the sender is the only rank before them).
        world_size: 1 sender + the engine's workers.
        timeout_s: how long a worker's broadcast waits for the sender.
    """

    master_address: str
    master_port: int
    channel: str
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"gloo weight transfer: master_port={self.master_port} is not a TCP port")
        if len(self.channel) < 2 * _CHANNEL_ID_BYTES:
            raise ValueError(f"gloo weight transfer: channel={self.channel!r} is shorter than {2 * _CHANNEL_ID_BYTES} "
                             "hex characters; the sender makes one with secrets.token_hex")
        if self.rank_offset < 1:
            raise ValueError(f"gloo weight transfer: rank_offset={self.rank_offset}; rank 0 is the sender's, "
                             "workers start at 1")
        if self.world_size <= self.rank_offset:
            raise ValueError(f"gloo weight transfer: world_size={self.world_size} leaves no rank for the workers "
                             f"(rank_offset={self.rank_offset})")
        if self.timeout_s <= 0:
            raise ValueError(f"gloo weight transfer: timeout_s={self.timeout_s} must be > 0")


@dataclass
class GlooWeightTransferUpdateInfo:
    """``update_info`` of one bucket: what the sender broadcasts next, in bucket order (``dtypes``: the parsed
    ``dtype_names``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"gloo weight transfer: update_info lists differ in length (names {len(self.names)}, "
                             f"dtype_names {len(self.dtype_names)}, shapes {len(self.shapes)})")
        self.dtypes = [dtype_from_name(dtype_name, name)
                       for name, dtype_name in zip(self.names, self.dtype_names, strict=True)]


def dtype_from_name(dtype_name: str, tensor_name: str) -> torch.dtype:
    """``torch.<dtype_name>`` (``"float32"``, ``"bfloat16"`` ...), refusing names that are not dtypes."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gloo weight transfer: tensor {tensor_name!r} has dtype name {dtype_name!r}, which is not "
                         "a torch dtype")
    return dtype


def gloo_worker_init_info(rendezvous: Mapping[str, Any], num_workers: int,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The ``init_info`` dict of ``init_weight_transfer_engine`` for an engine of ``num_workers`` workers, from the
    sender's :attr:`GlooSenderChannel.rendezvous`."""
    missing = sorted({"master_address", "master_port", "channel"} - set(rendezvous))
    if missing:
        raise ValueError(f"gloo weight transfer: the sender's rendezvous lacks {missing} (got {sorted(rendezvous)})")
    info = GlooWeightTransferInitInfo(str(rendezvous["master_address"]), int(rendezvous["master_port"]),
                                      str(rendezvous["channel"]), rank_offset=1, world_size=1 + num_workers,
                                      timeout_s=timeout_s)
    return dict(vars(info))


# ---------------------------------------------------------------------------- wire format (pure)


def bucket_layout(dtypes: Sequence[torch.dtype]) -> list[tuple[torch.dtype, list[int]]]:
    """How a bucket travels: one flat buffer per dtype, dtypes in order of first appearance, each listing the
    bucket positions of its tensors in bucket order. Sender and workers derive it from the same dtype list."""
    positions: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        positions.setdefault(dtype, []).append(index)
    return list(positions.items())


def pack_by_dtype(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The bucket's flat buffers, in :func:`bucket_layout` order: 1-D CPU tensors of ``sum(numel)`` elements each
    (copies: the sender's tensors are left as they are)."""
    layout = bucket_layout([t.dtype for t in tensors])
    return [torch.cat([tensors[i].detach().reshape(-1).cpu() for i in indices]) for _, indices in layout]


def empty_buffers(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Receive buffers for a bucket of these shapes and dtypes, in :func:`bucket_layout` order."""
    return [torch.empty(sum(_numel(shapes[i]) for i in indices), dtype=dtype)
            for dtype, indices in bucket_layout(dtypes)]


def unpack_by_dtype(buffers: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
                    dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """The bucket's tensors, in bucket order: views of ``buffers`` shaped as ``shapes``."""
    layout = bucket_layout(dtypes)
    if len(buffers) != len(layout):
        raise ValueError(f"gloo weight transfer: {len(buffers)} buffers for {len(layout)} dtypes")
    if len(shapes) != len(dtypes):
        raise ValueError(f"gloo weight transfer: {len(shapes)} shapes for {len(dtypes)} dtypes")
    views: dict[int, torch.Tensor] = {}
    for buffer, (dtype, indices) in zip(buffers, layout, strict=True):
        sizes = [_numel(shapes[i]) for i in indices]
        if buffer.dtype != dtype or buffer.numel() != sum(sizes):
            raise ValueError(f"gloo weight transfer: a {dtype} buffer of {sum(sizes)} elements was expected, got "
                             f"{buffer.dtype} with {buffer.numel()}")
        for i, flat in zip(indices, buffer.split(sizes), strict=True):
            views[i] = flat.view(list(shapes[i]))
    return [views[i] for i in range(len(shapes))]  # the layout places every tensor in one buffer


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(size) for size in shape)  # 1 for a 0-d tensor's []


# ---------------------------------------------------------------------------- the group


class GlooGroup:
    """A gloo group of its own: ``world_size`` ranks meeting at a ``TCPStore`` that rank 0 hosts.

    Built without ``torch.distributed.init_process_group``, so it lives beside any default process group (the
    trainer's world on the sender, vLLM's on the workers). Rank 0 binds the store when made (``master_port`` 0: a
    port the kernel picks, :attr:`port`); :meth:`connect` returns once every rank has joined.

    Raises:
        JobSecretError: this process holds no job secret (``HPC_RLHF_JOB_SECRET``), or not the sender's.
    """

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float,
                 channel: str):
        if not 0 <= rank < world_size:
            raise ValueError(f"gloo weight transfer: rank {rank} outside a group of {world_size}")
        self.timeout = timedelta(seconds=timeout_s)
        # Rank 0 hosts the store and does not wait for the others here: the group's own connection does.
        self.store = sealed_tcp_store(master_address, master_port, rank=rank, world_size=world_size,
                                      secret=held_job_secret(), namespace=f"{_STORE_NAMESPACE}/{channel}",
                                      timeout=self.timeout)
        tcp_store = self.store.underlying_store
        assert isinstance(tcp_store, dist.TCPStore)  # sealed_tcp_store's own: the port the kernel picked for rank 0
        self.port = int(tcp_store.port)
        self.rank, self.world_size = rank, world_size
        self.backend: dist.ProcessGroupGloo | None = None

    def connect(self) -> None:
        self.backend = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, self.timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place on every rank but ``src``; returns once this rank's part is done."""
        if self.backend is None:
            raise RuntimeError("gloo weight transfer: a broadcast before the group was connected")
        options = dist.BroadcastOptions()
        options.rootRank = src
        # torch's stubs leave out Backend.broadcast, which its C++ binding (ProcessGroupGloo) has
        self.backend.broadcast([tensor], options).wait()  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.backend is not None:
            with contextlib.suppress(Exception):  # a peer already gone is not this rank's error
                self.backend.shutdown()


# ---------------------------------------------------------------------------- sender (an actor rank)


class GlooSenderChannel:
    """One engine's group seen from its sending actor rank (rank 0): made (the store bound on ``master_address``,
    :attr:`rendezvous` says where, for the engine's ``open_weight_channel``), then :meth:`connect`, collective with
    the engine's ``init_weight_transfer_engine``, then one :meth:`send` per bucket of every round, in the order the
    engine is told about them."""

    # A broadcast to workers that died fails at once ("Connection closed by peer") and never completes into a peer
    # that did not take the data: the sender can leave a dead engine out of the rest of a round
    # (hpc_rlhf.rollout.weight_round_failure).
    survives_lost_receiver = True

    def __init__(self, num_workers: int, master_address: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S):
        if num_workers < 1:
            raise ValueError(f"GlooSenderChannel: num_workers={num_workers}; an engine has at least one worker")
        channel = secrets.token_hex(_CHANNEL_ID_BYTES)
        self.group = GlooGroup(master_address, 0, rank=0, world_size=1 + num_workers, timeout_s=timeout_s,
                               channel=channel)
        self.rendezvous: dict[str, Any] = {"master_address": master_address, "master_port": self.group.port,
                                           "channel": channel}

    def connect(self) -> None:
        """Returns once the engine's workers joined."""
        self.group.connect()

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket's tensors (any device; copied to CPU), packed by dtype."""
        for buffer in pack_by_dtype([tensor for _, tensor in bucket]):
            self.group.broadcast(buffer, src=0)

    def close(self) -> None:
        self.group.close()


# ---------------------------------------------------------------------------- receiver (each vLLM worker)


def worker_group_rank(parallel_config: Any, rank_offset: int) -> int:
    """This worker's rank in the transfer group: unique over vLLM's data-parallel replicas (as vLLM's NCCL backend
    numbers them), after the ``rank_offset`` sender ranks."""
    per_replica = parallel_config.world_size  # tp * pp workers of one data-parallel replica
    return parallel_config.data_parallel_index * per_replica + parallel_config.rank + rank_offset


class GlooWeightTransferReceiver:
    """All of ``GlooWeightTransferEngine``'s logic (see the module docstring); vLLM's ``WeightTransferEngine``
    base class sets ``model``, ``model_config``, ``parallel_config`` and ``device`` before any call here."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    group: GlooGroup | None = None
    # Set by vLLM's WeightTransferEngine, the base class GlooWeightTransferEngine adds. Any: vLLM objects (the
    # model's load_weights is vLLM's API, not nn.Module's); this module imports no vLLM.
    model: Any
    model_config: Any
    parallel_config: Any
    device: torch.device
    parse_update_info: Callable[[dict[str, Any]], GlooWeightTransferUpdateInfo]

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the sender's group (returns once the sender and every worker of the engine have joined)."""
        rank = worker_group_rank(self.parallel_config, init_info.rank_offset)
        self.group = GlooGroup(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                               init_info.timeout_s, init_info.channel)
        self.group.connect()

    def start_weight_update(self) -> None:
        """Layerwise reload: each layer is restored to checkpoint format, then loaded and processed again once all
        its tensors of this round have arrived."""
        resolve("vllm.model_executor.model_loader.reload:initialize_layerwise_reload")(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One bucket. Unlike vLLM's base class no accelerator is synchronised: gloo returns once the data is in
        host memory, and there may be no accelerator at all."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: update_weights before init_weight_transfer_engine; the sender's "
                               "group must be joined first")
        buffers = empty_buffers(update_info.shapes, update_info.dtypes)
        for buffer in buffers:
            self.group.broadcast(buffer, src=0)
        # Fresh buffers per bucket: the layerwise reload keeps the tensors of a layer until all its parts arrived.
        tensors = unpack_by_dtype(buffers, update_info.shapes, update_info.dtypes)
        # A bucket is a part of the model: vLLM's check that a checkpoint holds every MTP layer must not run on it.
        with resolve("vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check")():
            self.model.load_weights(weights=_on_device(zip(update_info.names, tensors, strict=True), self.device))

    def finish_weight_update(self) -> None:
        """Process every layer of the round; then a tied LM head, which got no tensor of its own."""
        resolve("vllm.model_executor.model_loader.reload:finalize_layerwise_reload")(self.model, self.model_config)
        refresh_after_reload(self.model)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _on_device(named: Iterable[tuple[str, torch.Tensor]], device: Any) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor if tensor.device == torch.device(device) else tensor.to(device)) for name, tensor in named]


def __getattr__(name: str) -> Any:
    """``GlooWeightTransferEngine``, built on first access (it needs vLLM's base class; see the module docstring)."""
    if name != "GlooWeightTransferEngine":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base = resolve("vllm.distributed.weight_transfer.base:WeightTransferEngine")
    engine_cls = type(name, (GlooWeightTransferReceiver, base), {
        "__module__": __name__,
        "__doc__": "vLLM's WeightTransferEngine over a gloo group (GlooWeightTransferReceiver holds the logic).",
    })
    globals()[name] = engine_cls
    return engine_cls
