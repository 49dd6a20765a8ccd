"""What a vLLM engine's workers are told about a weight channel: which backend (NCCL on CUDA, our gloo one
elsewhere), how to join it (``init_weight_transfer_engine``'s ``init_info``) and what each bucket holds
(``update_info``). Pure descriptions: imports no vLLM and opens nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hpc_rlhf.weight_sync.vllm_gloo_transfer import gloo_worker_init_info  # imports no vLLM

# vLLM's packed transfer: two 1 GiB staging buffers on each side (vLLM's defaults).
PACKED_BUFFER_BYTES = 1 << 30
PACKED_NUM_BUFFERS = 2
# Weight-transfer backends: vLLM's NCCL one on CUDA, ours over gloo elsewhere (vllm_gloo_transfer).
TRANSFER_BACKENDS = ("nccl", "gloo")


def transfer_backend(on_gpu: bool) -> str:
    """The weight-transfer backend of engines in processes of their own: ``nccl`` where CUDA is, ``gloo`` where it
    is not (NCCL does not exist on CPU). Both ends of a channel call this with ``torch.cuda.is_available()``."""
    return "nccl" if on_gpu else "gloo"


def worker_init_info(rendezvous: Mapping[str, Any], num_workers: int, backend: str = "nccl") -> dict[str, Any]:
    """``init_info`` of ``init_weight_transfer_engine``: workers take ranks ``1 .. num_workers`` of a
    communicator whose rank 0 is the sending actor rank; ``rendezvous`` is that sender's (its channel's
    ``rendezvous``: the NCCL unique id, or where the gloo group's sealed store is).

    Raises:
        ValueError: an unknown backend, or an NCCL rendezvous through a TCP store (``master_address`` /
            ``master_port``): vLLM's workers unpickle what they read from that plain store, so anyone who reaches
            its port would run code in them. NCCL channels join by unique id only.
    """
    if backend == "gloo":
        return gloo_worker_init_info(rendezvous, num_workers)
    if backend != "nccl":
        raise ValueError(f"unknown weight-transfer backend {backend!r}; choose one of {TRANSFER_BACKENDS}")
    if "master_address" in rendezvous or "master_port" in rendezvous:
        raise ValueError("an NCCL weight channel through a TCP store (master_address / master_port) is refused: "
                         "vLLM's workers unpickle the NCCL id they read from that unauthenticated store, so anyone "
                         "who reaches its port runs code in them. Pass the sender's nccl_unique_id_b64 instead "
                         "(vllm_nccl_transfer.SenderChannel.rendezvous)")
    unique_id = rendezvous.get("nccl_unique_id_b64")
    if not isinstance(unique_id, str) or not unique_id:
        raise ValueError("an NCCL weight channel's rendezvous needs nccl_unique_id_b64 "
                         f"(got keys {sorted(rendezvous)})")
    return {"nccl_unique_id_b64": unique_id, "rank_offset": 1, "world_size": 1 + num_workers, "packed": True,
            "packed_buffer_size_bytes": PACKED_BUFFER_BYTES, "packed_num_buffers": PACKED_NUM_BUFFERS}


def bucket_update_info(bucket: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """``update_info`` announcing one bucket to the workers: names, dtype names, shapes, in send order.
    The tensors may be ``device="meta"``: only their description crosses the control plane."""
    names, dtypes, shapes = [], [], []
    for name, tensor in bucket:
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}
